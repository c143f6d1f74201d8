#!/usr/bin/env python3
"""``zerooffload train --steps 30`` while other processes keep the CPUs busy: the default threads
against ``OMP_NUM_THREADS=1``, interleaved in pairs, judged on the median per-pair ratio.

Busy processes (``python -c 'while 1: pass'``, --busy of them) run for the whole benchmark; each
pair runs the default side and the single-thread side back to back, alternating which goes first.
Wall time of the whole command (start-up included), as a user sees it.

Usage:  python bench/threads_contention.py [--pairs 5] [--busy 2] [--steps 30] [--env KEY=VALUE ...]
(--env adds settings to the default side, to try a remedy against the same baseline).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _run(steps: int, env: dict[str, str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "zerooffload", "train", "--steps", str(steps), "--out", out],
                       check=True, capture_output=True, env={**os.environ, **env})
        return time.perf_counter() - start


def _wait_for_load(busy: int, limit_s: float = 120) -> None:
    """Let the 1-minute load average see the busy processes (as it would for a job already running)."""
    deadline = time.monotonic() + limit_s
    while busy and os.getloadavg()[0] < 0.8 * busy and time.monotonic() < deadline:
        time.sleep(1)
    print(f"load average {os.getloadavg()[0]:.1f} with {busy} busy process(es)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--busy", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--env", nargs="*", default=[], help="KEY=VALUE settings for the default side")
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.env)
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.busy)]
    try:
        _wait_for_load(args.busy)
        ratios, defaults, singles = [], [], []
        for pair in range(args.pairs):
            sides = [("default", extra), ("single", {"OMP_NUM_THREADS": "1"})]
            times = {}
            for name, env in (sides if pair % 2 == 0 else sides[::-1]):
                times[name] = _run(args.steps, env)
            defaults.append(times["default"])
            singles.append(times["single"])
            ratios.append(times["default"] / times["single"])
            print(f"pair {pair + 1}: default {times['default']:.1f} s, OMP_NUM_THREADS=1 {times['single']:.1f} s, "
                  f"ratio {ratios[-1]:.2f}", flush=True)
    finally:
        for process in busy:
            process.kill()
    print(f"default{' ' + ' '.join(args.env) if args.env else ''}: {min(defaults):.1f} / "
          f"{statistics.median(defaults):.1f} / {max(defaults):.1f} s; OMP_NUM_THREADS=1: {min(singles):.1f} / "
          f"{statistics.median(singles):.1f} / {max(singles):.1f} s; ratio min/median/max "
          f"{min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f} (target <= 1.3)")


if __name__ == "__main__":
    main()
