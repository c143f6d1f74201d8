"""What saving, loading and importing weights need of a training engine, as a protocol.

``checkpoint`` and ``pretrained`` work on a ``Trainable``: the engine (``engine.Engine``) is one, and
so is anything else with these members. They read nothing else of it, so the engine's insides can
change without them; the engine stays the one that changes its own state (``set_optimizer_states``,
``restore_counters``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .comm import Comm
    from .config import Config
    from .optim.state import UnitOptimizerState
    from .precision import LossScaler
    from .zero.partition import FlatUnit

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
    def stage(self) -> int:
        ...

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
    def scheduler(self) -> Any:
        """The LR schedule (``state_dict``/``load_state_dict``), or None."""

    @property
    def scaler(self) -> "LossScaler":
        ...

    @property
    def global_steps(self) -> int:
        ...

    @property
    def micro_steps(self) -> int:
        ...

    @property
    def skipped_steps(self) -> int:
        ...

    def ensure_open(self, call: str) -> None:
        """Refuse ``call`` on an engine that cannot run it (closed, or stopped after a failure)."""

    def visit_optimizer_states(self, *, write: bool) -> Iterator["UnitOptimizerState"]:
        """Each unit's optimizer state loaded, in unit order; ``write``: changes are stored back."""

    def fp32_shard(self, state: "UnitOptimizerState") -> "torch.Tensor":
        """This rank's whole shard of a loaded ``state``'s unit in fp32."""

    def set_optimizer_states(self, fill: FillState, *, whole: bool) -> None:
        """``fill`` every unit's loaded state and publish the new weights; ``whole``: it overwrites
        every block entirely (nothing is read first)."""

    def restore_counters(self, global_steps: int, micro_steps: int, skipped_steps: int) -> None:
        """Set the step counters of a resumed run."""
