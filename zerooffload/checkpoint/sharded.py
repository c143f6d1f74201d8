"""Checkpoints: sharded, atomic, exactly resumable, and reshardable across world sizes, stages and tiers.

[Note: checkpoint layout]
``DIR/<tag>/`` holds ``manifest.json`` (written by rank 0 last), ``rank00000.bin`` ... (each rank's
unit shards: for unit after unit, this rank's fp32 master shard and then each moment shard, padding
included, each segment 4 KiB-aligned: ``layout.shard_segments``) and ``rank00000.pt`` (each rank's RNG
states). Moments are saved as they are kept (``optimizer.moments``): fp32, bf16, or int8 codes followed
by their blocks' fp32 scales, so a compact run's checkpoint takes the bytes its states take. A split
master is saved as the fp32 value it holds exactly (4 bytes against its 4.125 beside the weight). A
load reads every segment as fp32 (widened or decoded, exactly) and stores it in the loading run's
format, so any format loads into any other: into bf16 rounded to nearest even, into int8 with codes
rounded to nearest; a load into the format it was saved in gives the same bits back (int8: where the
pieces, so the blocks, are cut as when saved, codes and scales are copied as they are; cut elsewhere,
the blocks are encoded anew, within int8's rounding). ``DIR/latest``
names the newest complete tag.
The manifest records the format version, the config, the world size and stage, every unit's layout
(parameter names, shapes, offsets, shard size), the optimizer's per-parameter step counts and group
settings, the LR schedule, loss scaler and counters, the module buffers, the client state, and the
size and CRC32C of every file.

- *Atomic*: every rank writes into ``<tag>.partial/`` and fsyncs; after a barrier rank 0 writes the
  manifest and its digest and publishes the directory (``files``' [Note: publishing a
  tag]): a run killed at any point leaves ``latest`` naming a loadable checkpoint, old or new.
- *Validated first*: a load checks everything it will use — files, digests, parameter names and
  shapes, buffers, optimizer groups and moments — before it changes any state, so a refused load
  leaves the engine as it was.
- *Buffers* are the module's persistent ones (``state_dict``'s), saved from rank 0 (as DDP's
  ``broadcast_buffers`` makes rank 0's the model's) and loaded on every rank.
- *Resharding*: a loading rank rebuilds each of its new unit shards from the saved shards by
  parameter name: for every parameter part it needs it reads the byte range of each old rank file
  that holds it (``layout``). So any world size, stage or tier layout loads into any other;
  names or shapes that differ are refused with the list.
- Blocks on NVMe are streamed through host buffers on the way out and in, one unit at a time.
- *Frozen parameters* keep no optimizer state (optim.state's frozen prefix rule), but the format is
  the same whatever is frozen: a shard's master segment holds the frozen values too, from the
  weights in fp32, and its moment segments zeros there. A load puts frozen values into the weights
  (and their shard home); in bf16/fp16 runs only their compute-dtype rounding is kept.

The engine is seen as a ``training_state.Trainable``: nothing else of it is read, and its state
changes only through its own methods. Every collective goes through ``comm``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..block_stream import checkpoint_depth
from ..comm import all_gather_object, barrier
from ..io import AsyncIO
from ..training_state import Trainable
from .files import (
    CheckpointError,
    ChecksummedWriter,
    begin_partial,
    file_record,
    out_of_space,
    publish,
    resolve_tag,
    write_manifest,
)
from .layout import (
    FORMAT,
    VERSION,
    Manifest,
    RankFiles,
    Source,
    malformed,
    parameter_sources,
    rank_file,
    read_manifest,
    read_int8_piece,
    read_range,
    read_saved_buffers,
    shard_segments,
)
from .safetensors_file import SafetensorsEntry, write_safetensors

if TYPE_CHECKING:
    from ..optim.state import UnitOptimizerState
    from ..zero.partition import FlatUnit
    from ..zero.unit_layout import Piece

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "consolidate", "default_tag", "resolve_tag",
           "read_manifest", "Manifest", "persistent_buffers", "Trainable"]


def default_tag(step: int) -> str:
    return f"step{step:08d}"


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``module.state_dict()`` holds, by name: non-persistent ones are not saved."""
    saved = module.state_dict(keep_vars=True)
    return [(name, buffer) for name, buffer in module.named_buffers() if name in saved]


# ---------------------------------------------------------------------------------------------- layout
def _unit_record(unit: "FlatUnit") -> dict:
    layout = unit.layout
    return {"name": layout.name, "shards": layout.shards, "shard_numel": layout.shard_numel,
            "slots": [{"names": list(s.names), "offset": s.offset, "numel": s.numel, "shape": list(s.shape),
                       "trainable": s.trainable} for s in layout.slots]}


# ---------------------------------------------------------------------------------------------- save
def save_checkpoint(engine: Trainable, directory: str | os.PathLike, tag: str | None = None,
                    client_state: dict | None = None) -> Path:
    """Write ``engine``'s full training state (see the note); collective: every rank calls it."""
    directory = Path(directory)
    tag = tag or default_tag(engine.window.global_steps)
    _check_tag(tag)
    if not _jsonable(client_state):
        raise TypeError(f"client_state must be JSON-serializable (it goes into the manifest): {client_state!r:.200}")
    rank = engine.comm.rank
    partial = begin_partial(directory, tag) if rank == 0 else directory / f"{tag}.partial"
    barrier(engine.comm)
    files = _write_rank_files(engine, partial)
    everyone = all_gather_object(engine.comm, (files, _optimizer_steps(engine)))
    if rank == 0:
        steps: dict[str, float] = {}
        for _, per_rank in everyone:  # a parameter may have pieces on several ranks, or on one only
            steps.update(per_rank)
        manifest = _manifest(engine, tag, {name: f for per_rank, _ in everyone for name, f in per_rank.items()},
                             steps, client_state)
        write_manifest(partial, manifest)
        publish(partial, tag)
    barrier(engine.comm)
    return directory / tag


def _check_tag(tag: str) -> None:
    if not tag or "/" in tag or tag.startswith(".") or tag.endswith((".partial", ".replaced", ".tmp")) \
            or tag == "latest":
        raise ValueError(f"checkpoint tag {tag!r}: expected a plain directory name, not 'latest', without '/' "
                         "and not ending in .partial, .replaced or .tmp")


def _write_rank_files(engine: Trainable, partial: Path) -> dict[str, dict]:
    """This rank's files in ``partial``; name -> size and CRC. Out of room: a ``CheckpointError``
    naming the directory and the bytes, and this rank's files removed (the previous checkpoint stays)."""
    rank = engine.comm.rank
    size = sum(sum(_segments(engine, s)) for s in engine.opt_states if rank < s.unit.layout.shards)
    try:
        return _write_rank_data(engine, partial, size)
    except OSError as error:
        for name in (rank_file(rank, "bin"), rank_file(rank, "pt"), "buffers.bin" if rank == 0 else ""):
            if name:
                with contextlib.suppress(OSError):
                    (partial / name).unlink()
        clear = out_of_space(error, partial, size)
        if clear is None:
            raise
        raise clear from error


def _write_rank_data(engine: Trainable, partial: Path, size: int) -> dict[str, dict]:
    """This rank's unit shards (units it holds a shard of) and RNG states; rank 0's also the buffers."""
    rank = engine.comm.rank
    with AsyncIO(engine.config.aio) as aio:
        depth = checkpoint_depth(engine.config.aio)
        writer = ChecksummedWriter(partial / rank_file(rank, "bin"), aio, size, writes_in_flight=depth)
        try:
            for state in engine.state_dicts.visit(write=False):
                if rank < state.unit.layout.shards:
                    parts = [engine.state_dicts.fp32_shard(state)]
                    parts += [part for name in state.moment_names for part in state.stored_moment(name)]
                    for part, nbytes in zip(parts, _segments(engine, state), strict=True):
                        writer.write(part, nbytes)
        finally:
            files = {rank_file(rank, "bin"): writer.close()}
        if rank == 0:
            buffers = ChecksummedWriter(partial / "buffers.bin", aio, writes_in_flight=depth)
            try:
                for _, buffer in persistent_buffers(engine.module):
                    buffers.write(buffer)
            finally:
                files["buffers.bin"] = buffers.close()
    rng_path = partial / rank_file(rank, "pt")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, rng_path)
    files[rng_path.name] = file_record(rng_path)
    return files


def _segments(engine: Trainable, state: "UnitOptimizerState") -> list[int]:
    """Bytes of each segment of ``state``'s unit shard in a rank file (``layout.shard_segments``)."""
    return shard_segments(_unit_record(state.unit), len(state.moment_names), engine.config.optimizer.moments)


def _optimizer_steps(engine: Trainable) -> dict[str, float]:
    """The optimizer step count of each parameter this rank holds a piece of, by its first name."""
    steps = {}
    for state in engine.opt_states:
        for piece, tensor in state.pieces:
            step = engine.optimizer.state[tensor].get("step")
            steps[state.unit.layout.slots[piece.slot_index].names[0]] = 0.0 if step is None else float(step)
    return steps


def _manifest(engine: Trainable, tag: str, files: dict, steps: dict[str, float], client_state: dict | None) -> dict:
    optimizer = engine.optimizer
    return {
        "format": FORMAT, "version": VERSION, "tag": tag, "world_size": engine.comm.world_size,
        "stage": engine.config.zero.stage, "precision": engine.config.train.precision, "config": engine.config.to_toml(),
        "moments": list(engine.opt_states[0].moment_names) if engine.opt_states else [],
        "moment_format": engine.config.optimizer.moments,
        "units": [_unit_record(u) for u in engine.units],
        "steps": steps,
        "groups": [{k: v for k, v in g.items() if k != "params" and _jsonable(v)} for g in optimizer.param_groups],
        "scheduler": None if engine.lr_scheduler is None else _scheduler_state(engine.lr_scheduler),
        "scaler": engine.scaler.state(),
        "counters": {"global_steps": engine.window.global_steps, "micro_steps": engine.window.micro_steps,
                     "skipped_steps": engine.window.skipped_steps},
        "buffers": [{"name": n, "dtype": str(b.dtype).removeprefix("torch."), "shape": list(b.shape)}
                    for n, b in persistent_buffers(engine.module)],
        "client_state": client_state,
        "files": files,
    }


def _scheduler_state(scheduler: Any) -> dict:
    return {k: v for k, v in scheduler.state_dict().items() if _jsonable(v)}


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# ---------------------------------------------------------------------------------------------- load
def load_checkpoint(engine: Trainable, directory: str | os.PathLike, tag: str | None = None, *,
                    verify: bool = True) -> dict | None:
    """Restore ``engine`` from a checkpoint of any layout; returns the saved client state. Everything
    is checked (and the buffers read) before the first state changes: a refused load changes nothing.
    ``verify=False``: the data files' CRCs were checked already (``read_manifest``)."""
    manifest = read_manifest(directory, tag, verify=verify)
    with malformed(manifest):
        sources = parameter_sources(manifest)
        _check_same_model(engine, sources, manifest.directory)
        _check_same_buffers(engine, manifest)
        _check_same_optimizer(engine, manifest)
    with RankFiles(manifest) as files:
        buffers = read_saved_buffers(manifest, files)
        engine.state_dicts.set_optimizer_states(lambda state, frozen: _fill_state(state, frozen, sources, files),
                                                whole=True)
    _restore_buffers(engine, buffers)
    _restore_optimizer(engine, manifest)
    _restore_rng(engine, manifest)
    return manifest.data["client_state"]


def _check_same_model(engine: Trainable, sources: dict[str, Source], path: Path) -> None:
    ours = {name: tuple(s.shape) for u in engine.units for s in u.layout.slots for name in s.names}
    _refuse_differences(path, "parameter", {n: s.shape for n, s in sources.items()}, ours)


def _check_same_buffers(engine: Trainable, manifest: Manifest) -> None:
    saved = {r["name"]: (tuple(r["shape"]), r["dtype"]) for r in manifest.data["buffers"]}
    ours = {n: (tuple(b.shape), str(b.dtype).removeprefix("torch.")) for n, b in persistent_buffers(engine.module)}
    _refuse_differences(manifest.directory, "buffer", saved, ours)


def _refuse_differences(path: Path, what: str, saved: dict[str, Any], ours: dict[str, Any]) -> None:
    """Refuse a checkpoint whose ``what``s (name -> shape, or shape and dtype) differ from the model's;
    the message names at most ten of each, the exception's attributes hold every name."""
    missing = sorted(set(ours) - set(saved))
    extra = sorted(set(saved) - set(ours))
    differ = sorted(f"{n}: saved {saved[n]}, model {ours[n]}" for n in set(ours) & set(saved) if saved[n] != ours[n])
    if missing or extra or differ:
        parts = [f"{what}s {label}: {_some(names)}" for label, names in
                 (("not in the checkpoint", missing), ("not in the model", extra), ("that differ", differ)) if names]
        error = CheckpointError(f"{path} was saved from another model; " + "; ".join(parts))
        error.missing, error.unexpected, error.mismatched = missing, extra, differ
        raise error


def _some(names: list[str], shown: int = 10) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{names[:shown]}{more} ({len(names)})" if more else str(names)


def _check_same_optimizer(engine: Trainable, manifest: Manifest) -> None:
    data = manifest.data
    ours = list(engine.opt_states[0].moment_names) if engine.opt_states else []
    if data["moments"] != ours:
        raise CheckpointError(f"{manifest.directory}: saved with optimizer moments {data['moments']}, but this "
                              f"optimizer keeps {ours}: use the optimizer.type it was saved with")
    if len(data["groups"]) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"{manifest.directory}: saved with {len(data['groups'])} parameter group(s), but this "
                              f"engine has {len(engine.optimizer.param_groups)}: pass the same param_groups")
    counters = data["counters"]
    for key in ("global_steps", "micro_steps", "skipped_steps"):
        int(counters[key])


def _fill_state(state: "UnitOptimizerState", frozen: torch.Tensor | None, sources: dict[str, Source],
                files: RankFiles) -> None:
    """This rank's new master and moment shards of one unit, from wherever the parameters were saved;
    values past the trainable part (frozen: no moments) into ``frozen``, the weights there."""
    unit, trainable = state.unit, state.unit.trainable_numel
    targets = [state.master()] + [state.moment(n) for n in state.moment_names]
    for target in [*targets, frozen]:
        if target is not None:
            target.zero_()  # padding
    for piece in unit.pieces:
        source = sources[unit.layout.slots[piece.slot_index].names[0]]
        start, stop = unit.param_range(piece)
        cut = piece.start + unit.held(piece)
        if cut > piece.start:
            for segment, target in enumerate(targets):
                if not (segment and _kept_int8(state, files, source, segment, piece, start, start + cut - piece.start)):
                    read_range(files, source, segment, start, start + cut - piece.start, target[piece.start:cut])
        if cut < piece.stop:
            read_range(files, source, 0, start + cut - piece.start, stop,
                       frozen[cut - trainable:piece.stop - trainable])


def _kept_int8(state: "UnitOptimizerState", files: RankFiles, source: Source, segment: int, piece: "Piece",
               start: int, stop: int) -> bool:
    """Whether an int8 moment's piece was stored as saved: codes and scales copied as they are where the
    saved blocks are the loading run's (``read_int8_piece``). Decoded and encoded anew, they would come
    back the same only as far as every value's fp32 round trip lands on its code again; a copy is exact
    by construction, so a resume at the same world size is bitwise, every time."""
    if not (state.int8 and files.manifest.moment_format == "int8"):
        return False
    saved = read_int8_piece(files, source, segment, start, stop)
    if saved is not None:
        state.keep_int8(state.moment_names[segment - 1], piece, *saved)
    return saved is not None


def _restore_optimizer(engine: Trainable, manifest: Manifest) -> None:
    data, optimizer = manifest.data, engine.optimizer
    for group, saved in zip(optimizer.param_groups, data["groups"], strict=True):
        group.update(saved)
    for state in engine.opt_states:
        for piece, tensor in state.pieces:
            name = state.unit.layout.slots[piece.slot_index].names[0]
            step = optimizer.state[tensor].get("step")
            if step is not None:
                step.fill_(data["steps"].get(name, 0.0))
    if engine.lr_scheduler is not None and data["scheduler"] is not None:
        engine.lr_scheduler.load_state_dict({**engine.lr_scheduler.state_dict(), **data["scheduler"]})
    engine.scaler.load_state(data["scaler"])
    counters = data["counters"]
    engine.window.restore(counters["global_steps"], counters["micro_steps"], counters["skipped_steps"])


def _restore_buffers(engine: Trainable, values: dict[str, torch.Tensor]) -> None:
    for name, buffer in persistent_buffers(engine.module):
        buffer.copy_(values[name])


def _restore_rng(engine: Trainable, manifest: Manifest) -> None:
    """RNG states come back on ranks that existed in the saved run (others keep theirs)."""
    path = manifest.directory / rank_file(engine.comm.rank, "pt")
    if not path.exists():
        return
    rng = torch.load(path, weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):  # fewer devices than when saved
            torch.cuda.set_rng_state_all(rng["cuda"])


# ---------------------------------------------------------------------------------------------- consolidate
def consolidate(directory: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype = torch.float32,
                tag: str | None = None) -> Path:
    """Write every key of the saved model's ``state_dict()`` (each tied name, buffers included) as one
    safetensors file, tensor by tensor, so peak memory stays near the largest tensor. Parameters are
    cast from the fp32 masters to ``dtype`` (round to nearest even, as torch casts); buffers keep theirs."""
    manifest = read_manifest(directory, tag)
    with RankFiles(manifest) as files:
        with malformed(manifest):
            entries = _consolidated_entries(manifest, dtype, files)
        return write_safetensors(out, entries, {"source": str(manifest.directory)})


def _consolidated_entries(manifest: Manifest, dtype: torch.dtype, files: RankFiles) -> list[SafetensorsEntry]:
    """Every parameter name and buffer, each value read from ``files`` when it is written."""
    entries = []
    for index, unit in enumerate(manifest.units):
        for slot in unit["slots"]:
            source = Source(index, unit, slot["offset"], tuple(slot["shape"]))

            def produce(source: Source = source, numel: int = slot["numel"]) -> torch.Tensor:
                values = torch.empty(numel, dtype=torch.float32)
                read_range(files, source, 0, 0, numel, values)
                return values.to(dtype).view(source.shape)
            entries += [SafetensorsEntry(name, source.shape, dtype, produce) for name in slot["names"]]
    offset = 0
    for record in manifest.data["buffers"]:
        buffer_dtype = getattr(torch, record["dtype"])
        shape = tuple(record["shape"])

        def produce_buffer(offset: int = offset, shape: tuple = shape, buffer_dtype: torch.dtype = buffer_dtype
                           ) -> torch.Tensor:
            values = torch.empty(shape, dtype=buffer_dtype)
            files.read_buffers(offset, values)
            return values
        entries.append(SafetensorsEntry(record["name"], shape, buffer_dtype, produce_buffer))
        offset += buffer_dtype.itemsize * math.prod(shape)
    return entries
