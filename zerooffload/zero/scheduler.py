"""The prefetching scheduler: when each partitioned unit's parameters are gathered and freed (stage 3).

[Note: uses, passes and the trace]
- A *use* is one unit's forward (from its pre-hook to its post-hook) or its backward (from the first
  gradient of its outputs to the gradient of its inputs); ``acquire`` starts one, ``release`` ends it.
  A unit is *live* while gathered or being gathered; live bytes count toward ``zero.max_live_size``.
- A *pass* is a training forward and its backward. The first pass records the order of its uses, the
  *trace*. Later passes check every use against it and, at each use, start the all-gathers of the next
  units along it: those within ``zero.prefetch_size`` bytes of upcoming units, as long as the live
  bytes stay within ``max_live_size``. A use that differs from the trace invalidates it (logged with
  the position and both units); that pass goes on fetching on demand and the next records anew.
- When a use ends the unit is freed, unless the trace says it is used again within the prefetch
  window: then it stays gathered (a unit called twice, or the last block between forward and backward).
- Evaluation forwards (no grad, or ``module.eval()``) fetch on demand and neither read nor write the
  trace. ``end_pass`` frees every live unit, so each pass starts with only the persistent units.
- Ranks issue the same all-gathers in the same order: the trace, the uses and the byte sizes are the
  same on every rank, and nothing here depends on timing.
- A shard whose home is not resident (``offload.param.tier = "nvme"``) is first *staged*: read into a
  host buffer. Reads run further ahead than all-gathers, over twice the prefetch window, since they
  need no agreement between ranks; an all-gather waits for its shard's read if it is still running.
  A shard in host memory is copied to the device when its all-gather starts (``tiers.DeviceCopier``:
  on CUDA a side stream and an event; the host buffer is let go only once the copy is done).
- How a gather runs is ``gathers``' business: over every rank, quantized under ``zero.quantized_weights``,
  or under hpZ, for a unit gathered before in this training pass, within the node from its secondary
  shards (gathers' [Note: secondary shards]); such a unit needs no read and no copy of its shard.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch

from ..comm import Comm
from ..block_stream import InFlight, wait_each
from ..config import ConfigError
from ..tiers import DeviceCopier, Kind, Tier
from ..trace import profiled
from .gathers import Gathers
from .partition import FlatUnit, ParamState

__all__ = ["PrefetchStats", "ParamScheduler", "gathered_bytes", "check_live_bound"]

logger = logging.getLogger(__name__)


def gathered_bytes(unit: FlatUnit) -> int:
    """Bytes a unit holds while gathered: its full padded buffer in the compute dtype."""
    return unit.layout.padded_numel * unit.compute_dtype.itemsize


def _live(unit: FlatUnit) -> bool:
    """Gathered or being gathered: its full buffer's bytes count toward ``zero.max_live_size``."""
    return unit.param_state is not ParamState.SHARDED


def check_live_bound(units: list[FlatUnit], max_live_bytes: int) -> None:
    """Refuse up front a ``zero.max_live_size`` that cannot hold what must be gathered at once.

    The root unit's module is the whole model, so the root stays gathered while each block computes:
    the bound must hold the root plus the largest other unit.
    """
    root = next((gathered_bytes(u) for u in units if not u.layout.name), 0)
    for unit in units:
        need = gathered_bytes(unit) + (root if unit.layout.name else 0)
        if need > max_live_bytes:
            what = (f"unit {unit.layout.name!r} ({gathered_bytes(unit)} bytes gathered) inside the root unit "
                    f"({root} bytes), which stays gathered around it" if unit.layout.name and root
                    else f"unit {unit.layout.name or '<root>'!r} ({gathered_bytes(unit)} bytes gathered)")
            raise ConfigError(f"zero.max_live_size = {max_live_bytes} bytes cannot hold {what}: raise zero.max_live_size "
                              f"to at least {need}, or keep small units gathered with zero.persist_threshold")


@dataclass(slots=True)
class PrefetchStats:
    """What the scheduler did since the last ``reset`` (training passes only)."""

    gathers: int = 0
    """All-gathers started (on demand or ahead)."""
    hits: int = 0
    """Uses whose unit was already gathered or in flight when needed."""
    misses: int = 0
    """Uses that had to start their unit's all-gather themselves."""
    wait_seconds: float = 0.0
    """Time blocked waiting for all-gathers to finish."""
    peak_live_bytes: int = 0
    """Most gathered bytes held at once."""
    read_wait_seconds: float = 0.0
    """Time blocked waiting for parameter shards to arrive from NVMe."""

    def reset(self, live_bytes: int) -> None:
        self.gathers = self.hits = self.misses = 0
        self.wait_seconds = self.read_wait_seconds = 0.0
        self.peak_live_bytes = live_bytes


class ParamScheduler:
    """Gathers and frees the partitioned units of one engine (see [Note: uses, passes and the trace])."""

    def __init__(self, comm: Comm, units: list[FlatUnit], tier: Tier, host_tier: Tier, *, prefetch_bytes: int,
                 max_live_bytes: int, copier: DeviceCopier | None = None):
        """``copier`` brings shards that live off the device (``offload.param.tier`` host or NVMe) to it."""
        self.comm = comm
        self.gathers = Gathers(comm, units, tier)
        """How the all-gathers run, as the units' placements say (ZeRO++'s qwZ and hpZ)."""
        self.copier = copier
        self.units = units
        self.tier = tier
        self.host_tier = host_tier
        self._staged = InFlight(depth=max(1, len(units)))
        """Shards being read into host buffers, by unit: bounded by the byte window, not by a count."""
        self.prefetch_bytes = prefetch_bytes
        self.max_live_bytes = max_live_bytes
        self._position = {u.index: position for position, u in enumerate(units)}
        """Each unit's position in ``units`` (what the trace and the per-unit lists hold), by ``unit.index``."""
        self._in_flight: dict[int, tuple[Any, list[Callable[[], None]]]] = {}
        self._active = [0] * len(units)
        self.live_bytes = 0
        self.trace: list[int] | None = None
        self._recording: list[int] | None = None
        self._trace_position = 0
        self._training = False
        self.stats = PrefetchStats()
        self.updates = None
        """The step's updates that may still run beside this pass (``StepUpdates``, set by the updater): a
        shard is read only once its unit's update is done (step_updates' [Note: the step beside the next
        forward]); reads ahead pass over units not yet updated, gathers wait, in the trace's order."""

    # ------------------------------------------------------------------ passes
    def begin_pass(self, training: bool) -> None:
        """A forward starts; a training one follows (or records) the trace."""
        if self._training:
            self.end_pass()  # the previous training forward had no backward through the engine
        self._training = training
        self._trace_position = 0
        if training and self.trace is None:
            self._recording = []

    def end_pass(self) -> None:
        """Backward is over: keep a freshly recorded trace and free every live unit."""
        if self._training and self._recording is not None:
            self.trace, self._recording = self._recording, None
            logger.debug("recorded a trace of %d unit uses", len(self.trace))
        self._training = False
        self.free_all()

    def abandon_pass(self) -> None:
        """A training forward whose backward will not run (the engine skips a window): a trace being
        recorded is dropped, since one without backward would mislead the next pass, and every live
        unit is freed."""
        self._recording = None
        self._training = False
        self.free_all()

    # ------------------------------------------------------------------ uses
    def acquire(self, unit: FlatUnit) -> None:
        """``unit`` is about to compute: make it gathered, then fetch ahead along the trace."""
        index = self._position[unit.index]
        self._follow_trace(index)
        if self._training:
            if _live(unit):
                self.stats.hits += 1
            else:
                self.stats.misses += 1
        if not _live(unit):
            self._make_room(gathered_bytes(unit))
            self._launch(index)
        self._wait(index)
        self._active[index] += 1
        self._prefetch()

    def release(self, unit: FlatUnit) -> None:
        """A use of ``unit`` ended: free it unless it is used again soon (and no other use is open)."""
        index = self._position[unit.index]
        if self._active[index] == 0:
            return  # its pass already ended (end_pass freed it)
        self._active[index] -= 1
        if self._active[index] == 0 and index not in self._window():
            self._free(index)

    def stage_first_units(self) -> None:
        """After the step: start reading the shards the next pass uses first, while nothing else runs.

        Only reads, which need no agreement between ranks; the all-gathers stay at their uses.
        """
        for index in self._ahead(0, scale=2):
            self._stage(index)

    def gather_all(self) -> None:
        """Every unit gathered at once, outside any pass (``engine.gathered``): not bounded by max_live_size."""
        for index, unit in enumerate(self.units):
            if not _live(unit):
                self._launch(index)
        for index in list(self._in_flight):
            self._wait(index)

    def free_all(self) -> None:
        """Free every live unit and every staged shard, waiting for every all-gather and read in flight
        first (all of them, even after one fails; the first failure raises once all are done)."""
        try:
            wait_each([partial(self._wait, index) for index in list(self._in_flight)])
        finally:
            wait_each([self._unstage_oldest] * len(self._staged))
        for index, unit in enumerate(self.units):
            self._active[index] = 0
            if _live(unit):
                self._free(index)
        self.gathers.drop(self.units)

    # ------------------------------------------------------------------ the trace
    def _follow_trace(self, index: int) -> None:
        if not self._training:
            return
        if self._recording is not None:
            self._recording.append(index)
            return
        if self.trace is None:
            return
        expected = self.trace[self._trace_position] if self._trace_position < len(self.trace) else None
        if expected == index:
            self._trace_position += 1
            return
        logger.info("unit order changed at use %d (trace: %s, now: %s): prefetch is off until the next pass "
                    "records a new trace", self._trace_position, self._name(expected), self._name(index))
        self.trace = None

    def _window(self, scale: int = 1) -> list[int]:
        """Units this training pass uses next along the trace, within ``scale × prefetch_size`` bytes."""
        if not self._training or self._recording is not None:
            return []
        return self._ahead(self._trace_position, scale)

    def _ahead(self, position: int, scale: int) -> list[int]:
        """Units used from ``position`` on along the trace, within ``scale × prefetch_size`` bytes (none
        without a trace)."""
        window: list[int] = []
        budget = scale * self.prefetch_bytes
        for index in self.trace[position:] if self.trace is not None else []:
            if index in window:
                continue
            budget -= gathered_bytes(self.units[index])
            if budget < 0:
                break
            window.append(index)
        return window

    def _prefetch(self) -> None:
        for index in self._window(scale=2):
            unit = self.units[index]
            if not _live(unit) and not (self.updates is not None and self.updates.pending(unit)):
                self._stage(index)
        for index in self._window():
            unit = self.units[index]
            if _live(unit):
                continue
            if self.live_bytes + gathered_bytes(unit) > self.max_live_bytes:
                break
            self._launch(index)

    def _name(self, index: int | None) -> str:
        return "end of trace" if index is None else repr(self.units[index].layout.name or "<root>")

    # ------------------------------------------------------------------ moves
    def _stage(self, index: int) -> None:
        """Start reading a shard that lives on NVMe into a host buffer (nothing for resident shards)."""
        unit = self.units[index]
        block = unit.param_block
        if block.resident or unit in self._staged or unit.secondary is not None:
            return  # a unit with a secondary shard is gathered from it: its primary shard is not read
        self._staged.add(block.load(self.host_tier.empty(Kind.BUFFER, block.nbytes, torch.uint8)), item=unit)

    def _unstage_oldest(self) -> None:
        """Wait for the oldest staged read and give its buffer back, however the read ended."""
        block = self._staged.oldest.param_block
        try:
            self._staged.wait_oldest()
        finally:
            self.host_tier.free(Kind.BUFFER, block.unload())

    def _shard_source(self, index: int) -> tuple[torch.Tensor, list[Callable[[], None]]]:
        """The shard as an all-gather input on the device, and what to release once the gather is done."""
        if self.updates is not None:
            self.updates.wait(self.units[index])
        block = self.units[index].param_block
        if not block.resident:
            self._stage(index)
            start = time.perf_counter()
            self._staged.finish(self.units[index])
            self.stats.read_wait_seconds += time.perf_counter() - start
        source, releases = block.data, []
        if self.copier is not None:
            source, release_copy = self.copier.to_device(source)
            releases.append(release_copy)  # first: the copy must be done before the host buffer goes
        if not block.resident:
            releases.append(lambda: self.host_tier.free(Kind.BUFFER, block.unload()))
        return source, releases

    def _launch(self, index: int) -> None:
        """Start ``units[index]``'s all-gather (its views attach once it is waited for)."""
        unit = self.units[index]
        source, releases = (None, []) if unit.secondary is not None else self._shard_source(index)
        with profiled("zerooffload::gather"):
            buffer = unit.begin_gather(self.tier)
            self.live_bytes += gathered_bytes(unit)
            self.stats.gathers += 1
            self.stats.peak_live_bytes = max(self.stats.peak_live_bytes, self.live_bytes)
            self._in_flight[index] = (self.gathers.start(unit, buffer, source), releases)

    def _wait(self, index: int) -> None:
        if index not in self._in_flight:
            return
        work, releases = self._in_flight.pop(index)
        with profiled("zerooffload::gather"):
            if work is not None:
                start = time.perf_counter()
                work.wait()
                self.stats.wait_seconds += time.perf_counter() - start
            for release in releases:
                release()
            self.units[index].finish_gather()
            self.gathers.arrived(self.units[index], self._training)

    def _free(self, index: int) -> None:
        self._wait(index)
        unit = self.units[index]
        unit.reshard(self.tier)
        self.live_bytes -= gathered_bytes(unit)

    def _make_room(self, nbytes: int) -> None:
        """Free idle live units (prefetched or kept) until ``nbytes`` more fit in max_live_size."""
        for index in self._idle_live():
            if self.live_bytes + nbytes <= self.max_live_bytes:
                return
            self._free(index)
        if self.live_bytes + nbytes > self.max_live_bytes:
            raise RuntimeError(
                f"stage 3 needs {self.live_bytes + nbytes} bytes of gathered parameters at once (units in use: "
                f"{self.live_bytes}, next: {nbytes}) but zero.max_live_size is {self.max_live_bytes}; raise it")

    def _idle_live(self) -> Iterator[int]:
        for index, unit in enumerate(self.units):
            if _live(unit) and self._active[index] == 0:
                yield index
