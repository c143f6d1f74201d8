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
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..training_state import Trainable
from .files import CheckpointError, resolve_tag
from .layout import (
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
)
from .safetensors_file import SafetensorsEntry, write_safetensors
from .saving import default_tag, persistent_buffers, save_checkpoint

if TYPE_CHECKING:
    from ..optim.state import UnitOptimizerState
    from ..zero.unit_layout import Piece

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "consolidate", "default_tag", "resolve_tag",
           "read_manifest", "Manifest", "persistent_buffers", "Trainable"]


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
