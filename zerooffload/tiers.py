"""Tiers: where a kind of state lives, what it may hold, and what it holds now.

[Note: tiers and kinds]
- A *tier* is a place for tensors with a torch device and a byte *budget*: ``device`` (the compute
  device; on a CPU-only machine, RAM accounted against ``memory.device_budget``), ``host`` (page-aligned
  RAM, pinned when CUDA is present) and, in a later layer, ``nvme``.
- A *kind* says what a tensor is for (parameters, gradients, optimizer state, engine buffers); every
  allocation names its kind so ``memory_report`` can say bytes per tier × kind and the peak.
- The engine never asks which tier it has: it asks the tier for tensors (``empty``/``zeros``), gives
  them back (``free``), and copies between tiers' devices; a tier that would pass its budget raises
  ``BudgetError``. ``check_plan`` refuses a whole run up front, before anything is allocated.
"""
from __future__ import annotations

import abc
import enum

import torch

from .config import ConfigError, MemoryConfig
from .io.buffers import aligned_empty

__all__ = ["Kind", "Tier", "DeviceTier", "HostTier", "BudgetError", "make_tiers", "check_plan", "Plan"]


class Kind(enum.Enum):
    PARAM = "param"
    """Parameters in the compute dtype: full, or this rank's shard."""
    GRAD = "grad"
    """Gradients in the compute dtype: full, or this rank's shard."""
    OPTIMIZER = "optimizer"
    """fp32 master weights (when separate from the parameters) and optimizer moments."""
    GATHERED = "gathered"
    """Stage 3: full parameters of units gathered for compute (bounded by ``zero.max_live_size``)."""
    BUFFER = "buffer"
    """Engine temporaries: gradients of a unit being reduced, reduce-scatter outputs, staging."""


class BudgetError(ConfigError):
    """A tier cannot hold what the run needs; the message has the numbers and the keys to change."""


Plan = dict[str, dict[Kind, int]]
"""Bytes a run will need, by tier name and kind (steady state plus the largest temporaries)."""


class Tier(abc.ABC):
    """A budgeted place for tensors; subclasses decide how memory is allocated."""

    budget_key = ""

    def __init__(self, name: str, device: torch.device, budget: int | None):
        self.name = name
        self.device = device
        self.budget = budget
        self.usage = {kind: 0 for kind in Kind}
        self.peak = 0

    @property
    def used(self) -> int:
        return sum(self.usage.values())

    def _account(self, kind: Kind, nbytes: int) -> None:
        if self.budget is not None and self.used + nbytes > self.budget:
            raise BudgetError(
                f"{self.name} tier: allocating {nbytes} bytes of {kind.value} would hold {self.used + nbytes} bytes, "
                f"over {self.budget_key} = {self.budget}; raise it or move state to another tier")
        self.usage[kind] += nbytes
        self.peak = max(self.peak, self.used)

    @abc.abstractmethod
    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh 1-D tensor in this tier's memory."""

    def empty(self, kind: Kind, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized 1-D tensor of ``numel`` elements, counted against this tier as ``kind``."""
        self._account(kind, numel * dtype.itemsize)
        return self._allocate(numel, dtype)

    def zeros(self, kind: Kind, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(kind, numel, dtype).zero_()

    def free(self, kind: Kind, tensor: torch.Tensor | None) -> None:
        """Stop counting ``tensor`` (the caller drops its references; memory returns when they are gone)."""
        if tensor is not None:
            self.usage[kind] -= tensor.numel() * tensor.element_size()

    def release_storage(self, kind: Kind, tensor: torch.Tensor) -> None:
        """Free ``tensor``'s memory now but keep the tensor, and every view of it, for ``restore_storage``.

        Views saved by autograd share the storage, so they are freed too and come back with it.
        """
        tensor.untyped_storage().resize_(0)
        self.free(kind, tensor)

    def restore_storage(self, kind: Kind, tensor: torch.Tensor) -> None:
        """Give a tensor whose storage was released its memory back (contents undefined), counted as ``kind``."""
        nbytes = tensor.numel() * tensor.element_size()
        self._account(kind, nbytes)
        tensor.untyped_storage().resize_(nbytes)


class DeviceTier(Tier):
    """The compute device's memory (RAM on a CPU-only machine)."""

    budget_key = "memory.device_budget"

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)


class HostTier(Tier):
    """Page-aligned host RAM, pinned when CUDA is present so copies to the device run asynchronously."""

    budget_key = "memory.host_budget"

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return aligned_empty(numel * dtype.itemsize, dtype)


def _device_budget(value: int | str, device: torch.device) -> int | None:
    if value != "auto":
        return int(value)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return None  # a CPU "device" is RAM the OS pages; no budget unless the user sets one


def make_tiers(memory: MemoryConfig, device: torch.device) -> dict[str, Tier]:
    """The tiers of a run, by the names config uses (``offload.*.tier``)."""
    host_budget = None if memory.host_budget == "auto" else int(memory.host_budget)
    return {"device": DeviceTier("device", device, _device_budget(memory.device_budget, device)),
            "host": HostTier("host", torch.device("cpu"), host_budget)}


def check_plan(plan: Plan, tiers: dict[str, Tier]) -> None:
    """Refuse a run whose planned bytes exceed a tier's budget, before anything is allocated."""
    for name, kinds in plan.items():
        tier, total = tiers[name], sum(kinds.values())
        if tier.budget is not None and total > tier.budget:
            parts = ", ".join(f"{kind.value} {n}" for kind, n in kinds.items() if n)
            raise BudgetError(
                f"the {name} tier needs {total} bytes ({parts}) but {tier.budget_key} is "
                f"{tier.budget} bytes ({total - tier.budget} short): raise {tier.budget_key}, "
                "use a higher zero.stage, or move state to another tier (offload.optimizer.tier, offload.param.tier)")
