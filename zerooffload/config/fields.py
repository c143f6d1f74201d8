"""The machinery of typed config sections: fields with docs and bounds, conversion, checks, errors.

Typed configuration: one frozen dataclass per component, validated once, read by every layer.

[Note: config vocabulary]
- A *section* is one component's settings (``[train]``, ``[zero]``, ``[offload.param]`` ...). Each is a
  ``@dataclass(kw_only=True, slots=True, frozen=True)`` whose fields carry a doc string and bounds in
  their metadata (see ``_opt``); ``__post_init__`` converts and checks every field, so a section built
  in Python is as validated as one read from a file.
- A *key path* names one field from the top, e.g. ``offload.optimizer.fraction``. Every error is a
  ``ConfigError`` (a ``ValueError``) that names the key path, the bad value and what is allowed.
- A *size* is a byte count: an integer, or a string such as ``"64MiB"``, ``"2GB"``, ``"1.5GiB"``.
  Some sizes also accept ``"auto"``, kept as the string ``"auto"`` and resolved by the component.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from .values import ConfigError, format_size, parse_size

__all__ = ["ALIGNMENT", "Section", "check_bounds", "convert", "describe", "option", "section"]


ALIGNMENT = 4096
"""O_DIRECT alignment of buffers, offsets and lengths on the disks we target."""


def option(default: Any, doc: str, *, min: float | None = None, max: float | None = None,
         below: float | None = None, above: float | None = None, size: bool = False,
         multiple_of: int | None = None) -> Any:
    """A section field: its default, what it means (shown in errors and docs/configuration-reference.md,
    which ``python docs/generate.py`` writes from it), and its bounds.

    ``min``/``max`` are inclusive, ``above``/``below`` exclusive; ``size`` marks a byte count.
    """
    meta = {"doc": doc, "min": min, "max": max, "above": above, "below": below, "size": size,
            "multiple_of": multiple_of}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def describe(hint: Any) -> str:
    """What a type hint allows, in words for error messages."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin in (list, tuple):
        count = f"{len(args)} items" if origin is tuple else "items"
        return f"a list of {count}, each {describe(args[0])}"
    if hint is type(None):
        return "unset"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]


def convert(value: Any, hint: Any, key: str) -> Any:
    """``value`` as ``hint`` (bool, int, float, str, Literal, list, tuple, Optional, unions of these)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        for arm in args:
            try:
                return convert(value, arm, key)
            except ConfigError:
                continue
    elif origin is Literal:
        if value in args and not isinstance(value, bool):
            return value
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)) and (origin is list or len(value) == len(args)):
            items = args if origin is tuple else [args[0]] * len(value)
            return origin(convert(v, h, f"{key}[{i}]") for i, (v, h) in enumerate(zip(value, items)))
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
    raise ConfigError(f"{key} = {value!r}: expected {describe(hint)}")


def check_bounds(value: Any, meta: dict, key: str) -> None:
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


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """A section's field types, resolved once per class: resolving them parses every annotation string
    anew, and a plan search loads hundreds of configs (most of its time, uncached)."""
    return get_type_hints(cls)


class Section:
    """Shared behaviour of the section dataclasses: convert and check each field after __init__."""

    __slots__ = ()
    PATH = ""

    def __post_init__(self) -> None:
        hints = _type_hints(type(self))
        for f in fields(self):
            key = f"{self.PATH}.{f.name}"
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                continue
            if f.metadata["size"] and not (isinstance(value, str) and value == "auto"):
                value = parse_size(value, key)
            value = convert(value, hints[f.name], key)
            check_bounds(value, f.metadata, key)
            object.__setattr__(self, f.name, value)
        self.check()

    def check(self) -> None:
        """Checks across the fields of one section; sections override it."""

    @classmethod
    def from_dict(cls, data: Any, path: str | None = None) -> "Section":
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
            nested = _type_hints(cls)[key]
            if dataclasses.is_dataclass(nested):
                value = nested.from_dict(value, f"{path}.{key}" if path else key)
            kwargs[key] = value
        return cls(**kwargs)

    def to_dict(self, *, readable_sizes: bool = False) -> dict:
        """Plain values (tuples as lists) for JSON and TOML; sizes as "64MiB" with ``readable_sizes``."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Section):
                value = value.to_dict(readable_sizes=readable_sizes)
            elif isinstance(value, tuple):
                value = list(value)
            elif readable_sizes and f.metadata["size"] and isinstance(value, int):
                value = format_size(value)
            out[f.name] = value
        return out


def section(cls):
    return dataclass(kw_only=True, slots=True, frozen=True)(cls)
