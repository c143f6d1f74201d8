#!/usr/bin/env python3
"""Peak RSS while a deep MLP grows 4x in depth with parameters and optimizer states on NVMe.

Each depth runs in its own process: ``--layers`` and 4 × ``--layers`` Linear(--width, --width) layers
(default 6 → 24 of 4096², ≈ 100M → 400M parameters), built under ``zo.init_context``, ZeRO stage 3,
bf16, parameters and optimizer on NVMe, batch 8, two steps; the figure is the process's VmHWM.
Target: peak RSS grows ≤ 1.2x while the model grows 4x (fixed batch, buffer and prefetch settings).

Usage:  python bench/rss_depth.py [--layers 6] [--width 4096] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

CHILD = """
import time, torch, zerooffload as zo
with zo.init_context():
    model = torch.nn.Sequential(*(torch.nn.Linear({width}, {width}) for _ in range({layers})))
engine = zo.initialize(model, {{"zero": {{"stage": 3}}, "train": {{"precision": "bf16"}}, "nvme": {{"path": {dir!r}}},
                               "offload": {{"param": {{"tier": "nvme"}}, "optimizer": {{"tier": "nvme"}}}}}})
x = torch.randn(8, {width})
start = time.perf_counter()
for _ in range(2):
    engine.backward(engine(x).float().square().mean())
    engine.step()
seconds = (time.perf_counter() - start) / 2
peaks = engine.memory_report().peaks
engine.close()
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
print(sum(p.numel() for p in model.parameters()), hwm, seconds, peaks["device"], peaks["host"])
"""


def _run(layers: int, args) -> tuple[int, int, float, int, int]:
    code = CHILD.format(width=args.width, layers=layers, dir=args.dir)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    params, hwm, seconds, device, host = done.stdout.split()
    return int(params), int(hwm), float(seconds), int(device), int(host)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--dir", default="/tmp")
    args = parser.parse_args()
    rows = []
    for layers in (args.layers, 4 * args.layers):
        started = time.perf_counter()
        params, hwm, seconds, device, host = _run(layers, args)
        rows.append(hwm)
        print(f"{layers} layers, {params / 1e6:.0f}M params: peak RSS {hwm / 1e9:.2f} GB (engine peaks: device "
              f"{device / 1e9:.2f} GB, host {host / 1e9:.2f} GB); {seconds:.1f} s/step; "
              f"{time.perf_counter() - started:.0f} s in all", flush=True)
    growth = rows[1] / rows[0]
    print(f"peak RSS grows {growth:.2f}x for 4x the parameters (target ≤ 1.2: {'met' if growth <= 1.2 else 'NOT met'})")


if __name__ == "__main__":
    main()
