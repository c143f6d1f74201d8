"""Lazy construction: build a model on the meta device, then give it values one unit at a time.

[Note: lazy construction]
- ``init_context()`` builds modules on the meta device: shapes, no memory, no random numbers drawn.
- ``initialize`` then swaps every meta parameter for a *placeholder* (the right shape, one NaN behind
  it, like stage 3's) so units can be laid out, and walks the modules in ``named_modules`` order, the
  order an eager build constructs them in. Each module's own parameters get memory, its
  ``reset_parameters()`` (or ``init_fn(module)``) runs, the values are copied into their unit's flat
  fp32 buffer and the memory is let go. A unit whose parameters all have values is handed to the
  engine at once, so memory stays near one unit (plus the root unit, which spans the whole model).
- A module whose parameter another module initialized already (tied weights) still runs its
  initializer, on a scratch stand-in, so it draws the same random numbers as in an eager build:
  models initialized by their modules' ``reset_parameters()`` get an eager build's exact values.
- Meta buffers become zero tensors before the initializers run (``reset_parameters`` of e.g.
  BatchNorm sets them); a buffer computed only in ``__init__`` cannot be recovered (use ``init_fn``).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .zero.partition import FlatUnit

__all__ = ["init_context", "is_lazy", "swap_in_placeholders", "initial_values"]


_RANDOM_FILLS = frozenset({"normal_", "exponential_", "log_normal_", "cauchy_", "geometric_"})
"""By name: ``nn.init.normal_`` reaches the mode as itself, ``Tensor.normal_`` as the method."""


class _MetaRandomFills(TorchFunctionMode):
    """A random fill of a meta tensor is the no-op it is: torch runs these fills on meta through
    decompositions that import ``torch._dynamo`` on first use (measured: 2.3 s and ~100 MiB of modules
    in a process that never compiles), and ``nn.Embedding``'s initializer is one."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes its tensor by keyword
        if getattr(func, "__name__", None) in _RANDOM_FILLS and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def init_context(config: Any = None) -> Iterator[None]:
    """Modules built inside have meta parameters; ``zo.initialize`` materializes them unit by unit.

    ``config`` is accepted for symmetry with ``initialize`` (the layout is decided there)."""
    with torch.device("meta"), _MetaRandomFills():
        yield


def is_lazy(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _placeholder(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((1,), math.nan, dtype=dtype).expand(shape)


def swap_in_placeholders(model: nn.Module) -> dict[int, nn.Parameter]:
    """Replace meta parameters with CPU placeholders (one object per shared parameter, so ties hold)
    and meta buffers with zeros; returns each replaced parameter's placeholder, by the old one's id."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                if id(param) not in replaced:
                    replaced[id(param)] = nn.Parameter(_placeholder(param.shape, param.dtype),
                                                       requires_grad=param.requires_grad)
                module._parameters[name] = replaced[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype)
    return replaced


def initial_values(model: nn.Module, units: list[FlatUnit], init_fn: Callable[[nn.Module], None] | None
                   ) -> Iterator[tuple[FlatUnit, torch.Tensor]]:
    """Yield (unit, its flat padded fp32 values) as each unit's parameters all have values (see the note)."""
    owner = {id(slot.param): (unit, slot) for unit in units for slot in unit.layout.slots}
    flats: dict[int, torch.Tensor] = {}
    missing = {id(unit): len(unit.layout.slots) for unit in units}
    done: set[int] = set()
    for module in model.modules():
        own = [(name, p) for name, p in module._parameters.items() if p is not None]
        fresh = [(name, p) for name, p in own if id(p) not in done]
        with _stand_ins(module, [(name, p) for name, p in own if id(p) in done]), torch.no_grad():
            for _, param in fresh:
                param.data = torch.empty(param.shape, dtype=param.dtype)
            _run_initializer(module, init_fn)
            for _, param in fresh:
                unit, slot = owner[id(param)]
                flat = flats.setdefault(id(unit), torch.zeros(unit.layout.padded_numel, dtype=torch.float32))
                flat[slot.offset:slot.offset + slot.numel] = param.detach().reshape(-1).float()
                param.data = _placeholder(param.shape, param.dtype)
                done.add(id(param))
                missing[id(unit)] -= 1
                if missing[id(unit)] == 0:
                    yield unit, flats.pop(id(unit))


@contextlib.contextmanager
def _stand_ins(module: nn.Module, shared: list[tuple[str, nn.Parameter]]) -> Iterator[None]:
    """Give already-initialized shared parameters scratch stand-ins while this module's initializer runs."""
    for name, param in shared:
        module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                requires_grad=param.requires_grad)
    try:
        yield
    finally:
        for name, param in shared:
            module._parameters[name] = param


def _run_initializer(module: nn.Module, init_fn: Callable[[nn.Module], None] | None) -> None:
    if init_fn is not None:
        init_fn(module)
    elif not module._parameters:
        return  # a container: its children initialize their own parameters
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()
    else:
        raise ValueError(f"{type(module).__name__} has parameters ({', '.join(module._parameters)}) but no "
                         "reset_parameters(), so a model built under init_context cannot give them values: "
                         "add reset_parameters() or pass init_fn to initialize()")
