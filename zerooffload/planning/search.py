"""The layouts a plan weighs: every choice of the searched keys the user left free, those that fit, ranked.

[Note: the search]
The searched keys (``SEARCHED``): ``zero.stage``; ``offload.optimizer.tier`` and its ``fraction``;
``offload.param.tier`` (stage 3); ``train.activation_checkpointing`` and, where it moves them (a CUDA
device), ``offload.activations.tier`` for the checkpointed inputs; ``train.micro_batch_size``
(powers of two dividing the batch per rank, ``train.grad_accum_steps`` making up the rest); and
the stage-3 window, ``zero.prefetch_size`` with ``zero.max_live_size``: the config's, one unit ahead
within the root and two units gathered, or none ahead within the root and one unit (the tight ones
for a device that cannot hold the model gathered); and the optimizer state's format,
``optimizer.master`` and ``optimizer.moments``, which ``plan`` tries in turn rather than beside the
others (each format a search of its own, the next only when no layout of the last fits): the config's,
then a split master (lossless, bf16 runs), then bf16 moments too, then int8 moments, then as well two
host buffers per block stream (``aio.blocks_in_flight``) instead of three. A key the user *pins* (set in their
config or as an override) is a constraint: every candidate keeps its value. A candidate *fits* when
the memory checks the engine itself runs at start accept it (``check_plan`` against the budgets,
``check_ram`` against the RAM there is, swap space against the free disk); the fitting ones are
ranked by predicted step time, and within ``TIE`` of each other by the bytes they put on disk, then in
memory (the simpler layout, and the safer). Nothing is allocated: models are on the meta device,
plans are arithmetic, and only one block per micro-batch size is ever materialized to time it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..activations import ActivationProfile
from ..config import Config, ConfigError, format_size
from ..memory_plan import check_fits, local_ranks, plan_for_machine
from ..telemetry import Prediction
from ..tiers import BudgetError, make_tiers, swap_bytes, swap_free_bytes
from ..zero.placement import (COMPUTE, STAGING, TIER_NAMES, Placement, activations_leave_device, addressable,
                              leaves_device, shard_count)
from ..zero.unit_layout import UnitLayout, find_units
from .model_spec import BlockTimes, ModelSpec, measure_compute
from .predict import predict
from .probe import Probe

__all__ = ["SEARCHED", "Candidate", "Evaluator", "candidates", "rank", "refusal"]

SEARCHED = ("zero.stage", "offload.optimizer.tier", "offload.optimizer.fraction", "offload.param.tier",
            "train.activation_checkpointing", "offload.activations.tier", "train.micro_batch_size",
            "zero.prefetch_size", "zero.max_live_size", "optimizer.master", "optimizer.moments",
            "aio.blocks_in_flight")
FRACTIONS = (1.0, 0.5)
MICRO_BATCHES = 4
"""At most this many micro-batch sizes (the largest that divide the batch): beyond, the per-token cost
is flat and only memory changes."""
TIE = 0.03


@dataclass
class Candidate:
    """One layout: the values it gives the searched keys, and what the plan found of it."""

    overrides: dict[str, object]
    config: Config
    prediction: Prediction | None = None
    placement: Placement | None = None
    """The placement the engine would make of it (the evaluator's)."""
    refusal: str | None = None
    """Why it does not fit (the engine's own refusal), or None."""
    memory_need: int = 0
    """Bytes its memory plan asks of RAM and the device (activations included; swap files not)."""

    def describe(self) -> str:
        """The layout in a line: the stage, what lives off the device, the micro-batch, the stage-3 window."""
        c, partitioned = self.config, any(u.partitioned for u in self.placement.units)
        parts = [f"stage {c.zero.stage}"]
        optimizer = c.offload.optimizer
        if leaves_device(optimizer.tier):
            share = "" if optimizer.fraction == 1.0 else f" {optimizer.fraction:.0%}"
            parts.append(f"optimizer {optimizer.tier}{share}")
        if partitioned and leaves_device(c.offload.param.tier):
            parts.append(f"params {c.offload.param.tier}")
        if c.train.activation_checkpointing:
            parts.append("checkpointing" + (f", activations {c.offload.activations.tier}"
                                            if leaves_device(c.offload.activations.tier) else ""))
        parts.append(f"micro {c.train.micro_batch_size}x{c.train.grad_accum_steps}")
        if c.optimizer.master != "fp32":
            parts.append(f"master {c.optimizer.master}")
        if c.optimizer.moments != "fp32":
            parts.append(f"moments {c.optimizer.moments}")
        if c.aio.blocks_in_flight == 2:
            parts.append("2 blocks in flight")
        if partitioned and c.zero.prefetch_size == 0:
            parts.append("no prefetch")
        if partitioned:
            parts.append(f"live {format_size(c.zero.max_live_size)}")
        if c.zero.quantized_weights or c.zero.hpz_partition_size > 1 or c.zero.quantized_gradients:
            parts.append("ZeRO++")
        return ", ".join(parts)

    def in_memory_bytes(self) -> int:
        return sum(n for tier, n in self.prediction.peak_bytes.items() if addressable(tier))

    def on_disk_bytes(self) -> int:
        return sum(n for tier, n in self.prediction.peak_bytes.items() if not addressable(tier))


def candidates(base: Config, pinned: Iterable[str], batch: int, world_size: int, device: str,
               unit_bytes: tuple[int, int] = (0, 0)) -> list[Candidate]:
    """Every layout of the searched keys left free (see the note), as configs over ``base`` for a
    ``device`` (the probe's); ``unit_bytes``: the root unit's and the largest other unit's gathered bytes
    (for the windows)."""
    pinned = set(pinned)
    per_rank = batch // world_size
    micros = [m for m in (1 << i for i in range(16)) if m <= per_rank and per_rank % m == 0][-MICRO_BATCHES:]
    root, largest = unit_bytes
    windows = [(base.zero.prefetch_size, base.zero.max_live_size), (largest, root + 2 * largest), (0, root + largest)]
    choices = {
        "zero.stage": (1, 2, 3), "offload.optimizer.tier": TIER_NAMES, "offload.optimizer.fraction": FRACTIONS,
        "offload.param.tier": TIER_NAMES, "train.activation_checkpointing": (False, True),
        "offload.activations.tier": (COMPUTE, STAGING),
        "train.micro_batch_size": tuple(reversed(micros)), "window": windows}
    window_free = not {"zero.prefetch_size", "zero.max_live_size"} & pinned
    in_turn = ("zero.prefetch_size", "zero.max_live_size", "optimizer.master", "optimizer.moments",
               "aio.blocks_in_flight")  # see the note
    free = [key for key in SEARCHED if key not in pinned and key not in in_turn]
    free += ["window"] if window_free and largest else []
    out, seen = [], set()
    for values in itertools.product(*(choices[key] for key in free)):
        overrides = dict(zip(free, values))
        if "window" in overrides:
            overrides["zero.prefetch_size"], overrides["zero.max_live_size"] = overrides.pop("window")
        if not _meaningful(overrides, base):
            continue
        micro = overrides.get("train.micro_batch_size", base.train.micro_batch_size)
        if "train.grad_accum_steps" not in pinned:
            overrides["train.grad_accum_steps"] = max(1, per_rank // micro)
        try:
            config = Config.load(base, overrides=[f"{k}={_toml(v)}" for k, v in overrides.items()])
        except ConfigError:
            continue  # a combination the config itself refuses
        if "offload.activations.tier" in overrides and leaves_device(overrides["offload.activations.tier"]) and \
                not activations_leave_device(config, torch.device(device)):
            continue  # nothing would move (no checkpointing, or a CPU device): the device layout again
        key = config.to_toml()
        if key not in seen:
            seen.add(key)
            out.append(Candidate(overrides, config))
    return out


def _meaningful(overrides: dict, base: Config) -> bool:
    """Leave out combinations that only rename another: a fraction of a device-tier optimizer, parameter
    tiers and prefetch windows below stage 3."""
    get = lambda key, default: overrides.get(key, default)  # noqa: E731
    stage = get("zero.stage", base.zero.stage)
    if not leaves_device(get("offload.optimizer.tier", base.offload.optimizer.tier)) and \
            get("offload.optimizer.fraction", base.offload.optimizer.fraction) != FRACTIONS[0] and \
            "offload.optimizer.fraction" in overrides:
        return False
    window = (base.zero.prefetch_size, base.zero.max_live_size)
    if stage < 3 and (leaves_device(overrides.get("offload.param.tier", base.offload.param.tier))
                      or (overrides.get("zero.prefetch_size", window[0]),
                          overrides.get("zero.max_live_size", window[1])) != window):
        return False
    return True


def _toml(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


class Evaluator:
    """Predictions of candidates for one model: layouts, activations and compute measured once each."""

    def __init__(self, model: ModelSpec, probe: Probe, world_size: int, progress: Callable[[str], None], *,
                 timed: bool = True):
        self.model, self.probe, self.world_size, self.progress = model, probe, world_size, progress
        self.timed = timed
        """Whether a block is timed (``measure_compute``), or counted in FLOPs alone."""
        self.device = torch.device(probe.device)
        self._layouts: dict[tuple, list[UnitLayout]] = {}
        self._activations: dict[tuple, ActivationProfile] = {}
        self._times: dict[tuple, BlockTimes] = {}

    def layouts(self, config: Config) -> list[UnitLayout]:
        shards = shard_count(config, self.world_size)
        key = (shards, tuple(config.zero.unit_modules))
        if key not in self._layouts:
            self._layouts[key] = find_units(self.model.module, config.zero.unit_modules, shards)
        return self._layouts[key]

    def activations(self, config: Config) -> ActivationProfile:
        key = (config.train.micro_batch_size, config.train.precision)
        if key not in self._activations:
            layouts = find_units(self.model.module, config.zero.unit_modules, 1)
            self._activations[key] = self.model.activations(layouts, *key, self.device)
        return self._activations[key]

    def times(self, config: Config) -> BlockTimes:
        key = (config.train.micro_batch_size, config.train.precision)
        if key not in self._times:
            if key[1] not in self.probe.matmul_flops:
                raise ConfigError(f"train.precision = {key[1]!r}: the machine's probe has no {key[1]} rates yet; "
                                  f"plan with train.precision={key[1]} once to measure them")
            if self.timed:
                self.progress(f"timing a block at micro-batch {key[0]} ({key[1]})")
            layouts = find_units(self.model.module, config.zero.unit_modules, 1)
            self._times[key] = measure_compute(self.model, layouts, *key, self.probe.matmul_flops[key[1]],
                                               self.device, timed=self.timed)
        return self._times[key]

    def evaluate(self, candidate: Candidate) -> Candidate:
        """Fill in ``candidate``'s refusal, or else its prediction."""
        config = candidate.config
        layouts, activations = self.layouts(config), self.activations(config)
        candidate.placement, candidate.refusal, candidate.memory_need = refusal(config, layouts, activations,
                                                                                self.world_size, self.device)
        if candidate.refusal is None:
            candidate.prediction = predict(config, layouts, self.probe, self.times(config), activations,
                                           self.world_size)
        return candidate


def _first_clause(text: str) -> str:
    """``text`` up to its first ``;`` outside parentheses: a refusal without its suggested fix."""
    depth = 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == ";" and depth == 0:
            return text[:index]
    return text


def rank(evaluator: Evaluator, pool: list[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """The fitting candidates ranked (see the note), and the refused ones."""
    for candidate in pool:
        evaluator.evaluate(candidate)
    fitting = sorted((c for c in pool if c.refusal is None), key=lambda c: c.prediction.step_seconds)
    if fitting:  # within TIE of the fastest, the simplest first: the least on disk, then in memory
        fastest = fitting[0].prediction.step_seconds
        tied = [c for c in fitting if c.prediction.step_seconds <= fastest * (1 + TIE)]
        tied.sort(key=lambda c: (c.on_disk_bytes(), c.in_memory_bytes()))
        fitting = tied + [c for c in fitting if c not in tied]
    return fitting, [c for c in pool if c.refusal is not None]


def refusal(config: Config, layouts: list[UnitLayout], activations: ActivationProfile | None, world_size: int,
            device: torch.device) -> tuple[Placement, str | None, int]:
    """The placement the engine would make; why it would refuse ``config`` at start (its own checks, in its
    order), or None; and the bytes its plan asks of memory (``Candidate.memory_need``)."""
    tiers = make_tiers(config.memory, device)
    placement, plan = plan_for_machine(layouts, config, world_size, device, activations, tiers=tiers)
    need = sum(sum(kinds.values()) for tier, kinds in plan.items() if addressable(tier)) + (
        activations.bytes(config.train.activation_checkpointing) if activations is not None else 0)
    try:
        check_fits(plan, config, tiers, activations, device, world_size)
    except BudgetError as exc:
        return placement, _first_clause(str(exc)), need
    swap = swap_bytes(plan) * local_ranks(world_size)
    if swap and swap > swap_free_bytes(config):
        free = swap_free_bytes(config)
        return placement, f"the swap files need {swap:,} bytes but {config.nvme.paths} has {free:,} free", need
    return placement, None, need
