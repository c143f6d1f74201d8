"""The engine: hooks into the module, backward with accumulation, the sharded optimizer step.

[Note: a step]
``engine(batch)`` runs the module (floating inputs cast to the compute dtype). ``engine.backward``
scales the loss by ``loss_scale / grad_accum_steps`` and runs autograd; a post-accumulate hook on
every trainable parameter adds its gradient into its unit's flat gradient (and drops ``.grad``). A
unit whose gradients are complete is handed to the reducer during backward: at stages 2–3 in every
backward (an offloaded unit's reduced shard then leaves for its grad home, ``offloaded_grads``),
at stages 0–1 in the one that closes the window; averaged over ranks (all-reduce at stage 0,
reduce-scatter to shard owners above), its squared norm taken as it lands (``FlatUnit.grad_sumsq``).
``engine.step`` at the accumulation boundary then:
1. in ONE small control all-reduce sums the squared norms and the "had a gradient" flag of every
   parameter over ranks;
2. skips the step everywhere if fp16 gradients overflowed, else folds the unscale and the clip to
   ``train.grad_clip`` into one gradient scale;
3. unit by unit, its optimizer block loaded (``optim.state``; streamed when on NVMe): the update of the
   pieces whose parameters had a gradient somewhere (others skip, as torch skips ``grad is None``;
   frozen parameters have no pieces, and units with no trainable parameter are neither reduced nor
   updated: optim.state's frozen prefix rule), writing the new compute weights where they are
   published (``update``, ``publication``): all-gathered at stages 1–2, a partitioned unit's shard at
   stage 3, gathered again at its next use by the ``ParamScheduler`` (``param_hooks``).
The parts: ``placement`` decides where every unit's state lives, ``sharded_state`` holds it,
``update`` and ``backward_updates`` change it, ``state_dicts`` reads and writes it whole.

Updates that need nothing global run in backward instead (``backward_updates``' note).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from . import checkpoint
from .activation_offload import HostActivations
from .activations import ActivationProfile, checkpoint_forward
from .comm import Comm, all_gather_object, control_all_reduce, failing_together
from .config import Config
from .memory_plan import check_memory
from .optim import build_scheduler
from .optim.state import UnitOptimizerState
from .precision import COMPUTE_DTYPES, LossScaler, cast_floats
from .skip_streak import SkipStreak
from .telemetry import MemoryReport, Prediction, StepStats, WindowMeter, memory_report
from .tiers import DeviceCopier, LinkStats, close_tiers, make_tiers, open_swap, release_idle
from .tiers.streams import SideStreams
from .trace import RECORDER, ArmedTrace, forward_segments, segment
from .zero.backward_updates import BackwardUpdates
from .zero.param_hooks import register_param_hooks
from .zero.partition import FlatUnit
from .zero.placement import activations_leave_device
from .zero.reduction import GradReducer, Mode, reduction_order
from .zero.scheduler import ParamScheduler, check_live_bound
from .zero.sharded_state import ShardedState, Values, eager_values, make_units
from .zero.state_dicts import StateDicts
from .zero.unit_layout import UnitLayout
from .zero.update import Updater, grad_scale

__all__ = ["Engine"]

logger = logging.getLogger(__name__)


def _engine_call(method: Any) -> Any:
    """A public engine call: refused on a closed engine, and after which no peer is left waiting in a
    collective when this rank raises (comm's [Note: failing together])."""
    @functools.wraps(method)
    def guarded(self: "Engine", *args: Any, **kwargs: Any) -> Any:
        self.ensure_open(method.__name__)
        with failing_together(self.comm):
            return method(self, *args, **kwargs)
    return guarded


class Engine:
    """Trains one module with ZeRO stages 0–3; see [Note: a step]."""

    def __init__(self, module: nn.Module, layouts: list[UnitLayout], config: Config, comm: Comm,
                 param_groups: list[dict] | None,
                 values: Values = eager_values, activations: ActivationProfile | None = None,
                 prediction: Prediction | None = None):
        self.module = module
        self.config = config
        self.comm = comm
        self.stage = config.zero.stage
        self.compute_dtype = COMPUTE_DTYPES[config.train.precision]
        if not layouts:
            raise ValueError("the model has no parameters to train")
        self.tiers = make_tiers(config.memory, comm.device)
        self.placement, plan = check_memory(module, layouts, config, self.tiers, activations, comm.world_size,
                                            comm.device)
        self.units = make_units(layouts, self.placement, comm.rank, self.compute_dtype)
        partitioned = [u for u in self.units if u.partitioned]
        check_live_bound(partitioned, config.zero.max_live_size)
        self._io, self._link = open_swap(self.tiers, plan, config, comm.rank), LinkStats()
        self.state = ShardedState(module, config, comm, self.units, self.placement, self.tiers, self._link,
                                  param_groups, values)
        self.opt_states, self.optimizer = self.state.opt_states, self.state.optimizer
        streams = SideStreams(comm.device)  # every side stream the engine's copies use (streams' note)
        self.param_scheduler = ParamScheduler(
            comm, partitioned, self.state.compute, self.state.staging, prefetch_bytes=config.zero.prefetch_size,
            max_live_bytes=config.zero.max_live_size,
            copier=DeviceCopier(self.state.compute, self._link, streams) if self.placement.shards_off_device else None)
        self._updater = Updater(self.state, self.param_scheduler)
        self._state_dicts = StateDicts(self.state, self.param_scheduler, self._updater)
        self.scheduler = build_scheduler(self.optimizer, config.scheduler)
        self.scaler = LossScaler(config.train)
        mode = Mode.REDUCE_SCATTER if self.placement.reduce_scatters else Mode.ALL_REDUCE
        self.reducer = GradReducer(comm, reduction_order(self.units), mode, config.zero.bucket_size,
                                   self.state.compute, on_reduced=self._on_reduced,
                                   flagged=lambda unit: unit.placement.updates_in_backward)
        self._backward = BackwardUpdates(self.state, self._updater, self.reducer.order, lambda: self._last_checkpoint)
        self._hooks = [slot.param.register_post_accumulate_grad_hook(partial(self._on_grad, unit, index))
                       for unit in self.units for index, slot in enumerate(unit.layout.slots) if slot.trainable]
        if partitioned:
            self._hooks += register_param_hooks(module, partitioned, self.param_scheduler)
        self._hooks += forward_segments([(unit.layout.name, unit.layout.module) for unit in self.units])
        self._activations = (HostActivations(self.state.staging, comm.device, streams)
                             if activations_leave_device(config, comm.device) else None)
        if config.train.activation_checkpointing:  # block units; the root unit holds the embeddings and head
            for unit in (u for u in self.units if u.layout.name):
                checkpoint_forward(unit.layout.module, self._activations)
        self.micro_steps = self.global_steps = self.skipped_steps = 0
        self._stepped_at = 0
        """The micro-step after which ``step()`` last ran (a window is stepped once)."""
        self._stats: StepStats | None = None
        self._window_skipped: str | None = None
        """Why this accumulation window will not update (``train.skip_nonfinite``), once it is known."""
        self.skip_streak = SkipStreak(config.train.max_skip_streak)
        self._last_checkpoint: str | None = None
        """The checkpoint this engine last saved or loaded: where to go back to after poisoned updates."""
        self._closed = False
        self._trace: ArmedTrace | None = None
        self._meter = WindowMeter(comm.counters, self.param_scheduler.stats, lambda: self.param_scheduler.live_bytes,
                                  self._io, self._link, prediction)
        self._meter.start()

    # ------------------------------------------------------------------ forward and backward
    @segment("forward")
    @_engine_call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compute_dtype != torch.float32:
            args, kwargs = cast_floats(args, self.compute_dtype), cast_floats(kwargs, self.compute_dtype)
        with self._meter.phase("forward"):
            if self._activations is not None:
                self._activations.begin_forward()
            return self.module(*args, **kwargs)

    def _on_grad(self, unit: FlatUnit, index: int, param: nn.Parameter) -> None:
        complete = unit.accumulate(index, param.grad, self.state.compute)
        param.grad = None
        if not complete:
            return
        RECORDER.finish_as(f"backward {unit.name}", then="backward: reduce")
        if (self.placement.reduces_every_backward or self._backward.closes_window) and self.config.zero.overlap_comm:
            self.reducer.mark_ready(unit)  # without overlap_comm, flush() reduces after backward

    def _on_reduced(self, unit: FlatUnit, shard: torch.Tensor, flags: torch.Tensor | None) -> None:
        """The reducer's hand-off of ``unit``'s reduced shard: updated at once, or kept for the step."""
        if self._window_skipped is not None:
            return  # the window will not update: its gradients are not kept
        if unit.grad_leaves:  # for the tier or for the update
            self._link.device_to_host_bytes += shard.numel() * unit.compute_dtype.itemsize
        if not self._backward.take(unit, shard, flags, self.scaler.scale):
            unit.add_grad_shard(shard, self.state.compute)
            if self._backward.closes_window:
                unit.grad_sumsq()  # its part of the step's norm, read while the gradient is fresh
        self._window_skipped = self._backward.skipped

    @segment("backward: reduce")
    @_engine_call
    def backward(self, output: Any) -> None:
        """Backward of a loss (or of ``output.loss``), scaled by loss scale / ``grad_accum_steps``.

        With ``train.skip_nonfinite``, a loss that is inf/NaN on any rank (one flag, all-reduced here)
        marks the window skipped and runs no backward at all: its gradients would be discarded."""
        with self._meter.phase("backward"):
            self._backward_pass(output if isinstance(output, torch.Tensor) else output.loss)

    def _backward_pass(self, loss: torch.Tensor) -> None:
        self._check_step_called()
        if self.config.train.skip_nonfinite and self._window_skipped is None:
            self._window_skipped = self._nonfinite_loss(loss)
        if self._window_skipped is not None:
            self.param_scheduler.abandon_pass()
            self.micro_steps += 1
            return
        for unit in self.units:
            unit.begin_backward()
        self._backward.start(closes_window=(self.micro_steps + 1) % self.config.train.grad_accum_steps == 0)
        if self._activations is not None:
            self._activations.prefetch_last()
        try:
            (loss * (self.scaler.scale / self.config.train.grad_accum_steps)).backward()
            if self.placement.reduces_every_backward or self._backward.closes_window:
                self.reducer.flush()
                self.state.grad_writer.finish()
        except BaseException:
            self._backward.abandon()
            raise
        self._backward.finish()
        self.param_scheduler.end_pass()
        release_idle(self.tiers)  # the phase's buffers kept for reuse go: buffer_arena's note
        self.micro_steps += 1

    def _check_step_called(self) -> None:
        """A backward after the one that closed a window, with no ``step()`` between, would fold two
        windows into one update (or apply two, where units update in backward): refused."""
        if self.is_accumulation_boundary and self._stepped_at != self.micro_steps:
            raise RuntimeError(
                f"backward() called again before step(): with train.grad_accum_steps = "
                f"{self.config.train.grad_accum_steps}, backward number {self.micro_steps} closed an accumulation "
                "window; call engine.step() after every backward(), or raise train.grad_accum_steps to accumulate "
                "more micro-batches per update")

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
    @segment("step")
    @_engine_call
    def step(self) -> bool:
        """Call after every backward; updates at accumulation boundaries and returns whether it did."""
        if not self.is_accumulation_boundary or self._stepped_at == self.micro_steps:
            return False
        try:
            return self._step()
        finally:
            if self._trace is not None and self._trace.step_done():
                self._trace = None

    def _step(self) -> bool:
        started = time.perf_counter()
        self._stepped_at = self.micro_steps
        norm_sq = math.inf
        expected = self._window_skipped is None and self.scaler.enabled  # an fp16 overflow, if one is found now
        if self._window_skipped is None:
            norm_sq, had_grad = self._updater.norm_and_flags()
            norm_sq /= self.scaler.scale ** 2
            if not math.isfinite(norm_sq) and (self.scaler.enabled or self.config.train.skip_nonfinite):
                self._window_skipped = "inf/NaN gradients" if self.scaler.enabled else "non-finite gradient norm"
        overflow, reason = self._window_skipped is not None, self._window_skipped
        scale = None if overflow else grad_scale(norm_sq, self.config.train.grad_clip, self.scaler.scale)
        undone = self._backward.settle(keep=scale == 1.0 / self.scaler.scale)  # tentative updates: kept if unclipped
        if overflow:
            self.skipped_steps += 1
            logger.warning("step %d skipped (%s); %d skipped so far", self.global_steps + 1, self._window_skipped,
                           self.skipped_steps)
            self._window_skipped = None
            self._updater.republish(undone)
        else:
            self.optimizer.step_with(lambda: self._updater.step_units(had_grad, scale))  # with the undone units
        for unit in self.units:
            unit.clear_grads(self.state.compute)
        release_idle(self.tiers)
        self.scaler.update(overflow)
        self.global_steps += 1
        if self.scheduler is not None and not overflow:
            self.scheduler.step()
        self._stats = self._meter.stats(step=self.global_steps, updated=not overflow,
                                        skipped_steps=self.skipped_steps, norm_sq=norm_sq, loss_scale=self.scaler.scale,
                                        lr=self.optimizer.param_groups[0]["lr"], memory=self.memory_report(),
                                        undone_updates=len(undone), step_started=started)
        self._meter.start()
        if not overflow:
            self.skip_streak.updated()
        elif not expected:  # may raise: after the step's bookkeeping, so the engine stays consistent
            self.skip_streak.skipped(reason, self.global_steps, self._last_checkpoint)
        return not overflow

    @_engine_call
    def trace(self, path: str | os.PathLike, steps: int = 1) -> None:
        """Record the next ``steps`` optimizer steps into a Chrome trace at ``path`` (trace's [Note:
        step traces]); call it between steps. Every rank must call it: at the last step rank 0 writes
        one file with every rank's events."""
        gather = (lambda events: all_gather_object(self.comm, events)) if self.comm.world_size > 1 else (
            lambda events: [events])
        self._trace = ArmedTrace(path, steps, gather, writes=self.comm.rank == 0)
        for name, tier in self.tiers.items():  # each counter starts at what its tier holds, not at its next change
            RECORDER.counter(name, tier.used)

    # ------------------------------------------------------------------ inspection and whole values
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
        weights' (``StateDicts.fp32_shard``).
        """
        return self._state_dicts.full_state_dict(all_ranks)

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
            with self._state_dicts.gathered(modifier_rank) as module:
                yield module

    def visit_optimizer_states(self, *, write: bool, read: bool = True) -> Iterator[UnitOptimizerState]:
        """Each unit's optimizer state loaded, in unit order (``ShardedState.visit``): for checkpoints."""
        return self.state.visit(write=write, read=read)

    def fp32_shard(self, state: UnitOptimizerState) -> torch.Tensor:
        return self._state_dicts.fp32_shard(state)

    @_engine_call
    def set_optimizer_states(self, fill: Callable[[UnitOptimizerState, torch.Tensor | None], None], *,
                             whole: bool) -> None:
        """Set masters (and moments) from outside the step — a checkpoint or pretrained weights — and
        publish the new compute weights (``StateDicts.set_optimizer_states``)."""
        self._state_dicts.set_optimizer_states(fill, whole=whole)

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
        if self._trace is not None:  # armed and never finished: the recorder stops with the engine
            RECORDER.stop()
            self._trace = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.state.grad_reader.close()
        close_tiers(self.tiers)
