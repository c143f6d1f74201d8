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

A unit's states and the moves between them are ``unit_states``' [Note: unit states]; its gradient
moves are ``unit_grads.UnitGradients``, mixed into ``FlatUnit``.
"""
from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING

import torch

from ..tiers import Block, Kind, Tier
from .offloaded_grads import OffloadedGrad
from .unit_grads import UnitGradients
from .unit_layout import ALIGN_ELEMENTS, Piece, UnitLayout
from .unit_states import GradState, ParamState, UnitStateError

if TYPE_CHECKING:
    from .placement import UnitPlacement

__all__ = ["FlatUnit", "GradState", "ParamState", "UnitStateError"]


class FlatUnit(UnitGradients):
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
        self.secondary: torch.Tensor | None = None
        """hpZ: this rank's share of the gathered weights, kept for the rest of the training pass (gathers'
        [Note: secondary shards]); None when it has none."""
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
        """Where the reduced shard waits for the step, on its grad home (``keep_grads_on``), if it does."""
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

    def _move_params(self, action: str, to: ParamState, allowed: ParamState) -> None:
        if self._param_state is not allowed:
            raise self._refuse("parameters", action, self._param_state, to, (allowed,))
        self._param_state = to

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

    def keep_secondary(self, tier: Tier, part: int, parts: int) -> None:
        """Keep share ``part`` of ``parts`` of the gathered weights as the secondary shard, on ``tier``
        (gathers' [Note: secondary shards]); nothing when it has one already."""
        if self.secondary is not None:
            return
        if self._param_state is not ParamState.GATHERED:
            raise self._refuse("parameters", "keep_secondary", self._param_state, None, (ParamState.GATHERED,))
        size = self.layout.padded_numel // parts
        self.secondary = tier.empty(Kind.SECONDARY, size, self.compute_dtype)
        self.secondary.copy_(self.flat_param[part * size:(part + 1) * size])

    def drop_secondary(self, tier: Tier) -> None:
        """Let the secondary shard go (the pass ended: the next step changes the weights it copies)."""
        tier.free(Kind.SECONDARY, self.secondary)
        self.secondary = None
