"""zerooffload: ZeRO sharded data-parallel training with a CPU/NVMe offload engine.

The public names are listed in ``__all__``; docs/python-api.md describes their contract. They load on first
use (PEP 562), so ``import zerooffload.io`` or ``zerooffload.config`` brings in only those layers,
never the engine.
"""
import importlib

from .threads import choose_openmp_wait

choose_openmp_wait()  # before anything loads torch: libgomp reads its settings once (threads' note)

__version__ = "0.1.0"

_PUBLIC = {
    "CheckpointError": "checkpoint", "Config": "config", "ConfigError": "config",
    "DeepSpeedConfigWarning": "config", "Engine": "engine", "initialize": "initialization",
    "init_context": "lazy_init", "load_safetensors": "pretrained", "plan": "planning", "Prediction": "telemetry",
    "SkipStreakError": "errors",
}
"""Each public name and the module that defines it."""

__all__ = [*_PUBLIC, "checkpoint", "__version__"]


def __getattr__(name: str):
    if name == "checkpoint":
        return importlib.import_module(".checkpoint", __name__)
    if name not in _PUBLIC:
        raise AttributeError(f"module 'zerooffload' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC, "checkpoint"])
