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

import torch

from ..tiers import Kind, Tier
from ..zero.partition import FlatUnit
from ..zero.shard_blocks import span_block
from ..zero.unit_layout import Piece

__all__ = ["UnitOptimizerState", "MOMENT_DTYPES", "state_bytes"]

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``optimizer.moments``' dtypes."""


def state_bytes(moments: int, moment_dtype: str, master: bool) -> int:
    """Bytes of optimizer state per trainable element: the fp32 master (unless it is the weights
    themselves) and ``moments`` moments of ``moment_dtype``."""
    return 4 * master + moments * MOMENT_DTYPES[moment_dtype].itemsize


def _point(tensor: torch.Tensor, source: torch.Tensor | None, start: int = 0, stop: int = 0) -> None:
    """Make ``tensor`` the view ``source[start:stop]`` (or empty when ``source`` is None), in place."""
    if source is None:
        tensor.set_()
    else:
        tensor.set_(source.untyped_storage(), source.storage_offset() + start, (stop - start,), (1,))


class UnitOptimizerState:
    """One unit shard's optimizer block and the optimizer pieces that live in it."""

    def __init__(self, unit: FlatUnit, tier: Tier, moment_names: tuple[str, ...], key: str,
                 moment_dtype: torch.dtype = torch.float32):
        self.unit = unit
        self.tier = tier
        self.moment_names = moment_names
        self.moment_dtype = moment_dtype
        self.has_master = not unit.master_is_param
        span = unit.trainable_span
        self._parts = [torch.float32] * self.has_master + [moment_dtype] * len(moment_names)
        nbytes = span * sum(dtype.itemsize for dtype in self._parts)
        unit_bytes = min((dtype.itemsize for dtype in self._parts), default=4)  # digests: per part, or per half
        self.block = span_block(tier, Kind.OPTIMIZER, key, max(nbytes, span * 4), torch.uint8,
                                aside=unit.placement.updates_tentatively,
                                segments=max(1, nbytes // (span * unit_bytes)) if span else 1)
        self.pieces: list[tuple[Piece, torch.Tensor]] = []

    def _part(self, index: int) -> torch.Tensor:
        """Part ``index``'s values: the trainable part (its span's rest is alignment padding)."""
        start = self.unit.trainable_span * sum(dtype.itemsize for dtype in self._parts[:index])
        dtype = self._parts[index]
        return self.block.data[start:start + self.unit.trainable_numel * dtype.itemsize].view(dtype)

    def master(self) -> torch.Tensor:
        """This rank's fp32 master over the shard's trainable part (valid while the block is loaded)."""
        return self._part(0) if self.has_master else self.unit.master

    def moment(self, name: str) -> torch.Tensor:
        return self._part(self.has_master + self.moment_names.index(name))

    def initialize(self, shard_fp32: torch.Tensor) -> None:
        """First values of a loaded block: the master from this rank's fp32 shard, moments (and the
        padding) zero."""
        self.block.data.zero_()
        if self.has_master:
            self.master().copy_(shard_fp32[:self.unit.trainable_numel])

    def add_piece(self, piece: Piece) -> torch.Tensor:
        """A new optimizer param for ``piece``: an fp32 tensor object pointed into the block when loaded."""
        tensor = torch.empty(0, dtype=torch.float32, device=self.block.data.device if self.block.resident
                             else torch.device("cpu"))
        self.pieces.append((piece, tensor))
        return tensor

    def point(self, optimizer: torch.optim.Optimizer) -> None:
        """Point the pieces, their moments and ``unit.master`` into the loaded block."""
        master = self.master()
        self.unit.set_master(master)
        for piece, tensor in self.pieces:
            _point(tensor, master, piece.start, piece.stop)
            state = optimizer.state[tensor]
            for name in self.moment_names:
                _point(state[name], self.moment(name), piece.start, piece.stop)

    def unpoint(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a block that is not resident unloads: empty every view of it."""
        self.unit.set_master(None)
        for _, tensor in self.pieces:
            _point(tensor, None)
            for name in self.moment_names:
                _point(optimizer.state[tensor][name], None)
