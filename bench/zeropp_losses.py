#!/usr/bin/env python3
"""Does ZeRO++ train as well as plain stage 3 (issue 44)? The ``small`` preset at stage 3 for ``--steps``
steps on two nodes x 2 ranks over a real link (two_nodes.py's network namespaces), once plain and once
with each of qwZ alone, qgZ alone and all three parts (hpZ, qwZ, qgZ), the losses from each run's
summary.json (each step's the global batch's: the 4 ranks' mean, not rank 0's one sequence). Every run
uses two_nodes.py's keys (``zero.prefetch_size=4MiB zero.max_live_size=16MiB``, so backward gathers again
and hpZ has something to do) and the same data, so the curves differ only by what the quantization changes.

Judged: each ZeRO++ run's mean loss over its last 50 steps within 1% of plain stage 3's (loss_tails.py);
every curve is recorded, so ``results.py --report`` redraws the plot from the records. With ``--seeds N``
each run is made at ``train.seed`` 0 .. N-1 (another init and data order each) and judged by its curve's
mean over the seeds: one seed's 300 steps at micro-batch 1 is one trajectory, and the seed alone moves a
part's ratio by whole points (each seed's ratios are printed and recorded beside the judgement).
hpZ alone is not run here: it is bitwise plain stage 3 (tests/test_two_nodes.py, tests/test_zeropp.py).

    sudo python bench/zeropp_losses.py [--steps 300] [--seeds 1] [--first-seed 0] [--runs qwZ,qgZ,...]
                                       [--model small] [--rate 200mbit]
                                       [--plot FILE] [key=value ...]

It needs root, as two_nodes.py does; without it one line says so and it exits with status 2.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from loss_tails import judge_tails
from pairs import record
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
    parser.add_argument("--seeds", type=int, default=1, help="runs of each at train.seed 0 .. N-1, judged on the mean")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds FIRST .. FIRST+N-1 instead (a replication)")
    parser.add_argument("--runs", default=",".join(list(RUNS)[1:]),
                        help="the ZeRO++ runs beside plain stage 3, comma-separated (default: all three)")
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
    runs = {name: keys for name, keys in RUNS.items() if name == "plain stage 3" or name in args.runs.split(",")}
    if len(runs) < 2:
        parser.error(f"--runs {args.runs!r}: expected some of {', '.join(list(RUNS)[1:])}")
    by_seed: dict[str, list[list[float]]] = {name: [] for name in runs}
    with two_nodes(args.rate) as link, tempfile.TemporaryDirectory(prefix="zo-zeropp-losses-") as tmp:
        seeds = range(args.first_seed, args.first_seed + args.seeds)
        for seed in seeds:
            for name, keys in runs.items():
                print(f"{name}, seed {seed}: {args.steps} steps", flush=True)
                command = ["-m", "zerooffload", "train", "--model", args.model, *BASE, *args.overrides, *keys,
                           f"train.seed={seed}"]
                by_seed[name].append(train(link, command, args.steps, Path(tmp) / "out", args.timeout)["losses"])
    named = f", mean of seeds {seeds[0]}-{seeds[-1]}" if args.seeds > 1 else f", seed {seeds[0]}" if seeds[0] else ""
    title = (f"{args.model}, stage 3, 2 nodes x 2 ranks, {' '.join(args.overrides) or 'defaults'}, {args.steps} steps"
             f"{named}: last-{TAIL}-step mean loss")
    if args.seeds > 1:
        each_seed(by_seed, title, seeds)
    curves = {name: [statistics.fmean(step) for step in zip(*runs)] for name, runs in by_seed.items()}
    failed = judge_tails(curves, title, BOUND, TAIL)
    if args.plot:
        plot_curves(curves, Path(args.plot), CURVES["zeropp_losses"][1])
        print(f"\nplot: {args.plot}")
    return 1 if failed else 0


def each_seed(by_seed: dict[str, list[list[float]]], title: str, seeds: range) -> None:
    """Print and record each seed's last-``TAIL``-step mean of every run over plain stage 3's at that seed
    (shown beside the judgement, which reads the mean over seeds)."""
    reference, *others = by_seed
    print(f"\n| run | {' | '.join(f'seed {s}' for s in seeds)} |\n|---|{'---|' * len(seeds)}")
    for name in others:
        ratios = [statistics.fmean(run[-TAIL:]) / statistics.fmean(plain[-TAIL:])
                  for run, plain in zip(by_seed[name], by_seed[reference])]
        print(f"| {name} / {reference} | {' | '.join(f'{r:.4f}' for r in ratios)} |")
        record("check", title=f"{title}, {name} / {reference}, each seed", value=statistics.fmean(ratios),
               target="—", met=None, detail="seeds: " + ", ".join(f"{r:.4f}" for r in ratios))


if __name__ == "__main__":
    sys.exit(main())
