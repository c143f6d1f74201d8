#!/usr/bin/env python3
"""Step overhead of the engine against plain PyTorch, on the built-in 50M-parameter GPT (fp32).

Measures (DESIGN §4 rule: the two sides interleaved in pairs, judged on the median per-pair ratio,
min/median/max reported):
  A. world size 1, stage 0      vs  plain PyTorch with torch.optim.AdamW(fused=True)   (target ≤ 1.10x)
  B. world size 2, stage 2      vs  torch DDP (gloo) with AdamW(fused=True)            (target ≤ 1.15x)
Each side of a pair runs WARMUP untimed steps, then STEPS timed steps (forward, backward, optimizer
step) on the same batches; a side's figure is its mean step time. Ranks use one thread each.

Usage:  python bench/step_overhead.py [--pairs 5] [--steps 3] [--batch 2] [--seq 128] [--preset 50m]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zerooffload as zo
from zerooffload.data import ByteCorpus
from zerooffload.models import GPT, PRESETS
from pairs import interleaved_pairs, report_pairs

WARMUP = 1


def _batches(args, rank: int, world: int) -> list:
    corpus = ByteCorpus(max_bytes=4 << 20)
    return [corpus.batch(step, batch_size=args.batch, seq_len=args.seq, rank=rank, world_size=world)
            for step in range(WARMUP + args.steps)]


def _timed(step_fn, batches) -> float:
    for x, y in batches[:WARMUP]:
        step_fn(x, y)
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for x, y in batches[WARMUP:]:
        step_fn(x, y)
    if dist.is_initialized():
        dist.barrier()
    return (time.perf_counter() - start) / (len(batches) - WARMUP)


def _torch_side(args, ddp: bool):
    torch.manual_seed(0)
    model = GPT(PRESETS[args.preset])
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(x, y):
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _engine_side(args, stage: int):
    torch.manual_seed(0)
    engine = zo.initialize(GPT(PRESETS[args.preset]), {"zero": {"stage": stage}, "optimizer": {"lr": 1e-4}})

    def step(x, y):
        engine.backward(engine(x, y))
        engine.step()
    return step


def _pairs(args, torch_step, engine_step, rank: int, world: int) -> list[tuple[float, float]]:
    """(engine, torch) seconds per step, in interleaved pairs."""
    batches = _batches(args, rank, world)
    return interleaved_pairs(args.pairs, ("engine", lambda: _timed(engine_step, batches)),
                             ("torch", lambda: _timed(torch_step, batches)), show=rank == 0)


def _distributed_worker(rank: int, args, store_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    results = _pairs(args, _torch_side(args, ddp=True), _engine_side(args, stage=2), rank, 2)
    if rank == 0:
        report_pairs("B. world size 2: stage 2 vs torch DDP", ("engine", "torch"), results, 1.15)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--preset", default="50m", choices=sorted(PRESETS))
    parser.add_argument("--only", choices=["A", "B"])
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}; GPT {args.preset} "
          f"({PRESETS[args.preset].num_params / 1e6:.1f}M params), batch {args.batch}×{args.seq}, fp32")
    if args.only in (None, "A"):
        torch.set_num_threads(1)
        print("A. world size 1: stage 0 vs plain PyTorch")
        report_pairs("A. world size 1: stage 0 vs plain PyTorch AdamW(fused=True)", ("engine", "torch"),
                     _pairs(args, _torch_side(args, ddp=False), _engine_side(args, stage=0), 0, 1), 1.10)
    if args.only in (None, "B"):
        print("\nB. world size 2: stage 2 vs DDP")
        with tempfile.TemporaryDirectory() as store_dir:
            mp.spawn(_distributed_worker, args=(args, store_dir), nprocs=2)


if __name__ == "__main__":
    main()
