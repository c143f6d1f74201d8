#!/usr/bin/env python3
"""The optimizer phase through the engine's public API, against torch's fused AdamW + bf16 cast.

The model: 10 bias-free Linear(3162, 3162) units (100M parameters), bf16 compute, the optimizer on the
host tier, world size 1. The sides, each measured in every round in a rotating order (DESIGN §4: judged on
the median per-round ratio, min/median/max reported):

  step       ``engine.step()`` at stage 1 (backward untimed)      vs  torch: ``AdamW(fused=True).step()`` on
             the fp32 masters (fp32 ``.grad`` in place), then the bf16 weights copied from them     ≤ 0.77x
             and vs our own kernel alone (``fused_adam_step`` over the same 100M elements)           ≤ 1.15x
  clip       the same with ``train.grad_clip = 1.0``             vs  torch with ``clip_grad_norm_`` first ≤ 0.85x
  iteration  forward + backward + step, stages 1 and 2           vs  torch: fp32 parameters, bf16 autocast,
             (torch's own mixed precision, whose forward casts the weights), fused AdamW       ≤ 1.00x each
  backward   stage 2 backward, units updated in it              vs  torch backward + 1.15 x the kernel ≤ 1.00x
  formats    ``engine.step()`` with compact optimizer states     vs  torch, as in step:
             ``optimizer.master = "split"``                                                     ≤ 0.78x
             split and ``optimizer.moments = "bf16"``                                           ≤ 0.60x
             split and ``optimizer.moments = "int8"``                                           ≤ 0.50x
             (byte floors: 26.25/34 = 0.77, 18.25/34 = 0.54, 14.3/34 = 0.42)

The step comparison also prints each side's rate in the bytes it must move (``BYTES_PER_ELEMENT``) and the
byte floor: where both sides stream at the same rate, engine/torch cannot fall below it.

Every figure is a mean over ``--steps`` timed calls after one untimed. Each phase's split (forward,
backward, step) is recorded for ``bench/results.py``'s plot.

Whole iterations run at ``--batch`` rows (1 by default: bf16 matrix products on a CPU without AVX-512
BF16 or AMX take ~70 ms per 3162² unit and row, and would bury the optimizer phase under them).

Usage:  python bench/optimizer_phase.py [--rounds 5] [--steps 3] [--batch 1]
                                       [--only step,clip,iteration,backward,formats]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

import zerooffload as zo
from zerooffload.optim import fused_adam_step, simd_level
from pairs import record, report_pairs, rotating_rounds

WIDTH, UNITS = 3162, 10
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.01


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(UNITS)))


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.float().square().mean()


def _mean_seconds(fn: Callable[[], None], steps: int, before: Callable[[], None] = lambda: None) -> float:
    """``fn``'s mean time over ``steps`` calls after one untimed, ``before`` run untimed ahead of each."""
    total = 0.0
    for index in range(steps + 1):
        before()
        start = time.perf_counter()
        fn()
        if index:
            total += time.perf_counter() - start
    return total / steps


class Engine:
    """The engine side: one engine per configuration, kept for every round."""

    def __init__(self, stage: int, clip: float, batch: torch.Tensor, master: str = "fp32", moments: str = "fp32"):
        config = {"zero": {"stage": stage}, "train": {"precision": "bf16", "grad_clip": clip},
                  "optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY,
                                "master": master, "moments": moments},
                  "offload": {"optimizer": {"tier": "host"}}}
        self.engine = zo.initialize(_model(), config)
        self.batch = batch

    def backward(self) -> None:
        self.engine.backward(_loss(self.engine(self.batch)))

    def iteration(self) -> None:
        self.backward()
        self.engine.step()

    def step_seconds(self, steps: int) -> float:
        return _mean_seconds(self.engine.step, steps, before=self.backward)

    def backward_seconds(self, steps: int) -> float:
        return _mean_seconds(self.backward, steps, before=self.engine.step)

    def split(self, steps: int) -> dict[str, float]:
        """Mean seconds of forward, backward and step over ``steps`` iterations."""
        phases = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        for _ in range(steps):
            start = time.perf_counter()
            loss = _loss(self.engine(self.batch))
            forward = time.perf_counter()
            self.engine.backward(loss)
            backward = time.perf_counter()
            self.engine.step()
            phases["forward"] += forward - start
            phases["backward"] += backward - forward
            phases["step"] += time.perf_counter() - backward
        return {name: seconds / steps for name, seconds in phases.items()}


class Torch:
    """torch's side: fp32 parameters (the masters), fused AdamW, and either bf16 weights copied from the
    masters after each step (the step comparison) or bf16 autocast (whole iterations)."""

    def __init__(self, clip: float, batch: torch.Tensor):
        self.model = _model()
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                           fused=True)
        self.weights = [p.detach().to(torch.bfloat16) for p in self.params]
        self.clip = clip
        self.batch = batch

    def fill_grads(self) -> None:
        """fp32 gradients in place, made once (the step leaves them; an iteration clears them)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.randn_like(p).mul_(1e-3)

    def step(self) -> None:
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        with torch.no_grad():
            for weight, p in zip(self.weights, self.params):
                weight.copy_(p)

    def backward(self) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(self.model(self.batch))
        loss.backward()

    def iteration(self) -> None:
        self.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step_seconds(self, steps: int) -> float:
        return _mean_seconds(self.step, steps, before=self.fill_grads)

    def backward_seconds(self, steps: int) -> float:
        return _mean_seconds(self.backward, steps, before=lambda: self.optimizer.zero_grad(set_to_none=True))

    def split(self, steps: int) -> dict[str, float]:
        phases = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        for _ in range(steps):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _loss(self.model(self.batch))
            forward = time.perf_counter()
            loss.backward()
            backward = time.perf_counter()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            phases["forward"] += forward - start
            phases["backward"] += backward - forward
            phases["step"] += time.perf_counter() - backward
        return {name: seconds / steps for name, seconds in phases.items()}


class Kernel:
    """Our fused Adam pass alone over the same element count: bf16 gradient in, bf16 weights out."""

    def __init__(self):
        numel = WIDTH * WIDTH * UNITS
        self.param = torch.randn(numel) * 0.02
        self.grad = (torch.randn(numel) * 1e-3).to(torch.bfloat16)
        self.exp_avg, self.exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
        self.out = torch.empty(numel, dtype=torch.bfloat16)
        self.count = 0

    def step(self) -> None:
        self.count += 1
        fused_adam_step(self.param, self.grad, self.exp_avg, self.exp_avg_sq, self.out, lr=LR, betas=BETAS, eps=EPS,
                        weight_decay=WEIGHT_DECAY, step=self.count)

    def step_seconds(self, steps: int) -> float:
        return _mean_seconds(self.step, steps)


def _rounds(count: int, sides: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    return rotating_rounds(count, sides, unit="ms", scale=1e3)


def _report(title: str, ours: list[float], theirs: list[float], names: tuple[str, str], target: float) -> None:
    report_pairs(title, names, list(zip(ours, theirs)), target, unit="s")


BYTES_PER_ELEMENT = {"engine": 28, "kernel": 28, "torch": 34, "split": 26.25, "split + bf16 moments": 18.25,
                     "split + int8 moments": 14.3125}
"""What each side must move per element at the least: fp32 master, exp_avg and exp_avg_sq read and
written (24), the gradient read (bf16 here: 2; torch's fp32: 4) and the bf16 weight written (2; torch's
cast reads the master again: 4 + 2). A split master reads and writes its weight and its residual and bit
instead of the fp32 master (2 + 2.125 each way, the weight written anyway); bf16 moments 2 bytes each way
each, int8 moments 1 and a 4-byte scale per 256 elements."""


def _bandwidth_floor(times: dict[str, list[float]]) -> None:
    """Each side's rate in the bytes it must move at the least (``BYTES_PER_ELEMENT``), and the floor of
    engine/torch: where both stream at the same rate, ours cannot take less than that share of torch's time."""
    numel = WIDTH * WIDTH * UNITS
    rates = {side: BYTES_PER_ELEMENT[side] * numel / statistics.median(t) / 1e9 for side, t in times.items()}
    floor = BYTES_PER_ELEMENT["engine"] / BYTES_PER_ELEMENT["torch"]
    detail = ", ".join(f"{side} {rate:.1f} GB/s" for side, rate in rates.items())
    print(f"bytes each side must move, per second: {detail}; engine/torch at equal rates (the byte floor): {floor:.3f}")
    record("check", title="step: the byte floor of engine/torch (both streaming at the same rate)", value=floor,
           target="—", met=None, detail=detail)


def bench_step(args, batch) -> None:
    engine, reference, kernel = Engine(1, 0.0, batch), Torch(0.0, batch), Kernel()
    print("step: engine.step() at stage 1 vs torch fused AdamW + bf16 cast vs our kernel alone")
    times = _rounds(args.rounds, {"engine": lambda: engine.step_seconds(args.steps),
                                  "torch": lambda: reference.step_seconds(args.steps),
                                  "kernel": lambda: kernel.step_seconds(args.steps)})
    _report("step: engine.step() (stage 1, host, bf16, no clip) vs torch fused AdamW + cast", times["engine"],
            times["torch"], ("engine", "torch"), 0.77)
    _report("step: engine.step() vs our fused kernel alone on the same element count", times["engine"],
            times["kernel"], ("engine", "kernel"), 1.15)
    _bandwidth_floor(times)


def bench_clip(args, batch) -> None:
    engine, reference = Engine(1, 1.0, batch), Torch(1.0, batch)
    print("clip: engine.step() with grad_clip 1.0 vs torch clip_grad_norm_ + fused AdamW + cast")
    times = _rounds(args.rounds, {"engine": lambda: engine.step_seconds(args.steps),
                                  "torch": lambda: reference.step_seconds(args.steps)})
    _report("clip: engine.step() (grad_clip 1.0) vs torch clip_grad_norm_ + fused AdamW + cast", times["engine"],
            times["torch"], ("engine", "torch"), 0.85)


def bench_iteration(args, batch) -> None:
    reference = Torch(0.0, batch)
    for stage in (1, 2):
        engine = Engine(stage, 0.0, batch)
        print(f"iteration: stage {stage} forward + backward + step vs torch autocast + fused AdamW")
        times = _rounds(args.rounds, {"engine": lambda: _mean_seconds(engine.iteration, args.steps),
                                      "torch": lambda: _mean_seconds(reference.iteration, args.steps)})
        _report(f"iteration: stage {stage} forward + backward + step vs torch (autocast bf16, fused AdamW)",
                times["engine"], times["torch"], ("engine", "torch"), 1.00)
        for side, runner in (("engine", engine), ("torch", reference)):
            record("split", title=f"stage {stage} iteration", side=side, phases=runner.split(args.steps))
        engine.engine.close()  # its memory, before the next stage's engine


def bench_backward(args, batch) -> None:
    engine, reference, kernel = Engine(2, 0.0, batch), Torch(0.0, batch), Kernel()
    assert all(u.placement.updates_in_backward for u in engine.engine.units), "stage 2 host must update in backward"
    print("backward: stage 2 backward with its updates vs torch backward + 1.15 x our kernel")
    times = _rounds(args.rounds, {"engine": lambda: engine.backward_seconds(args.steps),
                                  "torch": lambda: reference.backward_seconds(args.steps),
                                  "kernel": lambda: kernel.step_seconds(args.steps)})
    bound = [t + 1.15 * k for t, k in zip(times["torch"], times["kernel"])]
    _report("backward: stage 2 backward with updates in it vs torch backward + 1.15 x kernel", times["engine"], bound,
            ("engine", "torch+1.15k"), 1.00)


def bench_formats(args, batch) -> None:
    sides = {"split": Engine(1, 0.0, batch, "split"), "split + bf16 moments": Engine(1, 0.0, batch, "split", "bf16"),
             "split + int8 moments": Engine(1, 0.0, batch, "split", "int8")}
    reference = Torch(0.0, batch)
    print("formats: engine.step() with compact optimizer states vs torch fused AdamW + bf16 cast")
    times = _rounds(args.rounds, {"torch": lambda: reference.step_seconds(args.steps),
                                  **{name: (lambda engine=engine: engine.step_seconds(args.steps))
                                     for name, engine in sides.items()}})
    for name, target in (("split", 0.78), ("split + bf16 moments", 0.60), ("split + int8 moments", 0.50)):
        _report(f"formats: engine.step() (stage 1, host, bf16, {name}) vs torch fused AdamW + cast", times[name],
                times["torch"], (name, "torch"), target)
    print("byte floors (equal rates): " + ", ".join(
        f"{name} {BYTES_PER_ELEMENT[name] / BYTES_PER_ELEMENT['torch']:.3f}" for name in sides))


BENCHES = {"step": bench_step, "clip": bench_clip, "iteration": bench_iteration, "backward": bench_backward,
           "formats": bench_formats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--only", default=",".join(BENCHES), help="comma-separated: " + ", ".join(BENCHES))
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), fused "
          f"Adam on {simd_level()}; {UNITS} x Linear({WIDTH}, {WIDTH}) = {UNITS * WIDTH * WIDTH / 1e6:.0f}M params, "
          f"bf16, batch {args.batch}")
    batch = torch.randn(args.batch, WIDTH)
    for name in args.only.split(","):
        BENCHES[name](args, batch)
        print(flush=True)


if __name__ == "__main__":
    main()
