"""Unit layouts: which parameters are managed together, and where each lies in its unit's flat buffer.

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
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ALIGN_ELEMENTS", "Slot", "Piece", "UnitLayout", "find_units", "rebind"]

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


def rebind(layouts: list[UnitLayout], replaced: dict[int, nn.Parameter]) -> list[UnitLayout]:
    """``layouts`` with each parameter that ``replaced`` names (by the old one's id) swapped for its
    replacement: a lazily built model's units, found once on the meta device, kept after its meta
    parameters become placeholders (``lazy_init.swap_in_placeholders``)."""
    return [dataclasses.replace(layout, slots=tuple(dataclasses.replace(slot, param=replaced.get(id(slot.param),
                                                                                                 slot.param))
                                                    for slot in layout.slots)) for layout in layouts]
