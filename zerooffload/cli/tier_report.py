"""What a ``zerooffload train`` run kept on each tier and what it moved between them: its last lines and
summary.json's ``tiers`` and ``traffic``, from the engine's own telemetry.

[Note: the tier lines]
- *Where the states lived*, per tier (``device``, ``host``, ``nvme``) and kind (``Kind``): the most the
  tier held of that kind at the end of a step (``engine.stats.memory``: the states at rest, which is
  where they live), and the tier's peak at any moment (``memory_report().peaks``: with a step's
  temporaries, gathered parameters and staging buffers). On a CPU-only machine the device tier is RAM
  accounted apart from the host's. Where the placement stores differently than the kinds suggest, a line
  says so: stage-3 parameters kept inside their fp32 masters on NVMe (no copy of their own), and blocks
  stored twice where updates made in backward are tentative (the block before the update is kept for a
  redo when the clip binds).
- *What moved, per step*: NVMe bytes read and written (``stats.io``) and the time the run waited for
  them, and bytes between host and device (``stats.link``): the median over the steps after the first
  (which records the trace and faults the buffers in), the rates those bytes over the median step's
  wall time. Totals over all of this process's steps are kept too (summary.json's ``traffic``).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = ["TierLog", "tier_lines", "tier_summary"]

_FIELDS = ("nvme_read", "nvme_write", "host_to_device", "device_to_host", "intra_node", "inter_node")
"""Bytes a step moved: NVMe, host <-> device, and what this rank's collectives sent within and across nodes."""
_ALWAYS = ("param", "grad", "optimizer")
"""The kinds shown even where no tier holds them: the model states a reader looks for."""


@dataclass(slots=True)
class TierLog:
    """Each step's bytes moved and the most each tier held of each kind at a step's end (see the note)."""

    steps: list[dict[str, float]] = field(default_factory=list)
    at_rest: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, stats) -> None:
        """Log the step ``stats`` (``engine.stats``) describes."""
        self.steps.append({"nvme_read": stats.io.read_bytes, "nvme_write": stats.io.write_bytes,
                           "nvme_wait": stats.io.wait_seconds, "host_to_device": stats.link.host_to_device_bytes,
                           "device_to_host": stats.link.device_to_host_bytes,
                           "intra_node": stats.intra_node_bytes, "inter_node": stats.inter_node_bytes})
        for tier, kinds in stats.memory.bytes_by_tier.items():
            held = self.at_rest.setdefault(tier, {})
            for kind, nbytes in kinds.items():
                held[kind] = max(held.get(kind, 0), nbytes)


def tier_summary(engine, log: TierLog, step_seconds: list[float]) -> dict:
    """summary.json's ``tiers`` (per tier: ``at_rest`` bytes by kind, ``peak``, ``budget``), ``traffic`` (per
    step medians, rates and totals) and ``placement_notes`` (see the note); before ``engine.close()``."""
    report = engine.memory_report()
    tiers = {tier: {"at_rest": dict(log.at_rest.get(tier, {})), "peak": peak, "budget": report.budgets[tier]}
             for tier, peak in report.peaks.items()}
    steady = log.steps[1:] or log.steps
    seconds = statistics.median(step_seconds[1:] or step_seconds) if step_seconds else 0.0
    traffic = {"steps": len(steady), "step_seconds": seconds,
               "nvme_wait_seconds": statistics.median(s["nvme_wait"] for s in steady) if steady else 0.0}
    for name in _FIELDS:
        median = statistics.median(s[name] for s in steady) if steady else 0
        traffic[f"{name}_bytes"] = median
        traffic[f"{name}_total_bytes"] = sum(s[name] for s in log.steps)
        if name.startswith("nvme"):
            traffic[f"{name}_gbps"] = median / seconds / 1e9 if seconds else 0.0
    return {"tiers": tiers, "traffic": traffic, "placement_notes": _placement_notes(engine.placement)}


def _placement_notes(placement) -> list[str]:
    """What the kinds alone do not say about where the states are stored (see the note)."""
    units = placement.units
    notes = []
    if any(u.params_in_masters for u in units):
        notes.append("parameters: on nvme inside their fp32 masters (counted as optimizer), no copy of their own")
    tentative = {u.optimizer for u in units if u.updates_tentatively}
    if tentative:
        notes.append(f"optimizer on {', '.join(sorted(tentative))}: each block stored twice, as updates made in "
                     "backward keep the block before them for a redo if the clip binds")
    return notes


def tier_lines(s: dict) -> list[str]:
    """The last lines of a run: bytes by tier and kind in MB, the notes, and the traffic (see the note)."""
    tiers = s["tiers"]
    kinds = [*_ALWAYS, *(kind for kind in ("gathered", "buffer", "activation")
                         if any(t["at_rest"].get(kind) for t in tiers.values()))]
    budgets = any(t["budget"] is not None for t in tiers.values())
    lines = ["model states by tier, MB (each kind: the most held at a step's end; peak: at any moment)",
             f"{'':<8}" + "".join(f"{kind:>11}" for kind in kinds) + f"{'peak':>11}" + (f"{'budget':>11}" if budgets
                                                                                         else "")]
    for tier, t in tiers.items():
        cells = [f"{t['at_rest'][kind] / 1e6:>11.1f}" if t["at_rest"].get(kind) else f"{'-':>11}" for kind in kinds]
        budget = "-" if t["budget"] is None else f"{t['budget'] / 1e6:.1f}"
        lines.append(f"{tier:<8}" + "".join(cells) + f"{t['peak'] / 1e6:>11.1f}" + (f"{budget:>11}" if budgets else ""))
    return lines + [f"  {note}" for note in s["placement_notes"]] + _traffic_lines(s["traffic"])


def _traffic_lines(t: dict) -> list[str]:
    """The median step: its time, its NVMe bytes each way with their rates and the wait, its bytes between
    host and device; then the run's NVMe totals (what moved is named only where something did)."""
    moved = []
    if t["nvme_read_total_bytes"] or t["nvme_write_total_bytes"]:
        moved.append(f"nvme read {t['nvme_read_bytes'] / 1e6:.1f} MB at {t['nvme_read_gbps']:.2f} GB/s and written "
                     f"{t['nvme_write_bytes'] / 1e6:.1f} MB at {t['nvme_write_gbps']:.2f} GB/s "
                     f"({t['nvme_wait_seconds']:.3f} s waited)")
    if t["host_to_device_total_bytes"] or t["device_to_host_total_bytes"]:
        moved.append(f"host->device {t['host_to_device_bytes'] / 1e6:.1f} MB, device->host "
                     f"{t['device_to_host_bytes'] / 1e6:.1f} MB")
    lines = [f"per step (median of {t['steps']} after the first): {t['step_seconds']:.3f} s, "
             + (", ".join(moved) if moved else "nothing moved between tiers")]
    if t["nvme_read_total_bytes"] or t["nvme_write_total_bytes"]:
        lines.append(f"in all: nvme {t['nvme_read_total_bytes'] / 1e9:.2f} GB read, "
                     f"{t['nvme_write_total_bytes'] / 1e9:.2f} GB written")
    return lines
