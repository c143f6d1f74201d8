"""Reading DeepSpeed JSON configs: their keys mapped onto ours (DESIGN §2's table).

[Note: DeepSpeed mapping]
- A DeepSpeed config is recognized by ``zero_optimization`` or ``train_micro_batch_size_per_gpu``.
- Keys are *paths* (``zero_optimization.offload_param.device``). A few have a second spelling DeepSpeed
  also reads (``max_live_parameters`` for ``stage3_max_live_parameters``: its pydantic field names,
  ``aio.thread_count`` from before ``intra_op_parallelism``, ``bfloat16`` for ``bf16``); both map alike,
  and every message names the spelling the user wrote.
- *Direct* keys copy their value to one of ours; *element* keys count elements and become bytes of the
  compute dtype (2 for bf16/fp16, 4 for fp32); a few keys (precision, optimizer and scheduler types,
  offload devices and paths, batch sizes, the stage-3 live bound) need a rule of their own.
- Zeros mean what they mean to DeepSpeed: ``reduce_bucket_size = 0`` reduces each gradient alone (ours:
  ``zero.bucket_size = 1`` byte, each unit alone); ``stage3_prefetch_bucket_size = 0`` prefetches nothing;
  ``stage3_max_live_parameters = 0`` gathers only what is in use, so nothing is prefetched.
- Every error names the DeepSpeed key as written, its value, then our reason in our key names.
- Every other key is kept in one of three lists, reported together in one ``DeepSpeedConfigWarning``
  with the ``"auto"`` values: *not needed* (DeepSpeed tuning knobs our design makes unnecessary),
  *approximated* (mapped with a difference the user should know), *not supported* (ignored, with a
  "did you mean" for near misses, or zerooffload's own way of that feature: ``INSTEAD``). Nothing is
  dropped silently. What the config switches off (a section whose ``enabled`` is false, a switch DeepSpeed
  leaves off set to false: ``OFF_BY_DEFAULT``) asks for nothing, so it is listed as not needed.

[Note: "auto" and absent keys]
``"auto"`` is a request to the Hugging Face Trainer or Accelerate to fill the value in; DeepSpeed's own
config classes drop it, so the key counts as absent. zerooffload does the same, and lists each ``"auto"``
in the warning with the value it resolved to. An absent key takes zerooffload's default, except where
DeepSpeed's default would change what training computes; there DeepSpeed's default applies, as a run
under DeepSpeed would get it (``DEEPSPEED_DEFAULTS``): clipping at 1.0 (DeepSpeed >= 0.19.3), no weight
decay in the optimizers DeepSpeed builds (torch's 0.01 for ``torch_adam`` AdamW), fp16's
``loss_scale_window`` 1000, and the schedulers' 1000 warmup steps and WarmupDecayLR's peak 0.001. Sizes
of buckets, prefetch and persistence keep zerooffload's defaults: they size zerooffload's own buffers.
A ``null`` counts as absent too, as it does for DeepSpeed's optional fields.
"""
from __future__ import annotations

import difflib
import logging
import os
import re
import warnings
from functools import reduce
from typing import Any

from .deepspeed_keys import (ALIASES, DEEPSPEED_DEFAULTS, DIRECT, ELEMENTS, INSTEAD, NOT_NEEDED, OFF_BY_DEFAULT,
                             OFFLOAD_DEVICES, OPTIMIZERS, PREFIX_ALIASES, SCHEDULERS, SIZES, SPECIAL, TARGETS, Z,
                             ZERO_PP)
from .values import ConfigError, dtype_bytes, format_size

__all__ = ["DeepSpeedConfigWarning", "is_deepspeed", "from_deepspeed"]

logger = logging.getLogger(__name__)


class DeepSpeedConfigWarning(UserWarning):
    """Keys of a DeepSpeed config that zerooffload reads differently or not at all."""




def is_deepspeed(data: dict) -> bool:
    """True for a DeepSpeed config (our own format has neither of these keys)."""
    return "zero_optimization" in data or "train_micro_batch_size_per_gpu" in data


def _leaves(data: dict, prefix: str = "") -> dict[str, Any]:
    """Flatten nested tables to ``{"a.b.c": value}``; empty tables and nulls count as absent."""
    out = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_leaves(value, path + "."))
        elif value is not None:
            out[path] = value
    return out


def _canonical(path: str) -> str:
    for old, new in PREFIX_ALIASES.items():
        if path.startswith(old):
            path = new + path[len(old):]
    return ALIASES.get(path, path)


def _set(tree: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


class _Mapping:
    """One DeepSpeed config being translated: the flat input by canonical key, our nested output, where
    each of our values came from, and the notes for the warning."""

    def __init__(self, data: dict, schema: type):
        self.schema = schema
        """Our config class: its defaults, and the check of the result."""
        self.ds: dict[str, Any] = {}
        self.written: dict[str, str] = {}
        self.auto: list[str] = []
        for path, value in _leaves(data).items():
            key = _canonical(path)
            if key in self.written:
                raise ConfigError(f"{self.written[key]} and {path} are the same DeepSpeed setting: give one of them")
            self.written[key] = path
            if value == "auto":
                self.auto.append(key)
            else:
                self.ds[key] = value
        self.ours: dict = {}
        self.source: dict[str, str] = {}
        self.defaults: dict[str, str] = {}
        self.approximated: list[str] = []
        self.ignored: list[str] = []
        self.unused: list[str] = []

    def name(self, key: str) -> str:
        """The key as the user wrote it."""
        return self.written.get(key, key)

    def get(self, key: str, default: Any = None) -> Any:
        return self.ds.get(key, default)

    def put(self, our_key: str, value: Any, ds_key: str) -> None:
        _set(self.ours, our_key, value)
        self.source[our_key] = ds_key

    def default(self, ds_key: str, value: Any) -> None:
        """DeepSpeed's own default for an absent (or "auto") key, where it differs from ours."""
        our_key = TARGETS[ds_key]
        self.put(our_key, value, ds_key)
        self.defaults[our_key] = f"{ds_key} = {value!r}"

    def count(self, key: str) -> int | None:
        """A whole number >= 0 (DeepSpeed writes ``5e8``), None when absent."""
        value = self.ds.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
            raise ConfigError(f"{self.name(key)} = {value!r}: expected a whole number >= 0")
        return int(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.ds.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f'{self.name(key)} = {value!r}: expected true, false or "auto"')
        return value

    def choice(self, key: str, table: dict, default: str) -> str:
        """Map a DeepSpeed enum value (case-insensitive) or fail naming the key and the choices."""
        value = self.get(key, default)
        mapped = table.get(str(value).lower())
        if mapped is None:
            raise ConfigError(f"{self.name(key)} = {value!r}: zerooffload supports {', '.join(table)} (DeepSpeed "
                              "spelling, any case)")
        return mapped


def _map_precision(m: _Mapping) -> str:
    bf16, fp16 = m.flag("bf16.enabled", False), m.flag("fp16.enabled", False)
    if bf16 and fp16:
        raise ConfigError(f"{m.name('bf16.enabled')} and {m.name('fp16.enabled')} are both true: enable at most one")
    precision = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    m.put("train.precision", precision, "bf16.enabled" if bf16 else "fp16.enabled")
    if fp16 and "fp16.loss_scale_window" not in m.ds:
        m.default("fp16.loss_scale_window", DEEPSPEED_DEFAULTS["fp16.loss_scale_window"])
    return precision


def _map_batch(m: _Mapping, world_size: int) -> None:
    """DeepSpeed's rule: train_batch_size = micro × accumulation × world; a missing one is derived."""
    total = m.count("train_batch_size")
    micro, accum = m.count("train_micro_batch_size_per_gpu"), m.count("gradient_accumulation_steps")
    if total is None:
        return
    if micro is None:
        micro = total // ((accum or 1) * world_size)
    if accum is None:
        accum = total // (micro * world_size) if micro else 0
    if micro < 1 or accum < 1 or micro * accum * world_size != total:
        raise ConfigError(
            f"train_batch_size = {total}: must equal train_micro_batch_size_per_gpu ({micro}) × "
            f"gradient_accumulation_steps ({accum}) × world size ({world_size}); fix one of them or drop "
            "train_batch_size")
    m.put("train.micro_batch_size", micro, "train_batch_size")
    m.put("train.grad_accum_steps", accum, "train_batch_size")


def _map_optimizer(m: _Mapping) -> None:
    """DeepSpeed builds FusedAdam, DeepSpeedCPUAdam or a torch optimizer, all without weight decay by
    default but torch's AdamW (``torch_adam``); without an ``optimizer`` it uses the script's own."""
    if "optimizer.type" not in m.ds:
        if not any(k.startswith("optimizer.") for k in m.written):
            m.approximated.append("optimizer (absent: DeepSpeed trains with the optimizer the script passes; "
                                  "zerooffload builds the one optimizer.* describes)")
        return
    kind = m.choice("optimizer.type", OPTIMIZERS, "adamw")
    torch_adam = m.flag("optimizer.params.torch_adam", False)
    if kind == "adam" and m.flag("optimizer.params.adam_w_mode", True):
        kind = "adamw"  # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false
    m.put("optimizer.type", kind, "optimizer.type")
    if "optimizer.params.weight_decay" not in m.ds:
        torch_adamw = torch_adam and kind == "adamw"
        m.default("optimizer.params.weight_decay", 0.01 if torch_adamw else DEEPSPEED_DEFAULTS[
            "optimizer.params.weight_decay"])


def _map_scheduler(m: _Mapping) -> None:
    if "scheduler.type" not in m.ds:
        return
    kind = m.choice("scheduler.type", SCHEDULERS, "warmuplr")
    m.put("scheduler.type", kind, "scheduler.type")
    if "scheduler.params.warmup_num_steps" not in m.ds:
        m.default("scheduler.params.warmup_num_steps", DEEPSPEED_DEFAULTS["scheduler.params.warmup_num_steps"])
    if kind == "warmup_linear" and "scheduler.params.warmup_max_lr" not in m.ds:
        m.default("scheduler.params.warmup_max_lr", DEEPSPEED_DEFAULTS["scheduler.params.warmup_max_lr"])
    if kind != "constant" and "scheduler.params.total_num_steps" not in m.ds:
        m.put("scheduler.type", "constant", "scheduler.params.total_num_steps")
        m.approximated.append(f"{m.name('scheduler.type')} = {m.ds['scheduler.type']!r} without "
                              "scheduler.params.total_num_steps (no total to decay over: warmup, then constant; "
                              "set scheduler.type and scheduler.total_steps to decay)")
    warmup_type = m.get("scheduler.params.warmup_type", "log")
    if warmup_type != "linear":
        m.approximated.append(f"{m.name('scheduler.params.warmup_type')} = {warmup_type!r} (DeepSpeed's default "
                              "is 'log'; zerooffload warms up linearly)")
    if kind == "warmup_cosine":
        lr = m.ours.get("optimizer", {}).get("lr", 1e-3)
        cos_min, warm_min = m.get("scheduler.params.cos_min_ratio", 1e-4), m.get("scheduler.params.warmup_min_ratio", 0)
        m.put("scheduler.min_lr", cos_min * lr, "scheduler.params.cos_min_ratio")
        if warm_min != cos_min:
            m.approximated.append(f"{m.name('scheduler.params.warmup_min_ratio')} = {warm_min} (zerooffload warms "
                                  f"up from min_lr = cos_min_ratio × lr = {cos_min * lr:g})")


def _map_sizes(m: _Mapping, precision: str) -> None:
    """Element counts as bytes; the live bound caps prefetching, as DeepSpeed's does."""
    nbytes = dtype_bytes(precision)
    for ds_key, our_key in ELEMENTS.items():
        elements = m.count(ds_key)
        if elements is not None and our_key not in m.source:  # reduce_bucket_size before allgather_bucket_size
            m.put(our_key, elements * nbytes, ds_key)
    if m.ours.get("zero", {}).get("bucket_size") == 0:  # zerooffload's smallest bucket: every unit goes alone
        m.put("zero.bucket_size", 1, m.source["zero.bucket_size"])
        m.approximated.append(f"{m.name(m.source['zero.bucket_size'])} = 0 (DeepSpeed reduces each gradient alone, "
                              "zerooffload each unit alone: zero.bucket_size = 1 byte)")
    live_key = Z + "stage3_max_live_parameters"
    live = m.count(live_key)
    if live == 0:
        del m.ours["zero"]["max_live_size"], m.source["zero.max_live_size"]
        m.put("zero.prefetch_size", 0, live_key)
        m.approximated.append(f"{m.name(live_key)} = 0 (DeepSpeed then gathers only the modules in use: "
                              "zerooffload prefetches nothing, zero.prefetch_size = 0, and keeps its default "
                              "zero.max_live_size)")
    elif live is not None:
        prefetch = m.ours["zero"].get("prefetch_size", m.schema().zero.prefetch_size)
        m.put("zero.prefetch_size", min(prefetch, live * nbytes), m.source.get("zero.prefetch_size", live_key))
        m.approximated.append(f"{m.name(live_key)} = {_shown(m.ds[live_key])} (zero.max_live_size = "
                              f"{_size(live * nbytes)}: a bound zerooffload keeps, refusing at initialize a "
                              "unit that alone needs more; DeepSpeed gathers the module in use regardless)")
    threshold_key = Z + "stage3_param_persistence_threshold"
    if m.get(threshold_key):
        m.approximated.append(f"{m.name(threshold_key)} = {_shown(m.ds[threshold_key])} (zerooffload counts the "
                              "parameters of a unit, DeepSpeed those of each tensor)")


def _map_offload(m: _Mapping, stage: int) -> None:
    """Offload devices and swap paths; an offload_param below stage 3 is ignored as DeepSpeed ignores it,
    and an nvme_path for a device other than nvme is unused, as in DeepSpeed."""
    paths: dict[str, str] = {}
    for kind in ("param", "optimizer"):
        device_key, path_key = f"{Z}offload_{kind}.device", f"{Z}offload_{kind}.nvme_path"
        tier = m.choice(device_key, OFFLOAD_DEVICES, "none")
        if kind == "param" and stage < 3 and tier != "device":
            m.ignored.append(f"{m.name(device_key)} = {m.ds[device_key]!r} (parameters are offloaded only at "
                             "stage 3)")
            tier = "device"
        elif device_key in m.ds:
            m.put(f"offload.{kind}.tier", tier, device_key)
        if path_key not in m.ds:
            continue
        if tier != "nvme":
            m.unused.append(f"{m.name(path_key)} (the device is not nvme)")
        elif not isinstance(m.ds[path_key], str) or not m.ds[path_key]:
            raise ConfigError(f"{m.name(path_key)} = {m.ds[path_key]!r}: expected a directory")
        else:
            paths[path_key] = m.ds[path_key]
    if len(set(paths.values())) == 1:  # one swap directory: nvme.path, which an override can move
        key, path = next(iter(paths.items()))
        m.put("nvme.path", path, key)
    else:
        for key, path in paths.items():
            m.put(f"offload.{key.split('.')[1].removeprefix('offload_')}.path", path, key)


def _map_zero_pp(m: _Mapping, stage: int) -> None:
    """ZeRO++'s keys (``ZERO_PP``) at stage 3; below it ignored and reported, as DeepSpeed, whose stage 3 alone
    reads them, ignores them there (our qgZ would run at stages 1-2: not what that DeepSpeed run trained with)."""
    for ds_key, our_key in ZERO_PP.items():
        if ds_key not in m.ds:
            continue
        if stage == 3:
            m.put(our_key, m.ds[ds_key], ds_key)
        elif m.ds[ds_key] is True or (not isinstance(m.ds[ds_key], bool) and m.ds[ds_key] != 1):
            m.ignored.append(f"{m.name(ds_key)} = {m.ds[ds_key]!r} (ZeRO++ runs at stage 3 only)")


def from_deepspeed(data: dict, *, schema: type, world_size: int | None = None) -> dict:
    """Our config dict from a DeepSpeed one, checked against ``schema`` (``root.Config``, which calls
    this: passed in, so the two modules do not import each other); warns once about every key not
    mapped exactly."""
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if isinstance(data.get("zero_optimization"), bool):  # DeepSpeed's oldest form: true = stage 1
        data = {**data, "zero_optimization": {"stage": int(data["zero_optimization"])}}
    m = _Mapping(data, schema)
    for ds_key, our_key in DIRECT.items():
        if ds_key in m.ds:
            m.put(our_key, m.ds[ds_key], ds_key)
    if "gradient_clipping" not in m.ds:
        m.default("gradient_clipping", DEEPSPEED_DEFAULTS["gradient_clipping"])
    precision = _map_precision(m)
    _map_sizes(m, precision)
    _map_batch(m, world_size)
    _map_optimizer(m)
    _map_scheduler(m)
    stage = m.count(Z + "stage")
    _map_offload(m, m.schema().zero.stage if stage is None else stage)
    _map_zero_pp(m, m.schema().zero.stage if stage is None else stage)
    if any(m.written[k] != k and m.written[k].startswith(Z + "aio.") for k in m.written):
        m.approximated.append(f"{Z}aio (DeepSpeed reads aio at the top level only; read as aio)")
    config = _validated(m)
    _warn(m, config)
    return m.ours


def _validated(m: _Mapping) -> Any:
    """The mapped config validated now, so that an error names the DeepSpeed key it came from."""
    try:
        return m.schema.from_dict(m.ours)
    except ConfigError as exc:
        message = str(exc)
    found = [(match.start(), ours) for ours in m.source if (match := _mention(ours, message))]
    if not found:
        raise ConfigError(message) from None
    ours = min(found)[1]
    ds_key = m.source[ours]
    applied = [note for other, note in m.defaults.items() if other != ours and _mention(other.split(".")[-1], message)]
    tail = f" (DeepSpeed's default {', '.join(applied)} applies)" if applied else ""
    if ds_key in m.ds or ds_key in m.auto:
        said = f"{m.name(ds_key)} = {_shown(m.ds.get(ds_key, 'auto'))}"
        raise ConfigError(message + tail if message.startswith(said) else f"{said}: {message}{tail}") from None
    raise ConfigError(f"DeepSpeed's default {m.defaults.get(ours, ds_key)}: {message}{tail}") from None


def _mention(name: str, message: str) -> re.Match | None:
    """Where ``name`` occurs in ``message`` as a whole key (not inside a longer one)."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message)


def _resolved_autos(m: _Mapping, config: Any) -> list[str]:
    """``"auto"`` keys grouped by the key of ours they set, with the value it holds now."""
    by_target: dict[str, list[str]] = {}
    for key in sorted(m.auto):
        if key in TARGETS:
            by_target.setdefault(TARGETS[key], []).append(m.name(key))
    out = []
    for target, keys in by_target.items():
        value = reduce(getattr, target.split("."), config)
        out.append(f"{', '.join(keys)} -> {target} = {_size(value) if target in SIZES else repr(value)}")
    return out


def _warn(m: _Mapping, config: Any) -> None:
    mapped = set(DIRECT) | set(ELEMENTS) | SPECIAL
    keys = [k for k in m.written if k not in mapped and not (k in m.auto and k in TARGETS)]
    off = _switched_off(m, keys)
    keys = [k for k in keys if k not in off]
    not_needed = sorted({m.name(k) for k in keys if k in NOT_NEEDED} | set(off.values())) + m.unused
    unsupported = m.ignored + sorted(_unsupported(m.name(k), mapped | NOT_NEEDED) for k in keys if k not in NOT_NEEDED)
    autos = _resolved_autos(m, config)
    parts = [f"{title} ({len(items)}): {', '.join(items)}" for title, items in (
        ("not supported, ignored", unsupported), ("approximated", m.approximated),
        ('"auto" (no Hugging Face Trainer fills it in: the default applies)',
         autos), ("accepted but not needed by zerooffload", not_needed)) if items]
    if parts:
        warnings.warn("DeepSpeed config keys " + "; ".join(parts), DeepSpeedConfigWarning, stacklevel=4)
    if m.defaults:
        logger.info("DeepSpeed config: DeepSpeed's defaults applied for %s", ", ".join(m.defaults.values()))


def _shown(value: Any) -> str:
    """A value as the user would write it: ``1e9`` read from JSON shows as 1000000000, not 1000000000.0."""
    return repr(int(value)) if isinstance(value, float) and value.is_integer() else repr(value)


def _size(nbytes: int) -> str:
    """Bytes in the unit that divides them: "32MiB", "400MB", else the integer."""
    binary = format_size(nbytes)
    if isinstance(binary, str) and not binary.endswith("KiB"):
        return binary
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(binary)


def _switched_off(m: _Mapping, keys: list[str]) -> dict[str, str]:
    """Keys that ask for nothing, each with how the warning lists it: a switch DeepSpeed leaves off, set
    to false, under its own name; every key of a section whose ``enabled`` is false, as the section."""
    sections = {k[:-len("enabled")]: f"{m.name(k)[:-len('.enabled')]} (enabled: false)"
                for k in m.ds if k.endswith(".enabled") and m.ds[k] is False}
    off = {k: m.name(k) for k in keys if k in OFF_BY_DEFAULT and m.ds.get(k) is False}
    for key in keys:
        shown = next((name for prefix, name in sections.items() if key.startswith(prefix)), None)
        if shown is not None:
            off[key] = shown
    return off


def _unsupported(key: str, known: set[str]) -> str:
    """An ignored key with what to use instead: zerooffload's own way, or the known key it nearly is."""
    instead = next((text for prefix, text in INSTEAD.items() if key.startswith(prefix)), None)
    if instead:
        return f"{key} ({instead})"
    hint = difflib.get_close_matches(key, known, n=1, cutoff=0.9)
    return f"{key} (did you mean {hint[0]}?)" if hint else key
