#!/usr/bin/env python3
"""Peak RSS against the engine's own memory report while a deep MLP grows 4x in depth (stage 3, NVMe).

Each depth runs in a process of its own: ``--layers`` and 4 x ``--layers`` Linear(--width, --width)
units (default 24 -> 96 of 2048², ≈ 100M -> 400M parameters), built under ``zo.init_context``, ZeRO
stage 3, bf16, parameters and optimizer on NVMe, batch 8, ``--steps`` steps. Figures:
  - the process's peak RSS above its *baseline* (RSS just before the model is built), from VmHWM;
  - the report's peak: ``memory_report()``'s host + device peaks;
  - RSS above the baseline after every step, to see it flat (or not) step after step.
Targets: peak RSS above the baseline grows ≤ 1.15x for 4x the parameters, and is 0.85–1.15x of the
report's peak at both depths.

Usage:  python bench/rss_depth.py [--layers 24] [--width 2048] [--steps 4] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from pairs import record

CHILD = """
import json, time, torch, zerooffload as zo

def rss(field="VmRSS"):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field)) * 1024

torch.manual_seed(0)
x = torch.randn(8, {width})
baseline = rss()
with zo.init_context():
    model = torch.nn.Sequential(*(torch.nn.Linear({width}, {width}) for _ in range({layers})))
engine = zo.initialize(model, {{"zero": {{"stage": 3}}, "train": {{"precision": "bf16"}}, "nvme": {{"path": {dir!r}}},
                               "offload": {{"param": {{"tier": "nvme"}}, "optimizer": {{"tier": "nvme"}}}}}})
after_steps = []
start = time.perf_counter()
for _ in range({steps}):
    engine.backward(engine(x).float().square().mean())
    engine.step()
    after_steps.append(rss() - baseline)
seconds = (time.perf_counter() - start) / {steps}
peaks = engine.memory_report().peaks
engine.close()
print(json.dumps(dict(params=sum(p.numel() for p in model.parameters()), peak=rss("VmHWM") - baseline,
                      report=peaks["device"] + peaks["host"], after_steps=after_steps, seconds=seconds)))
"""


def _run(layers: int, args) -> dict:
    code = CHILD.format(width=args.width, layers=layers, dir=args.dir, steps=args.steps)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dir", default="/tmp")
    args = parser.parse_args()
    peaks = []
    for layers in (args.layers, 4 * args.layers):
        started = time.perf_counter()
        run = _run(layers, args)
        ratio = run["peak"] / run["report"]
        peaks.append(run["peak"])
        steps = ", ".join(f"{b / 2**20:.0f}" for b in run["after_steps"])
        print(f"{layers} units, {run['params'] / 1e6:.0f}M params: peak RSS above baseline {run['peak'] / 2**20:.0f} MiB, "
              f"report's host + device peak {run['report'] / 2**20:.0f} MiB, RSS/report {ratio:.2f} "
              f"(target 0.85–1.15: {'met' if 0.85 <= ratio <= 1.15 else 'NOT met'}); RSS after each step: {steps} MiB; "
              f"{run['seconds']:.1f} s/step, {time.perf_counter() - started:.0f} s in all", flush=True)
        record("rss", layers=layers, params=run["params"], rss_bytes=run["peak"], report_bytes=run["report"], ratio=ratio)
        record("check", title=f"peak RSS above baseline / report, {layers} units", value=ratio, target="0.85–1.15",
               met=0.85 <= ratio <= 1.15, detail=f"{run['peak'] / 2**20:.0f} MiB vs {run['report'] / 2**20:.0f} MiB")
    growth = peaks[1] / peaks[0]
    print(f"peak RSS above baseline grows {growth:.2f}x for 4x the parameters "
          f"(target ≤ 1.15: {'met' if growth <= 1.15 else 'NOT met'})")
    record("check", title="peak RSS growth for 4x depth", value=growth, target="≤ 1.15", met=growth <= 1.15,
           detail=f"{args.layers} -> {4 * args.layers} units of {args.width}²")


if __name__ == "__main__":
    main()
