"""Pretrained weights into a running engine, streamed from safetensors files tensor part by tensor part.

[Note: loading safetensors]
A *source* is one ``.safetensors`` file, a Hugging Face shard index (``*.safetensors.index.json``,
whose ``weight_map`` names the file of every key), or a directory holding one of them. Each key is
the model's parameter name with ``prefix`` in front (``"model."`` for many published checkpoints).
Every rank reads only the byte ranges of the parameter parts its own shards hold, straight from the
files (their format puts each tensor's bytes at a known offset), converts them to fp32 into its
master shards, wherever those live (NVMe too, unit by unit), and the compute weights follow; frozen
parameters, which have no master (optim.state's frozen prefix rule), go into the weights directly.
So loading needs about one unit of memory, never the whole model.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .comm import failing_together
from .io import OffsetReader
from .training_state import Trainable

if TYPE_CHECKING:
    from .optim.state import UnitOptimizerState

__all__ = ["load_safetensors", "SafetensorsSource"]

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class SafetensorsSource:
    """Keys of one or more safetensors files: shape, dtype and where their bytes are."""

    def __init__(self, source: str | os.PathLike):
        self.entries: dict[str, tuple[Path, dict, int]] = {}
        for file in _files(Path(source)):
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            header.pop("__metadata__", None)
            for key, entry in header.items():
                self.entries[key] = (file, entry, 8 + length)
        self._reader = OffsetReader()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key][1]["shape"])

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of ``key`` flattened, as fp32."""
        file, entry, data_start = self.entries[key]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{file}: {key} has dtype {entry['dtype']}; loadable: {sorted(_DTYPES)}")
        dtype = _DTYPES[entry["dtype"]]
        out = torch.empty(stop - start, dtype=dtype)
        try:
            self._reader.read_into(file, data_start + entry["data_offsets"][0] + start * dtype.itemsize, out)
        except EOFError as error:
            raise ValueError(f"{error} (reading {key})") from None
        return out.float()

    def close(self) -> None:
        self._reader.close()


def _files(source: Path) -> list[Path]:
    if source.is_dir():
        indexes = sorted(source.glob("*.safetensors.index.json"))
        return _files(indexes[0]) if indexes else sorted(source.glob("*.safetensors"))
    if source.name.endswith(".json"):
        weight_map = json.loads(source.read_text())["weight_map"]
        return [source.parent / name for name in sorted(set(weight_map.values()))]
    return [source]


def load_safetensors(engine: Trainable, source: str | os.PathLike, prefix: str = "", strict: bool = True) -> None:
    """Set ``engine``'s parameters from safetensors (see the note); collective. With ``strict`` every
    parameter must be found and every ``prefix`` key used; shapes must match either way."""
    engine.ensure_open("load_safetensors")
    with failing_together(engine.comm):  # a rank that cannot read its files must not strand the others
        files = SafetensorsSource(source)
        try:
            keys = _match(engine, files, prefix, strict)
            engine.state_dicts.set_optimizer_states(lambda state, frozen: _fill_master(state, frozen, files, keys),
                                                    whole=False)
        finally:
            files.close()


def _match(engine: Trainable, files: SafetensorsSource, prefix: str, strict: bool) -> dict[int, str]:
    """id(param) -> the key holding it, after checking names and shapes."""
    keys, missing, shapes = {}, [], []
    for unit in engine.units:
        for slot in unit.layout.slots:
            key = next((prefix + n for n in slot.names if prefix + n in files.entries), None)
            if key is None:
                missing.append(slot.names[0])
            elif files.shape(key) != tuple(slot.shape):
                shapes.append(f"{key}: file {list(files.shape(key))}, model {list(slot.shape)}")
            else:
                keys[id(slot.param)] = key
    names = {prefix + n for u in engine.units for s in u.layout.slots for n in s.names}
    unused = sorted(k for k in files.entries if k.startswith(prefix) and k not in names)
    problems = [f"shapes differ: {shapes}" if shapes else "",
                f"not in the files: {missing}" if missing and strict else "",
                f"not in the model: {unused}" if unused and strict else ""]
    if any(problems):
        raise ValueError("load_safetensors: " + "; ".join(p for p in problems if p))
    return keys


def _fill_master(state: "UnitOptimizerState", frozen: torch.Tensor | None, files: SafetensorsSource,
                 keys: dict[int, str]) -> None:
    """The parameter parts of one unit's shard found in the files: in the trainable part into the
    master, past it (frozen values, which have no master) into ``frozen``, the weights there."""
    unit, master, trainable = state.unit, state.master(), state.unit.trainable_numel
    for piece in unit.pieces:
        key = keys.get(id(unit.layout.slots[piece.slot_index].param))
        if key is None:
            continue
        values, held = files.read(key, *unit.param_range(piece)), unit.held(piece)
        master[piece.start:piece.start + held] = values[:held]
        if held < values.numel():
            frozen[piece.start + held - trainable:piece.stop - trainable] = values[held:]
