"""Training state from another framework's checkpoint, read by parameter name into any layout.

[Note: foreign checkpoints]
A checkpoint another tool wrote (an FSDP2 ``torch.distributed.checkpoint`` directory, a
``transformers.Trainer`` folder) holds whole tensors by name: each parameter's weights, and its AdamW
``exp_avg``, ``exp_avg_sq`` and ``step``. ``load_by_name`` fills the engine from such a *source*
exactly as ``sharded.load_checkpoint`` fills it from ours: unit by unit (``set_optimizer_states``), each
rank asking the source for just the flat ranges of the parameters its shard holds (a ``Request`` per
range and kind), so memory stays near one unit whatever the model's size, and any stage, tier or world
size loads it. A parameter the source has no optimizer state for gets zero moments and step 0, as torch's
AdamW keeps none for a parameter that never had a gradient. What such a source does not hold (the loss
scale, the skipped-step count, RNG) is left as the engine has it; the step counter becomes the saved
AdamW step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ..training_state import Trainable
from .saving import persistent_buffers

if TYPE_CHECKING:
    from ..optim.state import UnitOptimizerState

__all__ = ["Request", "NamedSource", "load_by_name", "foreign_kind", "GROUP_KEYS", "PARAM"]

PARAM = "param"
"""A request's kind for the parameter's value (the others are moment names)."""

GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")
"""The parameter-group settings taken from a foreign checkpoint (its schedule's own keys are not)."""


FOREIGN_KINDS = (
    (".metadata", "a torch.distributed.checkpoint (DCP) directory",
     "pass that directory itself to load_checkpoint"),
    ("trainer_state.json", "a transformers.Trainer checkpoint-N folder",
     "resume it with zerooffload.hf.Trainer (trainer.train(resume_from_checkpoint=that folder))"),
    ("mp_rank_00_model_states.pt", "a DeepSpeed checkpoint",
     "zerooffload does not read DeepSpeed's files: convert it with its zero_to_fp32.py and load the weights "
     "with zo.load_safetensors"),
    ("model.safetensors", "model weights without optimizer state", "load them with zo.load_safetensors"),
    ("model.safetensors.index.json", "model weights without optimizer state", "load them with zo.load_safetensors"),
)
"""Files that tell another kind of checkpoint, what it is, and what loads it."""


def foreign_kind(path: Path) -> tuple[str, str] | None:
    """What kind of checkpoint ``path`` is when it is not ours (a file telling it, at ``path`` or one level
    below, e.g. a DeepSpeed tag folder), and what loads it; None when nothing tells."""
    for name, kind, fix in FOREIGN_KINDS:
        if (path / name).is_file() or (path.is_dir() and any((child / name).is_file() for child in path.iterdir()
                                                              if child.is_dir())):
            return kind, fix
    return None


@dataclass(slots=True)
class Request:
    """Elements [start, stop) of the flattened ``kind`` (``PARAM`` or a moment) of the parameter
    known by ``names`` (tied names, first first), into ``out`` (any float dtype: values are rounded
    into it as ``copy_`` rounds)."""
    names: tuple[str, ...]
    kind: str
    start: int
    stop: int
    out: torch.Tensor


@dataclass
class NamedSource:
    """What a foreign checkpoint offers ``load_by_name``: ``read(requests)`` fills them (moments it
    lacks left as zeros), ``steps`` the AdamW step by parameter name (absent: none taken), ``groups``
    each parameter's group settings by name, ``buffers`` the persistent buffers by name."""
    read: Callable[[list[Request]], None]
    steps: dict[str, float] = field(default_factory=dict)
    groups: dict[str, dict] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def load_by_name(engine: Trainable, source: NamedSource) -> int:
    """Fill ``engine`` from ``source`` (see the note); returns the step count restored."""
    engine.state_dicts.set_optimizer_states(lambda state, frozen: _fill(state, frozen, source), whole=True)
    for name, buffer in persistent_buffers(engine.module):
        if name in source.buffers:  # checked by the source's loader where it must be there
            buffer.copy_(source.buffers[name])
    steps = _restore_steps(engine, source)
    _restore_groups(engine, source)
    engine.window.restore(steps, steps * engine.config.train.grad_accum_steps, 0)
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict({**engine.lr_scheduler.state_dict(), "last_epoch": steps,
                                             "_step_count": steps + 1})
    return steps


def _fill(state: "UnitOptimizerState", frozen: torch.Tensor | None, source: NamedSource) -> None:
    """One unit's master and moment shards (and its frozen values) from ``source``, in one read."""
    unit, trainable = state.unit, state.unit.trainable_numel
    targets = [state.master()] + [state.moment(n) for n in state.moment_names]
    kinds = (PARAM, *state.moment_names)
    for target in [*targets, frozen]:
        if target is not None:
            target.zero_()  # padding, and moments the source lacks
    requests = []
    for piece in unit.pieces:
        names = tuple(unit.layout.slots[piece.slot_index].names)
        start, stop = unit.param_range(piece)
        cut = piece.start + unit.held(piece)
        if cut > piece.start:
            requests += [Request(names, kind, start, start + cut - piece.start, target[piece.start:cut])
                         for kind, target in zip(kinds, targets)]
        if cut < piece.stop:
            requests.append(Request(names, PARAM, start + cut - piece.start, stop,
                                    frozen[cut - trainable:piece.stop - trainable]))
    source.read(requests)


def _restore_steps(engine: Trainable, source: NamedSource) -> int:
    """Each piece's AdamW step from the source (0 where it has none); the largest, the run's step count
    (the same on every rank: taken from the whole source)."""
    for state in engine.opt_states:
        for piece, tensor in state.pieces:
            names = state.unit.layout.slots[piece.slot_index].names
            value = next((source.steps[n] for n in names if n in source.steps), 0.0)
            step = engine.optimizer.state[tensor].get("step")
            if step is not None:
                step.fill_(value)
    return int(max(source.steps.values(), default=0.0))


def _restore_groups(engine: Trainable, source: NamedSource) -> None:
    """Each group's settings from the source's group of its first parameter found there."""
    named = {id(tensor): state.unit.layout.slots[piece.slot_index].names
             for state in engine.opt_states for piece, tensor in state.pieces}
    for group in engine.optimizer.param_groups:
        for tensor in group["params"]:
            saved = next((source.groups[n] for n in named.get(id(tensor), ()) if n in source.groups), None)
            if saved is not None:
                group.update({k: saved[k] for k in GROUP_KEYS if k in saved and k in group})
                break
