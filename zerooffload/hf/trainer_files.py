"""Our Trainer's ``checkpoint-N`` in the plain Trainer's own layout, written streamed.

[Note: one checkpoint both Trainers read]
A checkpoint-N ours saves is what ``transformers.Trainer`` writes and reads: ``model.safetensors`` (every
tensor of ``state_dict()`` once: a tied name after the first is left out, as ``save_pretrained`` leaves
it) and ``optimizer.pt`` (``torch.optim.AdamW``'s state_dict: parameters indexed by the plain Trainer's
two groups, weight decay then none, in ``named_parameters`` order; ``step``, ``exp_avg``, ``exp_avg_sq``
for each parameter that was updated), beside the Trainer's own scheduler, RNG and trainer_state files;
so either Trainer resumes either's checkpoint, and the bytes are the state's: 4 B of fp32 weights and
8 B of fp32 moments a parameter, nothing written twice. ``zerooffload.json`` adds what only we need:
each file's size and CRC32C (a resume verifies them first), the counters, the loss scale and the run's
shape (checkpoints' [Note: Trainer checkpoints]).

Nothing is whole in memory: the engine's units are walked once, in order; each unit's master and moments
are gathered (every rank takes part: the collectives), and rank 0 writes the unit's weights into
``model.safetensors`` (its header first: every shape is known) and its moments as records of the
``optimizer.pt`` zip (whose pickle, written first, refers to each by key, so it needs only shapes), so
memory stays near one unit's 12 B a parameter. A resume reads them back by name and row range
(``trainer_layout_source``): bitwise the state saved.

Where the layout cannot hold the state exactly (moments in bf16 or int8, a master split into weights and
residual), the engine's sharded format is saved instead (``zerooffload/`` in checkpoint-N), saying so
once: the plain Trainer cannot resume that one (``zerooffload checkpoint consolidate`` gives its weights).
"""
from __future__ import annotations

import collections
import io
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.serialization import _get_storage_alignment, get_crc32_options

from ..checkpoint import CheckpointError, SafetensorsEntry, write_safetensors
from ..checkpoint.files import file_record, verify_file, write_text_atomically
from ..checkpoint.saving import optimizer_steps
from ..comm import all_gather, barrier, failing_together
from ..io.files import open_nofollow
from ..training_state import Trainable

__all__ = ["DIGESTS_FILE", "MODEL_FILE", "OPTIMIZER_FILE", "unsupported", "save_trainer_files", "save_weights",
           "read_digests", "tied_once"]

MODEL_FILE, OPTIMIZER_FILE = "model.safetensors", "optimizer.pt"
"""transformers' SAFE_WEIGHTS_NAME and OPTIMIZER_NAME."""

DIGESTS_FILE = "zerooffload.json"
"""Our record beside the Trainer's files: their sizes and CRC32Cs, counters, loss scale, run shape."""

_STORAGES = {torch.float32: torch.FloatStorage}


def unsupported(engine: Trainable) -> str | None:
    """Why the Trainer's layout cannot hold ``engine``'s state exactly, or None when it can."""
    moments = engine.config.optimizer.moments
    if moments != "fp32":
        return f"optimizer.moments = {moments!r} (the plain Trainer's AdamW keeps fp32 moments)"
    if any(state.split for state in engine.opt_states):
        return "a split master (weights + residual; the plain Trainer keeps fp32 weights)"
    return None


def save_trainer_files(engine: Trainable, folder: Path, groups: list[list[str]], group_settings: list[dict],
                       record: dict) -> None:
    """``model.safetensors``, ``optimizer.pt`` and ``zerooffload.json`` of ``engine`` into ``folder``
    (see the note); ``groups``: the plain Trainer's two groups by name, ``group_settings`` the AdamW
    settings each is saved with, ``record`` what else zerooffload.json keeps. Collective."""
    engine.ensure_open("save_checkpoint")
    writes = engine.comm.rank == 0
    updated = _updated(engine, {name: i for i, name in enumerate(n for names in groups for n in names)})
    with failing_together(engine.comm):
        optimizer = _OptimizerFile(folder / OPTIMIZER_FILE, writes)
        try:
            entries = _model_entries(engine, updated, optimizer)
            if writes:
                optimizer.begin(updated, groups, group_settings, engine.opt_states[0].moment_names
                                if engine.opt_states else ())
            write_safetensors(folder / MODEL_FILE, entries.entries, {"source": "zerooffload"}, writes=writes)
            entries.finish()
        except BaseException:
            optimizer.close(failed=True)
            raise
        optimizer.close()
    if writes:
        files = {name: file_record(folder / name) for name in (MODEL_FILE, OPTIMIZER_FILE)}
        write_text_atomically(folder / DIGESTS_FILE, json.dumps({**record, "files": files}, indent=1))
    barrier(engine.comm)


def tied_once(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``state_dict()``'s tensors by name, a tensor under several names (tied weights) under its first
    only, as ``save_pretrained`` stores them (the model ties the others again when it loads)."""
    seen: set[int] = set()
    kept = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            kept.append((name, tensor))
    return kept


def save_weights(engine: Trainable, path: Path) -> Path:
    """``model.safetensors`` from the live engine as ``save_pretrained`` writes it (fp32, tied weights once),
    one unit gathered at a time, rank 0 writing. Collective."""
    engine.ensure_open("save_model")
    kept = {name for name, _ in tied_once(engine.module)}
    with failing_together(engine.comm):
        entries = [SafetensorsEntry(*entry) for entry in engine.state_dicts.streamed_entries(torch.float32)
                   if entry[0] in kept]
        return write_safetensors(path, entries, {"source": "zerooffload"}, writes=engine.comm.rank == 0)


def read_digests(folder: Path, verify: bool) -> dict | None:
    """``folder``'s zerooffload.json (None: a plain Trainer's checkpoint), its files verified if ``verify``."""
    path = folder / DIGESTS_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error}); the checkpoint is damaged") from error
    if verify:
        for name, expected in record["files"].items():
            verify_file(folder / name, expected)
    return record


def _updated(engine: Trainable, index: dict[str, int]) -> dict[int, tuple[tuple[int, ...], float]]:
    """optimizer.pt's index -> (shape, AdamW step) of each parameter updated at least once (torch's
    AdamW keeps no state for the others). Collective."""
    steps = optimizer_steps(engine)
    return {_index(slot.names, index): (tuple(slot.shape), steps[slot.names[0]])
            for unit in engine.units for slot in unit.layout.slots
            if slot.trainable and steps.get(slot.names[0], 0.0) > 0}


def _index(names: tuple[str, ...] | list[str], index: dict[str, int]) -> int:
    found = next((index[n] for n in names if n in index), None)
    if found is None:
        raise CheckpointError(f"{names[0]}: trainable but in neither of the Trainer's parameter groups")
    return found


class _ModelEntries:
    """``model.safetensors``' entries in unit order, each unit gathered (master and moments) when its first
    tensor is produced, its moments handed to ``optimizer`` then (every rank produces every value)."""

    def __init__(self, units: Iterator[dict], order: dict[int, int]):
        self.units, self.order, self.reached = units, order, -1
        self.current: dict[int, tuple[torch.Tensor, dict]] = {}
        self.entries: list[SafetensorsEntry] = []

    def value(self, param_id: int) -> torch.Tensor:
        while self.reached < self.order[param_id]:
            self.current = next(self.units)
            self.reached += 1
        return self.current[param_id][0]

    def finish(self) -> None:
        """Units past the last tensor produced (none normally): walked, for the collectives and their moments."""
        for _ in self.units:
            pass


def _model_entries(engine: Trainable, updated: dict[int, tuple], optimizer: "_OptimizerFile") -> _ModelEntries:
    named = tied_once(engine.module)
    order = {id(slot.param): u for u, unit in enumerate(engine.units) for slot in unit.layout.slots}
    entries = _ModelEntries(_unit_values(engine, optimizer), order)
    params = sorted(((name, t) for name, t in named if id(t) in order), key=lambda item: order[id(item[1])])
    entries.entries = [SafetensorsEntry(name, tuple(t.shape), torch.float32, lambda i=id(t): entries.value(i))
                       for name, t in params]
    entries.entries += [SafetensorsEntry(name, tuple(t.shape), t.dtype, lambda t=t: t.detach().cpu())
                        for name, t in named if id(t) not in order]
    return entries


def _unit_values(engine: Trainable, optimizer: "_OptimizerFile") -> Iterator[dict[int, tuple[torch.Tensor, dict]]]:
    """Unit by unit: its parameters' fp32 values by ``id(param)``; its updated parameters' moments go to
    ``optimizer`` (rank 0) as they are gathered."""
    comm = engine.comm
    for opt_state in engine.state_dicts.visit(write=False):
        unit = opt_state.unit
        shard = engine.state_dicts.fp32_shard(opt_state)
        parts = [shard]
        for name in opt_state.moment_names:
            moment = torch.zeros_like(shard)  # over the trainable front of the shard; frozen values have none
            moment[:unit.trainable_numel].copy_(opt_state.moment(name))
            parts.append(moment)
        flats = []
        for part in parts:
            flat = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=part.device)
            if unit.layout.shards > 1:
                all_gather(comm, flat, part)
            else:
                flat.copy_(part)
            flats.append(flat.cpu())
        values = {}
        for slot in unit.layout.slots:
            view = lambda flat: flat[slot.offset:slot.offset + slot.numel].view(slot.shape)  # noqa: E731
            values[id(slot.param)] = (view(flats[0]), {})
            if slot.trainable and optimizer.writes:
                optimizer.moments(slot.names, dict(zip(opt_state.moment_names, map(view, flats[1:]))))
        yield values


class _Storage:
    """A storage of optimizer.pt known by key, dtype and size before its bytes exist."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    """Pickles as a contiguous CPU tensor over a ``_Storage`` (``torch._utils._rebuild_tensor_v2``, as
    ``torch.save`` pickles one; ``weights_only`` loads allow it)."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: int) -> tuple:
        stride, size = [], 1
        for n in reversed(self.shape):
            stride.insert(0, size)
            size *= n
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, torch.Size(self.shape), tuple(stride), False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> tuple | None:
        if isinstance(obj, _Storage):
            return ("storage", _STORAGES[obj.dtype], obj.key, "cpu", obj.numel)
        return None


class _OptimizerFile:
    """``optimizer.pt`` as ``torch.save`` writes a zip: the pickle first (built from shapes alone,
    ``begin``), then each tensor's record as its unit is gathered (``moments``); rank 0 only."""

    def __init__(self, path: Path, writes: bool):
        self.path, self.writes = path, writes
        self.temporary = path.with_name(path.name + ".partial")
        self.keys: dict[tuple[int, str], str] = {}
        self.index: dict[str, int] = {}
        self.file: Any = None
        self.zip: Any = None

    def begin(self, updated: dict[int, tuple[tuple[int, ...], float]], groups: list[list[str]],
              group_settings: list[dict], moment_names: tuple[str, ...]) -> None:
        self.index = {name: i for i, name in enumerate(n for names in groups for n in names)}
        state = {i: {"step": self._placeholder((i, "step"), ()),
                     **{m: self._placeholder((i, m), shape) for m in moment_names}}
                 for i, (shape, _) in sorted(updated.items())}
        first, param_groups = 0, []
        for names, settings in zip(groups, group_settings):
            param_groups.append({**settings, "params": list(range(first, first + len(names)))})
            first += len(names)
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=2).dump({"state": state, "param_groups": param_groups})
        self.file = open(open_nofollow(self.temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666), "wb")
        self.zip = torch._C.PyTorchFileWriter(self.file, get_crc32_options(), _get_storage_alignment())
        self._record("data.pkl", buffer.getvalue())
        self._record(".format_version", "1")
        self._record(".storage_alignment", str(_get_storage_alignment()))
        self._record("byteorder", sys.byteorder)
        for i, (_, step) in updated.items():
            self._tensor(self.keys[(i, "step")], torch.tensor(step))

    def _placeholder(self, what: tuple[int, str], shape: tuple[int, ...]) -> _Tensor:
        key = self.keys.setdefault(what, str(len(self.keys)))
        numel = 1
        for n in shape:
            numel *= n
        return _Tensor(_Storage(key, torch.float32, numel), shape)

    def _record(self, name: str, data: str | bytes) -> None:
        self.zip.write_record(name, data, len(data))

    def _tensor(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().to("cpu", torch.float32).contiguous().clone()  # its own storage, no offset
        self.zip.write_record(f"data/{key}", value.untyped_storage(), value.nbytes)

    def moments(self, names: tuple[str, ...], values: dict[str, torch.Tensor]) -> None:
        """A parameter's moments (known by its names), if it has state in the file."""
        i = _index(names, self.index)
        for name, value in values.items():
            if (i, name) in self.keys:
                self._tensor(self.keys[(i, name)], value)

    def close(self, failed: bool = False) -> None:
        """The zip's directory written, fsynced and renamed into place; after a failure, closed and removed."""
        if self.file is None:
            return
        try:
            if not failed:
                self.zip.write_end_of_file()
                self.file.flush()
                os.fsync(self.file.fileno())
        finally:
            self.file.close()
        if failed:
            self.temporary.unlink(missing_ok=True)
        else:
            os.replace(self.temporary, self.path)
