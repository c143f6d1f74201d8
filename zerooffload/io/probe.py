"""Runtime probes of what the kernel and a filesystem offer the I/O layer.

They answer by trying, not by reading version numbers: io_uring can be compiled in yet disabled
(``kernel.io_uring_disabled``) or blocked by seccomp in containers, and O_DIRECT depends on the
filesystem under a path (tmpfs refuses it), so ``doctor`` and the ``auto`` backend ask these.
``mount_of`` names the filesystem a path is on: a swap directory on the root disk looks like any other.

There is one io_uring probe, the native engine's own (``zerooffload._aio.uring_probe``: a ring set up
and IORING_OP_READ/WRITE supported), which ``probe_io_uring`` asks for doctor and the uring backend's
``unavailable_reason`` alike, so the two cannot disagree. Only when the native extension is not built
does a Python stand-in set up a ring by the raw system call, and its answer says so.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import importlib
import mmap
import os
import platform
import re
from dataclasses import dataclass
from types import ModuleType

__all__ = ["Probe", "Mount", "native_aio", "probe_io_uring", "probe_o_direct", "mount_of"]

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


@functools.cache
def native_aio() -> tuple[ModuleType | None, str]:
    """The native async-I/O module ``zerooffload._aio``, or None and why it would not load (the extension
    is optional at install)."""
    try:
        return importlib.import_module("zerooffload._aio"), ""
    except ImportError as exc:
        return None, f"the native extension zerooffload._aio is not built ({exc})"


_URING_HINTS = {errno.EPERM: " (disabled: see /proc/sys/kernel/io_uring_disabled, or blocked by seccomp)",
                errno.ENOSYS: " (kernel built without io_uring)",
                errno.EOPNOTSUPP: " (kernel older than 5.6: no IORING_OP_READ/WRITE)"}


def probe_io_uring() -> Probe:
    """Whether io_uring works here as the uring backend uses it, by the native engine's probe (see the
    module note); without the native extension, the Python stand-in's answer."""
    native = native_aio()[0]
    if native is None:
        return _python_probe_io_uring()
    code = native.uring_probe()
    if code == 0:
        return Probe(True, "io_uring works (ring set up, IORING_OP_READ/WRITE supported)")
    return Probe(False, f"io_uring does not work here: [Errno {code}] {os.strerror(code)}{_URING_HINTS.get(code, '')}",
                 code)


def _python_probe_io_uring() -> Probe:
    """Set up (and close) a real 4-entry ring through the raw system call: less than the native probe asks
    (no check of the READ/WRITE ops), and only what the kernel offers, since the uring backend is native."""
    note = " (Python probe, ring setup only: zerooffload._aio is not built)"
    number = _IO_URING_SETUP.get(platform.machine())
    if number is None:
        return Probe(False, f"unknown io_uring_setup syscall number on {platform.machine()}{note}")
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(_PARAMS_BYTES)
    fd = libc.syscall(number, ctypes.c_uint(4), params)
    if fd < 0:
        err = ctypes.get_errno()
        return Probe(False, f"io_uring_setup failed: [Errno {err}] {os.strerror(err)}{_URING_HINTS.get(err, '')}{note}",
                     err)
    os.close(fd)
    return Probe(True, f"io_uring_setup works{note}")


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
