"""The space of a swap store: private directories, locked stripe files, extents, and the files' lifetime.

[Note: swap space]
- A store owns one *stripe* in each configured directory: a swap file inside the private directory
  ``<dir>/zerooffload-swap`` (mode 0700), named ``<host>.<job>.rank<rank>.<pid>.<token>.swap``, created
  0600 and held under an exclusive ``flock``. The random token keeps names apart where host, job and
  pid repeat: containers with the same hostname each have a pid 1.
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
- A store may have a *cap*: the most bytes its files may take on disk, preallocated space included
  (``nvme.max_bytes`` over the ranks of the machine). Placing an entry that would grow them past it is
  refused before anything is written (``grow``), and the growth steps shrink as the cap nears, a
  stripe taking at most its even share of the room left, so a cap never costs room to preallocation.
- No name here is followed when it is a symbolic link: ``zerooffload-swap`` is checked with ``lstat``,
  the lock and swap files are opened with ``O_NOFOLLOW``, and a store removes only the file it created
  (io.files' [Note: no links followed]).
"""
from __future__ import annotations

import bisect
import errno
import fcntl
import logging
import os
import shutil
import signal
import stat
import threading
import weakref
from pathlib import Path
from typing import Any

from .aio import open_file
from .files import open_nofollow, refuse_link

__all__ = ["ALIGN", "GROWTH", "PRIVATE_DIR", "ExtentAllocator", "Stripe", "SwapSpaceError", "check_cap",
           "check_free_space", "directory_lock", "extents", "grow", "install_signal_cleanup", "job_id",
           "live_finalizers", "private_dir", "remove_stripes", "round_up", "sweep_stale"]

logger = logging.getLogger(__name__)

ALIGN = 4096
"""Extent granularity: O_DIRECT needs offsets and lengths in 4 KiB multiples."""
GROWTH = 64 << 20
"""Bytes a swap file is preallocated by when an extent passes its end."""
PRIVATE_DIR = "zerooffload-swap"


class SwapSpaceError(OSError):
    """The swap directories cannot hold what the store was asked to reserve."""


def job_id() -> str:
    """The launcher's job id (torchrun, SLURM), else this process's id: ranks of a job share it."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID"):
        if os.environ.get(var):
            return "".join(c if c.isalnum() or c in "-_" else "_" for c in os.environ[var])
    return f"pid{os.getpid()}"


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class ExtentAllocator:
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


class Stripe:
    """One locked swap file, its allocator, and how far the file is preallocated."""

    def __init__(self, directory: Path, name: str, direct: bool):
        self.path = directory / name
        self.allocator = ExtentAllocator()
        self.preallocated = 0
        with directory_lock(directory):
            self.file = open_file(str(self.path), "rw", direct=direct, create=True, follow=False)
            try:
                fcntl.flock(self.file.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                self.file.close()  # the file is the other process's: leave it in place
                raise BlockingIOError(exc.errno, f"swap file {self.path} is locked by another live process "
                                      "(same host, job, rank, pid and token); not using it") from exc

    @property
    def span(self) -> int:
        """Bytes the file takes: its extents' end, or what was preallocated past it."""
        return max(self.allocator.end, self.preallocated)

    def reserve(self, nbytes: int) -> None:
        try:
            os.posix_fallocate(self.file.fd, 0, nbytes)
        except OSError as error:  # the system's error names no file
            fix = ("raise this process's file-size limit (ulimit -f)" if error.errno == errno.EFBIG else
                   "free space there, point nvme.path at another disk or keep more state in RAM")
            raise OSError(error.errno, f"cannot claim {nbytes:,} bytes of swap in {self.path}: {error.strerror}; {fix}",
                          str(self.path)) from error
        self.preallocated = max(self.preallocated, nbytes)

    def close(self) -> None:
        """Close the file (which releases its flock) and remove it: the file this stripe created, not
        whatever may have taken its name since."""
        created = os.fstat(self.file.fd) if not self.file.closed else None
        self.file.close()
        try:
            now = os.lstat(self.path)
        except FileNotFoundError:
            return
        if created is not None and (now.st_dev, now.st_ino) == (created.st_dev, created.st_ino):
            self.path.unlink()


def check_cap(need: int, cap: int, what: str) -> None:
    """Refuse (``SwapSpaceError``) files of ``need`` bytes past a store's ``cap`` (0: none), for ``what``."""
    if cap and need > cap:
        raise SwapSpaceError(errno.ENOSPC, f"{what} needs this rank's swap files to grow to {need:,} bytes, past "
                                           f"its share of nvme.max_bytes, {cap:,} bytes ({need - cap:,} more): raise "
                                           "nvme.max_bytes, or keep more state in RAM (offload.*.tier)")


def grow(stripes: list[Stripe], cap: int, what: str) -> None:
    """Preallocate each stripe past its extents' end (``GROWTH`` steps), the files' bytes kept within
    ``cap`` (0: none), after an entry ``what`` was placed; refused before any write (see the note)."""
    check_cap(sum(stripe.span for stripe in stripes), cap, what)
    for stripe in stripes:
        end = stripe.allocator.end
        if end > stripe.preallocated:
            target = -(-end // GROWTH) * GROWTH
            if cap:
                room = (cap - sum(s.span for s in stripes)) // len(stripes) // ALIGN * ALIGN
                target = min(target, end + room)
            stripe.reserve(target)


def remove_stripes(stripes: list[Stripe]) -> None:
    """Close and unlink a store's files (a finalizer: it must not hold the store itself)."""
    for stripe in stripes:
        stripe.close()
    stripes.clear()


class directory_lock:
    """Exclusive lock on ``<private dir>/.lock`` while files there are created or swept."""

    def __init__(self, directory: Path):
        self.fd = open_nofollow(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def private_dir(path: str) -> Path:
    """``<path>/zerooffload-swap``, created 0700; refuses one that others may write to.

    ``path`` itself must exist: a missing one is most often a disk that is not mounted (a DeepSpeed
    config's ``/mnt/nvme``), and creating it would quietly send the swap to the root disk.
    """
    directory = Path(path) / PRIVATE_DIR
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        refuse_link(directory)  # mkdir does not follow a link there, but whatever comes next would
    except FileNotFoundError as exc:
        raise FileNotFoundError(errno.ENOENT, f"swap directory {path} does not exist: mount the disk meant to be "
                                              "there or create the directory, or set nvme.path (offload.*.path) "
                                              "to an existing one") from exc
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create swap directory {directory}: {exc.strerror}; "
                                 "set nvme.path to a writable directory", str(directory)) from exc
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise FileExistsError(errno.EEXIST, f"swap directory {directory} is not a directory; remove it or use "
                                            "another nvme.path")
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"swap directory {directory} is not private (owner uid {info.st_uid}, mode "
                              f"{oct(info.st_mode & 0o777)}); remove it or use another nvme.path")
    return directory


def sweep_stale(directory: Path) -> list[str]:
    """Remove swap files in ``directory`` whose owner died (nobody holds their flock)."""
    removed = []
    with directory_lock(directory):
        for path in directory.glob("*.swap"):
            try:
                fd = open_nofollow(path, os.O_RDONLY)  # a link here is refused, never locked nor removed
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


def extents(pieces: tuple[tuple[int, int, int], ...], start: int, nbytes: int) -> tuple[tuple[int, int, int], ...]:
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


def check_free_space(dirs: list[Path], reserve: int) -> None:
    """Refuse a reservation the directories cannot hold, naming each short directory and the numbers."""
    if not reserve:
        return
    share = round_up(-(-reserve // len(dirs)))
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


live_finalizers: set[weakref.finalize] = set()
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
        for finalizer in list(live_finalizers):
            finalizer()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def install_signal_cleanup() -> None:
    """Once per process, from the main thread only (Python's rule for signal handlers)."""
    if _previous_handlers or threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        _previous_handlers[signum] = signal.getsignal(signum)
        signal.signal(signum, _on_signal)
