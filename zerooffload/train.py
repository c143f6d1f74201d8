"""``zerooffload train``: the built-in GPT on the offline byte corpus, read top to bottom.

Without ``--config`` the run uses ``TRAIN_DEFAULTS`` (below) over the library defaults: a batch and
learning rate that make the small preset's loss fall visibly within a minute or two on a laptop
CPU. With ``--config`` the file alone decides (library defaults for what it leaves out). Overrides
(``key.path=value``) apply last either way. ``scheduler.total_steps = 0`` with a decaying schedule
means "the run's ``--steps``". Under ``torchrun`` every rank trains its slice and rank 0 reports.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .config import Config, apply_override
from .data import ByteCorpus
from .engine import initialize
from .models import GPT, PRESETS

__all__ = ["TRAIN_DEFAULTS", "load_train_config", "run_training"]

TRAIN_DEFAULTS = {
    "train": {"micro_batch_size": 16, "grad_clip": 1.0},
    "optimizer": {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.95]},
    "scheduler": {"type": "warmup_cosine", "warmup_steps": 20, "min_lr": 3e-4},
}
"""What ``zerooffload train`` uses when no ``--config`` is given (fp32: faster than bf16 at this size)."""


def load_train_config(config_path: str | None, overrides: list[str], steps: int) -> Config:
    """The run's config: file or TRAIN_DEFAULTS, overrides, and total_steps filled from ``--steps``."""
    data = Config.load(config_path).to_dict() if config_path else json.loads(json.dumps(TRAIN_DEFAULTS))
    for override in overrides:
        data = apply_override(data, override)
    scheduler = data.get("scheduler", {})
    if scheduler.get("type", "constant") != "constant" and not scheduler.get("total_steps"):
        data = apply_override(data, f"scheduler.total_steps={max(steps, scheduler.get('warmup_steps', 0) + 1)}")
    return Config.load(data)


def run_training(args: argparse.Namespace) -> int:
    """Train ``args.model`` for ``args.steps`` optimizer steps; print a summary and write it to ``--out``."""
    config = load_train_config(args.config, args.overrides, args.steps)
    torch.manual_seed(config.train.seed)
    model_config = PRESETS[args.model]
    engine = initialize(GPT(model_config), config)
    checkpoints = Path(args.out) / "checkpoints"
    first_step = engine.load_checkpoint(checkpoints)["next_step"] if args.resume else 0
    if first_step >= args.steps:
        engine.close()
        if engine.comm.rank == 0:
            print(f"nothing to train: {checkpoints} is at step {first_step} and --steps is {args.steps}")
        return 0
    corpus = ByteCorpus()
    rank, world = engine.comm.rank, engine.comm.world_size
    micro, accum, seq = config.train.micro_batch_size, config.train.grad_accum_steps, model_config.block_size
    tokens_per_step = micro * accum * world * seq
    losses, started = [], time.perf_counter()
    progress = tqdm(range(first_step, args.steps), desc=f"train {args.model}", disable=rank != 0, unit="step",
                    mininterval=1.0, initial=first_step, total=args.steps)
    for step in progress:
        step_start, window_loss = time.perf_counter(), 0.0
        for micro_step in range(accum):
            x, y = corpus.batch(step * accum + micro_step, batch_size=micro, seq_len=seq, seed=config.train.seed,
                                rank=rank, world_size=world)
            loss = engine(x.to(engine.comm.device), y.to(engine.comm.device))
            engine.backward(loss)
            engine.step()
            window_loss += loss.item() / accum
        losses.append(window_loss)
        elapsed = time.perf_counter() - step_start
        progress.set_postfix(loss=f"{window_loss:.3f}", tok_s=f"{tokens_per_step / elapsed:,.0f}",
                             step_s=f"{elapsed:.3f}", **_offload_postfix(engine.stats))
        if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            engine.save_checkpoint(checkpoints, client_state={"next_step": step + 1})
    summary = _summary(args, engine, losses, time.perf_counter() - started, tokens_per_step, model_config)
    engine.close()
    if rank == 0:
        _print_summary(summary)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


def _offload_postfix(stats) -> dict[str, str]:
    """Stage 3 and NVMe figures for the progress bar, when the run has them."""
    postfix = {}
    if stats.prefetch_hit_rate is not None:
        postfix["prefetch"] = f"{stats.prefetch_hit_rate:.0%}"
    if stats.io.read_bytes or stats.io.write_bytes:
        postfix["nvme"] = f"{stats.io_gbps:.2f}GB/s"
        postfix["io_wait_s"] = f"{stats.io.wait_seconds:.2f}"
    if stats.link.host_to_device_bytes or stats.link.device_to_host_bytes:
        postfix["host<->device"] = f"{stats.link_gbps:.2f}GB/s"
    return postfix


def _summary(args, engine, losses: list[float], seconds: float, tokens_per_step: int, model_config) -> dict:
    window = min(20, max(1, len(losses) // 2))
    first, last = statistics.fmean(losses[:window]), statistics.fmean(losses[-window:])
    report = engine.memory_report()
    return {"model": args.model, "params": model_config.num_params, "steps": len(losses),
            "world_size": engine.comm.world_size, "stage": engine.stage, "precision": engine.config.train.precision,
            "seconds": round(seconds, 2), "tokens_per_second": round(tokens_per_step * len(losses) / seconds),
            "first_loss_mean": first, "last_loss_mean": last, "loss_ratio": last / first, "window": window,
            "skipped_steps": engine.skipped_steps, "peak_bytes": dict(report.peaks), "losses": losses}


def _print_summary(s: dict) -> None:
    print(f"\ntrained {s['model']} ({s['params'] / 1e6:.2f}M params) for {s['steps']} steps in {s['seconds']:.1f} s "
          f"on {s['world_size']} rank(s), ZeRO stage {s['stage']}, {s['precision']}")
    print(f"loss: mean of first {s['window']} steps {s['first_loss_mean']:.3f} -> last {s['window']} "
          f"{s['last_loss_mean']:.3f} (x{s['loss_ratio']:.2f}); {s['tokens_per_second']:,} tokens/s")
    print("peak engine memory: " + ", ".join(f"{tier} {n / 1e6:.1f} MB" for tier, n in s["peak_bytes"].items()))
