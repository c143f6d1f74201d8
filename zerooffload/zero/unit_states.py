"""The states of a flat unit on this rank, and the error a move they do not allow raises.

[Note: unit states]
A unit's life on this rank is two small state machines, ``param_state`` and ``grad_state``. Only the
unit's own methods change them (and its fields), and each checks its move: one this note does not
list raises ``UnitStateError``, naming the unit, the move and both states.

Parameters (``ParamState``; FSDP2's unshard/reshard, with the all-gather's flight in view)::

    SHARDED --begin_gather--> GATHERING --finish_gather--> GATHERED --reshard--> SHARDED

A unit that is not partitioned is GATHERED for good; a partitioned one is SHARDED between uses, and
the ``scheduler`` moves it (GATHERING while its all-gather is in flight: ``begin_gather`` restores
the storage the collective writes into, ``finish_gather`` attaches the parameters once it has
arrived). Gathering a unit that is not SHARDED, or resharding one that is not GATHERED, is an error
rather than a no-op, both ways alike: each move is paired with a collective every rank issues and
with the scheduler's byte count, so a repeated one is a bug to see, not to absorb.

Gradients (``GradState``), over one accumulation window::

    EMPTY/ACCUMULATING --accumulate--> ACCUMULATING
    EMPTY/ACCUMULATING --begin_reduction--> REDUCING --add_grad_shard, reduced_in_place--> REDUCED
                                                     --mark_updated_in_backward---------> UPDATED
                                                     --release_flat_grad, nothing kept--> DISCARDED
    UPDATED --undo_update_in_backward--> REDUCED                          (a tentative update, redone)
    REDUCED --accumulate--> ACCUMULATING, --begin_reduction--> REDUCING   (stages 2–3 only)
    any --clear_grads--> EMPTY                                            (the window's end: the step)

- ACCUMULATING: ``accumulate`` adds each parameter's gradient into the full ``flat_grad``. At stages
  0–1 that buffer persists and takes the whole window; it is reduced once, as the backward that closes
  the window completes the unit (all-reduced in place at stage 0: ``reduced_in_place``; at stage 1
  reduce-scattered into this rank's range of the buffer itself: ``add_grad_shard``), so a REDUCED unit
  takes no more gradients there.
- At stages 2–3 a unit is reduced each micro-batch, as soon as its gradients are complete: the next
  micro-batch's gradients move it from REDUCED back to ACCUMULATING, and its reduced part adds into
  the window's shard. A unit with no gradient on this rank in a micro-batch is reduced all the same
  (zeros: its peers may have some), from EMPTY or REDUCED.
- REDUCING: ``begin_reduction`` has handed the full gradient to the reducer; ``note_nonfinite`` reads
  it then. The hand-off ends it: the shard kept (``add_grad_shard``: REDUCED), used by an update in
  backward (``mark_updated_in_backward``: UPDATED, no gradient may follow in the window; nothing kept,
  but for a tentative update, whose shard stays on its grad home in case the step undoes the
  update to redo it: REDUCED again), or dropped because the window is being skipped (``release_flat_grad`` finds it still REDUCING:
  DISCARDED).
- ``begin_backward`` needs EMPTY, ACCUMULATING or (stages 2–3) REDUCED: a unit still REDUCING, or
  UPDATED or DISCARDED, waits for the step. ``local_grad`` (the optimizer's read) needs REDUCED.
- ``clear_grads`` ends every window, updated or skipped: EMPTY again.
"""
from __future__ import annotations

import enum

__all__ = ["GradState", "ParamState", "UnitStateError"]


class ParamState(enum.Enum):
    """Where a unit's parameters are on this rank (see [Note: unit states])."""

    SHARDED = "sharded"
    """A partitioned unit between uses: only its shard (``param_block``); parameters are placeholders."""
    GATHERING = "gathering"
    """``flat_param``'s storage restored, its all-gather in flight: parameters not attached yet."""
    GATHERED = "gathered"
    """``flat_param`` holds the full weights and the module's parameters are views of it."""


class GradState(enum.Enum):
    """Where a unit's gradient of the accumulation window is on this rank (see [Note: unit states])."""

    EMPTY = "empty"
    """No gradient yet this window."""
    ACCUMULATING = "accumulating"
    """Gradients being added into the full ``flat_grad``, not yet reduced."""
    REDUCING = "reducing"
    """The full gradient handed to the reducer: its collective launched or about to be."""
    REDUCED = "reduced"
    """The window's gradient so far reduced and kept: the shard (here or on its grad home), or
    at stage 0 the all-reduced full buffer."""
    UPDATED = "updated"
    """Updated in backward from its reduced gradient (``backward_updates``): nothing is kept."""
    DISCARDED = "discarded"
    """Reduced in a window that will not update (the engine skips it): nothing is kept."""


class UnitStateError(RuntimeError):
    """A unit was asked for a move its state does not allow (see [Note: unit states])."""
