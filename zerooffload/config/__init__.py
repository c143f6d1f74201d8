"""Typed configuration, validated once and read by every layer, which it imports none of (DESIGN §3).

- ``values``: byte sizes, compute dtypes, ``ConfigError``;
- ``fields``: the machinery of sections (fields with docs and bounds, conversion, checks);
- ``sections``: one frozen dataclass per component (``[train]``, ``[zero]``, ``[offload.param]`` ...);
- ``root``: ``Config``, the whole of a run's config, read from TOML or JSON, overridden, written;
- ``deepspeed``, ``deepspeed_keys``: DeepSpeed's JSON read into ours.
"""
from .deepspeed import DeepSpeedConfigWarning
from .fields import ALIGNMENT
from .root import Config, apply_override, read_config_file
from .sections import (AioConfig, MemoryConfig, NvmeConfig, OffloadActivationsConfig, OffloadConfig,
                       OffloadOptimizerConfig, OffloadParamConfig, OptimizerConfig, SchedulerConfig, TrainConfig,
                       ZeroConfig)
from .values import ConfigError, dtype_bytes, format_size, parse_size

__all__ = ["ALIGNMENT", "AioConfig", "Config", "ConfigError", "DeepSpeedConfigWarning", "MemoryConfig", "NvmeConfig",
           "OffloadActivationsConfig", "OffloadConfig", "OffloadOptimizerConfig", "OffloadParamConfig",
           "OptimizerConfig", "SchedulerConfig", "TrainConfig", "ZeroConfig", "apply_override", "dtype_bytes",
           "format_size", "parse_size", "read_config_file"]
