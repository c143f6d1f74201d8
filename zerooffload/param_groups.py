"""torch-style parameter groups, checked as torch checks them, before the engine rewrites them over
its master pieces.

``param_groups=`` takes what ``torch.optim.Optimizer`` takes: an iterable of parameters (one group)
or of dicts, each with ``"params"`` (a parameter or an iterable of them) and optional hyperparameters.
Refused, each naming the group and the parameter: a parameter in two groups (torch refuses it), a
tensor that is not one of the model's parameters, a group without ``params``, a known hyperparameter
that is not a number (``lr``, ``weight_decay``, ``eps``, ``momentum``; ``betas`` two numbers).
"""
from __future__ import annotations

import numbers
from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["normalize_param_groups"]

_NUMERIC = ("lr", "weight_decay", "eps", "momentum")


def normalize_param_groups(param_groups: Iterable[Any] | None, model: nn.Module) -> list[dict]:
    """A list of dicts whose ``params`` are lists of ``model``'s parameters; by default one group of
    every trainable parameter."""
    if param_groups is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    if isinstance(param_groups, (torch.Tensor, dict)):
        raise TypeError("param_groups must be an iterable of parameters or of dicts (as torch.optim takes), "
                        f"not a {type(param_groups).__name__}")
    groups = list(param_groups)
    if groups and all(isinstance(g, torch.Tensor) for g in groups):
        groups = [{"params": groups}]
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=True)}
    seen: dict[int, int] = {}
    return [_checked_group(index, group, names, seen) for index, group in enumerate(groups)]


def _checked_group(index: int, group: Any, names: dict[int, str], seen: dict[int, int]) -> dict:
    if not isinstance(group, dict) or "params" not in group:
        raise TypeError(f"param_groups[{index}]: expected a dict with 'params' (or a parameter), got "
                        f"{type(group).__name__}")
    params = group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    for param in params:
        if not isinstance(param, torch.Tensor) or id(param) not in names:
            shape = list(param.shape) if isinstance(param, torch.Tensor) else type(param).__name__
            raise ValueError(f"param_groups[{index}]: a tensor {shape} that is not a parameter of the model")
        if id(param) in seen:
            raise ValueError(f"parameter {names[id(param)]!r} is in param_groups[{seen[id(param)]}] and "
                             f"param_groups[{index}]: a parameter may be in one group only (torch refuses it too)")
        seen[id(param)] = index
    for key in _NUMERIC:
        if key in group and not _is_number(group[key]):
            raise TypeError(f"param_groups[{index}]['{key}'] = {group[key]!r}: expected a number")
    betas = group.get("betas")
    if betas is not None and not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(map(_is_number, betas))):
        raise TypeError(f"param_groups[{index}]['betas'] = {group['betas']!r}: expected two numbers")
    return {**group, "params": params}


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
