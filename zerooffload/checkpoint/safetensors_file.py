"""One safetensors file written tensor by tensor, so memory stays near the largest tensor.

Every name, dtype and shape is known before any value (from a manifest, or from the model), so the
header goes first and each value is produced and written in turn. The file appears under its name
only when complete (written to ``<name>.partial``, fsynced, renamed). A rank that does not write
still produces every value in order, for the collectives that produce them.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from ..comm import failing_together
from ..io.files import open_nofollow

if TYPE_CHECKING:
    from ..training_state import Trainable

__all__ = ["SafetensorsEntry", "save_safetensors", "write_safetensors"]

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
           torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
           torch.float64: "F64"}


class SafetensorsEntry(NamedTuple):
    """One tensor of the file: its name, shape and dtype, and the call that produces its value."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]


def _header(entries: list[SafetensorsEntry], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for entry in entries:
        nbytes = entry.dtype.itemsize * math.prod(entry.shape)
        header[entry.name] = {"dtype": _DTYPES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return encoded + b" " * (-len(encoded) % 8)


def write_safetensors(out: str | os.PathLike, entries: list[SafetensorsEntry], metadata: dict[str, str],
                      writes: bool = True) -> Path:
    """Write ``entries`` in order as the safetensors file ``out`` (every value produced, also where
    ``writes`` is False: see the module's note)."""
    out = Path(out)
    if not writes:
        for entry in entries:
            entry.produce()
        return out
    header = _header(entries, {"format": "pt", **metadata})
    temporary = out.with_name(out.name + ".partial")  # a link planted there is refused, never truncated
    with open(open_nofollow(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666), "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for entry in entries:
            value = entry.produce()
            if value.dtype != entry.dtype or tuple(value.shape) != tuple(entry.shape):
                raise ValueError(f"{entry.name}: produced {value.dtype} {tuple(value.shape)}, the header says "
                                 f"{entry.dtype} {entry.shape}")
            f.write(memoryview(value.contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, out)
    return out


def save_safetensors(engine: "Trainable", path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Path:
    """An engine's ``full_state_dict()`` keys as one safetensors file at ``path`` (``zo.load_safetensors``'s
    counterpart), rank 0 writing, one unit gathered at a time (memory near one unit, never the whole
    model): parameters from the masters cast to ``dtype``, buffers as they are. Collective."""
    engine.ensure_open("save_safetensors")
    with failing_together(engine.comm):  # a rank that cannot write must not strand the others in a gather
        entries = [SafetensorsEntry(*entry) for entry in engine.state_dicts.streamed_entries(dtype)]
        return write_safetensors(path, entries, {"source": "zerooffload"}, writes=engine.comm.rank == 0)
