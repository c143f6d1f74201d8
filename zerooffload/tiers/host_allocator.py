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

[Note: huge pages for engine buffers]
The engine's CPU buffers that torch allocates (a stage-3 unit's gathered parameters, whose storage
comes back at each use, and the tiers' fresh buffers: gradients, reduction buckets) are tens of MiB
and, as mappings of their own, fresh at every use: 4 KiB page faults and zeroing on first touch.
Advised huge pages (io.buffers' [Note: huge pages for I/O buffers]) take one fault per 2 MiB: a 48 MiB
unit's storage restored and filled took 9.0 ms against 27.9 (median of 12 interleaved rounds here).
``advise_fresh`` advises only memory that is surely a mapping of its own (``THRESHOLD`` and more once
fixed, else glibc's largest threshold, 32 MiB), so the advice leaves with the ``munmap`` and never
lingers on heap memory that later small allocations reuse.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import TYPE_CHECKING

from ..io.buffers import HUGE_PAGE, advise_huge_pages

if TYPE_CHECKING:
    import torch

__all__ = ["THRESHOLD", "advise_fresh", "release_freed_memory", "return_free_heap"]

THRESHOLD = 1 << 20
"""Bytes from which every allocation is its own mapping (glibc's default starts at 128 KiB and floats)."""
_M_MMAP_THRESHOLD = -3
"""mallopt's parameter number (malloc.h)."""
_GLIBC_MAX_THRESHOLD = 32 << 20
"""The most glibc's floating threshold reaches on 64-bit: larger requests are always mappings."""
_own_mappings_from = _GLIBC_MAX_THRESHOLD
"""Bytes from which a torch CPU allocation is surely a mapping of its own: ``THRESHOLD`` once fixed."""


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
    fixed = bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD))
    if fixed:
        global _own_mappings_from
        _own_mappings_from = THRESHOLD
    return fixed


def advise_fresh(tensor: torch.Tensor) -> None:
    """Huge pages for ``tensor``, memory torch has just allocated on the CPU and nothing has touched,
    if it is surely a mapping of its own ([Note: huge pages for engine buffers])."""
    if tensor.numel() * tensor.element_size() >= max(_own_mappings_from, 2 * HUGE_PAGE):
        advise_huge_pages(tensor)
