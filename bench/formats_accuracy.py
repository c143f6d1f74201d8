#!/usr/bin/env python3
"""Does a compact optimizer state train as well? The ``small`` preset for ``--steps`` steps in bf16 with
each state format, as a user runs it (``zerooffload train``, train's defaults otherwise), the losses
from each run's summary.json.

Judged: the mean loss of the last 50 steps of each compact format within 2% of the fp32 format's (an
fp32 master and fp32 moments). A split master is bitwise the fp32 master (tests/test_compact_states.py),
so its curve is the fp32 one and it is not run alone; bf16 and int8 moments are not bitwise.
``--plot FILE`` draws the curves.

    python bench/formats_accuracy.py [--steps 500] [--plot bench/formats_loss.png]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pairs import record

FORMATS = {"fp32 master, fp32 moments": [],
           "split master, bf16 moments": ["optimizer.master=split", "optimizer.moments=bf16"],
           "split master, int8 moments": ["optimizer.master=split", "optimizer.moments=int8"]}
TAIL, BOUND = 50, 0.02


def losses(overrides: list[str], steps: int) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="zo-formats-") as work:
        done = subprocess.run([sys.executable, "-m", "zerooffload", "train", "--model", "small", "--steps", str(steps),
                               "--out", str(Path(work) / "out"), "train.precision=bf16", *overrides],
                              capture_output=True, text=True, timeout=4 * 3600)
        if done.returncode != 0:
            raise SystemExit(f"{overrides} failed: {done.stderr[-2000:]}")
        return json.loads((Path(work) / "out" / "summary.json").read_text())["losses"]


def plot(curves: dict[str, list[float]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, values in curves.items():
        smooth = [statistics.fmean(values[max(0, i - 9):i + 1]) for i in range(len(values))]
        ax.plot(range(1, len(values) + 1), smooth, label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean of the last 10 steps)")
    ax.set_title("small preset, bf16: the optimizer state's formats")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--plot", default="")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs; zerooffload train --model small --steps {args.steps} train.precision=bf16")
    curves = {name: losses(overrides, args.steps) for name, overrides in FORMATS.items()}
    reference = statistics.fmean(curves["fp32 master, fp32 moments"][-TAIL:])
    print(f"\n| format | last-{TAIL}-step mean loss | vs fp32 | within {BOUND:.0%} |\n|---|---|---|---|")
    failed = 0
    for name, values in curves.items():
        tail = statistics.fmean(values[-TAIL:])
        ok = abs(tail / reference - 1) <= BOUND
        failed += not ok
        print(f"| {name} | {tail:.4f} | {tail / reference:.4f} | {'yes' if ok else 'NO'} |")
        record("check", title=f"small, bf16, {len(values)} steps: last-{TAIL}-step mean loss, {name} / fp32 states",
               value=tail / reference, target=f"{1 - BOUND:.2f}–{1 + BOUND:.2f}", met=ok, detail=f"{tail:.4f}")
    if args.plot:
        plot(curves, args.plot)
        print(f"\nplot: {args.plot}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
