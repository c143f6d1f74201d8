"""The step's updates beside the next forward: exact, unit by unit, each unit's use waiting for its own update.

[Note: the step beside the next forward]
Where an update needs the window's global norm (``train.grad_clip``) and its unit's optimizer state is in
memory (changed in place: no old version to go back to, so no tentative update in backward), ``engine.step``
updates the unit, and a step that ran those updates before returning left the device idle through every CPU
update. Instead the step takes the verdict (the norm, the clip coefficient: its one control all-reduce),
*prepares* each unit's update in forward order (the root unit first, whose module's hooks run first, then
the blocks in their order) and, once its bookkeeping is done (``start``: its stats taken, so the meter's
next window counts these updates' I/O whole), hands them to a worker of their own (update_worker's [Note:
the update worker]), which runs them one after the other beside whatever comes next: the caller's code, the
next forward. A unit is *published* once its update ran and what it wrote is home (its shard's store waited
for). The rules:
- *each use waits for its own unit*: the scheduler reads a partitioned unit's shard for its gather only once
  it is published (``ParamScheduler.updates``: reads ahead pass over units not yet published; a gather waits,
  so that every rank starts the same gathers in the same order); any other trainable unit's forward pre-hook
  waits for its update (``wait``), then, at stages 1–2, starts the all-gathers sent so far up to its own in
  the order sent (``Publication.start_gathers``, from the thread that issues collectives) and waits for its
  own;
- *exact*: each update is the one the step would have run: the same verdict and gradient (a unit's
  gradients are cleared only as its update ends), the learning rates and other group settings as they were
  at the step (``ZeroOptimizer.hyperparameters``: the LR scheduler moves on before the updates run);
  elementwise, so one native pass per unit is bitwise the step's pass over several (update's [Note: updates
  run together]);
- *joined before anything else uses the state*: the next backward (its gradients, its updates in backward),
  checkpoints' saves and loads, ``full_state_dict``, ``gathered`` and the state dicts, all collective, join
  them (``join``: every update, the rest of the all-gathers, the last optimizer block stored); ``close``
  waits for them and drops the all-gathers not started. A save in the background that writes the state
  from where it lies in host memory has its staging thread wait for the last update and start its writes
  then (``last_update``: async_save's note), so the updates still run beside the next forward;
- *a failure* drops the updates after it (they are never run), and its very exception (an ``AioError``'s one
  line naming file and offset) is raised by the next wait or join: in the next engine call that uses the
  state or the weights. The weights are then part-updated, as a step failing half-way leaves them;
- *where it applies*: the CPU updating state that lives off the device (``ZeroOptimizer.native``, every unit
  the step updates offloaded: on a CPU-only machine the device's state is the same cores' work, nothing to
  overlap) with ``optimizer.updates_in_flight`` > 0, unless a partitioned shard is read from its optimizer
  block's masters (fp32 with parameters and optimizer on NVMe: that block is stored only as the stream moves
  past it); elsewhere the step updates before it returns, as it did.
What it holds meanwhile: each unit's reduced gradient until its update ends (memory the step held anyway,
now beside the next forward's activations), the block stream's host buffers, and at stages 1–2 a
shard-sized gather input per unit until its gather starts.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from .partition import FlatUnit
from .publication import Publication
from .update_worker import UpdateState, UpdateWorker

__all__ = ["StepUpdates"]


class StepUpdates:
    """One step's updates at a time, run beside what follows the step (see the note)."""

    def __init__(self, units: list[FlatUnit], enabled: bool, device: torch.device):
        """``enabled``: ``optimizer.updates_in_flight`` > 0; the worker takes every unit's update at once (each
        holds only what the step holds anyway) and the round's last one."""
        self.enabled = enabled
        self.worker = UpdateWorker(len(units) + 1, device)
        self._prepared: list[tuple[FlatUnit, Callable[[], None], Callable[[], None]]] = []
        """Updates prepared by the step, in forward order, handed to the worker by ``start``."""
        self._submitted: dict[int, object] = {}
        """The round's updates handed to the worker and not yet waited for, by ``unit.index``."""
        self._round: set[int] = set()
        """The units whose gradients the round's updates clear (``holds``)."""
        self._publication: Publication | None = None
        self._stream: Iterator | None = None

    @property
    def running(self) -> bool:
        """A round was prepared and is not yet joined."""
        return self._publication is not None

    def begin(self, publication: Publication, stream: Iterator) -> None:
        """A round of updates sending through ``publication``, their optimizer blocks streamed by ``stream``."""
        assert not self.running, "a step's updates are joined before the next step prepares its own"
        self._publication, self._stream = publication, stream

    def prepare(self, unit: FlatUnit, run: Callable[[], None], release: Callable[[], None]) -> None:
        """``unit``'s update (``run``), then ``release`` (its gradients cleared) whatever it ended like."""
        self._prepared.append((unit, run, release))
        self._round.add(unit.index)

    def holds(self, unit: FlatUnit) -> bool:
        """Whether ``unit``'s gradients are the running round's, cleared as its update ends."""
        return unit.index in self._round

    def start(self) -> None:
        """Hand the prepared updates to the worker, in order (the step's bookkeeping is done)."""
        prepared, self._prepared = self._prepared, []
        for unit, run, release in prepared:
            self._submitted[unit.index] = self.worker.submit(unit.name, run, release)

    def pending(self, unit: FlatUnit) -> bool:
        """Whether ``unit`` is not yet published (a glance: it may be by the time the caller acts)."""
        update = self._submitted.get(unit.index)
        return any(u is unit for u, _, _ in self._prepared) or (
            update is not None and update.state is UpdateState.SUBMITTED)

    def wait(self, unit: FlatUnit) -> None:
        """``unit`` published, and at stages 1–2 its new weights all-gathered (see the note): the thread
        that issues collectives calls this, at the same point on every rank."""
        if not self.running:
            return
        self.start()
        update = self._submitted.pop(unit.index, None)
        if update is None:
            return
        try:
            self.worker.wait_for(update)
            self._publication.start_gathers(until=unit)
            self._publication.wait_gather(unit)
        except BaseException:
            self._abandon()
            raise

    def join(self) -> None:
        """Every update of the round done, its all-gathers done, its last optimizer block stored; the first
        failure raises. Collective (its all-gathers start here, in order): every rank calls it alike."""
        if not self.running:
            return
        self.start()
        try:
            self.worker.join()
            self._publication.finish()
        except BaseException:
            self._abandon()
            raise
        self._end()

    def last_update(self) -> Callable[[], bool]:
        """In place of ``join``, for a reader of the optimizer state on another thread (a save in the
        background writing it from where it lies): the prepared updates handed to the worker, and a wait,
        for that thread, until the last of them ended, returning whether every one ran (a failure is left
        for this thread's next wait or join). The round stays running: the next forward's waits and the
        next backward's join go on as without it."""
        if self.running:
            self.start()
        if not self.running or not self._submitted:
            return lambda: True
        last = next(reversed(self._submitted.values()))
        return lambda: self.worker.ended(last)

    def close(self) -> None:
        """The engine closes: wait for the updates (a failure raises, after), drop the all-gathers not started."""
        if not self.running:
            return
        try:
            self.worker.join()
        finally:
            self._abandon()

    def _abandon(self) -> None:
        """After a failure: the update running waited for, the rest dropped, the stream closed (its
        transfers waited for, its buffers freed), the all-gathers started waited for."""
        self.worker.abandon()
        self._stream.close()
        self._publication.abandon()
        self._end()

    def _end(self) -> None:
        self._prepared, self._submitted, self._round = [], {}, set()
        self._publication, self._stream = None, None
