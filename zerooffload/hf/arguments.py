"""A zerooffload config for a Trainer run: ``"auto"`` filled from TrainingArguments, conflicts refused.

[Note: who decides what]
The Trainer runs the loop (its data loader sizes the micro-batches, it counts the accumulation, logs
and schedules), so where the config and ``TrainingArguments`` both speak they must agree, as
transformers requires of a DeepSpeed JSON. Each row of ``ARGUMENT_KEYS`` is one value both can hold:
in the config it may be a number, ``"auto"`` or absent; ``"auto"`` and absent both take the argument's
value (DeepSpeed would put its own default where a key is absent, which the Trainer's loop would then
contradict), and any other value must equal the argument's or the run is refused, every disagreement
named in one error. A DeepSpeed JSON without an ``optimizer`` gets the Trainer's AdamW (its
``args.optim`` must name an AdamW); one with a ``scheduler`` keeps it, its warmup and total steps
filled from the arguments (``warmup_steps``, the run's ``max_steps``), and then the Trainer's
``lr_scheduler_type`` is not used; without one, the Trainer's own schedule drives the engine's
learning rate. The engine never schedules: the Trainer steps whichever schedule applies.
"""
from __future__ import annotations

import copy
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import Config, ConfigError, SchedulerConfig, read_config_file
from ..config.deepspeed import is_deepspeed

__all__ = ["ARGUMENT_KEYS", "TrainerConfig", "refuse_arguments", "resolve"]

logger = logging.getLogger(__name__)

Args = Any
"""transformers.TrainingArguments (not imported: this module loads without transformers)."""


@dataclass(frozen=True)
class ArgumentKey:
    """One value the config and the arguments can both hold: its path in our format and in DeepSpeed's,
    the argument(s) it comes from, and how to read it from them."""
    ours: str
    deepspeed: str
    argument: str
    value: Callable[[Args], Any]


def _precision(args: Args) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


ARGUMENT_KEYS = (
    ArgumentKey("train.micro_batch_size", "train_micro_batch_size_per_gpu", "per_device_train_batch_size",
                lambda a: a.per_device_train_batch_size),
    ArgumentKey("train.grad_accum_steps", "gradient_accumulation_steps", "gradient_accumulation_steps",
                lambda a: a.gradient_accumulation_steps),
    ArgumentKey("train.grad_clip", "gradient_clipping", "max_grad_norm", lambda a: float(a.max_grad_norm or 0.0)),
    ArgumentKey("train.precision", "bf16.enabled", "bf16", lambda a: _precision(a)),
    ArgumentKey("train.precision", "fp16.enabled", "fp16", lambda a: _precision(a)),
    ArgumentKey("optimizer.lr", "optimizer.params.lr", "learning_rate", lambda a: a.learning_rate),
    ArgumentKey("optimizer.betas", "optimizer.params.betas", "adam_beta1, adam_beta2",
                lambda a: [a.adam_beta1, a.adam_beta2]),
    ArgumentKey("optimizer.eps", "optimizer.params.eps", "adam_epsilon", lambda a: a.adam_epsilon),
    ArgumentKey("optimizer.weight_decay", "optimizer.params.weight_decay", "weight_decay", lambda a: a.weight_decay),
)
"""The values both sides can hold (see [Note: who decides what])."""

SCHEDULE_KEYS = (
    ("scheduler.warmup_steps", "scheduler.params.warmup_num_steps", "warmup_steps",
     lambda a, steps: a.get_warmup_steps(steps)),
    ("scheduler.total_steps", "scheduler.params.total_num_steps", "max_steps", lambda a, steps: steps),
    ("optimizer.lr", "scheduler.params.warmup_max_lr", "learning_rate", lambda a, steps: a.learning_rate),
    ("scheduler.min_lr", "scheduler.params.warmup_min_lr", "(0: the Trainer's schedules start at 0)",
     lambda a, steps: 0.0),
)
"""A config's own schedule: filled at ``train()``, when the run's ``max_steps`` is known."""

ADAMW_OPTIMS = frozenset({"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused", "adamw_torch_xla",
                          "adamw_torch_npu_fused"})
"""``args.optim`` values that are plain AdamW: the engine's ``optimizer.type = "adamw"`` computes them."""

REFUSED_ARGUMENTS = (
    ("deepspeed", lambda a: a.deepspeed, "pass the DeepSpeed JSON as zerooffload= instead: one engine trains the model"),
    ("fsdp", lambda a: a.fsdp, "zerooffload shards the model itself; drop fsdp"),
    ("activation_checkpointing", lambda a: a.activation_checkpointing or a.gradient_checkpointing,
     "set train.activation_checkpointing = true in the zerooffload config instead: the engine recomputes whole "
     "units, fetching their parameters again"),
    ("torch_compile", lambda a: a.torch_compile, "the engine's hooks run eagerly; drop torch_compile"),
)
"""Arguments that would put a second engine under or around ours."""


@dataclass(frozen=True)
class TrainerConfig:
    """The engine's config (no schedule: the Trainer steps it) and the raw config it came from."""
    engine: Config
    data: dict
    deepspeed: bool

    @property
    def has_schedule(self) -> bool:
        """The config brings its own learning-rate schedule (else the Trainer's lr_scheduler_type drives)."""
        return "scheduler" in self.data

    def schedule(self, args: Args, max_steps: int) -> SchedulerConfig:
        """The config's schedule with its warmup and total steps filled for a run of ``max_steps``."""
        data = copy.deepcopy(self.data)
        _fill(data, [(ours, ds, arg, lambda a, f=f: f(a, max_steps)) for ours, ds, arg, f in SCHEDULE_KEYS],
              args, self.deepspeed)
        with warnings.catch_warnings():  # said once, when the config was first read
            warnings.simplefilter("ignore")
            return Config.load(data, world_size=args.world_size).scheduler


def resolve(source: Config | dict | str | os.PathLike, args: Args) -> TrainerConfig:
    """The config ``zerooffload=`` names, filled from and checked against ``args``; ConfigError lists
    every disagreement, and refused arguments are named with what to do instead."""
    refuse_arguments(args)
    data = _raw(source)
    deepspeed = is_deepspeed(data)
    keys = [(k.ours, k.deepspeed, k.argument, k.value) for k in ARGUMENT_KEYS]
    if deepspeed:
        keys.append((None, "train_batch_size", "per_device_train_batch_size × gradient_accumulation_steps × "
                     "world size", lambda a: a.per_device_train_batch_size * a.gradient_accumulation_steps
                     * a.world_size))
    if _get(data, "optimizer.type") is None:
        _put(data, "optimizer.type", _adamw(args) if deepspeed else _adamw(args).lower())
    _fill(data, keys, args, deepspeed)
    sized_by_us = _drop_autos(data)
    if sized_by_us:
        logger.info("zerooffload sizes these itself (\"auto\" left to its defaults): %s", ", ".join(sized_by_us))
    engine_data = {k: v for k, v in data.items() if k != "scheduler"}
    return TrainerConfig(Config.load(engine_data, world_size=args.world_size), data, deepspeed)


def refuse_arguments(args: Args) -> None:
    """ConfigError naming every argument that would put a second engine under or around ours."""
    refused = [f"TrainingArguments.{name} is set: {fix}" for name, is_set, fix in REFUSED_ARGUMENTS if is_set(args)]
    if refused:
        raise ConfigError("; ".join(refused))


def _raw(source: Config | dict | str | os.PathLike) -> dict:
    if isinstance(source, Config):
        return source.to_dict()
    if isinstance(source, (str, os.PathLike)):
        return read_config_file(Path(source))
    if isinstance(source, dict):
        return copy.deepcopy(source)
    raise ConfigError(f"zerooffload = {source!r}: expected a config path, a dict or a zerooffload.Config")


def _adamw(args: Args) -> str:
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in ADAMW_OPTIMS:
        raise ConfigError(f"TrainingArguments.optim = {optim!r}: the config has no optimizer, and zerooffload's are "
                          "AdamW, Adam and SGD (optimizer.type); use an AdamW optim, or name the optimizer in the config")
    return "AdamW"


def _fill(data: dict, keys: list[tuple], args: Args, deepspeed: bool) -> None:
    """Put each argument's value where the config says "auto" or nothing; refuse every disagreement."""
    disagreements = []
    for ours, ds, argument, value_of in keys:
        path = ds if deepspeed else ours
        if path is None or (path.startswith("scheduler.") and "scheduler" not in data):
            continue
        wanted = value_of(args)
        if deepspeed and path.endswith(("bf16.enabled", "fp16.enabled")):
            wanted = wanted == path.split(".")[0]
        present = _get(data, path)
        if present is None or present == "auto":
            _put(data, path, wanted)
        elif not _same(present, wanted):
            disagreements.append(f"{path} = {present!r} but TrainingArguments {argument} = {wanted!r}")
    if disagreements:
        raise ConfigError("the zerooffload config and TrainingArguments disagree: " + "; ".join(disagreements)
                          + ' (make them equal, or write "auto" in the config to take the argument\'s value)')


def _same(present: Any, wanted: Any) -> bool:
    if isinstance(wanted, list):
        return isinstance(present, (list, tuple)) and len(present) == len(wanted) and all(
            _same(p, w) for p, w in zip(present, wanted))
    if isinstance(wanted, bool) or isinstance(wanted, str):
        return present == wanted
    return isinstance(present, (int, float)) and not isinstance(present, bool) and float(present) == float(wanted)


def _has(data: dict, path: str, deepspeed: bool) -> bool:
    return _get(data, path) is not None


def _get(data: dict, path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _put(data: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _drop_autos(data: dict, prefix: str = "") -> list[str]:
    """Remove the ``"auto"`` values no argument fills (bucket, prefetch and persistence sizes, which
    transformers derives from the model for DeepSpeed's buffers and zerooffload sizes for its own);
    returns their paths. The scheduler's stay: they are filled when ``train()`` knows its steps."""
    dropped = []
    for key, value in list(data.items()):
        path = f"{prefix}{key}"
        if value == "auto" and not path.startswith("scheduler."):
            del data[key]
            dropped.append(path)
        elif isinstance(value, dict):
            dropped += _drop_autos(value, path + ".")
    return dropped
