"""A saved checkpoint read back by parameter name, whatever layout saved it: the manifest, where each
parameter's values lie in the rank files, and reads of those byte ranges (``checkpoint``'s [Note:
checkpoint layout] says what the files hold). Loading (resharding into any world size, stage or
tiers) and ``consolidate`` both read through here.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..io import OffsetReader
from .files import CheckpointError, load_manifest_json, resolve_tag, verify_file

__all__ = ["FORMAT", "VERSION", "Manifest", "read_manifest", "rank_file", "malformed", "Source", "parameter_sources",
           "RankFiles", "read_range", "read_saved_buffers"]

FORMAT = "zerooffload-checkpoint"
VERSION = 1


def rank_file(rank: int, suffix: str) -> str:
    return f"rank{rank:05d}.{suffix}"


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


_MANIFEST_KEYS = {"format": str, "version": int, "world_size": int, "moments": list, "units": list, "steps": dict,
                  "groups": list, "scaler": dict, "counters": dict, "buffers": list, "files": dict}


def read_manifest(directory: str | os.PathLike, tag: str | None = None, verify: bool = True) -> Manifest:
    """The manifest of ``tag`` (default: ``latest``), its digest and (with ``verify``) every file it
    lists checked; anything malformed is a ``CheckpointError`` naming the file."""
    path = resolve_tag(Path(directory), tag)
    data = load_manifest_json(path)
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise CheckpointError(f"{path / 'manifest.json'}: format {data.get('format')!r} version "
                              f"{data.get('version')!r}; this zerooffload reads {FORMAT!r} version {VERSION}")
    wrong = [f"{key} (expected a JSON {kind.__name__})" for key, kind in _MANIFEST_KEYS.items()
             if not isinstance(data.get(key), kind)]
    if wrong:
        raise CheckpointError(f"{path / 'manifest.json'}: not a valid manifest: missing or malformed "
                              + ", ".join(wrong))
    if verify:
        for name, expected in data["files"].items():
            verify_file(path / name, expected)
    return Manifest(path, data)


@contextlib.contextmanager
def malformed(manifest: Manifest) -> Any:
    """A manifest whose records lack what they should hold is refused by name, not with a KeyError."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise CheckpointError(f"{manifest.directory / 'manifest.json'}: not a valid manifest "
                              f"({type(error).__name__}: {error})") from None


@dataclass(frozen=True, slots=True)
class Source:
    """Where one parameter's values lie in the saved layout."""

    unit_index: int
    unit: dict
    offset: int
    shape: tuple[int, ...]


def parameter_sources(manifest: Manifest) -> dict[str, Source]:
    sources = {}
    for index, unit in enumerate(manifest.units):
        for slot in unit["slots"]:
            for name in slot["names"]:
                sources[name] = Source(index, unit, slot["offset"], tuple(slot["shape"]))
    return sources


class RankFiles:
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

    def __enter__(self) -> "RankFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self._reader.close()


def read_range(files: RankFiles, source: Source, segment: int, start: int, stop: int,
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


def read_saved_buffers(manifest: Manifest, files: RankFiles) -> dict[str, torch.Tensor]:
    """The saved buffers, by name, read into new CPU tensors (checked against the model already)."""
    values, offset = {}, 0
    for record in manifest.data["buffers"]:
        value = torch.empty(record["shape"], dtype=getattr(torch, record["dtype"]))
        files.read_buffers(offset, value)
        values[record["name"]] = value
        offset += value.numel() * value.element_size()
    return values
