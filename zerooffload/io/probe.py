"""Runtime probes of what the kernel and a filesystem offer the I/O layer.

They answer by trying, not by reading version numbers: io_uring can be compiled in yet disabled
(``kernel.io_uring_disabled``) or blocked by seccomp in containers, and O_DIRECT depends on the
filesystem under a path (tmpfs refuses it), so ``doctor`` and the ``auto`` backend ask these.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
from dataclasses import dataclass

__all__ = ["Probe", "probe_io_uring", "probe_o_direct"]

_IO_URING_SETUP = {"x86_64": 425, "aarch64": 425}
_PARAMS_BYTES = 120  # sizeof(struct io_uring_params) in <linux/io_uring.h>


@dataclass(frozen=True, slots=True)
class Probe:
    """The outcome of one probe: whether the feature works, and why not when it does not."""

    ok: bool
    detail: str


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
        return Probe(False, f"cannot open {path} with O_DIRECT: [Errno {exc.errno}] {exc.strerror}")
    try:
        written = os.pwritev(fd, [block], 0)
        back = mmap.mmap(-1, 4096)
        read = os.preadv(fd, [back], 0)
        if written != 4096 or read != 4096 or back[:] != block[:]:
            return Probe(False, f"O_DIRECT round trip in {directory} returned wrong bytes")
        return Probe(True, f"O_DIRECT write+read works in {directory}")
    except OSError as exc:
        return Probe(False, f"O_DIRECT I/O in {directory} failed: [Errno {exc.errno}] {exc.strerror}")
    finally:
        os.close(fd)
        os.unlink(path)
