"""Checkpoints: sharded, atomic, exactly resumable, and reshardable across world sizes, stages and tiers.

[Note: checkpoint layout]
``DIR/<tag>/`` holds ``manifest.json`` (written by rank 0 last), ``rank00000.bin`` ... (each rank's
unit shards: for unit after unit, this rank's fp32 master shard and then each moment shard, padding
included) and ``rank00000.pt`` (each rank's RNG states). ``DIR/latest`` names the newest complete tag.
The manifest records the format version, the config, the world size and stage, every unit's layout
(parameter names, shapes, offsets, shard size), the optimizer's per-parameter step counts and group
settings, the LR schedule, loss scaler and counters, the module buffers, the client state, and the
size and CRC-32 of every file.

- *Atomic*: every rank writes into ``<tag>.partial/`` and fsyncs; after a barrier rank 0 writes the
  manifest, renames the directory to ``<tag>`` and only then replaces ``latest`` (write, fsync,
  rename). A run killed at any point leaves the previous checkpoint and ``latest`` as they were.
- *Resharding*: a loading rank rebuilds each of its new unit shards from the saved shards by
  parameter name: for every parameter part it needs it reads the byte range of each old rank file
  that holds it. So any world size, stage or tier layout loads into any other; names or shapes that
  differ are refused with the list.
- Blocks on NVMe are streamed through host buffers on the way out and in, one unit at a time.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .io import AsyncIO, OffsetReader, aligned_empty, open_file
from .partition import FlatUnit

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "consolidate", "default_tag", "resolve_tag",
           "read_manifest", "Manifest"]

FORMAT = "zerooffload-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, corrupt, truncated, or for another model."""


def default_tag(step: int) -> str:
    return f"step{step:08d}"


def rank_file(rank: int, suffix: str) -> str:
    return f"rank{rank:05d}.{suffix}"


# ---------------------------------------------------------------------------------------------- files
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _ChecksummedWriter:
    """A file written front to back with O_DIRECT through the async-I/O engine, ``WRITES_IN_FLIGHT``
    transfers at a time, its CRC-32 computed from the bytes as they go out.

    Each write is copied into its own aligned buffer first, so the caller's tensor (often a stream's
    host buffer about to be reused) is free at once and reading the next block overlaps this write.
    A known ``size`` is preallocated: ext4 serializes writes that extend a file (half speed here).
    """

    WRITES_IN_FLIGHT = 3

    def __init__(self, path: Path, aio: AsyncIO, size: int = 0):
        self.path = path
        self.aio = aio
        self.file = open_file(path, "w", direct=aio.config.direct)
        if size:
            os.posix_fallocate(self.file.fd, 0, size)
        self.crc = 0
        self.bytes = 0
        self._pending: deque[tuple[torch.Tensor, Any]] = deque()

    def write(self, tensor: torch.Tensor) -> None:
        while len(self._pending) >= self.WRITES_IN_FLIGHT:
            self._pending.popleft()[1].wait()
        staging = aligned_empty(tensor.numel() * tensor.element_size())
        staging.copy_(tensor.detach().reshape(-1).view(torch.uint8))  # one copy, from wherever it lives
        self.crc = zlib.crc32(memoryview(staging.numpy()), self.crc)
        self._pending.append((staging, self.aio.write(self.file, staging, self.bytes)))
        self.bytes += staging.numel()

    def close(self) -> dict:
        try:
            while self._pending:
                self._pending.popleft()[1].wait()
            os.fsync(self.file.fd)
        finally:
            self.file.close()
        return {"bytes": self.bytes, "crc32": self.crc}


def _verify_file(path: Path, expected: dict) -> None:
    if not path.exists():
        raise CheckpointError(f"{path}: missing (the manifest lists it); the checkpoint is incomplete")
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"{path}: {size} bytes but the manifest says {expected['bytes']}: truncated or "
                              "overwritten")
    crc = _crc32(path)
    if crc != expected["crc32"]:
        raise CheckpointError(f"{path}: CRC-32 {crc:#010x} but the manifest says {expected['crc32']:#010x}: "
                              "the file is corrupt")


# ---------------------------------------------------------------------------------------------- layout
def _unit_record(unit: FlatUnit) -> dict:
    layout = unit.layout
    return {"name": layout.name, "shards": layout.shards, "shard_numel": layout.shard_numel,
            "slots": [{"names": list(s.names), "offset": s.offset, "numel": s.numel, "shape": list(s.shape),
                       "trainable": s.trainable} for s in layout.slots]}


@dataclass(frozen=True, slots=True)
class Manifest:
    """A loaded ``manifest.json`` and where its files are."""

    directory: Path
    data: dict

    @property
    def units(self) -> list[dict]:
        return self.data["units"]

    @property
    def segments(self) -> int:
        """Tensors per unit shard in a rank file: the master and each moment."""
        return 1 + len(self.data["moments"])

    def unit_offset(self, index: int) -> int:
        """Byte offset of unit ``index``'s shard block in each rank file that holds it."""
        return sum(u["shard_numel"] * 4 * self.segments for u in self.units[:index])


def resolve_tag(directory: str | os.PathLike, tag: str | None) -> Path:
    directory = Path(directory)
    if tag is None:
        latest = directory / LATEST
        if not latest.exists():
            raise CheckpointError(f"{directory}: no '{LATEST}' file, so no complete checkpoint to load; pass a tag")
        tag = latest.read_text().strip()
    path = directory / tag
    if not (path / MANIFEST).exists():
        raise CheckpointError(f"{path}: no {MANIFEST}: not a complete checkpoint (a save that did not finish "
                              "leaves only a .partial directory)")
    return path


def read_manifest(directory: str | os.PathLike, tag: str | None = None, verify: bool = True) -> Manifest:
    path = resolve_tag(directory, tag)
    data = json.loads((path / MANIFEST).read_text())
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise CheckpointError(f"{path / MANIFEST}: format {data.get('format')!r} version {data.get('version')!r}; "
                              f"this zerooffload reads {FORMAT!r} version {VERSION}")
    if verify:
        for name, expected in data["files"].items():
            _verify_file(path / name, expected)
    return Manifest(path, data)


# ---------------------------------------------------------------------------------------------- save
def save_checkpoint(engine: Any, directory: str | os.PathLike, tag: str | None = None,
                    client_state: dict | None = None) -> Path:
    """Write ``engine``'s full training state (see the note); collective: every rank calls it."""
    directory = Path(directory)
    tag = tag or default_tag(engine.global_steps)
    partial = directory / f"{tag}.partial"
    rank = engine.comm.rank
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a save killed earlier
        partial.mkdir(parents=True)
    _barrier(engine)
    files = _write_rank_files(engine, partial)
    everyone = _gather(engine, (files, _optimizer_steps(engine)))
    if rank == 0:
        steps: dict[str, float] = {}
        for _, per_rank in everyone:  # a parameter may have pieces on several ranks, or on one only
            steps.update(per_rank)
        manifest = _manifest(engine, tag, {name: f for per_rank, _ in everyone for name, f in per_rank.items()},
                             steps, client_state)
        _write_json(partial / MANIFEST, manifest)
        _fsync_dir(partial)
        final = directory / tag
        replaced = directory / f"{tag}.replaced"
        shutil.rmtree(replaced, ignore_errors=True)
        if final.exists():  # set aside, not deleted, until the new one is in place: two renames apart
            os.replace(final, replaced)
        os.replace(partial, final)
        _write_text_atomically(directory / LATEST, tag)
        shutil.rmtree(replaced, ignore_errors=True)
    _barrier(engine)
    return directory / tag


def _write_rank_files(engine: Any, partial: Path) -> dict[str, dict]:
    """This rank's unit shards (units it holds a shard of) and RNG states; name -> size and CRC."""
    rank = engine.comm.rank
    with AsyncIO(engine.config.aio) as aio:
        size = sum(s.unit.layout.shard_numel * 4 * (1 + len(s.moment_names))  # master and moments, as written
                   for s in engine.opt_states if rank < s.unit.layout.shards)
        writer = _ChecksummedWriter(partial / rank_file(rank, "bin"), aio, size)
        try:
            for state in engine.visit_optimizer_states(write=False):
                if rank < state.unit.layout.shards:
                    writer.write(state.master())
                    for name in state.moment_names:
                        writer.write(state.moment(name))
        finally:
            files = {rank_file(rank, "bin"): writer.close()}
        if rank == 0:
            buffers = _ChecksummedWriter(partial / "buffers.bin", aio)
            for _, buffer in engine.module.named_buffers():
                buffers.write(buffer)
            files["buffers.bin"] = buffers.close()
    rng_path = partial / rank_file(rank, "pt")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, rng_path)
    files[rng_path.name] = _file_record(rng_path)
    return files


def _file_record(path: Path) -> dict:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "crc32": _crc32(path)}


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(64 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _optimizer_steps(engine: Any) -> dict[str, float]:
    """The optimizer step count of each parameter this rank holds a piece of, by its first name."""
    steps = {}
    for state in engine.opt_states:
        for piece, tensor in state.pieces:
            step = engine.optimizer.state[tensor].get("step")
            steps[state.unit.layout.slots[piece.slot_index].names[0]] = 0.0 if step is None else float(step)
    return steps


def _manifest(engine: Any, tag: str, files: dict, steps: dict[str, float], client_state: dict | None) -> dict:
    optimizer = engine.optimizer
    return {
        "format": FORMAT, "version": VERSION, "tag": tag, "world_size": engine.comm.world_size,
        "stage": engine.stage, "precision": engine.config.train.precision, "config": engine.config.to_toml(),
        "moments": list(engine.opt_states[0].moment_names) if engine.opt_states else [],
        "units": [_unit_record(u) for u in engine.units],
        "steps": steps,
        "groups": [{k: v for k, v in g.items() if k != "params" and _jsonable(v)} for g in optimizer.param_groups],
        "scheduler": None if engine.scheduler is None else _scheduler_state(engine.scheduler),
        "scaler": engine.scaler.state(),
        "counters": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                     "skipped_steps": engine.skipped_steps},
        "buffers": [{"name": n, "dtype": str(b.dtype).removeprefix("torch."), "shape": list(b.shape)}
                    for n, b in engine.module.named_buffers()],
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


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _write_text_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    _fsync_dir(path.parent)


def _barrier(engine: Any) -> None:
    if engine.comm.world_size > 1:
        dist.barrier(group=engine.comm.group)


def _gather(engine: Any, value: Any) -> list:
    if engine.comm.world_size == 1:
        return [value]
    out: list = [None] * engine.comm.world_size
    dist.all_gather_object(out, value, group=engine.comm.group)
    return out


# ---------------------------------------------------------------------------------------------- load
def load_checkpoint(engine: Any, directory: str | os.PathLike, tag: str | None = None) -> dict | None:
    """Restore ``engine`` from a checkpoint of any layout; returns the saved client state."""
    manifest = read_manifest(directory, tag)
    sources = _parameter_sources(manifest)
    _check_same_model(engine, sources, manifest.directory)
    with _RankFiles(manifest) as files:
        engine.set_optimizer_states(lambda state: _fill_state(state, sources, files), whole=True)
        _restore_buffers(engine, files)
    _restore_optimizer(engine, manifest)
    _restore_rng(engine, manifest)
    return manifest.data["client_state"]


@dataclass(frozen=True, slots=True)
class _Source:
    """Where one parameter's values lie in the saved layout."""

    unit_index: int
    unit: dict
    offset: int
    shape: tuple[int, ...]


def _parameter_sources(manifest: Manifest) -> dict[str, _Source]:
    sources = {}
    for index, unit in enumerate(manifest.units):
        for slot in unit["slots"]:
            for name in slot["names"]:
                sources[name] = _Source(index, unit, slot["offset"], tuple(slot["shape"]))
    return sources


def _check_same_model(engine: Any, sources: dict[str, _Source], path: Path) -> None:
    ours = {name: tuple(s.shape) for u in engine.units for s in u.layout.slots for name in s.names}
    missing = sorted(set(ours) - set(sources))
    extra = sorted(set(sources) - set(ours))
    shapes = sorted(f"{n}: saved {list(sources[n].shape)}, model {list(ours[n])}"
                    for n in set(ours) & set(sources) if sources[n].shape != ours[n])
    if missing or extra or shapes:
        parts = [f"not in the checkpoint: {missing}" if missing else "",
                 f"not in the model: {extra}" if extra else "", f"shapes differ: {shapes}" if shapes else ""]
        raise CheckpointError(f"{path} was saved from another model; " + "; ".join(p for p in parts if p))


class _RankFiles:
    """The checkpoint's data files, opened on demand, read by byte offset: a rank's shards, the buffers."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self._reader = OffsetReader()

    def read(self, rank: int, offset: int, out: torch.Tensor) -> None:
        self._read(rank_file(rank, "bin"), offset, out)

    def read_buffers(self, offset: int, out: torch.Tensor) -> None:
        self._read("buffers.bin", offset, out)

    def _read(self, name: str, offset: int, out: torch.Tensor) -> None:
        try:
            self._reader.read_into(self.manifest.directory / name, offset, out)
        except EOFError as error:
            raise CheckpointError(str(error)) from None

    def __enter__(self) -> "_RankFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self._reader.close()


def _fill_state(state: Any, sources: dict[str, _Source], files: _RankFiles) -> None:
    """This rank's new master and moment shards of one unit, from wherever the parameters were saved."""
    unit = state.unit
    targets = [state.master()] + [state.moment(n) for n in state.moment_names]
    for target in targets:
        target.zero_()  # padding
    for piece in unit.pieces:
        source = sources[unit.layout.slots[piece.slot_index].names[0]]
        start, stop = unit.param_range(piece)
        for segment, target in enumerate(targets):
            _read_range(files, source, segment, start, stop, target[piece.start:piece.stop])


def _read_range(files: _RankFiles, source: _Source, segment: int, start: int, stop: int,
                out: torch.Tensor) -> None:
    """Elements [start, stop) of one saved parameter's ``segment`` (0 master, 1.. moments) into ``out``."""
    manifest, shard = files.manifest, source.unit["shard_numel"]
    base = manifest.unit_offset(source.unit_index)
    flat_lo, flat_hi = source.offset + start, source.offset + stop
    buffer = torch.empty(stop - start, dtype=torch.float32)
    for rank in range(flat_lo // shard, (flat_hi - 1) // shard + 1):
        lo, hi = max(flat_lo, rank * shard), min(flat_hi, (rank + 1) * shard)
        byte = base + (segment * shard + lo - rank * shard) * 4
        files.read(rank, byte, buffer[lo - flat_lo:hi - flat_lo])
    out.copy_(buffer)


def _restore_optimizer(engine: Any, manifest: Manifest) -> None:
    data, optimizer = manifest.data, engine.optimizer
    for group, saved in zip(optimizer.param_groups, data["groups"]):
        group.update(saved)
    for state in engine.opt_states:
        for piece, tensor in state.pieces:
            name = state.unit.layout.slots[piece.slot_index].names[0]
            step = optimizer.state[tensor].get("step")
            if step is not None:
                step.fill_(data["steps"].get(name, 0.0))
    if engine.scheduler is not None and data["scheduler"] is not None:
        engine.scheduler.load_state_dict({**engine.scheduler.state_dict(), **data["scheduler"]})
    engine.scaler.load_state(data["scaler"])
    counters = data["counters"]
    engine.global_steps, engine.micro_steps = counters["global_steps"], counters["micro_steps"]
    engine.skipped_steps = counters["skipped_steps"]
    engine._stepped_at = engine.micro_steps


def _restore_buffers(engine: Any, files: _RankFiles) -> None:
    named = dict(engine.module.named_buffers())
    offset = 0
    for record in files.manifest.data["buffers"]:
        buffer = named.get(record["name"])
        if buffer is None or list(buffer.shape) != record["shape"]:
            raise CheckpointError(f"{files.manifest.directory}: module buffer {record['name']!r} "
                                  f"{record['shape']} has no match in the model")
        values = torch.empty(buffer.shape, dtype=buffer.dtype)
        files.read_buffers(offset, values)
        buffer.copy_(values)
        offset += values.numel() * values.element_size()


def _restore_rng(engine: Any, manifest: Manifest) -> None:
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
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                       torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL", torch.float64: "F64"}


def consolidate(directory: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype = torch.float32,
                tag: str | None = None) -> Path:
    """Write every key of the saved model's ``state_dict()`` (each tied name, buffers included) as one
    safetensors file, tensor by tensor, so peak memory stays near the largest tensor. Parameters are
    cast from the fp32 masters to ``dtype`` (round to nearest even, as torch casts); buffers keep theirs."""
    manifest = read_manifest(directory, tag)
    entries = _consolidated_entries(manifest, dtype)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": str(manifest.directory)}}
    offset = 0
    for name, shape, tensor_dtype, _ in entries:
        nbytes = tensor_dtype.itemsize * math.prod(shape)
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor_dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    out = Path(out)
    temporary = out.with_name(out.name + ".partial")
    with _RankFiles(manifest) as files, open(temporary, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for _, _, _, produce in entries:
            f.write(memoryview(produce(files).contiguous().view(torch.uint8).reshape(-1).numpy()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, out)
    return out


def _consolidated_entries(manifest: Manifest, dtype: torch.dtype) -> list[tuple]:
    """(name, shape, dtype, produce(files) -> tensor) for every parameter name and buffer."""
    entries = []
    for index, unit in enumerate(manifest.units):
        for slot in unit["slots"]:
            source = _Source(index, unit, slot["offset"], tuple(slot["shape"]))

            def produce(files: _RankFiles, source: _Source = source, numel: int = slot["numel"]) -> torch.Tensor:
                values = torch.empty(numel, dtype=torch.float32)
                _read_range(files, source, 0, 0, numel, values)
                return values.to(dtype)
            entries += [(name, source.shape, dtype, produce) for name in slot["names"]]
    offset = 0
    for record in manifest.data["buffers"]:
        buffer_dtype = getattr(torch, record["dtype"])
        shape = tuple(record["shape"])

        def produce_buffer(files: _RankFiles, offset: int = offset, shape: tuple = shape,
                           buffer_dtype: torch.dtype = buffer_dtype) -> torch.Tensor:
            values = torch.empty(shape, dtype=buffer_dtype)
            files.read_buffers(offset, values)
            return values
        entries.append((record["name"], shape, buffer_dtype, produce_buffer))
        offset += buffer_dtype.itemsize * math.prod(shape)
    return entries
