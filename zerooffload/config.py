"""Typed configuration: one frozen dataclass per component, validated once, read by every layer.

[Note: config vocabulary]
- A *section* is one component's settings (``[train]``, ``[zero]``, ``[offload.param]`` ...). Each is a
  ``@dataclass(kw_only=True, slots=True, frozen=True)`` whose fields carry a doc string and bounds in
  their metadata (see ``_opt``); ``__post_init__`` converts and checks every field, so a section built
  in Python is as validated as one read from a file.
- A *key path* names one field from the top, e.g. ``offload.optimizer.fraction``. Every error is a
  ``ConfigError`` (a ``ValueError``) that names the key path, the bad value and what is allowed.
- A *size* is a byte count: an integer, or a string such as ``"64MiB"``, ``"2GB"``, ``"1.5GiB"``.
  Some sizes also accept ``"auto"``, kept as the string ``"auto"`` and resolved by the component.

This module imports no other part of zerooffload: every layer reads it, it reads none of them.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tempfile
import tomllib
import types
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from . import deepspeed_config
from .values import ConfigError, dtype_bytes, format_size, parse_size

__all__ = [
    "ConfigError", "Config", "TrainConfig", "OptimizerConfig", "SchedulerConfig", "ZeroConfig",
    "OffloadParamConfig", "OffloadOptimizerConfig", "OffloadConfig", "MemoryConfig", "NvmeConfig",
    "AioConfig", "parse_size", "format_size", "dtype_bytes",
]

ALIGNMENT = 4096
"""O_DIRECT alignment of buffers, offsets and lengths on the disks we target."""


# ----------------------------------------------------------------------------------------------
# Field conversion

def _opt(default: Any, doc: str, *, min: float | None = None, max: float | None = None,
         below: float | None = None, above: float | None = None, size: bool = False,
         multiple_of: int | None = None) -> Any:
    """A section field: its default, what it means (shown in errors and the README), and its bounds.

    ``min``/``max`` are inclusive, ``above``/``below`` exclusive; ``size`` marks a byte count.
    """
    meta = {"doc": doc, "min": min, "max": max, "above": above, "below": below, "size": size,
            "multiple_of": multiple_of}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _describe(hint: Any) -> str:
    """What a type hint allows, in words for error messages."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin in (list, tuple):
        count = f"{len(args)} items" if origin is tuple else "items"
        return f"a list of {count}, each {_describe(args[0])}"
    if hint is type(None):
        return "unset"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]


def _convert(value: Any, hint: Any, key: str) -> Any:
    """``value`` as ``hint`` (bool, int, float, str, Literal, list, tuple, Optional, unions of these)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        for arm in args:
            try:
                return _convert(value, arm, key)
            except ConfigError:
                continue
    elif origin is Literal:
        if value in args and not isinstance(value, bool):
            return value
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)) and (origin is list or len(value) == len(args)):
            items = args if origin is tuple else [args[0]] * len(value)
            return origin(_convert(v, h, f"{key}[{i}]") for i, (v, h) in enumerate(zip(value, items)))
    elif hint is type(None):
        if value is None:
            return None
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key} = {value!r}: expected {_describe(hint)}")


def _check_bounds(value: Any, meta: dict, key: str) -> None:
    """Range checks from a field's metadata; every message says what range is allowed."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    checks = [("min", lambda b: value >= b, ">="), ("max", lambda b: value <= b, "<="),
              ("above", lambda b: value > b, ">"), ("below", lambda b: value < b, "<")]
    for name, ok, symbol in checks:
        bound = meta[name]
        if bound is not None and not ok(bound):
            raise ConfigError(f"{key} = {value!r}: must be {symbol} {bound} ({meta['doc']})")
    if meta["multiple_of"] and value % meta["multiple_of"]:
        raise ConfigError(f"{key} = {value!r}: must be a multiple of {meta['multiple_of']} ({meta['doc']})")


class _Section:
    """Shared behaviour of the section dataclasses: convert and check each field after __init__."""

    __slots__ = ()
    PATH = ""

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self))
        for f in fields(self):
            key = f"{self.PATH}.{f.name}"
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                continue
            if f.metadata["size"] and not (isinstance(value, str) and value == "auto"):
                value = parse_size(value, key)
            value = _convert(value, hints[f.name], key)
            _check_bounds(value, f.metadata, key)
            object.__setattr__(self, f.name, value)
        self.check()

    def check(self) -> None:
        """Checks across the fields of one section; sections override it."""

    @classmethod
    def from_dict(cls, data: Any, path: str | None = None) -> "_Section":
        """Build from a mapping, refusing unknown keys with a "did you mean" hint."""
        path = path or cls.PATH
        if not isinstance(data, dict):
            raise ConfigError(f"{path or 'config'} = {data!r}: expected a table of keys")
        names = {f.name: f for f in fields(cls)}
        for key in data:
            if key not in names:
                hint = difflib.get_close_matches(str(key), names, n=1)
                where = f"{path}.{key}" if path else str(key)
                near = f"{path}.{hint[0]}" if hint and path else hint[0] if hint else ""
                raise ConfigError(f"unknown key {where!r}" + (f"; did you mean {near!r}?" if near else "")
                                  + f" (allowed: {', '.join(names)})")
        kwargs = {}
        for key, value in data.items():
            nested = get_type_hints(cls)[key]
            if dataclasses.is_dataclass(nested):
                value = nested.from_dict(value, f"{path}.{key}" if path else key)
            kwargs[key] = value
        return cls(**kwargs)

    def to_dict(self, *, readable_sizes: bool = False) -> dict:
        """Plain values (tuples as lists) for JSON and TOML; sizes as "64MiB" with ``readable_sizes``."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, _Section):
                value = value.to_dict(readable_sizes=readable_sizes)
            elif isinstance(value, tuple):
                value = list(value)
            elif readable_sizes and f.metadata["size"] and isinstance(value, int):
                value = format_size(value)
            out[f.name] = value
        return out


def _section(cls):
    return dataclass(kw_only=True, slots=True, frozen=True)(cls)


# ----------------------------------------------------------------------------------------------
# Sections

@_section
class TrainConfig(_Section):
    PATH = "train"
    micro_batch_size: int = _opt(1, "samples per rank per forward", min=1)
    grad_accum_steps: int = _opt(1, "micro-batches accumulated per optimizer step", min=1)
    precision: Literal["fp32", "bf16", "fp16"] = _opt("fp32", "compute dtype; master weights stay fp32")
    grad_clip: float = _opt(0.0, "clip the global gradient norm to this; 0 = off", min=0)
    seed: int = _opt(0, "seed of parameter init and data order", min=0)
    activation_checkpointing: bool = _opt(False, "recompute each unit's activations in backward")
    threads: int = _opt(0, "torch's CPU threads; 0: torch's default (one per core)", min=0)
    skip_nonfinite: bool = _opt(True, "skip a window whose loss or gradient norm is inf/NaN on any rank, as fp16 "
                                      "skips overflows (counted in stats.skipped_steps); false: update anyway, "
                                      "as plain PyTorch does")
    max_skip_streak: int = _opt(8, "stop (SkipStreakError) after this many windows in a row skipped for inf/NaN "
                                   "losses or gradients (fp16 overflows do not count); 0: never", min=0)
    loss_scale: float = _opt(0.0, "fp16 static loss scale; 0 = dynamic", min=0)
    initial_scale_power: int = _opt(16, "fp16 dynamic scale starts at 2**this", min=0, max=64)
    loss_scale_window: int = _opt(2000, "fp16: steps without overflow before the scale doubles", min=1)
    hysteresis: int = _opt(2, "fp16: overflows tolerated before the scale halves", min=1)
    min_loss_scale: float = _opt(1.0, "fp16: the dynamic scale never drops below this", above=0)


@_section
class OptimizerConfig(_Section):
    PATH = "optimizer"
    type: Literal["adamw", "adam", "sgd"] = _opt("adamw", "update rule (adam: L2 decay; adamw: decoupled)")
    lr: float = _opt(1e-3, "learning rate (the peak, with a warmup schedule)", min=0)
    betas: tuple[float, float] = _opt((0.9, 0.999), "Adam moment decay rates, each in [0, 1)")
    eps: float = _opt(1e-8, "Adam denominator term", above=0)
    weight_decay: float = _opt(0.01, "weight decay", min=0)
    momentum: float = _opt(0.0, "SGD momentum", min=0, below=1)
    update_in_backward: Literal["auto", "on", "off"] = _opt(
        "auto", "update units whose gradients leave the device in the backward that closes a window (auto: "
        "unless fp16; with train.grad_clip only units whose optimizer state is on nvme, tentatively: the step "
        "commits the update, or redoes it clipped when the global norm exceeds the clip)")

    def check(self) -> None:
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ConfigError(f"optimizer.betas[{i}] = {beta!r}: must be in [0, 1)")


@_section
class SchedulerConfig(_Section):
    PATH = "scheduler"
    type: Literal["constant", "warmup_cosine", "warmup_linear"] = _opt(
        "constant", "learning-rate schedule: linear warmup from min_lr to lr, then constant or a decay to min_lr")
    warmup_steps: int = _opt(0, "optimizer steps of linear warmup", min=0)
    total_steps: int = _opt(0, "optimizer step at which a decay reaches min_lr (decays need it > warmup_steps)",
                            min=0)
    min_lr: float = _opt(0.0, "where warmup starts and decay ends", min=0)

    def check(self) -> None:
        if self.type != "constant" and self.total_steps <= self.warmup_steps:
            raise ConfigError(
                f"scheduler.total_steps = {self.total_steps}: scheduler.type = {self.type!r} decays after "
                f"warmup, so total_steps must be > warmup_steps ({self.warmup_steps})")


@_section
class ZeroConfig(_Section):
    PATH = "zero"
    stage: int = _opt(2, "ZeRO stage: 0 DDP, 1 optimizer states, 2 + gradients, 3 + parameters", min=0, max=3)
    unit_modules: list[str] = _opt([], "class names of the modules that form units; [] = each child of a "
                                       "ModuleList/Sequential")
    bucket_size: int = _opt("32MiB", "bytes per reduce-scatter/all-reduce bucket", size=True, above=0)
    prefetch_size: int = _opt("64MiB", "stage 3: bytes of gathered parameters fetched ahead", size=True, min=0)
    max_live_size: int = _opt("1GiB", "stage 3: most bytes of gathered parameters held at once", size=True,
                              above=0)
    persist_threshold: int = _opt(0, "stage 3: units with fewer parameters stay gathered", min=0)
    overlap_comm: bool = _opt(True, "overlap gradient reduction with backward")

    def check(self) -> None:
        if self.prefetch_size > self.max_live_size:
            raise ConfigError(f"zero.prefetch_size = {self.prefetch_size}: must be <= zero.max_live_size "
                              f"({self.max_live_size}): prefetched units are live")


_TIERS = Literal["device", "host", "nvme"]


@_section
class OffloadParamConfig(_Section):
    PATH = "offload.param"
    tier: _TIERS = _opt("device", "home of stage-3 parameter shards")
    path: str | None = _opt(None, "swap directory for this state (overrides nvme.path)")


@_section
class OffloadOptimizerConfig(_Section):
    PATH = "offload.optimizer"
    tier: _TIERS = _opt("device", "home of fp32 master weights and optimizer moments")
    path: str | None = _opt(None, "swap directory for this state (overrides nvme.path)")
    fraction: float = _opt(1.0, "share of optimizer state offloaded to the tier; the rest stays on device",
                           min=0, max=1)


@_section
class OffloadActivationsConfig(_Section):
    PATH = "offload.activations"
    tier: Literal["device", "host"] = _opt(
        "device", "where checkpointed activations (the block inputs train.activation_checkpointing keeps) wait "
        "for backward; host: copied off a CUDA device after each block's forward, prefetched back in backward "
        "order (on a CPU device they are in host memory already: nothing moves)")


@_section
class OffloadConfig(_Section):
    PATH = "offload"
    param: OffloadParamConfig = field(default_factory=OffloadParamConfig, metadata={"doc": "parameters"})
    optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig,
                                              metadata={"doc": "optimizer states"})
    activations: OffloadActivationsConfig = field(default_factory=OffloadActivationsConfig,
                                                  metadata={"doc": "checkpointed activations"})


_BUDGET = Union[int, Literal["auto"]]


@_section
class MemoryConfig(_Section):
    PATH = "memory"
    device_budget: _BUDGET = _opt("auto", 'bytes the engine may hold on the device; "auto": 90% of free CUDA '
                                          "memory; on CPU the RAM available, shared with the host tier", size=True,
                                  min=1)
    host_budget: _BUDGET = _opt("auto", 'bytes the engine may hold in host RAM; "auto": the RAM available (less a '
                                        "margin for activations, the allocator and torch)", size=True, min=1)
    release_freed: Literal["auto", "on", "off"] = _opt(
        "auto", "give freed host buffers of 1 MiB and more back to the OS at once (glibc's mmap threshold fixed), so "
        "RSS follows what the engine holds, at the cost of page faults on fresh buffers (CPU activations too); auto: "
        "on when parameters or optimizer states live on NVMe")


@_section
class NvmeConfig(_Section):
    PATH = "nvme"
    path: Union[str, list[str]] = _opt(tempfile.gettempdir(),
                                       "an existing swap directory (never created; files go in its zerooffload-swap/), "
                                       "or a list to stripe over")
    checksum: bool = _opt(True, "verify every swapped-in block against the digest taken when it was written "
                                "(off: faster by a few percent, and a damaged swap file is trained on)")

    def check(self) -> None:
        if not self.path or (isinstance(self.path, list) and not all(self.path)):
            raise ConfigError(f"nvme.path = {self.path!r}: needs at least one non-empty directory")

    @property
    def paths(self) -> list[str]:
        """The swap directories as a list, whichever way they were given."""
        return [self.path] if isinstance(self.path, str) else list(self.path)


@_section
class AioConfig(_Section):
    PATH = "aio"
    backend: Literal["auto", "uring", "pool", "python", "aiofiles"] = _opt(
        "auto", "I/O engine; auto = uring, else pool, else python")
    block_size: int = _opt("1MiB", "bytes per I/O request piece", size=True, min=ALIGNMENT, multiple_of=ALIGNMENT)
    queue_depth: int = _opt(32, "I/O request pieces in flight per engine", min=1, max=4096)
    threads: int = _opt(4, "worker threads of the pool/python/aiofiles backends", min=1, max=256)
    direct: bool = _opt(True, "O_DIRECT: bypass the page cache")
    blocks_in_flight: int = _opt(
        0, "host buffers each block pipeline holds at most (the optimizer/parameter block stream, the "
        "background block writer, offloaded-gradient reads, the checkpoint writer's writes in flight); 0 = "
        "each its own default (3, 3, 2, 3); else at least 2", min=0, max=64)

    def check(self) -> None:
        if self.blocks_in_flight == 1:
            raise ConfigError("aio.blocks_in_flight = 1: must be 0 (each pipeline's default) or at least 2 (a "
                              "block stream holds the block being worked on while it reads the next)")


# ----------------------------------------------------------------------------------------------
# The whole configuration

@_section
class Config(_Section):
    """Everything a run needs, by component; see README "Configuration" for every key."""

    PATH = ""
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "training loop"})
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, metadata={"doc": "optimizer"})
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig, metadata={"doc": "LR schedule"})
    zero: ZeroConfig = field(default_factory=ZeroConfig, metadata={"doc": "sharding"})
    offload: OffloadConfig = field(default_factory=OffloadConfig, metadata={"doc": "state placement"})
    memory: MemoryConfig = field(default_factory=MemoryConfig, metadata={"doc": "budgets"})
    nvme: NvmeConfig = field(default_factory=NvmeConfig, metadata={"doc": "swap files"})
    aio: AioConfig = field(default_factory=AioConfig, metadata={"doc": "async I/O"})

    def check(self) -> None:
        if self.offload.param.tier != "device" and self.zero.stage != 3:
            raise ConfigError(
                f"offload.param.tier = {self.offload.param.tier!r} needs zero.stage = 3 (only stage 3 partitions "
                f"parameters; zero.stage is {self.zero.stage}): set zero.stage = 3 or offload.param.tier = 'device'")
        if self.offload.optimizer.tier != "device" and self.zero.stage == 0:
            raise ConfigError(
                f"offload.optimizer.tier = {self.offload.optimizer.tier!r} needs zero.stage >= 1 (stage 0 keeps no "
                "optimizer shards): set zero.stage = 1, 2 or 3")
        self._check_update_in_backward()
        if self.offload.activations.tier != "device" and not self.train.activation_checkpointing:
            raise ConfigError(
                f"offload.activations.tier = {self.offload.activations.tier!r} needs train.activation_checkpointing "
                "= true (only checkpointed block inputs are moved off the device): turn it on, or set "
                "offload.activations.tier = 'device'")

    def _check_update_in_backward(self) -> None:
        """``optimizer.update_in_backward = "on"`` only where it can apply: units whose reduced gradients
        leave the device, updated tentatively under a clip (their state before the update kept on NVMe)."""
        if self.optimizer.update_in_backward != "on":
            return
        needs = []
        if self.train.grad_clip > 0 and self.offload.optimizer.tier != "nvme":
            needs.append(f"offload.optimizer.tier = 'nvme' with train.grad_clip = {self.train.grad_clip} (a clipped "
                         "update in backward is tentative: the state before it is kept on NVMe for the redo), or "
                         "train.grad_clip = 0")
        if self.train.precision == "fp16":
            needs.append("train.precision other than fp16 (an fp16 step may be skipped for overflow)")
        if self.zero.stage < 2 or self.offload.optimizer.tier == "device" or self.offload.optimizer.fraction == 0:
            needs.append("zero.stage >= 2 with offload.optimizer.tier = 'host' or 'nvme' and a fraction > 0 (only "
                         "gradients that leave the device are updated in backward)")
        if needs:
            raise ConfigError("optimizer.update_in_backward = 'on' needs " + "; and ".join(needs)
                              + ": set it to 'auto' or 'off', or change those keys")

    @classmethod
    def load(cls, source: "Config | dict | str | Path", *, overrides: list[str] | tuple[str, ...] = (),
             world_size: int | None = None) -> "Config":
        """A validated Config from a Config, a dict, or a TOML/JSON file (ours or DeepSpeed's).

        ``overrides`` are ``"key.path=value"`` strings (values in TOML syntax, else strings), applied after
        reading. ``world_size`` checks a DeepSpeed ``train_batch_size``; by default WORLD_SIZE or 1.
        """
        if isinstance(source, Config) and not overrides:
            return source
        data = source.to_dict() if isinstance(source, Config) else (
            _read_file(Path(source)) if isinstance(source, (str, Path)) else source)
        if not isinstance(data, dict):
            raise ConfigError(f"config = {data!r}: expected a table of sections")
        if deepspeed_config.is_deepspeed(data):
            data = deepspeed_config.from_deepspeed(data, world_size=world_size, schema=cls)
        for override in overrides:
            data = apply_override(data, override)
        return cls.from_dict(data)

    def to_toml(self) -> str:
        """TOML text that ``Config.load`` reads back to an equal Config."""
        return _to_toml(self.to_dict(readable_sizes=True))

    def replace(self, **sections: Any) -> "Config":
        """A copy with whole sections replaced (sections are immutable)."""
        return dataclasses.replace(self, **sections)


def _read_file(path: Path) -> dict:
    """Parse TOML or JSON by the file's suffix (JSON, then TOML, when the suffix says neither)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    formats = {".toml": {"TOML": tomllib.loads}, ".json": {"JSON": json.loads}}.get(
        path.suffix.lower(), {"JSON": json.loads, "TOML": tomllib.loads})
    errors = []
    for name, parse in formats.items():
        try:
            return parse(text)
        except (ValueError, tomllib.TOMLDecodeError) as exc:  # both messages give the line and column
            errors.append(f"{name}: {exc}" if len(formats) > 1 else str(exc))
    raise ConfigError(f"config file {path} is not valid {' or '.join(formats)}: " + "; ".join(errors))


def apply_override(data: dict, override: str) -> dict:
    """``data`` with one ``key.path=value`` set; the value is read as TOML (``3``, ``true``, ``[1, 2]``)
    and taken as a plain string when it is not valid TOML (``bf16``)."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {override!r}: expected key.path=value, e.g. zero.stage=3")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    out = json.loads(json.dumps(data))  # a deep copy of plain data; the caller's dict stays as it was
    *parents, leaf = key.split(".")
    node = out
    for i, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parents[:i + 1])} is not a section")
    node[leaf] = value
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"


def _to_toml(data: dict, prefix: str = "") -> str:
    """Tables of scalars and lists; nested tables as ``[a.b]``; None (unset) omitted."""
    scalars = [f"{k} = {_toml_value(v)}" for k, v in data.items() if v is not None and not isinstance(v, dict)]
    out = [f"[{prefix}]"] + scalars + [""] if prefix and scalars else []
    for key, value in data.items():
        if isinstance(value, dict):
            out.append(_to_toml(value, f"{prefix}.{key}" if prefix else key))
    return "\n".join(out)
