"""Checkpoints saved while training goes on: the handle of a save in the background, the staging ring
its state is copied into, and the engine's saves (at most one in flight, its error never lost).

[Note: saving in the background]
``engine.save_checkpoint(..., blocking=False)`` takes the state at the step boundary it is called at
and returns a ``SaveHandle`` (``wait()``, ``done()``, ``path``) while the files are written:
- *The step's updates* (step_updates' [Note: the step beside the next forward]) may still be running
  when the save is called. Where every part of this rank's file is written from where it lies (each
  optimizer block in host memory, stored as the checkpoint stores it: see below), the saves' staging
  thread waits for the last of them and then starts this rank's writes (``StepUpdates.last_update``,
  ``RankWriters.after_updates``: the parameters' optimizer steps read, each block's CRC32C taken and its
  O_DIRECT write submitted from where it lies), so they still run beside the next forward, as in a
  step without a save, and the writes land while it runs; otherwise (a blocking save, state on NVMe, a
  part to convert) the call joins them first.
- *On the calling thread* (``saving.begin_save``): ``<tag>.partial`` is made and its files opened
  (preallocated), the manifest's values (schedule, scaler, counters, client state),
  the RNG states and the module's buffers are taken, and the parts of this rank's data file are named:
  the master and moment shards of every unit. A block on NVMe that holds its checkpoint segments byte
  for byte (fp32 master and moments, no padding past the parameters) is left for a copy in the kernel;
  state held in memory (optimizer blocks resident: host or device) is left where it is for now; other
  state on NVMe is read block by block as a blocking save reads it (``ShardedState.visit``) and copied
  into the *staging ring* (``StagingRing``) as each block is loaded, its writes started at once.
- *On the saves' staging thread* (``zerooffload-save``, one per engine, at normal priority: the
  engine's next calls may wait for it): blocks on NVMe left for it are copied from the swap file to
  the rank file (``os.copy_file_range``), their CRC32C joined from the digests the swap store took as
  it wrote them (``SwapStore.copy_out``: never from bytes nobody read back); resident state is copied
  into the ring piece by piece, each piece's O_DIRECT write started as it is copied; when the ring is
  full the copy waits for its oldest writes to land; writes started from where the state lies are
  waited for. Then ``staged`` is set: until then the engine's next call that may change the state
  (``backward``, ``step``, ``load_checkpoint``, ``gathered``: ``Saves.check``) waits for it, so past
  the ring's room the next update waits for the writes; forward does not wait. Each piece's CRC32C is
  taken when its write ends (in file order: they end oldest first). Then, on the saves' publishing
  thread (``zerooffload-publish``, in the machine's idle time: threads' [Note: work in idle time];
  nothing waits for it before the next save or the end), the writes are waited for and the files
  fsynced, every rank's file records (or its error) gathered, rank 0 writes the manifest and its
  digest and publishes the tag (files' [Note: publishing a tag]), and a barrier closes it. At world size > 1 those collectives run on a gloo group made for the saves at
  the first one (``Saves._comm``), never on the engine's group, whose direct-exchange tags come from
  one sequence on the training thread.
- *The ring* is host memory of ``train.save_staging`` bytes at most, never more than this rank's state
  (``memory_plan.save_staging_bytes``, which the plan counts with ``train.async_save``), allocated at the
  first save in the background and kept for the next.
- *Crash consistency* is the blocking save's: ``latest`` moves only once every rank's files are
  durable, so a kill at any point leaves the previous tag intact and loadable.
- *Ordering*: a second save waits for the first; ``load_checkpoint``, ``close()`` and ``zerooffload
  train``'s end (and its SIGTERM save) wait for it.
- *Errors*: a failed write (ENOSPC, EFBIG, EIO) leaves nothing published. Its error surfaces at the
  next engine call (or ``wait()``, if that comes first) as the one line a blocking save would have
  raised; at world size > 1 every rank learns it through the gather, and the rank that raises ends
  the engine's group (comm's [Note: failing together]) so no peer waits for it.
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist

from ..comm import Comm
from ..memory_plan import save_staging_bytes
from ..threads import in_idle_time
from ..training_state import Trainable
from .files import ALIGN, StagingRing
from .saving import BegunSave, begin_save, save_checkpoint

if TYPE_CHECKING:
    from ..zero.step_updates import StepUpdates

__all__ = ["SaveHandle", "Saves"]


class SaveHandle:
    """A checkpoint being finished in the background (see the note): ``done()`` says whether it ended,
    ``wait()`` waits and returns its path or raises its error."""

    def __init__(self, begun: BegunSave, comm: Comm, stager: "_TaskThread", publisher: "_TaskThread"):
        self.path: Path = begun.path
        self.staged = begun.writers.staged
        """Set once the save reads nothing of the live state any more (``Saves.check``)."""
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self.reported = False
        """Whether its error was raised already (by ``wait``): the engine does not raise it again."""
        stager.put(lambda: (begun.writers.stage(), publisher.put(lambda: self._finish(begun, comm))))

    def _finish(self, begun: BegunSave, comm: Comm) -> None:
        try:
            begun.finish(comm)
        except BaseException as error:  # raised on the caller's thread by wait()
            self._error = error
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        """The published tag's path, once it is; the save's error, if it failed."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the save of {self.path} is still being written after {timeout} s")
        if self._error is not None:
            self.reported = True
            raise self._error
        return self.path


class Saves:
    """An engine's checkpoint saves and loads: at most one save in the background (see the note)."""

    def __init__(self, engine: Trainable, load: Callable[..., dict | None]):
        self.engine = engine
        self._load = load
        """``load(engine, directory, tag, verify=)``: ``checkpoint.load_checkpoint``, which knows every kind."""
        self.pending: SaveHandle | None = None
        self._ring: StagingRing | None = None
        self._save_comm: Comm | None = None
        self._previous: str | None = None
        """The checkpoint the engine named before the save in flight (``window.last_checkpoint``), its
        fallback if that one fails."""
        self._threads: tuple[_TaskThread, _TaskThread] | None = None
        """The saves' two threads, started at the first save in the background: one stages the state (what
        the engine's next calls may wait for), one in idle time publishes it (what nothing waits for)."""
        self.waited_seconds = 0.0
        """Time engine calls that may change the state waited for a save in the background to copy it
        (``check``): what saves held the caller for beyond ``save_checkpoint`` and the waits for their end."""

    def save(self, directory: str | os.PathLike, tag: str | None, client_state: dict | None, blocking: bool,
             updates: "StepUpdates") -> Path | SaveHandle:
        """``updates``: the step's, which may still run beside what follows the step (step_updates' note):
        joined before anything is read, or left to start the writes as they end (``begin_save``; see the
        note)."""
        self.wait()
        if blocking:
            path = save_checkpoint(self.engine, directory, tag, client_state, updates)
            self.engine.window.last_checkpoint = str(path)
            return path
        begun = begin_save(self.engine, directory, tag, client_state, ring=self._staging(), updates=updates)
        self._previous, self.engine.window.last_checkpoint = self.engine.window.last_checkpoint, str(begun.path)
        if self._threads is None:  # the same two for every save: starting one costs the caller a GIL switch
            self._threads = (_TaskThread("zerooffload-save", idle=False), _TaskThread("zerooffload-publish", idle=True))
        self.pending = SaveHandle(begun, self._comm(), *self._threads)
        return self.pending

    def load(self, directory: str | os.PathLike, tag: str | None, verify: bool) -> dict | None:
        self.wait()
        client_state = self._load(self.engine, directory, tag, verify=verify)
        self.engine.window.last_checkpoint = f"{directory} ({tag or 'latest'})"
        return client_state

    def check(self, call: str) -> None:
        """At every engine call: one that may change the state waits until a save in the background has
        copied it (``SaveHandle.staged``); a save that ended is settled, its error raised (once)."""
        if self.pending is not None and call in _CHANGES_STATE and not self.pending.staged.is_set():
            start = time.perf_counter()
            self.pending.staged.wait()
            self.waited_seconds += time.perf_counter() - start
        if self.pending is not None and self.pending.done():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight, if any; its error raises unless ``wait()`` raised it already."""
        handle, self.pending = self.pending, None
        if handle is None:
            return
        reported = handle.reported
        try:
            handle.wait()
        except BaseException:
            self.engine.window.last_checkpoint = self._previous  # named at the call: it holds the state then
            if reported:  # the caller's own wait() raised it: not lost, not raised twice
                return
            raise

    @contextlib.contextmanager
    def closing(self) -> Iterator[None]:
        """For ``close()``: wait for the save in flight, run the block (the release), then raise the
        save's error, if it failed."""
        try:
            self.wait()
        except BaseException as error:
            failure: BaseException | None = error
        else:
            failure = None
        self._stop_threads()
        yield
        if failure is not None:
            raise failure

    def _stop_threads(self) -> None:
        """End the saves' threads once their last tasks have returned, so that no save code runs while the
        process exits (a thread inside torch at interpreter exit can abort it: see the engine's close)."""
        if self._threads is not None:
            for thread in self._threads:
                thread.stop()
            self._threads = None

    def _staging(self) -> StagingRing:
        """The ring, made at the first non-blocking save: ``train.save_staging`` bytes, no more than this
        rank's state takes (``memory_plan.save_staging_bytes``: what the plan counts)."""
        if self._ring is None:
            layouts = [unit.layout for unit in self.engine.units]
            self._ring = StagingRing(max(ALIGN, save_staging_bytes(layouts, self.engine.config)))
        return self._ring

    def _comm(self) -> Comm:
        """The saves' own group (gloo over the engine's ranks), made at the first non-blocking save, which
        every rank calls on its training thread; none alone."""
        if self._save_comm is None:
            comm = self.engine.comm
            group = dist.new_group(list(range(comm.world_size)), backend="gloo") if comm.world_size > 1 else None
            self._save_comm = Comm(group, comm.rank, comm.world_size, torch.device("cpu"))
        return self._save_comm


_CHANGES_STATE = frozenset({"backward", "step", "load_checkpoint", "gathered"})
"""Engine calls that may change what a save reads (masters, moments, weights): forward does not."""


class _TaskThread:
    """One thread running tasks in turn (a task records its own failure), in the machine's idle time or
    not (threads' [Note: work in idle time])."""

    def __init__(self, name: str, idle: bool):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(idle,), name=name, daemon=True)
        self._thread.start()

    def put(self, task: Callable[[], object]) -> None:
        self._tasks.put(task)

    def stop(self) -> None:
        """Once the tasks put before have returned."""
        self._tasks.put(None)
        self._thread.join()

    def _run(self, idle: bool) -> None:
        if idle:
            in_idle_time()
        while (task := self._tasks.get()) is not None:
            task()
