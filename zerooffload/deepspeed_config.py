"""Reading DeepSpeed JSON configs: their keys mapped onto ours (DESIGN §2's table).

[Note: DeepSpeed mapping]
- A DeepSpeed config is recognized by ``zero_optimization`` or ``train_micro_batch_size_per_gpu``.
- *Direct* keys copy their value to one of ours; *element* keys count elements and become bytes of the
  compute dtype (2 for bf16/fp16, 4 for fp32); a few keys (precision, optimizer and scheduler types,
  offload devices, batch sizes) need a rule of their own.
- ``"auto"`` (as Hugging Face writes it) resolves to our default for that key.
- Every other key is kept in one of three lists, reported together in one ``DeepSpeedConfigWarning``:
  *not needed* (DeepSpeed tuning knobs our design makes unnecessary), *approximated* (mapped with a
  difference the user should know), *not supported* (ignored). Nothing is dropped silently.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from .config import ConfigError, dtype_bytes

__all__ = ["DeepSpeedConfigWarning", "is_deepspeed", "from_deepspeed"]

logger = logging.getLogger(__name__)


class DeepSpeedConfigWarning(UserWarning):
    """Keys of a DeepSpeed config that zerooffload reads differently or not at all."""


_DIRECT = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "gradient_clipping": "train.grad_clip",
    "fp16.loss_scale": "train.loss_scale",
    "fp16.initial_scale_power": "train.initial_scale_power",
    "fp16.loss_scale_window": "train.loss_scale_window",
    "fp16.hysteresis": "train.hysteresis",
    "fp16.min_loss_scale": "train.min_loss_scale",
    "optimizer.params.lr": "optimizer.lr",
    "optimizer.params.betas": "optimizer.betas",
    "optimizer.params.eps": "optimizer.eps",
    "optimizer.params.weight_decay": "optimizer.weight_decay",
    "optimizer.params.momentum": "optimizer.momentum",
    "scheduler.params.warmup_num_steps": "scheduler.warmup_steps",
    "scheduler.params.total_num_steps": "scheduler.total_steps",
    "scheduler.params.warmup_min_lr": "scheduler.min_lr",
    "scheduler.params.warmup_max_lr": "optimizer.lr",
    "zero_optimization.stage": "zero.stage",
    "zero_optimization.overlap_comm": "zero.overlap_comm",
    "zero_optimization.stage3_param_persistence_threshold": "zero.persist_threshold",
    "zero_optimization.offload_param.nvme_path": "offload.param.path",
    "zero_optimization.offload_optimizer.nvme_path": "offload.optimizer.path",
    "zero_optimization.offload_optimizer.ratio": "offload.optimizer.fraction",
    "aio.block_size": "aio.block_size",
    "aio.queue_depth": "aio.queue_depth",
    "aio.thread_count": "aio.threads",
    "aio.intra_op_parallelism": "aio.threads",
}
_ELEMENTS = {
    "zero_optimization.reduce_bucket_size": "zero.bucket_size",
    "zero_optimization.allgather_bucket_size": "zero.bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size": "zero.prefetch_size",
    "zero_optimization.stage3_max_live_parameters": "zero.max_live_size",
}
_NOT_NEEDED = {
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "fp16.auto_cast", "bf16.immediate_grad_update", "optimizer.params.torch_adam",
    "aio.single_submit", "aio.overlap_events", "aio.use_gds",
    *(f"zero_optimization.{k}" for k in (
        "contiguous_gradients", "sub_group_size", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
        "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save", "elastic_checkpoint",
        "load_from_fp32_weights", "ignore_unused_parameters", "use_multi_rank_bucket_allreduce",
        "memory_efficient_linear", "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory")),
    *(f"zero_optimization.offload_{s}.{k}" for s in ("param", "optimizer") for k in (
        "buffer_count", "buffer_size", "max_in_cpu", "pin_memory", "pipeline", "pipeline_read", "pipeline_write",
        "fast_init")),
}
_OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd"}
_SCHEDULERS = {"warmuplr": "constant", "warmupdecaylr": "warmup_linear", "warmupcosinelr": "warmup_cosine"}
_OFFLOAD_DEVICES = {"none": "device", "cpu": "host", "nvme": "nvme"}
_SPECIAL = {"train_batch_size", "bf16.enabled", "fp16.enabled", "optimizer.type", "optimizer.params.adam_w_mode",
            "scheduler.type", "scheduler.params.warmup_type", "scheduler.params.cos_min_ratio",
            "scheduler.params.warmup_min_ratio", "zero_optimization.offload_param.device",
            "zero_optimization.offload_optimizer.device"}


def is_deepspeed(data: dict) -> bool:
    """True for a DeepSpeed config (our own format has neither of these keys)."""
    return "zero_optimization" in data or "train_micro_batch_size_per_gpu" in data


def _leaves(data: dict, prefix: str = "") -> dict[str, Any]:
    """Flatten nested tables to ``{"a.b.c": value}``."""
    out = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        out.update(_leaves(value, path + ".") if isinstance(value, dict) and value else {path: value})
    return out


def _set(tree: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


class _Mapping:
    """One DeepSpeed config being translated: the flat input, our nested output, and the notes."""

    def __init__(self, data: dict):
        self.ds = {k: v for k, v in _leaves(data).items() if v != "auto"}
        self.auto = sorted(k for k, v in _leaves(data).items() if v == "auto")
        self.ours: dict = {}
        self.approximated: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:
        return self.ds.get(key, default)

    def choice(self, key: str, table: dict, default: str) -> str:
        """Map a DeepSpeed enum value (case-insensitive) or fail naming the key and the choices."""
        value = self.get(key, default)
        mapped = table.get(str(value).lower())
        if mapped is None:
            raise ConfigError(f"{key} = {value!r}: zerooffload supports {', '.join(table)} (DeepSpeed spelling, "
                              "any case)")
        return mapped


def _map_precision(m: _Mapping) -> str:
    bf16, fp16 = bool(m.get("bf16.enabled", False)), bool(m.get("fp16.enabled", False))
    if bf16 and fp16:
        raise ConfigError("bf16.enabled and fp16.enabled are both true: enable at most one")
    precision = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    m.ours.setdefault("train", {})["precision"] = precision
    return precision


def _map_batch(m: _Mapping, world_size: int) -> None:
    """DeepSpeed's rule: train_batch_size = micro × accumulation × world; a missing one is derived."""
    total = m.get("train_batch_size")
    micro, accum = m.get("train_micro_batch_size_per_gpu"), m.get("gradient_accumulation_steps")
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
    m.ours.setdefault("train", {}).update(micro_batch_size=micro, grad_accum_steps=accum)


def _map_optimizer(m: _Mapping) -> None:
    if "optimizer.type" not in m.ds:
        return
    kind = m.choice("optimizer.type", _OPTIMIZERS, "adamw")
    if kind == "adam" and m.get("optimizer.params.adam_w_mode", True):
        kind = "adamw"  # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false
    _set(m.ours, "optimizer.type", kind)


def _map_scheduler(m: _Mapping) -> None:
    if "scheduler.type" not in m.ds:
        return
    _set(m.ours, "scheduler.type", m.choice("scheduler.type", _SCHEDULERS, "warmuplr"))
    if m.get("scheduler.params.warmup_type", "log") != "linear":
        m.approximated.append(f"scheduler.params.warmup_type = {m.get('scheduler.params.warmup_type', 'log')!r} "
                              "(DeepSpeed's default is 'log'; zerooffload warms up linearly)")
    if "scheduler.params.cos_min_ratio" in m.ds or m.ds["scheduler.type"].lower() == "warmupcosinelr":
        lr = m.ours.get("optimizer", {}).get("lr", 1e-3)
        cos_min, warm_min = m.get("scheduler.params.cos_min_ratio", 1e-4), m.get("scheduler.params.warmup_min_ratio", 0)
        _set(m.ours, "scheduler.min_lr", cos_min * lr)
        if warm_min != cos_min:
            m.approximated.append(f"scheduler.params.warmup_min_ratio = {warm_min} (zerooffload warms up from "
                                  f"min_lr = cos_min_ratio × lr = {cos_min * lr:g})")


def _map_offload(m: _Mapping, stage: int) -> list[str]:
    """Offload devices; an offload_param below stage 3 is ignored as DeepSpeed ignores it."""
    ignored = []
    for kind in ("param", "optimizer"):
        key = f"zero_optimization.offload_{kind}.device"
        if key not in m.ds:
            continue
        tier = m.choice(key, _OFFLOAD_DEVICES, "none")
        if kind == "param" and stage < 3 and tier != "device":
            ignored.append(f"{key} = {m.ds[key]!r} (parameters are offloaded only at stage 3)")
            m.ours.get("offload", {}).pop("param", None)
            continue
        _set(m.ours, f"offload.{kind}.tier", tier)
    return ignored


def from_deepspeed(data: dict, *, world_size: int | None = None) -> dict:
    """Our config dict from a DeepSpeed one; warns once about every key not mapped exactly."""
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    m = _Mapping(data)
    for ds_key, our_key in _DIRECT.items():
        if ds_key in m.ds:
            _set(m.ours, our_key, m.ds[ds_key])
    precision = _map_precision(m)
    for ds_key, our_key in _ELEMENTS.items():
        if ds_key in m.ds and not (our_key == "zero.bucket_size" and "bucket_size" in m.ours.get("zero", {})):
            _set(m.ours, our_key, _elements_to_bytes(ds_key, m.ds[ds_key], precision))
    _map_batch(m, world_size)
    _map_optimizer(m)
    _map_scheduler(m)
    unsupported = _map_offload(m, m.ours.get("zero", {}).get("stage", 0))
    mapped = set(_DIRECT) | set(_ELEMENTS) | _SPECIAL
    not_needed = sorted(k for k in m.ds if k in _NOT_NEEDED)
    unsupported += sorted(k for k in m.ds if k not in mapped and k not in _NOT_NEEDED)
    _warn(not_needed, m.approximated, unsupported)
    if m.auto:
        logger.info("DeepSpeed config: 'auto' resolved to zerooffload defaults for %s", ", ".join(m.auto))
    return m.ours


def _elements_to_bytes(key: str, value: Any, precision: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise ConfigError(f"{key} = {value!r}: expected a whole number of elements")
    return int(value) * dtype_bytes(precision)


def _warn(not_needed: list[str], approximated: list[str], unsupported: list[str]) -> None:
    parts = [f"{title} ({len(keys)}): {', '.join(keys)}" for title, keys in (
        ("not supported, ignored", unsupported), ("approximated", approximated),
        ("accepted but not needed by zerooffload", not_needed)) if keys]
    if parts:
        warnings.warn("DeepSpeed config keys " + "; ".join(parts), DeepSpeedConfigWarning, stacklevel=3)
