"""Thin hooks that tell the scheduler when a partitioned unit computes, in forward and in backward.

[Note: where a unit's uses begin and end]
- Forward: the unit module's pre-hook acquires it, its post-hook releases it.
- Backward begins for a unit when the first gradient of its outputs is computed, before any of its
  backward ops run: a multi-grad hook on the forward's outputs (``mode="any"``) acquires it.
- Backward ends when the gradients of its inputs are known: the forward pre-hook passes the inputs
  through an identity autograd function whose backward releases the unit. A unit whose inputs need no
  gradient (the root, the first block of some models) is released when the pass ends.
- Activation checkpointing recomputes a unit's forward inside its backward use, so the gathered
  parameters are already there and the recomputation adds no use.
The model itself gets one more pre-hook, first of all, that starts a pass (training or not).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from .partition import FlatUnit
from .scheduler import ParamScheduler

__all__ = ["register_param_hooks"]


class _ReleaseAfterInputGrads(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once their gradients exist, ending the unit's backward."""

    @staticmethod
    def forward(ctx: Any, release: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.release = release
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.release()
        return (None, *grads)


def _tensors_needing_grad(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _pre_forward(scheduler: ParamScheduler, unit: FlatUnit, module: nn.Module, args: tuple,
                 kwargs: dict) -> tuple[tuple, dict]:
    scheduler.acquire(unit)
    if not torch.is_grad_enabled():
        return args, kwargs
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if positions:
        wrapped = _ReleaseAfterInputGrads.apply(partial(scheduler.release, unit), *(leaves[i] for i in positions))
        for i, tensor in zip(positions, wrapped):
            leaves[i] = tensor
    return tree_unflatten(leaves, spec)


def _post_forward(scheduler: ParamScheduler, unit: FlatUnit, module: nn.Module, args: tuple, output: Any) -> None:
    scheduler.release(unit)
    outputs = _tensors_needing_grad(output) if torch.is_grad_enabled() else []
    if outputs:
        torch.autograd.graph.register_multi_grad_hook(outputs, lambda grads: scheduler.acquire(unit), mode="any")


def register_param_hooks(model: nn.Module, units: list[FlatUnit], scheduler: ParamScheduler) -> list[RemovableHandle]:
    """Hook ``model`` and each partitioned unit's module (see the note); returns the handles to remove."""

    def begin_pass(module: nn.Module, args: tuple) -> None:
        scheduler.begin_pass(training=torch.is_grad_enabled() and module.training)

    handles = [model.register_forward_pre_hook(begin_pass, prepend=True)]
    for unit in units:
        module = unit.layout.module
        handles.append(module.register_forward_pre_hook(partial(_pre_forward, scheduler, unit), with_kwargs=True))
        handles.append(module.register_forward_hook(partial(_post_forward, scheduler, unit)))
    return handles
