"""Verified swap reads: what a swap entry's digests cover, the error a damaged one raises, the handles.

[Note: swap digests]
- With ``checksum`` (``nvme.checksum``, on by default) every entry keeps one digest per *segment*
  (``checksum``'s [Note: CRC32C digests]): the writer names the segment size, so that each part read
  on its own (an optimizer block's master, read alone as a stage-3 shard) is verified alone; an
  entry is one segment otherwise. A read that comes back different, or short (a truncated file), is
  ``SwapDamage``: the swap file, the block, the offset, and what to do.
- A digest covers one *chunk*: a segment is cut every ``CHUNK`` bytes. Digests are taken off the
  caller's thread while the transfer runs: a write's by the store's *digest* thread as its bytes go to
  disk, a read's by its *verify* thread chunk by chunk as the chunks land (two threads, so a write's
  digest never queues behind a read still in flight). The handle's ``wait`` returns when the transfer
  and its digests are done, so a caller never reuses a buffer under a digest nor uses data before it is
  verified, and a read waits for the last chunk's digest only: on a step bound by the disk the digests
  cost next to no time (a whole-block digest after the read cost the NVMe step ~10%).
"""
from __future__ import annotations

import errno
from concurrent.futures import Future
from typing import Any

from .aio import AioError, Handle
from .checksum import digest

__all__ = ["CHUNK", "SwapDamage", "SwapHandle", "chunk_spans", "take_digests"]

CHUNK = 4 << 20
"""Most bytes one digest covers (see the note): small enough that the last chunk's digest, the one a
read waits for, takes a fraction of a millisecond; large enough that requests stay large."""


class SwapDamage(AioError):
    """A swap entry read back is not what this store wrote: its digest differs, or the file ended
    before it (truncated). ``key`` names the block, ``filename`` and ``offset`` where its bytes lie."""

    advice_included = True
    """Its message says what to do too: the command line prints it as it is."""

    def __init__(self, key: str, problem: str, filename: str, offset: int, length: int):
        super().__init__(errno.EIO, problem, filename, op="read", offset=offset, length=length)
        self.key = key

    def __str__(self) -> str:
        return (f"swap block {self.key!r} is damaged: {self.strerror} ({self.length} bytes at offset {self.offset} "
                f"of {self.filename}); something other than this run changed the swap file (another process, a "
                "full or failing disk), so the run stops rather than train on it: keep other writers out of "
                "nvme.path and resume from the last checkpoint")


def chunk_spans(nbytes: int, segment: int) -> tuple[tuple[int, int], ...]:
    """``(start, length)`` of the chunks an entry's digests cover: each segment cut every ``CHUNK`` bytes."""
    return tuple((start + offset, min(CHUNK, min(segment, nbytes - start) - offset))
                 for start in range(0, nbytes, segment) for offset in range(0, min(segment, nbytes - start), CHUNK))


class SwapHandle:
    """Completion of one store read or write: the handles of its pieces, then its digests (``digests``,
    a Future), which ``on_done`` checks; ``on_error`` may restate a transfer's error."""

    def __init__(self, handles: list[Handle], digests: Future | None = None, on_done: Any = None,
                 on_error: Any = None):
        self._handles = handles
        self._digests = digests
        self._on_done = on_done
        self._on_error = on_error
        self._failure: OSError | None = None

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def wait(self, timeout: float | None = None) -> int:
        """Bytes moved; raises the first piece's error after waiting for all of them (``on_error`` may
        restate it: ``SwapStore._damage``)."""
        errors, total = [], 0
        for handle in self._handles:
            try:
                total += handle.wait(timeout)
            except OSError as exc:
                errors.append(exc)
        if errors:
            if self._on_error is not None:
                self._failure = self._on_error(errors[0]) or errors[0]
                self._on_error = None
            raise self._failure or errors[0]
        digests = None if self._digests is None else self._digests.result(timeout)
        if self._on_done is not None:
            self._on_done(digests)
            self._on_done = None
        return total


def take_digests(view: Any, chunks: tuple[tuple[int, int], ...], landed: list[list[Handle]] | None = None
             ) -> tuple[int, ...] | None:
    """The digest of each chunk of ``view``; with ``landed``, each chunk's once its transfers end (None
    when one failed: its handle reports that)."""
    digests = []
    for number, (start, length) in enumerate(chunks):
        for handle in landed[number] if landed else ():
            try:
                handle.wait()
            except OSError:
                return None
        digests.append(digest(view[start:start + length]))
    return tuple(digests)
