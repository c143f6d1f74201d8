"""A scratch file on a disk, written and read back through the I/O backends: what the disk does.

``bench io`` and ``tune io`` measure their settings on it, and the planner's probe measures a swap
directory's bandwidths the same way, so all three mean the same by "GB/s". A run (``ScratchDisk.run``)
is one timed write of the whole payload, ``fsync`` included, and one timed read, each on an O_DIRECT
file through ``AsyncIO(raw=True)`` (no page cache, no bounce copy), then a byte-for-byte check
outside the timing (bench's [Note: bench vocabulary]).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import torch

from ..config import AioConfig, format_size
from ..io import AioError, AioFile, AsyncIO, aligned_empty, open_file

__all__ = ["BenchError", "QUEUE_BACKENDS", "Record", "ScratchDisk", "Unavailable", "preflight", "scratch_disk"]


QUEUE_BACKENDS = frozenset({"uring"})
"""Backends whose in-flight bound is ``queue_depth``; the others are bounded by ``threads``."""


class BenchError(Exception):
    """A run that cannot start or a check that failed; ``code`` is the exit status (2 usage, 1 failure)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Record:
    """One op of one run; ``as_json`` gives exactly the keys the ``--json`` output promises."""

    backend: str
    op: str
    block_size: int
    queue_depth: int | None
    threads: int | None
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9

    def as_json(self) -> dict:
        return {**dataclasses.asdict(self), "gbps": self.gbps}


def preflight(directory: str, size: int) -> None:
    """Refuse up front what would fail half way: no directory, too little disk or memory."""
    if not os.path.isdir(directory):
        raise BenchError(f"--path {directory}: not a directory", code=2)
    free = shutil.disk_usage(directory).free
    if free < size:
        raise BenchError(f"--size {format_size(size)} ({size} bytes) does not fit in {directory}: only "
                         f"{free} bytes free; pass a smaller --size or another --path", code=2)
    memory = psutil.virtual_memory().available
    if memory < 2 * size:  # the payload and the readback buffer
        raise BenchError(f"--size {size} bytes needs twice that in host memory (payload and readback); "
                         f"only {memory} bytes are available", code=2)


@contextlib.contextmanager
def _test_file(directory: str, size: int) -> Iterator[AioFile]:
    """A fresh O_DIRECT file of ``size`` bytes, deleted on leaving (also on error and Ctrl-C).

    The file is preallocated once with posix_fallocate, so every timed write lands inside the file
    size: ext4 serializes writes that extend a file (they take the inode lock exclusively), which
    would measure the filesystem's lock rather than the backend's parallelism.
    """
    fd, path = tempfile.mkstemp(prefix="zerooffload-bench-", suffix=".dat", dir=directory)
    try:
        os.close(fd)
        try:
            with open_file(path, "rw", direct=True) as file:
                os.posix_fallocate(file.fd, 0, size)
                yield file
        except AioError as exc:  # open, or a transfer: the message names the file, offset and errno
            hint = " (choose a --path on a filesystem with O_DIRECT)" if exc.op == "open" else ""
            raise BenchError(f"{exc}{hint}") from None
        except OSError as exc:  # posix_fallocate, fsync
            raise BenchError(f"{path}: [Errno {exc.errno}] {exc.strerror}") from None
    finally:
        os.unlink(path)


@dataclass
class ScratchDisk:
    """A test file with its payload and readback buffers: where runs happen (``bench io``, ``tune io``)."""

    file: AioFile
    payload: torch.Tensor
    readback: torch.Tensor

    def run(self, setting: AioConfig) -> list[Record]:
        """One run of ``setting`` on fresh bytes: its write and read records (``Unavailable`` when the
        backend cannot start here)."""
        self.payload.add_(1)  # new bytes each run: a write that moved nothing would read back stale
        return _run(setting, self.file, self.payload, self.readback)


@contextlib.contextmanager
def scratch_disk(directory: str, size: int) -> Iterator[ScratchDisk]:
    """A ``ScratchDisk`` of ``size`` bytes in ``directory``, its file deleted on leaving."""
    payload, readback = aligned_empty(size), aligned_empty(size)
    payload.random_(0, 256, generator=torch.Generator().manual_seed(0))
    with _test_file(directory, size) as file:
        yield ScratchDisk(file, payload, readback)


class Unavailable(Exception):
    """The backend cannot start on this machine (the reason is the message)."""


def _run(setting: AioConfig, file: AioFile, payload: torch.Tensor, readback: torch.Tensor) -> list[Record]:
    """One timed write (with fsync) and one timed read of the whole file, then the byte check."""
    try:
        aio = AsyncIO(setting, raw=True)
    except RuntimeError as exc:
        raise Unavailable(str(exc)) from None
    readback.zero_()
    with aio:
        start = time.perf_counter()
        aio.write(file, payload, 0).wait()
        os.fsync(file.fd)
        wrote = time.perf_counter() - start
        start = time.perf_counter()
        aio.read(file, readback, 0).wait()
        read = time.perf_counter() - start
    _verify(setting.backend, payload, readback)
    return [_record(setting, "write", payload.numel(), wrote), _record(setting, "read", payload.numel(), read)]


def _record(setting: AioConfig, op: str, nbytes: int, seconds: float) -> Record:
    queued = setting.backend in QUEUE_BACKENDS
    return Record(setting.backend, op, setting.block_size, setting.queue_depth if queued else None,
                  None if queued else setting.threads, nbytes, seconds)


def _verify(backend: str, written: torch.Tensor, read: torch.Tensor, chunk: int = 64 << 20) -> None:
    """Every byte read back equals the byte written, or BenchError naming the first bad offset.

    Compared chunk by chunk so that locating a mismatch never needs a mask as large as the file.
    """
    if torch.equal(written, read):
        return
    for start in range(0, written.numel(), chunk):
        diff = (written[start:start + chunk] != read[start:start + chunk]).nonzero()
        if diff.numel():
            offset = start + int(diff[0])
            raise BenchError(f"{backend}: data read back differs from what was written, first at byte offset "
                             f"{offset} (wrote {int(written[offset])}, read {int(read[offset])})")
    raise AssertionError("torch.equal found a difference that no chunk shows")
