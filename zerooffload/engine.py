"""The engine: hooks into the module, backward with accumulation, the sharded optimizer step.

[Note: a step]
``engine(batch)`` runs the module (floating inputs cast to the compute dtype). ``engine.backward``
scales the loss by ``loss_scale / grad_accum_steps`` and runs autograd; a post-accumulate hook on
every trainable parameter adds its gradient into its unit's flat gradient (and drops ``.grad``). At
stages 2–3 a unit whose gradients are complete is handed to the reducer during backward (and an
offloaded unit's reduced shard leaves for the optimizer's tier, ``offloaded_grads``); at stages 0–1
all units are reduced when the window closes. ``engine.step`` at the accumulation boundary then:
1. averages the gradients over ranks (all-reduce at stage 0, reduce-scatter to shard owners above);
2. in ONE small control all-reduce sums the squared norms of the reduced gradients and the "had a
   gradient" flag of every parameter over ranks;
3. skips the step everywhere if fp16 gradients overflowed, else folds the unscale and the clip to
   ``train.grad_clip`` into one gradient scale;
4. unit by unit, its optimizer block loaded (``optim.state``; streamed when on NVMe): the update of the
   pieces whose parameters had a gradient somewhere (others skip, as torch skips ``grad is None``;
   frozen parameters have no pieces, and units with no trainable parameter are neither reduced nor
   updated: optim.state's frozen prefix rule),
   writing the new compute weights where they are published (``publication``): all-gathered at stages
   1–2, a partitioned unit's shard at stage 3, gathered again at its next use by the ``ParamScheduler``
   (``param_hooks``).

[Note: updates in backward]
When the update needs nothing global (no ``train.grad_clip``, no fp16 loss scale that may skip the
step), a unit whose gradient would leave for the optimizer's tier is updated, in the backward that
closes an accumulation window, the moment its last reduced shard arrives: its optimizer block was
read ahead (the blocks stream in the reducer's fixed order, read i+1 ‖ update i ‖ write i−1, as in
the step), the shard is rounded to the compute dtype exactly as the tier would store it (or added to
the window's earlier parts, read ahead from the tier, exactly as the tier would add it), and the new
weights are published as the step would publish them. The gradient never makes its last trip to the
tier and back (2 × its bytes per step saved on NVMe; with one micro-batch per step it is never
stored at all), and the optimizer's I/O overlaps backward. The result is bitwise the step's: the
same inputs, the same update. It is safe because a unit is reduced only once every use of its
parameters in this backward is over (autograd accumulates a parameter's gradient after all its
uses), and the "had a gradient somewhere" flags of its slots are summed over ranks right then, in
the reducer's order. ``engine.step`` then updates only the other units, and closes the window as
always (counters, LR schedule, the gradient norm reported). So the backward that closes a window
applies its update: call ``step`` after every ``backward``, as always. (A ``grad_clip`` too large
to bind turns this off and changes nothing else: the tests compare both ways.)
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint
from torch import nn

from . import checkpoint
from .activations import ActivationProfile, measure_activations
from .comm import Comm, all_gather, broadcast, control_all_reduce, failing_together, init_comm
from .config import Config, dtype_bytes
from .lazy_init import initial_values, is_lazy, swap_in_placeholders
from .memory_plan import (activation_bytes, fitting_layout, grads_kept_for_step, master_is_param, params_in_masters,
                          plan_for_config, updates_in_backward)
from .optim import ZeroOptimizer, build_scheduler, moment_names
from .param_groups import normalize_param_groups
from .param_hooks import register_param_hooks
from .partition import FlatUnit, Piece, SplitShardBlock, UnitLayout, find_units, span_block
from .publication import Publication
from .precision import COMPUTE_DTYPES, LossScaler
from .reduction import GradReducer, Mode
from .scheduler import ParamScheduler, check_live_bound
from .offloaded_grads import OffloadedGrad
from .optim.state import UnitOptimizerState, units_to_offload
from .telemetry import MemoryReport, StepStats, memory_report
from .threads import set_threads
from .tiers import (Block, BlockWriter, DeviceCopier, IOStats, Kind, LinkStats, NvmeTier, Tier, check_plan, check_ram,
                    make_tiers, stream_blocks, write_block)

__all__ = ["Engine", "initialize"]

logger = logging.getLogger(__name__)

_EAGER = object()
"""``lazy_init_fn`` of a model built eagerly: its parameters already hold their values."""


def initialize(model: nn.Module, config: Config | dict | str | None = None, param_groups: list[dict] | None = None,
               init_fn: Any = None, *, example_inputs: tuple | dict | None = None) -> "Engine":
    """Shard ``model``'s training state as ``config`` says and return the engine that trains it.

    ``param_groups`` are torch-style groups over ``model``'s parameters (lr, weight_decay, ... per
    group); by default one group of every trainable parameter. ``init_fn(model)``, when given, runs
    once under ``torch.no_grad()`` before the parameters are flattened; for a model built under
    ``init_context`` it runs as ``init_fn(module)`` for each module instead of ``reset_parameters()``
    (``lazy_init``'s note), one unit's worth of memory at a time. ``example_inputs``: one micro-batch's
    arguments to the model (a tuple, or a dict of keyword arguments; real or meta tensors, only their
    shapes count), for a model built under ``init_context``: its activations are measured on the meta
    device and counted in the memory check ([Note: measuring activations]).
    """
    config = Config.load(config if config is not None else {})
    set_threads(config.train.threads)
    lazy = is_lazy(model)
    comm = init_comm()
    activations = None
    if example_inputs is not None:
        activations = _measure(model, config, comm.device, example_inputs)
    if lazy:
        swap_in_placeholders(model)
    elif init_fn is not None:
        with torch.no_grad():
            init_fn(model)
    with failing_together(comm):
        return Engine(model, config, comm, param_groups, lazy_init_fn=init_fn if lazy else _EAGER,
                      activations=activations)


def _measure(model: nn.Module, config: Config, device: torch.device, example_inputs: tuple | dict
             ) -> ActivationProfile:
    """The activations of ``model`` (still on the meta device) on ``example_inputs``."""
    if not is_lazy(model):
        raise ValueError("example_inputs: activations are measured on a model built under zo.init_context(); "
                         "build it there, or leave example_inputs out (the RAM margin then stands in for them)")
    args, kwargs = (((), example_inputs) if isinstance(example_inputs, dict) else (tuple(example_inputs), {}))
    layouts = find_units(model, config.zero.unit_modules, 1)
    return measure_activations(model, layouts, dtype_bytes(config.train.precision), args, kwargs, device)


def _engine_call(method: Any) -> Any:
    """A public engine call: refused on a closed engine, and after which no peer is left waiting in a
    collective when this rank raises (comm's [Note: failing together])."""
    @functools.wraps(method)
    def guarded(self: "Engine", *args: Any, **kwargs: Any) -> Any:
        self.ensure_open(method.__name__)
        with failing_together(self.comm):
            return method(self, *args, **kwargs)
    return guarded


def _storage_bytes(module: nn.Module) -> int:
    """Bytes the module's parameters hold now, each storage once: what flattening them gives back
    (an eager build's weights; a lazy build's placeholders hold next to nothing)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()
                if not p.is_meta and p.device.type == "cpu"}
    return sum(storages.values())


def _local_ranks(comm: Comm) -> int:
    """Ranks sharing this machine's RAM (torchrun's LOCAL_WORLD_SIZE; all of them without it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size))


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors nested in tuples, lists and dicts, cast to ``dtype``; everything else as is."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _checkpoint_forward(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward (``train.activation_checkpointing``).

    The module's own ``forward`` is wrapped on the instance (its class is left alone) with torch's
    non-reentrant checkpoint, only while gradients are enabled so evaluation runs plainly.
    """
    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    module.forward = checkpointed


@dataclasses.dataclass(slots=True)
class _BackwardUpdates:
    """One backward's updates in progress (see [Note: updates in backward])."""

    states: Iterator[UnitOptimizerState]
    """The units' optimizer states in arrival order, streamed: the next one loads during an update."""
    publication: Publication
    """Their new weights on their way."""


class Engine:
    """Trains one module with ZeRO stages 0–3; see [Note: a step]."""

    def __init__(self, module: nn.Module, config: Config, comm: Comm, param_groups: list[dict] | None,
                 lazy_init_fn: Any = None, activations: ActivationProfile | None = None):
        self.module = module
        self.config = config
        self.comm = comm
        self.stage = config.zero.stage
        self.compute_dtype = COMPUTE_DTYPES[config.train.precision]
        self.tiers = make_tiers(config.memory, comm.device)
        layouts = find_units(module, config.zero.unit_modules, comm.world_size if self.stage >= 1 else 1)
        if not layouts:
            raise ValueError("the model has no parameters to train")
        self.units = [FlatUnit(layout, comm.rank, self.compute_dtype, keep_full_grad=self.stage <= 1,
                               keep_grad_shard=self.stage >= 2, partitioned=self._partitioned(layout))
                      for layout in layouts]
        partitioned = [u for u in self.units if u.partitioned]
        self._offloaded = units_to_offload(layouts, config.offload.optimizer.fraction)
        self._updates_in_backward = updates_in_backward(config.train)
        """Whether units whose gradients leave the device are updated in the backward that closes a window
        ([Note: updates in backward])."""
        self._grads_kept = grads_kept_for_step(config.train)
        """Whether reduced shards leaving the device wait on the optimizer's tier (``offloaded_grads``)."""
        check_live_bound(partitioned, config.zero.max_live_size)
        plan = plan_for_config(layouts, config, comm.world_size)
        measured = activation_bytes(activations, config)
        check_plan(plan, self.tiers, measured)  # memory budgets first: they are cheap to check, swap space is not
        check_ram(plan, config.memory, comm.device, activations=measured, released=_storage_bytes(module),
                  local_ranks=_local_ranks(comm), suggestion=lambda fits: fitting_layout(
                      module, config, comm.world_size, fits, activations, _local_ranks(comm)))
        if "nvme" in plan:
            self.tiers["nvme"] = NvmeTier(config, comm.rank, reserve=sum(plan["nvme"].values()))
        self._io = self.tiers["nvme"].io if "nvme" in self.tiers else IOStats()
        self._link = LinkStats()
        self._param_tier = self.tiers[config.offload.param.tier]
        self._grad_writer = BlockWriter(self.tiers["host"])  # offloaded gradient shards on their way home
        self.opt_states = self._materialize(lazy_init_fn)
        shards_off_device = config.offload.param.tier != "device"
        self.param_scheduler = ParamScheduler(comm, partitioned, self.tiers["device"], self.tiers["host"],
                                              prefetch_bytes=config.zero.prefetch_size,
                                              max_live_bytes=config.zero.max_live_size,
                                              copier=DeviceCopier(self.tiers["device"], self._link)
                                              if shards_off_device else None)
        self.optimizer = ZeroOptimizer(self._groups(param_groups), config.optimizer)
        self._attach_optimizer_state()
        default_schedule = config.scheduler.type == "constant" and config.scheduler.warmup_steps == 0
        self.scheduler = None if default_schedule else build_scheduler(self.optimizer, config.scheduler)
        self.scaler = LossScaler(config.train)
        mode = Mode.ALL_REDUCE if self.stage == 0 else Mode.REDUCE_SCATTER
        self.reducer = GradReducer(comm, self._reduction_order(), mode, config.zero.bucket_size, self.tiers["device"],
                                   on_reduced=self._on_reduced)
        self._backward_units = [u for u in self.reducer.order if u.grad_leaves] if self._updates_in_backward else []
        self._backward_states = [self.opt_states[self.units.index(unit)] for unit in self._backward_units]
        self._in_backward: _BackwardUpdates | None = None
        self._hooks = [slot.param.register_post_accumulate_grad_hook(partial(self._on_grad, unit, index))
                       for unit in self.units for index, slot in enumerate(unit.layout.slots) if slot.trainable]
        if partitioned:
            self._hooks += register_param_hooks(module, partitioned, self.param_scheduler)
        if config.train.activation_checkpointing:
            for unit in self.units:
                if unit.layout.name:  # block units; the root unit holds the embeddings and head
                    _checkpoint_forward(unit.layout.module)
        self.micro_steps = 0
        self._stepped_at = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self._stats: StepStats | None = None
        self._window_skipped: str | None = None
        """Why this accumulation window will not update (``train.skip_nonfinite``), once it is known."""
        self._last_checkpoint: str | None = None
        """The checkpoint this engine last saved or loaded: where to go back to after poisoned updates."""
        self._closed = False
        self._start_window()

    # ------------------------------------------------------------------ construction
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

    def _partitioned(self, layout: UnitLayout) -> bool:
        """Stage 3 partitions every unit except those under ``zero.persist_threshold`` parameters."""
        return self.stage == 3 and layout.numel >= self.config.zero.persist_threshold

    def _optimizer_tier_name(self, index: int) -> str:
        """``offload.optimizer.tier`` for the units ``offload.optimizer.fraction`` sends there, else device."""
        return self.config.offload.optimizer.tier if self._offloaded[index] else "device"

    def _param_block(self, index: int, tier_name: str) -> Block:
        """A partitioned unit's shard home (``Kind.PARAM`` on ``offload.param.tier``); in fp32 with the
        unit's optimizer block on NVMe too, the block's master segment instead, which holds the same
        values and which the update writes anyway: no second copy to write each step (not for a shard
        with frozen values, which the master does not hold). On NVMe a shard whose trainable span is
        followed by frozen values is two blocks, so that steps write the span alone."""
        unit = self.units[index]
        size, span = unit.layout.shard_numel, unit.trainable_span
        if params_in_masters(self.config, tier_name) and unit.trainable_numel == size:
            # the master is the block's first segment
            return self.tiers["nvme"].prefix_block(f"optimizer.{index}", size, torch.float32)
        if self._param_tier.resident or span in (0, size):
            return self._param_tier.block(Kind.PARAM, f"param.{index}", size, self.compute_dtype)
        return SplitShardBlock(self._param_tier.block(Kind.PARAM, f"param.{index}", span, self.compute_dtype),
                               self._param_tier.block(Kind.PARAM, f"param.{index}.frozen", size - span,
                                                      self.compute_dtype))

    def _update_tier(self, state: UnitOptimizerState) -> Tier:
        """Where a unit's update runs: its optimizer tier's memory, or host memory for NVMe blocks."""
        return state.tier if state.tier.resident else self.tiers["host"]

    def _materialize(self, lazy_init_fn: Any) -> list[UnitOptimizerState]:
        """Unit by unit: rank 0's values broadcast (as DDP does), flattened onto their tiers, and the
        unit's optimizer block written; returns the optimizer states in unit order. A lazily built
        model's values are made here, unit by unit (``lazy_init``), unless ``lazy_init_fn`` is _EAGER."""
        states: dict[int, UnitOptimizerState] = {}
        names = moment_names(self.config.optimizer)
        values = (((u, u.full_fp32()) for u in self.units) if lazy_init_fn is _EAGER
                  else initial_values(self.module, self.units, lazy_init_fn))
        for unit, full in values:
            index = self.units.index(unit)
            full = full.to(self.comm.device)
            broadcast(self.comm, full)
            tier_name = self._optimizer_tier_name(index)
            param_block = self._param_block(index, tier_name) if unit.partitioned else None
            unit.grad_leaves = unit.keep_grad_shard and tier_name != "device"
            if unit.grad_leaves and self._grads_kept:  # the trainable span's: frozen slots' are zeros
                block = span_block(self.tiers[tier_name], Kind.GRAD, f"grad.{index}", unit.trainable_span,
                                   self.compute_dtype)
                unit.offloaded_grad = OffloadedGrad(block, self._grad_writer, self.tiers["host"])
            unit.materialize(full, self.tiers["device"], master_is_param(self.config, tier_name), param_block)
            if param_block is not None and param_block.writable:
                write_block(param_block, full[unit.shard_range], self.tiers["host"])
            state = UnitOptimizerState(unit, self.tiers[tier_name], names, key=f"optimizer.{index}")
            for _ in stream_blocks([state.block], self.tiers["host"], read=False):
                state.initialize(full[unit.shard_range])  # copy_ moves it to the update's device
            states[index] = state
        for module in self.module.modules():
            for name, buffer in module.named_buffers(recurse=False):
                moved = buffer.to(self.comm.device)
                broadcast(self.comm, moved)
                setattr(module, name, moved)
        return [states[index] for index in range(len(self.units))]

    def _attach_optimizer_state(self) -> None:
        """Give every piece its (empty) moment tensors, then point resident blocks' pieces once for good."""
        names = moment_names(self.config.optimizer)
        for state in self.opt_states:
            for _, tensor in state.pieces:
                self.optimizer.attach_state(tensor, {n: torch.empty(0, dtype=torch.float32, device=tensor.device)
                                                     for n in names})
            if state.block.resident:
                state.point(self.optimizer)

    def visit_optimizer_states(self, *, write: bool, read: bool = True,
                               states: list[UnitOptimizerState] | None = None) -> Iterator[UnitOptimizerState]:
        """Each unit's optimizer state (or each of ``states``) loaded and pointed, in unit order (paged
        through host buffers when it lives on NVMe: read i+1 ‖ work on i ‖ write i−1); ``write`` stores
        changes back, ``read=False`` reads nothing (the caller overwrites every block whole). Resident
        blocks were pointed once for good (``_attach_optimizer_state``)."""
        states = self.opt_states if states is None else states
        blocks = [state.block for state in states]
        states = iter(states)
        for _ in stream_blocks(blocks, self.tiers["host"], read=read, write=write):
            state = next(states)  # the stream must be resumed after each yield: it stores the block then
            paged = not state.block.resident
            if paged:
                state.point(self.optimizer)
            yield state
            if paged:
                state.unpoint(self.optimizer)

    def _reduction_order(self) -> list[FlatUnit]:
        """Block units last to first, then the root unit: the order backward usually completes them.
        Frozen units have no gradient to reduce."""
        trainable = [u for u in self.units if u.layout.trainable]
        blocks = [u for u in trainable if u.layout.name]
        return blocks[::-1] + [u for u in trainable if not u.layout.name]

    # ------------------------------------------------------------------ forward and backward
    @_engine_call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compute_dtype != torch.float32:
            args, kwargs = _cast_floats(args, self.compute_dtype), _cast_floats(kwargs, self.compute_dtype)
        return self.module(*args, **kwargs)

    def _on_grad(self, unit: FlatUnit, index: int, param: nn.Parameter) -> None:
        complete = unit.accumulate(index, param.grad, self.tiers["device"])
        param.grad = None
        if complete and self.stage >= 2 and self.config.zero.overlap_comm:
            self.reducer.mark_ready(unit)  # without overlap_comm, flush() reduces after backward

    @_engine_call
    def backward(self, output: Any) -> None:
        """Backward of a loss (or of ``output.loss``), scaled by loss scale / ``grad_accum_steps``.

        With ``train.skip_nonfinite``, a loss that is inf/NaN on any rank (one flag, all-reduced here)
        marks the window skipped and runs no backward at all: its gradients would be discarded."""
        loss = output if isinstance(output, torch.Tensor) else output.loss
        self._check_step_called()
        if self.config.train.skip_nonfinite and self._window_skipped is None:
            self._window_skipped = self._nonfinite_loss(loss)
        if self._window_skipped is not None:
            self.param_scheduler.abandon_pass()
            self.micro_steps += 1
            return
        for unit in self.units:
            unit.begin_backward()
        self._in_backward = self._start_backward_updates()
        try:
            (loss * (self.scaler.scale / self.config.train.grad_accum_steps)).backward()
            if self.stage >= 2:
                self.reducer.flush()
                self._grad_writer.finish()
        except BaseException:
            self._abandon_backward_updates()
            raise
        self._finish_backward_updates()
        self.param_scheduler.end_pass()
        self.micro_steps += 1

    def _check_step_called(self) -> None:
        """A backward after the one that closed a window, with no ``step()`` between, would fold two
        windows into one update (or apply two, where units update in backward): refused."""
        if self.is_accumulation_boundary and self._stepped_at != self.micro_steps:
            accum = self.config.train.grad_accum_steps
            raise RuntimeError(f"backward() called again before step(): with train.grad_accum_steps = {accum}, "
                               f"backward number {self.micro_steps} closed an accumulation window; call "
                               "engine.step() after every backward(), or raise train.grad_accum_steps to "
                               "accumulate more micro-batches per update")

    def _nonfinite_loss(self, loss: torch.Tensor) -> str | None:
        """Why the window is skipped, if this loss is inf/NaN on any rank (one control all-reduce)."""
        bad = torch.tensor([0.0 if bool(torch.isfinite(loss.detach()).all()) else 1.0], dtype=torch.float64)
        if self.comm.world_size > 1:
            bad = control_all_reduce(self.comm, bad.to(self.comm.device)).cpu()
        return None if bad.item() == 0 else f"non-finite loss on {int(bad.item())} rank(s)"

    def restore_counters(self, global_steps: int, micro_steps: int, skipped_steps: int) -> None:
        """Counters as a checkpoint saved them; the window the checkpoint closed counts as stepped."""
        self.global_steps, self.micro_steps, self.skipped_steps = global_steps, micro_steps, skipped_steps
        self._stepped_at = micro_steps

    @property
    def is_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` updates: the last backward closed an accumulation window."""
        return self.micro_steps > 0 and self.micro_steps % self.config.train.grad_accum_steps == 0

    # ------------------------------------------------------------------ the step
    @_engine_call
    def step(self) -> bool:
        """Call after every backward; updates at accumulation boundaries and returns whether it did."""
        if not self.is_accumulation_boundary or self._stepped_at == self.micro_steps:
            return False
        self._stepped_at = self.micro_steps
        norm_sq = math.inf
        if self._window_skipped is None:
            if self.stage <= 1:
                self.reducer.flush()
            norms = [self._grad_norm(unit) for unit in self.units]
            norm_sq, had_grad = self._global_norm_and_flags(norms)
            norm_sq /= self.scaler.scale ** 2
            if not math.isfinite(norm_sq) and (self.scaler.enabled or self.config.train.skip_nonfinite):
                self._window_skipped = "inf/NaN gradients" if self.scaler.enabled else "non-finite gradient norm"
        overflow = self._window_skipped is not None
        if overflow:
            self.skipped_steps += 1
            logger.warning("step %d skipped (%s); %d skipped so far", self.global_steps + 1, self._window_skipped,
                           self.skipped_steps)
            self._window_skipped = None
        else:
            self._update(had_grad, self._grad_scale(norm_sq))
        for unit in self.units:
            unit.clear_grads(self.tiers["device"])
        self.scaler.update(overflow)
        self.global_steps += 1
        if self.scheduler is not None and not overflow:
            self.scheduler.step()
        self._record(not overflow, norm_sq)
        self._start_window()
        return not overflow

    def _grad_norm(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's part of ``unit``'s gradient norm for the window, from wherever its gradient went
        (a frozen unit has none: 0)."""
        if not unit.layout.trainable:
            return torch.zeros((), dtype=torch.float32)
        if unit.backward_update_norm is not None:
            return unit.backward_update_norm
        if unit.offloaded_grad is not None:
            return unit.offloaded_grad.norm  # taken as it was written
        return torch.linalg.vector_norm(unit.local_grad(), dtype=torch.float32)

    @contextlib.contextmanager
    def _reduced_grad(self, unit: FlatUnit) -> Iterator[torch.Tensor]:
        """This rank's reduced gradient of ``unit`` for the window, in memory for the duration (read
        from the optimizer's tier when it was offloaded)."""
        if unit.offloaded_grad is None:
            yield unit.local_grad()
        else:
            with unit.offloaded_grad.loaded() as grad:
                yield grad

    def _global_norm_and_flags(self, norms: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
        """One control all-reduce: the squared gradient norm and each slot's "had a gradient" count."""
        flags = [torch.tensor(u.has_grad, dtype=torch.float64) for u in self.units]
        # norms taken where each gradient was: on the device, or in host memory when offloaded
        local_sq = torch.stack([n.to(self.comm.device) for n in norms]).double().square().sum().cpu().reshape(1)
        if self.stage == 0 and self.comm.rank != 0:
            local_sq.zero_()  # stage 0 gradients are whole on every rank: count them once
        control = control_all_reduce(self.comm, torch.cat([local_sq, *flags]).to(self.comm.device)).cpu()
        sizes = [len(f) for f in flags]
        return float(control[0]), list(torch.split(control[1:], sizes))

    def _grad_scale(self, norm_sq: float) -> float:
        """What the reduced gradients are multiplied by in the update: 1 / loss scale, times the clip
        coefficient of ``train.grad_clip`` against the global norm (``norm_sq`` already unscaled)."""
        coefficient = 1.0
        if self.config.train.grad_clip > 0:
            coefficient = min(1.0, self.config.train.grad_clip / (math.sqrt(norm_sq) + 1e-6))
        return coefficient / self.scaler.scale

    def _update(self, had_grad: list[torch.Tensor], grad_scale: float) -> None:
        """Unit by unit, those not updated in backward already: the update on the pieces with a gradient
        somewhere, writing the new compute weights straight where they are published; one unit's
        all-gather runs while the next updates. Frozen units are never updated, nor their state read or
        written."""
        left = [i for i, unit in enumerate(self.units)
                if unit.layout.trainable and unit.backward_update_norm is None]
        publication = self._publication()
        states = self.visit_optimizer_states(write=True, states=[self.opt_states[i] for i in left])
        for position, state in enumerate(states):
            unit = state.unit
            upcoming = self.units[left[position + 1]].offloaded_grad if position + 1 < len(left) else None
            if upcoming is not None:
                upcoming.prefetch()  # its read overlaps this unit's update
            with self._reduced_grad(unit) as grad:  # entered even when nothing steps: it may be prefetched
                self._update_unit(state, had_grad[left[position]], grad, grad_scale, publication)
        publication.finish()
        self.param_scheduler.stage_first_units()

    def _update_unit(self, state: UnitOptimizerState, flags: torch.Tensor, grad: torch.Tensor, grad_scale: float,
                     publication: Publication) -> None:
        """One unit's update on the pieces whose parameters had a gradient somewhere (``flags``),
        writing its new weights into their target, then sent on (``publication``'s note)."""
        target = publication.target(state.unit)
        stepped = [(piece, tensor) for piece, tensor in state.pieces if flags[piece.slot_index] > 0]
        if stepped:
            self._step_unit(stepped, grad, grad_scale, target, self._update_tier(state))
        self._send(publication, state, target, [piece for piece, _ in stepped])

    def _send(self, publication: Publication, state: UnitOptimizerState, target: torch.Tensor | None,
              stepped: list[Piece]) -> None:
        on_device = self._update_tier(state) is self.tiers["device"]
        publication.send(state.unit, target, stepped, updated_on_device=on_device)

    def _publication(self, whole_shards: bool = False) -> Publication:
        return Publication(self.comm, self.tiers["device"], self.tiers["host"], self._link,
                           shards_off_device=self.config.offload.param.tier != "device", whole_shards=whole_shards)

    # ------------------------------------------------------------------ updates in backward
    def _start_backward_updates(self) -> "_BackwardUpdates | None":
        closes_window = (self.micro_steps + 1) % self.config.train.grad_accum_steps == 0
        if not (self._backward_units and closes_window):
            return None
        self._prefetch_window_part(0)
        return _BackwardUpdates(self.visit_optimizer_states(write=True, states=self._backward_states),
                                self._publication())

    def _on_reduced(self, unit: FlatUnit, shard: torch.Tensor) -> None:
        """The reducer's hand-off of ``unit``'s reduced shard: updated at once, or kept for the step."""
        updates = self._in_backward
        if self._window_skipped is not None:
            return  # the window will not update: its gradients are not kept
        if unit.grad_leaves:  # for the tier or for the update
            self._link.device_to_host_bytes += shard.numel() * unit.compute_dtype.itemsize
        if updates is None or not unit.grad_leaves:
            unit.add_grad_shard(shard, self.tiers["device"])
            return
        state = next(updates.states)  # loaded ahead while the previous unit updated
        assert state.unit is unit, "reduced shards arrive in the reducer's fixed order"
        position = self._backward_units.index(unit)
        self._prefetch_window_part(position + 1)  # the next unit's, during this update
        with self._window_grad(unit, shard) as grad:
            norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
            flags = torch.tensor([*unit.has_grad, 0.0 if torch.isfinite(norm) else 1.0], dtype=torch.float64)
            flags = control_all_reduce(self.comm, flags.to(self.comm.device)).cpu()
            if flags[-1] > 0 and self.config.train.skip_nonfinite:
                self._refuse_poisoned_update(unit, position)
                return
            self._update_unit(state, flags[:-1], grad, 1.0 / self.scaler.scale, updates.publication)
            unit.backward_update_norm = norm

    def _refuse_poisoned_update(self, unit: FlatUnit, position: int) -> None:
        """A non-finite gradient reached an update in backward. Before the first unit's update the
        window is skipped like any other (the stream closed, later shards discarded); after it, weights
        have changed and the step cannot be undone, so every rank raises (the flag was all-reduced)."""
        name = unit.layout.name or "<root>"
        if position > 0:
            raise RuntimeError(
                f"unit {name!r} has a non-finite (inf/NaN) gradient on some rank, found after {position} unit(s) "
                "were already updated in this backward: those weights have changed, so this engine must not go "
                f"on. Restart from the last good checkpoint ({self._last_checkpoint or 'none saved or loaded'}); "
                "with train.grad_clip > 0 updates wait for the global norm and such a window is skipped instead")
        self._window_skipped = f"non-finite gradient of unit {name!r}"
        self._abandon_backward_updates()

    @contextlib.contextmanager
    def _window_grad(self, unit: FlatUnit, shard: torch.Tensor) -> Iterator[torch.Tensor]:
        """The window's whole gradient of ``unit`` given its last reduced part: that part rounded to the
        compute dtype as the tier would store it, or added to the earlier parts read from the tier (and
        not stored back: the update is its last use)."""
        if unit.offloaded_grad is None or not unit.offloaded_grad.written:
            yield shard.to(unit.compute_dtype)
            return
        with unit.offloaded_grad.loaded() as grad:
            yield grad.add_(shard[:grad.numel()])  # the tier keeps the trainable span's

    def _prefetch_window_part(self, position: int) -> None:
        """Start reading the earlier gradient parts (accumulation) of the ``position``-th unit updated in
        backward, if there is one and it has some."""
        if position < len(self._backward_units):
            kept = self._backward_units[position].offloaded_grad
            if kept is not None and kept.written:
                kept.prefetch()

    def _finish_backward_updates(self) -> None:
        """Backward is over: the last optimizer block stored, the new weights home or all-gathered."""
        updates, self._in_backward = self._in_backward, None
        if updates is None:
            return
        for _ in updates.states:  # every unit was reduced, so this only stores the last block ...
            raise AssertionError("a unit updated in backward got no reduced gradient")
        updates.publication.finish()

    def _abandon_backward_updates(self) -> None:
        """Backward failed: let the stream wait for its transfers and free its buffers; keep the first error."""
        updates, self._in_backward = self._in_backward, None
        if updates is not None:
            updates.states.close()
            updates.publication.abandon()

    @_engine_call
    def set_optimizer_states(self, fill: Callable[[UnitOptimizerState, torch.Tensor | None], None], *,
                             whole: bool) -> None:
        """Set masters (and moments) from outside the step — a checkpoint or pretrained weights — and
        publish the new compute weights, in one pass over the optimizer blocks: ``fill(state, frozen)``
        on each loaded state, ``frozen`` being where this rank's values past the trainable part go
        (compute dtype; None when there are none: ``Publication.frozen_part``); ``whole`` when it
        overwrites the entire block, which is then not read first."""
        self.param_scheduler.free_all()  # shards read ahead hold the old weights
        publication = self._publication(whole_shards=True)
        for state in self.visit_optimizer_states(write=True, read=not whole):
            target = publication.target(state.unit)
            fill(state, publication.frozen_part(state.unit))
            self._send(publication, state, target, stepped=[])
        publication.finish()

    def _step_unit(self, stepped: list[tuple[Piece, torch.Tensor]], grad: torch.Tensor, grad_scale: float,
                   target: torch.Tensor | None, update_tier: Tier) -> None:
        """The optimizer on one unit's stepped pieces. The native pass reads the reduced gradient as it
        lies (any dtype) and scales it itself; torch's update gets an fp32 copy, scaled, for the unit."""
        update_device = stepped[0][1].device
        scaled = None
        if not self.optimizer.native or grad.device != update_device:
            scaled = update_tier.empty(Kind.BUFFER, grad.numel(), torch.float32)
            grad = scaled.copy_(grad).mul_(grad_scale)
            grad_scale = 1.0
        try:
            self.optimizer.step(grads={t: grad[p.start:p.stop] for p, t in stepped}, grad_scale=grad_scale,
                                outs={} if target is None else {t: target[p.start:p.stop] for p, t in stepped})
        finally:
            update_tier.free(Kind.BUFFER, scaled)

    def _start_window(self) -> None:
        """Counters cover one accumulation window: everything between two optimizer steps."""
        self.comm.counters.reset()
        self.param_scheduler.stats.reset(self.param_scheduler.live_bytes)
        self._io.reset()
        self._link.reset()
        self._window_started = time.perf_counter()

    def _record(self, updated: bool, norm_sq: float) -> None:
        counters = self.comm.counters
        self._stats = StepStats(
            step=self.global_steps, updated=updated, skipped_steps=self.skipped_steps,
            grad_norm=math.sqrt(norm_sq) if math.isfinite(norm_sq) else float("inf"), loss_scale=self.scaler.scale,
            lr=self.optimizer.param_groups[0]["lr"], data_elements=counters.data_elements,
            data_bytes=counters.data_bytes, control_elements=counters.control_elements, memory=self.memory_report(),
            prefetch=dataclasses.replace(self.param_scheduler.stats), io=dataclasses.replace(self._io),
            link=dataclasses.replace(self._link),
            seconds=time.perf_counter() - self._window_started)

    # ------------------------------------------------------------------ inspection
    @property
    def stats(self) -> StepStats | None:
        """The last optimizer step's telemetry (None before the first)."""
        return self._stats

    @_engine_call
    def memory_report(self) -> MemoryReport:
        return memory_report(self.tiers)

    @_engine_call
    def full_state_dict(self, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        """``model.state_dict()``'s keys with fp32 CPU parameters (from the masters) and buffers as they are.

        Collective: every rank must call it. Built unit by unit; rank 0 (every rank with ``all_ranks``)
        gets the dict, the others ``{}``. Frozen parameters have no master: their values are the
        weights' (``fp32_shard``).
        """
        values: dict[int, torch.Tensor] = {}
        for state in self.visit_optimizer_states(write=False):
            unit = state.unit
            shard = self.fp32_shard(state)
            flat = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=shard.device)
            if unit.layout.shards > 1:
                all_gather(self.comm, flat, shard)
            else:
                flat.copy_(shard)
            for slot in unit.layout.slots:
                values[id(slot.param)] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).cpu().clone()
        if not (all_ranks or self.comm.rank == 0):
            return {}
        return {name: values[id(t)] if id(t) in values else t.detach().cpu().clone()
                for name, t in self.module.state_dict(keep_vars=True).items()}

    def fp32_shard(self, state: UnitOptimizerState) -> torch.Tensor:
        """This rank's whole shard of ``state``'s unit in fp32 (``state`` loaded): the master over the
        trainable part, the weights past it. Those are frozen values, exact in fp32 runs; in bf16/fp16
        ones the compute-dtype values, since a frozen parameter keeps no fp32 copy."""
        master, trainable = state.master(), state.unit.trainable_numel
        if trainable == state.unit.layout.shard_numel:
            return master
        shard = torch.empty(state.unit.layout.shard_numel, dtype=torch.float32, device=master.device)
        shard[:trainable].copy_(master)
        with self._frozen_weights(state.unit) as frozen:
            shard[trainable:].copy_(frozen)
        return shard

    @contextlib.contextmanager
    def _frozen_weights(self, unit: FlatUnit) -> Iterator[torch.Tensor]:
        """This rank's weights of ``unit`` past its trainable part, readable for the duration: read from
        the shard's home when that is on NVMe (shards read ahead are let go first: they hold the block)."""
        trainable = unit.trainable_numel
        if unit.gathered:  # the full weights are here (always, for a unit not partitioned)
            yield unit.flat_param[unit.shard_range][trainable:]
            return
        if unit.param_block.resident:
            yield unit.param_block.data[trainable:]
            return
        self.param_scheduler.free_all()
        block, host = unit.param_block, self.tiers["host"]
        buffer = host.empty(Kind.BUFFER, block.nbytes, torch.uint8)
        try:
            block.load(buffer).wait()
            yield block.data[trainable:]
        finally:
            block.unload()
            host.free(Kind.BUFFER, buffer)

    @contextlib.contextmanager
    def gathered(self, modifier_rank: int = 0) -> Iterator[nn.Module]:
        """Full parameters readable and writable; on exit ``modifier_rank``'s writes reach the fp32 masters.

        Masters change only where the compute weights were changed, so untouched values keep their
        full fp32 precision under bf16/fp16; frozen parameters, which have no master, keep the written
        compute weights (stored home at stage 3). At stage 3 every unit is gathered for the duration
        (not bounded by ``zero.max_live_size``) and freed on exit.
        """
        self.ensure_open("gathered")
        with failing_together(self.comm):  # the user's block raising on one rank must not strand the others
            self.param_scheduler.gather_all()
            before = [u.flat_param[u.shard_range].clone() for u in self.units]  # only this rank's masters matter
            try:
                yield self.module
                for state, old in zip(self.visit_optimizer_states(write=True), before):
                    self._write_gathered(state.unit, old, modifier_rank)
            finally:
                self.param_scheduler.free_all()

    def _write_gathered(self, unit: FlatUnit, old: torch.Tensor, modifier_rank: int) -> None:
        """``modifier_rank``'s full parameters of ``unit`` to every rank, and the changed values of this
        rank's shard into its masters (and its shard home, if any changed; frozen values have no
        master: the weights and their home hold them)."""
        broadcast(self.comm, unit.flat_param, src=modifier_rank)
        new = unit.flat_param[unit.shard_range]
        changed = new != old
        if unit.partitioned and unit.param_block.writable and bool(changed.any()):
            write_block(unit.param_block, new, self.tiers["host"])
        if not unit.master_is_param:
            trainable = unit.trainable_numel
            changed, new = changed[:trainable], new[:trainable]
            unit.master[changed.to(unit.master.device)] = new[changed].float().to(unit.master.device)

    @_engine_call
    def save_checkpoint(self, directory: str | os.PathLike, tag: str | None = None,
                        client_state: dict | None = None) -> Path:
        """Write the whole training state under ``directory/tag`` (default ``step00000042``) and point
        ``directory/latest`` at it, atomically; collective. ``client_state``: JSON-serializable."""
        path = checkpoint.save_checkpoint(self, directory, tag, client_state)
        self._last_checkpoint = str(path)
        return path

    @_engine_call
    def load_checkpoint(self, directory: str | os.PathLike, tag: str | None = None, *,
                        verify: bool = True) -> dict | None:
        """Restore from ``directory/tag`` (default: ``latest``), whatever world size, stage or tiers
        saved it; returns the saved client state. Collective. ``verify=False`` skips the CRC pass over
        the data files (the manifest's digest is still checked): for files just verified."""
        client_state = checkpoint.load_checkpoint(self, directory, tag, verify=verify)
        self._last_checkpoint = f"{directory} ({tag or 'latest'})"
        return client_state

    @_engine_call
    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def ensure_open(self, call: str) -> None:
        """Refuse ``call`` on a closed engine, or on one whose process group a failure ended."""
        if self._closed:
            raise RuntimeError(f"engine is closed: {call}() needs a live engine (close() released its buffers "
                               "and swap files); build a new one with zo.initialize")
        if self.comm.ended is not None:
            raise RuntimeError(f"engine stopped after a failure ({self.comm.ended}): {call}() cannot run; build a "
                               f"new engine and load the last good checkpoint ({self._last_checkpoint or 'none'})")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks, stop accounting the engine's tensors and release its swap files; every
        later call raises. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for tier in self.tiers.values():
            tier.usage = {kind: 0 for kind in Kind}
            tier.close()
