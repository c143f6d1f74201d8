"""A tier's engine buffers, kept when freed and handed out again for the next request of their size.

[Note: buffer arena]
The engine's temporaries (``Kind.BUFFER``: a unit's full gradient in backward, shard staging for
NVMe reads, publication's all-gather inputs, reduction buckets) come and go once per unit per pass,
in a handful of sizes that repeat every step. Given back to the C library each time (host_allocator's
[Note: RSS that follows the accounting]), every one would be a fresh mapping whose pages the kernel
faults in and zeroes again: on a stage 3 NVMe MLP that was ~1 s of system time per step for 24 units.
Kept here instead, by (element count, dtype), the next request of the same size takes a buffer whose
pages are already there: a pass allocates once per buffer alive at a time and reuses from then on
(ZeRO-R's memory defragmentation: long-lived buffers preallocated, constant in size whatever the
model's depth). The tier counts what the arena keeps idle in its peak, so ``memory_report`` shows
memory the process really holds, and lets it go (``clear``) when a request would pass the tier's budget
and at the end of each backward and step (and of the step's updates that run beside the next forward),
so one phase's sizes never pile up beside another's.
Only buffers this arena lent are kept (a tensor freed here is the whole allocation it handed out); CUDA
memory is left to torch's caching allocator, which already does this, stream by stream.
"""
from __future__ import annotations

import torch

__all__ = ["BufferArena"]


class BufferArena:
    """Idle buffers by (numel, dtype); see the note."""

    def __init__(self):
        self._idle: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._lent: set[int] = set()
        """``id`` of each buffer lent and not given back."""
        self.idle_bytes = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """An idle buffer of exactly ``numel`` ``dtype`` elements, now lent; None when there is none."""
        idle = self._idle.get((numel, dtype))
        if not idle:
            return None
        buffer = idle.pop()
        self.idle_bytes -= numel * dtype.itemsize
        self._lent.add(id(buffer))
        return buffer

    def lend(self, buffer: torch.Tensor) -> None:
        """Record a freshly allocated buffer as lent, so that it is kept once given back."""
        self._lent.add(id(buffer))

    def give_back(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` for the next request of its size, if this arena lent it (the caller drops it)."""
        if id(buffer) not in self._lent:
            return
        self._lent.discard(id(buffer))
        self._idle.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)
        self.idle_bytes += buffer.numel() * buffer.element_size()

    def clear(self) -> None:
        """Let every idle buffer go (its memory returns to the OS once unreferenced)."""
        self._idle.clear()
        self.idle_bytes = 0
