"""What saving, loading and importing weights need of a training engine, as a protocol.

``checkpoint`` and ``pretrained`` work on a ``Trainable``: the engine (``engine.Engine``) is one, and
so is anything else with these members. They read nothing else of it, so the engine's insides can
change without them; the engine's own parts change its state (``state_dicts.set_optimizer_states``,
``window.restore``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .comm import Comm
    from .config import Config
    from .optim.state import UnitOptimizerState
    from .precision import LossScaler
    from .zero.partition import FlatUnit
    from .zero.state_dicts import StateDicts
    from .zero.window import Window

__all__ = ["Trainable", "FillState"]

FillState = Callable[["UnitOptimizerState", "torch.Tensor | None"], None]
"""``fill(state, frozen)``: set one loaded unit's master (and moments); values past its trainable
part go into ``frozen`` (None when there are none)."""


class Trainable(Protocol):
    """A training engine as checkpoints and weight imports see it."""

    @property
    def comm(self) -> "Comm":
        """The engine's process group and this rank."""

    @property
    def config(self) -> "Config":
        ...

    @property
    def module(self) -> "nn.Module":
        """The model (its persistent buffers are saved and loaded)."""

    @property
    def units(self) -> Sequence["FlatUnit"]:
        """Every unit, in order: its layout (parameter names, shapes, offsets) and this rank's shard."""

    @property
    def opt_states(self) -> Sequence["UnitOptimizerState"]:
        """Each unit's optimizer state, in unit order."""

    @property
    def optimizer(self) -> "torch.optim.Optimizer":
        """Its ``param_groups`` and per-parameter ``state`` (step counts) over this rank's pieces."""

    @property
    def lr_scheduler(self) -> Any:
        """The LR schedule (``state_dict``/``load_state_dict``), or None."""

    @property
    def scaler(self) -> "LossScaler":
        ...

    @property
    def window(self) -> "Window":
        """The accumulation window: the step counters (``global_steps``, ``micro_steps``,
        ``skipped_steps``) and ``restore`` for a resumed run."""

    @property
    def state_dicts(self) -> "StateDicts":
        """Whole values: ``visit`` each loaded optimizer state, its ``fp32_shard``, and
        ``set_optimizer_states(fill, whole=...)``, which fills every unit's loaded state and publishes the
        new weights (``whole``: it overwrites every block entirely, nothing is read first)."""

    def ensure_open(self, call: str) -> None:
        """Refuse ``call`` on an engine that cannot run it (closed, or stopped after a failure)."""
