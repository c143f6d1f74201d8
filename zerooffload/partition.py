"""Units and flat shards: which parameters are managed together, and the one object that owns them.

[Note: unit vocabulary]
- A *unit* is a module subtree whose parameters are flattened into one buffer and moved by one
  collective: each module named by ``zero.unit_modules`` (by default each direct child of an
  ``nn.ModuleList``/``nn.Sequential``), outermost first, plus a *root unit* for the rest. A parameter
  reached from several modules (tied weights) belongs to the unit of their lowest common ancestor.
- A unit's *flat* layout puts its parameters end to end, the trainable ones first (each kind in
  registration order), then pads the total to ``shards × shard_numel``, with ``shard_numel`` a
  multiple of ``ALIGN_ELEMENTS`` so every shard is 4 KiB-aligned in fp32 (and so on disk). Shard ``r``
  is ``flat[r*S:(r+1)*S]``.
- The *trainable prefix* is ``flat[:T]``: every trainable slot, ``T`` the offset of the first frozen
  one (``requires_grad=False``); a unit without frozen slots is trainable to its end, padding
  included. A shard's *trainable part* is its first ``t`` elements, its share of the prefix
  (``UnitLayout.trainable_in_shard``): all of a shard without frozen elements, none of a frozen one.
  Only that part has optimizer state and gradients kept for the step; the rest, frozen values and
  padding, lives in the compute weights alone (optim.state's frozen prefix rule). Blocks over the
  trainable part are sized to its *span*, ``t`` rounded up to ``ALIGN_ELEMENTS`` (4 KiB-aligned I/O).
- A *slot* is one parameter's place in the flat layout (offset, numel, shape, every name it has).
- A *piece* is the part of one slot inside this rank's shard: the optimizer works on pieces, so a
  parameter that got no gradient can be skipped exactly as torch skips ``grad is None``.
- ``FlatUnit`` owns every tensor of one unit on this rank: ``flat_param`` (compute dtype, full: the
  module's parameters are views of it), ``flat_grad`` (compute dtype, full, while gradients are
  accumulated or reduced), ``grad_shard`` (compute dtype, this rank's reduced shard) and ``master``
  (fp32, the shard's trainable part, a view of the weights when fp32 weights already live where the
  optimizer runs). A unit with no trainable slot keeps no gradient buffer at all.

[Note: partitioned units (stage 3)]
A *partitioned* unit keeps only ``param_block`` (compute dtype, this rank's shard, a ``tiers.Block``
whose home is ``offload.param.tier``: device, host or NVMe) between uses. Its
``flat_param`` tensor stays, but its storage is *released* (zero bytes) while the unit is *sharded*
and *restored* and all-gathered into when the unit is *gathered*. Autograd saves views of the weights
(``weight.t()``), which share that storage: they are freed with it and valid again once the unit is
gathered for backward. The module's parameters are views of ``flat_param`` only while gathered; while
sharded each is a *placeholder* of the right shape holding one NaN (an expanded view), so reading a
parameter outside forward and backward shows NaN instead of crashing or looking like real weights.
On NVMe a shard with both trainable and frozen elements is stored as two blocks
(``SplitShardBlock``), so that a step rewrites its trainable span alone.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from .offloaded_grads import OffloadedGrad
from .tiers import Block, Kind, Tier

__all__ = ["ALIGN_ELEMENTS", "Slot", "Piece", "UnitLayout", "FlatUnit", "SplitShardBlock", "find_units",
           "span_block"]

ALIGN_ELEMENTS = 1024
"""Shard granularity in elements: 4 KiB of fp32, the O_DIRECT alignment."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One parameter's place in its unit's flat buffer."""

    names: tuple[str, ...]
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of ``slot`` inside this rank's shard: ``[start, stop)`` in shard coordinates."""

    slot_index: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class UnitLayout:
    """Where a unit's parameters go, computed before any memory is touched."""

    name: str
    module: nn.Module
    slots: tuple[Slot, ...]
    shards: int
    shard_numel: int

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def padded_numel(self) -> int:
        return self.shards * self.shard_numel

    @property
    def trainable_numel(self) -> int:
        """``T``, the end of the trainable prefix (see [Note: unit vocabulary]): the first frozen
        slot's offset, or the padded end when no slot is frozen (0: the unit is frozen)."""
        return next((s.offset for s in self.slots if not s.trainable), self.padded_numel)

    @property
    def trainable(self) -> bool:
        """Whether any slot trains: a unit without one gets no gradient, reduction or update."""
        return self.trainable_numel > 0

    def trainable_in_shard(self, rank: int) -> int:
        """How many of shard ``rank``'s first elements are trainable: its part of the trainable prefix."""
        return min(max(self.trainable_numel - rank * self.shard_numel, 0), self.shard_numel)

    def pieces(self, rank: int) -> list[Piece]:
        """The slots' parts inside shard ``rank`` (slots outside it have none)."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        out = []
        for index, slot in enumerate(self.slots):
            start, stop = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
            if start < stop:
                out.append(Piece(index, start - lo, stop - lo))
        return out


def _unit_roots(model: nn.Module, unit_modules: list[str]) -> list[str]:
    """Module paths that start units, outermost only, in registration order."""
    wanted = set(unit_modules)
    roots: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(root + ".") for root in roots):
            continue
        if wanted:
            if path and type(module).__name__ in wanted:
                roots.append(path)
        elif isinstance(module, (nn.ModuleList, nn.Sequential)):
            roots.extend(f"{path}.{name}" if path else name for name, _ in module.named_children())
    return [r for r in dict.fromkeys(roots) if not any(r.startswith(o + ".") for o in roots if o != r)]


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for items in zip(*parts):
        if len(set(items)) > 1:
            break
        common.append(items[0])
    return ".".join(common)


def find_units(model: nn.Module, unit_modules: list[str], shards: int) -> list[UnitLayout]:
    """Group the model's parameters into units (see [Note: unit vocabulary]); the root unit comes last."""
    roots = _unit_roots(model, unit_modules)
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    members: dict[str, list[tuple[tuple[str, ...], nn.Parameter]]] = {root: [] for root in [*roots, ""]}
    for key, param in params.items():
        owner = _common_prefix([n.rpartition(".")[0] for n in names[key]])
        unit = next((r for r in roots if owner == r or owner.startswith(r + ".")), "")
        members[unit].append((tuple(names[key]), param))
    modules = dict(model.named_modules())
    return [_layout(root, modules[root], members[root], shards) for root in [*roots, ""] if members[root]]


def _layout(name: str, module: nn.Module, members: list, shards: int) -> UnitLayout:
    """Trainable parameters first (stable), so they are the flat buffer's prefix (see the note)."""
    slots, offset = [], 0
    for param_names, param in sorted(members, key=lambda member: not member[1].requires_grad):
        slots.append(Slot(param_names, param, offset, param.numel(), param.shape))
        offset += param.numel()
    per_shard = -(-offset // shards)
    shard_numel = max(1, -(-per_shard // ALIGN_ELEMENTS)) * ALIGN_ELEMENTS
    return UnitLayout(name, module, tuple(slots), shards, shard_numel)


class FlatUnit:
    """Every tensor of one unit on this rank, and the moves between them (see the note above).

    Which gradient buffers persist depends on the stage: ``keep_full_grad`` (stages 0–1 accumulate
    full gradients over the window) and ``keep_grad_shard`` (stages 2–3 accumulate reduced shards).
    A buffer that does not persist is a temporary (``Kind.BUFFER``), freed as soon as it is used; a
    frozen unit keeps none. ``partitioned`` units (stage 3) gather their parameters only while in use
    (see the note above).
    """

    def __init__(self, layout: UnitLayout, rank: int, compute_dtype: torch.dtype, *, keep_full_grad: bool,
                 keep_grad_shard: bool, partitioned: bool = False):
        self.layout = layout
        self.rank = rank if layout.shards > 1 else 0
        self.compute_dtype = compute_dtype
        self.keep_full_grad = keep_full_grad and layout.trainable
        self.keep_grad_shard = keep_grad_shard and layout.trainable
        self.trainable_numel = layout.trainable_in_shard(self.rank)
        """This rank's shard's trainable part: its first elements, the only ones with optimizer state."""
        self.trainable_span = -(-self.trainable_numel // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
        """The trainable part rounded up to ``ALIGN_ELEMENTS``: the size of the blocks that hold it."""
        self.partitioned = partitioned
        self.gathered = True
        self.pieces = layout.pieces(self.rank)
        self.flat_param: torch.Tensor | None = None
        self.param_block: Block | None = None
        self.grad_leaves = False
        """Whether the reduced shard leaves the device: for the optimizer's tier (``offloaded_grad``) or
        straight into the update (engine's [Note: updates in backward])."""
        self.offloaded_grad: OffloadedGrad | None = None
        """Set when the reduced shard lives on the optimizer's tier until the step (``offloaded_grads``)."""
        self.backward_update_norm: torch.Tensor | None = None
        """Set when the unit was updated in this window's backward: the norm of the gradient it used."""
        self._placeholder: torch.Tensor | None = None
        self.flat_grad: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.master: torch.Tensor | None = None
        self.master_is_param = False
        self.has_grad = [False] * len(layout.slots)
        self._written = [False] * len(layout.slots)
        self.pending = 0

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

    def materialize(self, full_fp32: torch.Tensor, device_tier: Tier, master_is_param: bool,
                    param_block: Block | None = None) -> None:
        """Move the parameters into ``flat_param`` (the module's tensors become views) and make the
        persistent gradient buffers; a partitioned unit then keeps only ``param_block`` (which the
        caller fills with the shard). With ``master_is_param`` the fp32 master is the weights' shard
        itself (its trainable part); otherwise the optimizer's state block provides it
        (``optim.state``)."""
        layout = self.layout
        kind = Kind.GATHERED if self.partitioned else Kind.PARAM
        self.flat_param = device_tier.empty(kind, layout.padded_numel, self.compute_dtype)
        self.flat_param.copy_(full_fp32)
        self.attach_params()
        weights = self.flat_param[self.shard_range]
        if self.partitioned:
            self.param_block = param_block
            weights = param_block.data
            self._placeholder = torch.full((1,), math.nan, dtype=self.compute_dtype, device=device_tier.device)
        self.master_is_param = master_is_param
        self.master = weights[:self.trainable_numel] if master_is_param else None
        if self.keep_full_grad:
            self.flat_grad = device_tier.zeros(Kind.GRAD, layout.padded_numel, self.compute_dtype)
        if self.keep_grad_shard and not self.grad_leaves:
            self.grad_shard = device_tier.zeros(Kind.GRAD, layout.shard_numel, self.compute_dtype)
        if self.partitioned:
            self.reshard(device_tier)

    # ---------------------------------------------------------------- gradients
    def begin_backward(self) -> None:
        """Expect one gradient from every trainable slot before the unit counts as complete."""
        self.pending = sum(1 for s in self.layout.slots if s.trainable)

    def ensure_flat_grad(self, tier: Tier) -> torch.Tensor:
        """The full gradient buffer, made (temporary) when this pass has none yet.

        Only the padding is zeroed here: slots are overwritten by their first gradient, and
        ``zero_unwritten`` clears the rest before the buffer is reduced.
        """
        if self.flat_grad is None:
            self.flat_grad = tier.empty(Kind.BUFFER, self.layout.padded_numel, self.compute_dtype)
            self.flat_grad[self.layout.numel:].zero_()
            self._written = [False] * len(self.layout.slots)
        return self.flat_grad

    def accumulate(self, slot_index: int, grad: torch.Tensor, tier: Tier) -> bool:
        """Put one parameter's gradient into ``flat_grad``; True once every trainable slot has reported.

        The first gradient of a window is copied over whatever the buffer held, later ones added, so a
        persistent buffer is never zero-filled; ``zero_unwritten`` clears the slots nobody wrote.
        """
        slot = self.layout.slots[slot_index]
        view = self.ensure_flat_grad(tier)[slot.offset:slot.offset + slot.numel]
        if self._written[slot_index]:
            view.add_(grad.reshape(-1))
        else:
            view.copy_(grad.reshape(-1))
            self._written[slot_index] = True
        self.has_grad[slot_index] = True
        self.pending -= 1
        return self.pending == 0

    def zero_unwritten(self) -> None:
        """Zero the slots that got no gradient this window, before the buffer is reduced."""
        for slot, written in zip(self.layout.slots, self._written):
            if not written:
                self.flat_grad[slot.offset:slot.offset + slot.numel].zero_()

    def release_flat_grad(self, tier: Tier) -> None:
        """Drop a temporary full gradient once it has been reduced (a persistent one stays)."""
        if not self.keep_full_grad:
            tier.free(Kind.BUFFER, self.flat_grad)
            self.flat_grad = None

    def add_grad_shard(self, reduced: torch.Tensor, tier: Tier) -> None:
        """Accumulate a reduced gradient shard (stage 2 adds one per micro-batch), on the device or,
        offloaded, on the optimizer's tier."""
        if self.offloaded_grad is not None:
            self.offloaded_grad.add(reduced)
            return
        if self.grad_shard is None:
            self.grad_shard = tier.zeros(Kind.BUFFER, self.layout.shard_numel, self.compute_dtype)
        self.grad_shard.add_(reduced)

    def local_grad(self) -> torch.Tensor:
        """What the optimizer reads: the reduced shard, or at stage 0 the full all-reduced buffer."""
        return self.grad_shard if self.grad_shard is not None else self.flat_grad

    def clear_grads(self, tier: Tier) -> None:
        """End of an accumulation window: forget persistent gradients, free temporary ones.

        A persistent full gradient is not zero-filled: the next window's first gradients overwrite it.
        """
        if not self.keep_full_grad and self.flat_grad is not None:
            tier.free(Kind.BUFFER, self.flat_grad)
            self.flat_grad = None
        if self.keep_grad_shard and self.grad_shard is not None:  # None when offloaded
            self.grad_shard.zero_()
        elif self.grad_shard is not None:
            tier.free(Kind.BUFFER, self.grad_shard)
            self.grad_shard = None
        if self.offloaded_grad is not None:
            self.offloaded_grad.clear()
        self.backward_update_norm = None
        self.has_grad = [False] * len(self.layout.slots)
        self._written = [False] * len(self.layout.slots)

    # ---------------------------------------------------------------- parameters
    def attach_params(self) -> None:
        """Make the module's parameters views of ``flat_param`` (whose storage must be present)."""
        for slot in self.layout.slots:
            slot.param.data = self.flat_param[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def gather_buffer(self, tier: Tier) -> torch.Tensor:
        """``flat_param`` with its storage restored, for the all-gather of a partitioned unit."""
        if self.gathered:
            raise RuntimeError(f"unit {self.layout.name or '<root>'} is already gathered")
        tier.restore_storage(Kind.GATHERED, self.flat_param)
        self.gathered = True
        return self.flat_param

    def reshard(self, tier: Tier) -> None:
        """Back to the shard alone: parameters become placeholders and the full buffer's memory is freed."""
        if not self.gathered:
            return
        for slot in self.layout.slots:
            slot.param.data = self._placeholder.expand(slot.shape)
        tier.release_storage(Kind.GATHERED, self.flat_param)
        self.gathered = False


def span_block(tier: Tier, kind: Kind, key: str, numel: int, dtype: torch.dtype) -> Block:
    """``tier.block(...)`` for state over a trainable span; a span of nothing (a frozen shard) gets an
    empty resident block instead: streams load and store it at no cost, and no tier counts it."""
    if numel == 0:
        return Block(torch.empty(0, dtype=dtype, device=tier.device))
    return tier.block(kind, key, numel, dtype)


class _Both:
    """The moves of a block's two parts, waited for together (every one, even after a failure)."""

    def __init__(self, handles: list):
        self.handles = handles

    def wait(self) -> int:
        error = None
        for handle in self.handles:
            try:
                handle.wait()
            except Exception as exc:  # keep waiting: no buffer may be freed under a transfer
                error = error or exc
        if error is not None:
            raise error
        return 0


class SplitShardBlock(Block):
    """A partitioned unit's shard home on NVMe kept as two blocks: ``head``, the trainable span, which a
    step rewrites (``publication``: read first, for the few frozen values in its last granule), and
    ``tail``, the frozen values past it, which only whole writes store (first values, loads,
    ``gathered``). Loading reads both into one buffer, so to the scheduler the shard is one tensor;
    storing writes both. Frozen weights are thus read every pass and never written back by a step
    (bar those sharing the head's last 4 KiB-aligned granule, rewritten as read), and each block's
    checksum (``nvme.checksum``) covers its own bytes."""

    resident = False

    def __init__(self, head: Block, tail: Block):
        self.head, self.tail = head, tail
        self.numel, self.dtype = head.numel + tail.numel, head.dtype
        self.data: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None

    def load(self, buffer: torch.Tensor | None = None, *, read: bool = True) -> _Both:
        raw = buffer.view(torch.uint8)
        self._buffer, self.data = buffer, raw[:self.nbytes].view(self.dtype)
        head = self.head.load(raw[:self.head.nbytes], read=read)
        try:
            return _Both([head, self.tail.load(raw[self.head.nbytes:], read=read)])
        except BaseException:
            with contextlib.suppress(Exception):  # already failing: the first error is the one to see
                head.wait()  # the buffer must not be freed under the head's transfer
            raise

    def store(self) -> _Both:
        return _Both([self.head.store(), self.tail.store()])

    def unload(self) -> torch.Tensor | None:
        self.head.unload()
        self.tail.unload()
        buffer, self._buffer, self.data = self._buffer, None, None
        return buffer
