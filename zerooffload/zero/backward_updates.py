"""Updates in backward: units whose reduced gradients leave the device, updated as they arrive.

[Note: updates in backward]
When the update needs nothing global (``optimizer.update_in_backward``: by default no
``train.grad_clip`` and no fp16 loss scale that may skip the step), a unit whose gradient would leave
for the optimizer's tier is updated, in the backward that closes an accumulation window, the moment
its last reduced shard arrives: its optimizer block was read ahead (the blocks stream in the reducer's
fixed order, read i+1 ‖ update i ‖ write i−1, as in the step), the shard is rounded to the compute
dtype exactly as the tier would store it (or added to the window's earlier parts, read ahead from the
tier, exactly as the tier would add it), and the new weights are published as the step would publish
them. The gradient never makes its last trip to the tier and back (2 × its bytes per step saved on
NVMe; with one micro-batch per step it is never stored at all), and the optimizer's I/O overlaps
backward. The result is bitwise the step's: the same inputs, the same update. It is safe because a unit
is reduced only once every use of its parameters in this backward is over (autograd accumulates a
parameter's gradient after all its uses), and the "had a gradient somewhere" flags of its slots
arrive summed over ranks with the reduced shard itself (``reduction``'s flags), in the reducer's order.
``engine.step`` then updates only the other units, and closes the window as always (counters, LR
schedule, the gradient norm reported). So the backward that closes a window applies its update: call
``step`` after every ``backward``, as always.

[Note: tentative updates]
With ``train.grad_clip`` the update needs the global norm, known only once backward is over. Units
whose optimizer block streams from NVMe are updated in backward all the same, *tentatively*: as if
the clip coefficient were 1, their new blocks stored aside (``tiers`` blocks' ``hold``: the block as
it was stays readable), the window's gradient kept on its grad home as the step would keep it,
each optimizer counter noted. The step then takes the norm from those very gradients; where the clip
coefficient is exactly 1 (the norm is within the clip) the tentative update IS the clipped one, and
its blocks are committed (a rename in the swap store: no byte moves). Otherwise every tentative
update is undone (versions aside dropped, counters restored, units back to REDUCED) and the step
updates those units as it updates the others, from the blocks as they were and the kept gradients,
clipped; a skipped window republishes their weights from the old masters. So the result is bitwise
clip-then-update either way. What it costs: twice the units' optimizer blocks on NVMe, the gradient
written once (and read back for a redo), and a redo is one more read and write of the redone blocks
in the step. Blocks in memory are changed in place, which cannot be undone without a second copy in
RAM, so those units keep their updates in the step under a clip.

[Note: updates off the autograd thread]
``take`` runs in the autograd thread (in the reducer's hand-off); the update itself (``_update``: the
block's turn in the stream, the window's gradient, the optimizer, the new weights sent) runs on the update
worker (update_worker's [Note: the update worker]), at most ``optimizer.updates_in_flight`` units at once,
so the device computes the next units' backward while the CPU updates. ``take`` does what must happen at
once: the non-finite check (a skip or a refusal, as above, after the updates in flight are joined), the
unit marked UPDATED (its norm's tensor filled by the update, read only after the join), and the gradient
handed over: at world size 1 the unit's own full gradient, lent (``Handoff.HELD``), at larger world sizes a
copy of the reducer's part (its buffers are reused at once), rounded to the compute dtype where it is the
window's whole gradient, exactly as the update would round it; a part cast as it left the device
(``Window._leaving``) is that rounding already, a tensor of its own, handed over as it is. The window joins
the worker when the backward's reductions end; the update reads and writes only its own unit's block,
gradient and weights, and the worker issues no collective (its all-gathers start at ``Publication.finish``),
so the result is bitwise the synchronous one. A split master's update reads its weights from home there,
never the gathered copy, which backward may free under it.
"""
from __future__ import annotations

import contextlib
import enum
from functools import partial
from typing import Callable, Iterator

import torch

from ..optim.state import UnitOptimizerState
from .partition import FlatUnit
from .publication import Publication
from .sharded_state import ShardedState
from .update import Updater
from .update_worker import UpdateWorker

__all__ = ["BackwardUpdates", "Handoff"]


class Handoff(enum.Enum):
    """What ``BackwardUpdates.take`` did with a reduced shard."""

    NOT_TAKEN = "not taken"
    """The unit is not updated in backward: the caller keeps the shard for the step."""
    TAKEN = "taken"
    """Updated in backward (or its window skipped): the shard is the caller's again once ``take`` returns."""
    HELD = "held"
    """Handed to the update worker with the shard lent to it (the unit's own full gradient, world size 1):
    the update holds it until it ends, then releases it (``FlatUnit.release_flat_grad``)."""


def _nothing() -> None:
    """What a gradient that holds nothing releases."""


class BackwardUpdates:
    """The updates of one backward at a time, over the units placed to update in backward."""

    def __init__(self, state: ShardedState, updater: Updater, order: list[FlatUnit],
                 last_checkpoint: Callable[[], str | None]):
        """``order``: the reducer's, in which reduced shards arrive; ``last_checkpoint()`` names where to
        go back to after a poisoned update."""
        self.state = state
        self.updater = updater
        self.units = [u for u in order if u.placement.updates_in_backward]
        self._opt_states = [state.opt_states[u.index] for u in self.units]
        self._positions = {u.index: position for position, u in enumerate(self.units)}
        """Each unit's position in ``units`` (arrival order), by ``unit.index``."""
        self._last_checkpoint = last_checkpoint
        self._states: Iterator[UnitOptimizerState] | None = None
        """The units' optimizer states in arrival order, streamed: the next one loads during an update."""
        self._publication: Publication | None = None
        self.tentative = bool(self.units) and self.units[0].placement.updates_tentatively
        """Whether the updates run before the global norm is known, to be kept or undone by ``settle``."""
        self._counters: list[tuple[dict, torch.Tensor]] = []
        """Each tentatively updated piece's optimizer state and its step counter before the update."""
        self._held: list[UnitOptimizerState] = []
        """The states whose blocks hold a tentative version this window."""
        self.skipped: str | None = None
        """Why the window was skipped here (a non-finite gradient before the first update), if it was."""
        self.closes_window = False
        """Whether the backward running now (or the last one) closes its accumulation window: every stage
        reduces in it."""
        self.worker = UpdateWorker(state.config.optimizer.updates_in_flight, state.comm.device)
        """Where the updates run (see [Note: updates off the autograd thread])."""

    @property
    def active(self) -> bool:
        return self._states is not None

    def start(self, closes_window: bool) -> None:
        """A backward begins; its updates run if it closes the accumulation window."""
        self.skipped = None
        self.closes_window = closes_window
        if not (self.units and closes_window):
            return
        self._prefetch_window_part(0)
        self._states = self.state.visit(write=True, states=self._opt_states)
        self._publication = self.updater.publication(off_thread=self.worker.depth > 0)
        if self.tentative:
            for opt_state in self._opt_states:
                opt_state.block.hold()
            self._held = list(self._opt_states)

    def take(self, unit: FlatUnit, shard: torch.Tensor, flags: torch.Tensor, loss_scale: float,
             lent: bool = False, owned: bool = False) -> Handoff:
        """Update ``unit`` from its last reduced ``shard`` if it updates in backward now, given ``flags``: each
        slot's "had a gradient" count over ranks, then the non-finite count. ``lent``: the shard is the unit's
        own full gradient, which the update may hold past this call; ``owned``: the shard is a tensor of its
        own, in the dtype the update reads, which no one else uses (see [Note: updates off the autograd
        thread])."""
        if self._states is None or not unit.placement.updates_in_backward:
            return Handoff.NOT_TAKEN
        position = self._positions[unit.index]
        if flags[-1] > 0 and self.state.config.train.skip_nonfinite:
            self._refuse_poisoned_update(unit, position)
            return Handoff.TAKEN
        sumsq = torch.zeros((), dtype=torch.float64)
        # a tentative update's norm is the kept gradient's, read as the step reads it: the clip decides alike
        unit.mark_updated_in_backward(sumsq)
        grad, release, handoff = self._hand_over(unit, shard, lent, owned)
        self.worker.submit(unit.name, partial(self._update, unit, position, grad, flags[:-1], 1.0 / loss_scale,
                                              sumsq), release)
        return handoff

    def _hand_over(self, unit: FlatUnit, shard: torch.Tensor, lent: bool, owned: bool
                   ) -> tuple[torch.Tensor, Callable[[], None], Handoff]:
        """The gradient the update reads, what lets it go once the update ends, and the hand-off: the shard
        itself in the autograd thread; for the worker, a lent shard, an owned one, else a copy (see the note)."""
        if self.worker.depth == 0:
            return shard, _nothing, Handoff.TAKEN
        if lent:
            return shard, partial(unit.release_flat_grad, self.state.compute), Handoff.HELD
        if owned:
            return shard, _nothing, Handoff.TAKEN
        whole = not self.tentative and (unit.offloaded_grad is None or not unit.offloaded_grad.written)
        return shard.to(unit.compute_dtype if whole else shard.dtype, copy=True), _nothing, Handoff.TAKEN

    def _update(self, unit: FlatUnit, position: int, shard: torch.Tensor, flags: torch.Tensor, grad_scale: float,
                sumsq: torch.Tensor) -> None:
        """``unit``'s update from its last reduced ``shard`` (on the worker): its optimizer block's turn in the
        stream, the window's gradient, the update, the new weights sent; ``sumsq`` gets the gradient's norm."""
        opt_state = next(self._states)  # loaded ahead while the previous unit updated
        assert opt_state.unit is unit, "reduced shards arrive in the reducer's fixed order"
        self._prefetch_window_part(position + 1)  # the next unit's, during this update
        with self._window_grad(unit, shard) as grad:
            if self.tentative:
                self._note_counters(opt_state)
            total = self.updater.update_unit(opt_state, flags, grad, grad_scale, self._publication,
                                             sumsq=not self.tentative)
        sumsq.copy_(unit.offloaded_grad.sumsq if self.tentative else total)

    def join(self) -> None:
        """Every update of this backward DONE (the first failure raises)."""
        self.worker.join()

    def settle(self, keep: bool) -> list[FlatUnit]:
        """The step's verdict on this window's tentative updates (none: nothing to do): kept, their
        blocks committed; or undone, the blocks as they were, counters restored, and the units' kept
        gradients waiting for the step's update. Returns the units undone."""
        held, counters, self._held, self._counters = self._held, self._counters, [], []
        undone = []
        for opt_state in held:
            if keep:
                opt_state.block.commit()
                continue
            opt_state.block.discard()
            if opt_state.unit.updated_in_backward:
                opt_state.unit.undo_update_in_backward()
                undone.append(opt_state.unit)
        if not keep:
            for state, step in counters:
                state["step"].copy_(step)
        return undone

    def _note_counters(self, opt_state: UnitOptimizerState) -> None:
        """Keep the step counters of ``opt_state``'s pieces as they are before its tentative update."""
        optimizer = self.state.optimizer
        for _, piece in opt_state.pieces:
            state = optimizer.state[piece]
            if "step" in state:
                self._counters.append((state, state["step"].clone()))

    def finish(self) -> None:
        """Backward is over: the updates joined, the last optimizer block stored, the new weights home or
        all-gathered."""
        self.worker.join()
        if self._states is None:
            return
        states, publication, self._states, self._publication = self._states, self._publication, None, None
        for _ in states:  # every unit was reduced, so this only stores the last block ...
            raise AssertionError("a unit updated in backward got no reduced gradient")
        publication.finish()

    def abandon(self) -> None:
        """Backward failed: the update running waited for (the rest dropped), the stream left to wait for its
        transfers and free its buffers; keep the first error."""
        self.worker.abandon()
        if self._states is None:
            return
        states, publication, self._states, self._publication = self._states, self._publication, None, None
        states.close()
        publication.abandon()

    def _refuse_poisoned_update(self, unit: FlatUnit, position: int) -> None:
        """A non-finite gradient reached an update in backward. Before the first unit's update the
        window is skipped like any other (the stream closed, later shards discarded); after it, weights
        have changed and the step cannot be undone, so every rank raises (the flag was summed over ranks).
        The updates in flight are joined first: those before this unit ran, as in the autograd thread."""
        self.worker.join()
        name = unit.layout.name or "<root>"
        if position > 0 and not self.tentative:  # tentative updates are undone by the step (settle)
            raise RuntimeError(
                f"unit {name!r} has a non-finite (inf/NaN) gradient on some rank, found after {position} unit(s) "
                "were already updated in this backward: those weights have changed, so this engine must not go "
                f"on. Restart from the last good checkpoint ({self._last_checkpoint() or 'none saved or loaded'}); "
                "with train.grad_clip > 0 updates wait for the global norm and such a window is skipped instead")
        self.skipped = f"non-finite gradient of unit {name!r}"
        self.abandon()

    @contextlib.contextmanager
    def _window_grad(self, unit: FlatUnit, shard: torch.Tensor) -> Iterator[torch.Tensor]:
        """The window's whole gradient of ``unit`` given its last reduced part: that part rounded to the
        compute dtype as the tier would store it, or added to the earlier parts read from the tier (and
        not stored back: the update is its last use; but for a tentative update, the kept gradient)."""
        if self.tentative:
            with unit.offloaded_grad.adding(shard) as grad:
                yield grad
            return
        if unit.offloaded_grad is None or not unit.offloaded_grad.written:
            yield shard.to(unit.compute_dtype)
            return
        with unit.offloaded_grad.loaded() as grad:
            yield grad.add_(shard[:grad.numel()].to(grad.device))  # the tier keeps the trainable span's (on the host)

    def _prefetch_window_part(self, position: int) -> None:
        """Start reading the earlier gradient parts (accumulation) of the ``position``-th unit updated in
        backward, if there is one and it has some."""
        if position < len(self.units) and not self.tentative:  # a kept gradient is read as it is added to
            kept = self.units[position].offloaded_grad
            if kept is not None and kept.written:
                kept.prefetch()
