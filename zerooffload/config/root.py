"""The whole config of a run: its sections, read from a file (ours or DeepSpeed's), overridden, written.
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import stat
import tomllib
from dataclasses import field
from pathlib import Path
from typing import Any

from .deepspeed import from_deepspeed, is_deepspeed
from .fields import Section, section
from .sections import (AioConfig, MemoryConfig, NvmeConfig, OffloadConfig, OptimizerConfig, SchedulerConfig,
                       TrainConfig, ZeroConfig)
from .values import ConfigError

__all__ = ["Config", "apply_override"]


@section
class Config(Section):
    """Everything a run needs, by component; every key: docs/configuration-reference.md."""

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
        self._check_split_master()
        self._check_update_in_backward()
        if self.offload.activations.tier != "device" and not self.train.activation_checkpointing:
            raise ConfigError(
                f"offload.activations.tier = {self.offload.activations.tier!r} needs train.activation_checkpointing "
                "= true (only checkpointed block inputs are moved off the device): turn it on, or set "
                "offload.activations.tier = 'device'")

    def _check_split_master(self) -> None:
        """A split master is the bf16 weight plus its residual: bf16 precision only, updated in the step."""
        if self.optimizer.master != "split":
            return
        if self.train.precision != "bf16":
            what = ("the fp32 master is the weight itself: there is nothing to split" if self.train.precision == "fp32"
                    else "fp16 weights keep an fp32 master (a split master is a bf16 weight plus a residual)")
            raise ConfigError(f"optimizer.master = 'split' needs train.precision = 'bf16' ({what}): set "
                              "optimizer.master = 'fp32' or train.precision = 'bf16'")
        if self.optimizer.type == "sgd":
            raise ConfigError("optimizer.master = 'split' is updated by the native Adam pass: optimizer.type = 'sgd' "
                              "keeps an fp32 master; set optimizer.master = 'fp32' or type 'adamw'")
        if self.optimizer.update_in_backward == "on" and self.train.grad_clip > 0:
            raise ConfigError("optimizer.update_in_backward = 'on' cannot go with optimizer.master = 'split' and "
                              f"train.grad_clip = {self.train.grad_clip} (a clipped update in backward is tentative, "
                              "and the weights it rewrote could not be restored): set it to 'auto' or 'off', or "
                              "train.grad_clip = 0")

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
            read_config_file(Path(source)) if isinstance(source, (str, Path)) else source)
        if not isinstance(data, dict):
            raise ConfigError(f"config = {data!r}: expected a table of sections")
        if is_deepspeed(data):
            data = from_deepspeed(data, world_size=world_size, schema=cls)
        for override in overrides:
            data = apply_override(data, override)
        return cls.from_dict(data)

    def to_toml(self) -> str:
        """TOML text that ``Config.load`` reads back to an equal Config."""
        return _to_toml(self.to_dict(readable_sizes=True))

    def replace(self, **sections: Any) -> "Config":
        """A copy with whole sections replaced (sections are immutable)."""
        return dataclasses.replace(self, **sections)


def read_config_file(path: Path) -> dict:
    """Parse TOML or JSON by the file's suffix (JSON, then TOML, when the suffix says neither)."""
    try:
        text = _read_text(path)
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


def _read_text(path: Path) -> str:
    """``path``'s text; a pipe's (a FIFO, ``--config <(...)``) in waits of 0.2 s. Why: Python runs a
    signal's handler between its own steps, and a Ctrl-C that lands after the last of them but before
    a blocking read of a pipe starts is taken only once the read returns: if the writer never writes,
    never (tests/test_cli_errors.py's Ctrl-C test hung so in about 1 run of 30 on a busy machine)."""
    if not stat.S_ISFIFO(path.stat().st_mode):
        return path.read_text()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # returns at once; the poll waits for a writer
    try:
        poller, chunks = select.poll(), []
        poller.register(fd, select.POLLIN)
        while True:
            if not poller.poll(200):
                continue  # back in Python: a pending signal's handler runs here
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:  # every writer gone: the end
                return b"".join(chunks).decode()
            chunks.append(chunk)
    finally:
        os.close(fd)


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
