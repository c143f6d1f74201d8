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
``window`` runs the accumulation window (its backwards, skips, reductions and the step's verdict),
``update`` and ``backward_updates`` change the state, ``state_dicts`` reads and writes it whole.

Updates that need nothing global run in backward instead (``backward_updates``' note).
"""
from __future__ import annotations

import contextlib
import os
import time
from functools import partial, wraps
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from . import checkpoint
from .activation_offload import HostActivations
from .activations import ActivationProfile, checkpoint_blocks
from .comm import Comm, all_gather_object, failing_together
from .config import Config
from .memory_plan import check_memory, local_ranks
from .optim import build_scheduler
from .precision import COMPUTE_DTYPES, LossScaler, cast_floats
from .telemetry import MemoryReport, Prediction, StepStats, WindowMeter, memory_report
from .tiers import DeviceCopier, LinkStats, close_tiers, make_tiers, open_swap, release_idle
from .tiers.streams import SideStreams
from .trace import RECORDER, ArmedTrace, forward_segments, segment
from .zero.param_hooks import register_param_hooks
from .zero.placement import activations_leave_device
from .zero.scheduler import ParamScheduler, check_live_bound
from .zero.sharded_state import ShardedState, Values, eager_values, make_units
from .zero.state_dicts import StateDicts
from .zero.unit_layout import UnitLayout
from .zero.update import Updater
from .zero.window import Window

__all__ = ["Engine"]


def _engine_call(method: Any) -> Any:
    """A public engine call: refused on a closed engine, and after which no peer is left waiting in a
    collective when this rank raises (comm's [Note: failing together])."""
    @wraps(method)
    def guarded(self: "Engine", *args: Any, **kwargs: Any) -> Any:
        self.ensure_open(method.__name__)
        with failing_together(self.comm):
            self.saves.check(method.__name__)  # a background save's error surfaces here (async_save's note)
            return method(self, *args, **kwargs)
    return guarded


class Engine:
    """Trains one module with ZeRO stages 0–3; see [Note: a step]."""

    def __init__(self, module: nn.Module, layouts: list[UnitLayout], config: Config, comm: Comm,
                 param_groups: list[dict] | None, values: Values = eager_values,
                 activations: ActivationProfile | None = None, prediction: Prediction | None = None):
        self.module = module
        self.config = config
        self.comm = comm
        self.compute_dtype = COMPUTE_DTYPES[config.train.precision]
        if not layouts:
            raise ValueError("the model has no parameters to train")
        self.tiers = make_tiers(config.memory, comm.device)
        self.placement, plan = check_memory(module, layouts, config, self.tiers, activations, comm.world_size,
                                            comm.device)
        self.units = make_units(layouts, self.placement, comm.rank, self.compute_dtype)
        partitioned = [u for u in self.units if u.partitioned]
        check_live_bound(partitioned, config.zero.max_live_size)
        self._io, self._link = open_swap(self.tiers, plan, config, comm.rank, local_ranks(comm.world_size)), LinkStats()
        self.state = ShardedState(module, config, comm, self.units, self.placement, self.tiers, self._link,
                                  param_groups, values)
        self.opt_states, self.optimizer = self.state.opt_states, self.state.optimizer
        streams = SideStreams(comm.device)  # every side stream the engine's copies use (streams' note)
        self.param_scheduler = ParamScheduler(
            comm, partitioned, self.state.compute, self.state.staging, prefetch_bytes=config.zero.prefetch_size,
            max_live_bytes=config.zero.max_live_size,
            copier=DeviceCopier(self.state.compute, self._link, streams) if self.placement.shards_off_device else None)
        self._updater = Updater(self.state, self.param_scheduler, streams)
        self.state_dicts = StateDicts(self.state, self.param_scheduler, self._updater)
        """Whole values in and out: state dicts, gathered parameters, checkpoints' and weights' masters."""
        self.lr_scheduler = build_scheduler(self.optimizer, config.scheduler)
        self.scaler = LossScaler(config.train)
        self.window = Window(config, self.state, self._updater, comm, self._link, self.scaler)
        self._hooks = self.window.grad_hooks()
        if partitioned:
            self._hooks += register_param_hooks(module, partitioned, self.param_scheduler)
        self._hooks += forward_segments([(unit.layout.name, unit.layout.module) for unit in self.units])
        self.host_activations = (HostActivations(self.state.staging, comm.device, streams)
                             if activations_leave_device(config, comm.device) else None)
        if config.train.activation_checkpointing:
            checkpoint_blocks([unit.layout for unit in self.units], self.host_activations)
        self._stats: StepStats | None = None
        self.saves = checkpoint.Saves(self, checkpoint.load_checkpoint)  # saves (one in the background) and loads
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
            if self.host_activations is not None:
                self.host_activations.begin_forward()
            return self.module(*args, **kwargs)

    @segment("backward: reduce")
    @_engine_call
    def backward(self, output: Any, *, scale_wrt_gas: bool = True, closes_window: bool | None = None) -> None:
        """Backward of a loss (or ``output.loss``) × loss scale / ``grad_accum_steps`` (undivided with
        ``scale_wrt_gas=False``; ``closes_window``: the caller ends windows: window's note). A loss inf/NaN
        on any rank skips the window under ``train.skip_nonfinite``: no backward runs (all-reduced flag)."""
        with self._meter.phase("backward"):
            self._backward_pass(getattr(output, "loss", output), scale_wrt_gas, closes_window)

    def _backward_pass(self, loss: torch.Tensor, scale_wrt_gas: bool, closes_window: bool | None) -> None:
        if not self.window.begin_backward(loss, closes_window):  # a skipped window: nothing to run (window's note)
            self.param_scheduler.abandon_pass()
            return
        if self.host_activations is not None:
            self.host_activations.prefetch_last()
        try:
            (loss * self.window.loss_factor(scale_wrt_gas)).backward()
            self.window.finish_reductions()
        except BaseException:
            self.window.abandon_backward()
            raise
        self.window.end_backward()
        self.param_scheduler.end_pass()
        release_idle(self.tiers)  # the phase's buffers kept for reuse go: buffer_arena's note

    @property
    def is_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` updates: the last backward closed an accumulation window."""
        return self.window.at_boundary

    # ------------------------------------------------------------------ the step
    @segment("step")
    @_engine_call
    def step(self) -> bool:
        """Call after every backward; updates at accumulation boundaries and returns whether it did."""
        if not self.window.step_due:
            return False
        try:
            return self._step()
        finally:
            if self._trace is not None and self._trace.step_done():
                self._trace = None

    def _step(self) -> bool:
        """The window's verdict applied: the update (tentative ones undone redone with it) or the skip."""
        started = time.perf_counter()
        verdict = self.window.verdict()
        if verdict.updates:
            self.optimizer.step_with(lambda: self._updater.step_units(verdict.had_grad, verdict.scale))
        else:
            self._updater.republish(verdict.undone)
        self._updater.end_window()  # gradients cleared (a unit whose update runs beside the next forward: as it ends)
        self.scaler.update(not verdict.updates)
        self.window.close(verdict)
        if self.lr_scheduler is not None and verdict.updates:
            self.lr_scheduler.step()
        self._stats = self._meter.stats(step=self.window.global_steps, updated=verdict.updates,
                                        skipped_steps=self.window.skipped_steps,
                                        norm_sq=verdict.norm_sq, loss_scale=self.scaler.scale,
                                        lr=self.optimizer.param_groups[0]["lr"], memory=self.memory_report(),
                                        undone_updates=len(verdict.undone), step_started=started)
        self._meter.start()
        self.window.end_step(verdict)  # may raise: after the step's bookkeeping, so the engine stays consistent
        return verdict.updates

    @_engine_call
    def trace(self, path: str | os.PathLike, steps: int = 1) -> None:
        """Record the next ``steps`` optimizer steps into a Chrome trace at ``path`` (trace's [Note:
        step traces]); call it between steps. Every rank must call it: at the last step rank 0 writes
        one file with every rank's events."""
        self._trace = ArmedTrace(path, steps, partial(all_gather_object, self.comm), writes=self.comm.rank == 0,
                                 counters={name: tier.used for name, tier in self.tiers.items()})

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
        return self.state_dicts.full_state_dict(all_ranks)

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
            self.saves.check("gathered")
            with self.state_dicts.gathered(modifier_rank) as module:
                yield module

    @_engine_call
    def save_checkpoint(self, directory: str | os.PathLike, tag: str | None = None, client_state: dict | None = None,
                        *, blocking: bool = True) -> "Path | checkpoint.SaveHandle":
        """Write the whole training state under ``directory/tag`` (default ``step00000042``) and point
        ``directory/latest`` at it, atomically; collective. ``client_state``: JSON-serializable.
        ``blocking=False``: returns a handle (``wait()``, ``done()``) while the files are written
        (checkpoint.async_save's [Note: saving in the background])."""
        return self.saves.save(directory, tag, client_state, blocking, self._updater.step_updates)

    @_engine_call
    def load_checkpoint(self, directory: str | os.PathLike, tag: str | None = None, *,
                        verify: bool = True) -> dict | None:
        """Restore from ``directory/tag`` (default: ``latest``), whatever world size, stage or tiers
        saved it; returns the saved client state. Collective. ``verify=False`` skips the CRC pass over
        the data files (the manifest's digest is still checked): for files just verified."""
        self._updater.step_updates.join()  # and before anything is replaced
        return self.saves.load(directory, tag, verify)

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
                               f"new engine and load the last good checkpoint ({self.window.last_checkpoint or 'none'})")

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
        with self.saves.closing():  # a save in the background is published first; its error raises after this
            if self._trace is not None:  # armed and never finished: the recorder stops with the engine
                RECORDER.stop()
                self._trace = None
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            self._updater.close()  # the step's updates waited for, the gradient reader closed
            close_tiers(self.tiers)
