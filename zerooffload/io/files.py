"""Files that AsyncIO reads and writes: a descriptor, its path, and what unaligned writes to it share.

[Note: file vocabulary]
- ``AioFile``: one open descriptor with the path it was opened by, its ``mode`` ("r", "w", "rw") and
  whether it is ``direct`` (O_DIRECT: transfers bypass the page cache and must be 4 KiB aligned).
- *Edge block*: a 4 KiB block that an unaligned write covers only in part, so it is read, patched and
  written whole (bounce.py). Two writes that touch disjoint bytes of one edge block must not interleave
  those steps, or one would write back stale bytes over the other: ``FileWriteState.edges`` serializes
  them per block.
- *Padding*: a write whose last edge block lies past end of file writes that block whole, which grows
  the file past the write's end; ``FileWriteState.padded_tail`` cuts it back. The cut goes no lower
  than the highest end of any write submitted to this AioFile (``note_end``), so it never removes
  bytes of a write that is still in flight, nor of one that already landed.
Coordination is per AioFile: two AioFiles opened on one path do not see each other's edges.

[Note: no links followed]
The names zerooffload creates, locks or removes inside a directory it was given (``--out``'s ``.lock``,
``nvme.path``'s ``zerooffload-swap`` and swap files, a checkpoint directory's tags, ``latest``) are
never followed when they are symbolic links: such a name is opened with ``O_NOFOLLOW`` or checked with
``lstat`` first, and a link there is refused (``LinkRefused``), naming it. Another user who may write
to a shared directory could otherwise plant ``.lock -> ~/.bashrc`` and have a run truncate it, or a
swap directory link that sends the run's writes and its sweep of stale files elsewhere. The directories
given (``--out``, ``nvme.path``, a checkpoint directory) and those above them may be links: a disk is
often mounted so.
"""
from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import torch

from .errors import AioError

__all__ = ["AioFile", "FileWriteState", "LinkRefused", "OffsetReader", "open_file", "open_nofollow", "refuse_link"]

_MODES = {"r": os.O_RDONLY, "w": os.O_WRONLY, "rw": os.O_RDWR}


class FileWriteState:
    """What concurrent writes to one AioFile agree on: busy edge blocks and the highest write end."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy: set[int] = set()
        self._end = 0
        self._extend = threading.Lock()

    def note_end(self, end: int) -> None:
        """Record a write ending at ``end``; called when the write is submitted, before it can land."""
        with self._cond:
            self._end = max(self._end, end)

    @contextlib.contextmanager
    def edges(self, blocks: Iterable[int]) -> Iterator[None]:
        """Hold the edge blocks (file offsets) exclusively; all are taken at once, so no deadlock."""
        wanted = set(blocks)
        with self._cond:
            self._cond.wait_for(lambda: not wanted & self._busy)
            self._busy |= wanted
        try:
            yield
        finally:
            with self._cond:
                self._busy -= wanted
                self._cond.notify_all()

    @contextlib.contextmanager
    def padded_tail(self, fd: int, end: int, padded_end: int) -> Iterator[None]:
        """Around a write of bytes up to ``end`` that writes whole blocks up to ``padded_end``.

        When the padding may grow the file, writes that may do so run one at a time, and after the
        write the file is cut back to the larger of its size before and the highest noted write end.
        """
        if padded_end == end or os.fstat(fd).st_size >= padded_end:
            yield
            return
        with self._extend:
            before = os.fstat(fd).st_size
            yield
            with self._cond:
                target = max(before, self._end)
            if os.fstat(fd).st_size > target:
                os.ftruncate(fd, target)


class AioFile:
    """An open file for AsyncIO; a context manager that closes it. See ``open_file``."""

    def __init__(self, fd: int, path: str, mode: str, direct: bool):
        self.fd = fd
        self.path = path
        self.mode = mode
        self.direct = direct
        self.write_state = FileWriteState()
        """Shared by AsyncIO's unaligned writes to this file (see the module note)."""

    @property
    def readable(self) -> bool:
        return self.mode != "w"

    @property
    def writable(self) -> bool:
        return self.mode != "r"

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def close(self) -> None:
        """Close the descriptor (idempotent). Transfers still in flight on it fail with EBADF."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> AioFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AioFile({self.path!r}, mode={self.mode!r}, direct={self.direct}, fd={self.fd})"


class LinkRefused(OSError):
    """A name zerooffload creates, locks or removes is a symbolic link (see [Note: no links followed])."""


def refuse_link(path: str | os.PathLike[str]) -> None:
    """Raise ``LinkRefused`` when ``path`` itself is a symbolic link (``lstat``; a missing path passes).
    Only its last component is looked at: the directories above it may be links."""
    if os.path.islink(path):
        try:
            target = f" to {os.readlink(path)}"
        except OSError:
            target = ""  # gone again since the lstat: still refused, this time
        raise LinkRefused(errno.ELOOP, f"{os.fspath(path)} is a symbolic link{target}, and a link is never followed "
                                       "where files are created, locked or removed: remove it (the directories "
                                       "given, such as --out and nvme.path, and those above them may be links)",
                          os.fspath(path))


def open_nofollow(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    """``os.open`` with ``O_NOFOLLOW | O_CLOEXEC``: a symbolic link at ``path`` is ``LinkRefused``."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as error:
        if error.errno == errno.ELOOP:
            refuse_link(path)
        raise


def open_file(path: str | os.PathLike[str], mode: str = "r", direct: bool = True,
              create: bool = True, follow: bool = True) -> AioFile:
    """Open ``path`` for AsyncIO; raises AioError naming the path.

    ``mode`` is "r", "w" or "rw"; "w" and "rw" create a missing file (mode 0o600) when ``create``, and
    never truncate: transfers are positional, like pread/pwrite. A direct file opened "w" is opened
    read-write underneath, because unaligned writes read back their edge blocks; AsyncIO still refuses
    reads from it. Without ``follow`` a symbolic link at ``path`` is ``LinkRefused`` (O_NOFOLLOW): the
    files zerooffload names itself (swap files, checkpoint data; [Note: no links followed]).
    """
    if mode not in _MODES:
        raise ValueError(f"mode = {mode!r}: expected one of {sorted(_MODES)}")
    name = os.fspath(path)
    flags = (os.O_RDWR if direct and mode == "w" else _MODES[mode]) | os.O_CLOEXEC
    if create and mode != "r":
        flags |= os.O_CREAT
    if direct:
        flags |= os.O_DIRECT
    try:
        fd = os.open(name, flags, 0o600) if follow else open_nofollow(name, flags)
    except LinkRefused:
        raise
    except OSError as exc:
        hint = "; this filesystem may not support O_DIRECT: open with direct=False" if (
            direct and exc.errno == errno.EINVAL) else ""
        raise AioError(exc.errno, exc.strerror + hint, name, op="open") from None
    return AioFile(fd, name, mode, direct)


class OffsetReader:
    """Files opened on first use and read by byte offset into tensors, through the page cache: the
    small scattered reads of checkpoint loads and pretrained weights. A short read raises ``EOFError``
    naming the file and the byte it ends before."""

    def __init__(self) -> None:
        self._files: dict[Path, BinaryIO] = {}

    def read_into(self, path: Path, offset: int, out: torch.Tensor) -> None:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open(path, "rb")
        f.seek(offset)
        if not out.is_contiguous():
            raise ValueError(f"reading {path}: the destination tensor must be contiguous")
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())  # reshape first: 0-dim tensors too
        if f.readinto(view) != len(view):
            raise EOFError(f"{path}: ends before byte {offset + len(view)}: truncated")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
