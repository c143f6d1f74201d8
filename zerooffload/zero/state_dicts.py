"""Whole values in and out of the sharded state: full state dicts, gathered parameters, new masters.

Every operation here is collective and walks the units one at a time (optimizer blocks paged in by
``ShardedState.visit``), so memory stays near one unit whatever the model's size.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from ..block_stream import write_block
from ..comm import all_gather, broadcast
from ..optim.state import UnitOptimizerState
from ..tiers import Kind
from .partition import FlatUnit, ParamState
from .scheduler import ParamScheduler
from .sharded_state import ShardedState
from .update import Updater

__all__ = ["StateDicts"]


class StateDicts:
    """Reads and writes a ``ShardedState`` whole."""

    def __init__(self, state: ShardedState, param_scheduler: ParamScheduler, updater: Updater):
        self.state = state
        self.param_scheduler = param_scheduler
        self.updater = updater

    def full_state_dict(self, all_ranks: bool) -> dict[str, torch.Tensor]:
        """``model.state_dict()``'s keys with fp32 CPU parameters (from the masters) and buffers as they
        are; rank 0 (every rank with ``all_ranks``) gets the dict, the others ``{}``."""
        values: dict[int, torch.Tensor] = {}
        for unit_values in self.unit_values():
            values.update({key: value.clone() for key, value in unit_values.items()})  # not views of the unit
        if not (all_ranks or self.state.comm.rank == 0):
            return {}
        return {name: values[id(t)] if id(t) in values else t.detach().cpu().clone()
                for name, t in self.state.module.state_dict(keep_vars=True).items()}

    def unit_values(self) -> Iterator[dict[int, torch.Tensor]]:
        """Unit by unit, in unit order, its parameters' fp32 CPU values by ``id(param)`` (every rank):
        views of the unit's gathered buffer."""
        comm = self.state.comm
        self.updater.step_updates.join()  # every read of the state joins the step's updates first (their note)
        for opt_state in self.state.visit(write=False):
            unit = opt_state.unit
            shard = self.fp32_shard(opt_state)
            flat = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=shard.device)
            if unit.layout.shards > 1:
                all_gather(comm, flat, shard)
            else:
                flat.copy_(shard)
            flat = flat.cpu()
            yield {id(slot.param): flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
                   for slot in unit.layout.slots}

    def streamed_entries(self, dtype: torch.dtype) -> list[tuple[str, tuple, torch.dtype, Callable]]:
        """``state_dict()``'s keys as (name, shape, dtype, produce) in unit order, parameters cast to
        ``dtype``, then the other tensors (buffers) as they are: producing them in order gathers one
        unit at a time (collective: every rank produces every value)."""
        units = self.unit_values()
        current: dict[int, torch.Tensor] = {}
        order = {id(slot.param): index for index, unit in enumerate(self.state.units) for slot in unit.layout.slots}
        reached = [-1]

        def parameter(param_id: int) -> torch.Tensor:
            while reached[0] < order[param_id]:
                current.clear()
                current.update(next(units))
                reached[0] += 1
            return current[param_id].to(dtype)

        named = list(self.state.module.state_dict(keep_vars=True).items())
        params = sorted(((name, t) for name, t in named if id(t) in order), key=lambda item: order[id(item[1])])
        entries = [(name, tuple(t.shape), dtype, lambda i=id(t): parameter(i)) for name, t in params]
        return entries + [(name, tuple(t.shape), t.dtype, lambda t=t: t.detach().cpu())
                          for name, t in named if id(t) not in order]

    def visit(self, *, write: bool, read: bool = True, states: list[UnitOptimizerState] | None = None
              ) -> Iterator[UnitOptimizerState]:
        """Each unit's optimizer state (or each of ``states``) loaded, in unit order (``ShardedState.visit``):
        for checkpoints."""
        self.updater.step_updates.join()
        return self.state.visit(write=write, read=read, states=states)

    def fp32_shard(self, opt_state: UnitOptimizerState) -> torch.Tensor:
        """This rank's whole shard of ``opt_state``'s unit in fp32 (``opt_state`` loaded): the master
        over the trainable part, the weights past it. Those are frozen values, exact in fp32 runs; in
        bf16/fp16 ones the compute-dtype values, since a frozen parameter keeps no fp32 copy. A split
        master is joined from the weights (state_formats' [Note: split masters])."""
        unit = opt_state.unit
        trainable = unit.trainable_numel
        if trainable == unit.layout.shard_numel and not opt_state.split:
            return opt_state.master()
        with self._shard_weights(unit) as weights:
            opt_state.unpack_master(weights[:trainable])
            master = opt_state.master()
            shard = torch.empty(unit.layout.shard_numel, dtype=torch.float32, device=master.device)
            shard[:trainable].copy_(master)
            shard[trainable:].copy_(weights[trainable:])
            opt_state.drop_master()
        return shard

    @contextlib.contextmanager
    def _shard_weights(self, unit: FlatUnit) -> Iterator[torch.Tensor]:
        """This rank's weights of ``unit``'s shard, readable for the duration: read from the shard's home
        when that is not addressable (shards read ahead are let go first: they hold the block)."""
        if unit.param_state is ParamState.GATHERED:  # the full weights are here (always, unless partitioned)
            yield unit.flat_param[unit.shard_range]
            return
        if unit.param_block.resident:
            yield unit.param_block.data
            return
        self.param_scheduler.free_all()
        block, staging = unit.param_block, self.state.staging
        buffer = staging.empty(Kind.BUFFER, block.nbytes, torch.uint8)
        try:
            block.load(buffer).wait()
            yield block.data
        finally:
            block.unload()
            staging.free(Kind.BUFFER, buffer)

    @contextlib.contextmanager
    def gathered(self, modifier_rank: int) -> Iterator[nn.Module]:
        """Full parameters readable and writable; on exit ``modifier_rank``'s writes reach the masters
        (only where the compute weights changed, so untouched values keep their full fp32 precision)."""
        units = self.state.units
        self.updater.step_updates.join()
        self.param_scheduler.gather_all()
        before = [u.flat_param[u.shard_range].clone() for u in units]  # only this rank's masters matter
        try:
            yield self.state.module
            for opt_state, old in zip(self.state.visit(write=True), before):
                self._write_gathered(opt_state, old, modifier_rank)
        finally:
            self.param_scheduler.free_all()

    def _write_gathered(self, opt_state: UnitOptimizerState, old: torch.Tensor, modifier_rank: int) -> None:
        """``modifier_rank``'s full parameters of the unit to every rank, and the changed values of this
        rank's shard into its masters (and its shard home, if any changed; frozen values have no
        master: the weights and their home hold them; a split master is its weights exactly there)."""
        unit = opt_state.unit
        broadcast(self.state.comm, unit.flat_param, src=modifier_rank)
        new = unit.flat_param[unit.shard_range]
        changed = new != old
        if unit.partitioned and unit.param_block.writable and bool(changed.any()):
            write_block(unit.param_block, new, self.state.staging)
        trainable = unit.trainable_numel
        if opt_state.split:
            opt_state.clear_residual(changed[:trainable].cpu())
        elif not unit.master_is_param:
            changed, new = changed[:trainable], new[:trainable]
            unit.master[changed.to(unit.master.device)] = new[changed].float().to(unit.master.device)

    def set_optimizer_states(self, fill: Callable[[UnitOptimizerState, torch.Tensor | None], None], *,
                             whole: bool) -> None:
        """Set masters (and moments) from outside the step and publish the new compute weights, in one
        pass over the optimizer blocks: ``fill(state, frozen)`` on each loaded state, ``frozen`` being
        where this rank's values past the trainable part go (compute dtype; None when there are none:
        ``Publication.frozen_part``); ``whole`` when it overwrites the entire block, not read first."""
        self.updater.step_updates.join()
        self.param_scheduler.free_all()  # shards read ahead hold the old weights
        publication = self.updater.publication(whole_shards=True)
        for opt_state in self.state.visit(write=True, read=not whole):
            if whole:  # not read: its padding would be the host buffer's last contents (a checkpoint's bytes)
                opt_state.block.data.zero_()
            target = publication.target(opt_state.unit)
            trainable = opt_state.unit.trainable_numel
            if opt_state.split:  # its master is joined from the weights in the target, and split back into them
                opt_state.unpack_master(target[:trainable])
            opt_state.unpack_moments(decode=not whole)  # int8 moments: as fp32 values, encoded back after
            fill(opt_state, publication.frozen_part(opt_state.unit))
            opt_state.pack_moments()
            if opt_state.split:
                opt_state.pack_master(target[:trainable])
            self.updater.send(publication, opt_state, target, stepped=[])
        publication.finish()
