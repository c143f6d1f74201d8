"""Freed host memory goes back to the OS at once: glibc's mmap threshold, fixed.

[Note: RSS that follows the accounting]
glibc serves a request below its *mmap threshold* from heap arenas (one per thread that allocates),
and raises the threshold, up to 32 MiB, each time a mapped chunk is freed. So the engine's buffers of a
few MiB that live for a unit's turn and are freed again (gathered parameters, reduction and staging
buffers, activations) soon churn through those arenas, which fragment and are given back to the OS
only from their top: on a stage 3 NVMe run of a deep MLP (2048² units) the process's peak RSS measured
2.5x the engine's own report with 24 units and 5.7x with 96, growing step after step, while
``malloc_trim`` brought it back to a fifth. Fixed at ``THRESHOLD`` with ``mallopt(M_MMAP_THRESHOLD)``,
which also stops glibc moving it, every buffer that large has a mapping of its own, returned when
freed: RSS then follows what the engine holds (``memory_report``), whatever the depth or the step
(``bench/rss_depth.py``). The cost is the kernel's page faults on each fresh buffer (about 1 ms per 8
MiB): small beside an NVMe step, but on CPU-only training every activation of 1 MiB or more is a fresh
mapping too, which made the nano GPT's ``zerooffload train`` ~25% slower here. So
``memory.release_freed = auto`` (the default) fixes it where state lives on NVMe, the runs whose RAM
decides what fits; ``on`` and ``off`` decide for any run. On a C library other than glibc there is
nothing to set.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["THRESHOLD", "release_freed_memory", "return_free_heap"]

THRESHOLD = 1 << 20
"""Bytes from which every allocation is its own mapping (glibc's default starts at 128 KiB and floats)."""
_M_MMAP_THRESHOLD = -3
"""mallopt's parameter number (malloc.h)."""


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def return_free_heap() -> None:
    """Give the heap's free pages back to the OS now (``malloc_trim``; nothing off glibc): after a burst
    of small allocations freed at once, which glibc would otherwise keep: initialize's meta forward and
    unit-by-unit initialization left 8-34 MB so for the small GPT (whose model states are 174 MB), the
    amount varying run to run; after the trim, 11 MB above the states, every run."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def release_freed_memory() -> bool:
    """Fix the mmap threshold at ``THRESHOLD`` for this process (once); False where the C library is
    not glibc (nothing changed)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD))
