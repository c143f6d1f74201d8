"""What the engine reports: memory per tier × kind, the last step's numbers (frozen snapshots), and the
prediction a plan made of them, handed in as data so that the two can be read side by side.

[Note: phases]
A step's wall time splits into *phases*, the engine calls that run it: ``forward`` (``engine(...)``),
``backward`` (``engine.backward``) and ``step`` (``engine.step`` at the boundary: the norm, the
updates, the streaming of optimizer blocks), summed over the window's micro-batches; what the user's
loop does between the calls (the loss, the data) is the rest of ``seconds``. A plan predicts the same
phases (``Prediction.phases``) and, under them, the seconds of *work* each resource does before
overlap (``Prediction.work``): compute, optimizer, nvme_read, nvme_write, host_device, collectives.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

from .tiers import IOStats, Kind, LinkStats, Tier
from .zero.scheduler import PrefetchStats

__all__ = ["PHASES", "MemoryReport", "Prediction", "StepStats", "memory_report"]

PHASES = ("forward", "backward", "step")
"""The engine calls a step's time is split into ([Note: phases])."""


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
class Prediction:
    """What a plan expects of one optimizer step of a run (``zerooffload plan``), as plain data."""

    step_seconds: float
    phases: Mapping[str, float]
    """Seconds per phase of ``PHASES`` ([Note: phases])."""
    work: Mapping[str, float]
    """Seconds of work per resource before overlap ([Note: phases]); the largest is the bottleneck."""
    peak_bytes: Mapping[str, int]
    """Peak bytes per tier (``device``, ``host``, ``nvme``), activations on the device included."""
    moved_bytes: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    """Bytes a step moves: ``nvme_read``, ``nvme_write`` (what ``StepStats.io`` counts) and ``host_device``."""
    bottleneck: str = ""
    """One line saying what bounds the step, e.g. ``disk-bound: 3.1 GB read per step at 2.0 GB/s``."""
    ram_peak_bytes: int | None = None
    """On a CPU device, where the device and host tiers are one RAM: their expected peak together. Each
    tier's peak comes in its own phase (the host's streaming buffers in the step, the device's
    activations at the end of forward), so this is less than their sum (predict's note)."""
    redone: Prediction | None = None
    """The same step when a binding ``train.grad_clip`` redoes its tentative updates (their blocks read,
    updated and written again in the step: backward_updates' note); None where no unit updates
    tentatively. The rest of this prediction is the step the clip leaves alone."""

    def as_json(self) -> dict:
        return {"step_seconds": self.step_seconds, "phases": dict(self.phases), "work": dict(self.work),
                "peak_bytes": dict(self.peak_bytes), "moved_bytes": dict(self.moved_bytes),
                "bottleneck": self.bottleneck, "ram_peak_bytes": self.ram_peak_bytes,
                "redone": self.redone.as_json() if self.redone else None}

    @classmethod
    def from_json(cls, data: dict) -> Prediction:
        mappings = ("phases", "work", "peak_bytes", "moved_bytes")
        redone = data.get("redone")
        return cls(**{k: MappingProxyType(dict(v)) if k in mappings else v for k, v in data.items() if k != "redone"},
                   redone=cls.from_json(redone) if redone else None)

    def __reduce__(self):
        """Pickled as its JSON (a mapping proxy does not pickle): rank 0's plan reaches every rank."""
        return Prediction.from_json, (self.as_json(),)


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
    phase_seconds: Mapping[str, float] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    """Wall time of the window per phase of ``PHASES`` ([Note: phases])."""
    predicted: Prediction | None = None
    """The plan's prediction for such a step, when the engine was given one (``initialize(prediction=)``)."""
    intra_node_bytes: int = 0
    """Bytes this rank's data collectives sent to ranks of its own node in the window."""
    inter_node_bytes: int = 0
    """Bytes this rank's data collectives sent to other nodes in the window: its share of the link's traffic."""

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
                 link: LinkStats, predicted: Prediction | None = None):
        self.counters, self.prefetch, self.live_bytes, self.io, self.link = counters, prefetch, live_bytes, io, link
        self.predicted = predicted
        self.started = time.perf_counter()
        self.phases = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the block's wall time to phase ``name``'s in this window."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] += time.perf_counter() - start

    def start(self) -> None:
        self.counters.reset()
        self.prefetch.reset(self.live_bytes())
        self.io.reset()
        self.link.reset()
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.started = time.perf_counter()

    def stats(self, *, step: int, updated: bool, skipped_steps: int, norm_sq: float, loss_scale: float, lr: float,
              memory: MemoryReport, undone_updates: int = 0, step_started: float | None = None) -> StepStats:
        """The window's ``StepStats`` (``norm_sq``: the unscaled squared global gradient norm;
        ``step_started``: when the running ``step`` phase began, counted up to now)."""
        counters, now = self.counters, time.perf_counter()
        phases = dict(self.phases)
        if step_started is not None:
            phases["step"] += now - step_started
        return StepStats(
            step=step, updated=updated, skipped_steps=skipped_steps,
            grad_norm=math.sqrt(norm_sq) if math.isfinite(norm_sq) else float("inf"), loss_scale=loss_scale, lr=lr,
            data_elements=counters.data_elements, data_bytes=counters.data_bytes,
            control_elements=counters.control_elements, memory=memory, prefetch=dataclasses.replace(self.prefetch),
            io=dataclasses.replace(self.io), link=dataclasses.replace(self.link),
            seconds=now - self.started, undone_updates=undone_updates, phase_seconds=MappingProxyType(phases),
            predicted=self.predicted, intra_node_bytes=counters.intra_node_bytes,
            inter_node_bytes=counters.inter_node_bytes)
