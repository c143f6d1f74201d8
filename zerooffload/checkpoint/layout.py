"""A saved checkpoint read back by parameter name, whatever layout saved it: the manifest, where each
parameter's values lie in the rank files, and reads of those byte ranges (``checkpoint``'s [Note:
checkpoint layout] says what the files hold). Loading (resharding into any world size, stage or
tiers) and ``consolidate`` both read through here.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..io import OffsetReader
from ..io.buffers import ALIGNMENT
from ..optim.state_formats import INT8_BLOCK, decode_int8, int8_blocks
from .files import CheckpointError, load_manifest_json, resolve_tag, verify_file

__all__ = ["FORMAT", "VERSION", "MOMENT_ITEMSIZE", "Manifest", "read_manifest", "first_verified", "rank_file",
           "malformed", "Source", "parameter_sources", "shard_segments", "RankFiles", "read_range",
           "read_int8_piece", "read_saved_buffers"]

FORMAT = "zerooffload-checkpoint"
VERSION = 2
"""The manifest's format version. 2: data files digested with CRC32C (1: zlib's CRC-32, still read)."""
READABLE_VERSIONS = (1, 2)


MOMENT_ITEMSIZE = {"fp32": 4, "bf16": 2, "int8": 1}
"""Bytes per element of a saved moment, by ``optimizer.moments`` (int8: the codes; the scales beside)."""

def rank_file(rank: int, suffix: str) -> str:
    return f"rank{rank:05d}.{suffix}"


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to O_DIRECT's alignment: every segment starts aligned in its rank file."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _int8_scales(unit: dict) -> int:
    """Scales saved per int8 moment of a unit shard: enough for any rank's pieces (each starts a block)."""
    return unit["shard_numel"] // INT8_BLOCK + sum(1 for slot in unit["slots"] if slot["trainable"])


def shard_segments(unit: dict, moments: int, moment_format: str) -> list[int]:
    """Bytes of each segment of one unit shard in a rank file, as saved: the fp32 master, then per moment
    its values (int8: codes, then a segment of fp32 scales); each padded to 4 KiB. fp32 moments keep the
    layout of checkpoints saved before the compact formats (a shard is a multiple of 1024 elements)."""
    shard = unit["shard_numel"]
    per_moment = [_aligned(shard * MOMENT_ITEMSIZE[moment_format])]
    if moment_format == "int8":
        per_moment.append(_aligned(4 * _int8_scales(unit)))
    return [shard * 4] + per_moment * moments


@dataclass(frozen=True, slots=True)
class Manifest:
    """A loaded ``manifest.json`` and where its files are."""

    directory: Path
    data: dict

    @property
    def units(self) -> list[dict]:
        return self.data["units"]

    @property
    def moment_format(self) -> str:
        """The moments' saved format (checkpoints from before the compact formats hold fp32)."""
        return self.data.get("moment_format", "fp32")

    def segments(self, index: int) -> list[int]:
        """Bytes of each segment of unit ``index``'s shard block (``shard_segments``)."""
        return shard_segments(self.units[index], len(self.data["moments"]), self.moment_format)

    def segment_offset(self, index: int, segment: int) -> int:
        """Byte offset of segment ``segment`` (0 master, 1.. moments) of unit ``index``'s shard block in each
        rank file that holds it."""
        before = sum(sum(self.segments(i)) for i in range(index))
        return before + sum(self.segments(index)[:self._first_part(segment)])

    def _first_part(self, segment: int) -> int:
        """Index of a segment's first part in ``segments`` (an int8 moment has two: codes and scales)."""
        return 1 + (segment - 1) * (2 if self.moment_format == "int8" else 1) if segment else 0


_MANIFEST_KEYS = {"format": str, "version": int, "world_size": int, "moments": list, "units": list, "steps": dict,
                  "groups": list, "scaler": dict, "counters": dict, "buffers": list, "files": dict}


def read_manifest(directory: str | os.PathLike, tag: str | None = None, verify: bool = True) -> Manifest:
    """The manifest of ``tag`` (default: ``latest``), its digest and (with ``verify``) every file it
    lists checked; anything malformed is a ``CheckpointError`` naming the file."""
    path = resolve_tag(Path(directory), tag)
    data = load_manifest_json(path)
    if data.get("format") != FORMAT or data.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path / 'manifest.json'}: format {data.get('format')!r} version "
                              f"{data.get('version')!r}; this zerooffload reads {FORMAT!r} versions "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
    wrong = [f"{key} (expected a JSON {kind.__name__})" for key, kind in _MANIFEST_KEYS.items()
             if not isinstance(data.get(key), kind)]
    if wrong:
        raise CheckpointError(f"{path / 'manifest.json'}: not a valid manifest: missing or malformed "
                              + ", ".join(wrong))
    if data.get("moment_format", "fp32") not in MOMENT_ITEMSIZE:
        raise CheckpointError(f"{path / 'manifest.json'}: moment_format {data['moment_format']!r}: expected one of "
                              f"{sorted(MOMENT_ITEMSIZE)}")
    if verify:
        for name, expected in data["files"].items():
            verify_file(path / name, expected)
    return Manifest(path, data)


def first_verified(places: list[tuple[Path, str | None]], verify: Callable[[Path, str | None], Any] | None = None
                   ) -> tuple[int | None, list[CheckpointError]]:
    """Which of ``places`` (a checkpoint directory and tag, None for ``latest``; newest first) is the first
    whose manifest and files verify (``verify``, by default ``read_manifest``: a CheckpointError says
    why not), None when none does, and why each one before it did not: a resume takes the newest
    checkpoint that verifies and says in one line what it passed over."""
    errors = []
    for index, (directory, tag) in enumerate(places):
        try:
            (verify or read_manifest)(directory, tag)
        except CheckpointError as error:
            errors.append(error)
            continue
        return index, errors
    return None, errors


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
    """Elements [start, stop) of one saved parameter's ``segment`` (0 master, 1.. moments) into ``out``,
    as fp32 values (bf16 moments widened, int8 ones decoded: both exact)."""
    shard = source.unit["shard_numel"]
    flat_lo, flat_hi = source.offset + start, source.offset + stop
    buffer = torch.empty(stop - start, dtype=torch.float32)
    for rank in range(flat_lo // shard, (flat_hi - 1) // shard + 1):
        lo, hi = max(flat_lo, rank * shard), min(flat_hi, (rank + 1) * shard)
        _read_shard_range(files, source, segment, rank, lo - rank * shard, hi - rank * shard,
                          buffer[lo - flat_lo:hi - flat_lo])
    out.copy_(buffer)


def _read_shard_range(files: RankFiles, source: Source, segment: int, rank: int, lo: int, hi: int,
                      out: torch.Tensor) -> None:
    """Elements [lo, hi) of rank ``rank``'s shard (all inside ``source``'s slot) of one segment, as fp32."""
    manifest = files.manifest
    base = manifest.segment_offset(source.unit_index, segment)
    moment_format = manifest.moment_format if segment else "fp32"
    if moment_format == "int8":
        _read_int8_range(files, source, base, segment == 1, rank, lo, hi, out)
    elif moment_format == "bf16":
        values = torch.empty(hi - lo, dtype=torch.bfloat16)
        files.read(rank, base + lo * 2, values)
        out.copy_(values)
    else:
        files.read(rank, base + lo * 4, out)


def _read_int8_range(files: RankFiles, source: Source, base: int, signed: bool, rank: int, lo: int, hi: int,
                     out: torch.Tensor) -> None:
    """An int8 moment's elements [lo, hi) of a saved shard, decoded from the whole blocks around them.
    Blocks start at each trainable piece of the shard (optim.state), pieces in slot order."""
    piece_start, first_scale = _saved_piece(source.unit, source.offset, rank)
    first_block = (lo - piece_start) // INT8_BLOCK
    code_lo = piece_start + first_block * INT8_BLOCK
    codes = torch.empty(hi - code_lo, dtype=torch.uint8)
    files.read(rank, base + code_lo, codes)
    scales = torch.empty(int8_blocks(codes.numel()), dtype=torch.float32)
    scales_at = base + _aligned(source.unit["shard_numel"])
    files.read(rank, scales_at + 4 * (first_scale + first_block), scales)
    out.copy_(decode_int8(codes, scales, signed)[lo - code_lo:])


def read_int8_piece(files: RankFiles, source: Source, segment: int, start: int, stop: int
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The codes and scales of elements [start, stop) of one saved parameter's int8 moment ``segment``, as
    they are, when a saved shard held exactly that piece (so its blocks were cut as the loading run's: a
    resume at the saved world size); None when they were cut elsewhere (``read_range`` then decodes)."""
    shard = source.unit["shard_numel"]
    rank = (source.offset + start) // shard
    piece_start, first_scale = _saved_piece(source.unit, source.offset, rank)
    piece_stop = min(source.offset + math.prod(source.shape), (rank + 1) * shard) - rank * shard
    if (piece_start, piece_stop) != (source.offset + start - rank * shard, source.offset + stop - rank * shard):
        return None
    base = files.manifest.segment_offset(source.unit_index, segment)
    codes = torch.empty(stop - start, dtype=torch.uint8)
    files.read(rank, base + piece_start, codes)
    scales = torch.empty(int8_blocks(stop - start), dtype=torch.float32)
    files.read(rank, base + _aligned(shard) + 4 * first_scale, scales)
    return codes, scales


def _saved_piece(unit: dict, slot_offset: int, rank: int) -> tuple[int, int]:
    """Where the piece of the slot at ``slot_offset`` starts in rank ``rank``'s saved shard, and its first
    int8 scale (the blocks of the trainable pieces before it come first)."""
    shard = unit["shard_numel"]
    lo, hi = rank * shard, (rank + 1) * shard
    first_scale = 0
    for slot in unit["slots"]:
        start, stop = max(slot["offset"], lo), min(slot["offset"] + slot["numel"], hi)
        if slot["offset"] == slot_offset:
            return start - lo, first_scale
        if slot["trainable"] and start < stop:
            first_scale += int8_blocks(stop - start)
    raise ValueError(f"unit {unit['name']!r} has no parameter at offset {slot_offset}")  # sources come from it


def read_saved_buffers(manifest: Manifest, files: RankFiles) -> dict[str, torch.Tensor]:
    """The saved buffers, by name, read into new CPU tensors (checked against the model already)."""
    values, offset = {}, 0
    for record in manifest.data["buffers"]:
        value = torch.empty(record["shape"], dtype=getattr(torch, record["dtype"]))
        files.read_buffers(offset, value)
        values[record["name"]] = value
        offset += value.numel() * value.element_size()
    return values
