"""Errors of the I/O layer: what backends raise, and what users see.

[Note: I/O errors]
- ``TransferFailed`` is raised by a backend's ticket: an errno, the index of the failed request in its
  batch and the file offset the failed piece had reached. Backends see descriptors, not paths, so it
  names no file.
- ``AioError`` is what users see: an ``OSError`` naming the operation, the file, the offset and length
  of the transfer they asked for, the file offset where it failed when a backend got that far, and the
  errno, e.g. ``write of 4194304 bytes at offset 1048576 in /nvme/swap failed at offset 2097152:
  [Errno 27] File too large``.
- ``EEOF`` (``ENODATA``) is the errno of a read that met end of file before its length; its message is
  "unexpected end of file" rather than the C library's "No data available".
"""
from __future__ import annotations

import errno
import os

__all__ = ["AioError", "EEOF", "TransferFailed", "describe_errno"]

EEOF = errno.ENODATA


def describe_errno(code: int) -> str:
    """The message for an errno, with ``EEOF`` spelt as what it means here."""
    return "unexpected end of file" if code == EEOF else os.strerror(code)


class TransferFailed(Exception):
    """A batch failed: ``errno``, the failed request's ``index`` and the file ``offset`` it reached."""

    def __init__(self, code: int, index: int, offset: int):
        super().__init__(code, index, offset)
        self.errno = code
        self.index = index
        self.offset = offset

    def __str__(self) -> str:
        return f"request {self.index} failed at offset {self.offset}: [Errno {self.errno}] {describe_errno(self.errno)}"


class AioError(OSError):
    """A failed open, read or write: ``filename``, ``offset``, ``length``, ``failed_offset``, ``errno``.

    ``op`` is ``"open"``, ``"read"`` or ``"write"``; ``offset`` and ``length`` are those of the transfer
    the user asked for (``None`` for an open). ``failed_offset`` is the file offset where the transfer
    failed, which for a large one is what tells a bad block or a size limit from a bad request (``None``
    when it failed before any backend ran it: a refused mode, a negative offset, a closed engine). It
    pickles with all of them, so an error raised on one rank can be reported by another.
    """

    def __init__(self, code: int, strerror: str, filename: str, op: str = "I/O",
                 offset: int | None = None, length: int | None = None, failed_offset: int | None = None):
        super().__init__(code, strerror, filename)
        self.op = op
        self.offset = offset
        self.length = length
        self.failed_offset = failed_offset

    def __str__(self) -> str:
        if self.length is None:
            what = f"{self.op} of {self.filename}"
        else:
            what = f"{self.op} of {self.length} bytes at offset {self.offset} in {self.filename}"
        where = "" if self.failed_offset is None else f" at offset {self.failed_offset}"
        return f"{what} failed{where}: [Errno {self.errno}] {self.strerror}"
