#!/usr/bin/env python3
"""ZeRO-3 with parameters and optimizer states on NVMe: zerooffload against DeepSpeed, same workload.

The workload is ``../shared/anchors/zero3_nvme.py``'s: a ~50M-parameter MLP of two blocks
(d=2048, ffn=6144), batch 64, MSE loss, Adam (lr 1e-4, no weight decay), fp32, one process, every
parameter shard and all optimizer state in swap files under --nvme. Each side runs in its own
process (3 warm-up steps, then --steps timed steps; its median step time), the two sides
interleaved in --pairs pairs with alternating order (DESIGN §4 rule: judged on the median of the
per-pair ratios, min/median/max reported). Targets: ours ≤ 0.6x DeepSpeed's step time, and ours with
``train.grad_clip = 1.0`` ≤ 1.1x ours without (a third side in each round, the order rotating). At
1.0 the clip never binds on this workload (``clip_rate.py``), so its updates in backward, tentative,
are committed; a fourth side clips at 1e-9, which binds every step, so every tentative update is
undone and redone in the step: what a redo costs (target ≤ 2x ours without clipping: a redone step
costs less than two); a fifth clips at 1.0 with ``optimizer.update_in_backward = off`` (every update
waits for the norm, in the step), and from the three clipped sides the share of clipped steps below
which tentative updates win.

Usage:
  python bench/zero3_nvme.py [--pairs 5] [--steps 6] [--nvme DIR]
         [--deepspeed-python /tmp/anchors/dsvenv/bin/python] [--anchor ../shared/anchors/zero3_nvme.py]
  python bench/zero3_nvme.py --side ours [--grad-clip 1.0] [--update-in-backward off]   (one side alone)
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from io_vs_fio import peak_rss_bytes
from pairs import interleaved_pairs, report_pairs, rotating_rounds

RESULT = re.compile(r"RESULT .*step ms min/med/max = (\d+) / (\d+) / (\d+)")
HERE = Path(__file__).resolve().parent


def run_ours(args) -> None:
    """One side: our engine on the anchor's workload; prints the anchor's RESULT line format."""
    import torch

    import zerooffload as zo

    d, f = 2048, 6144
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(d, f), torch.nn.GELU(), torch.nn.Linear(f, d),
                                torch.nn.Linear(d, f), torch.nn.GELU(), torch.nn.Linear(f, d))
    x, y = torch.randn(args.batch, d), torch.randn(args.batch, d)
    engine = zo.initialize(model, {
        "zero": {"stage": 3}, "train": {"grad_clip": args.grad_clip},
        "optimizer": {"type": "adam", "lr": 1e-4, "weight_decay": 0.0, "update_in_backward": args.update_in_backward},
        "offload": {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}},
        "nvme": {"path": args.nvme, "checksum": args.checksum == "on"}})
    times = []
    for step in range(3 + args.steps):
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if step >= 3:
            times.append(time.perf_counter() - start)
    stats = engine.stats.prefetch
    print(f"ours: read wait {stats.read_wait_seconds * 1e3:.0f} ms, gather wait {stats.wait_seconds * 1e3:.0f} ms "
          f"in the last step; units redone in it {engine.stats.undone_updates}; "
          f"peak RSS {peak_rss_bytes() / 2**20:.0f} MB")
    engine.close()
    ms = [t * 1e3 for t in times]
    print(f"RESULT mode=ours dtype=fp32 step ms min/med/max = {min(ms):.0f} / {statistics.median(ms):.0f} / "
          f"{max(ms):.0f} (n={len(ms)})")


def _side(command: list[str], env: dict) -> float:
    """Run one side in a fresh process; its median step time in ms."""
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    match = RESULT.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"{command[:3]} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return float(match.group(2))


def compare(args) -> None:
    nvme = Path(args.nvme)
    ours = [sys.executable, str(Path(__file__).resolve()), "--side", "ours", "--steps", str(args.steps),
            "--batch", str(args.batch), "--nvme", str(nvme / "ours")]
    clipped, redone = [*ours, "--grad-clip", "1.0"], [*ours, "--grad-clip", "1e-9"]
    in_step = [*clipped, "--update-in-backward", "off"]
    theirs = [args.deepspeed_python, args.anchor, "--mode", "ds", "--dtype", "fp32", "--steps", str(args.steps),
              "--batch", str(args.batch), "--nvme", str(nvme / "ds")]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    print(f"machine: {os.cpu_count()} CPUs; swap under {nvme}; {args.pairs} pairs of {args.steps} timed steps")
    sides = {"zerooffload": lambda: _side(ours, env), "zerooffload clip 1.0": lambda: _side(clipped, env),
             "zerooffload clip 1e-9 (redone)": lambda: _side(redone, env),
             "zerooffload clip 1.0, updates in step": lambda: _side(in_step, env)}
    if args.deepspeed_python:
        sides["DeepSpeed ZeRO-3"] = lambda: _side(theirs, env)
    try:
        times = rotating_rounds(args.pairs, sides, unit="ms/step")
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    if args.deepspeed_python:
        report_pairs("ZeRO-3, parameters and optimizer on NVMe", ("zerooffload", "DeepSpeed ZeRO-3"),
                     list(zip(times["zerooffload"], times["DeepSpeed ZeRO-3"])), 0.6, unit="ms/step")
    report_pairs("ZeRO-3 NVMe: train.grad_clip = 1.0 against no clipping", ("zerooffload clip 1.0", "zerooffload"),
                 list(zip(times["zerooffload clip 1.0"], times["zerooffload"])), 1.1, unit="ms/step")
    report_pairs("ZeRO-3 NVMe: every tentative update redone (clip 1e-9) against no clipping",
                 ("zerooffload clip 1e-9 (redone)", "zerooffload"),
                 list(zip(times["zerooffload clip 1e-9 (redone)"], times["zerooffload"])), 2.0, unit="ms/step")
    report_pairs("ZeRO-3 NVMe, grad_clip = 1.0: tentative updates in backward against updates in the step",
                 ("zerooffload clip 1.0", "zerooffload clip 1.0, updates in step"),
                 list(zip(times["zerooffload clip 1.0"], times["zerooffload clip 1.0, updates in step"])), 1.0,
                 unit="ms/step")
    committed, redo, wait = (statistics.median(times[name]) for name in (
        "zerooffload clip 1.0", "zerooffload clip 1e-9 (redone)", "zerooffload clip 1.0, updates in step"))
    print(f"tentative updates win while fewer than {(wait - committed) / (redo - committed):.0%} of steps clip "
          f"(medians: committed {committed:.0f}, redone {redo:.0f}, in the step {wait:.0f} ms/step)")


def compare_checksum(args) -> None:
    """Our default side (swap digests verified) against the same with ``nvme.checksum = off``."""
    nvme = Path(args.nvme)
    ours = [sys.executable, str(Path(__file__).resolve()), "--side", "ours", "--steps", str(args.steps),
            "--batch", str(args.batch), "--nvme", str(nvme / "ours"), "--grad-clip", str(args.grad_clip)]
    print(f"machine: {os.cpu_count()} CPUs; swap under {nvme}; {args.pairs} pairs of {args.steps} timed steps")
    try:
        pairs = interleaved_pairs(args.pairs, ("checksum on", lambda: _side(ours, os.environ.copy())),
                                  ("checksum off", lambda: _side([*ours, "--checksum", "off"], os.environ.copy())),
                                  unit="ms/step")
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    report_pairs("ZeRO-3 NVMe: nvme.checksum on (the default) against off", ("checksum on", "checksum off"), pairs,
                 1.03, unit="ms/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=["ours"], help="run one side alone (used by the comparison)")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--nvme", default="/tmp/zerooffload-bench-nvme")
    parser.add_argument("--deepspeed-python", default="/tmp/anchors/dsvenv/bin/python",
                        help="DeepSpeed's interpreter ('' : compare our sides only)")
    parser.add_argument("--grad-clip", type=float, default=0.0, help="our side's train.grad_clip")
    parser.add_argument("--update-in-backward", default="auto", help="our side's optimizer.update_in_backward")
    parser.add_argument("--checksum", choices=["on", "off"], default="on", help="our side's nvme.checksum")
    parser.add_argument("--only", choices=["checksum"],
                        help="checksum: our default side against nvme.checksum = off alone (the swap digests' cost)")
    parser.add_argument("--anchor", default=str(HERE.parent.parent / "shared" / "anchors" / "zero3_nvme.py"))
    args = parser.parse_args()
    if args.side:
        Path(args.nvme).mkdir(parents=True, exist_ok=True)
        run_ours(args)
    elif args.only == "checksum":
        compare_checksum(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
