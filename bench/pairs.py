"""The DESIGN §4 rule for two sides: interleaved pairs, the order alternating so drift on the shared
machine hits both, judged on the median of the per-pair ratios (ours / theirs), min/median/max reported,
and beside it the interval the median lies in (``median_interval``), so a verdict the noise can flip says so."""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
from typing import Callable

Side = tuple[str, Callable[[], float]]
"""A side's name and a function that measures it once (its time)."""


def interleaved_pairs(count: int, ours: Side, theirs: Side, *, unit: str = "s/step", show: bool = True
                      ) -> list[tuple[float, float]]:
    """``count`` pairs of (ours, theirs) times, theirs first in even pairs; each printed when ``show``."""
    results = []
    for pair in range(count):
        order = [theirs, ours] if pair % 2 == 0 else [ours, theirs]
        times = {name: measure() for name, measure in order}
        results.append((times[ours[0]], times[theirs[0]]))
        if show:
            print(f"  pair {pair}: {ours[0]} {results[-1][0]:.4g} {unit}, {theirs[0]} {results[-1][1]:.4g} {unit}, "
                  f"ratio {results[-1][0] / results[-1][1]:.3f}", flush=True)
    return results


def rotating_rounds(count: int, sides: dict[str, Callable[[], float]], *, unit: str = "s", scale: float = 1.0,
                    show: bool = True) -> dict[str, list[float]]:
    """Three or more sides: every side measured once per round, the order rotating from round to round
    (so drift hits each in every position); each side's times, in ``sides``' order."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(count):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(sides[name]())
        if show:
            print(f"  round {index}: " + ", ".join(f"{name} {times[name][-1] * scale:.4g} {unit}" for name in names),
                  flush=True)
    return times


MEDIAN_CONFIDENCE = 0.9
"""The least coverage ``median_interval`` accepts: 5 pairs reach it (min to max, 93.8%), 4 do not."""


def median_interval(values: list[float]) -> tuple[float, float, float] | None:
    """A distribution-free confidence interval for the median of what ``values`` sample: the narrowest
    pair of order statistics (the k-th smallest and the k-th largest) that holds the true median with
    probability at least ``MEDIAN_CONFIDENCE`` whatever the distribution, since each value falls below
    the median with probability 1/2 (coverage 1 - 2 P[Binomial(n, 1/2) < k]). Returns (low, high,
    coverage), or None when even min..max covers too little (under 5 values)."""
    n, ordered = len(values), sorted(values)
    best, below = None, 0  # below: the ways fewer than k of n values fall under the median
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1)
        coverage = 1 - 2 * below / 2 ** n
        if coverage < MEDIAN_CONFIDENCE:
            break
        best = (ordered[k - 1], ordered[n - k], coverage)
    return best


def resolution(values: list[float], target: float | None) -> str:
    """The median's interval as text, and whether it settles ``target`` (None: no target): a median on one
    side of the target whose interval holds it is a verdict the machine's noise could flip."""
    interval = median_interval(values)
    if interval is None:
        return "too few to say"
    low, high, coverage = interval
    text = f"{low:.3f} – {high:.3f} ({coverage:.0%})"
    return text if target is None or not low <= target <= high else f"{text}, holds the target: unresolved"


def report_pairs(title: str, names: tuple[str, str], results: list[tuple[float, float]], target: float, *,
                 unit: str = "s/step") -> None:
    """Both sides' min/median/max and the per-pair ratio's, judged on its median against ``target``."""
    ratios = [o / t for o, t in results]
    median = statistics.median(ratios)
    print(f"\n{title}\n| side | {unit} min / median / max |\n|---|---|")
    for name, times in zip(names, zip(*results)):
        print(f"| {name} | {min(times):.4g} / {statistics.median(times):.4g} / {max(times):.4g} |")
    print(f"ratio {names[0]}/{names[1]} per pair: min {min(ratios):.3f} / median {median:.3f} / max {max(ratios):.3f} "
          f"(target ≤ {target:.2f}: {'met' if median <= target else 'NOT met'}); the median's interval "
          f"{resolution(ratios, target)}")
    record("pairs", title=title, names=list(names), unit=unit, target=target, ratios=ratios,
           times={name: list(times) for name, times in zip(names, zip(*results))}, met=median <= target)


def record(kind: str, **fields) -> None:
    """Append one result (``kind`` and ``fields``, JSON) to the file named by $ZO_BENCH_RECORD, if set:
    how ``bench/results.py`` collects what each benchmark measured."""
    path = os.environ.get("ZO_BENCH_RECORD")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"kind": kind, "bench": os.path.basename(sys.argv[0]), **fields}) + "\n")
