"""``zerooffload bench adam``: the CPU optimizer phase of an offloaded step, ours against the peers.

[Note: bench adam vocabulary]
- The *phase* is what an offloaded mixed-precision step does on the CPU for N parameters: one AdamW
  update (weight decay 0.01) and the copy of every new parameter into its preallocated compute-dtype
  tensor (``--dtype``). The N parameters are tensors of 10M elements (the last one shorter), as a
  model's would be.
- A *side* is one way to run the phase:
  ``ours``            ``fused_adam_step``: one native pass that writes the copy too, fp32 gradients;
  ``ours bf16-grad``  the same reading bf16 gradients, as the engine holds them (2 B/param fewer);
  ``torch``           ``torch.optim.AdamW(fused=True).step()``, then ``copy.copy_(param)`` per tensor;
  ``deepspeed``       ``DeepSpeedCPUAdam(adamw_mode=True).step()`` and the same copies, in DeepSpeed's
                      own venv (``bench/ds_adam_side.py``), with ``--deepspeed-python`` only.
- A *round* runs every side once, the order reversed every other round (DESIGN §4: at least 5 rounds,
  a side judged on the median over rounds of its per-round ratio to ``ours``; min/median/max shown).
  Two phases per side run before the first round, so page faults and lazily built optimizer state
  (torch allocates its moments on the first step) are never timed.

Bytes per parameter a phase must move at least: ours reads p, g, m, v and writes p, m, v and the copy
(30 B; 28 with bf16 gradients); torch's two passes move ~36 B. This module is a face (DESIGN §3): it
times the public ``fused_adam_step`` and torch's optimizer and prints; no optimizer logic lives here.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

from ..optim import fused_adam_step, simd_level
from ..precision import COMPUTE_DTYPES
from ..planning.scratch_disk import BenchError
from .peer_process import PeerError, PeerProcess

__all__ = ["run_adam_bench"]

log = logging.getLogger("zerooffload.cli.bench")

TENSOR_NUMEL = 10_000_000
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
STATE_BYTES = 18
"""Bytes per parameter a side holds: fp32 param, grad, exp_avg, exp_avg_sq (16) and the 2-byte copy."""
DS_SIDE = Path(__file__).resolve().parents[2] / "bench" / "ds_adam_side.py"


def run_adam_bench(args: argparse.Namespace) -> int:
    """Time every side over ``args.pairs`` rounds and print the table; the exit status (2: usage)."""
    try:
        n, dtype = _parse(args)
        sides = _open_sides(args, n, dtype)
    except BenchError as exc:
        print(f"zerooffload bench adam: {exc}", file=sys.stderr)
        return exc.code
    try:
        times = _rounds(sides, args.pairs)
    except KeyboardInterrupt:
        print("zerooffload bench adam: interrupted", file=sys.stderr)
        return 130
    finally:
        for side in sides:
            side.close()
    print(format_report(times, n, args))
    return 0


def _parse(args: argparse.Namespace) -> tuple[int, torch.dtype]:
    """``--params`` as a count (``1e8`` and ``100000000`` alike), checked against the memory the sides need."""
    n = int(args.params)
    if n < 1 or n != args.params:
        raise BenchError(f"--params {args.params:g}: must be a whole number >= 1", code=2)
    if args.pairs < 1:
        raise BenchError(f"--pairs {args.pairs}: must be >= 1 (DESIGN §4 asks for 5 or more)", code=2)
    if args.threads < 0:
        raise BenchError(f"--threads {args.threads}: must be >= 0 (0: every CPU)", code=2)
    if args.pairs < 5:
        log.warning("--pairs %d: fewer than the 5 rounds DESIGN §4 asks for a decision", args.pairs)
    holders = 2 + bool(args.deepspeed_python)  # ours (both sides: one state, + bf16 grads), torch, deepspeed
    need = n * (holders * STATE_BYTES + 2)
    available = psutil.virtual_memory().available
    if need > available:
        raise BenchError(f"--params {n} needs ~{need / 1e9:.1f} GB of memory; only "
                         f"{available / 1e9:.1f} GB are available: pass a smaller --params", code=2)
    return n, COMPUTE_DTYPES[args.dtype]


def _sizes(n: int) -> list[int]:
    return [min(TENSOR_NUMEL, n - start) for start in range(0, n, TENSOR_NUMEL)]


# ------------------------------------------------------------------------------------------------
# Sides: each has ``name``, ``phase() -> seconds`` and ``close()``


class _Tensors:
    """Seeded fp32 params and grads, zero moments and empty copies, one of each per tensor size."""

    def __init__(self, n: int, dtype: torch.dtype, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.params = [torch.randn(size, generator=gen) for size in _sizes(n)]
        self.grads = [torch.randn(p.numel(), generator=gen).mul_(1e-3) for p in self.params]
        self.exp_avgs = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in self.params]
        self.copies = [torch.empty(p.numel(), dtype=dtype) for p in self.params]


class OursSide:
    """``fused_adam_step`` over every tensor, writing the copies in the same pass."""

    def __init__(self, name: str, tensors: _Tensors, grads: list[torch.Tensor], threads: int):
        self.name, self.tensors, self.grads, self.threads = name, tensors, grads, threads
        self.step = 0

    def phase(self) -> float:
        t = self.tensors
        self.step += 1
        start = time.perf_counter()
        for p, g, m, v, copy in zip(t.params, self.grads, t.exp_avgs, t.exp_avg_sqs, t.copies):
            fused_adam_step(p, g, m, v, copy, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                            step=self.step, threads=self.threads)
        return time.perf_counter() - start

    def close(self) -> None:
        """Nothing to release: the tensors go with the side."""


class TorchSide:
    """torch's fused AdamW, then the cast into the copies: what the engine would do without our pass."""

    name = "torch"

    def __init__(self, tensors: _Tensors):
        self.params = [torch.nn.Parameter(p) for p in tensors.params]
        for p, g in zip(self.params, tensors.grads):
            p.grad = g
        self.copies = tensors.copies
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                           fused=True)

    def phase(self) -> float:
        start = time.perf_counter()
        self.optimizer.step()
        for copy, p in zip(self.copies, self.params):
            copy.copy_(p.detach())
        return time.perf_counter() - start

    def close(self) -> None:
        """Nothing to release: the tensors go with the side."""


class DeepSpeedSide:
    """DeepSpeedCPUAdam in a long-lived child of its venv (bench/ds_adam_side.py), timed in the child."""

    name = "deepspeed"

    def __init__(self, python: str, n: int, dtype_name: str):
        if not os.access(python, os.X_OK):
            raise BenchError(f"--deepspeed-python {python}: not an executable", code=2)
        try:
            self.peer = PeerProcess([python, str(DS_SIDE), f"--params={n}", f"--tensor-numel={TENSOR_NUMEL}",
                                     f"--dtype={dtype_name}", f"--lr={LR}", f"--weight-decay={WEIGHT_DECAY}"])
        except PeerError as exc:
            raise BenchError(f"deepspeed: {exc}") from None

    def phase(self) -> float:
        return self.peer.ask("step")["ms"] / 1e3

    def close(self) -> None:
        self.peer.close()


def _open_sides(args: argparse.Namespace, n: int, dtype: torch.dtype) -> list:
    """ours, ours bf16-grad (same state, its own bf16 gradients), torch (its own state), deepspeed when asked."""
    mine = _Tensors(n, dtype, seed=0)
    sides = [OursSide("ours", mine, mine.grads, args.threads),
             OursSide("ours bf16-grad", mine, [g.bfloat16() for g in mine.grads], args.threads),
             TorchSide(_Tensors(n, dtype, seed=0))]
    if args.deepspeed_python:
        sides.append(DeepSpeedSide(args.deepspeed_python, n, args.dtype))
    return sides


# ------------------------------------------------------------------------------------------------
# Measuring and reporting


def _rounds(sides: list, pairs: int) -> dict[str, list[float]]:
    """Seconds per side per round, after two untimed phases per side."""
    for side in sides:
        side.phase()
        side.phase()
    times: dict[str, list[float]] = {side.name: [] for side in sides}
    for round_ in range(pairs):
        for side in sides if round_ % 2 == 0 else reversed(sides):
            times[side.name].append(side.phase())
    return times


def _spread(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


def format_report(times: dict[str, list[float]], n: int, args: argparse.Namespace) -> str:
    """A header naming the setting, one line per side (ms and Gparam/s), then ours against each peer
    and against the faster peer of each round, as medians of per-round ratios (higher: ours faster)."""
    peers = [name for name in times if not name.startswith("ours")]
    tensors = f"{math.ceil(n / TENSOR_NUMEL)} tensor(s) of <= {TENSOR_NUMEL / 1e6:g}M"
    lines = [f"bench adam: {n / 1e6:g}M params ({tensors}), AdamW wd {WEIGHT_DECAY}, copy to {args.dtype}, "
             f"{args.pairs} round(s); ours: {simd_level()}, threads={args.threads or 'all'}; "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads",
             f"{'side':<16} {'ms min / median / max':>24} {'Gparam/s':>9}"]
    for name, seconds in times.items():
        lines.append(f"{name:<16} {_spread([s * 1e3 for s in seconds], '.1f'):>24} "
                     f"{n / statistics.median(seconds) / 1e9:>9.2f}")
    against = {peer: times[peer] for peer in peers}
    if len(peers) > 1:
        against["the faster peer"] = [min(round_) for round_ in zip(*against.values())]
    for ours in (name for name in times if name.startswith("ours")):
        for peer, peer_times in against.items():
            ratios = [p / o for p, o in zip(peer_times, times[ours])]
            lines.append(f"{ours} vs {peer}: {statistics.median(ratios):.2f}x (per-round ratios "
                         f"{_spread(ratios, '.2f')})")
    return "\n".join(lines)
