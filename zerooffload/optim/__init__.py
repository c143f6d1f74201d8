"""Optimizers over sharded fp32 masters, the fused CPU Adam pass, and learning-rate schedules."""
from .cpu_adam import AdamUpdate, fused_adam_step, fused_adam_steps, simd_level, sum_squares
from .optimizer import ZeroOptimizer, moment_names
from .schedule import build_scheduler

__all__ = ["AdamUpdate", "ZeroOptimizer", "build_scheduler", "fused_adam_step", "fused_adam_steps", "moment_names",
           "simd_level", "sum_squares"]
