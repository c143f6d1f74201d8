"""The update worker: units' updates in backward run off the autograd thread, in order, a bounded number at once.

[Note: the update worker]
An update in backward (backward_updates' [Note: updates in backward]) needs its unit's reduced gradient,
its optimizer block and the unit's weights, none of which the rest of that backward touches (a unit is
reduced after its last use in it). So the autograd thread hands the update to one worker thread and goes
on with the next unit's backward, while the update's CPU work (the native Adam pass releases the GIL), its
optimizer block's I/O and the new weights' store run beside it. Each unit's update is, in turn::

    SUBMITTED --the worker runs it--> DONE
    SUBMITTED --it raises--> FAILED          (the first failure is kept for the next join)
    SUBMITTED --an earlier one FAILED, or the backward is abandoned--> DROPPED    (never run)

A DONE, FAILED or DROPPED update has let go of what it held (``release``: its unit's gradient). The rules:
- *one owner*: the ``BackwardUpdates`` of the running backward submits, in the reducer's order, and joins;
  the worker runs the updates one at a time in that order (the optimizer blocks stream in it);
- *bounded*: at most ``depth`` (``optimizer.updates_in_flight``) updates SUBMITTED at once, each holding its
  unit's reduced gradient; a submission past that waits for the oldest. Depth 0 is no worker: each update
  runs in the autograd thread as it is submitted (the synchronous path, bitwise the same);
- *joined before any use*: ``join`` waits until none is SUBMITTED and raises the first failure. The window
  joins when the backward's reductions end (before the kept gradients' writer finishes): the step,
  checkpoints, ``full_state_dict``, the next gathers and ``close`` all come after it;
- *never lost, never a hang*: a failure is raised, the very exception (its one line as the autograd thread
  would have raised it), by the next submission, ``wait_for`` or join, and the updates after it are DROPPED
  until that join; ``abandon`` (the backward failed) waits for the update running, drops the rest and
  raises nothing, so the error being raised stays the one to see;
- *no collectives*: ranks must issue collectives in one order, which only the autograd thread decides, so a
  worker's all-gathers wait for ``Publication.finish`` (publication's ``off_thread``).
A reader of the updated state on another thread (a save in the background) waits until one update ended
(``ended``): told whether it ran, never taking the owner's failure.
The thread lives from a backward's first submission to its join or abandon: none outlives its backward.
The step's updates run on a worker of their own, the same way (step_updates' [Note: the step beside the next
forward]): there ``wait_for`` waits for one unit's update, and its thread lives until the next join.
Its updates are the ``updates`` track of a step trace (trace's note), its waits on transfers red in it; a
torch.profiler run sees its labels when it profiles every thread (trace's ``profiled``).
"""
from __future__ import annotations

import enum
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from ..trace import RECORDER

__all__ = ["UpdateState", "UpdateWorker"]


class UpdateState(enum.Enum):
    """Where one unit's update is (see [Note: the update worker])."""

    SUBMITTED = "submitted"
    """Handed to the worker: waiting, or running now."""
    DONE = "done"
    """Ran to its end; what it wrote may be read."""
    FAILED = "failed"
    """Raised; its exception waits for the next join (the first failure only)."""
    DROPPED = "dropped"
    """Never ran: an earlier update failed, or the backward was abandoned."""


@dataclass(eq=False, slots=True)
class _Update:
    name: str
    run: Callable[[], None]
    release: Callable[[], None]
    state: UpdateState = UpdateState.SUBMITTED


class UpdateWorker:
    """Runs submitted updates on one thread, at most ``depth`` at once (see the note)."""

    def __init__(self, depth: int, device: torch.device):
        """``device``: the compute device, current in the worker thread (a CUDA rank's own GPU)."""
        if depth < 0:
            raise ValueError(f"depth = {depth}: at least 0 (0: updates run where they are submitted)")
        self.depth, self.device = depth, device
        self._cond = threading.Condition()
        self._queue: deque[_Update] = deque()
        """SUBMITTED updates, oldest first; the worker runs the first and removes it when it ends."""
        self._error: BaseException | None = None
        self._abandoned = False
        self._failed = False
        """An update FAILED since the last join or abandon: the later ones are DROPPED, even once its
        exception was raised (by ``submit`` or ``wait_for``)."""
        self._stopping = False
        """The queue drained and the thread is told to end (``_stop``): set and read under ``_cond``."""
        self._thread: threading.Thread | None = None
        self.busy_seconds = 0.0
        """Time the worker spent running updates (for benchmarks: what could hide)."""
        self.wait_seconds = 0.0
        """Time the submitting thread waited for the worker (room to submit, or a join): what did not hide."""

    @property
    def in_flight(self) -> int:
        """Updates SUBMITTED now."""
        return len(self._queue)

    def submit(self, name: str, run: Callable[[], None], release: Callable[[], None]) -> _Update:
        """Run ``run`` (the update of unit ``name``), then ``release`` whatever it ended like; returns the
        update (for ``wait_for``). Raises an earlier update's failure instead (``release`` is then called here)."""
        update = _Update(name, run, release)
        if self.depth == 0:
            self._execute(update)
            if update.state is UpdateState.FAILED:
                self._failed = False  # raised here and now: the next submission runs
                self._raise_failure()
            return update
        try:
            with self._cond:
                self._wait_while(lambda: len(self._queue) >= self.depth and self._error is None)
                self._raise_failure()
                self._queue.append(update)
                self._cond.notify_all()
        except BaseException:
            update.release()
            raise
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="zerooffload-update", daemon=True)
            self._thread.start()
        return update

    def wait_for(self, update: _Update) -> None:
        """Wait until ``update`` (and so every one before it) is no longer SUBMITTED and has let go of what it
        held; raise the first failure, if it did not end DONE."""
        with self._cond:
            self._wait_while(lambda: update in self._queue)
        if update.state is not UpdateState.DONE:
            self._raise_failure()

    def ended(self, update: _Update) -> bool:
        """Wait, on any thread, until ``update`` (and so every one before it) ended; whether it ended DONE.
        For a reader of the updated state (a save's staging thread): it raises nothing and takes no failure
        from the owner, whose next wait or join raises it, and its wait is not the owner's (``wait_seconds``)."""
        with self._cond:
            while update in self._queue:
                self._cond.wait()
        return update.state is UpdateState.DONE

    def join(self) -> None:
        """Wait until no update is SUBMITTED and the thread ended; raise the first failure, if any."""
        self._stop()
        self._failed = False
        self._raise_failure()

    def abandon(self) -> None:
        """The backward failed: wait for the update running, drop the others, and raise nothing."""
        with self._cond:
            self._abandoned = True
        self._stop()
        self._error, self._abandoned, self._failed = None, False, False

    def _stop(self) -> None:
        if self._thread is None:
            return
        with self._cond:
            self._wait_while(lambda: bool(self._queue))
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        self._thread, self._stopping = None, False

    def _wait_while(self, condition: Callable[[], bool]) -> None:
        """Wait (holding ``_cond``) while ``condition()``: time the updates did not hide (``wait_seconds``,
        the trace)."""
        if not condition():
            return
        start = time.perf_counter()
        while condition():
            self._cond.wait()
        end = time.perf_counter()
        self.wait_seconds += end - start
        RECORDER.complete("wait: updates", "waits", start, end)

    def _raise_failure(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _loop(self) -> None:
        """The worker thread: the oldest update in turn, until told to stop with none left."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread's current device is the first GPU, not this rank's
        RECORDER.redirect_waits("updates")
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                update = self._queue[0]
            self._execute(update)
            with self._cond:
                self._queue.popleft()
                self._cond.notify_all()

    def _execute(self, update: _Update) -> None:
        """Run one update (or drop it after a failure or an abandon), then release what it held."""
        start = time.perf_counter()
        try:
            if self._failed or self._abandoned:
                update.state = UpdateState.DROPPED
                return
            update.run()
            update.state = UpdateState.DONE
        except BaseException as error:  # kept for the next join: never lost
            update.state = UpdateState.FAILED
            self._error, self._failed = error, True
        finally:
            update.release()
            end = time.perf_counter()
            if update.state is not UpdateState.DROPPED:
                self.busy_seconds += end - start
                RECORDER.complete(f"update {update.name}", "updates", start, end, state=update.state.value)
