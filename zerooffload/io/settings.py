"""What the I/O layer is told: five plain values, so it depends on nothing above it.

``config.AioConfig`` (the ``[aio]`` section users write) has exactly these fields and defaults, plus
``blocks_in_flight``, which the block pipelines above this layer read (``block_stream``), and is passed
as it is; a test ties the two. ``IOSettings()`` is what an ``AsyncIO()`` made without one uses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["IOSettings", "Settings"]


class Settings(Protocol):
    """Anything with the five fields (an ``IOSettings``, or the config's ``aio`` section)."""

    backend: str
    block_size: int
    queue_depth: int
    threads: int
    direct: bool


@dataclass(frozen=True, slots=True)
class IOSettings:
    backend: str = "auto"
    """``auto``: io_uring, else the native thread pool, else Python threads; or ``uring``, ``pool``,
    ``python``, ``aiofiles``."""
    block_size: int = 1 << 20
    """Bytes per request piece (a multiple of ``buffers.ALIGNMENT``)."""
    queue_depth: int = 32
    """Request pieces in flight per engine."""
    threads: int = 4
    """Worker threads of the pool, python and aiofiles backends."""
    direct: bool = True
    """O_DIRECT: bypass the page cache."""
