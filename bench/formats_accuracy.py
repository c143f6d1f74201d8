#!/usr/bin/env python3
"""Does a compact optimizer state train as well? The ``small`` preset for ``--steps`` steps in bf16 with
each state format, as a user runs it (``zerooffload train``, train's defaults otherwise), the losses
from each run's summary.json.

Judged: the mean loss of the last 50 steps of each compact format within 2% of the fp32 format's (an
fp32 master and fp32 moments), which is recorded as the reference (its loss, judged against nothing).
A split master is bitwise the fp32 master (tests/test_compact_states.py), so its curve is the fp32 one
and it is not run alone; bf16 and int8 moments are not bitwise. Every format's losses are recorded too
(``curve``), so ``results.py --report`` redraws the plot from the records; ``--plot FILE`` draws it here.

    python bench/formats_accuracy.py [--steps 500] [--plot bench/formats_loss.png]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from loss_tails import judge_tails
from results_report import plot_curves

FORMATS = {"fp32 master, fp32 moments": [],
           "split master, bf16 moments": ["optimizer.master=split", "optimizer.moments=bf16"],
           "split master, int8 moments": ["optimizer.master=split", "optimizer.moments=int8"]}
TAIL, BOUND = 50, 0.02
TITLE = "small preset, bf16: the optimizer state's formats"


def losses(overrides: list[str], steps: int) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="zo-formats-") as work:
        done = subprocess.run([sys.executable, "-m", "zerooffload", "train", "--model", "small", "--steps", str(steps),
                               "--out", str(Path(work) / "out"), "train.precision=bf16", *overrides],
                              capture_output=True, text=True, timeout=4 * 3600)
        if done.returncode != 0:
            raise SystemExit(f"{overrides} failed: {done.stderr[-2000:]}")
        return json.loads((Path(work) / "out" / "summary.json").read_text())["losses"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--plot", default="")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs; zerooffload train --model small --steps {args.steps} train.precision=bf16")
    curves = {name: losses(overrides, args.steps) for name, overrides in FORMATS.items()}
    failed = judge_tails(curves, f"small, bf16, {args.steps} steps: last-{TAIL}-step mean loss", BOUND, TAIL)
    if args.plot:
        plot_curves(curves, Path(args.plot), TITLE)
        print(f"\nplot: {args.plot}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
