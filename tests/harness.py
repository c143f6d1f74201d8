"""A pool of spawned gloo ranks that runs many test cases, so each test does not pay for spawning.

[Note: rank pool]
- A *pool* is ``world_size`` fresh processes that join one gloo process group (a ``FileStore`` in a
  temporary directory, a 60 s collective timeout) and then wait for *tasks*. They are forked by
  multiprocessing's *forkserver*, a clean process started once per session (like ``spawn``: nothing of
  pytest's process is inherited) that has imported zerooffload, torch and the engine already
  (tests/rank_preload.py), so a pool (re)starts in under a second instead of each rank importing them
  anew (~7 s a pool on a 2-core CI, paid again after every failure test). The forkserver never runs
  torch code itself: no intra-op thread pool exists yet to be forked.
- A *task* is a module-level function plus arguments; every rank runs it and sends back its result
  or its formatted traceback. ``RankPool.run`` returns the results in rank order.
- When a rank fails, crashes or overruns the task timeout, the others may be stuck in a collective
  that will never complete, so the pool waits a short grace period, kills every rank, raises
  ``RankFailure`` with all tracebacks, and respawns on the next task. Nothing hangs.
- A rank whose task ended the process group (the engine does when it raises: comm's [Note: failing
  together]) cannot run another, so the pool respawns on the next task then too.
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

PROCESS_GROUP_TIMEOUT = timedelta(seconds=60)
"""How long a collective may wait for a peer: long enough for a slow 2-core CI, short enough to fail."""
FAILURE_GRACE_S = 3.0
"""After the first failure, how long to wait for the other ranks' outcomes before killing them."""


class RankFailure(AssertionError):
    """One or more ranks raised, died or timed out; the message holds every rank's story."""


def _worker(rank: int, world_size: int, store_path: str, tasks: mp.Queue, results: mp.Queue) -> None:
    """A rank's main loop: join the group once, then run tasks until told to stop (``None``)."""
    import torch
    import torch.distributed as dist

    from zerooffload.log import configure_logging

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    configure_logging("WARNING")
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=PROCESS_GROUP_TIMEOUT)
    try:
        while (task := tasks.get()) is not None:
            task_id, fn, args, kwargs = task
            try:
                ok, value = True, fn(*args, **kwargs)
            except BaseException:  # the traceback must reach pytest whatever was raised
                ok, value = False, traceback.format_exc()
            results.put((task_id, rank, ok, value, dist.is_initialized()))
            if not dist.is_initialized():
                return  # the task ended the group: this rank can run no other (the pool respawns)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PRELOAD = ["rank_preload"]
"""What the forkserver imports once for every rank: tests/rank_preload.py says what and why."""


def fresh_process_context() -> mp.context.BaseContext:
    """The multiprocessing context that starts fresh processes with torch and the engine imported: the
    forkserver, started with tests/ on its path (it imports PRELOAD before it takes this process's
    sys.path, on Python 3.11, and would skip a module it cannot find, silently)."""
    from multiprocessing import forkserver

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)), previous]))
    try:
        forkserver.ensure_running()  # a no-op once it runs
    finally:
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous
    return context


class RankPool:
    """``world_size`` gloo ranks reused across tasks; see [Note: rank pool]."""

    def __init__(self, world_size: int, timeout: float = 120.0):
        self.world_size = world_size
        self.timeout = timeout
        self._context = fresh_process_context()
        self._task_ids = itertools.count()
        self._procs: list = []

    def _start(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="zo-ranks-")
        store_path = os.path.join(self._tmp.name, "store")
        self._results = self._context.Queue()
        self._tasks = [self._context.Queue() for _ in range(self.world_size)]
        self._procs = [self._context.Process(target=_worker, daemon=True, name=f"rank{r}",
                                             args=(r, self.world_size, store_path, self._tasks[r], self._results))
                       for r in range(self.world_size)]
        for proc in self._procs:
            proc.start()

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; the results in rank order, or ``RankFailure``."""
        if not self._procs:
            self._start()
        task_id = next(self._task_ids)
        for tasks in self._tasks:
            tasks.put((task_id, fn, args, kwargs))
        outcomes = self._collect(task_id, time.monotonic() + (timeout or self.timeout))
        failures = {r: o for r, o in outcomes.items() if not o[0]}
        if failures or len(outcomes) < self.world_size:
            self.close(force=True)
            raise RankFailure(self._report(fn, outcomes))
        if not all(group_alive for _, _, group_alive in outcomes.values()):
            self.close(force=True)  # a rank ended the process group: the next task starts afresh
        return [outcomes[r][1] for r in range(self.world_size)]

    def _collect(self, task_id: int, deadline: float) -> dict[int, tuple[bool, Any, bool]]:
        """Outcomes (ok, value, group still alive) by rank until all arrive, the deadline passes, or the
        grace after a failure ends."""
        outcomes: dict[int, tuple[bool, Any, bool]] = {}
        while len(outcomes) < self.world_size and time.monotonic() < deadline:
            try:
                got_id, rank, ok, value, group_alive = self._results.get(timeout=0.2)
            except queue.Empty:
                for rank, proc in enumerate(self._procs):
                    if rank not in outcomes and not proc.is_alive():
                        outcomes[rank] = (False, f"rank {rank} died with exit code {proc.exitcode}\n", False)
            else:
                if got_id == task_id:
                    outcomes[rank] = (ok, value, group_alive)
            if any(not ok for ok, _, _ in outcomes.values()):
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        return outcomes

    def _report(self, fn: Callable, outcomes: dict[int, tuple[bool, Any, bool]]) -> str:
        lines = [f"{fn.__name__} on {self.world_size} ranks:"]
        for rank in range(self.world_size):
            ok, value, _ = outcomes.get(rank, (False, "no result (timed out or blocked behind a failed rank)\n", False))
            lines.append(f"--- rank {rank}: " + ("ok" if ok else f"FAILED\n{value}"))
        return "\n".join(lines)

    def close(self, force: bool = False) -> None:
        """Stop every rank and remove the store; ``force`` kills at once (ranks may be stuck in a collective)."""
        for proc, tasks in zip(self._procs, self._tasks):
            if proc.is_alive() and not force:
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=0 if force else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self._procs:
            self._tmp.cleanup()
        self._procs = []
