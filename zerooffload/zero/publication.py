"""New compute weights on their way out of one round of updates (a step, a backward, a checkpoint load).

[Note: publication]
The update writes each unit's new compute-dtype weights straight into a *target* (``target``): a
partitioned unit's shard block (stage 3; stored home in the background), a sharded unit's all-gather
input (stages 1–2; the gather is started at once and waited for by ``finish``), else the unit's own
weights; none when the fp32 masters are the weights, or when the shard is read from the masters
(``tiers`` prefix blocks). ``send`` first fills what the update did not write in the shard's
trainable part (unused parameters, padding) from the masters, then sends the weights on. A split
master's target holds the weights before the update (its high half: state_formats' [Note: split
masters]), read from home like frozen values, so nothing is filled from it. Weights that
cross between the update's side and the target's side of the host-device link are counted there
(``LinkStats``).

Frozen values (past the trainable part: optim.state's frozen prefix rule) have no master: the
weights hold them. A step's target covers the trainable part alone, so no shard home is written
past it: a ``SplitShardBlock`` on NVMe has its trainable head read and rewritten, never its frozen
tail. An all-gather input is the exception: its frozen rest is copied from the weights. A round of
loads (``whole_shards``: a checkpoint, pretrained weights) may change frozen values too: its targets
cover whole shards, a shard home on NVMe read first so that values the load leaves alone stay, and
the load writes frozen values into the weights (``frozen_part``).

A round run *off the thread* that issues collectives and frees gathered weights (``off_thread``: the
update worker's, backward_updates' [Note: updates off the autograd thread]) starts no all-gather in
``send``: they start, in the order sent, in ``finish``, which that thread calls (or, for the step's updates
beside the next forward, up to each unit's own as its forward begins: ``start_gathers``); and a split master's
target reads the weights from home, never from a gathered copy that thread may free meanwhile.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Any

import torch

from ..block_stream import STREAM_BUFFERS, BlockWriter
from ..comm import Comm, all_gather
from ..tiers import Block, Kind, LinkStats, Tier
from ..trace import profiled
from .partition import FlatUnit, ParamState
from .shard_blocks import SplitShardBlock
from .unit_layout import Piece

__all__ = ["Publication"]


def _copy_unstepped(target: torch.Tensor, master: torch.Tensor, stepped: list[Piece]) -> None:
    """Copy ``master`` into ``target`` outside the stepped pieces, which the update wrote already:
    frozen and unused parameters' values and the padding."""
    start = 0
    for piece in sorted(stepped, key=lambda p: p.start):
        if piece.start > start:
            target[start:piece.start].copy_(master[start:piece.start])
        start = max(start, piece.stop)
    if start < target.numel():
        target[start:].copy_(master[start:])


class Publication:
    """One round's new weights: their targets, and the stores and all-gathers that send them on."""

    def __init__(self, comm: Comm, device_tier: Tier, host_tier: Tier, link: LinkStats, shards_off_device: bool,
                 whole_shards: bool = False, depth: int = STREAM_BUFFERS, off_thread: bool = False):
        """``shards_off_device``: partitioned units' shards live in host memory or on NVMe;
        ``whole_shards``: a round of loads, which may change frozen values too (see the note);
        ``depth``: host buffers of the shard stores in flight (``aio.blocks_in_flight``);
        ``off_thread``: sends run on the update worker (see the note)."""
        self.comm, self.device_tier, self.link = comm, device_tier, link
        self.shards_off_device = shards_off_device
        self.whole_shards = whole_shards
        self.off_thread = off_thread
        self.writer = BlockWriter(host_tier, depth=depth)
        self._gathers: list[tuple[FlatUnit, torch.Tensor, Any]] = []
        """All-gathers started and not yet waited for: (unit, its input, its work)."""
        self._due: deque[tuple[FlatUnit, torch.Tensor]] = deque()
        """All-gathers sent off the thread, to start in ``finish`` or ``start_gathers``: (unit, its input); the
        worker appends while that thread takes from the other end."""

    def target(self, unit: FlatUnit) -> torch.Tensor | None:
        """Where this rank's new weights of ``unit`` are to be written (None: nowhere, see the note)."""
        trainable, mixed = unit.trainable_numel, unit.trainable_numel < unit.layout.shard_numel
        if unit.partitioned:
            block = unit.param_block
            if unit.master_is_param or not block.writable or not (trainable or self.whole_shards):
                return None
            # read first on NVMe when frozen values share what is written, so that they stay as they are, and
            # for a split master, whose update reads the weights it rewrites
            split = unit.placement.master_split
            gathered = (split and unit.param_state is ParamState.GATHERED and not block.resident
                        and not self.off_thread)
            target = self.writer.begin(self._home(unit), read=(mixed or split) and not gathered and not block.resident)
            if gathered:  # the whole block: a step's head may hold frozen values past the trainable part
                target.copy_(unit.flat_param[unit.shard_range][:target.numel()])
            return target if self.whole_shards else target[:trainable]
        if self._gathered(unit):
            # The all-gather writes this rank's shard too, so its input must not alias the output.
            target = self.device_tier.empty(Kind.BUFFER, unit.layout.shard_numel, unit.compute_dtype)
            if unit.placement.master_split:  # its trainable part: ``send`` copies the rest
                target[:trainable].copy_(unit.flat_param[unit.shard_range][:trainable])
            return target
        return None if unit.master_is_param else unit.flat_param[unit.shard_range][:trainable]

    def in_place(self, unit: FlatUnit) -> bool:
        """Whether ``unit``'s send moves nothing on: no shard store, no all-gather (its target, if any, is
        its own weights)."""
        return not unit.partitioned and not self._gathered(unit)

    def frozen_part(self, unit: FlatUnit) -> torch.Tensor | None:
        """In a round of loads, after ``target``: where this rank's values of ``unit`` past its trainable
        part go (the weights, or the target read from NVMe), in the compute dtype; None when it has none."""
        trainable = unit.trainable_numel
        return None if trainable == unit.layout.shard_numel else unit.shard_weights()[trainable:]

    def send(self, unit: FlatUnit, target: torch.Tensor | None, stepped: list[Piece], updated_on_device: bool
             ) -> None:
        """Complete ``target`` from the masters outside the ``stepped`` pieces and send it on."""
        if target is None:
            return
        with profiled("zerooffload::publish"):
            trainable = unit.trainable_numel
            if not unit.placement.master_split:  # a split master's unstepped weights are in the target already
                _copy_unstepped(target[:trainable], unit.master, stepped)
            self._count(unit, target, updated_on_device)
            if unit.partitioned:
                self.writer.commit(self._home(unit))
            elif self._gathered(unit):
                target[trainable:].copy_(unit.flat_param[unit.shard_range][trainable:])  # frozen: the weights'
                if self.off_thread:
                    self._due.append((unit, target))
                else:
                    self._gather(unit, target)

    def _gather(self, unit: FlatUnit, source: torch.Tensor) -> None:
        self._gathers.append((unit, source, all_gather(self.comm, unit.flat_param, source, async_op=True)))

    def start_gathers(self, until: FlatUnit) -> None:
        """In the thread that issues collectives, once ``until``'s send is done: start the all-gathers sent
        off the thread so far, in the order sent, up to ``until``'s (none when it sent none, so that every
        rank starts the same ones at the same point)."""
        if not any(unit is until for unit, _ in list(self._due)):
            return
        while True:
            unit, source = self._due.popleft()
            self._gather(unit, source)
            if unit is until:
                return

    def wait_gather(self, unit: FlatUnit) -> None:
        """Wait for ``unit``'s all-gather, if one was started and not yet waited for, and free its input."""
        for entry in self._gathers:
            if entry[0] is unit:
                self._gathers.remove(entry)
                entry[2].wait()
                self.device_tier.free(Kind.BUFFER, entry[1])
                return

    def _home(self, unit: FlatUnit) -> Block:
        """The block this round writes of a partitioned unit: its shard home, or in a step only the
        trainable head of one kept in two parts (``SplitShardBlock``)."""
        block = unit.param_block
        return block.head if isinstance(block, SplitShardBlock) and not self.whole_shards else block

    def _gathered(self, unit: FlatUnit) -> bool:
        """Whether ``unit``'s new shards are all-gathered (a sharded unit at stages 1–2)."""
        return not unit.partitioned and unit.layout.shards > 1 and self.comm.world_size > 1

    def _count(self, unit: FlatUnit, target: torch.Tensor, updated_on_device: bool) -> None:
        """The bytes the update's side writes into ``target`` where the link lies between them: the trainable
        part (an all-gather input's frozen rest is copied on the device), or a load's whole shard."""
        target_on_device = not (unit.partitioned and self.shards_off_device)
        written = target.numel() if self.whole_shards else min(target.numel(), unit.trainable_numel)
        nbytes = written * target.element_size()
        if target_on_device and not updated_on_device:
            self.link.host_to_device_bytes += nbytes
        elif updated_on_device and not target_on_device:
            self.link.device_to_host_bytes += nbytes

    def finish(self) -> None:
        """Every store home and every all-gather done (their inputs freed); in the thread that issues
        collectives: the all-gathers sent off it start here."""
        with profiled("zerooffload::publish"):
            while self._due:
                self._gather(*self._due.popleft())
            self.writer.finish()
            for _, source, work in self._gathers:
                work.wait()
                self.device_tier.free(Kind.BUFFER, source)
            self._gathers = []

    def abandon(self) -> None:
        """After a failure: wait for what is in flight, so no buffer is freed under a transfer; the
        first error is the one to see, so this one raises nothing. All-gathers not started are not (the
        peers may not reach theirs): their inputs are freed."""
        for _, source in self._due:
            self.device_tier.free(Kind.BUFFER, source)
        self._due.clear()
        with contextlib.suppress(Exception):
            self.finish()
