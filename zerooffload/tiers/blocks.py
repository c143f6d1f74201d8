"""Blocks: buffers whose home is a tier, worked on a piece at a time, and the counters of their moves.

[Note: blocks]
A *block* is a buffer whose home is a tier, for state that is worked on a piece at a time (a unit's
optimizer state, a unit's parameter shard). ``load(buffer)`` makes ``block.data`` valid, ``store()``
writes changes home, ``unload()`` lets the memory go. On a resident tier (device, host) ``data`` is
always the block's own tensor, and the three are no-ops; on the ``nvme`` tier the bytes live in a swap
file and ``data`` is the caller's host buffer while loaded, read and written through the async-I/O
engine. Callers treat every block alike; the tier decides what moving means. A *prefix block* reads
the first elements of another NVMe block (a partitioned unit's fp32 shard inside its optimizer block)
and is never written through.
Blocks are moved a few at a time through bounded host buffers by ``block_stream``'s pipelines.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ..io.swapfile import SwapStore
from ..trace import RECORDER

__all__ = ["ASIDE", "Block", "IOStats", "SwappedBlock", "SwappedPrefix"]


class _Done:
    """A finished move (resident blocks never wait)."""

    def wait(self) -> int:
        return 0


class Block:
    """A resident block: ``data`` is always its own tensor; loading and storing move nothing."""

    resident = True
    writable = True

    def __init__(self, data: torch.Tensor):
        self.data: torch.Tensor | None = data
        self.numel, self.dtype = data.numel(), data.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def load(self, buffer: torch.Tensor | None = None, *, read: bool = True) -> Any:
        """Make ``data`` valid (``read=False``: contents to be overwritten, nothing is read)."""
        return _Done()

    def store(self) -> Any:
        """Write ``data`` home."""
        return _Done()

    def unload(self) -> torch.Tensor | None:
        """Let the memory go; returns the caller's host buffer for reuse (None when resident)."""
        return None

    def copy_out(self, fd: int, offsets: list[int]) -> list[list[tuple[int, int]]] | None:
        """Copy each segment of the block's stored bytes into file ``fd`` at its offset in ``offsets`` in
        the kernel, returning the digests they were written with (``SwapStore.copy_out``); None where it
        cannot (in memory: write ``data``)."""
        return None

    def hold(self) -> None:
        """Keep a version aside (``SwappedBlock.hold``): a block in memory is changed in place, so only an
        empty one (a frozen shard's span) can, having nothing to keep."""
        if self.numel:
            raise TypeError("a block in memory is changed in place: it cannot keep its old version aside")

    def commit(self) -> None:
        """Nothing was kept aside (``hold``)."""

    def discard(self) -> None:
        """Nothing was kept aside (``hold``)."""


@dataclass(slots=True)
class IOStats:
    """What the NVMe tier moved since the last ``reset``: bytes each way and time callers were blocked."""

    read_bytes: int = 0
    """NVMe -> host."""
    write_bytes: int = 0
    """host -> NVMe."""
    wait_seconds: float = 0.0
    """Time spent waiting for reads and writes to finish (I/O not hidden behind compute)."""

    def reset(self) -> None:
        self.read_bytes = self.write_bytes = 0
        self.wait_seconds = 0.0


class _TimedHandle:
    """A swap transfer whose ``wait`` counts the time it blocks toward the tier's ``IOStats``, and
    which an armed trace shows from submission to that wait (trace's [Note: step traces])."""

    def __init__(self, handle: Any, stats: IOStats, track: str, key: str, nbytes: int):
        self.handle, self.stats, self.track, self.key = handle, stats, track, key
        self.trace_id = RECORDER.transfer_started(track, nbytes, key)
        self.nbytes = nbytes

    def wait(self) -> int:
        start = time.perf_counter()
        try:
            return self.handle.wait()
        finally:
            end = time.perf_counter()
            self.stats.wait_seconds += end - start
            if end - start > 1e-4:
                RECORDER.complete(f"wait: {self.track} {self.key}", "waits", start, end, bytes=self.nbytes)
            RECORDER.transfer_done(self.track, self.trace_id, self.key)
            self.trace_id = None


ASIDE = "~aside"
"""Suffix of the swap key under which a held block stores its tentative version."""


class SwappedBlock(Block):
    """A block in the NVMe tier's swap store, paged through a caller's host buffer."""

    resident = False
    prefix = False
    """Whether the block is the first elements of a longer swap entry (``SwappedPrefix``)."""

    def __init__(self, store: SwapStore, key: str, numel: int, dtype: torch.dtype, stats: IOStats, segment: int = 0):
        self.store_, self.key, self.stats = store, key, stats
        self.numel, self.dtype = numel, dtype
        self.segment = segment or self.nbytes
        """Bytes of each part verified on its own (``SwapStore.write``'s ``segment``)."""
        self.data = None
        self._buffer: torch.Tensor | None = None
        self._store_key = key
        """Where ``store`` writes: the block's key, or while stores are held its version aside."""

    def load(self, buffer: torch.Tensor | None = None, *, read: bool = True) -> Any:
        if buffer is None or buffer.numel() * buffer.element_size() < self.nbytes:
            raise ValueError(f"block {self.key!r} needs a host buffer of at least {self.nbytes} bytes")
        self._buffer = buffer
        self.data = buffer.view(torch.uint8)[:self.nbytes].view(self.dtype)
        if not read:
            return _Done()
        self.stats.read_bytes += self.nbytes
        return _TimedHandle(self.store_.read(self.key, self.data, prefix=self.prefix), self.stats, "nvme read",
                            self.key, self.nbytes)

    def store(self) -> Any:
        self.stats.write_bytes += self.nbytes
        return _TimedHandle(self.store_.write(self._store_key, self.data, segment=self.segment), self.stats,
                            "nvme write", self.key, self.nbytes)

    def unload(self) -> torch.Tensor | None:
        buffer, self._buffer, self.data = self._buffer, None, None
        return buffer

    def copy_out(self, fd: int, offsets: list[int]) -> list[list[tuple[int, int]]] | None:
        return None if self.prefix or not self.store_.checksum else self.store_.copy_out(self.key, fd, offsets)

    def hold(self) -> None:
        """Store later versions aside, until ``commit`` makes the last one the block's or ``discard``
        drops it; loads read the block as it was all the while. For an update that may have to be
        redone from the state before it (backward_updates' [Note: tentative updates]); the space aside
        was counted when the block was made (``NvmeTier.block``'s ``aside``)."""
        self.discard()  # a version left aside by a window that failed is no one's
        self._store_key = self.key + ASIDE

    def commit(self) -> None:
        """The version stored aside (if one was) becomes the block's; stores go to the block again. Call
        once no store is in flight."""
        aside, self._store_key = self._store_key, self.key
        if aside != self.key and aside in self.store_:
            self.store_.rename(aside, self.key)

    def discard(self) -> None:
        """Drop the version stored aside (if one was): the block is what it was before ``hold``."""
        aside, self._store_key = self._store_key, self.key
        if aside != self.key and aside in self.store_:
            self.store_.free(aside)


class SwappedPrefix(SwappedBlock):
    """The first ``numel`` elements of another swapped block, read-only: a second way to read part of
    a block that its owner writes (a partitioned unit's fp32 shard inside its optimizer block)."""

    writable = False
    prefix = True

    def store(self) -> Any:
        raise TypeError(f"the first {self.numel} elements of swap block {self.key!r} are written by its owner only")
