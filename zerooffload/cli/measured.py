"""What a run really used, measured apart from the engine's own accounting (summary.json's ``measured``).

[Note: measured peaks]
- *Memory*: the process's peak resident set (the kernel's ``VmHWM``) above its RSS when the engine
  was about to be built, the peak reset to that moment first (``/proc/self/clear_refs``), so a plan's
  timed block or the model's meta build before it does not count. The heap's free pages go back to
  the OS first (``malloc_trim``): pages a plan freed but glibc kept would otherwise serve the run's
  first allocations without raising the RSS, and the same run read 398 MB after a plan, 655 MB
  without one. The modules the engine's meta forward imports on first use (torch's symbolic shapes,
  sympy: ~70 MB of Python objects, the same whatever the model) are imported before the start too:
  a process's imports are not what a layout costs. On a CPU device the device and host
  tiers are one RAM, so this one figure stands against their sum, activations and torch's temporaries
  included; on CUDA the device's own peak stands against the device tier, and the RSS against the
  host's. That peak is what torch's caching allocator reserved (``max_memory_reserved``): the memory
  the process took from the GPU, which ``memory.device_budget`` caps (device_memory's note), not the
  smaller sum of live tensors (``max_memory_allocated``) that fragmentation and cached blocks exceed.
- *Disk*: the blocks the run's swap files hold (``st_blocks``), preallocation included: what the disk
  really gave the run.
Where ``clear_refs`` cannot be written (a kernel or container without it), the peak is taken over the
process's life (``ru_maxrss``), which can only read higher.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import resource
from pathlib import Path

import psutil
import torch

from ..tiers.host_allocator import return_free_heap

__all__ = ["RunMemory"]


class RunMemory:
    """The RAM, device memory and swap files a run uses from its construction on (see the note)."""

    def __init__(self) -> None:
        importlib.import_module("torch.fx.experimental.symbolic_shapes")  # see the note
        return_free_heap()
        self.reset = False
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
            self.reset = True
        self.start = psutil.Process().memory_info().rss
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def peak_ram(self) -> int:
        """Peak RSS above ``start`` (see the note)."""
        return _peak_rss(self.reset) - self.start

    def peaks(self, swap_dirs: list[str]) -> dict[str, int]:
        """Bytes per tier as measured: ``device+host`` (one RAM) on a CPU device, else ``device`` and
        ``host``; and ``nvme``, the blocks this process's swap files hold under ``swap_dirs``."""
        ram = self.peak_ram()
        memory = {"device": torch.cuda.max_memory_reserved(), "host": ram} if torch.cuda.is_available() else {
            "device+host": ram}
        return {**memory, "nvme": swap_file_bytes(swap_dirs)}


def _peak_rss(reset: bool) -> int:
    if reset:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def swap_file_bytes(swap_dirs: list[str]) -> int:
    """Bytes of disk held by this process's swap files (their names carry its PID: swapfile's note)."""
    pid = os.getpid()
    return sum(path.stat().st_blocks * 512 for directory in swap_dirs
               for path in Path(directory, "zerooffload-swap").glob(f"*.{pid}.*.swap"))
