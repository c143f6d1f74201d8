"""Flat units: the one object that owns every tensor of a unit on this rank, and its states.

See unit_layout's [Note: unit vocabulary] for units, slots, pieces and the trainable prefix.

[Note: partitioned units (stage 3)]
A *partitioned* unit keeps only ``param_block`` (compute dtype, this rank's shard, a ``tiers.Block``
whose home is ``offload.param.tier``: device, host or NVMe) between uses. Its
``flat_param`` tensor stays, but its storage is *released* (zero bytes) while the unit is *sharded*
and *restored* and all-gathered into when the unit is *gathered* (``ParamState``, see [Note: unit
states]). Autograd saves views of the weights (``weight.t()``), which share that storage: they are
freed with it and valid again once the unit is gathered for backward. The module's parameters are
views of ``flat_param`` only while gathered; while sharded each is a *placeholder* of the right shape
holding one NaN (an expanded view), so reading a parameter outside forward and backward shows NaN
instead of crashing or looking like real weights.
On NVMe a shard with both trainable and frozen elements is stored as two blocks
(``SplitShardBlock``), so that a step rewrites its trainable span alone.

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
  but for a tentative update, whose shard stays on the optimizer's tier in case the step undoes the
  update to redo it: REDUCED again), or dropped because the window is being skipped (``release_flat_grad`` finds it still REDUCING:
  DISCARDED).
- ``begin_backward`` needs EMPTY, ACCUMULATING or (stages 2–3) REDUCED: a unit still REDUCING, or
  UPDATED or DISCARDED, waits for the step. ``local_grad`` (the optimizer's read) needs REDUCED.
- ``clear_grads`` ends every window, updated or skipped: EMPTY again.
"""
from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING

import torch

from ..optim.cpu_adam import sum_squares
from ..tiers import Block, Kind, Tier
from .offloaded_grads import OffloadedGrad
from .unit_layout import ALIGN_ELEMENTS, Piece, UnitLayout

if TYPE_CHECKING:
    from .placement import UnitPlacement

__all__ = ["FlatUnit", "ParamState", "GradState", "UnitStateError"]


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
    """The window's gradient so far reduced and kept: the shard (here or on the optimizer's tier), or
    at stage 0 the all-reduced full buffer."""
    UPDATED = "updated"
    """Updated in backward from its reduced gradient (``backward_updates``): nothing is kept."""
    DISCARDED = "discarded"
    """Reduced in a window that will not update (the engine skips it): nothing is kept."""


class UnitStateError(RuntimeError):
    """A unit was asked for a move its state does not allow (see [Note: unit states])."""


class FlatUnit:
    """Every tensor of one unit on this rank, and the moves between them (see the notes above).

    Built from the unit's ``placement.UnitPlacement``, which decides once which gradient buffers
    persist: ``keep_full_grad`` (stages 0–1 accumulate full gradients over the window) and
    ``keep_grad_shard`` (stages 2–3 accumulate reduced shards). A buffer that does not persist is a
    temporary (``Kind.BUFFER``), freed as soon as it is used; a frozen unit keeps none.
    ``partitioned`` units (stage 3) gather their parameters only while in use. Only this class's
    methods change a unit's fields, each move checked against its states ([Note: unit states]).
    """

    def __init__(self, layout: UnitLayout, placement: UnitPlacement, rank: int, compute_dtype: torch.dtype):
        self.layout = layout
        self.placement = placement
        """Where this unit's state lives and its update runs (``placement``): read-only, decided once."""
        self.rank = rank if layout.shards > 1 else 0
        self.compute_dtype = compute_dtype
        self.trainable_numel = layout.trainable_in_shard(self.rank)
        """This rank's shard's trainable part: its first elements, the only ones with optimizer state."""
        self.trainable_span = -(-self.trainable_numel // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
        """The trainable part rounded up to ``ALIGN_ELEMENTS``: the size of the blocks that hold it."""
        self.pieces = layout.pieces(self.rank)
        self.flat_param: torch.Tensor | None = None
        self.param_block: Block | None = None
        self._placeholder: torch.Tensor | None = None
        self.flat_grad: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.master: torch.Tensor | None = None
        self.has_grad = [False] * len(layout.slots)
        self._written = [False] * len(layout.slots)
        self._nonfinite = False
        self._shard_written = False
        """Whether this window's reduced gradient has a part home yet: the first is copied, later ones added."""
        self.pending = 0
        self._offloaded_grad: OffloadedGrad | None = None
        self._grad_sumsq: torch.Tensor | None = None
        """This window's squared norm of the reduced gradient, once taken (``grad_sumsq``)."""
        self._param_state = ParamState.GATHERED  # materialize fills flat_param; a partitioned unit then reshards
        self._grad_state = GradState.EMPTY

    # ---------------------------------------------------------------- what the placement decided
    @property
    def index(self) -> int:
        """The unit's position in the model's unit order (its placement's)."""
        return self.placement.index

    @property
    def name(self) -> str:
        """The unit's module path, ``<root>`` for the root unit (for messages)."""
        return self.layout.name or "<root>"

    @property
    def partitioned(self) -> bool:
        """Stage 3: only a shard lives between uses (see [Note: partitioned units (stage 3)])."""
        return self.placement.partitioned

    @property
    def keep_full_grad(self) -> bool:
        """Stages 0–1: the full gradient buffer persists over the window."""
        return self.placement.keep_full_grad

    @property
    def keep_grad_shard(self) -> bool:
        """Stages 2–3: the reduced shard persists over the window (unless it leaves the device)."""
        return self.placement.keep_grad_shard

    @property
    def grad_leaves(self) -> bool:
        """Whether the reduced shard leaves the device: for its grad home (``offloaded_grad``) or
        straight into the update (backward_updates' [Note: updates in backward])."""
        return self.placement.grad_leaves

    @property
    def master_is_param(self) -> bool:
        """The fp32 master is the weights' own shard (its trainable part): no copy."""
        return self.placement.master_is_param

    # ---------------------------------------------------------------- states
    @property
    def param_state(self) -> ParamState:
        return self._param_state

    @property
    def grad_state(self) -> GradState:
        return self._grad_state

    @property
    def offloaded_grad(self) -> OffloadedGrad | None:
        """Where the reduced shard waits for the step on the optimizer's tier (``keep_grads_on``), if it does."""
        return self._offloaded_grad

    @property
    def updated_in_backward(self) -> bool:
        """This window's update already ran, in backward (``backward_updates``)."""
        return self._grad_state is GradState.UPDATED

    def _refuse(self, what: str, action: str, current: enum.Enum, to: enum.Enum | None,
                allowed: tuple[enum.Enum, ...]) -> UnitStateError:
        names = [state.name for state in allowed]
        wanted = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        does = f"moves them from {wanted} to {to.name}" if to is not None else f"needs them {wanted}"
        return UnitStateError(f"unit {self.name!r}: cannot {action}: its {what} are {current.name}, and {action} "
                              f"{does} (partition's [Note: unit states])")

    def _move_grads(self, action: str, to: GradState | None, *allowed: GradState) -> None:
        """Check that ``action`` may run in the current gradient state, then enter ``to`` (None: stay)."""
        if self._grad_state not in allowed:
            raise self._refuse("gradients", action, self._grad_state, to, allowed)
        if to is not None:
            self._grad_state = to

    def _move_params(self, action: str, to: ParamState, allowed: ParamState) -> None:
        if self._param_state is not allowed:
            raise self._refuse("parameters", action, self._param_state, to, (allowed,))
        self._param_state = to

    @property
    def _reduced_again(self) -> tuple[GradState, ...]:
        """REDUCED, when a reduced unit may take more gradients: at stages 2–3, reduced per micro-batch
        (at stages 0–1 it is reduced once, at the step, and its full buffer holds the result)."""
        return () if self.keep_full_grad else (GradState.REDUCED,)

    # ---------------------------------------------------------------- construction
    @property
    def shard_range(self) -> slice:
        s = self.layout.shard_numel
        return slice(self.rank * s, (self.rank + 1) * s)

    def param_range(self, piece: Piece) -> tuple[int, int]:
        """Where ``piece`` lies inside its parameter, flattened: [start, stop)."""
        start = self.shard_range.start + piece.start - self.layout.slots[piece.slot_index].offset
        return start, start + piece.stop - piece.start

    def held(self, piece: Piece) -> int:
        """How many of ``piece``'s first elements lie in the trainable part (whose values the master
        holds); the weights alone hold the rest."""
        return min(max(self.trainable_numel - piece.start, 0), piece.stop - piece.start)

    def shard_weights(self) -> torch.Tensor | None:
        """This rank's shard of the compute weights: a view of ``flat_param``, or a partitioned unit's
        shard block (None while a block on NVMe is not loaded)."""
        return self.param_block.data if self.partitioned else self.flat_param[self.shard_range]

    def full_fp32(self) -> torch.Tensor:
        """The parameters' current fp32 values, flat and padded with zeros (for initialization)."""
        flat = torch.zeros(self.layout.padded_numel, dtype=torch.float32)
        for slot in self.layout.slots:
            flat[slot.offset:slot.offset + slot.numel] = slot.param.detach().reshape(-1).float().cpu()
        return flat

    def keep_grads_on(self, offloaded_grad: OffloadedGrad) -> None:
        """Before ``materialize``: the reduced shard waits for the step in ``offloaded_grad``, on the
        placement's ``grad_home`` (``offloaded_grads``), as the placement says (``grads_kept``)."""
        if not self.placement.grads_kept or self.flat_param is not None or self._offloaded_grad is not None:
            raise UnitStateError(f"unit {self.name!r}: keep_grads_on needs a unit whose placement keeps its "
                                 "gradients off the device (grads_kept), once, before materialize")
        self._offloaded_grad = offloaded_grad

    def materialize(self, full_fp32: torch.Tensor, device_tier: Tier, param_block: Block | None = None) -> None:
        """Move the parameters into ``flat_param`` (the module's tensors become views) and make the
        persistent gradient buffers; a partitioned unit then keeps only ``param_block`` (which the
        caller fills with the shard). With ``master_is_param`` the fp32 master is the weights' shard
        itself (its trainable part); otherwise the optimizer's state block provides it
        (``optim.state``)."""
        layout = self.layout
        kind = Kind.GATHERED if self.partitioned else Kind.PARAM
        self.flat_param = device_tier.empty(kind, layout.padded_numel, self.compute_dtype)
        self.flat_param.copy_(full_fp32)
        self._attach_params()
        weights = self.flat_param[self.shard_range]
        if self.partitioned:
            self.param_block = param_block
            weights = param_block.data
            self._placeholder = torch.full((1,), math.nan, dtype=self.compute_dtype, device=device_tier.device)
        self.master = weights[:self.trainable_numel] if self.master_is_param else None
        if self.keep_full_grad:
            self.flat_grad = device_tier.zeros(Kind.GRAD, layout.padded_numel, self.compute_dtype)
        if self.keep_grad_shard and not self.grad_leaves:  # never zero-filled: a window's first part is copied
            self.grad_shard = device_tier.empty(Kind.GRAD, layout.shard_numel, self.compute_dtype)
        if self.partitioned:
            self.reshard(device_tier)

    def set_master(self, master: torch.Tensor | None) -> None:
        """Point the fp32 master at a loaded optimizer block's segment, or at nothing once it unloads
        (``optim.state``); a master that is the weights' shard stays as it is."""
        if self.master_is_param and master is not self.master:
            raise UnitStateError(f"unit {self.name!r}: its fp32 master is its weights' shard and cannot be "
                                 "pointed elsewhere")
        self.master = master

    # ---------------------------------------------------------------- gradients
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
        offloaded, on the optimizer's tier. The window's first part is copied (nothing is zero-filled),
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
        window's gradient, kept on the optimizer's tier, waits for the step's update again."""
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

    # ---------------------------------------------------------------- parameters
    def _attach_params(self) -> None:
        """Make the module's parameters views of ``flat_param`` (whose storage must be present)."""
        for slot in self.layout.slots:
            slot.param.data = self.flat_param[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def begin_gather(self, tier: Tier) -> torch.Tensor:
        """SHARDED → GATHERING: ``flat_param`` with its storage restored, for the all-gather of a
        partitioned unit (``finish_gather`` once it has arrived)."""
        self._move_params("begin_gather", ParamState.GATHERING, ParamState.SHARDED)
        tier.restore_storage(Kind.GATHERED, self.flat_param)
        return self.flat_param

    def finish_gather(self) -> None:
        """GATHERING → GATHERED: the all-gather arrived; the module's parameters become its views."""
        self._move_params("finish_gather", ParamState.GATHERED, ParamState.GATHERING)
        self._attach_params()

    def reshard(self, tier: Tier) -> None:
        """GATHERED → SHARDED: back to the shard alone; parameters become placeholders and the full
        buffer's memory is freed (a partitioned unit only)."""
        if not self.partitioned:
            raise UnitStateError(f"unit {self.name!r}: reshard needs a partitioned unit (stage 3); this one "
                                 "keeps its full parameters")
        self._move_params("reshard", ParamState.SHARDED, ParamState.GATHERED)
        for slot in self.layout.slots:
            slot.param.data = self._placeholder.expand(slot.shape)
        tier.release_storage(Kind.GATHERED, self.flat_param)
