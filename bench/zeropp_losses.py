#!/usr/bin/env python3
"""Does ZeRO++ train as well as plain stage 3 (issue 44)? The ``small`` preset at stage 3 for ``--steps``
steps on two nodes x 2 ranks over a real link (two_nodes.py's network namespaces), once plain and once
with each of qwZ alone, qgZ alone and all three parts (hpZ, qwZ, qgZ), the losses from each run's
summary.json. Every run uses two_nodes.py's keys (``zero.prefetch_size=4MiB zero.max_live_size=16MiB``, so
backward gathers again and hpZ has something to do) and the same data, so the curves differ only by what
the quantization changes.

Judged: each ZeRO++ run's mean loss over its last 50 steps within 1% of plain stage 3's (loss_tails.py);
every curve is recorded, so ``results.py --report`` redraws the plot from the records. hpZ alone is not
run here: it is bitwise plain stage 3 (tests/test_two_nodes.py, tests/test_zeropp.py).

    sudo python bench/zeropp_losses.py [--steps 300] [--model small] [--rate 200mbit] [--plot FILE] [key=value ...]

It needs root, as two_nodes.py does; without it one line says so and it exits with status 2.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from loss_tails import judge_tails
from results_report import CURVES, plot_curves
from two_nodes import BASE, two_nodes, train

RUNS = {"plain stage 3": [],
        "qwZ": ["zero.quantized_weights=true"],
        "qgZ": ["zero.quantized_gradients=true"],
        "hpZ + qwZ + qgZ": ["zero.hpz_partition_size=2", "zero.quantized_weights=true",
                            "zero.quantized_gradients=true"]}
TAIL, BOUND = 50, 0.01


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model", default="small")
    parser.add_argument("--rate", default=None, help="shape the link with tc tbf (e.g. 200mbit); unshaped without")
    parser.add_argument("--timeout", type=float, default=3 * 3600, help="seconds one run may take")
    parser.add_argument("--plot", default="")
    parser.add_argument("overrides", nargs="*", help="keys passed to every run (key.path=value)")
    args = parser.parse_args()
    if os.geteuid() != 0 or not shutil.which("ip"):
        print("zeropp_losses: needs root and iproute2 (ip, tc) to make network namespaces; run it as root",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # the link is deleted
    curves = {}
    with two_nodes(args.rate) as link, tempfile.TemporaryDirectory(prefix="zo-zeropp-losses-") as tmp:
        for name, keys in RUNS.items():
            print(f"{name}: {args.steps} steps", flush=True)
            command = ["-m", "zerooffload", "train", "--model", args.model, *BASE, *args.overrides, *keys]
            curves[name] = train(link, command, args.steps, Path(tmp) / "out", args.timeout)["losses"]
    title = (f"{args.model}, stage 3, 2 nodes x 2 ranks, {' '.join(args.overrides) or 'defaults'}, {args.steps} steps: "
             f"last-{TAIL}-step mean loss")
    failed = judge_tails(curves, title, BOUND, TAIL)
    if args.plot:
        plot_curves(curves, Path(args.plot), CURVES["zeropp_losses"][1])
        print(f"\nplot: {args.plot}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
