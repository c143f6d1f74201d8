"""Model-state memory per device by the ZeRO paper's formulas (Rajbhandari et al., 2020, §5).

With mixed-precision Adam a parameter costs 2 bytes (fp16/bf16 weights) + 2 (gradients) + K = 12
(fp32 master, momentum, variance). Sharding over Nd ranks divides, by stage:
  0 (DDP)      (2 + 2 + K) Ψ
  1 (P_os)     (2 + 2) Ψ + K Ψ / Nd
  2 (P_os+g)   2 Ψ + (2 + K) Ψ / Nd
  3 (P_os+g+p) (2 + 2 + K) Ψ / Nd
Offloading the optimizer states (``offload.optimizer``) moves the K Ψ / Nd term (stages 1–3) to host RAM
or NVMe, and at stages 2–3 the gradient shards 2 Ψ / Nd with it (the engine sends them to the
optimizer's tier as soon as they are reduced); offloading parameters at stage 3 (``offload.param``)
moves 2 Ψ / Nd as well. The figures are
model states only: activations, buffers and fragmentation come on top. The compact optimizer state
formats (``optimizer.master``, ``optimizer.moments``) change K: 2.125 for a split master instead of 4,
2 + 2 bytes for bf16 moments and 1 + 1/64 + 1 + 1/64 for int8 ones instead of 4 + 4 (``k_adam``).
Above one rank, stage 3's bytes on the wire per rank and step follow, within a node and across nodes
(``--ranks-per-node``), plain and with ZeRO++ (planning.volumes' [Note: volumes]), and hpZ's secondary
shards on each device, 2Ψ / ranks per node.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..config import ConfigError
from ..optim.state import state_bytes
from ..planning.volumes import step_volume

__all__ = ["K_ADAM", "StageEstimate", "estimate", "format_table", "format_volumes", "k_adam", "parse_count"]

K_ADAM = 12
"""Bytes of optimizer state per parameter for mixed-precision Adam: fp32 master, m and v."""


def k_adam(master: str = "fp32", moments: str = "fp32") -> float:
    """K for Adam's state in the formats ``optimizer.master`` and ``optimizer.moments`` name (12 for fp32 both)."""
    numel = 1 << 16
    return state_bytes(numel, 2, moments, master, pieces=0) / numel


_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_COUNT_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """A parameter count as people write it: ``7.5e9``, ``1500000``, ``1.5B``, ``350M``, ``2k``.

    Suffixes are decimal (K = 1e3, M = 1e6, B = 1e9, T = 1e12), as model sizes are quoted. A ``ValueError``
    that shows the accepted forms otherwise: a count is never guessed from a byte unit such as ``G``.
    """
    match = _COUNT_RE.match(text)
    value = float(match.group(1)) * _COUNT_SUFFIXES[match.group(2).lower()] if match else math.nan
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{text!r} is not a positive parameter count: write it like 7.5e9, 1.5B, 350M or 2K")
    return value


@dataclass(frozen=True, slots=True)
class StageEstimate:
    """Bytes per device for one stage, all on the device and with states offloaded."""

    stage: int
    device: float
    device_optimizer_offloaded: float
    offloaded_optimizer: float
    device_all_offloaded: float
    offloaded_all: float


def estimate(params: float, dp: int, k: float = K_ADAM) -> list[StageEstimate]:
    """Per-device bytes of model states for stages 0–3 (see the module docstring)."""
    if params <= 0 or dp < 1:
        raise ValueError(f"--params must be > 0 and --dp >= 1 (got {params}, {dp})")
    psi = params
    rows = []
    for stage in range(4):
        weights = 2 * psi / (dp if stage == 3 else 1)
        grads = 2 * psi / (dp if stage >= 2 else 1)
        optimizer = k * psi / (dp if stage >= 1 else 1)
        offloadable = optimizer + (grads if stage >= 2 else 0.0) if stage >= 1 else 0.0
        params_offloadable = weights if stage == 3 else 0.0
        rows.append(StageEstimate(
            stage=stage, device=weights + grads + optimizer,
            device_optimizer_offloaded=weights + grads + optimizer - offloadable,
            offloaded_optimizer=offloadable,
            device_all_offloaded=weights + grads + optimizer - offloadable - params_offloadable,
            offloaded_all=offloadable + params_offloadable))
    return rows


def format_table(rows: list[StageEstimate], params: float, dp: int, k: float = K_ADAM) -> str:
    """A table in decimal GB, one line per stage."""
    gb = 1e9
    lines = [f"model states per device for {params:.4g} parameters over {dp} data-parallel ranks (GB = 1e9 B; "
             f"optimizer state K = {k:.4g} bytes per parameter)",
             f"{'stage':<14}{'on device':>11}{'optimizer offloaded: device / host|nvme':>42}"
             f"{'params too: device / host|nvme':>34}"]
    names = {0: "0 (DDP)", 1: "1 (P_os)", 2: "2 (P_os+g)", 3: "3 (P_os+g+p)"}
    for row in rows:
        optimizer = (f"{row.device_optimizer_offloaded / gb:.2f} / {row.offloaded_optimizer / gb:.2f}"
                     if row.stage >= 1 else "-")
        both = f"{row.device_all_offloaded / gb:.2f} / {row.offloaded_all / gb:.2f}" if row.stage == 3 else "-"
        lines.append(f"{names[row.stage]:<14}{row.device / gb:>11.2f}{optimizer:>42}{both:>34}")
    return "\n".join(lines)


ZERO_PP_ROWS = (("plain", {}), ("hpZ", {"hpz": True}), ("qwZ", {"quantized_weights": True}),
                ("qgZ", {"gradient_bits": 8}), ("qgZ 4-bit", {"gradient_bits": 4}),
                ("all three", {"hpz": True, "quantized_weights": True, "gradient_bits": 8}),
                ("all three, 4-bit", {"hpz": True, "quantized_weights": True, "gradient_bits": 4}))
"""ZeRO++'s settings as ``step_volume`` takes them: ``zero.hpz_partition_size`` = the ranks per node,
``zero.quantized_weights``, ``zero.quantized_gradients`` (and its bits)."""


def format_volumes(params: float, dp: int, local: int, compute_bytes: int = 2) -> str:
    """Stage 3's bytes a rank sends per step (one micro-batch, every unit gathered again in backward) within
    its node and across nodes, plain and with ZeRO++, in decimal GB; hpZ's device bytes below."""
    if dp % local:
        raise ConfigError(f"--ranks-per-node {local} does not divide --dp {dp}: every node runs as many ranks")
    gb = 1e9
    plain = step_volume(params, dp, local, compute_bytes).inter
    lines = [f"stage 3 on the wire per rank and step, {dp // local} node(s) x {local} ranks ({compute_bytes}-byte "
             f"weights, fp32 gradient sums; GB = 1e9 B)", f"{'':<18}{'within a node':>15}{'across nodes':>15}"
             f"{'across vs plain':>17}"]
    for name, options in ZERO_PP_ROWS:
        volume = step_volume(params, dp, local, compute_bytes, **options)
        ratio = f"{volume.inter / plain:.3f}" if plain else "-"
        lines.append(f"{name:<18}{volume.intra / gb:>15.2f}{volume.inter / gb:>15.2f}{ratio:>17}")
    lines.append(f"hpZ's secondary shards hold {compute_bytes * params / local / gb:.2f} GB more on each device")
    return "\n".join(lines)
