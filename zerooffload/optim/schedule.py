"""Built-in learning-rate schedules, as torch ``LambdaLR`` factors of each group's peak lr.

Warmup rises linearly from ``min_lr`` to the peak over ``warmup_steps`` optimizer steps; then
``constant`` stays there, ``warmup_linear`` falls linearly and ``warmup_cosine`` along a half cosine
to ``min_lr`` at ``total_steps``, and both stay at ``min_lr`` after it.
"""
from __future__ import annotations

import math

import torch

from ..config import SchedulerConfig

__all__ = ["build_scheduler", "lr_factor"]


def lr_factor(step: int, config: SchedulerConfig, peak_lr: float) -> float:
    """Multiplier of ``peak_lr`` at optimizer step ``step`` (0-based: the lr of the step about to run)."""
    floor = config.min_lr / peak_lr if peak_lr else 0.0
    if step < config.warmup_steps:
        return floor + (1 - floor) * step / config.warmup_steps
    if config.type == "constant":
        return 1.0
    progress = min(1.0, (step - config.warmup_steps) / (config.total_steps - config.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if config.type == "warmup_cosine" else 1 - progress
    return floor + (1 - floor) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, config: SchedulerConfig
                    ) -> torch.optim.lr_scheduler.LambdaLR | None:
    """A LambdaLR over every group, each scaled from its own peak lr; None for the default schedule
    (constant, no warmup), which leaves the optimizer's lr alone."""
    if config.type == "constant" and config.warmup_steps == 0:
        return None
    peaks = [group["lr"] for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, [lambda step, peak=peak: lr_factor(step, config, peak) for peak in peaks])
