"""What the engine reports: memory per tier × kind, and the last step's numbers (frozen snapshots)."""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

from .tiers import IOStats, Kind, LinkStats, Tier
from .zero.scheduler import PrefetchStats

__all__ = ["MemoryReport", "StepStats", "memory_report"]


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Bytes the engine holds now, per tier and kind; each tier's peak and budget (None = unlimited)."""

    bytes_by_tier: Mapping[str, Mapping[str, int]]
    peaks: Mapping[str, int]
    budgets: Mapping[str, int | None]

    def bytes(self, tier: str, kind: str | Kind) -> int:
        return self.bytes_by_tier[tier][kind.value if isinstance(kind, Kind) else kind]

    def total(self, tier: str) -> int:
        return sum(self.bytes_by_tier[tier].values())

    def __str__(self) -> str:
        kinds = [k.value for k in Kind]
        lines = [f"{'tier':<8}" + "".join(f"{k:>14}" for k in kinds) + f"{'peak':>14}{'budget':>14}"]
        for tier, by_kind in self.bytes_by_tier.items():
            budget = self.budgets[tier]
            lines.append(f"{tier:<8}" + "".join(f"{by_kind[k]:>14,}" for k in kinds)
                         + f"{self.peaks[tier]:>14,}" + f"{'-' if budget is None else f'{budget:,}':>14}")
        return "\n".join(lines)


def memory_report(tiers: dict[str, Tier]) -> MemoryReport:
    """A snapshot of every tier's accounting."""
    return MemoryReport(
        MappingProxyType({name: MappingProxyType({k.value: t.usage[k] for k in Kind}) for name, t in tiers.items()}),
        MappingProxyType({name: t.peak for name, t in tiers.items()}),
        MappingProxyType({name: t.budget for name, t in tiers.items()}))


@dataclass(frozen=True, slots=True)
class StepStats:
    """The last accumulation window: what the optimizer did and what the collectives moved."""

    step: int
    """Optimizer steps attempted so far (updates plus skipped)."""
    updated: bool
    skipped_steps: int
    """Steps skipped in total: fp16 overflows, and inf/NaN losses or gradients (``train.skip_nonfinite``)."""
    grad_norm: float | None
    """Global gradient norm before clipping (None before the first step)."""
    loss_scale: float
    lr: float
    data_elements: int
    """Collective elements per rank in the window (DESIGN §3's convention)."""
    data_bytes: int
    control_elements: int
    memory: MemoryReport
    prefetch: PrefetchStats
    """Stage 3: all-gathers served ahead of need, stalls and peak gathered bytes in the window."""
    io: IOStats
    """NVMe tier: bytes read and written in the window and the time waited for them (zeros without it)."""
    link: LinkStats
    """Host memory <-> device tier: bytes each way in the window (offloaded parameters, gradients, updates)."""
    seconds: float
    """Wall time of the window (previous step's end to this step's end): divide bytes by it for GB/s."""
    undone_updates: int = 0
    """Units whose tentative update in backward this step undid: redone clipped, or dropped by a skipped
    step (backward_updates' [Note: tentative updates]); 0 where the clip did not bind."""

    @property
    def prefetch_hit_rate(self) -> float | None:
        uses = self.prefetch.hits + self.prefetch.misses
        return self.prefetch.hits / uses if uses else None

    @property
    def stall_seconds(self) -> float:
        """Time blocked in the window on NVMe transfers and on all-gathers; the rest of ``seconds`` was
        spent computing (or copying)."""
        return self.io.wait_seconds + self.prefetch.wait_seconds

    @property
    def io_gbps(self) -> float:
        return (self.io.read_bytes + self.io.write_bytes) / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def link_gbps(self) -> float:
        moved = self.link.host_to_device_bytes + self.link.device_to_host_bytes
        return moved / self.seconds / 1e9 if self.seconds > 0 else 0.0


class WindowMeter:
    """The counters of one accumulation window (collectives, prefetch, NVMe, link) and its wall time:
    reset as a window starts, read into ``StepStats`` as it ends."""

    def __init__(self, counters: Any, prefetch: PrefetchStats, live_bytes: Callable[[], int], io: IOStats,
                 link: LinkStats):
        self.counters, self.prefetch, self.live_bytes, self.io, self.link = counters, prefetch, live_bytes, io, link
        self.started = time.perf_counter()

    def start(self) -> None:
        self.counters.reset()
        self.prefetch.reset(self.live_bytes())
        self.io.reset()
        self.link.reset()
        self.started = time.perf_counter()

    def stats(self, *, step: int, updated: bool, skipped_steps: int, norm_sq: float, loss_scale: float, lr: float,
              memory: MemoryReport, undone_updates: int = 0) -> StepStats:
        """The window's ``StepStats`` (``norm_sq``: the unscaled squared global gradient norm)."""
        counters = self.counters
        return StepStats(
            step=step, updated=updated, skipped_steps=skipped_steps,
            grad_norm=math.sqrt(norm_sq) if math.isfinite(norm_sq) else float("inf"), loss_scale=loss_scale, lr=lr,
            data_elements=counters.data_elements, data_bytes=counters.data_bytes,
            control_elements=counters.control_elements, memory=memory, prefetch=dataclasses.replace(self.prefetch),
            io=dataclasses.replace(self.io), link=dataclasses.replace(self.link),
            seconds=time.perf_counter() - self.started, undone_updates=undone_updates)
