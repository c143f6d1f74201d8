"""Runtime probes of what the kernel and a filesystem offer the I/O layer.

They answer by trying, not by reading version numbers: io_uring can be compiled in yet disabled
(``kernel.io_uring_disabled``) or blocked by seccomp in containers, and O_DIRECT depends on the
filesystem under a path (tmpfs refuses it), so ``doctor`` and the ``auto`` backend ask these.
``mount_of`` names the filesystem a path is on: a swap directory on the root disk looks like any other.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import re
from dataclasses import dataclass

__all__ = ["Probe", "Mount", "probe_io_uring", "probe_o_direct", "mount_of"]

_IO_URING_SETUP = {"x86_64": 425, "aarch64": 425}
_PARAMS_BYTES = 120  # sizeof(struct io_uring_params) in <linux/io_uring.h>


@dataclass(frozen=True, slots=True)
class Probe:
    """The outcome of one probe: whether the feature works, and why not when it does not."""

    ok: bool
    detail: str
    errno: int = 0
    """The errno that failed it (0 when ok, or when no system call failed): callers tell a directory that
    is not writable (EACCES, EROFS) from a filesystem without O_DIRECT (EINVAL)."""


@dataclass(frozen=True, slots=True)
class Mount:
    """One mounted filesystem, as ``/proc/self/mountinfo`` lists it."""

    point: str
    fstype: str
    source: str


def probe_io_uring() -> Probe:
    """Set up (and close) a real 4-entry ring through the raw system call."""
    number = _IO_URING_SETUP.get(platform.machine())
    if number is None:
        return Probe(False, f"unknown io_uring_setup syscall number on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(_PARAMS_BYTES)
    fd = libc.syscall(number, ctypes.c_uint(4), params)
    if fd < 0:
        err = ctypes.get_errno()
        return Probe(False, f"io_uring_setup failed: [Errno {err}] {os.strerror(err)}" + _uring_hint(err))
    os.close(fd)
    return Probe(True, "io_uring_setup works")


def _uring_hint(err: int) -> str:
    if err == errno.ENOSYS:
        return " (kernel without io_uring)"
    if err == errno.EPERM:
        return " (disabled: see /proc/sys/kernel/io_uring_disabled, or blocked by seccomp)"
    return ""


def probe_o_direct(directory: str) -> Probe:
    """Write and read back one aligned 4 KiB block with O_DIRECT in ``directory``; the file is removed."""
    path = os.path.join(directory, f".zerooffload-probe-{os.getpid()}")
    block = mmap.mmap(-1, 4096)  # anonymous mappings are page aligned, as O_DIRECT needs
    block.write(os.urandom(4096))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        return Probe(False, f"cannot open {path} with O_DIRECT: [Errno {exc.errno}] {exc.strerror}", exc.errno)
    try:
        written = os.pwritev(fd, [block], 0)
        back = mmap.mmap(-1, 4096)
        read = os.preadv(fd, [back], 0)
        if written != 4096 or read != 4096 or back[:] != block[:]:
            return Probe(False, f"O_DIRECT round trip in {directory} returned wrong bytes")
        return Probe(True, f"O_DIRECT write+read works in {directory}")
    except OSError as exc:
        return Probe(False, f"O_DIRECT I/O in {directory} failed: [Errno {exc.errno}] {exc.strerror}", exc.errno)
    finally:
        os.close(fd)
        os.unlink(path)


def mount_of(path: str) -> Mount | None:
    """The mount ``path`` lives on: the longest mount point above its real path, the last listed when
    several share one (a later mount hides an earlier one there); None without /proc."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
            lines = table.read().splitlines()
    except OSError:
        return None
    best = None
    for mount in map(_parse_mountinfo, lines):
        inside = real == mount.point or real.startswith(mount.point.rstrip("/") + "/")
        if inside and (best is None or len(mount.point) >= len(best.point)):
            best = mount
    return best


def _parse_mountinfo(line: str) -> Mount:
    """``id parent major:minor root point options [optional...] - fstype source super-options``; the
    kernel writes space, tab, newline and backslash in names as octal escapes (``\\040``)."""
    fields = line.split(" ")
    rest = fields[fields.index("-", 6) + 1:]
    return Mount(_unescape(fields[4]), rest[0], _unescape(rest[1]))


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)
