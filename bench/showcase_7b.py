#!/usr/bin/env python3
"""The 7b showcase: ``zerooffload train --model 7b --plan auto --steps 3`` on this machine, as a user runs it.

With ``--cases defaults --steps 6``: a plain ``zerooffload train --model 7b`` (its default layout and
training defaults), held to learning: no loss of its first six above 1.1x the first, the sixth not above it.

The ``7b`` preset (d_model 4096, 32 layers, ~6.4B parameters; train's defaults for its size: bf16, a batch
of 1 x 1024 tokens, AdamW, clipping at 1.0) under a 60 GB cap on the swap files (``nvme.max_bytes``), and
each further case's overrides beside it. ``plan`` chooses the layout and the optimizer state's format
(the lossless ones first). From each run's summary.json: the losses (finite?), seconds per step
(measured: the mean past the first step, which reads the swap files cold), the plan's prediction and
its floors (compute: forward and backward; I/O: the NVMe bytes a step reads and writes at the probed
rates), the peak RSS above the start (measured apart from the engine: cli/measured.py) and the swap
bytes, each beside the plan's.

    python bench/showcase_7b.py [--steps 3] [--cases cap,16gb] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pairs import record

CASES = {"cap": ("60 GB swap cap", ["nvme.max_bytes=60GB"], None),
         "16gb": ("60 GB cap, 5 GiB budgets (a 16 GB workstation)",
                  ["nvme.max_bytes=60GB", "memory.host_budget=5GiB", "memory.device_budget=5GiB"], 12e9),
         "defaults": ("the default layout, 60 GB swap cap", ["nvme.max_bytes=60GB"], None)}
"""name: (title, overrides, the bound on peak RSS above the start: None for the plan's own prediction).
Every case but ``defaults`` runs ``--plan auto``; ``defaults`` is a plain ``train`` (its default layout)."""
LEARNS = 6
"""Steps from which a run is held to learning (issue 43): no loss above 1.1x the first, the sixth not above it."""
SWAP_CAP = 60e9


def run(overrides: list[str], steps: int, work: Path, plan: bool) -> tuple[dict | None, str, str, float]:
    """One ``train`` of 7b (``--plan auto`` with the swap in ``work`` if ``plan``, else the default layout, its
    swap folder in ``--out``): its summary (None if it failed), the plan's chosen layout, the last line it
    printed on failure, and the wall seconds."""
    out, swap = work / "out", work / "swap"
    swap.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "zerooffload", "train", "--model", "7b", "--steps", str(steps),
                           *(["--plan", "auto", f"nvme.path={swap}"] if plan else []), "--out", str(out), *overrides],
                          capture_output=True, text=True, timeout=4 * 3600)
    wall = time.monotonic() - start
    chosen = re.search(r"^plan: (.*) \(of \d+ that fit\)", done.stderr, re.MULTILINE)
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    summary = json.loads((out / "summary.json").read_text()) if done.returncode == 0 else None
    return summary, chosen.group(1) if chosen else "?", last, wall


def report(name: str, rss_bound: float | None, summary: dict | None, layout: str, last: str, wall: float) -> None:
    print(f"\n### {name}\nlayout the plan chose: {layout}; wall {wall / 60:.1f} min")
    if summary is None:
        print(f"FAILED: {last}")
        record("check", title=f"7b, {name}: trains", value=0, target="finite loss", met=False, detail=last)
        return
    measured, predicted = summary["measured"], summary["predicted"]
    losses = summary["losses"]
    work, moved = predicted["work"], predicted["moved_bytes"]
    rows = [("loss per step", " -> ".join(f"{x:.3f}" for x in losses), "finite" if all(map(math.isfinite, losses))
             else "NOT finite"),
            ("s/step (past the first)", f"{measured['step_seconds']:.1f}", f"plan {predicted['step_seconds']:.1f}"),
            ("compute floor s (fwd+bwd)", f"{work['compute']:.1f}", ""),
            ("I/O floor s (NVMe read / write)", f"{work['nvme_read']:.1f} / {work['nvme_write']:.1f}",
             f"{moved['nvme_read'] / 1e9:.1f} / {moved['nvme_write'] / 1e9:.1f} GB per step"),
            ("peak RSS above start GB", f"{measured['peak_bytes']['device+host'] / 1e9:.2f}",
             f"plan {predicted['ram_peak_bytes'] / 1e9:.2f}"),
            ("swap GB", f"{measured['peak_bytes']['nvme'] / 1e9:.2f}", f"plan {predicted['peak_bytes']['nvme'] / 1e9:.2f}")]
    print("| figure | measured | beside it |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    rss, swap = measured["peak_bytes"]["device+host"], measured["peak_bytes"]["nvme"]
    bound = rss_bound or predicted["ram_peak_bytes"]
    for title, value, target, met, detail in (
            ("loss finite every step", float(all(map(math.isfinite, losses))), "1", all(map(math.isfinite, losses)),
             " -> ".join(f"{x:.3f}" for x in losses)),
            ("peak RSS above start GB", rss / 1e9, f"≤ {bound / 1e9:.2f}" + ("" if rss_bound else " (plan)"),
             rss <= bound, layout),
            ("swap GB", swap / 1e9, f"≤ {SWAP_CAP / 1e9:.0f}", swap <= SWAP_CAP, ""),
            ("s/step, measured / plan's", measured["step_seconds"] / predicted["step_seconds"], "—", None,
             f"{measured['step_seconds']:.1f} / {predicted['step_seconds']:.1f} s; floors: compute "
             f"{work['compute']:.1f} s, NVMe {work['nvme_read']:.1f} / {work['nvme_write']:.1f} s")):
        record("check", title=f"7b, {name}: {title}", value=value, target=target, met=met, detail=detail)
    if len(losses) >= LEARNS:
        worst = max(losses[:LEARNS]) / losses[0]
        learns = worst <= 1.1 and losses[LEARNS - 1] <= losses[0]
        print(f"learns: the highest of the first {LEARNS} losses is {worst:.3f}x the first (≤ 1.1), the sixth "
              f"{losses[LEARNS - 1]:.3f} against the first {losses[0]:.3f}: {'met' if learns else 'NOT met'}")
        record("check", title=f"7b, {name}: highest of the first {LEARNS} losses / the first", value=worst,
               target="≤ 1.1, and the sixth ≤ the first", met=learns,
               detail=" -> ".join(f"{x:.3f}" for x in losses[:LEARNS]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB "
          f"RAM; zerooffload train --model 7b --steps {args.steps} (--plan auto, but for the defaults case)")
    for case in args.cases.split(","):
        name, overrides, rss_bound = CASES[case]
        work = Path(tempfile.mkdtemp(prefix="zo-7b-", dir=args.dir))
        try:
            report(name, rss_bound, *run(overrides, args.steps, work, plan=case != "defaults"))
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
