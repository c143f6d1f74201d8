#!/usr/bin/env python3
"""Does ``zerooffload train --plan auto`` hold the memory its plan promised? Predicted peaks against
peaks measured apart from the engine's accounting (``cli/measured.py``'s note).

For each preset and stage, ``zerooffload train --plan auto zero.stage=S`` runs a few steps as a user
would (train's defaults; the plan chooses the rest), plus the same at stage 3 with parameters and
optimizer states pinned to NVMe, so the disk's tier is judged too. From each run's summary.json: the
plan's predicted peak per tier against the measured one: on a CPU device ``device+host`` (the
process's peak RSS above its RSS before the engine was built, against the plan's ``ram_peak_bytes``:
one RAM) and ``nvme`` (the blocks the swap files hold). Judged: within ±15% or ±32 MiB, whichever is larger (RSS carries tens of MB of
allocator noise).

    python bench/peaks_check.py [--models nano,small,50m] [--steps 3] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from zerooffload.cli.train_plan import predicted_peaks

CASES = {"stage 1": ["zero.stage=1"], "stage 3": ["zero.stage=3"],
         "stage 3 nvme": ["zero.stage=3", "offload.param.tier=nvme", "offload.optimizer.tier=nvme"]}
SLACK, FLOOR = 0.15, 32 << 20


def run(model: str, overrides: list[str], steps: int, work: Path) -> tuple[dict, str]:
    """One ``train --plan auto`` run; its summary and the layout the plan chose."""
    out, swap = work / "out", work / "swap"
    swap.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "zerooffload", "train", "--model", model, "--steps", str(steps),
                           "--plan", "auto", "--out", str(out), f"nvme.path={swap}", *overrides],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"}, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{model} {overrides} failed:\n{done.stderr[-3000:]}")
    chosen = re.search(r"^plan: (.*) \(of \d+ that fit\)", done.stderr, re.MULTILINE)
    return json.loads((out / "summary.json").read_text()), chosen.group(1) if chosen else "?"


def judged(predicted: int, measured: int) -> tuple[float, bool]:
    ratio = predicted / measured if measured else float("inf") if predicted else 1.0
    return ratio, abs(predicted - measured) <= max(SLACK * measured, FLOOR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="nano,small,50m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs; train --plan auto, {args.steps} steps each\n")
    print("| model | case | layout | tier | predicted MB | measured MB | ratio | within ±15% or ±32 MiB |\n"
          "|---|---|---|---|---|---|---|---|")
    failed = 0
    for model in args.models.split(","):
        for case in args.cases.split(","):
            work = Path(tempfile.mkdtemp(prefix="zo-peaks-", dir=args.dir))
            try:
                summary, layout = run(model, CASES[case], args.steps, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            predicted, measured = predicted_peaks(summary["predicted"], summary["measured"]), summary["measured"]
            for tier, got in measured["peak_bytes"].items():
                want = predicted[tier]
                if tier == "nvme" and not want and not got:
                    continue
                ratio, ok = judged(want, got)
                failed += not ok
                print(f"| {model} | {case} | {layout} | {tier} | {want / 1e6:.1f} | {got / 1e6:.1f} | {ratio:.2f} | "
                      f"{'yes' if ok else 'NO'} |", flush=True)
    print(f"\n{'every peak is within' if not failed else f'{failed} of the peaks are outside'} the bound")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
