#!/usr/bin/env python3
"""Stage 3 against stage 2 at world size 2 on a built-in GPT (fp32, gloo), and what prefetch buys.

Three sides, interleaved in rounds (their order rotates each round; DESIGN §4 rule: judged on the
median per-round ratio, min/median/max reported):
  stage 2                    the reference: full parameters on every rank
  stage 3                    partitioned parameters, prefetch along the trace (zero.prefetch_size default)
  stage 3, no prefetch       zero.prefetch_size = 0: every use gathers on demand
For each: mean step time, time blocked waiting for all-gathers per step, prefetch hits/misses and the
peak engine memory on the device tier. Each side runs WARMUP untimed steps (the first records the
trace), then STEPS timed ones. Ranks use one thread each.

Usage:  python bench/stage3.py [--rounds 5] [--steps 3] [--batch 2] [--seq 128] [--preset 50m]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zerooffload as zo
from step_overhead import WARMUP, _batches, _timed
from zerooffload.models import GPT, PRESETS

SIDES = {"stage 2": {"stage": 2}, "stage 3": {"stage": 3}, "stage 3, no prefetch": {"stage": 3, "prefetch_size": 0}}


class _Side:
    """One engine and what its timed steps waited for."""

    def __init__(self, args, zero: dict):
        torch.manual_seed(0)
        self.engine = zo.initialize(GPT(PRESETS[args.preset]), {"zero": zero, "optimizer": {"lr": 1e-4}})
        self.waits: list[float] = []
        self.round_waits: list[float] = []
        self.hits = self.misses = 0

    def step(self, x, y) -> None:
        self.engine.backward(self.engine(x, y))
        self.engine.step()
        prefetch = self.engine.stats.prefetch
        self.waits.append(prefetch.wait_seconds)
        self.hits += prefetch.hits
        self.misses += prefetch.misses


def _rounds(args, rank: int) -> None:
    batches = _batches(args, rank, 2)
    sides = {name: _Side(args, zero) for name, zero in SIDES.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for number in range(args.rounds):
        order = names[number % len(names):] + names[:number % len(names)]
        for name in order:
            side = sides[name]
            side.waits.clear()
            times[name].append(_timed(side.step, batches))
            side.round_waits.append(statistics.mean(side.waits[WARMUP:]))
        if rank == 0:
            print(f"  round {number}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in names), flush=True)
    if rank == 0:
        _report(args, sides, times)


def _report(args, sides: dict[str, _Side], times: dict[str, list[float]]) -> None:
    print("\n| side | s/step min / median / max | gather wait s/step (median) | prefetch hits / misses | peak device MB |")
    print("|---|---|---|---|---|")
    for name, side in sides.items():
        t = times[name]
        wait = statistics.median(side.round_waits)
        peak = side.engine.memory_report().peaks["device"] / 1e6
        print(f"| {name} | {min(t):.3f} / {statistics.median(t):.3f} / {max(t):.3f} | {wait:.3f} | "
              f"{side.hits} / {side.misses} | {peak:.0f} |")
    for name in ("stage 3", "stage 3, no prefetch"):
        ratios = [a / b for a, b in zip(times[name], times["stage 2"])]
        print(f"{name} / stage 2 per round: min {min(ratios):.3f} / median {statistics.median(ratios):.3f} / "
              f"max {max(ratios):.3f}")


def _worker(rank: int, args, store_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    _rounds(args, rank)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--preset", default="50m", choices=sorted(PRESETS))
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}; GPT {args.preset} "
          f"({PRESETS[args.preset].num_params / 1e6:.1f}M params), world size 2 (gloo), batch {args.batch}×{args.seq}"
          " per rank, fp32")
    with tempfile.TemporaryDirectory() as store_dir:
        mp.spawn(_worker, args=(args, store_dir), nprocs=2)


if __name__ == "__main__":
    main()
