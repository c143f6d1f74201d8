"""NVMe swap store: tensors' bytes kept under keys in per-rank swap files, striped over directories.

[Note: swap store]
- A *store* belongs to one process (one rank of one job). In each configured directory it owns one
  *stripe*: a swap file inside the private directory ``<dir>/zerooffload-swap`` (mode 0700), named
  ``<host>.<job>.rank<rank>.<pid>.<token>.swap``, created 0600 and held under an exclusive ``flock``.
  The random token keeps names apart where host, job and pid repeat: containers with the same
  hostname each have a pid 1.
- An *entry* is the bytes stored under one key: split into one contiguous, 4 KiB-aligned *extent*
  per stripe so that every disk works on every read and write (RAID-0 without a RAID).
- Each stripe's space is handed out by an *extent allocator*: first fit from a sorted free list,
  neighbours merged on free, the file grown at its end when nothing fits.
- *Stale* files are those whose flock nobody holds: the kernel drops a lock when its process dies,
  even by SIGKILL, so a store removes them when it opens. A directory lock file serializes that
  sweep with creating and locking new files, so a sweep never takes a file being born.
- Every store's files are removed on ``close()``, when the store is garbage-collected and at interpreter
  exit (a ``weakref.finalize`` covers those two), and on a SIGTERM/SIGINT that kills the process (its
  disposition was SIG_DFL). A signal the process survives (a handler of the user's, SIG_IGN, Python's
  KeyboardInterrupt) leaves the files alone: the run goes on using them.
- Files grow ahead of their extents in ``GROWTH`` steps with ``posix_fallocate``: writes that extend a
  file are serialized by ext4 and ran at half speed with io_uring at queue depth 32.
- With ``checksum`` (``nvme.checksum``, on by default) every entry keeps one digest per *segment*
  (``checksum``'s [Note: swap checksums]): the writer names the segment size, so that each part read
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

import bisect
import errno
import fcntl
import logging
import os
import secrets
import shutil
import signal
import socket
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .aio import AioError, AsyncIO, Handle, open_file
from .checksum import digest
from .errors import EEOF

__all__ = ["SwapDamage", "SwapStore", "SwapSpaceError", "SwapHandle", "job_id"]

logger = logging.getLogger(__name__)

ALIGN = 4096
"""Extent granularity: O_DIRECT needs offsets and lengths in 4 KiB multiples."""
GROWTH = 64 << 20
"""Bytes a swap file is preallocated by when an extent passes its end."""
PRIVATE_DIR = "zerooffload-swap"
CHUNK = 4 << 20
"""Most bytes one digest covers (see the note): small enough that the last chunk's digest, the one a
read waits for, takes a fraction of a millisecond; large enough that requests stay large."""


class SwapSpaceError(OSError):
    """The swap directories cannot hold what the store was asked to reserve."""


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


def job_id() -> str:
    """The launcher's job id (torchrun, SLURM), else this process's id: ranks of a job share it."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID"):
        if os.environ.get(var):
            return "".join(c if c.isalnum() or c in "-_" else "_" for c in os.environ[var])
    return f"pid{os.getpid()}"


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _ExtentAllocator:
    """Aligned extents of one file: a sorted free list of ``(offset, length)`` and the file's end."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []
        self.end = 0

    def allocate(self, length: int) -> int:
        for i, (offset, size) in enumerate(self.free):
            if size >= length:
                self.free[i:i + 1] = [(offset + length, size - length)] if size > length else []
                return offset
        offset, self.end = self.end, self.end + length
        return offset

    def release(self, offset: int, length: int) -> None:
        i = bisect.bisect(self.free, (offset, length))
        self.free.insert(i, (offset, length))
        if i + 1 < len(self.free) and offset + length == self.free[i + 1][0]:
            self.free[i:i + 2] = [(offset, length + self.free[i + 1][1])]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:
            self.free[i - 1:i + 1] = [(self.free[i - 1][0], self.free[i - 1][1] + self.free[i][1])]
        if self.free and sum(self.free[-1]) == self.end:
            self.end = self.free.pop()[0]  # give the tail back, so the file can shrink


def _chunks(nbytes: int, segment: int) -> tuple[tuple[int, int], ...]:
    """``(start, length)`` of the chunks an entry's digests cover: each segment cut every ``CHUNK`` bytes."""
    return tuple((start + offset, min(CHUNK, min(segment, nbytes - start) - offset))
                 for start in range(0, nbytes, segment) for offset in range(0, min(segment, nbytes - start), CHUNK))


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


def _digests(view: Any, chunks: tuple[tuple[int, int], ...], landed: list[list[Handle]] | None = None
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


class _Stripe:
    """One locked swap file, its allocator, and how far the file is preallocated."""

    def __init__(self, directory: Path, name: str, direct: bool):
        self.path = directory / name
        self.allocator = _ExtentAllocator()
        self.preallocated = 0
        with _directory_lock(directory):
            self.file = open_file(str(self.path), "rw", direct=direct, create=True)
            try:
                fcntl.flock(self.file.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                self.file.close()  # the file is the other process's: leave it in place
                raise BlockingIOError(exc.errno, f"swap file {self.path} is locked by another live process "
                                      "(same host, job, rank, pid and token); not using it") from exc

    def allocate(self, length: int) -> int:
        """An extent of ``length`` bytes, the file's blocks claimed ahead of it (see GROWTH)."""
        offset = self.allocator.allocate(length)
        if self.allocator.end > self.preallocated:
            self.reserve(-(-self.allocator.end // GROWTH) * GROWTH)
        return offset

    def reserve(self, nbytes: int) -> None:
        try:
            os.posix_fallocate(self.file.fd, 0, nbytes)
        except OSError as error:  # the system's error names no file
            raise OSError(error.errno, f"cannot claim {nbytes:,} bytes of swap in {self.path}: {error.strerror}; free "
                                       "space there, point nvme.path at another disk or keep more state in RAM",
                          str(self.path)) from error
        self.preallocated = max(self.preallocated, nbytes)

    def close(self) -> None:
        self.file.close()  # closing the last descriptor releases the flock
        self.path.unlink(missing_ok=True)


def _remove_stripes(stripes: list[_Stripe]) -> None:
    """Close and unlink a store's files (a finalizer: it must not hold the store itself)."""
    for stripe in stripes:
        stripe.close()
    stripes.clear()


class _directory_lock:
    """Exclusive lock on ``<private dir>/.lock`` while files there are created or swept."""

    def __init__(self, directory: Path):
        self.fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _private_dir(path: str) -> Path:
    """``<path>/zerooffload-swap``, created 0700; refuses one that others may write to.

    ``path`` itself must exist: a missing one is most often a disk that is not mounted (a DeepSpeed
    config's ``/mnt/nvme``), and creating it would quietly send the swap to the root disk.
    """
    directory = Path(path) / PRIVATE_DIR
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
    except FileNotFoundError as exc:
        raise FileNotFoundError(errno.ENOENT, f"swap directory {path} does not exist: mount the disk meant to be "
                                              "there or create the directory, or set nvme.path (offload.*.path) "
                                              "to an existing one") from exc
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create swap directory {directory}: {exc.strerror}; "
                                 "set nvme.path to a writable directory", str(directory)) from exc
    info = directory.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"swap directory {directory} is not private (owner uid {info.st_uid}, mode "
                              f"{oct(info.st_mode & 0o777)}); remove it or use another nvme.path")
    return directory


def sweep_stale(directory: Path) -> list[str]:
    """Remove swap files in ``directory`` whose owner died (nobody holds their flock)."""
    removed = []
    with _directory_lock(directory):
        for path in directory.glob("*.swap"):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live store holds it
            finally:
                os.close(fd)
            path.unlink(missing_ok=True)
            removed.append(path.name)
    if removed:
        logger.info("removed %d stale swap file(s) of dead jobs in %s: %s", len(removed), directory,
                    ", ".join(removed))
    return removed


def _extents(pieces: tuple[tuple[int, int, int], ...], start: int, nbytes: int) -> tuple[tuple[int, int, int], ...]:
    """The extents (stripe, offset, length) holding an entry's bytes ``start .. start + nbytes``."""
    out, skip, left = [], start, nbytes
    for index, offset, length in pieces:
        if left <= 0:
            break
        if skip < length:
            take = min(length - skip, left)
            out.append((index, offset + skip, take))
            left -= take
        skip = max(skip - length, 0)
    return tuple(out)


class SwapStore:
    """Tensors' bytes under keys in this rank's swap files; see [Note: swap store].

    ``reserve`` bytes are checked against free space up front and preallocated, so a run that
    cannot fit fails at start with the numbers instead of with ENOSPC hours later.
    """

    def __init__(self, paths: list[str] | str, aio: AsyncIO, *, rank: int = 0, reserve: int = 0,
                 checksum: bool = True, direct: bool = True):
        self.aio = aio
        self.checksum = checksum
        dirs = [_private_dir(p) for p in ([paths] if isinstance(paths, str) else paths)]
        if not dirs:
            raise ValueError("a swap store needs at least one directory (nvme.path)")
        for directory in dirs:
            sweep_stale(directory)
        _check_free_space(dirs, reserve)
        name = f"{socket.gethostname()}.{job_id()}.rank{rank}.{os.getpid()}.{secrets.token_hex(4)}.swap"
        self.stripes: list[_Stripe] = []
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._digest_thread = self._verify_thread = None
        if checksum:  # see the note: one thread for writes' digests, one for reads'
            self._digest_thread = ThreadPoolExecutor(1, thread_name_prefix="zerooffload-swap-digest")
            self._verify_thread = ThreadPoolExecutor(1, thread_name_prefix="zerooffload-swap-verify")
        self._finalizer = weakref.finalize(self, _remove_stripes, self.stripes)
        _live_finalizers.add(self._finalizer)
        _install_signal_cleanup()
        try:
            for directory in dirs:
                self.stripes.append(_Stripe(directory, name, direct))
            if reserve:
                share = _round_up(-(-reserve // len(self.stripes)))
                for stripe in self.stripes:
                    stripe.reserve(share)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ placement
    def _place(self, nbytes: int) -> tuple[tuple[int, int, int], ...]:
        """Split ``nbytes`` into one aligned extent per stripe (fewer when it is small)."""
        share = _round_up(-(-nbytes // len(self.stripes)))
        pieces, start = [], 0
        for index, stripe in enumerate(self.stripes):
            length = min(share, nbytes - start)
            if length <= 0:
                break
            pieces.append((index, stripe.allocate(_round_up(length)), length))
            start += length
        return tuple(pieces)

    def _release(self, entry: _Entry) -> None:
        for index, offset, length in entry.pieces:
            self.stripes[index].allocator.release(offset, _round_up(length))

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
                    self._release(old)
                pieces = self._place(view.nbytes)
            handles = self._submit(self.aio.write, view, pieces)
            digests = None if self._digest_thread is None else self._digest_thread.submit(
                _digests, view, _chunks(view.nbytes, segment))
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
            return SwapHandle(self._submit(self.aio.read, view, _extents(entry.pieces, 0, view.nbytes)),
                              on_error=lambda error: self._damage(key, entry, error))
        chunks = tuple(chunk for chunk in _chunks(entry.nbytes, entry.segment) if chunk[0] < view.nbytes)
        landed = [self._submit(self.aio.read, view[start:start + length], _extents(entry.pieces, start, length))
                  for start, length in chunks]  # one request per chunk: each is verified as it lands
        return SwapHandle([handle for handles in landed for handle in handles],
                          self._verify_thread.submit(_digests, view, chunks, landed),
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
        """A failed read as the user should see it: a file that ended early is a damaged swap file."""
        if not isinstance(error, AioError) or error.errno != EEOF:
            return error
        start = error.offset if error.failed_offset is None else error.failed_offset
        return SwapDamage(key, "the swap file ends before it (truncated)", error.filename, start, entry.nbytes)

    def free(self, key: str) -> None:
        """Forget ``key`` and give its extents back for reuse."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                raise KeyError(f"swap key {key!r} is not stored")
            self._release(entry)

    def rename(self, source: str, target: str) -> None:
        """Make ``source``'s bytes ``target``'s (its old extents given back) and forget ``source``: the
        commit of a version written aside, which reads of ``target`` did not see until now."""
        with self._lock:
            entry = self._entries.pop(source, None)
            if entry is None:
                raise KeyError(f"swap key {source!r} is not stored")
            old = self._entries.pop(target, None)
            if old is not None:
                self._release(old)
            self._entries[target] = entry

    def _drop(self, key: str, entry: _Entry) -> None:
        """Free ``key`` if it still names ``entry`` (a later write may have replaced it)."""
        with self._lock:
            if self._entries.get(key) is entry:
                del self._entries[key]
                self._release(entry)

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
        _live_finalizers.discard(self._finalizer)
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


def _check_free_space(dirs: list[Path], reserve: int) -> None:
    """Refuse a reservation the directories cannot hold, naming each short directory and the numbers."""
    if not reserve:
        return
    share = _round_up(-(-reserve // len(dirs)))
    per_device: dict[int, list[Path]] = {}
    for directory in dirs:
        per_device.setdefault(directory.stat().st_dev, []).append(directory)
    short = []
    for group in per_device.values():
        need, free = share * len(group), shutil.disk_usage(group[0]).free
        if free < need:
            short.append(f"{', '.join(map(str, group))} needs {_size(need)} but has {_size(free)} free")
    if short:
        raise SwapSpaceError(28, f"swap store of {_size(reserve)} does not fit: " + "; ".join(short)
                                 + ". Free space, add directories to nvme.path, or keep more state in RAM")


def _size(nbytes: int) -> str:
    """Exact bytes, then GB: rounded figures alone can read "needs 0.01 GB but has 0.01 GB free"."""
    return f"{nbytes} bytes ({nbytes / 1e9:.2f} GB)"


# ---------------------------------------------------------------------- cleanup on signals
_live_finalizers: set[weakref.finalize] = set()
_previous_handlers: dict[int, Any] = {}


def _on_signal(signum: int, frame: Any) -> None:
    """Do what the signal would have done; remove the files first only when that is to die.

    A handler of the user's, SIG_IGN or Python's KeyboardInterrupt let the process run on (a
    preemption handler that saves a checkpoint, ``nohup``, a caught Ctrl-C), and it still needs its
    files; they go at exit with the finalizers.
    """
    previous = _previous_handlers[signum]
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        for finalizer in list(_live_finalizers):
            finalizer()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_signal_cleanup() -> None:
    """Once per process, from the main thread only (Python's rule for signal handlers)."""
    if _previous_handlers or threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        _previous_handlers[signum] = signal.getsignal(signum)
        signal.signal(signum, _on_signal)
