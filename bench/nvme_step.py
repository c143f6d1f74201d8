#!/usr/bin/env python3
"""An optimizer step with its states on NVMe against the disk's bound: R/read_bw + W/write_bw.

Workload: an MLP of --layers Linear(--width, --width) (default 18 × 4096² ≈ 302M parameters), ZeRO
stage 2, fp32, world size 1, optimizer states (fp32 master, Adam m and v: 12 B/param) in swap files
under --dir, gradient clipping on and ``optimizer.update_in_backward = off`` (so every update runs
in the step, not tentatively in backward: backward_updates' notes). Each round times ``engine.step()`` after a backward: it reads every unit's block and its
reduced gradient shard (R = 12 + 4 B/param; the gradients were written during backward) and writes
the blocks back (W = 12 B/param), updating in between with the native pass. The bound
uses fio's sequential O_DIRECT read and write bandwidth (1 MiB blocks, queue depth 32, 1 GiB)
measured in the same round. Rounds alternate fio and the step (order reversed every other round);
judged on the median per-round ratio step/bound (DESIGN §4 rule; target ≤ 1.15), min/median/max.

With ``--only checksum`` it measures instead what the swap digests cost (``nvme.checksum``, on by
default): two engines over equal models, one verifying and one not, their steps interleaved in
--rounds pairs, each side's time the median of 3 steps (target: the median per-pair ratio ≤ 1.03).

Usage:  python bench/nvme_step.py [--rounds 5] [--dir /tmp] [--width 4096] [--layers 18] [--only checksum]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import zerooffload as zo
from io_vs_fio import ensure_fio, judge_against_fio
from pairs import interleaved_pairs, report_pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--only", choices=["checksum"], help="checksum: the swap digests' cost (see above)")
    args = parser.parse_args()
    if args.only == "checksum":
        return compare_checksum(args)
    ensure_fio()
    work = Path(tempfile.mkdtemp(prefix="zo-step-bench-", dir=args.dir))
    try:
        engine, params = _engine(args, work)
        blocks = engine.memory_report().bytes("nvme", "optimizer")
        grads = engine.memory_report().bytes("nvme", "grad")
        print(f"machine: {os.cpu_count()} CPUs; {params / 1e6:.0f}M parameters, optimizer states on NVMe: the step "
              f"reads {(blocks + grads) / 2**30:.2f} GiB and writes {blocks / 2**30:.2f} GiB")
        step = _timed_step(engine, args.width)
        judge_against_fio("step", args.rounds, work, step, lambda: (blocks + grads, blocks), target=1.15,
                          note=lambda: f"; waited on NVMe {engine.stats.io.wait_seconds:.2f} s",
                          title=f"NVMe optimizer step, {params / 1e6:.0f}M params, vs the fio bound")
        engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _engine(args, work: Path, checksum: bool = True):
    """The benchmark's engine (see the module docstring) and its parameter count."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width) for _ in range(args.layers)))
    engine = zo.initialize(model, {"zero": {"stage": 2}, "train": {"grad_clip": 1.0},
                                   "optimizer": {"type": "adamw", "update_in_backward": "off"},
                                   "offload": {"optimizer": {"tier": "nvme"}},
                                   "nvme": {"path": str(work), "checksum": checksum}})
    return engine, sum(p.numel() for p in model.parameters())


def _timed_step(engine, width: int, repeat: int = 1):
    """A backward, then the timed ``engine.step()``: its seconds (the median of ``repeat`` such)."""
    x = torch.randn(4, width)

    def step() -> float:
        engine.backward(engine(x).square().mean())
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start
    return lambda: statistics.median(step() for _ in range(repeat))


def compare_checksum(args) -> None:
    """The step with swap digests verified (the default) against the same engine shape without."""
    work = Path(tempfile.mkdtemp(prefix="zo-step-bench-", dir=args.dir))
    try:
        (on, params), (off, _) = _engine(args, work), _engine(args, work, checksum=False)
        print(f"machine: {os.cpu_count()} CPUs; {params / 1e6:.0f}M parameters, optimizer states on NVMe, "
              f"{args.rounds} pairs")
        pairs = interleaved_pairs(args.rounds, ("checksum on", _timed_step(on, args.width, repeat=3)),
                                  ("checksum off", _timed_step(off, args.width, repeat=3)))
        report_pairs("NVMe optimizer step: nvme.checksum on (the default) against off",
                     ("checksum on", "checksum off"), pairs, 1.03)
        on.close()
        off.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
