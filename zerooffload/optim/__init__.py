"""Optimizers over sharded fp32 masters, and learning-rate schedules."""
from .optimizer import ZeroOptimizer, moment_names
from .schedule import build_scheduler

__all__ = ["ZeroOptimizer", "build_scheduler", "moment_names"]
