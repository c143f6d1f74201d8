#!/usr/bin/env python3
"""Saving NVMe-resident state against the disk's bound, and the peak memory of consolidation.

Workload: an MLP of --layers Linear(--width, --width) layers (default 6 × 4096² ≈ 100M parameters),
ZeRO stage 3, fp32, parameters and optimizer states on NVMe (swap files under --dir), world size 1.
A save reads every unit's fp32 master and Adam moments from the swap files (R bytes, 12 per
parameter) and writes them to the checkpoint's rank file (W bytes, the same 12, plus small files).
The bound for one save is R/read_bw + W/write_bw, with fio's sequential O_DIRECT read and write
bandwidth (1 MiB blocks, queue depth 32, 1 GiB) measured in the same round. Rounds alternate fio and
the save (order reversed every other round); judged on the median per-round ratio save/bound
(DESIGN §4 rule; target ≤ 1.25), min/median/max reported.

Then ``zerooffload checkpoint consolidate`` runs in a child process on the last checkpoint: its peak
RSS is reported next to the largest tensor and the checkpoint's size (tensor by tensor: the peak
should sit near the interpreter plus one tensor, not near the checkpoint).

Usage:  python bench/checkpoint_io.py [--rounds 5] [--dir /tmp/zo-ckpt-bench] [--width 4096] [--layers 6]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import zerooffload as zo
from io_vs_fio import ensure_fio, judge_against_fio, peak_rss_bytes
from pairs import record


def _engine(args, swap: Path):
    swap.mkdir()  # the engine takes an existing swap directory only (a missing one is an unmounted disk)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width) for _ in range(args.layers)))
    return zo.initialize(model, {"zero": {"stage": 3}, "optimizer": {"type": "adam"}, "nvme": {"path": str(swap)},
                                 "offload": {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}})


def _judge_saves(args, engine, work: Path) -> tuple[int, int]:
    """Save rounds against fio (the bound: the blocks read from swap, the files written); the bytes of each."""
    stored = engine.memory_report().bytes("nvme", "optimizer")
    written = 0

    def save() -> float:
        nonlocal written
        shutil.rmtree(work / "ckpt", ignore_errors=True)
        start = time.perf_counter()
        path = engine.save_checkpoint(work / "ckpt", tag="bench")
        seconds = time.perf_counter() - start
        written = sum(f.stat().st_size for f in path.iterdir())
        return seconds

    judge_against_fio("save", args.rounds, work, save, lambda: (stored, written), target=1.25,
                      title=f"checkpoint save of NVMe state, {stored / 2**30:.2f} GiB, vs the fio bound")
    return stored, written


PEAK_RSS = "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')))"
"""A child's own peak RSS in kB (VmHWM starts afresh at exec; getrusage's maxrss would carry the parent's)."""


def _child_peak_rss(code: str) -> float:
    done = subprocess.run([sys.executable, "-c", f"{code}; {PEAK_RSS}"], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1]) / 1024


def _consolidate_peak_rss(checkpoint: Path, out: Path) -> float:
    """Peak RSS in MB of a child process that consolidates ``checkpoint`` into ``out``."""
    return _child_peak_rss(f"from zerooffload.checkpoint import consolidate; consolidate({str(checkpoint)!r}, "
                           f"{str(out)!r})")


def _baseline_rss() -> float:
    """Peak RSS in MB of a child that only imports what consolidation imports."""
    return _child_peak_rss("import zerooffload.checkpoint")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    ensure_fio()
    work = Path(tempfile.mkdtemp(prefix="zo-ckpt-bench-", dir=args.dir))
    try:
        engine = _engine(args, work / "swap")
        params = sum(p.numel() for p in engine.module.parameters())
        print(f"machine: {os.cpu_count()} CPUs; {params / 1e6:.0f}M parameters, stage 3, fp32, state on NVMe "
              f"under {work}")
        stored, written = _judge_saves(args, engine, work)
        engine.close()
        print(f"save: reads {stored / 2**30:.2f} GiB from swap, writes {written / 2**30:.2f} GiB")
        peak = _consolidate_peak_rss(work / "ckpt", work / "model.safetensors")
        base = _baseline_rss()
        largest = args.width * args.width * 4 / 2**20
        print(f"consolidate: peak RSS {peak:.0f} MB (imports alone {base:.0f} MB; largest tensor {largest:.0f} MB; "
              f"checkpoint {written / 2**20:.0f} MB, output {(work / 'model.safetensors').stat().st_size / 2**20:.0f} MB)")
        record("check", title="consolidate: peak RSS above the imports alone (MB)", value=peak - base,
               target=f"near one tensor ({largest:.0f} MB), far below the checkpoint ({written / 2**20:.0f} MB)",
               met=None, detail=f"peak {peak:.0f} MB, imports alone {base:.0f} MB")
        print(f"this process's peak RSS {peak_rss_bytes() / 2**20:.0f} MB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
