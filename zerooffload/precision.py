"""Compute dtypes and fp16 loss scaling.

[Note: loss scaling]
fp16 gradients underflow unless the loss is multiplied by a *scale* before backward and the
gradients divided by it after. With ``train.loss_scale = 0`` the scale is *dynamic*, as
``torch.amp.GradScaler`` does it: it starts at ``2**initial_scale_power``; a step whose gradients
hold inf/NaN on any rank is *skipped* on every rank and halves the scale (not below
``min_loss_scale``); ``loss_scale_window`` clean steps in a row double it. ``hysteresis`` (from
DeepSpeed) lets that many overflows in a row pass before the scale halves; 1 is GradScaler exactly.
A static scale never changes, and overflowing steps are still skipped.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from .config import TrainConfig

__all__ = ["COMPUTE_DTYPES", "LossScaler", "cast_floats", "fp16_slowdown", "warn_if_fp16_is_slow"]

logger = logging.getLogger(__name__)
SLOW_FP16 = 2.0
"""fp16 matmuls this many times slower than bf16's are worth a warning: many CPUs have bf16 units
(AVX512-BF16, AMX) and convert fp16 through fp32, or run it in scalar code."""

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """The loss scale of an fp16 run (1.0 and never changing for fp32/bf16)."""

    def __init__(self, config: TrainConfig):
        self.enabled = config.precision == "fp16"
        self.dynamic = self.enabled and config.loss_scale == 0
        self.scale = (config.loss_scale or 2.0 ** config.initial_scale_power) if self.enabled else 1.0
        self.window = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self.min_scale = config.min_loss_scale
        self._clean_steps = 0
        self._hysteresis_left = config.hysteresis

    def state(self) -> dict:
        """What a checkpoint keeps to resume the scale sequence exactly."""
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state(self, state: dict) -> None:
        self.scale = state["scale"]
        self._clean_steps = state["clean_steps"]
        self._hysteresis_left = state["hysteresis_left"]

    def update(self, overflow: bool) -> None:
        """Adjust the scale after a step that did (``overflow``) or did not see inf/NaN gradients."""
        if not self.dynamic:
            return
        if overflow:
            self._clean_steps = 0
            if self._hysteresis_left > 1:
                self._hysteresis_left -= 1
            else:
                self.scale = max(self.scale / 2, self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps == self.window:
            self.scale *= 2
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors nested in tuples, lists and dicts, cast to ``dtype``; everything else as is."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value


def fp16_slowdown(device: torch.device, size: int = 512, repeats: int = 3) -> float:
    """How many times longer an fp16 matmul of ``size``² takes than a bf16 one on ``device`` (best of
    ``repeats`` each, after a warm-up): a few milliseconds."""
    def best(dtype: torch.dtype) -> float:
        a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
        a @ b
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times)
    return best(torch.float16) / best(torch.bfloat16)


def warn_if_fp16_is_slow(config: TrainConfig, device: torch.device) -> None:
    """One warning when an fp16 run's matmuls here are much slower than bf16's (``SLOW_FP16``)."""
    if config.precision != "fp16" or device.type != "cpu":
        return
    slowdown = fp16_slowdown(device)
    if slowdown >= SLOW_FP16:
        logger.warning("train.precision = fp16: this CPU runs fp16 matmuls %.1fx slower than bf16's (measured "
                       "now); train.precision = bf16 keeps the same bytes per value, needs no loss scale and "
                       "runs at the CPU's bf16 rate", slowdown)
