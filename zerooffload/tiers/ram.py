"""Refusals before anything is allocated: a run's planned bytes against the tiers' budgets and the RAM.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import psutil
import torch

from ..config import MemoryConfig
from ..kinds import Kind
from .tier import BudgetError, MemoryPlan, Tier

__all__ = ["RAM_MARGIN", "RAM_MARGIN_MIN", "available_ram", "check_plan", "check_ram"]


RAM_MARGIN = 0.10
"""Share of RAM (at least ``RAM_MARGIN_MIN``) kept out of the "auto" budgets: activations, the
allocator's slack, torch and the interpreter are not the engine's tensors but live in the same RAM."""


RAM_MARGIN_MIN = 1 << 30


def available_ram() -> int:
    """Bytes of RAM this process can still take: the kernel's estimate (MemAvailable), lowered to
    what the cgroup limit leaves when a container has one (the OOM killer acts on that)."""
    available = psutil.virtual_memory().available
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        with contextlib.suppress(OSError, ValueError):
            with open(limit_path) as limit, open(usage_path) as usage:
                available = min(available, int(limit.read()) - int(usage.read()))  # "max" raises ValueError
    return max(available, 0)


def check_ram(plan: MemoryPlan, memory: MemoryConfig, device: torch.device, *, activations: int = 0, released: int = 0,
              local_ranks: int = 1, suggestion: Callable[[Callable[[MemoryPlan, int], bool]], str | None] = lambda fits: None
              ) -> None:
    """Refuse a run whose "auto" tiers cannot fit in the RAM the machine really has, before anything
    is allocated. The host tier lives in RAM; so does the device tier on a CPU-only machine, so there
    the two plans share it, with the device's ``activations`` (measured bytes; 0 when unknown, left to
    the margin). ``released``: bytes the model holds now that its flattening gives back (an eagerly
    built model's parameters). ``local_ranks`` processes of the job share this RAM, each with a plan
    like ``plan``. ``suggestion(fits)`` names a layout that would fit (``fits(plan, activations)``)."""
    in_ram = [name for name, auto in (("host", memory.host_budget == "auto"),
                                      ("device", device.type == "cpu" and memory.device_budget == "auto")) if auto]
    available, margin = available_ram(), max(RAM_MARGIN_MIN, int(RAM_MARGIN * psutil.virtual_memory().total))
    room = (available - margin) // local_ranks + released

    def need(candidate: MemoryPlan, activation_bytes: int) -> dict[str, int]:
        return {name: sum(candidate.get(name, {}).values()) + (activation_bytes if name == "device" else 0)
                for name in in_ram}

    def fits(candidate: MemoryPlan, activation_bytes: int) -> bool:
        return sum(need(candidate, activation_bytes).values()) <= room

    if not in_ram or fits(plan, activations):
        return
    needed = need(plan, activations)
    parts = "; ".join(f"{name} tier {n:,} ({_kinds(plan[name], activations if name == 'device' else 0)})"
                      for name, n in needed.items() if n)
    layout = suggestion(fits)
    fix = (f"a layout that fits: {layout}" if layout else "no layout of this model fits here: use a machine with "
           "more RAM, or set memory.device_budget/host_budget if you know better")
    shared = f", shared by {local_ranks} ranks" if local_ranks > 1 else ""
    given_back = f", plus {released:,} the model's weights give back" if released else ""
    kept_for = "the allocator and torch" if activations else "activations, the allocator and torch"
    raise BudgetError(f"the run needs {sum(needed.values()):,} bytes of RAM per rank ({parts}) but "
                      f"this machine has {max(room, 0):,} for it ({available:,} available, less {margin:,} kept for "
                      f"{kept_for}{shared}{given_back}; memory.*_budget = \"auto\"); {fix}")


def _kinds(kinds: dict[Kind, int], activations: int) -> str:
    """``param 1,024, grad 2,048, ...``: the kinds a tier's plan holds, and the measured activations."""
    parts = [f"{k.value} {b:,}" for k, b in kinds.items() if b]
    return ", ".join(parts + ([f"activations {activations:,}"] if activations else []))


def check_plan(plan: MemoryPlan, tiers: dict[str, Tier], activations: int = 0) -> None:
    """Refuse a run whose planned bytes (and the device's measured ``activations``) exceed a tier's
    budget, before anything is allocated."""
    for name, kinds in plan.items():
        extra = activations if name == "device" else 0
        tier, total = tiers.get(name), sum(kinds.values()) + extra
        if tier is not None and tier.budget is not None and total > tier.budget:  # nvme: checked as it opens
            parts = ", ".join(f"{kind.value} {n}" for kind, n in kinds.items() if n)
            parts += f", activations {extra}" if extra else ""
            raise BudgetError(
                f"the {name} tier needs {total} bytes ({parts}) but {tier.budget_words} "
                f"({total - tier.budget} short): raise {tier.budget_key}, "
                "use a higher zero.stage, or move state to another tier (offload.optimizer.tier, offload.param.tier)")
