"""The config of ``zerooffload train``: ``TRAIN_DEFAULTS`` without ``--config``, then overrides and ``--steps``.
"""
from __future__ import annotations

import json

from ..config import Config, apply_override

__all__ = ["TRAIN_DEFAULTS", "load_train_config"]


TRAIN_DEFAULTS = {
    "train": {"micro_batch_size": 16, "grad_clip": 1.0},
    "optimizer": {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.95]},
    "scheduler": {"type": "warmup_cosine", "warmup_steps": 20, "min_lr": 3e-4},
}
"""What ``zerooffload train`` uses when no ``--config`` is given (fp32: faster than bf16 at this size)."""


def load_train_config(config_path: str | None, overrides: list[str], steps: int) -> Config:
    """The run's config: file or TRAIN_DEFAULTS, overrides, and total_steps filled from ``--steps``."""
    data = Config.load(config_path).to_dict() if config_path else json.loads(json.dumps(TRAIN_DEFAULTS))
    for override in overrides:
        data = apply_override(data, override)
    scheduler = data.get("scheduler", {})
    if scheduler.get("type", "constant") != "constant" and not scheduler.get("total_steps"):
        data = apply_override(data, f"scheduler.total_steps={max(steps, scheduler.get('warmup_steps', 0) + 1)}")
    return Config.load(data)
