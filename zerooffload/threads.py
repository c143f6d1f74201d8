"""How torch's CPU threads wait, decided before torch loads, and how many there are.

[Note: spinning under contention]
torch's CPU kernels run on OpenMP (libgomp), whose threads spin for a while at the end of every
parallel region before they sleep (GOMP_SPINCOUNT, 300,000 turns by default). On a machine whose
cores are busy with other work, a spinning thread burns the timeslice its sibling needs to finish
the region: measured here (2 cores, two busy processes beside it, `bench/threads_contention.py`),
`zerooffload train --steps 30` took 2.9x as long as with OMP_NUM_THREADS=1. With a short spin
(GOMP_SPINCOUNT=10000) the same run took 0.94x the single-thread time, and on an idle machine
1.07x the default's (median of 5 pairs), so the short spin is chosen only when the machine is busy
as zerooffload loads: a 1-minute load average of at least half the CPUs. libgomp reads the setting
once, when torch loads, so this runs first thing in ``import zerooffload``; a setting of the user's
(GOMP_SPINCOUNT or OMP_WAIT_POLICY in the environment) is never overridden, and nothing changes
when torch was imported first. ``train.threads`` sets torch's thread count (0: torch's default).

[Note: work in idle time]
Work beside training that nothing waits for and that has seconds to finish (a checkpoint's publication:
its writes landed, fsync, manifest, rename) runs on a thread of the lowest scheduling class (Linux
``SCHED_IDLE``): it gets a core only when no other thread of the machine wants it. On a machine whose
cores all run torch's threads, a normal thread's few milliseconds preempt one of them, and the other
waits for it at the parallel region's end, so the step loses more than the thread ran. In idle time it
runs in the step's gaps (Python between kernels, waits for the link or the disk) instead. Work that
training will wait for must not be there: a blocked training thread does not free a core for it while
torch's other threads spin and the step's I/O threads run (a save's copy of NVMe state, in idle time,
held the loop 332 ms a save, at normal priority 77 ms), so a save stages the state on a thread
of normal priority and publishes it on one in idle time (async_save's note). The class keeps a small
share of a busy core (CFS weight 3 against a normal thread's 1024), so the idle thread is never starved
for good. Where the class does not exist (not Linux) the thread keeps its priority.
"""
from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["choose_openmp_wait", "in_idle_time", "openmp_wait", "set_threads"]

SHORT_SPIN = "10000"
"""GOMP_SPINCOUNT under contention: a short spin, then sleep (see the note)."""

_decision = "libgomp's default spin (the machine was not busy as zerooffload loaded)"


def choose_openmp_wait() -> None:
    """Shorten OpenMP's spin when the machine is busy and nobody chose; before torch loads only."""
    global _decision
    if "torch" in sys.modules:
        _decision = "as torch was loaded with (it was imported before zerooffload)"
        return
    chosen = {k: os.environ[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if k in os.environ}
    if chosen:
        _decision = "yours: " + ", ".join(f"{k}={v}" for k, v in chosen.items())
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load >= cpus / 2:
        os.environ["GOMP_SPINCOUNT"] = SHORT_SPIN
        _decision = (f"GOMP_SPINCOUNT={SHORT_SPIN}: the machine was busy (load {load:.1f} on {cpus} CPUs), and "
                     "spinning threads slow each other down there")


def openmp_wait() -> str:
    """What ``choose_openmp_wait`` decided, for ``doctor``."""
    return _decision


def set_threads(threads: int) -> None:
    """``train.threads``: torch's intra-op threads, when the user sets a number (0 keeps torch's)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def in_idle_time() -> None:
    """Let the calling thread run only on cores nothing else wants ([Note: work in idle time]), where the
    system has that class."""
    if hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread alone (Linux: per thread)
