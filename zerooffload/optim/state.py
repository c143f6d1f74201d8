"""Each unit shard's optimizer state as one block on the optimizer tier, and the pieces pointed into it.

[Note: optimizer blocks]
- A unit's *optimizer block* holds ``[master | moment_1 | moment_2 ...]`` over this rank's shard's
  *trainable part* (unit_layout's [Note: unit vocabulary]), one segment each, sized to its span
  (rounded up to ``ALIGN_ELEMENTS`` for O_DIRECT): the master in fp32, the moments in
  ``optimizer.moments``' dtype (``state_formats``' [Note: bf16 moments]); the master is left out when
  it is a view of fp32 weights already (``placement.UnitPlacement.master_is_param``). The block is
  bytes; each part is a view of its own dtype into them. The block's home is
  ``offload.optimizer.tier``: device or host memory, or a swap file on NVMe paged through host
  buffers (``block_stream.stream_blocks``).
- *Frozen prefix rule*: trainable parameters come first in a unit, so a shard's trainable part is
  its first ``t`` elements, and everything past them is frozen (or padding) and held by the compute
  weights alone: no master, no moments, no gradient kept for the step, and never written by a step
  (``publication``'s note). A unit without frozen parameters is trainable over its whole shard, as
  before; a frozen shard has no trainable part and gets an empty resident block, which streams skip
  at no cost, and a frozen unit is never reduced or updated. Whatever needs the whole shard in fp32
  (``full_state_dict``, checkpoints, which keep one format) takes the master over the trainable part
  and the weights past it.
- The torch optimizer sees *pieces* (``optimizer.py``), and per piece the moment tensors in its state.
  These tensor objects live as long as the engine (torch keys its state by them) but their memory
  is *pointed* into the block whenever it is loaded, and *unpointed* (made empty) when a block that is
  not resident is unloaded, so no stale view keeps a host buffer alive.
"""
from __future__ import annotations

import itertools

import torch

from ..tiers import Kind, Tier
from .state_formats import (INT8_BLOCK, decode_int8, encode_int8, int8_blocks, join_master, read_bits, split_master,
                            write_bits)
from ..zero.partition import FlatUnit
from ..zero.shard_blocks import span_block
from ..zero.unit_layout import Piece

__all__ = ["UnitOptimizerState", "MOMENT_DTYPES", "state_bytes"]

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
"""``optimizer.moments``' dtypes (int8: the codes; their scales are fp32)."""

_NEAREST = 0x8000
"""Rounding noise that rounds int8 codes to nearest: values set from outside the step (checkpoints)
take the code they decoded from, so a save and load gives the same codes back."""


def _master_parts(master: str | None, span: int) -> list[tuple[torch.dtype, int]]:
    """The master's parts in an optimizer block over ``span`` elements: (dtype, bytes)."""
    if master is None:
        return []
    if master == "split":  # the residual bits: one per element, span a multiple of 8 (ALIGN_ELEMENTS)
        return [(torch.int16, 2 * span), (torch.uint8, span // 8)]
    return [(torch.float32, 4 * span)]


def _moment_parts(moments: int, moment_dtype: str, span: int, pieces: int) -> list[tuple[torch.dtype, int]]:
    """The moments' parts over ``span`` elements in ``pieces`` pieces: (dtype, bytes); int8 moments' scales
    are sized for the most blocks so many pieces can have (each starts a block), 16-byte aligned."""
    dtype = MOMENT_DTYPES[moment_dtype]
    parts = [(dtype, span * dtype.itemsize)] * moments
    if moment_dtype == "int8":
        parts += [(torch.float32, -(-4 * (span // INT8_BLOCK + pieces) // 16) * 16)] * moments
    return parts


def state_bytes(numel: int, moments: int, moment_dtype: str, master: str | None, pieces: int = 1) -> int:
    """Bytes of optimizer state over ``numel`` elements (a multiple of 8) in at most ``pieces`` pieces: the
    master (None: it is the weights themselves; "fp32" or "split") and ``moments`` moments of
    ``moment_dtype``."""
    parts = _master_parts(master, numel) + _moment_parts(moments, moment_dtype, numel, pieces)
    return sum(n for _, n in parts)


def _point(tensor: torch.Tensor, source: torch.Tensor | None, start: int = 0, stop: int = 0) -> None:
    """Make ``tensor`` the view ``source[start:stop]`` (or empty when ``source`` is None), in place."""
    if source is None:
        tensor.set_()
    else:
        tensor.set_(source.untyped_storage(), source.storage_offset() + start, (stop - start,), (1,))


class UnitOptimizerState:
    """One unit shard's optimizer block and the optimizer pieces that live in it."""

    def __init__(self, unit: FlatUnit, tier: Tier, moment_names: tuple[str, ...], key: str,
                 moment_format: str = "fp32"):
        self.unit = unit
        self.tier = tier
        self.moment_names = moment_names
        self.moment_dtype = MOMENT_DTYPES[moment_format]
        self.int8 = moment_format == "int8"
        self.has_master = not unit.master_is_param
        self.split = unit.placement.master_split
        span = unit.trainable_span
        trainable = [p for p in unit.pieces if unit.layout.slots[p.slot_index].trainable]
        self._first_scale = dict(zip(trainable, [0, *itertools.accumulate(int8_blocks(p.stop - p.start)
                                                                           for p in trainable)]))
        """Each trainable piece's first scale in an int8 moment's scales."""
        self._parts = (_master_parts(unit.placement.master_format, span)
                       + _moment_parts(len(moment_names), moment_format, span, len(trainable)))
        nbytes = sum(n for _, n in self._parts)
        # digests per part (or per half part: bf16 moments beside an fp32 master; per int8 moment's codes, its
        # scales a last short segment), so an fp32 master alone reads as its own segments; a split block's whole
        unit_bytes = min((dtype.itemsize for dtype, _ in self._parts), default=4)
        self.block = span_block(tier, Kind.OPTIMIZER, key, nbytes or span * 4, torch.uint8,
                                aside=unit.placement.updates_tentatively,
                                segment=0 if self.split else span * unit_bytes)
        self.pieces: list[tuple[Piece, torch.Tensor]] = []
        self._master: torch.Tensor | None = None
        """A split master unpacked (``unpack_master``), until ``pack_master``."""
        self._moments: dict[str, torch.Tensor] | None = None
        """int8 moments unpacked (``unpack_moments``), until ``pack_moments``."""
        self._kept: set[tuple[str, Piece]] = set()
        """(moment, piece) of int8 codes stored as they are (``keep_int8``), until ``pack_moments``."""

    def _part(self, index: int) -> torch.Tensor:
        """Part ``index``'s values: the trainable part (its span's rest is alignment padding); all the
        residual bits' bytes."""
        start = sum(n for _, n in self._parts[:index])
        dtype, nbytes = self._parts[index]
        if dtype == torch.uint8:
            return self.block.data[start:start + nbytes]
        return self.block.data[start:start + self.unit.trainable_numel * dtype.itemsize].view(dtype)

    def master(self) -> torch.Tensor:
        """This rank's fp32 master over the shard's trainable part (valid while the block is loaded; a
        split one between ``unpack_master`` and ``pack_master``)."""
        if self.split:
            if self._master is None:
                raise RuntimeError(f"unit {self.unit.name!r}: its split master is not unpacked")
            return self._master
        return self._part(0) if self.has_master else self.unit.master

    def residual(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A split master's residuals and the bytes of their bits (bit ``i`` for element ``i``)."""
        return self._part(0), self._part(1)

    def unpack_master(self, weights: torch.Tensor) -> None:
        """A split master joined from ``weights`` (the trainable part's, compute dtype) for ``master()``."""
        if self.split:
            residual, bits = self.residual()
            self._master = join_master(weights, residual, read_bits(bits, 0, residual.numel()))

    def pack_master(self, weights: torch.Tensor) -> None:
        """A split master's values as they are now in ``master()`` split into ``weights`` and the block."""
        if self.split:
            weight, residual, bits = split_master(self.master())
            weights.copy_(weight)
            self._part(0).copy_(residual)
            write_bits(self._part(1), 0, bits)
            self._master = None

    def drop_master(self) -> None:
        """Forget an unpacked split master unchanged."""
        self._master = None

    def clear_residual(self, changed: torch.Tensor) -> None:
        """A split master whose weights changed where ``changed`` (bools) holds them exactly there."""
        residual, bits = self.residual()
        residual[changed] = 0
        write_bits(bits, 0, read_bits(bits, 0, residual.numel()) & ~changed)

    def _moment_part(self, name: str, scales: bool = False) -> torch.Tensor:
        """A moment's part as stored (int8: its codes, or with ``scales`` its scales)."""
        count = len(self.moment_names) * (2 if self.int8 else 1)
        return self._part(len(self._parts) - count + self.moment_names.index(name)
                          + (len(self.moment_names) if scales else 0))

    def moment(self, name: str) -> torch.Tensor:
        """A moment over the trainable part, as it is stored; int8 moments as fp32 values between
        ``unpack_moments`` and ``pack_moments``."""
        if not self.int8:
            return self._moment_part(name)
        if self._moments is None:
            raise RuntimeError(f"unit {self.unit.name!r}: its int8 moments are not unpacked")
        return self._moments[name]

    def _piece_scales(self, name: str, piece: Piece) -> torch.Tensor:
        first = self._first_scale[piece]
        return self._moment_part(name, scales=True)[first:first + int8_blocks(piece.stop - piece.start)]

    def stored_moment(self, name: str) -> list[torch.Tensor]:
        """A moment over the trainable part as the block holds it (for checkpoints): its values, and an
        int8 moment's codes and then its pieces' scales, in piece order."""
        if not self.int8:
            return [self._moment_part(name)]
        scales = sum(int8_blocks(p.stop - p.start) for p in self._first_scale)
        return [self._moment_part(name), self._moment_part(name, scales=True)[:scales]]

    def unpack_moments(self, decode: bool = True) -> None:
        """int8 moments as fp32 values for ``moment()`` (zeros without ``decode``: they will be overwritten,
        and so are the codes and scales, so that the padding after the last piece is zero, as a step leaves it)."""
        if not self.int8:
            return
        self._moments = {}
        for index, name in enumerate(self.moment_names):
            if not decode:
                self._moment_part(name).zero_()
                self._moment_part(name, scales=True).zero_()
            values = torch.zeros(self.unit.trainable_numel, dtype=torch.float32)
            for piece in self._first_scale if decode else ():
                values[piece.start:piece.stop] = decode_int8(self._moment_part(name)[piece.start:piece.stop],
                                                             self._piece_scales(name, piece), signed=index == 0)
            self._moments[name] = values

    def keep_int8(self, name: str, piece: Piece, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Store an int8 moment's codes and scales of ``piece`` as they are (a checkpoint's, cut in the same
        blocks), between ``unpack_moments`` and ``pack_moments``, which then leaves them as they are."""
        self._moment_part(name)[piece.start:piece.start + codes.numel()] = codes
        self._piece_scales(name, piece).copy_(scales)
        self._kept.add((name, piece))

    def pack_moments(self) -> None:
        """Unpacked int8 moments as they are now in ``moment()`` encoded into the block, rounded to nearest
        (but the pieces stored as they are by ``keep_int8``)."""
        if not self.int8:
            return
        kept, self._kept = self._kept, set()
        for index, name in enumerate(self.moment_names):
            for piece in self._first_scale:
                if (name, piece) in kept:
                    continue
                values = self._moments[name][piece.start:piece.stop]
                codes, scales = encode_int8(values, torch.tensor(_NEAREST).expand(values.numel()), signed=index == 0)
                self._moment_part(name)[piece.start:piece.stop] = codes
                self._piece_scales(name, piece).copy_(scales)
        self._moments = None

    def drop_moments(self) -> None:
        """Forget unpacked int8 moments unchanged."""
        self._moments, self._kept = None, set()

    def initialize(self, shard_fp32: torch.Tensor) -> None:
        """First values of a loaded block: the master from this rank's fp32 shard (a split one's residual:
        the weights are that shard cast), moments (and the padding) zero."""
        self.block.data.zero_()
        values = shard_fp32[:self.unit.trainable_numel]
        if self.split:
            _, residual, bits = split_master(values.cpu())
            self._part(0).copy_(residual)
            write_bits(self._part(1), 0, bits)
        elif self.has_master:
            self.master().copy_(values)

    def add_piece(self, piece: Piece) -> torch.Tensor:
        """A new optimizer param for ``piece``: a tensor object pointed into the block when loaded (fp32
        master values, or a split master's residuals)."""
        tensor = torch.empty(0, dtype=torch.int16 if self.split else torch.float32,
                             device=self.block.data.device if self.block.resident else torch.device("cpu"))
        self.pieces.append((piece, tensor))
        return tensor

    def point(self, optimizer: torch.optim.Optimizer) -> None:
        """Point the pieces, their moments and ``unit.master`` into the loaded block (a split master's
        pieces at their residuals, their state at the residual bits)."""
        if self.split:
            master, bits = self.residual()
        else:
            master = self.master()
            self.unit.set_master(master)
        moments = {name: self._moment_part(name) for name in self.moment_names}
        for piece, tensor in self.pieces:
            _point(tensor, master, piece.start, piece.stop)
            state = optimizer.state[tensor]
            for name, moment in moments.items():
                _point(state[name], moment, piece.start, piece.stop)
                if self.int8:
                    state[f"{name}_scale"] = self._piece_scales(name, piece)
            if self.split:
                state["residual_bits"], state["residual_bit0"] = bits, piece.start

    def unpoint(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a block that is not resident unloads: empty every view of it."""
        self.unit.set_master(None)
        for _, tensor in self.pieces:
            _point(tensor, None)
            state = optimizer.state[tensor]
            for name in self.moment_names:
                _point(state[name], None)
                state.pop(f"{name}_scale", None)
            state.pop("residual_bits", None)
