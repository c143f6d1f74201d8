"""A flat unit's gradient moves over an accumulation window ([Note: unit states] in ``unit_states``).

``UnitGradients`` is the gradient half of ``partition.FlatUnit``, which it is mixed into: its methods
read and change the unit's gradient fields (``flat_grad``, ``grad_shard``, ``has_grad`` ...) and its
``grad_state``, each move checked as the note says; the parameter half stays in ``partition``.
"""
from __future__ import annotations

import math

import torch

from ..optim.cpu_adam import sum_squares
from ..tiers import Kind, Tier
from .offloaded_grads import OffloadedGrad
from .unit_states import GradState, UnitStateError

__all__ = ["UnitGradients"]


class UnitGradients:
    """The gradient moves of ``FlatUnit`` (see the module docstring)."""

    def _move_grads(self, action: str, to: GradState | None, *allowed: GradState) -> None:
        """Check that ``action`` may run in the current gradient state, then enter ``to`` (None: stay)."""
        if self._grad_state not in allowed:
            raise self._refuse("gradients", action, self._grad_state, to, allowed)
        if to is not None:
            self._grad_state = to

    @property
    def _reduced_again(self) -> tuple[GradState, ...]:
        """REDUCED, when a reduced unit may take more gradients: at stages 2–3, reduced per micro-batch
        (at stages 0–1 it is reduced once, at the step, and its full buffer holds the result)."""
        return () if self.keep_full_grad else (GradState.REDUCED,)

    def keep_grads_on(self, offloaded_grad: OffloadedGrad) -> None:
        """Before ``materialize``: the reduced shard waits for the step in ``offloaded_grad``, on the
        placement's ``grad_home`` (``offloaded_grads``), as the placement says (``grads_kept``)."""
        if not self.placement.grads_kept or self.flat_param is not None or self._offloaded_grad is not None:
            raise UnitStateError(f"unit {self.name!r}: keep_grads_on needs a unit whose placement keeps its "
                                 "gradients off the device (grads_kept), once, before materialize")
        self._offloaded_grad = offloaded_grad

    def begin_backward(self) -> None:
        """Expect one gradient from every trainable slot before the unit counts as complete."""
        self._move_grads("begin_backward", None, GradState.EMPTY, GradState.ACCUMULATING, *self._reduced_again)
        self.pending = sum(1 for s in self.layout.slots if s.trainable)

    def _ensure_flat_grad(self, tier: Tier) -> torch.Tensor:
        """The full gradient buffer, made (temporary) when this pass has none yet.

        Only the padding is zeroed here: slots are overwritten by their first gradient, and
        ``begin_reduction`` clears the rest before the buffer is reduced.
        """
        if self.flat_grad is None:
            self.flat_grad = tier.empty(Kind.BUFFER, self.layout.padded_numel, self.compute_dtype)
            self.flat_grad[self.layout.numel:].zero_()
            self._written = [False] * len(self.layout.slots)
        return self.flat_grad

    def accumulate(self, slot_index: int, grad: torch.Tensor, tier: Tier) -> bool:
        """Put one parameter's gradient into ``flat_grad``; True once every trainable slot has reported.

        The first gradient of a window is copied over whatever the buffer held, later ones added, so a
        persistent buffer is never zero-filled; ``begin_reduction`` clears the slots nobody wrote.
        """
        self._move_grads("accumulate", GradState.ACCUMULATING, GradState.EMPTY, GradState.ACCUMULATING,
                         *self._reduced_again)
        slot = self.layout.slots[slot_index]
        view = self._ensure_flat_grad(tier)[slot.offset:slot.offset + slot.numel]
        if self._written[slot_index]:
            view.add_(grad.reshape(-1))
        else:
            view.copy_(grad.reshape(-1))
            self._written[slot_index] = True
        self.has_grad[slot_index] = True
        self.pending -= 1
        return self.pending == 0

    def begin_reduction(self, tier: Tier) -> torch.Tensor:
        """The full gradient, handed to the reducer: made of zeros when this rank had none (the peers
        may have some), the slots that got no gradient this window zeroed."""
        self._move_grads("begin_reduction", GradState.REDUCING, GradState.EMPTY, GradState.ACCUMULATING,
                         *self._reduced_again)
        flat_grad = self._ensure_flat_grad(tier)
        for slot, written in zip(self.layout.slots, self._written):
            if not written:
                flat_grad[slot.offset:slot.offset + slot.numel].zero_()
        return flat_grad

    def note_nonfinite(self) -> bool:
        """Whether a full gradient of this window was non-finite on this rank, the current one included
        (for flags that must agree over ranks before the step: reduction's [Note: flags in the payload]).
        One read of the buffer: its sum of squares is finite exactly when every element is."""
        self._move_grads("note_nonfinite", None, GradState.REDUCING)
        self._nonfinite = self._nonfinite or not math.isfinite(sum_squares(self.flat_grad).item())
        return self._nonfinite

    def reduced_in_place(self) -> None:
        """Stage 0: the all-reduce's result is in ``flat_grad`` itself."""
        self._move_grads("reduced_in_place", GradState.REDUCED, GradState.REDUCING)

    def add_grad_shard(self, reduced: torch.Tensor, tier: Tier) -> None:
        """Accumulate a reduced gradient shard (stage 2 adds one per micro-batch), on the device or,
        offloaded, on its grad home (placement's). The window's first part is copied (nothing is zero-filled),
        later ones added; at stages 0–1 the part lands in this rank's range of the full buffer itself,
        where at world size 1 it already is (no copy at all)."""
        self._move_grads("add_grad_shard", GradState.REDUCED, GradState.REDUCING)
        self._grad_sumsq = None
        if self._offloaded_grad is not None:
            self._offloaded_grad.add(reduced)
            return
        if self.keep_full_grad:
            home = self.flat_grad[self.shard_range]
        else:  # placed to leave, yet kept until the step (its update in backward did not run): made for the window
            if self.grad_shard is None:
                self.grad_shard = tier.empty(Kind.BUFFER, self.layout.shard_numel, self.compute_dtype)
            home = self.grad_shard
        if self._shard_written:
            home.add_(reduced)
        elif home.data_ptr() != reduced.data_ptr():
            home.copy_(reduced)
        self._shard_written = True

    def mark_updated_in_backward(self, sumsq: torch.Tensor) -> None:
        """Its last reduced shard went straight into its update (``backward_updates``); ``sumsq`` is the
        squared norm of the window's gradient that update used (for the step's reported norm)."""
        self._move_grads("mark_updated_in_backward", GradState.UPDATED, GradState.REDUCING)
        self._grad_sumsq = sumsq

    def undo_update_in_backward(self) -> None:
        """Its tentative update in backward was undone (backward_updates' [Note: tentative updates]): the
        window's gradient, kept on its grad home, waits for the step's update again."""
        if self._offloaded_grad is None or not self._offloaded_grad.written:
            raise UnitStateError(f"unit {self.name!r}: cannot undo its update in backward: its gradient was not "
                                 "kept (only tentative updates keep it)")
        self._move_grads("undo_update_in_backward", GradState.REDUCED, GradState.UPDATED)

    def release_flat_grad(self, tier: Tier) -> None:
        """The reduced shard was handed on: drop a temporary full gradient (a persistent one stays). A
        hand-off that kept nothing (a window being skipped) leaves the gradients DISCARDED."""
        self._move_grads("release_flat_grad", None, GradState.REDUCING, GradState.REDUCED, GradState.UPDATED)
        if self._grad_state is GradState.REDUCING:
            self._grad_state = GradState.DISCARDED
        if not self.keep_full_grad:
            tier.free(Kind.BUFFER, self.flat_grad)
            self.flat_grad = None

    def local_grad(self) -> torch.Tensor:
        """What the optimizer reads: the reduced shard (at stages 0–1 this rank's range of the full
        buffer: the whole all-reduced buffer at stage 0)."""
        self._move_grads("local_grad", None, GradState.REDUCED)
        return self.flat_grad[self.shard_range] if self.keep_full_grad else self.grad_shard

    def grad_sumsq(self) -> torch.Tensor:
        """This rank's squared norm of the window's reduced gradient (float64; 0 for a frozen unit), taken
        once where the gradient is: by its update in backward, as an offloaded shard was written home, or
        here in one native read, which the engine runs as the unit's reduction completes in the backward
        that closes the window, so that the step reads no gradient for its norm."""
        if not self.layout.trainable:
            return torch.zeros((), dtype=torch.float64)
        if self._grad_sumsq is None:
            if self._offloaded_grad is not None:
                self._grad_sumsq = self._offloaded_grad.sumsq
            else:
                self._grad_sumsq = sum_squares(self.local_grad())
        return self._grad_sumsq

    def clear_grads(self, tier: Tier) -> None:
        """End of an accumulation window (whatever state it left): forget persistent gradients, free
        temporary ones; the gradients are EMPTY again.

        Persistent buffers are not zero-filled: the next window's first gradients overwrite them.
        """
        if not self.keep_full_grad and self.flat_grad is not None:
            tier.free(Kind.BUFFER, self.flat_grad)
            self.flat_grad = None
        if not self.keep_grad_shard and self.grad_shard is not None:
            tier.free(Kind.BUFFER, self.grad_shard)
            self.grad_shard = None
        if self._offloaded_grad is not None:
            self._offloaded_grad.clear()
        self._shard_written = False
        self._grad_sumsq = None
        self._nonfinite = False
        self.has_grad = [False] * len(self.layout.slots)
        self._written = [False] * len(self.layout.slots)
        self._grad_state = GradState.EMPTY
