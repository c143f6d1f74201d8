"""Initialization: the front door from a user's model and config to a training engine (``zo.initialize``)."""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .activations import ActivationProfile, measure_activations
from .comm import failing_together, init_comm
from .config import Config, dtype_bytes
from .engine import Engine
from .tiers.device_memory import cap_allocator, note_context
from .tiers.host_allocator import release_freed_memory, return_free_heap
from .lazy_init import initial_values, is_lazy, swap_in_placeholders
from .param_groups import normalize_param_groups
from .precision import warn_if_fp16_is_slow
from .telemetry import Prediction
from .threads import set_threads
from .zero.placement import streams_state
from .zero.sharded_state import eager_values
from .zero.placement import shard_count
from .zero.unit_layout import UnitLayout, find_units, rebind

__all__ = ["initialize"]


def _releases_freed(config: Config) -> bool:
    """``memory.release_freed``; ``auto``: where state streams from NVMe, the runs whose RAM decides what fits."""
    mode = config.memory.release_freed
    return streams_state(config) if mode == "auto" else mode == "on"


def initialize(model: nn.Module, config: Config | dict | str | None = None, param_groups: list[dict] | None = None,
               init_fn: Any = None, *, example_inputs: tuple | dict | None = None,
               prediction: Prediction | None = None) -> "Engine":
    """Shard ``model``'s training state as ``config`` says and return the engine that trains it.

    ``param_groups`` are torch-style groups over ``model``'s parameters (lr, weight_decay, ... per
    group); by default one group of every trainable parameter. ``init_fn(model)``, when given, runs
    once under ``torch.no_grad()`` before the parameters are flattened; for a model built under
    ``init_context`` it runs as ``init_fn(module)`` for each module instead of ``reset_parameters()``
    (``lazy_init``'s note), one unit's worth of memory at a time. ``example_inputs``: one micro-batch's
    arguments to the model (a tuple, or a dict of keyword arguments; real or meta tensors, only their
    shapes count), for a model built under ``init_context``: its activations are measured on the meta
    device and counted in the memory check ([Note: measuring activations]). ``prediction``: what a plan
    expects of a step (``zo.plan``), shown beside what is measured in every ``engine.stats``.
    """
    config = Config.load(config if config is not None else {})
    set_threads(config.train.threads)
    warn_if_fp16_is_slow(config.train, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if _releases_freed(config):
        release_freed_memory()  # before the first buffer: host_allocator's [Note: RSS that follows the accounting]
    lazy = is_lazy(model)
    note_context(int(os.environ.get("LOCAL_RANK", "0")))  # before init_comm makes it: device_memory's note
    comm = init_comm()
    cap_allocator(config.memory.device_budget, comm.device)  # the budget CUDA enforces, set once per engine
    layouts = find_units(model, config.zero.unit_modules, shard_count(config, comm.world_size))
    activations = None
    if example_inputs is not None:
        activations = _measure(model, layouts, config, comm.device, example_inputs)
    if lazy:
        groups = None if param_groups is None else normalize_param_groups(param_groups, model)  # of meta parameters
        replaced = swap_in_placeholders(model)
        layouts = rebind(layouts, replaced)
        param_groups = None if groups is None else [
            {**group, "params": [replaced.get(id(p), p) for p in group["params"]]} for group in groups]
    elif init_fn is not None:
        with torch.no_grad():
            init_fn(model)
    with failing_together(comm):
        values = (lambda units: initial_values(model, units, init_fn)) if lazy else eager_values
        engine = Engine(model, layouts, config, comm, param_groups, values=values,
                        activations=activations, prediction=prediction)
    return_free_heap()  # what the meta forward and the unit-by-unit initialization freed
    return engine


def _measure(model: nn.Module, layouts: list[UnitLayout], config: Config, device: torch.device,
             example_inputs: tuple | dict) -> ActivationProfile:
    """The activations of ``model`` (still on the meta device, its units ``layouts``) on ``example_inputs``."""
    if not is_lazy(model):
        raise ValueError("example_inputs: activations are measured on a model built under zo.init_context(); "
                         "build it there, or leave example_inputs out (the RAM margin then stands in for them)")
    args, kwargs = (((), example_inputs) if isinstance(example_inputs, dict) else (tuple(example_inputs), {}))
    return measure_activations(model, layouts, dtype_bytes(config.train.precision), args, kwargs, device)
