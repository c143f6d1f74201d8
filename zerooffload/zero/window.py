"""The accumulation window: its backwards, the rule that skips it, its reductions, and its step's verdict.

[Note: the window]
An optimizer step closes a window of ``train.grad_accum_steps`` micro-batches (or fewer, where the
caller says a backward closes it: the Trainer's last window of an epoch). ``Window`` owns that
cycle, so the engine only forwards to it:
- its *state* (``WindowState``), moved by the window's own methods only, each move checked (a move the
  states below do not allow raises, as ``FlatUnit``'s do)::

      OPEN/CLOSED --begin_backward--> ACCUMULATING --end_backward (the closing one)--> STEPPING
      OPEN/CLOSED/ACCUMULATING/STEPPING --skip--> SKIPPED
      STEPPING/SKIPPED at the boundary --close--> CLOSED

  A backward in STEPPING, or in SKIPPED at the boundary, is refused (it would fold two windows into
  one update): call ``step()`` after every backward;
- the *skip rule* (``train.skip_nonfinite``): a loss that is inf/NaN on any rank (one control
  all-reduce), a non-finite gradient reaching an update in backward, or a non-finite global norm skips
  the whole window on every rank; a skipped window's later backwards only count their micro-batches,
  and too many skipped windows in a row stop the run (``skip_streak``);
- the *reductions*: the reducer (``reduction``) and its callbacks. A unit whose gradients are complete
  is reduced during backward (in every backward where ``Placement.reduces_every_backward``, else in
  the one that closes the window); its reduced shard is handed to an update in backward
  (``backward_updates``) or kept for the step;
- the *step's verdict*: the window's norm and "had a gradient" flags, whether it updates, and the
  gradient scale (unscale and clip folded in) it updates with; then the counters it closes with.
"""
from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field
from functools import partial
import torch
from torch import nn

from ..comm import Comm, control_all_reduce
from ..config import Config
from ..precision import LossScaler
from ..skip_streak import SkipStreak
from ..tiers import LinkStats
from ..trace import RECORDER
from .backward_updates import BackwardUpdates, Handoff
from .partition import FlatUnit
from .reduction import GradReducer, Mode, reduction_order
from .sharded_state import ShardedState
from .update import Updater, grad_scale

__all__ = ["Verdict", "Window", "WindowError", "WindowState"]

logger = logging.getLogger(__name__)


class WindowState(enum.Enum):
    """Where the current accumulation window is (see [Note: the window])."""

    OPEN = "open"
    """No backward of a window has run yet: the engine is new, or a checkpoint was just loaded."""
    ACCUMULATING = "accumulating"
    """Backwards of this window ran, and more micro-batches are due before its boundary."""
    SKIPPED = "skipped"
    """A non-finite loss or gradient was found: the window will not update and keeps no gradient; its
    later backwards only count their micro-batches."""
    STEPPING = "stepping"
    """The backward that closes the window ran (its updates in backward with it): ``step()`` is due."""
    CLOSED = "closed"
    """``step()`` ran for the window, updating or skipping it; the next backward opens the next one."""


class WindowError(RuntimeError):
    """A call the window's state does not allow (see [Note: the window])."""


@dataclass(slots=True)
class Verdict:
    """What the step does with a window: update it (with ``scale``) or skip it (``reason``)."""

    norm_sq: float = math.inf
    """The window's squared gradient norm, unscaled (inf when it is skipped before the norm is taken)."""
    had_grad: list[torch.Tensor] = field(default_factory=list)
    """Each unit's slots' "had a gradient on some rank" counts."""
    reason: str | None = None
    """Why the window is skipped; None when it updates."""
    expected: bool = False
    """The skip is an fp16 overflow: the loss scale's business, no part of a skip streak."""
    scale: float | None = None
    """The gradient scale of the update: unscale and clip in one factor (None when skipped)."""
    undone: list[FlatUnit] = field(default_factory=list)
    """Units whose tentative updates in backward the step undid (to redo, or republish when skipped)."""

    @property
    def updates(self) -> bool:
        return self.reason is None


class Window:
    """The accumulation window of one engine (see [Note: the window])."""

    def __init__(self, config: Config, state: ShardedState, updater: Updater, comm: Comm, link: LinkStats,
                 scaler: LossScaler):
        self.config, self.state, self.updater, self.comm, self.link = config, state, updater, comm, link
        self.scaler = scaler
        self.placement = state.placement
        self.accum = config.train.grad_accum_steps
        mode = Mode.REDUCE_SCATTER if self.placement.reduce_scatters else Mode.ALL_REDUCE
        self.reducer = GradReducer(comm, reduction_order(state.units), mode, config.zero.bucket_size, state.compute,
                                   on_reduced=self._on_reduced, flagged=lambda unit: unit.placement.updates_in_backward)
        self.updates = BackwardUpdates(state, updater, self.reducer.order, lambda: self.last_checkpoint)
        """The updates of the backward that closes the window, for units placed to update in backward."""
        self.streak = SkipStreak(config.train.max_skip_streak)
        self.last_checkpoint: str | None = None
        """The checkpoint the engine last saved or loaded: where to go back to after poisoned updates."""
        self.micro_steps = self.global_steps = self.skipped_steps = 0
        self.in_window = 0
        """Micro-batches of the open window so far (0 once a backward closed it)."""
        self._closes = False
        """The running backward closes its window."""
        self.reason: str | None = None
        """Why the window is skipped, once it is known."""
        self._window_state = WindowState.OPEN

    @property
    def window_state(self) -> WindowState:
        return self._window_state

    @property
    def at_boundary(self) -> bool:
        """The last backward closed a window (``engine.is_accumulation_boundary``)."""
        return self.micro_steps > 0 and self.in_window == 0

    @property
    def step_due(self) -> bool:
        """``step()`` has a window to close: the closing backward ran, and no step since."""
        return self.at_boundary and self._window_state in (WindowState.STEPPING, WindowState.SKIPPED)

    def _move(self, action: str, to: WindowState, *allowed: WindowState) -> None:
        if self._window_state not in allowed:
            raise WindowError(f"the accumulation window cannot {action}: it is {self._window_state.name}, and {action} "
                              f"needs {' or '.join(s.name for s in allowed)}")
        self._window_state = to

    # ------------------------------------------------------------------ gradients as they arrive
    def grad_hooks(self) -> list:
        """A post-accumulate-grad hook on every trainable parameter: its gradient joins its unit's; and the
        forward pre-hooks that wait for the last step's updates (``Updater.forward_hooks``)."""
        return [slot.param.register_post_accumulate_grad_hook(partial(self._on_grad, unit, index))
                for unit in self.state.units for index, slot in enumerate(unit.layout.slots) if slot.trainable
                ] + self.updater.forward_hooks()

    def _on_grad(self, unit: FlatUnit, index: int, param: nn.Parameter) -> None:
        complete = unit.accumulate(index, param.grad, self.state.compute)
        param.grad = None
        if not complete:
            return
        RECORDER.finish_as(f"backward {unit.name}", then="backward: reduce")
        if self._reduces_now and self.config.zero.overlap_comm:
            self.reducer.mark_ready(unit)  # without overlap_comm, flush() reduces after backward

    def _on_reduced(self, unit: FlatUnit, shard: torch.Tensor, flags: torch.Tensor | None, lent: bool) -> bool:
        """The reducer's hand-off of ``unit``'s reduced shard: updated in backward, or kept for the step;
        whether a ``lent`` shard is kept by its update (which then releases it)."""
        if self.reason is not None:
            return False  # the window will not update: its gradients are not kept
        left = self._leaving(unit, shard) if unit.grad_leaves else shard  # for the tier or for the update
        handoff = self.updates.take(unit, left, flags, self.scaler.scale, lent, owned=left is not shard)
        if handoff is Handoff.NOT_TAKEN:
            unit.add_grad_shard(left, self.state.compute)
            if self.updates.closes_window:
                unit.grad_sumsq()  # its part of the step's norm, read while the gradient is fresh
        if self.updates.skipped is not None:
            self.skip(self.updates.skipped)
        return handoff is Handoff.HELD

    def _leaving(self, unit: FlatUnit, shard: torch.Tensor) -> torch.Tensor:
        """``unit``'s reduced shard as it leaves the device, for its grad home or its update: the window's first
        part (or whole gradient) in the compute dtype, cast where it is (a sum over ranks is fp32: reduction's
        note), since where it goes it is rounded to that dtype anyway (the same rounding, bitwise); a later
        part of an accumulating window crosses as it is, so that adding it to the earlier parts rounds once,
        as on the device; its trainable span's bytes counted, which is what crosses. A cast is a tensor of
        its own (``take``'s ``owned``): the update worker need not copy it."""
        kept = unit.offloaded_grad
        if shard.dtype != unit.compute_dtype and (kept is None or not kept.written):
            shard = shard.to(unit.compute_dtype)
        self.link.device_to_host_bytes += min(unit.trainable_span, shard.numel()) * shard.element_size()
        return shard

    @property
    def _reduces_now(self) -> bool:
        """This backward reduces its units: every backward does, or this one closes the window."""
        return self.placement.reduces_every_backward or self.updates.closes_window

    # ------------------------------------------------------------------ backward
    def begin_backward(self, loss: torch.Tensor, closes_window: bool | None = None) -> bool:
        """A backward of ``loss`` begins: False when its window is skipped (nothing to run: the micro-batch
        is counted), else the units and the updates in backward are readied. ``closes_window``: whether
        this micro-batch ends its window; None: when it is the ``train.grad_accum_steps``-th. The last step's
        updates are joined first (step_updates' note): this backward's gradients and updates follow them."""
        self.updater.step_updates.join()
        if self.step_due:
            raise WindowError(
                f"backward() called again before step(): with train.grad_accum_steps = {self.accum}, backward "
                f"number {self.micro_steps} closed an accumulation window; call engine.step() after every "
                "backward(), or raise train.grad_accum_steps to accumulate more micro-batches per update")
        if self._window_state is not WindowState.SKIPPED:
            self._move("begin a backward", WindowState.ACCUMULATING, WindowState.OPEN, WindowState.CLOSED,
                       WindowState.ACCUMULATING)
            if self.config.train.skip_nonfinite:
                reason = self._nonfinite_loss(loss)
                if reason is not None:
                    self.skip(reason)
        if closes_window is False and self.accum == 1:
            raise WindowError("backward(closes_window=False) with train.grad_accum_steps = 1: gradients are not kept "
                              "across backwards; set train.grad_accum_steps to the window's length")
        self._closes = self.in_window + 1 >= self.accum if closes_window is None else closes_window
        if self._window_state is WindowState.SKIPPED:
            self._count_micro_batch()
            return False
        for unit in self.state.units:
            unit.begin_backward()
        self.updates.start(closes_window=self._closes)
        return True

    def _count_micro_batch(self) -> None:
        self.micro_steps += 1
        self.in_window = 0 if self._closes else self.in_window + 1

    def loss_factor(self, scale_wrt_gas: bool) -> float:
        """What a backward multiplies its loss by: the loss scale, over the window's length unless the
        caller divided the loss already (``scale_wrt_gas=False``, DeepSpeed's name)."""
        return self.scaler.scale / (self.accum if scale_wrt_gas else 1)

    def finish_reductions(self) -> None:
        """Autograd is done: reduce what is left (where this backward reduces), join the updates in backward
        (update_worker's note: nothing after this reads a state they may still write) and send kept shards
        home (a tentative update stores its kept gradient through the same writer)."""
        if self._reduces_now:
            self.reducer.flush()
            self.updates.join()
            self.state.grad_writer.finish()

    def end_backward(self) -> None:
        """The backward is over: its updates stored, its micro-batch counted, the window moved on."""
        self.updates.finish()
        self._count_micro_batch()
        if self._window_state is WindowState.ACCUMULATING and self.at_boundary:
            self._window_state = WindowState.STEPPING

    def abandon_backward(self) -> None:
        """The backward failed: the updates' stream waits for its transfers (the first error is the one)."""
        self.updates.abandon()

    def skip(self, reason: str) -> None:
        """The window will not update: ``reason`` (the first one found stands)."""
        if self._window_state is not WindowState.SKIPPED:
            self._move("be skipped", WindowState.SKIPPED, WindowState.OPEN, WindowState.ACCUMULATING,
                       WindowState.STEPPING, WindowState.CLOSED)
            self.reason = reason

    def _nonfinite_loss(self, loss: torch.Tensor) -> str | None:
        """Why the window is skipped, if this loss is inf/NaN on any rank (one control all-reduce)."""
        bad = torch.tensor([0.0 if bool(torch.isfinite(loss.detach()).all()) else 1.0], dtype=torch.float64)
        if self.comm.world_size > 1:
            bad = control_all_reduce(self.comm, bad.to(self.comm.device)).cpu()
        return None if bad.item() == 0 else f"non-finite loss on {int(bad.item())} rank(s)"

    # ------------------------------------------------------------------ the step
    def verdict(self) -> Verdict:
        """Whether and how the step updates this window: its norm and flags (one control all-reduce) unless
        it is skipped already, the skip an overflow or a non-finite norm makes, the gradient scale, and the
        tentative updates in backward kept (unclipped) or undone."""
        verdict = Verdict(reason=self.reason)
        if verdict.reason is None:
            norm_sq, verdict.had_grad = self.updater.norm_and_flags()
            verdict.norm_sq = norm_sq / self.scaler.scale ** 2
            if not math.isfinite(verdict.norm_sq) and (self.scaler.enabled or self.config.train.skip_nonfinite):
                verdict.expected = self.scaler.enabled  # an fp16 overflow: the loss scale's business
                verdict.reason = "inf/NaN gradients" if self.scaler.enabled else "non-finite gradient norm"
        if verdict.updates:
            verdict.scale = grad_scale(verdict.norm_sq, self.config.train.grad_clip, self.scaler.scale)
        verdict.undone = self.updates.settle(keep=verdict.scale == 1.0 / self.scaler.scale)
        return verdict

    def close(self, verdict: Verdict) -> None:
        """The step is done with the window: counted, the next one open to backwards."""
        self._move("close", WindowState.CLOSED, WindowState.STEPPING, WindowState.SKIPPED)
        self.reason = None
        self.global_steps += 1
        if not verdict.updates:
            self.skipped_steps += 1
            logger.warning("step %d skipped (%s); %d skipped so far", self.global_steps, verdict.reason,
                           self.skipped_steps)

    def end_step(self, verdict: Verdict) -> None:
        """After the step's bookkeeping (its stats taken): its updates prepared to run beside the next forward
        start (step_updates' note); an update ends a skip streak; a skip other than an fp16 overflow
        lengthens it, and may stop the run (``SkipStreakError``)."""
        self.updater.step_updates.start()
        if verdict.updates:
            self.streak.updated()
        elif not verdict.expected:
            self.streak.skipped(verdict.reason, self.global_steps, self.last_checkpoint)

    def restore(self, global_steps: int, micro_steps: int, skipped_steps: int) -> None:
        """Counters as a checkpoint saved them; the window it closed counts as stepped."""
        self.global_steps, self.micro_steps, self.skipped_steps = global_steps, micro_steps, skipped_steps
        self.in_window = micro_steps % self.accum
        self._window_state, self.reason = WindowState.CLOSED, None
