"""The config's vocabulary of values: byte sizes, compute dtypes, and the error a bad value raises.

Its own module so that the sections and the DeepSpeed reader (which translates into them) share them
without importing each other.
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["ConfigError", "parse_size", "format_size", "dtype_bytes"]


class ConfigError(ValueError):
    """A configuration value is missing, misspelt, of the wrong type or out of range."""


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_SIZE_HELP = 'a byte count: an integer or a string like "4096", "64MiB", "2GB", "1.5GiB"'


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from an integer, an integral float (DeepSpeed writes ``5e8``) or a string with a unit."""
    if isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: expected {_SIZE_HELP}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return value
    match = _SIZE_RE.match(value) if isinstance(value, str) else None
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if unit is None:
        raise ConfigError(f"{key} = {value!r}: expected {_SIZE_HELP} (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    number = float(match.group(1)) * unit
    if not number.is_integer():
        raise ConfigError(f"{key} = {value!r}: is not a whole number of bytes")
    return int(number)


def format_size(nbytes: int) -> str | int:
    """The shortest exact spelling of a byte count: ``"64MiB"`` when a binary unit divides it."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit.lower()]
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return nbytes


def dtype_bytes(precision: str) -> int:
    """Bytes per element of the compute dtype named by ``train.precision``."""
    return 4 if precision == "fp32" else 2
