"""The sharded training state: every unit's flat tensors on their tiers, its optimizer block, the optimizer.

``ShardedState`` is built once from a ``Placement`` ([Note: placement]): unit by unit, rank 0's values
are broadcast (as DDP does), flattened onto their tiers, and the unit's optimizer block written (the
values come from ``values``: the eager model's weights, or a lazily built model's, made unit by unit
by its construction layer, ``lazy_init``, which this layer does not import). Afterwards it pages the
optimizer blocks in for whoever works on them (``visit``): the step, updates in backward, state dicts
and checkpoints.
"""
from __future__ import annotations

import zlib
from typing import Callable, Iterator

import torch
from torch import nn

from ..block_stream import BlockReader, BlockWriter, grad_read_depth, stream_blocks, stream_depth, write_block
from ..comm import Comm, broadcast
from ..config import Config
from ..optim import ZeroOptimizer, moment_names
from ..optim.state import UnitOptimizerState
from ..param_groups import normalize_param_groups
from ..tiers import Block, Kind, LinkStats, Tier
from .offloaded_grads import OffloadedGrad
from .partition import FlatUnit
from .placement import Placement
from .shard_blocks import SplitShardBlock, span_block
from .unit_layout import UnitLayout

__all__ = ["ShardedState", "Values", "eager_values", "make_units"]

Values = Callable[[list[FlatUnit]], Iterator[tuple[FlatUnit, torch.Tensor]]]
"""Where a state's first values come from: (unit, its flat padded fp32 values) for each unit, in turn."""


def eager_values(units: list[FlatUnit]) -> Iterator[tuple[FlatUnit, torch.Tensor]]:
    """The ``Values`` of a model built eagerly: its parameters already hold them."""
    return ((unit, unit.full_fp32()) for unit in units)


def make_units(layouts: list[UnitLayout], placement: Placement, rank: int, compute_dtype: torch.dtype
               ) -> list[FlatUnit]:
    """One ``FlatUnit`` per layout, as placed; nothing is allocated yet."""
    return [FlatUnit(layout, place, rank, compute_dtype) for layout, place in zip(layouts, placement.units)]


class ShardedState:
    """Units, their optimizer states and the optimizer over this rank's master pieces."""

    def __init__(self, module: nn.Module, config: Config, comm: Comm, units: list[FlatUnit], placement: Placement,
                 tiers: dict[str, Tier], link: LinkStats, param_groups: list[dict] | None, values: Values):
        self.module = module
        self.config = config
        self.comm = comm
        self.units = units
        self.placement = placement
        self.tiers = tiers
        self.link = link
        self.compute = tiers[placement.compute]
        """The tier the compute runs in."""
        self.staging = tiers[placement.staging]
        """The memory blocks that are not addressable pass through."""
        self.depth = stream_depth(config.aio)
        """Host buffers of each block stream and writer (``aio.blocks_in_flight``)."""
        self.grad_writer = BlockWriter(self.staging, depth=self.depth)  # offloaded gradient shards on their way home
        self.grad_reader = BlockReader(self.staging, depth=grad_read_depth(config.aio))  # and back, read ahead
        self.opt_states = self._materialize(values)
        self.optimizer = ZeroOptimizer(self._groups(param_groups), config.optimizer)
        self._attach_optimizer_state()

    def update_tier(self, state: UnitOptimizerState) -> Tier:
        """Where a unit's update runs (its placement's ``update_on``)."""
        return self.tiers[state.unit.placement.update_on]

    # ------------------------------------------------------------------ construction
    def _param_block(self, index: int) -> Block:
        """A partitioned unit's shard home (``Kind.PARAM`` on its ``param_home``); with params in masters
        the block's master segment instead, which holds the same values and which the update writes
        anyway: no second copy to write each step (placement leaves out units with frozen values, which
        the master does not hold). Off the addressable tiers, a shard whose trainable span is followed by frozen
        values is two blocks, so that steps write the span alone."""
        unit = self.units[index]
        place = unit.placement
        size, span = unit.layout.shard_numel, unit.trainable_span
        if place.params_in_masters:  # the master is the block's first segment
            return self.tiers[place.optimizer].prefix_block(f"optimizer.{index}", size, torch.float32)
        home = self.tiers[place.param_home]
        if home.resident or span in (0, size):
            return home.block(Kind.PARAM, f"param.{index}", size, unit.compute_dtype)
        return SplitShardBlock(home.block(Kind.PARAM, f"param.{index}", span, unit.compute_dtype),
                               home.block(Kind.PARAM, f"param.{index}.frozen", size - span, unit.compute_dtype))

    def _materialize(self, values: Values) -> list[UnitOptimizerState]:
        """Unit by unit: values broadcast, flattened onto their tiers, optimizer block written; returns
        the optimizer states in unit order."""
        states: dict[int, UnitOptimizerState] = {}
        names = moment_names(self.config.optimizer)
        for unit, full in values(self.units):
            index = unit.index
            place = unit.placement
            full = full.to(self.comm.device)
            broadcast(self.comm, full)
            param_block = self._param_block(index) if place.partitioned else None
            if place.grads_kept:  # the trainable span's: frozen slots' are zeros
                block = span_block(self.tiers[place.grad_home], Kind.GRAD, f"grad.{index}", unit.trainable_span,
                                   unit.compute_dtype)
                unit.keep_grads_on(OffloadedGrad(block, self.grad_writer, self.staging, reader=self.grad_reader))
            unit.materialize(full, self.compute, param_block)
            if param_block is not None and param_block.writable:
                write_block(param_block, full[unit.shard_range], self.staging)
            state = UnitOptimizerState(unit, self.tiers[place.optimizer], names, key=f"optimizer.{index}",
                                       moment_format=self.config.optimizer.moments)
            for _ in stream_blocks([state.block], self.staging, read=False, depth=self.depth):
                state.initialize(full[unit.shard_range])  # copy_ moves it to the update's device
            states[index] = state
        for module in self.module.modules():
            for name, buffer in module.named_buffers(recurse=False):
                moved = buffer.to(self.comm.device)
                broadcast(self.comm, moved)
                setattr(module, name, moved)
        return [states[index] for index in range(len(self.units))]

    def _groups(self, param_groups: list[dict] | None) -> list[dict]:
        """torch-style groups over model parameters, rewritten over this rank's master pieces."""
        groups = normalize_param_groups(param_groups, self.module)
        group_of = {id(p): index for index, group in enumerate(groups) for p in group["params"]}
        out = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups]
        for unit, state in zip(self.units, self.opt_states):
            for piece in unit.pieces:
                slot = unit.layout.slots[piece.slot_index]
                if not slot.trainable:
                    continue
                if id(slot.param) not in group_of:
                    raise ValueError(f"parameter {slot.names[0]!r} is trainable but in no param group")
                out[group_of[id(slot.param)]]["params"].append(state.add_piece(piece))
        return out

    def _attach_optimizer_state(self) -> None:
        """Give every piece its (empty) moment tensors and the number of its first element in its
        parameter (the key of its moments' rounding noise: the same however the parameters are sharded),
        then point resident blocks' pieces once for good."""
        names = moment_names(self.config.optimizer)
        for state in self.opt_states:
            for piece, tensor in state.pieces:
                name = state.unit.layout.slots[piece.slot_index].names[0]
                self.optimizer.attach_state(tensor, {n: torch.empty(0, dtype=state.moment_dtype, device=tensor.device)
                                                     for n in names},
                                            noise=(zlib.crc32(name.encode()), state.unit.param_range(piece)[0]))
            if state.block.resident:
                state.point(self.optimizer)

    # ------------------------------------------------------------------ paging
    def visit(self, *, write: bool, read: bool = True, states: list[UnitOptimizerState] | None = None
              ) -> Iterator[UnitOptimizerState]:
        """Each unit's optimizer state (or each of ``states``) loaded and pointed, in unit order (paged
        through host buffers when it lives on NVMe: read i+1 ‖ work on i ‖ write i−1); ``write`` stores
        changes back, ``read=False`` reads nothing (the caller overwrites every block whole). Resident
        blocks were pointed once for good (``_attach_optimizer_state``)."""
        states = self.opt_states if states is None else states
        blocks = [state.block for state in states]
        states = iter(states)
        for _ in stream_blocks(blocks, self.staging, read=read, write=write, depth=self.depth):
            state = next(states)  # the stream must be resumed after each yield: it stores the block then
            paged = not state.block.resident
            if paged:
                state.point(self.optimizer)
            yield state
            if paged:
                state.unpoint(self.optimizer)
