"""Models larger than RAM through the Trainer: built on the meta device, initialized unit by unit by
Hugging Face's own initializer, their pretrained weights streamed from safetensors into the shards.

A model the user's code builds whole cannot be larger than RAM, whatever trains it; so the Trainer
takes a *lazy* model (built under ``zo.init_context``, directly or in ``model_init``) and gives it
values as the engine lays it out: ``hf_initializer`` runs the model's ``_init_weights`` module by
module, and a model made by ``lazy_from_pretrained`` then has its safetensors streamed into the
engine's shards (``zo.load_safetensors``), never a whole copy in memory.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..lazy_init import init_context

__all__ = ["hf_initializer", "lazy_from_pretrained", "pretrained_weights"]

_WEIGHTS = "_zerooffload_weights"
"""The attribute a lazy model keeps its safetensors' location in."""


def hf_initializer(model: nn.Module) -> Callable[[nn.Module], None]:
    """``init_fn`` for a lazy Hugging Face model: its ``_init_weights`` on each module that owns
    parameters or buffers (zerooffload gives memory to one module's own tensors at a time, so a
    module owning none, such as GPT-2's attention block, has nothing of its own to initialize)."""
    def init(module: nn.Module) -> None:
        if next(module.parameters(recurse=False), None) is None and next(module.buffers(recurse=False), None) is None:
            return
        model._init_weights(module)
    return init


def lazy_from_pretrained(path: str | os.PathLike, model_class: Any = None, dtype: torch.dtype = torch.float32,
                         **config_kwargs: Any) -> nn.Module:
    """``model_class.from_pretrained(path)`` without the memory: the model built on the meta device
    from ``path``'s config, its weights (``*.safetensors``, sharded or not) streamed into the engine
    when the Trainer builds it. ``model_class``: default ``AutoModelForCausalLM``."""
    from transformers import AutoConfig, AutoModelForCausalLM
    path = Path(path)
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path}: no *.safetensors there; lazy_from_pretrained streams safetensors weights "
                                "(a local checkpoint folder: config.json and model*.safetensors)")
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    with init_context():
        model = (model_class or AutoModelForCausalLM).from_config(config, dtype=dtype)
    setattr(model, _WEIGHTS, str(path))
    return model


def pretrained_weights(model: nn.Module) -> str | None:
    """Where ``lazy_from_pretrained`` found ``model``'s weights (None for any other model)."""
    return getattr(model, _WEIGHTS, None)
