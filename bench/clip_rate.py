#!/usr/bin/env python3
"""How often ``train.grad_clip = 1.0`` actually clips: the steps whose global gradient norm exceeds it.

A speculative update (update as gradients land, redo when the norm turns out above the threshold) pays
its redo on exactly these steps, so their share decides whether speculation can win. Two workloads:
  gpt    ``zerooffload train``'s built-in default: the nano GPT preset with train_defaults (grad_clip
         1.0, warmup-cosine LR), on the built-in byte corpus;
  zero3  ``bench/zero3_nvme.py``'s MLP (2 blocks, d=2048, ffn=6144, batch 64, MSE, Adam lr 1e-4), fp32.
Both report ``engine.stats.grad_norm`` per step (the norm before clipping) and the clipped share.

Usage:  python bench/clip_rate.py [--steps 60] [--only gpt,zero3]
"""
from __future__ import annotations

import argparse

import torch

import zerooffload as zo
from zerooffload.cli.train_config import load_train_config
from zerooffload.data import ByteCorpus
from zerooffload.models import GPT, PRESETS
from pairs import record

THRESHOLD = 1.0


def gpt_norms(steps: int) -> list[float]:
    preset = PRESETS["nano"]
    config = load_train_config(None, [], preset.num_params, steps)
    torch.manual_seed(config.train.seed)
    engine = zo.initialize(GPT(preset), config)
    corpus = ByteCorpus()
    norms = []
    for step in range(steps):
        x, y = corpus.batch(step, batch_size=config.train.micro_batch_size, seq_len=preset.block_size)
        engine.backward(engine(x, y))
        engine.step()
        norms.append(engine.stats.grad_norm)
    engine.close()
    return norms


def zero3_norms(steps: int) -> list[float]:
    d, f = 2048, 6144
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(d, f), torch.nn.GELU(), torch.nn.Linear(f, d),
                                torch.nn.Linear(d, f), torch.nn.GELU(), torch.nn.Linear(f, d))
    x, y = torch.randn(64, d), torch.randn(64, d)
    engine = zo.initialize(model, {"zero": {"stage": 3}, "train": {"grad_clip": THRESHOLD},
                                   "optimizer": {"type": "adam", "lr": 1e-4, "weight_decay": 0.0}})
    norms = []
    for _ in range(steps):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        norms.append(engine.stats.grad_norm)
    engine.close()
    return norms


WORKLOADS = {"gpt": gpt_norms, "zero3": zero3_norms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--only", default=",".join(WORKLOADS))
    args = parser.parse_args()
    for name in args.only.split(","):
        norms = WORKLOADS[name](args.steps)
        clipped = [i for i, norm in enumerate(norms) if norm > THRESHOLD]
        share = len(clipped) / len(norms)
        print(f"{name}: {len(clipped)} of {len(norms)} steps above grad_clip {THRESHOLD} ({share:.0%}); "
              f"norm first / median / last: {norms[0]:.3g} / {sorted(norms)[len(norms) // 2]:.3g} / {norms[-1]:.3g}; "
              f"clipped steps: {clipped[:10]}{' …' if len(clipped) > 10 else ''}", flush=True)
        record("check", title=f"share of steps clipped at grad_clip {THRESHOLD}, {name}", value=share, target="—",
               met=None, detail=f"{len(clipped)} of {len(norms)} steps")


if __name__ == "__main__":
    main()
