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
import threading

import torch

from ..config import ConfigError, MemoryConfig
from ..io.buffers import aligned_empty
from ..kinds import Kind
from ..trace import RECORDER
from .blocks import Block
from .buffer_arena import BufferArena
from .device_memory import context_bytes, cublas_workspace_bytes
from .host_allocator import advise_fresh

__all__ = ["BudgetError", "DeviceTier", "HostTier", "MemoryPlan", "Tier", "close_tiers", "make_tiers", "release_idle"]


class BudgetError(ConfigError):
    """A tier cannot hold what the run needs; the message has the numbers and the keys to change."""


MemoryPlan = dict[str, dict[Kind, int]]
"""Bytes a run will need, by tier name and kind (steady state plus the largest temporaries)."""


class Tier(abc.ABC):
    """A budgeted place for tensors; subclasses decide how memory is allocated."""

    budget_key = ""
    resident = True
    """Whether the tier's tensors are memory the compute can address (device, host) or not (nvme)."""

    def __init__(self, name: str, device: torch.device, budget: int | None):
        self.name = name
        self.device = device
        self.budget = budget
        self.budget_words = "" if budget is None else f"{self.budget_key} is {budget} bytes"
        """The budget in a refusal's words: the key, and on CUDA what it leaves for the engine (``make_tiers``)."""
        self.usage = {kind: 0 for kind in Kind}
        self.peak = 0
        self._lock = threading.RLock()
        """Allocations and frees come from the autograd thread and the update worker (update_worker's note)
        at once: the counts and the arena change under this lock."""
        self.arena = BufferArena() if self.resident and device.type == "cpu" else None
        """Engine buffers kept for reuse in CPU memory (buffer_arena's [Note: buffer arena])."""
        self._huge_pages = self.resident and device.type == "cpu" and not torch.cuda.is_available()
        """Whether torch's fresh CPU buffers (the device tier's, storage restored) get huge pages
        (host_allocator's [Note: huge pages for engine buffers]); not where CUDA is, whose host buffers are
        pinned. The host tier's aligned buffers get them from ``aligned_empty``."""

    @property
    def used(self) -> int:
        return sum(self.usage.values())

    @property
    def idle(self) -> int:
        """Bytes the arena keeps for reuse: held, though no tensor uses them now."""
        return 0 if self.arena is None else self.arena.idle_bytes

    def _account(self, kind: Kind, nbytes: int) -> None:
        if self.budget is not None and self.used + self.idle + nbytes > self.budget:
            self.release_idle()  # what the arena keeps yields to what is asked for
        if self.budget is not None and self.used + nbytes > self.budget:
            raise BudgetError(
                f"{self.name} tier: allocating {nbytes} bytes of {kind.value} would hold {self.used + nbytes} bytes, "
                f"over its budget ({self.budget_words}); raise {self.budget_key} or move state to another tier")
        self.usage[kind] += nbytes
        self.peak = max(self.peak, self.used + self.idle)
        RECORDER.counter(self.name, self.used)

    @abc.abstractmethod
    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh 1-D tensor in this tier's memory."""

    def empty(self, kind: Kind, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized 1-D tensor of ``numel`` elements, counted against this tier as ``kind``
        (an engine buffer may be one the arena kept)."""
        with self._lock:
            reused = self.arena.take(numel, dtype) if kind is Kind.BUFFER and self.arena is not None else None
            self._account(kind, numel * dtype.itemsize)
        if reused is not None:
            return reused
        tensor = self._allocate(numel, dtype)
        if kind is Kind.BUFFER and self.arena is not None:
            with self._lock:
                self.arena.lend(tensor)
        return tensor

    def zeros(self, kind: Kind, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(kind, numel, dtype).zero_()

    def free(self, kind: Kind, tensor: torch.Tensor | None) -> None:
        """Stop counting ``tensor`` (the caller drops its references; memory returns when they are gone,
        or an engine buffer waits in the arena for its next use)."""
        if tensor is not None:
            with self._lock:
                self.usage[kind] -= tensor.numel() * tensor.element_size()
                RECORDER.counter(self.name, self.used)
                if kind is Kind.BUFFER and self.arena is not None:
                    self.arena.give_back(tensor)

    def release_idle(self) -> None:
        """Let the buffers the arena keeps go: at the end of a phase, or to make room."""
        if self.arena is not None:
            with self._lock:
                self.arena.clear()

    def release_storage(self, kind: Kind, tensor: torch.Tensor) -> None:
        """Free ``tensor``'s memory now but keep the tensor, and every view of it, for ``restore_storage``.

        Views saved by autograd share the storage, so they are freed too and come back with it.
        """
        tensor.untyped_storage().resize_(0)
        self.free(kind, tensor)

    def close(self) -> None:
        """Release what the tier holds outside memory (the NVMe tier's swap files)."""

    def block(self, kind: Kind, key: str, numel: int, dtype: torch.dtype, *, aside: bool = False,
              segment: int = 0) -> "Block":
        """A buffer of ``numel`` ``dtype`` elements whose home is this tier (see [Note: blocks]); a block
        in memory is changed in place, so it keeps no version ``aside`` (NVMe blocks do). ``segment``:
        bytes of each part that may be read on its own, the last may be shorter (verified apart on NVMe:
        swapfile's note); 0: the block is one part."""
        if aside:
            raise ValueError(f"block {key!r} on the {self.name} tier is changed in place: it cannot keep a version "
                             "aside (only NVMe blocks can)")
        return Block(self.empty(kind, numel, dtype))

    def restore_storage(self, kind: Kind, tensor: torch.Tensor) -> None:
        """Give a tensor whose storage was released its memory back (contents undefined), counted as ``kind``."""
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self._account(kind, nbytes)
        tensor.untyped_storage().resize_(nbytes)
        if self._huge_pages:
            advise_fresh(tensor)


class DeviceTier(Tier):
    """The compute device's memory (RAM on a CPU-only machine)."""

    budget_key = "memory.device_budget"

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(numel, dtype=dtype, device=self.device)
        if self._huge_pages:
            advise_fresh(tensor)
        return tensor


class HostTier(Tier):
    """Page-aligned host RAM, pinned when CUDA is present so copies to the device run asynchronously."""

    budget_key = "memory.host_budget"

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return aligned_empty(numel * dtype.itemsize, dtype)


def _device_budget(value: int | str, device: torch.device) -> tuple[int | None, str]:
    """The device tier's budget for the engine's tensors and the activations, and its words in a refusal:
    ``memory.device_budget`` as set, less on CUDA what the process holds besides them (device_memory's
    [Note: a budget CUDA enforces]); "auto": 90% of a GPU's free memory, no budget on a CPU device."""
    if value == "auto":
        if device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(device)[0] * 0.9)
            return budget, f"memory.device_budget = \"auto\" gives {budget} bytes (90% of the GPU's free memory)"
        return None, ""  # a CPU "device" is RAM the OS pages; no budget unless the user sets one
    budget = int(value)
    if device.type != "cuda":
        return budget, f"memory.device_budget is {budget} bytes"
    context, workspace = context_bytes(device), cublas_workspace_bytes(device)
    left = budget - context - workspace
    words = (f"memory.device_budget = {budget} leaves {left} bytes for the engine (less {context} for the CUDA "
             f"context and {workspace} for cuBLAS's workspaces)")
    if left <= 0:
        raise BudgetError(f"{words}: raise memory.device_budget past {context + workspace} bytes")
    return left, words


def make_tiers(memory: MemoryConfig, device: torch.device) -> dict[str, Tier]:
    """The resident tiers of a run, by the names config uses (``offload.*.tier``); the engine adds
    ``nvme`` once it knows how much swap space to reserve."""
    host_budget = None if memory.host_budget == "auto" else int(memory.host_budget)
    device_tier = DeviceTier("device", device, None)
    device_tier.budget, device_tier.budget_words = _device_budget(memory.device_budget, device)
    return {"device": device_tier, "host": HostTier("host", torch.device("cpu"), host_budget)}


def release_idle(tiers: dict[str, Tier]) -> None:
    """A phase (a backward, a step) is over: the buffers every tier's arena kept for reuse go."""
    for tier in tiers.values():
        tier.release_idle()


def close_tiers(tiers: dict[str, Tier]) -> None:
    """Stop accounting every tier's tensors and release what the tiers hold (swap files)."""
    for tier in tiers.values():
        tier.usage = {kind: 0 for kind in Kind}
        tier.close()
    release_idle(tiers)
