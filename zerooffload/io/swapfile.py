"""NVMe swap store: tensors' bytes kept under keys in per-rank swap files, striped over directories.

[Note: swap store]
- A *store* belongs to one process (one rank of one job); its files, their space and their lifetime are
  ``swap_space``'s ([Note: swap space]).
- An *entry* is the bytes stored under one key: split into one contiguous, 4 KiB-aligned *extent*
  per stripe so that every disk works on every read and write (RAID-0 without a RAID), and verified
  as it is read back (``swap_digests``' [Note: swap digests]).
"""
from __future__ import annotations

import os
import secrets
import socket
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .aio import AioError, AsyncIO, Handle
from .errors import EEOF
from .swap_digests import SwapDamage, SwapHandle, chunk_spans, take_digests
from .swap_space import (ALIGN, Stripe, SwapSpaceError, check_cap, check_free_space, extents, grow,
                         install_signal_cleanup, job_id, live_finalizers, private_dir, remove_stripes, round_up,
                         sweep_stale)

__all__ = ["SwapDamage", "SwapHandle", "SwapSpaceError", "SwapStore", "placed_bytes"]


@dataclass(frozen=True, slots=True)
class _Entry:
    """Where one key's bytes are: ``(stripe, offset, length)`` pieces in order, and the digest of each
    chunk of them (see the note)."""

    nbytes: int
    pieces: tuple[tuple[int, int, int], ...]
    segment: int
    digests: Future | None
    """The digest of each chunk, as the digest thread takes them (None without checksums)."""

    def location(self, start: int) -> tuple[int, int]:
        """The stripe and file offset holding the entry's byte ``start``."""
        for index, offset, length in self.pieces:
            if start < length:
                return index, offset + start
            start -= length
        raise ValueError(f"byte {start} is past the entry's {self.nbytes}")


def _pieces(nbytes: int, stripes: int) -> list[int]:
    """The lengths a block of ``nbytes`` is split into, one per stripe (fewer when it is small)."""
    share = round_up(-(-nbytes // stripes))
    return [min(share, nbytes - start) for start in range(0, nbytes, share)] if nbytes else []


def placed_bytes(nbytes: int, stripes: int = 1) -> int:
    """The swap space a block of ``nbytes`` takes over ``stripes`` files: each piece a whole aligned extent.
    The memory plan counts blocks so, and the store reserves what it counted: a plan short of a page
    would grow the file by a whole ``GROWTH`` step (a 10% larger swap file, measured)."""
    return sum(round_up(length) for length in _pieces(nbytes, stripes))


class SwapStore:
    """Tensors' bytes under keys in this rank's swap files; see [Note: swap store].

    ``reserve`` bytes are checked against free space up front and preallocated, so a run that
    cannot fit fails at start with the numbers instead of with ENOSPC hours later. ``cap``: the most
    bytes the files may take (0: no cap; swap_space's note), checked before every write that grows them.
    """

    def __init__(self, paths: list[str] | str, aio: AsyncIO, *, rank: int = 0, reserve: int = 0,
                 checksum: bool = True, direct: bool = True, cap: int = 0):
        self.aio = aio
        self.checksum = checksum
        self.cap = cap
        dirs = [private_dir(p) for p in ([paths] if isinstance(paths, str) else paths)]
        if not dirs:
            raise ValueError("a swap store needs at least one directory (nvme.path)")
        for directory in dirs:
            sweep_stale(directory)
        check_free_space(dirs, reserve)
        check_cap(round_up(reserve), cap, f"a reservation of {reserve:,} bytes")
        name = f"{socket.gethostname()}.{job_id()}.rank{rank}.{os.getpid()}.{secrets.token_hex(4)}.swap"
        self.stripes: list[Stripe] = []
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._digest_thread = self._verify_thread = None
        if checksum:  # see the note: one thread for writes' digests, one for reads'
            self._digest_thread = ThreadPoolExecutor(1, thread_name_prefix="zerooffload-swap-digest")
            self._verify_thread = ThreadPoolExecutor(1, thread_name_prefix="zerooffload-swap-verify")
        self._finalizer = weakref.finalize(self, remove_stripes, self.stripes)
        live_finalizers.add(self._finalizer)
        install_signal_cleanup()
        try:
            for directory in dirs:
                self.stripes.append(Stripe(directory, name, direct))
            pages, extra = divmod(round_up(reserve) // ALIGN, len(self.stripes))
            for index, stripe in enumerate(self.stripes):  # whole pages, as evenly as they go
                if share := (pages + (index < extra)) * ALIGN:
                    stripe.reserve(share)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ placement
    def _place(self, key: str, nbytes: int) -> tuple[tuple[int, int, int], ...]:
        """Split ``nbytes`` into one aligned extent per stripe (fewer when it is small), the files grown
        to hold them (``grow``: refused past the cap, and then nothing is placed)."""
        pieces = tuple((index, self.stripes[index].allocator.allocate(round_up(length)), length)
                       for index, length in enumerate(_pieces(nbytes, len(self.stripes))))
        try:
            grow(self.stripes, self.cap, f"swap block {key!r} ({nbytes:,} bytes)")
        except BaseException:
            self._release(pieces)
            raise
        return pieces

    def _release(self, pieces: tuple[tuple[int, int, int], ...]) -> None:
        for index, offset, length in pieces:
            self.stripes[index].allocator.release(offset, round_up(length))

    # ------------------------------------------------------------------ public API
    def write(self, key: str, tensor: Any, *, segment: int | None = None) -> SwapHandle:
        """Store ``tensor``'s bytes under ``key`` (replacing what was there); returns at submission.
        ``segment``: bytes per separately verified part (see the note; default: the whole entry).

        A write that fails frees the key: a half-written entry is never read back as valid.
        """
        view = _bytes_view(tensor)
        segment = segment or max(view.nbytes, 1)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None and old.nbytes == view.nbytes:
                pieces = old.pieces  # same size: overwrite in place
            else:
                if old is not None:
                    self._release(old.pieces)
                pieces = self._place(key, view.nbytes)
            handles = self._submit(self.aio.write, view, pieces)
            digests = None if self._digest_thread is None else self._digest_thread.submit(
                take_digests, view, chunk_spans(view.nbytes, segment))
            entry = self._entries[key] = _Entry(view.nbytes, pieces, segment, digests)
        return SwapHandle(handles, digests, on_error=lambda error: self._drop(key, entry))

    def read(self, key: str, tensor: Any, *, prefix: bool = False) -> SwapHandle:
        """Read ``key``'s bytes into ``tensor`` (same byte size; with ``prefix``, its first bytes, as
        many as ``tensor`` holds: whole segments when checksums are on); returns at submission."""
        view = _bytes_view(tensor)
        entry = self._entry(key)
        if entry.nbytes != view.nbytes and not (prefix and view.nbytes <= entry.nbytes):
            raise ValueError(f"swap key {key!r} holds {entry.nbytes} bytes but the destination has {view.nbytes}")
        if entry.digests is not None and view.nbytes % entry.segment and view.nbytes != entry.nbytes:
            raise ValueError(f"swap key {key!r}: reading its first {view.nbytes} bytes would end inside a "
                             f"checksummed segment of {entry.segment} bytes, which cannot then be verified")
        if entry.digests is None:
            return SwapHandle(self._submit(self.aio.read, view, extents(entry.pieces, 0, view.nbytes)),
                              on_error=lambda error: self._damage(key, entry, error))
        chunks = tuple(chunk for chunk in chunk_spans(entry.nbytes, entry.segment) if chunk[0] < view.nbytes)
        landed = [self._submit(self.aio.read, view[start:start + length], extents(entry.pieces, start, length))
                  for start, length in chunks]  # one request per chunk: each is verified as it lands
        return SwapHandle([handle for handles in landed for handle in handles],
                          self._verify_thread.submit(take_digests, view, chunks, landed),
                          on_done=lambda digests: self._verify(key, entry, chunks, digests),
                          on_error=lambda error: self._damage(key, entry, error))

    def _verify(self, key: str, entry: _Entry, chunks: tuple[tuple[int, int], ...], digests: tuple[int, ...]) -> None:
        """Compare the digest of each chunk read with the one taken when it was written."""
        for (start, length), read, written in zip(chunks, digests, entry.digests.result()):
            if read != written:
                stripe, offset = entry.location(start)
                segments = -(-entry.nbytes // entry.segment)
                part = f" (segment {start // entry.segment + 1} of {segments})" if segments > 1 else ""
                raise SwapDamage(key, f"its checksum differs from the one taken when it was written{part}",
                                 str(self.stripes[stripe].path), offset, length)

    def _damage(self, key: str, entry: _Entry, error: OSError) -> OSError:
        """A failed read as the user should see it: a file that ended early is a damaged swap file,
        named with the entry's own bytes in that file (its piece there) and where the file ends."""
        if not isinstance(error, AioError) or error.errno != EEOF:
            return error
        index, offset, length = next(piece for piece in entry.pieces  # one piece per stripe
                                     if str(self.stripes[piece[0]].path) == error.filename)
        end = os.fstat(self.stripes[index].file.fd).st_size  # the read may have stopped past it (at its own start)
        return SwapDamage(key, f"the swap file ends at byte {end}, before the block's end (truncated)",
                          error.filename, offset, length)

    def copy_out(self, key: str, fd: int, offsets: list[int]) -> list[list[tuple[int, int]]]:
        """Copy each segment of ``key``'s bytes into file ``fd`` at its offset in ``offsets``, in the kernel
        (``os.copy_file_range``: they never pass through this process, so nothing checks them on the way),
        and return the digests they were written with, ``(CRC32C, length)`` per chunk of each segment: a
        checkpoint's CRC from what this store wrote, never from bytes nobody verified. Needs ``checksum``;
        the entry must not be written meanwhile."""
        entry = self._entry(key)
        digests = None if entry.digests is None else entry.digests.result()
        if digests is None:
            raise ValueError(f"swap key {key!r} has no digests (nvme.checksum is off): read it to copy it")
        chunks = list(zip(digests, chunk_spans(entry.nbytes, entry.segment), strict=True))
        out = []
        for start, offset in zip(range(0, entry.nbytes, entry.segment), offsets, strict=True):
            length = min(entry.segment, entry.nbytes - start)
            self._copy_range(key, entry, start, length, fd, offset)
            out.append([(digest, n) for digest, (at, n) in chunks if start <= at < start + length])
        return out

    def _copy_range(self, key: str, entry: _Entry, start: int, length: int, fd: int, offset: int) -> None:
        """The entry's bytes ``start`` .. ``start + length`` into ``fd`` at ``offset``, piece by piece."""
        position = 0
        for index, source, size in entry.pieces:
            low, high = max(start, position), min(start + length, position + size)
            done = 0
            while low + done < high:
                moved = os.copy_file_range(self.stripes[index].file.fd, fd, high - low - done,
                                           source + low - position + done, offset + low - start + done)
                if moved == 0:
                    raise SwapDamage(key, "the swap file ends before the block's end (truncated)",
                                     str(self.stripes[index].path), source + low - position + done, high - low - done)
                done += moved
            position += size

    def free(self, key: str) -> None:
        """Forget ``key`` and give its extents back for reuse."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                raise KeyError(f"swap key {key!r} is not stored")
            self._release(entry.pieces)

    def rename(self, source: str, target: str) -> None:
        """Make ``source``'s bytes ``target``'s (its old extents given back) and forget ``source``: the
        commit of a version written aside, which reads of ``target`` did not see until now."""
        with self._lock:
            entry = self._entries.pop(source, None)
            if entry is None:
                raise KeyError(f"swap key {source!r} is not stored")
            old = self._entries.pop(target, None)
            if old is not None:
                self._release(old.pieces)
            self._entries[target] = entry

    def _drop(self, key: str, entry: _Entry) -> None:
        """Free ``key`` if it still names ``entry`` (a later write may have replaced it)."""
        with self._lock:
            if self._entries.get(key) is entry:
                del self._entries[key]
                self._release(entry.pieces)

    def _entry(self, key: str) -> _Entry:
        with self._lock:
            try:
                return self._entries[key]
            except KeyError:
                raise KeyError(f"swap key {key!r} is not stored") from None

    def _submit(self, op: Any, view: Any, pieces: tuple[tuple[int, int, int], ...]) -> list[Handle]:
        handles, start = [], 0
        for index, offset, length in pieces:
            handles.append(op(self.stripes[index].file, view[start:start + length], offset))
            start += length
        return handles

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def nbytes(self, key: str) -> int:
        return self._entry(key).nbytes

    @property
    def stored_bytes(self) -> int:
        """Bytes held under keys (what the tier accounts)."""
        return sum(e.nbytes for e in self._entries.values())

    @property
    def file_bytes(self) -> int:
        """Bytes the swap files span, free extents included."""
        return sum(s.allocator.end for s in self.stripes)

    @property
    def paths(self) -> list[Path]:
        return [s.path for s in self.stripes]

    def close(self) -> None:
        """Remove the swap files and release their locks; safe to call twice."""
        for thread in (self._digest_thread, self._verify_thread):
            if thread is not None:
                thread.shutdown()
        self._finalizer()
        live_finalizers.discard(self._finalizer)
        self._entries = {}

    def __enter__(self) -> "SwapStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bytes_view(tensor: Any) -> Any:
    """A flat uint8 view of a contiguous CPU tensor, sharing its memory."""
    import torch

    if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise TypeError("swap store I/O needs a contiguous CPU torch.Tensor")
    return tensor.view(-1).view(torch.uint8)
