"""Gradient reduction: units' gradients averaged over ranks in one fixed order, in buckets.

[Note: reduction order]
Every rank must issue the same collectives in the same order, yet which units finish their backward
first can differ by rank (a parameter unused on one rank's data never reports a gradient there).
So units are reduced in a fixed *order* (blocks last to first, then the root unit: the order backward
usually finishes them), a unit is launched only when it and every unit before it are *ready*, and
units are packed into *buckets* by that order and their sizes alone, never by timing. ``flush`` at
the end launches whatever is left. Ranks thus agree on every bucket, and overlap with backward is
as good as the model's real order allows.

[Note: flags in the payload]
Units updated in backward need, with their reduced shard, each slot's "had a gradient on some rank"
count and whether any rank's gradient was non-finite over the window: their update starts before
the step's control all-reduce. Those *flagged* units' flags travel in the reduce-scatter itself:
every rank's part of the bucket ends with the bucket's flag vector (so every rank's output ends with
the flags summed over ranks: a count above 0 means "somewhere"), and no collective of their own runs
inside autograd. A flagged unit is therefore always staged, never reduced in its own buffer.

A bucket holds small units until its fp32 staging reaches ``zero.bucket_size`` bytes, while a unit of
half that or more is reduced alone, in its own buffer when it is fp32; at most
``MAX_BUCKETS_IN_FLIGHT`` are in flight, so staging memory stays bounded.

[Note: quantized reductions (qgZ)]
Under ``zero.quantized_gradients`` a reduce-scatter runs as comm's ``quantized_reduce_scatter`` (quantize,
all-to-all within the node, sum in fp32, quantize, all-to-all across nodes, sum in fp32) into the same
fp32 output. The flags of the note above are counts that must stay exact (a 4-bit code rounds a 1/N
beside a large gradient to 0, and a non-finite gradient's scale turns its block's zeros to NaN), so
under qgZ they leave the quantized payload and travel in a small fp32 reduce-scatter of their own,
launched with it and landing in the same place of the output (its tail).

Sums run in ``REDUCE_DTYPE`` (fp32) whatever the compute dtype: a bf16 sum over ranks rounds after
every addition, in an order each collective algorithm picks (gloo's ring differs by chunk), which
moved bf16 updates by ~2e-2 at world size 4 in our equivalence tests; in fp32 that noise vanishes.
Gradients are divided by the world size before the sum, so fp16 gradients cannot overflow in it.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from ..block_stream import InFlight
from ..comm import Comm, all_reduce, quantized_reduce_scatter, reduce_scatter
from ..tiers import Kind, Tier
from .partition import FlatUnit

__all__ = ["Mode", "GradReducer", "reduction_order"]

logger = logging.getLogger(__name__)

MAX_BUCKETS_IN_FLIGHT = 2
"""Buckets whose collectives may run at once: one filling while one reduces is enough to overlap."""
REDUCE_DTYPE = torch.float32
"""The dtype gradients are summed in over ranks (see the note)."""


def reduction_order(units: list[FlatUnit]) -> list[FlatUnit]:
    """Block units last to first, then the root unit: the order backward usually completes them.
    Frozen units have no gradient to reduce."""
    trainable = [u for u in units if u.layout.trainable]
    blocks = [u for u in trainable if u.layout.name]
    return blocks[::-1] + [u for u in trainable if not u.layout.name]


class Mode(enum.Enum):
    ALL_REDUCE = "all_reduce"
    """Stage 0: every rank keeps the full averaged gradient."""
    REDUCE_SCATTER = "reduce_scatter"
    """Stages 1–2: every rank keeps the averaged shard it owns."""


class _Completion:
    """A bucket in flight as ``block_stream.InFlight`` waits for it: its collective, then its hand-offs."""

    def __init__(self, complete: Callable[[], None]):
        self.complete = complete

    def wait(self) -> None:
        self.complete()


@dataclass(slots=True)
class _Bucket:
    units: list[FlatUnit] = field(default_factory=list)
    nbytes: int = 0
    work: object = None
    staging: torch.Tensor | None = None
    output: torch.Tensor | None = None
    scratch: torch.Tensor | None = None
    flags: torch.Tensor | None = None
    """The flagged units' flags, end to end (see [Note: flags in the payload])."""
    flag_parts: torch.Tensor | None = None
    """Under qgZ: the flags' own reduce-scatter input, every rank's part this rank's flags ([Note: quantized
    reductions (qgZ)])."""
    flag_work: object = None
    copied: bool = False
    """``staging`` is a copy of the units' gradients (else a lone unit's own buffer, reduced in place)."""


class GradReducer:
    """Launches and completes gradient collectives for a list of units (see [Note: reduction order])."""

    def __init__(self, comm: Comm, units: list[FlatUnit], mode: Mode, bucket_bytes: int, tier: Tier,
                 on_reduced: Callable[[FlatUnit, torch.Tensor, torch.Tensor | None, bool], bool | None] | None = None,
                 flagged: Callable[[FlatUnit], bool] = lambda unit: False):
        """``on_reduced(unit, shard, flags, lent)`` receives each reduced shard (``REDUCE_SCATTER``), in the
        fixed order on every rank, with the unit's flags summed over ranks when ``flagged(unit)`` (each
        slot's "had a gradient" count, then the non-finite count: [Note: flags in the payload]), else
        None; by default the shard is added to the unit's gradient shard. The shard is the reducer's once
        the call returns, unless it is ``lent`` (the unit's own full gradient, at world size 1) and the call
        returns True: then the receiver keeps it and releases it (``FlatUnit.release_flat_grad``)."""
        self.comm = comm
        self.quantized_bits = max((unit.placement.gradient_bits for unit in units), default=0)
        """8 or 4 under qgZ (the placements', the same for every unit: [Note: quantized reductions (qgZ)]); 0: fp32."""
        self.on_reduced = on_reduced or (lambda unit, shard, flags, lent: unit.add_grad_shard(shard, tier))
        self.flagged = flagged
        self.order = units
        self.mode = mode
        self.bucket_bytes = bucket_bytes
        self.tier = tier
        self._position = {u.index: position for position, u in enumerate(units)}
        """Each unit's position in the fixed order, by ``unit.index``."""
        self._ready = [False] * len(units)
        self._next = 0
        self._filling = _Bucket()
        self._in_flight = InFlight(MAX_BUCKETS_IN_FLIGHT)
        """Buckets whose collective runs: waited for oldest first, each handing its shards off, then freed."""
        self._warned_order = False

    def mark_ready(self, unit: FlatUnit) -> None:
        """``unit``'s gradients for this pass are complete; launch what the fixed order now allows."""
        position = self._position[unit.index]
        self._ready[position] = True
        if position > self._next and not self._warned_order:
            self._warned_order = True
            waiting = self.order[self._next].layout.name or "<root>"
            logger.warning("unit %r finished its backward before unit %r, which the reduction order puts first: "
                           "its gradients wait, holding more memory than the memory plan counts (it assumes "
                           "backward finishes blocks last to first). A parameter of %r unused in forward, or "
                           "blocks run in another order than registered, does this", unit.layout.name or "<root>",
                           waiting, waiting)
        while self._next < len(self.order) and self._ready[self._next]:
            self._add(self.order[self._next])
            self._next += 1

    def flush(self) -> None:
        """Launch every unit not yet launched, wait for all collectives, and reset for the next pass."""
        for unit in self.order[self._next:]:
            self._add(unit)
        self._launch()
        self._in_flight.drain()
        self._ready = [False] * len(self.order)
        self._next = 0

    def _add(self, unit: FlatUnit) -> None:
        unit.begin_reduction(self.tier)  # zeros when this rank had none: the peers may have some
        if self.comm.world_size == 1:  # nothing to sum: no staging, no collective
            if self.mode is Mode.REDUCE_SCATTER:
                flags = self._local_flags(unit) if self.flagged(unit) else None
                if not self.on_reduced(unit, unit.flat_grad, flags, True):
                    unit.release_flat_grad(self.tier)
            else:
                unit.reduced_in_place()
            return
        nbytes = unit.layout.padded_numel * REDUCE_DTYPE.itemsize
        alone = nbytes >= self.bucket_bytes // 2
        if alone:
            self._launch()  # a large unit goes alone, reduced in place: staging it would only copy
        self._filling.units.append(unit)
        self._filling.nbytes += nbytes
        if alone or self._filling.nbytes >= self.bucket_bytes:
            self._launch()

    def _launch(self) -> None:
        bucket, self._filling = self._filling, _Bucket()
        if not bucket.units:
            return
        self._in_flight.make_room()
        bucket.staging = self._staged(bucket)
        bucket.copied = bucket.staging is not bucket.units[0].flat_grad
        if self.mode is Mode.ALL_REDUCE:
            bucket.work = all_reduce(self.comm, bucket.staging, async_op=True)
        else:
            shard_total = sum(u.layout.shard_numel for u in bucket.units)
            shard_total += 0 if bucket.flags is None else bucket.flags.numel()
            bucket.output = self.tier.empty(Kind.BUFFER, shard_total, REDUCE_DTYPE)
            if self.quantized_bits:
                self._reduce_quantized(bucket)
            else:
                if self.comm.direct_exchange:  # the peers' parts land here (comm's [Note: direct exchange on gloo])
                    bucket.scratch = self.tier.empty(Kind.BUFFER, (self.comm.world_size - 1) * shard_total,
                                                     REDUCE_DTYPE)
                bucket.work = reduce_scatter(self.comm, bucket.output, bucket.staging, scratch=bucket.scratch,
                                             async_op=True)
        self._in_flight.add(_Completion(partial(self._complete, bucket)), item=bucket,
                            release=partial(self._free, bucket))

    def _reduce_quantized(self, bucket: _Bucket) -> None:
        """qgZ: the gradients through the quantized reduce-scatter, the flags beside it in fp32, into the
        output's tail ([Note: quantized reductions (qgZ)])."""
        grads = bucket.output.numel() - (0 if bucket.flags is None else bucket.flags.numel())
        bucket.work = quantized_reduce_scatter(self.comm, bucket.output[:grads], bucket.staging,
                                               bits=self.quantized_bits, async_op=True)
        if bucket.flags is not None:
            bucket.flag_parts = bucket.flags.div(self.comm.world_size).repeat(self.comm.world_size)
            bucket.flag_work = reduce_scatter(self.comm, bucket.output[grads:], bucket.flag_parts, async_op=True)

    def _staged(self, bucket: _Bucket) -> torch.Tensor:
        """The collective's input in REDUCE_DTYPE, divided by the world size.

        A lone fp32 unit is reduced in its own buffer; otherwise units are copied into one staging
        buffer, for reduce-scatter interleaved rank by rank so that rank r's output is every unit's
        shard r end to end.
        """
        units = bucket.units
        if self.mode is Mode.REDUCE_SCATTER and any(self.flagged(u) for u in units):
            bucket.flags = torch.cat([self._local_flags(u) for u in units if self.flagged(u)]).to(
                REDUCE_DTYPE).to(self.tier.device)
        payload_flags = bucket.flags is not None and not self.quantized_bits  # qgZ sends them apart
        if len(units) == 1 and units[0].flat_grad.dtype == REDUCE_DTYPE and not payload_flags:
            staging = units[0].flat_grad
        else:
            if self.mode is Mode.ALL_REDUCE:
                parts = [u.flat_grad for u in units]
            else:
                rows = [u.flat_grad.view(u.layout.shards, -1) for u in units]
                tail = [bucket.flags] if payload_flags else []
                parts = [part for rank in range(units[0].layout.shards) for part in [*(r[rank] for r in rows), *tail]]
            staging = self.tier.empty(Kind.BUFFER, sum(p.numel() for p in parts), REDUCE_DTYPE)
            offset = 0
            for part in parts:
                staging[offset:offset + part.numel()].copy_(part)
                offset += part.numel()
        if self.comm.world_size > 1:
            staging.div_(self.comm.world_size)
        return staging

    @staticmethod
    def _local_flags(unit: FlatUnit) -> torch.Tensor:
        """This rank's flags of ``unit``: each slot had a gradient in the window (1/0), then whether a
        gradient of this window was non-finite here (``FlatUnit.note_nonfinite``)."""
        return torch.tensor([*unit.has_grad, 1.0 if unit.note_nonfinite() else 0.0], dtype=torch.float64)

    def _complete(self, bucket: _Bucket) -> None:
        """Wait for ``bucket``'s collective and hand each unit's result off (``on_reduced``)."""
        for work in (bucket.work, bucket.flag_work):
            if work is not None:
                work.wait()
        offset = 0
        flag_offset = sum(u.layout.shard_numel for u in bucket.units)
        for unit in bucket.units:
            if self.mode is Mode.ALL_REDUCE:
                if bucket.copied:
                    unit.flat_grad.copy_(bucket.staging[offset:offset + unit.layout.padded_numel])
                unit.reduced_in_place()
                offset += unit.layout.padded_numel
            else:
                flags = None
                if bucket.flags is not None and self.flagged(unit):
                    count = len(unit.layout.slots) + 1
                    flags = bucket.output[flag_offset:flag_offset + count].double().cpu()
                    flag_offset += count
                self.on_reduced(unit, bucket.output[offset:offset + unit.layout.shard_numel], flags, False)
                offset += unit.layout.shard_numel
                unit.release_flat_grad(self.tier)

    def _free(self, bucket: _Bucket) -> None:
        """Give ``bucket``'s buffers back, however its collective ended."""
        self.tier.free(Kind.BUFFER, bucket.output)
        self.tier.free(Kind.BUFFER, bucket.scratch)
        if bucket.copied:
            self.tier.free(Kind.BUFFER, bucket.staging)
