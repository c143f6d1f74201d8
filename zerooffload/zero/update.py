"""The optimizer update of units, and what it needs from the whole window: the global norm and flags.

One unit's update (``Updater.update_unit``) is the same whether the step runs it or an update in
backward does: the optimizer on the pieces whose parameters had a gradient on some rank (others skip,
as torch skips ``grad is None``), writing the new compute weights straight where they are published
(``publication``): all-gathered at stages 1–2, a partitioned unit's shard home at stage 3. A step
runs the units whose update moves nothing else in one native pass ([Note: updates run together]),
bitwise the same: the pass is elementwise; or, where the CPU updates, prepares them to run beside the
next forward (step_updates' [Note: the step beside the next forward]).
"""
from __future__ import annotations

import contextlib
import math
from functools import partial
from typing import Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..comm import control_all_reduce
from ..optim.cpu_adam import sum_squares
from ..optim.state import UnitOptimizerState
from ..tiers import Kind, Tier, release_idle
from ..tiers.streams import SideStreams
from ..trace import RECORDER, profiled
from .offloaded_grads import OffloadedGrad
from .partition import FlatUnit
from .placement import steps_beside_forward
from .publication import Publication
from .scheduler import ParamScheduler
from .sharded_state import ShardedState
from .step_updates import StepUpdates
from .update_copies import UpdateCopies
from .unit_layout import Piece

__all__ = ["Updater", "grad_scale"]


class Updater:
    """Updates units of a ``ShardedState`` and publishes their new weights."""

    def __init__(self, state: ShardedState, param_scheduler: ParamScheduler, streams: SideStreams):
        self.state = state
        self.param_scheduler = param_scheduler
        self.copies = UpdateCopies(state.staging, streams.get("updates"))
        """A CPU update's copies of device tensors (update_copies' [Note: the update's copies])."""
        self.step_updates = StepUpdates(state.units, state.config.optimizer.updates_in_flight > 0, state.comm.device)
        """The step's updates running beside the next forward (step_updates' note)."""
        param_scheduler.updates = self.step_updates

    def publication(self, whole_shards: bool = False, off_thread: bool = False) -> Publication:
        """A round of new weights (``Publication``; ``off_thread``: sent from the update worker)."""
        state = self.state
        return Publication(state.comm, state.compute, state.staging, state.link,
                           shards_off_device=state.placement.shards_off_device, whole_shards=whole_shards,
                           depth=state.depth, off_thread=off_thread)

    # ------------------------------------------------------------------ the window's norm and flags
    def norm_and_flags(self) -> tuple[float, list[torch.Tensor]]:
        """One control all-reduce: the window's squared gradient norm (still scaled by the loss scale)
        and each slot's "had a gradient" count over ranks. Each unit's part was taken where its gradient
        was, most as backward produced them (``FlatUnit.grad_sumsq``)."""
        units, comm = self.state.units, self.state.comm
        flags = [torch.tensor(u.has_grad, dtype=torch.float64) for u in units]
        local_sq = torch.stack([unit.grad_sumsq().to(comm.device) for unit in units]).sum().cpu().reshape(1)
        if not self.state.placement.reduce_scatters and comm.rank != 0:
            local_sq.zero_()  # all-reduced gradients are whole on every rank: count them once
        control = control_all_reduce(comm, torch.cat([local_sq, *flags]).to(comm.device)).cpu()
        return float(control[0]), list(torch.split(control[1:], [len(f) for f in flags]))

    # ------------------------------------------------------------------ updates
    def step_units(self, had_grad: list[torch.Tensor], grad_scale: float) -> None:
        """Unit by unit, those not updated in backward already: each one's update, one unit's
        all-gather running while the next updates; units whose update moves nothing else run together
        ([Note: updates run together]); or, where the CPU updates state off the device, prepared to run
        beside the next forward (step_updates' note). Frozen units are never updated, nor their state read or
        written."""
        units = self.state.units
        left = [i for i, unit in enumerate(units) if unit.layout.trainable and not unit.updated_in_backward]
        if self._beside_forward(left):
            return self._prepare_units(left, had_grad, grad_scale)
        publication = self.publication()
        together = []
        states = self.state.visit(write=True, states=[self.state.opt_states[i] for i in left])
        for position, opt_state in enumerate(states):
            upcoming = units[left[position + 1]].offloaded_grad if position + 1 < len(left) else None
            if upcoming is not None:
                upcoming.prefetch()  # its read overlaps this unit's update
            if self._runs_together(opt_state, publication):
                together.append((opt_state, had_grad[left[position]]))
                continue
            RECORDER.push(f"update {opt_state.unit.name}")
            with _reduced_grad(opt_state.unit) as grad:  # entered even when nothing steps: it may be prefetched
                self.update_unit(opt_state, had_grad[left[position]], grad, grad_scale, publication)
            RECORDER.pop()
        self._update_together(together, grad_scale, publication)
        publication.finish()
        self.param_scheduler.stage_first_units()

    def _beside_forward(self, left: list[int]) -> bool:
        """Whether the step's updates of units ``left`` run beside the next forward (step_updates' note)."""
        return self.step_updates.enabled and self.state.optimizer.native and steps_beside_forward(
            [self.state.units[i].placement for i in left])

    def _prepare_units(self, left: list[int], had_grad: list[torch.Tensor], grad_scale: float) -> None:
        """The step's updates of units ``left`` prepared in forward order (the root unit first), each
        clearing its unit's gradients as it ends; ``StepUpdates.start`` hands them to the worker."""
        units = self.state.units
        order = sorted(left, key=lambda i: bool(units[i].layout.name))  # stable: the blocks stay in their order
        states = self.state.visit(write=True, states=[self.state.opt_states[i] for i in order])
        publication = self.publication(off_thread=True)
        self.step_updates.begin(publication, states)
        groups = self.state.optimizer.hyperparameters()
        for position, index in enumerate(order):
            upcoming = units[order[position + 1]].offloaded_grad if position + 1 < len(order) else None
            run = partial(self._update_beside, states, units[index], had_grad[index], grad_scale, publication,
                          groups, upcoming, last=position + 1 == len(order))
            self.step_updates.prepare(units[index], run, partial(units[index].clear_grads, self.state.compute))

    def _update_beside(self, states: Iterator[UnitOptimizerState], unit: FlatUnit, flags: torch.Tensor,
                       grad_scale: float, publication: Publication, groups: list[dict], upcoming: OffloadedGrad | None,
                       *, last: bool) -> None:
        """One prepared update, on the step's worker: its optimizer block's turn in the stream, the update,
        the new weights sent and stored home (its gather reads them), the last block stored after the last."""
        opt_state = next(states)
        assert opt_state.unit is unit, "the optimizer blocks stream in the order the updates were prepared"
        if upcoming is not None:
            upcoming.prefetch()  # its read overlaps this unit's update
        with _reduced_grad(unit) as grad:
            self.update_unit(opt_state, flags, grad, grad_scale, publication, groups=groups)
        publication.writer.finish()
        if last:
            for _ in states:  # resumed once more, the stream stores the last block
                raise AssertionError("a prepared update's optimizer block was left in the stream")
            release_idle(self.state.tiers)  # the phase beside the forward is over: buffer_arena's note

    def forward_hooks(self) -> list[RemovableHandle]:
        """A forward pre-hook on each trainable unit that is not partitioned: its use waits for its update
        (partitioned units wait in the scheduler: step_updates' note)."""
        return [unit.layout.module.register_forward_pre_hook(partial(self._before_forward, unit))
                for unit in self.state.units if unit.layout.trainable and not unit.partitioned]

    def _before_forward(self, unit: FlatUnit, module: nn.Module, args: tuple) -> None:
        self.step_updates.wait(unit)

    def end_window(self) -> None:
        """The step is done with the window: every unit's gradients cleared, but those of units whose update
        still runs beside the next forward, cleared as it ends; the buffers the tiers kept for reuse let go."""
        for unit in self.state.units:
            if not self.step_updates.holds(unit):
                unit.clear_grads(self.state.compute)
        release_idle(self.state.tiers)

    def close(self) -> None:
        """The engine closes: the step's updates waited for, the gradient reader closed."""
        try:
            self.step_updates.close()
        finally:
            self.copies.close()
            self.state.grad_reader.close()

    def republish(self, units: list[FlatUnit]) -> None:
        """Publish ``units``' weights from their masters as they are (after tentative updates in
        backward were undone in a window that does not update: backward_updates' note)."""
        if not units:
            return
        publication = self.publication()
        for opt_state in self.state.visit(write=False, states=[self.state.opt_states[u.index] for u in units]):
            self.send(publication, opt_state, publication.target(opt_state.unit), [])
        publication.finish()

    def update_unit(self, opt_state: UnitOptimizerState, flags: torch.Tensor, grad: torch.Tensor,
                    grad_scale: float, publication: Publication, *, sumsq: bool = False,
                    groups: list[dict] | None = None) -> torch.Tensor | None:
        """One unit's update on the pieces whose parameters had a gradient somewhere (``flags``),
        writing its new weights into their target, then sent on (``publication``'s note). With
        ``sumsq``, returns the squared norm of ``grad`` (float64), summed by the update as it reads it
        (the pieces that do not step have none: zeros). ``groups``: the settings (``ZeroOptimizer.update``)."""
        target, stepped = self._stepped(opt_state, flags, publication)
        total = torch.zeros((), dtype=torch.float64) if sumsq else None
        if stepped:
            self._count_grad(opt_state.unit, grad)
            with profiled("zerooffload::optimizer_update"):
                total = self._step_pieces(stepped, grad, grad_scale, target, self.state.update_tier(opt_state), sumsq,
                                          groups)
        self.send(publication, opt_state, target, [piece for piece, _ in stepped])
        return total

    # [Note: updates run together]
    # The native pass over a unit of 10M elements streams ~280 MB, and leaves every cache cold for the
    # Python around it: one unit's bookkeeping then costs ~0.5 ms, and each pass starts and joins its
    # threads. Where a unit's update moves nothing else (its state resident, its reduced gradient in
    # memory, its weights published in place: no all-gather or store to overlap with the next unit),
    # it waits for the others of its kind, and all of them run as one native pass
    # (``fused_adam_steps``) before their sends. Measured through ``engine.step()`` on 10 units of
    # 3162² (stage 1, world 1, host tier): see bench/optimizer_phase.py.
    def _runs_together(self, opt_state: UnitOptimizerState, publication: Publication) -> bool:
        """Whether this unit's update waits to run with the others' (the note above)."""
        unit = opt_state.unit
        return (opt_state.block.resident and unit.offloaded_grad is None and publication.in_place(unit)
                and self._native_reads(unit.local_grad(), opt_state.pieces))

    def _native_reads(self, grad: torch.Tensor, pieces: list[tuple[Piece, torch.Tensor]]) -> bool:
        """Whether the native pass updates these pieces reading ``grad`` as it lies (same device)."""
        return self.state.optimizer.native and bool(pieces) and grad.device == pieces[0][1].device

    def _update_together(self, units: list[tuple[UnitOptimizerState, torch.Tensor]], grad_scale: float,
                         publication: Publication) -> None:
        """``units`` (state, flags) updated by one native pass over all their stepped pieces, then sent."""
        prepared = [(opt_state, *self._stepped(opt_state, flags, publication)) for opt_state, flags in units]
        grads, outs = {}, {}
        for opt_state, target, stepped in prepared:
            if stepped:
                self._count_grad(opt_state.unit, opt_state.unit.local_grad())
            grads.update(_piece_views(stepped, opt_state.unit.local_grad()))
            outs.update(_piece_views(stepped, target))
        if grads:
            RECORDER.push(f"update {len(prepared)} units together")
            with profiled("zerooffload::optimizer_update"):
                self.state.optimizer.update(grads, grad_scale, outs)
            RECORDER.pop()
        for opt_state, target, stepped in prepared:
            self.send(publication, opt_state, target, [piece for piece, _ in stepped])

    def _count_grad(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        """At stages 0–1 an update off the device reads the device's gradient across the link: its trainable
        part's bytes (above, a shard that leaves was counted as it left: ``Window._leaving``)."""
        if unit.keep_full_grad and not unit.placement.updated_on_device:
            self.state.link.device_to_host_bytes += unit.trainable_numel * grad.element_size()

    @staticmethod
    def _stepped(opt_state: UnitOptimizerState, flags: torch.Tensor, publication: Publication
                 ) -> tuple[torch.Tensor | None, list[tuple[Piece, torch.Tensor]]]:
        """The unit's target and its pieces whose parameters had a gradient on some rank (``flags``)."""
        grad_counts = flags.tolist()  # read once, not one tensor index per piece
        return publication.target(opt_state.unit), [
            (piece, tensor) for piece, tensor in opt_state.pieces if grad_counts[piece.slot_index] > 0]

    def send(self, publication: Publication, opt_state: UnitOptimizerState, target: torch.Tensor | None,
             stepped: list[Piece]) -> None:
        place = opt_state.unit.placement
        publication.send(opt_state.unit, target, stepped, updated_on_device=place.updated_on_device)

    def _step_pieces(self, stepped: list[tuple[Piece, torch.Tensor]], grad: torch.Tensor, grad_scale: float,
                     target: torch.Tensor | None, update_tier: Tier, sumsq: bool, groups: list[dict] | None
                     ) -> torch.Tensor | None:
        """The optimizer on one unit's stepped pieces (``update_unit``). The native pass reads the reduced
        gradient as it lies (any dtype), scales it and sums its squares itself (a device's gradient and
        weights cross through the update's copies: ``_step_across``); torch's update gets an fp32 copy,
        scaled, for the unit, and the squares are summed before."""
        optimizer, host = self.state.optimizer, stepped[0][1].device
        if optimizer.native and (grad.device != host or (target is not None and target.device != host)):
            return self._step_across(stepped, grad, grad_scale, target, sumsq, groups)
        outs = _piece_views(stepped, target)
        if self._native_reads(grad, stepped):
            return optimizer.update(_piece_views(stepped, grad), grad_scale, outs, sumsq=sumsq, groups=groups)
        total = sum_squares(grad) if sumsq else None
        scaled = update_tier.empty(Kind.BUFFER, grad.numel(), torch.float32)
        try:
            scaled.copy_(grad).mul_(grad_scale)
            optimizer.update(_piece_views(stepped, scaled), outs=outs, groups=groups)
        finally:
            update_tier.free(Kind.BUFFER, scaled)
        return total

    def _step_across(self, stepped: list[tuple[Piece, torch.Tensor]], grad: torch.Tensor, grad_scale: float,
                     target: torch.Tensor | None, sumsq: bool, groups: list[dict] | None) -> torch.Tensor | None:
        """The native pass on the host over a device gradient or device weights: the gradient down and the new
        weights up through the update's copies (update_copies' note), the trainable span's part of each."""
        copies, host = self.copies, stepped[0][1].device
        span = max(piece.stop for piece, _ in stepped)
        if grad.device != host:
            grad = copies.grad_down(grad[:span])
        staged = None
        if target is not None and target.device != host:  # a split master's pieces are int16 residuals: it reads them
            staged = copies.weights_staging(target[:span], read=stepped[0][1].dtype == torch.int16)
        outs = _piece_views(stepped, target if staged is None else staged)
        total = self.state.optimizer.update(_piece_views(stepped, grad), grad_scale, outs, sumsq=sumsq, groups=groups)
        if staged is not None:
            copies.weights_up(target[:span], staged)
        return total


def grad_scale(norm_sq: float, grad_clip: float, loss_scale: float) -> float:
    """What the reduced gradients are multiplied by in the update: 1 / loss scale, times the clip
    coefficient of ``grad_clip`` against the global norm (``norm_sq`` already unscaled)."""
    coefficient = 1.0
    if grad_clip > 0:
        coefficient = min(1.0, grad_clip / (math.sqrt(norm_sq) + 1e-6))
    return coefficient / loss_scale


def _piece_views(stepped: list[tuple[Piece, torch.Tensor]], flat: torch.Tensor | None
                 ) -> dict[torch.Tensor, torch.Tensor]:
    """Each stepped piece's part of one of the unit's flat tensors (its gradient, its target; none
    without one)."""
    return {} if flat is None else {tensor: flat[piece.start:piece.stop] for piece, tensor in stepped}


@contextlib.contextmanager
def _reduced_grad(unit: FlatUnit) -> Iterator[torch.Tensor]:
    """This rank's reduced gradient of ``unit`` for the window, in memory for the duration (read from
    its grad home when it was offloaded)."""
    if unit.offloaded_grad is None:
        yield unit.local_grad()
    else:
        with unit.offloaded_grad.loaded() as grad:
            yield grad
