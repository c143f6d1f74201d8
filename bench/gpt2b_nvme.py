#!/usr/bin/env python3
"""The ~2B GPT preset, whose bf16 model states (16 B/param) outgrow this machine's RAM, trains here.

Built under ``zo.init_context`` (no eager copy in memory; GPT-2's init applied module by module through
``init_fn``), ZeRO stage 3, bf16, parameters and optimizer states on NVMe (--dir), activation
checkpointing on, micro-batch --batch × --seq tokens, --steps steps on the offline byte corpus.
Reports parameters, model-state bytes against RAM, peak RSS (VmHWM), and per step the loss and the
split of its time: forward, backward with the update inside it (no clipping, so each unit is updated
as its gradient is reduced: engine's [Note: updates in backward]), the closing ``step()``, and the
waits for NVMe (reads of shards ahead of the all-gathers and of optimizer blocks, writes back) and
for all-gathers. Swap files are removed.

Usage:  python bench/gpt2b_nvme.py [--steps 2] [--batch 1] [--seq 256] [--dir /tmp] [--preset 2b]
"""
from __future__ import annotations

import argparse
import math
import os
import time

import psutil
import torch

import zerooffload as zo
from zerooffload.data import ByteCorpus
from zerooffload.models import GPT, PRESETS
from io_vs_fio import peak_rss_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="2b", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dir", default="/tmp")
    args = parser.parse_args()
    ram = psutil.virtual_memory().total
    torch.manual_seed(0)
    started = time.perf_counter()
    with zo.init_context():
        model = GPT(PRESETS[args.preset])
    engine = zo.initialize(model, {
        "zero": {"stage": 3}, "train": {"precision": "bf16", "activation_checkpointing": True},
        "offload": {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}, "nvme": {"path": args.dir},
        "optimizer": {"lr": 1e-4}}, init_fn=model.init_fn())
    params = sum(p.numel() for p in model.parameters())
    states = 16 * params
    print(f"machine: {os.cpu_count()} CPUs, {ram / 2**30:.1f} GiB RAM; GPT {args.preset}: {params / 1e9:.2f}B params, "
          f"bf16 model states {states / 1e9:.1f} GB = {states / ram:.2f}x RAM; built and offloaded in "
          f"{time.perf_counter() - started:.0f} s; NVMe holds {engine.memory_report().total('nvme') / 1e9:.1f} GB")
    corpus = ByteCorpus()
    try:
        for step in range(args.steps):
            x, y = corpus.batch(step, batch_size=args.batch, seq_len=args.seq)
            start = time.perf_counter()
            loss = engine(x, y)
            forward = time.perf_counter()
            engine.backward(loss)
            middle = time.perf_counter()
            engine.step()
            end = time.perf_counter()
            stats = engine.stats
            print(f"step {step}: loss {loss.item():.3f} ({'finite' if math.isfinite(loss.item()) else 'NOT finite'}); "
                  f"{end - start:.1f} s = forward {forward - start:.1f} s + backward with the updates "
                  f"{middle - forward:.1f} s + step() {end - middle:.1f} s; "
                  f"waited on NVMe {stats.io.wait_seconds:.1f} s and all-gathers {stats.prefetch.wait_seconds:.1f} s "
                  f"(compute ~{end - start - stats.stall_seconds:.1f} s); NVMe read {stats.io.read_bytes / 1e9:.1f} GB, "
                  f"wrote {stats.io.write_bytes / 1e9:.1f} GB ({stats.io_gbps:.2f} GB/s)", flush=True)
        peak = peak_rss_bytes()
        print(f"peak RSS {peak / 1e9:.1f} GB ({peak / ram:.0%} of RAM); engine peaks: "
              + ", ".join(f"{tier} {b / 1e9:.1f} GB" for tier, b in engine.memory_report().peaks.items()))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
