"""A trace of training steps in Chrome's trace format (Perfetto, chrome://tracing), and its recorder.

[Note: step traces]
``engine.trace(path, steps=N)`` (``zerooffload train --trace``) records the next N steps and writes
one JSON file: at world size > 1, one process per rank (rank 0 writes what every rank recorded). Its
tracks, per rank:
- ``main``: what the training thread does, as disjoint segments (a segment inside another pauses
  it: ``push``/``pop``): ``forward <unit>`` between the unit hooks (the root unit's own work between
  its blocks; a recompute under activation checkpointing inside its unit's backward), ``backward
  <unit>`` from the previous unit's last gradient to this one's, ``backward: reduce`` after, then
  ``step`` with ``update <unit>`` inside. Only what the engine runs is covered: the user's loss
  between forward and backward is a gap;
- ``updates``: the update worker's units' updates in backward (``update <unit>``, update_worker's note),
  beside the backward they run under; its own waits on NVMe transfers are red spans inside them;
- ``waits``: time the main thread was blocked on an NVMe transfer (red, ``bytes`` in its args), or on the
  update worker (``wait: updates``);
- ``nvme read`` / ``nvme write``: each block transfer from submission to the wait that saw it done,
  as async spans with their ``bytes`` (the same bytes ``engine.stats.io`` counts, at submission);
- ``collectives``: launches of all-reduces, reduce-scatters and all-gathers (the labels torch.profiler
  shows too: ``zerooffload::all_gather`` ...);
- counters ``<tier> bytes``: every tier's bytes held, as they change, and a PNG of them beside the
  file (``<path>.memory.png``) when matplotlib is there.
The recorder is process-wide and off unless a trace is armed: each hook is one attribute test then.
This module imports nothing from zerooffload, so every layer may record into it.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

__all__ = ["RECORDER", "ArmedTrace", "Recorder", "forward_segments", "profiled", "segment", "span", "write_trace"]

TRACKS = ("main", "updates", "waits", "nvme read", "nvme write", "collectives")
"""Track names in the order they are shown (their ``tid``)."""


class Recorder:
    """Events of the armed trace (see the note); ``active`` False: every call returns at once."""

    def __init__(self) -> None:
        self.active = False
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._ids = 0
        self.origin = time.perf_counter()
        """``time.perf_counter()`` at ts 0 (in the file's ``otherData``, to line up other clocks)."""
        self._open: dict[int, tuple[str, str]] = {}
        """Transfers begun and not yet seen done: id -> (track, key)."""
        self._stack: list[list] = []
        """The main thread's open segments, innermost last: ``[name, since]``."""
        self._thread = threading.local()
        """Per thread: the track its waits go to (``redirect_waits``), where it is not ``waits``."""

    def start(self) -> None:
        self.events, self.active, self._stack, self._open = [], True, [], {}

    def stop(self) -> list[dict]:
        """The events; transfers still in flight end here (their bytes were counted as they began)."""
        for ident, (track, key) in list(self._open.items()):
            self.transfer_done(track, ident, key, in_flight=True)
        while self._stack:  # the segments open now end here
            self.pop()
        self.active = False
        events, self.events = self.events, []
        return events

    def _us(self, seconds: float) -> float:
        return (seconds - self.origin) * 1e6

    def _add(self, event: dict) -> None:
        with self._lock:
            self.events.append(event)

    def redirect_waits(self, track: str) -> None:
        """This thread's waits are spans of ``track`` (still red): a worker's stalls are not the main thread's."""
        self._thread.waits = track

    def complete(self, name: str, track: str, start: float, end: float, **args: Any) -> None:
        """One span of ``track`` from ``start`` to ``end`` (``time.perf_counter`` seconds)."""
        if self.active:
            wait = track == "waits"
            track = getattr(self._thread, "waits", track) if wait else track
            event = {"name": name, "ph": "X", "ts": self._us(start), "dur": (end - start) * 1e6,
                     "tid": TRACKS.index(track), "args": args}
            if wait:
                event["cname"] = "terrible"  # red in the viewers: a stall
            self._add(event)

    def push(self, name: str) -> None:
        """The main thread starts ``name`` inside what it was doing (which pauses until ``pop``)."""
        if self.active:
            now = time.perf_counter()
            if self._stack:
                self._emit(self._stack[-1], now)
            self._stack.append([name, now])

    def pop(self) -> None:
        """The innermost work ends; the one around it resumes."""
        if self.active and self._stack:
            now = time.perf_counter()
            self._emit(self._stack.pop(), now)
            if self._stack:
                self._stack[-1][1] = now

    def finish_as(self, name: str, then: str) -> None:
        """The innermost work so far was ``name`` (known only now, as a unit's gradients complete);
        what follows is ``then`` until the next call."""
        if self.active and self._stack:
            now = time.perf_counter()
            top = self._stack[-1]
            self._emit([name, top[1]], now)
            top[0], top[1] = then, now

    def _emit(self, segment: list, now: float) -> None:
        name, start = segment
        self.complete(name, "main", start, now)

    def transfer_started(self, track: str, nbytes: int, key: str) -> int | None:
        """An NVMe transfer was submitted: its async span opens; returns its id (None when off)."""
        if not self.active:
            return None
        with self._lock:
            self._ids += 1
            ident = self._ids
            self._open[ident] = (track, key)
            self.events.append({"name": key, "ph": "b", "cat": track, "id": ident, "ts": self._us(time.perf_counter()),
                                "tid": TRACKS.index(track), "args": {"bytes": nbytes}})
        return ident

    def transfer_done(self, track: str, ident: int | None, key: str, in_flight: bool = False) -> None:
        if ident is not None and self.active:
            with self._lock:
                if self._open.pop(ident, None) is None:
                    return
                self.events.append({"name": key, "ph": "e", "cat": track, "id": ident,
                                    "ts": self._us(time.perf_counter()), "tid": TRACKS.index(track),
                                    "args": {"in flight when the trace ended": in_flight}})

    def counter(self, tier: str, value: int) -> None:
        """``tier``'s bytes held now (the counter ``<tier> bytes``; its name is made only when recording)."""
        if self.active:
            self._add({"name": f"{tier} bytes", "ph": "C", "ts": self._us(time.perf_counter()), "tid": 0,
                       "args": {"bytes": value}})


RECORDER = Recorder()

_UNLABELLED = contextlib.nullcontext()


def profiled(name: str) -> ContextManager:
    """``record_function(name)`` while torch.profiler records, else nothing: entering a label costs
    ~8 µs of dispatch even with no profiler running, and a step enters one per block moved, unit
    updated and gather, dozens of times. A profile of every thread (``experimental_config=
    torch.profiler._ExperimentalConfig(profile_all_threads=True)``) is on for no thread in particular,
    and shows the update worker's labels too (update_worker's note)."""
    recording = torch.autograd._profiler_enabled() or torch.autograd.profiler._is_profiler_enabled
    return record_function(name) if recording else _UNLABELLED


@contextlib.contextmanager
def span(name: str, track: str = "collectives") -> Iterator[None]:
    """``profiled(name)`` for torch.profiler, and the same span on ``track`` of an armed trace."""
    start = time.perf_counter()
    with profiled(name):
        yield
    RECORDER.complete(name, track, start, time.perf_counter())


class ArmedTrace:
    """The steps a trace still records (``engine.trace``); after the last, every rank's events are
    gathered (``gather``: this rank's events -> every rank's, in rank order) and ``path`` written
    where ``writes`` (rank 0)."""

    def __init__(self, path: str | os.PathLike, steps: int, gather: Callable[[list[dict]], list[list[dict]]],
                 writes: bool, counters: dict[str, int] | None = None):
        """``counters``: each tier's bytes held now, where its counter starts (not at its next change)."""
        if steps < 1:
            raise ValueError(f"steps = {steps}: a trace records at least one step")
        self.path, self.left, self.gather, self.writes = path, steps, gather, writes
        RECORDER.start()
        for name, value in (counters or {}).items():
            RECORDER.counter(name, value)

    def step_done(self) -> bool:
        """One more step recorded; True once the trace is written (the recorder is off again)."""
        self.left -= 1
        if self.left:
            return False
        events_by_rank = self.gather(RECORDER.stop())
        if self.writes:
            write_trace(self.path, events_by_rank)
        return True


def segment(name: str) -> Callable[[Callable], Callable]:
    """A method whose every call is a ``name`` segment of the main track (the segments it runs nest)."""
    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def traced(*args: Any, **kwargs: Any) -> Any:
            RECORDER.push(name)
            try:
                return method(*args, **kwargs)
            finally:
                RECORDER.pop()
        return traced
    return decorate


def forward_segments(units: list[tuple[str, nn.Module]]) -> list[RemovableHandle]:
    """Hooks that make each unit's forward a ``forward <name>`` segment of the main track."""
    handles = []
    for name, module in units:
        label = f"forward {name or '<root>'}"
        handles.append(module.register_forward_pre_hook(lambda *_, label=label: RECORDER.push(label)))
        handles.append(module.register_forward_hook(lambda *_: RECORDER.pop()))
    return handles


def write_trace(path: str | os.PathLike, events_by_rank: list[list[dict]]) -> None:
    """The Chrome trace file: one process per rank, its tracks named, then a PNG of the memory
    counters beside it (skipped without matplotlib)."""
    out = []
    for rank, events in enumerate(events_by_rank):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        out += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}}
                for tid, track in enumerate(TRACKS)]
        out += [{**event, "pid": rank} for event in events]
    with open(path, "w") as file:
        json.dump({"traceEvents": out, "displayTimeUnit": "ms",
                   "otherData": {"origin_perf_counter": RECORDER.origin}}, file)
    with contextlib.suppress(ImportError):
        _plot_memory(f"{path}.memory.png", events_by_rank[0])


def memory_series(events: list[dict]) -> dict[str, list[tuple[float, int]]]:
    """Each counter's (ms, bytes) points, each held on to the trace's last moment: a tier whose bytes
    never change in the traced steps (the swap files') is one sample, which a step plot cannot draw."""
    series: dict[str, list[tuple[float, int]]] = {}
    for event in events:
        if event["ph"] == "C":
            series.setdefault(event["name"], []).append((event["ts"] / 1e3, event["args"]["bytes"]))
    end = max((event["ts"] + event.get("dur", 0)) / 1e3 for event in events) if events else 0.0
    return {name: points + [(end, points[-1][1])] for name, points in series.items()}


def _plot_memory(path: str, events: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = memory_series(events)
    if not series:
        return
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for name, points in sorted(series.items()):
        ax.step([t for t, _ in points], [b / 2**20 for _, b in points], where="post", label=name)
    ax.set_xlabel("ms")
    ax.set_ylabel("MiB held")
    ax.set_title("rank 0: bytes each tier holds over the traced steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
