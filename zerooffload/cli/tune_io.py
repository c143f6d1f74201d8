"""``zerooffload tune io``: the ``[aio]`` settings for one disk, found by a search instead of a full grid.

[Note: tuning search]
- A *point* is a backend with a block size and a depth: ``queue_depth`` for io_uring, ``threads`` for
  the native pool (``bench``'s [Note: bench vocabulary]). Its *score* is the geometric mean of its
  write and read GB/s: one ``[aio]`` section serves both directions, and neither may be given up.
- Coarse to fine: first the corners and middle of the block × depth plane for each backend that runs
  here (``COARSE``); then, around the best so far, its neighbours one factor of two away on either
  axis, again and again (hill climbing on the log2 grid, within ``BLOCK_SIZES`` × ``DEPTHS``).
- Noise: a disk shared with other machines swings ±30% from one run to the next, so a neighbour takes
  over only if it beats the best by more than ``margin`` (the spread the best showed between its own
  measurements, at least ``MIN_MARGIN``); a round in which none does ends the climb. The finalists (the
  best few) are then measured again, interleaved, and the one with the best median wins. A time
  ``budget`` bounds everything: the search stops where it is when the budget is spent.
- The search takes any ``measure(point) -> (write GB/s, read GB/s)``: the command passes a real
  O_DIRECT file through ``bench io``'s runs; the tests pass a synthetic disk with a known optimum.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from ..config import AioConfig, Config, format_size
from ..planning.probe import record_disk
from ..planning.scratch_disk import QUEUE_BACKENDS, BenchError, Unavailable, preflight, scratch_disk
from .bench import SWEEP_BLOCK_SIZES, exit_status, parse_total, sweep_grid

__all__ = ["Point", "TuneResult", "search", "run_tune_io"]

BACKENDS = ("uring", "pool")
"""The native backends, which the engine runs on; the Python ones are baselines, never the best."""
BLOCK_SIZES = tuple(1 << s for s in range(17, 24))  # 128 KiB .. 8 MiB
DEPTHS = (1, 2, 4, 8, 16, 32, 64)
COARSE = tuple((b, d) for b in SWEEP_BLOCK_SIZES for d in (4, 32))
MIN_MARGIN = 0.05
"""A challenger must beat the best by at least this share, even on a quiet disk."""
FINALISTS = 3


@dataclass(frozen=True, slots=True)
class Point:
    backend: str
    block_size: int
    depth: int

    def aio(self, base: AioConfig) -> AioConfig:
        """The ``AioConfig`` that runs this point (the depth as the backend's own knob)."""
        knob = "queue_depth" if self.backend in QUEUE_BACKENDS else "threads"
        return dataclasses.replace(base, backend=self.backend, block_size=self.block_size, direct=True,
                                   **{knob: self.depth})

    def __str__(self) -> str:
        knob = "qd" if self.backend in QUEUE_BACKENDS else "threads"
        return f"{self.backend} {format_size(self.block_size)} {knob} {self.depth}"


@dataclass
class TuneResult:
    best: Point
    write_gbps: float
    read_gbps: float
    measured: dict[Point, list[tuple[float, float]]]
    """Every point's (write, read) GB/s, in the order measured."""
    seconds: float
    stopped: str
    """Why the search ended: ``converged`` or ``budget``."""


def _score(pair: tuple[float, float]) -> float:
    return math.sqrt(pair[0] * pair[1])


def _median_score(samples: list[tuple[float, float]]) -> float:
    return statistics.median(_score(s) for s in samples)


def _neighbours(point: Point) -> list[Point]:
    """The grid points one factor of two away from ``point`` on either axis."""
    b, d = BLOCK_SIZES.index(point.block_size), DEPTHS.index(point.depth)
    steps = [(b - 1, d), (b + 1, d), (b, d - 1), (b, d + 1)]
    return [Point(point.backend, BLOCK_SIZES[i], DEPTHS[j]) for i, j in steps
            if 0 <= i < len(BLOCK_SIZES) and 0 <= j < len(DEPTHS)]


def search(measure: Callable[[Point], tuple[float, float]], backends: tuple[str, ...] = BACKENDS, *,
           budget: float = 100.0, clock: Callable[[], float] = time.monotonic,
           progress: Callable[[Point], None] = lambda point: None) -> TuneResult:
    """The best point for ``measure`` (see [Note: tuning search]). A backend whose first point raises
    ``Unavailable`` is dropped; ``budget`` seconds of ``clock`` bound the whole search."""
    start = clock()
    measured: dict[Point, list[tuple[float, float]]] = {}
    stopped = "converged"

    def run(point: Point) -> bool:
        nonlocal stopped
        if clock() - start > budget:
            stopped = "budget"
            return False
        progress(point)
        sample = measure(point)
        measured.setdefault(point, []).append(sample)
        return True

    usable = []
    for backend in backends:
        try:
            if run(Point(backend, *COARSE[0])):
                usable.append(backend)
        except Unavailable:
            continue
    if not usable:
        raise BenchError(f"no native backend can run here ({', '.join(backends)} unavailable)")
    for backend in usable:
        for block, depth in COARSE[1:]:
            if not run(Point(backend, block, depth)):
                break
    best = max(measured, key=lambda p: _median_score(measured[p]))
    while stopped == "converged":
        run(best)  # its own spread is the noise a challenger must beat
        margin = max(MIN_MARGIN, _spread(measured[best]))
        challengers = [p for p in _neighbours(best) if p not in measured and run(p)]
        winner = max(challengers, key=lambda p: _median_score(measured[p]), default=None)
        if winner is None or _median_score(measured[winner]) <= _median_score(measured[best]) * (1 + margin):
            break
        best = winner
    finalists = sorted(measured, key=lambda p: _median_score(measured[p]), reverse=True)[:FINALISTS]
    for _ in range(2):
        for point in finalists:
            run(point)
    best = max(finalists, key=lambda p: _median_score(measured[p]))
    write = statistics.median(w for w, _ in measured[best])
    read = statistics.median(r for _, r in measured[best])
    return TuneResult(best, write, read, measured, clock() - start, stopped)


def _spread(samples: list[tuple[float, float]]) -> float:
    """The relative range of a point's scores (0 with one sample)."""
    scores = [_score(s) for s in samples]
    return (max(scores) - min(scores)) / statistics.median(scores) if len(scores) > 1 else 0.0


# ------------------------------------------------------------------------------------------------
# The command


def run_tune_io(args: argparse.Namespace, config: Config) -> int:
    """Search, print the result (and with ``--compare`` the full sweep's best against it), write
    ``--out`` and the probe cache; the exit status (``bench``'s: 2 for usage, 130 on Ctrl-C)."""
    return exit_status("tune io", lambda: _tune_io(args, config))


def _tune_io(args: argparse.Namespace, config: Config) -> int:
    size = parse_total(args.size)
    directory = args.path or config.nvme.paths[0]
    preflight(directory, size)
    with scratch_disk(directory, size) as disk, tqdm(unit="run", file=sys.stderr, disable=None,
                                                     desc="tune io") as bar:
        def measure(point: Point) -> tuple[float, float]:
            write, read = disk.run(point.aio(config.aio))
            return write.gbps, read.gbps

        def progress(point: Point) -> None:
            bar.set_postfix_str(str(point))
            bar.update()

        result = search(measure, budget=args.budget, progress=progress)
        comparison = _compare(measure, result) if args.compare else None
    print(f"best of {len(result.measured)} settings in {result.seconds:.0f} s ({result.stopped}): {result.best}: "
          f"write {result.write_gbps:.2f} GB/s, read {result.read_gbps:.2f} GB/s")
    if comparison:
        print(comparison)
    aio = result.best.aio(config.aio)
    if args.out:
        Path(args.out).write_text(aio_toml(aio, directory, result))
        print(f"wrote {args.out} (use it with --config {args.out}, or copy its [aio] section)")
    record_disk(directory, _tuned_keys(aio), result.write_gbps, result.read_gbps, source="tune io")
    return 0


def aio_toml(aio: AioConfig, directory: str, result: TuneResult) -> str:
    """A complete config whose only section is ``[aio]``: the tuned settings, the rest defaults."""
    lines = [f"# zerooffload tune io --path {directory}: {result.best}, write {result.write_gbps:.2f} GB/s, "
             f"read {result.read_gbps:.2f} GB/s ({len(result.measured)} settings, {result.seconds:.0f} s)", "[aio]"]
    return "\n".join(lines + [f"{key} = {json.dumps(value)}" for key, value in _tuned_keys(aio).items()]) + "\n"


def _tuned_keys(aio: AioConfig) -> dict:
    """The ``[aio]`` keys ``tune io`` sets, as the config and the probe cache both hold them."""
    return {"backend": aio.backend, "block_size": aio.block_size, "queue_depth": aio.queue_depth,
            "threads": aio.threads}


def _compare(measure: Callable[[Point], tuple[float, float]], result: TuneResult, pairs: int = 5) -> str:
    """The full ``bench io --sweep`` grid of the native backends, then its best and the tuned point
    measured again in ``pairs`` interleaved pairs: the tuned one's median ratio on write and read."""
    grid = [Point(b, point["block_size"], point.get("queue_depth", point.get("threads"))) for b in BACKENDS
            if any(p.backend == b for p in result.measured) for point in sweep_grid(b)]
    sweep = {point: [measure(point)] for point in grid}
    rival = max(sweep, key=lambda p: _median_score(sweep[p]))
    ratios = []
    for _ in range(pairs):
        ours, theirs = measure(result.best), measure(rival)
        ratios.append((ours[0] / theirs[0], ours[1] / theirs[1]))
    write, read = (statistics.median(r[i] for r in ratios) for i in (0, 1))
    return (f"against the sweep's best ({rival}, of {len(sweep)}): write {write:.2f}x, read {read:.2f}x "
            f"(median of {pairs} interleaved pairs; within 10%: {'yes' if min(write, read) >= 0.9 else 'no'})")
