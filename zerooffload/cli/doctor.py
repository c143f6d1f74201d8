"""``zerooffload doctor``: what this machine offers the engine, one line per check.

Each check tries the real thing (a ring set up, an O_DIRECT block written) because the usual
failures — io_uring disabled in a container, a swap path on tmpfs, a missing native build — look
fine from version numbers. A *fail* makes the tool unusable as configured; a *warn* costs speed.
"""
from __future__ import annotations

import enum
import errno
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import Config
from ..io.probe import mount_of, native_aio, probe_io_uring, probe_o_direct
from ..io.swap_space import PRIVATE_DIR

__all__ = ["Status", "Check", "run_checks"]

_SIMD_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "asimd", "sve")
_MIN_FREE_BYTES = 1 << 30
_UNWRITABLE = {errno.EROFS: "read-only filesystem", errno.EACCES: "permission denied",
               errno.EPERM: "permission denied"}
"""Errnos of a probe that could not create its file, and the words for them."""


class Status(enum.Enum):
    OK = "ok"
    """Works as the engine wants it."""
    WARN = "warn"
    """Works, but slower or with less than the engine could use."""
    FAIL = "FAIL"
    """The engine cannot run as configured; the detail says what to change."""


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str


def run_checks(config: Config) -> list[Check]:
    """All checks, in the order they are printed."""
    return [_python(), _torch(), _threads(config), _native_aio(), _native_adam(), _io_uring(), _aio_backend(config),
            *_swap_paths(config), _cuda(), _simd()]


def _python() -> Check:
    ok = sys.version_info >= (3, 11)
    return Check("python", Status.OK if ok else Status.FAIL,
                 f"{platform.python_version()}" + ("" if ok else " (zerooffload needs 3.11 or newer)"))


def _torch() -> Check:
    try:
        import torch
    except ImportError as exc:
        return Check("torch", Status.FAIL, f"cannot import torch ({exc}); pip install torch")
    import torch.distributed as dist

    backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
    return Check("torch", Status.OK, f"{torch.__version__}, distributed backends: {', '.join(backends) or 'none'}")


def _threads(config: Config) -> Check:
    """torch's thread count as ``train.threads`` leaves it, and how OpenMP threads wait (threads' note)."""
    import torch

    from ..threads import openmp_wait

    count = config.train.threads or torch.get_num_threads()
    source = "train.threads" if config.train.threads else "torch's default"
    return Check("threads", Status.OK, f"{count} CPU threads ({source}); OpenMP waiting: {openmp_wait()}")


_REBUILD = "Reinstall with a C compiler: pip install -e ."


def _native_aio() -> Check:
    """The async-I/O extension (io_uring and the pool); built and loaded apart from the Adam one."""
    native, reason = native_aio()
    if native is None:
        return Check("native I/O", Status.WARN, f"{reason}; I/O falls back to the python backend. {_REBUILD}")
    return Check("native I/O", Status.OK, f"zerooffload._aio loaded from {Path(native.__file__).name}")


def _native_adam() -> Check:
    """The fused CPU Adam extension, and the instruction set its pass runs on."""
    from ..optim import simd_level

    try:
        from .. import _cpu_adam
    except ImportError as exc:
        return Check("native Adam", Status.WARN, f"the native extension zerooffload._cpu_adam is not built ({exc}); "
                                                 f"the optimizer step runs as torch ops (slower). {_REBUILD}")
    try:
        level = simd_level()
    except ValueError as exc:  # a ZO_ADAM_SIMD that names no level: every step would raise it
        return Check("native Adam", Status.FAIL, str(exc))
    return Check("native Adam", Status.OK, f"zerooffload._cpu_adam loaded from {Path(_cpu_adam.__file__).name}; "
                                           f"SIMD: {level}")


def _io_uring() -> Check:
    """The native engine's own probe, the one ``auto`` asks (probe.py); the Python stand-in only without it."""
    probe = probe_io_uring()
    if native_aio()[0] is None:  # whatever the kernel offers, the uring backend is native
        return Check("io_uring", Status.WARN, probe.detail + "; the uring backend needs it built")
    return Check("io_uring", Status.OK if probe.ok else Status.WARN,
                 probe.detail + ("" if probe.ok else "; the pool backend (threads + pread/pwrite) is used instead"))


def _aio_backend(config: Config) -> Check:
    """The backend ``aio.backend`` resolves to here, by starting it."""
    from ..io import AsyncIO

    try:
        with AsyncIO(config.aio) as aio:
            backend = aio.backend
    except (OSError, RuntimeError, ValueError) as exc:
        return Check("aio backend", Status.FAIL, f"aio.backend = {config.aio.backend!r}: {exc}")
    slow = backend in ("python", "aiofiles")
    hint = " (the slowest; build the native extension zerooffload._aio)" if slow else ""
    return Check("aio backend", Status.WARN if slow else Status.OK, f"{config.aio.backend} -> {backend}{hint}")


def _swap_paths(config: Config) -> list[Check]:
    """Every swap directory the config names, each under the key that names it; nothing is created."""
    keys = dict.fromkeys(config.nvme.paths, "nvme.path")
    for name in ("param", "optimizer"):
        if path := getattr(config.offload, name).path:
            keys.setdefault(path, f"offload.{name}.path")
    return [_swap_path(directory, key) for directory, key in keys.items()]


def _swap_path(directory: str, key: str) -> Check:
    """What the swap store would meet in ``directory``, and the free space of the filesystem it is on.

    The directory must exist (the store never creates it: a disk that is not mounted would send the swap
    to the root disk). The O_DIRECT probe writes where the store writes, in ``zerooffload-swap/`` when that
    already exists, and removes its file, so the filesystem is left as it was found.
    """
    name = f"swap path {directory}"
    if not os.path.exists(directory):
        return Check(name, Status.FAIL, f"does not exist: mount the disk meant to be there or create the directory, "
                                        f"or set {key} to an existing one")
    if not os.path.isdir(directory):
        return Check(name, Status.FAIL, f"is not a directory: set {key} to a directory")
    private = os.path.join(directory, PRIVATE_DIR)
    target = private if os.path.isdir(private) else directory
    probe = probe_o_direct(target)
    if probe.errno in _UNWRITABLE:
        return Check(name, Status.FAIL, f"{target} is not writable ({_UNWRITABLE[probe.errno]}): choose a "
                                        f"writable {key}")
    free = shutil.disk_usage(directory).free
    detail = f"{probe.detail}; {_filesystem(directory)}: {free / 1e9:.1f} GB free"
    if not probe.ok:
        return Check(name, Status.FAIL, detail + f"; set {key} to a directory on a disk filesystem (ext4, xfs), "
                                                 "or aio.direct = false")
    if free < _MIN_FREE_BYTES:
        return Check(name, Status.WARN, detail + " (less than 1GiB: NVMe offload will not fit)")
    return Check(name, Status.OK, detail)


def _filesystem(directory: str) -> str:
    """``ext4 at /mnt/nvme (device /dev/nvme0n1)``: which disk the free space is measured on."""
    mount = mount_of(directory)
    return "unknown filesystem" if mount is None else f"{mount.fstype} at {mount.point} (device {mount.source})"


def _cuda() -> Check:
    import torch

    if not torch.cuda.is_available():
        return Check("cuda", Status.OK, "no CUDA device: compute on the CPU, collectives over gloo")
    devices = [f"{i}: {torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 1e9:.0f} GB)"
               for i in range(torch.cuda.device_count())]
    return Check("cuda", Status.OK, f"CUDA {torch.version.cuda}; " + "; ".join(devices))


def _simd() -> Check:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    found = [f for f in _SIMD_FLAGS if f in flags]
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return Check("cpu", Status.OK, f"{platform.machine()}, SIMD: {', '.join(found) or 'none found'}; "
                                   f"torch kernels: {capability}")
