"""``torch.distributed.checkpoint`` (DCP) directories in and out: FSDP2's and torchtitan's checkpoints.

[Note: DCP checkpoints]
A DCP directory holds ``.metadata`` (every tensor's global shape and the chunks its saving ranks
wrote) and the chunk files. FSDP2 saves ``get_state_dict(model, optimizer)`` in it, nested under the
names the user chose (``{"model": ..., "optim": ...}`` in torch's recipe); the metadata's
``planner_data`` keeps each flattened key's path, which ends in the parameter's fully qualified name for
a weight (``("model", "blocks.0.fc1.weight")``) and in ``("state", name, kind)`` for AdamW's state
(``kind``: ``step``, ``exp_avg``, ``exp_avg_sq``), ``("param_groups", i, key)`` for group settings. So
the loader finds them by path, whatever the prefix.

- *In* (``load_dcp``, reached through ``load_checkpoint`` when the directory has a ``.metadata``):
  each rank reads, unit by unit, only the rows of each tensor that cover the flat ranges its shard holds
  (a ``LoadPlanner`` of its own asking DCP's ``FileSystemReader`` for those chunks; it reads whole saved
  chunks, so memory stays near one unit plus one saved chunk), through ``by_name``'s [Note: foreign
  checkpoints]. Names and shapes are checked against the model before any state changes.
- *Out* (``export_dcp``, ``zerooffload checkpoint export CKPT DIR --format dcp``): our checkpoint's
  masters and moments, tensor by tensor from its rank files (the manifest has the layout, no model is
  built), as one process's DCP save of the same nested dict FSDP2's ``get_state_dict`` gives:
  ``model.<name>`` for every ``state_dict`` key (tied names each, buffers), ``optim.state.<name>.step``,
  ``.exp_avg``, ``.exp_avg_sq`` (fp32, as torch's AdamW keeps them) for every parameter that has
  stepped, ``optim.param_groups.0.*``. ``dcp.load`` reshards it into any FSDP2 world size.
- Not in FSDP2's state: the learning-rate schedule and the data position. Loading one, the engine's step
  counter becomes the saved AdamW ``step``, its schedule is put at that step (the config's schedule,
  continued as if it had run those steps), the groups' ``lr`` is the saved one, and the data position is
  the caller's (``load_checkpoint`` returns ``{"step": step}``: e.g. skip ``step`` batches); the loss
  scale, skipped-step count and RNG stay as they are.
"""
from __future__ import annotations

import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..training_state import Trainable
from .by_name import PARAM, NamedSource, Request, foreign_kind, load_by_name
from .saving import persistent_buffers
from .sharded import load_checkpoint as load_ours
from .files import MANIFEST, CheckpointError, read_latest
from .layout import RankFiles, Source, malformed, read_manifest, read_range

__all__ = ["METADATA", "is_dcp", "load_checkpoint", "load_dcp", "export_dcp"]

logger = logging.getLogger(__name__)

METADATA = ".metadata"


def is_dcp(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` is a DCP checkpoint (it holds a ``.metadata``)."""
    return (Path(directory) / METADATA).is_file()


# ---------------------------------------------------------------------------------------------- in
def load_checkpoint(engine: Trainable, directory: str | os.PathLike, tag: str | None = None, *,
                    verify: bool = True) -> dict | None:
    """``engine.load_checkpoint``: a DCP directory (``directory``, or ``directory/tag``, holding a
    ``.metadata``) through ``load_dcp``, ours through ``sharded.load_checkpoint``; a checkpoint of
    another kind is refused saying what it is and what loads it."""
    directory = Path(directory)
    place = directory / tag if tag else directory
    if is_dcp(place):
        return load_dcp(engine, place)
    named = tag or (read_latest(directory) if directory.is_dir() else None)
    candidate = directory / named if named else directory
    if not (candidate / MANIFEST).exists():
        kind = foreign_kind(candidate) or foreign_kind(directory)
        if kind is not None:
            raise CheckpointError(f"{candidate} is {kind[0]}, not a zerooffload checkpoint (no manifest.json): "
                                  f"{kind[1]}")
    return load_ours(engine, directory, tag, verify=verify)


class _Keys:
    """Where each parameter's weight, moments, step and group settings are among a DCP's keys."""

    def __init__(self, metadata: Metadata, path: Path):
        paths = metadata.planner_data
        if not isinstance(paths, dict):
            raise CheckpointError(f"{path / METADATA}: no key paths (planner_data): saved without DCP's default "
                                  "planner, so its keys cannot be told apart; save with dcp.save's default planner")
        self.model: dict[str, str] = {}
        self.state: dict[tuple[str, str], str] = {}
        self.groups: dict[int, dict[str, str]] = {}
        for key, parts in paths.items():
            parts = tuple(parts)
            if len(parts) >= 3 and parts[-3] == "state":
                self.state[(parts[-2], parts[-1])] = key
            elif len(parts) >= 3 and parts[-3] == "param_groups":
                self.groups.setdefault(int(parts[-2]), {})[parts[-1]] = key
            elif parts:
                self.model.setdefault(parts[-1], key)


class _RangeReader(LoadPlanner):
    """Reads the rows of DCP tensors that cover requested ranges, and byte entries, in one plan."""

    def __init__(self, metadata: Metadata, rows: dict[str, tuple[int, int]], byte_keys: list[str]):
        self.metadata = metadata
        self.targets = {}
        for key, (lo, hi) in rows.items():
            size = metadata.state_dict_metadata[key].size
            dtype = metadata.state_dict_metadata[key].properties.dtype
            self.targets[key] = torch.empty((hi - lo, *size[1:]) if len(size) else (), dtype=dtype)
        self.rows = rows
        self.byte_keys = byte_keys
        self.values: dict[str, Any] = {}

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, (lo, hi) in self.rows.items():
            entry = self.metadata.state_dict_metadata[key]
            rest = list(entry.size[1:])
            chunk = ChunkStorageMetadata(torch.Size([lo] + [0] * len(rest)) if len(entry.size) else torch.Size([]),
                                         torch.Size([hi - lo] + rest) if len(entry.size) else torch.Size([]))
            items += create_read_items_for_chunk_list(key, entry, [chunk])
        for key in self.byte_keys:
            index = MetadataIndex(key)
            items.append(ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]),
                                  torch.Size([0])))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self.targets[read_item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, offset, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class _DcpSource:
    """A DCP directory as ``by_name``'s source: ranges of weights and moments, steps, groups, buffers."""

    def __init__(self, path: Path):
        self.path = path
        self.reader = FileSystemReader(path)
        try:
            self.metadata = self.reader.read_metadata()
        except Exception as error:  # a damaged .metadata is any unpickling error
            raise CheckpointError(f"{path / METADATA}: cannot be read as DCP metadata ({error})") from None
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        self.keys = _Keys(self.metadata, path)

    def key(self, names: tuple[str, ...], kind: str) -> str | None:
        for name in names:
            key = self.keys.model.get(name) if kind == PARAM else self.keys.state.get((name, kind))
            if key is not None:
                return key
        return None

    def shape(self, key: str) -> tuple[int, ...]:
        entry = self.metadata.state_dict_metadata[key]
        return tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else ()

    def read(self, requests: list[Request], byte_keys: list[str] = ()) -> dict[str, Any]:
        """Fill ``requests`` (moments the checkpoint lacks stay zero); returns the byte entries read."""
        rows, wanted = {}, []
        for request in requests:
            key = self.key(request.names, request.kind)
            if key is None:
                continue
            row = math.prod(self.shape(key)[1:])
            lo, hi = request.start // row, -(-request.stop // row)
            old = rows.get(key, (lo, hi))
            rows[key] = (min(lo, old[0]), max(hi, old[1]))
            wanted.append((request, key))
        planner = self.run(rows, byte_keys)
        for request, key in wanted:
            first = rows[key][0] * math.prod(self.shape(key)[1:])
            flat = planner.targets[key].reshape(-1)
            request.out.copy_(flat[request.start - first:request.stop - first])
        return planner.values

    def run(self, rows: dict[str, tuple[int, int]], byte_keys: list[str] = ()) -> _RangeReader:
        """One read plan: ``rows`` [lo, hi) of tensors (scalars: (0, 0)) and whole byte entries."""
        planner = _RangeReader(self.metadata, rows, list(byte_keys))
        plan = self.reader.prepare_global_plan([self.reader.prepare_local_plan(planner.create_local_plan())])[0]
        self.reader.read_data(planner.finish_plan(plan), planner).wait()
        return planner

    def named(self, engine: Trainable) -> NamedSource:
        """``by_name``'s source: steps, groups and buffers read now (small), ranges on demand."""
        step_keys = {k: self.keys.state[k] for k in self.keys.state if k[1] == "step"}
        group_keys = [key for group in self.keys.groups.values() for key in group.values()]
        buffer_keys = {n: self.keys.model[n] for n, _ in persistent_buffers(engine.module)}
        planner = self.run({key: (0, self.shape(key)[0] if self.shape(key) else 0)
                            for key in [*step_keys.values(), *buffer_keys.values()]}, group_keys)
        steps = {name: float(planner.targets[key]) for (name, _), key in step_keys.items()}
        groups = {}
        for group in self.keys.groups.values():
            settings = {k: planner.values[key] for k, key in group.items()}
            groups.update({name: settings for name in settings.get("params", [])})
        buffers = {n: planner.targets[key] for n, key in buffer_keys.items()}
        return NamedSource(self.read, steps, groups, buffers)


def _check(engine: Trainable, source: _DcpSource) -> None:
    """Refuse a DCP whose weights or buffers differ from the model's (names, shapes), or whose optimizer
    state covers some trainable parameters but lacks moments of others that stepped."""
    problems, moments = [], engine.opt_states[0].moment_names if engine.opt_states else ()
    for unit in engine.units:
        for slot in unit.layout.slots:
            key = source.key(tuple(slot.names), PARAM)
            if key is None:
                problems.append(f"{slot.names[0]} not in it")
            elif source.shape(key) != tuple(slot.shape):
                problems.append(f"{slot.names[0]}: saved {source.shape(key)}, model {tuple(slot.shape)}")
            elif slot.trainable and source.key(tuple(slot.names), "step") is not None:
                problems += [f"{slot.names[0]}: no {kind}" for kind in moments if source.key(tuple(slot.names), kind)
                             is None]
    for name, buffer in persistent_buffers(engine.module):
        key = source.keys.model.get(name)
        if key is None or source.shape(key) != tuple(buffer.shape):
            problems.append(f"buffer {name} {'not in it' if key is None else 'of another shape'}")
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise CheckpointError(f"{source.path} (a torch.distributed.checkpoint directory) does not hold this model's "
                              f"state: {shown}")


def load_dcp(engine: Trainable, directory: str | os.PathLike) -> dict:
    """Fill ``engine`` from a DCP directory of FSDP2's layout (see the note); collective (every rank reads
    its own ranges). Returns ``{"step": step}``: the data position is the caller's to restore."""
    source = _DcpSource(Path(directory))
    _check(engine, source)
    if not source.keys.state:
        logger.warning("%s holds no optimizer state: the weights are loaded, the moments start at zero", directory)
    named = source.named(engine)
    return {"step": load_by_name(engine, named)}


# ---------------------------------------------------------------------------------------------- out
ADAMW_GROUP = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
               "fused": None, "decoupled_weight_decay": True}
"""torch.optim.AdamW's group settings beyond ours, as its own state_dict holds them."""


class _StreamedSave(DefaultSavePlanner):
    """DCP's default save of a dict of meta tensors, each value produced from our files when written
    (FileSystemWriter's serial loader asks for one tensor at a time: memory near the largest tensor)."""

    def __init__(self, produce: dict[str, Any]):
        super().__init__()
        self.produce = produce

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        return self.produce[write_item.index.fqn]()


def _layout(manifest: Any, files: RankFiles) -> tuple[dict, dict]:
    """The nested dict FSDP2's ``get_state_dict`` would give for the saved state (meta tensors) and
    each flattened key's producer."""
    data, model, state, produce = manifest.data, {}, {}, {}
    names, has_moments = [], data["moments"] == ["exp_avg", "exp_avg_sq"]
    for index, unit in enumerate(manifest.units):
        for slot in unit["slots"]:
            source = Source(index, unit, slot["offset"], tuple(slot["shape"]))

            def value(segment: int, source: Source = source, numel: int = slot["numel"]) -> torch.Tensor:
                out = torch.empty(numel, dtype=torch.float32)
                read_range(files, source, segment, 0, numel, out)
                return out.view(source.shape)
            meta = torch.empty(source.shape, dtype=torch.float32, device="meta")
            for name in slot["names"]:
                model[name], produce[f"model.{name}"] = meta, lambda value=value: value(0)
            step = data["steps"].get(slot["names"][0], 0.0)
            if slot["trainable"] and has_moments and step > 0:
                first = slot["names"][0]
                names.append(first)
                state[first] = {"step": torch.empty((), device="meta"), "exp_avg": meta, "exp_avg_sq": meta}
                produce[f"optim.state.{first}.step"] = lambda step=step: torch.tensor(step, dtype=torch.float32)
                for segment, kind in enumerate(("exp_avg", "exp_avg_sq"), start=1):
                    produce[f"optim.state.{first}.{kind}"] = lambda value=value, segment=segment: value(segment)
    _buffers(manifest, files, model, produce)
    groups = data["groups"]
    if len(groups) != 1:
        raise CheckpointError(f"{manifest.directory}: saved with {len(groups)} parameter groups, and the manifest does "
                              "not record which parameter is in which: a DCP export needs one group")
    group = {**ADAMW_GROUP, **{k: groups[0][k] for k in ("lr", "betas", "eps", "weight_decay") if k in groups[0]}}
    group["betas"] = tuple(group.get("betas", (0.9, 0.999)))
    return {"model": model, "optim": {"state": state, "param_groups": [{**group, "params": names}]}}, produce


def _buffers(manifest: Any, files: RankFiles, model: dict, produce: dict) -> None:
    offset = 0
    for record in manifest.data["buffers"]:
        dtype, shape = getattr(torch, record["dtype"]), tuple(record["shape"])

        def value(offset: int = offset, shape: tuple = shape, dtype: torch.dtype = dtype) -> torch.Tensor:
            out = torch.empty(shape, dtype=dtype)
            files.read_buffers(offset, out)
            return out
        model[record["name"]] = torch.empty(shape, dtype=dtype, device="meta")
        produce[f"model.{record['name']}"] = value
        offset += dtype.itemsize * math.prod(shape)


def export_dcp(directory: str | os.PathLike, out: str | os.PathLike, tag: str | None = None) -> Path:
    """Write our checkpoint ``directory`` (``tag``, default ``latest``) as a DCP directory ``out`` that
    FSDP2 loads with ``dcp.load({"model": ..., "optim": ...})`` and ``set_state_dict`` (see the note).
    Reads the manifest and rank files only: no model is built. Refuses an ``out`` that holds files."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: not empty; export into a new directory")
    manifest = read_manifest(directory, tag)
    with RankFiles(manifest) as files, malformed(manifest):
        nested, produce = _layout(manifest, files)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_save(nested, storage_writer=FileSystemWriter(out, thread_count=1), planner=_StreamedSave(produce),
                     no_dist=True)
    return out
