#!/usr/bin/env python3
"""Swap files damaged under a running job: does every run stop, at once, with checkpoints that still work?

Each trial starts ``zerooffload train`` as a user would (the nano preset, ZeRO stage 3, parameters and
optimizer states on NVMe, ``--save-every 1 --keep-last 3``, every other setting the default: swap
checksums on), waits a random 0.5-4 s into training, then damages its swap file the way another process
or a failing disk would:
- ``overwrite``: every byte of the file replaced by random bytes;
- ``truncate``: the file cut to a random length below half its size;
- ``zero-fill``: every byte of the file set to zero.
Judged per trial: the run exits 1 with one ``zerooffload: swap block ... is damaged`` line naming the
file and offset; it stopped within 2 steps of the damage (the checkpoint ``latest`` named when the
damage struck, against the last one it saved); the newest checkpoint left consolidates
(``zerooffload checkpoint consolidate``) to finite weights; and ``train --resume`` continues from it for
two more steps and exits 0. The table counts the trials that met each point.

    python bench/fault_sweep.py [--trials 10] [--dir /tmp] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = ("overwrite", "truncate", "zero-fill")
TRAIN = ["train", "--model", "nano", "--steps", "1000000", "--save-every", "1", "--keep-last", "3",
         "zero.stage=3", "offload.param.tier=nvme", "offload.optimizer.tier=nvme"]
LINE = re.compile(r"^zerooffload: swap block '(param|optimizer)\.\d+' is damaged: .* \(\d+ bytes at offset \d+ "
                  r"of (?P<file>\S+)\); .*resume from the last checkpoint$")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerooffload", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def _damage(path: Path, kind: str, rng: random.Random) -> None:
    size = path.stat().st_size
    if kind == "truncate":
        os.truncate(path, rng.randrange(0, size // 2))
        return
    chunk = 4 << 20
    with open(path, "r+b") as file:
        for offset in range(0, size, chunk):
            length = min(chunk, size - offset)
            file.write(os.urandom(length) if kind == "overwrite" else bytes(length))
        file.flush()
        os.fsync(file.fileno())


def _latest_step(checkpoints: Path) -> int:
    try:
        return int((checkpoints / "latest").read_text().strip()[4:])
    except (OSError, ValueError):
        return 0


def trial(kind: str, work: Path, rng: random.Random) -> dict:
    """One damaged run, then its checkpoints consolidated and resumed; what each check found."""
    out, swap = work / "out", work / "swap"
    swap.mkdir(parents=True)
    process = subprocess.Popen([sys.executable, "-m", "zerooffload", *TRAIN, "--out", str(out), f"nvme.path={swap}"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 120
        while _latest_step(out / "checkpoints") < 1:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run did not start: {process.communicate()[1][-2000:]}")
            time.sleep(0.05)
        time.sleep(rng.uniform(0.5, 4.0))
        (path,) = swap.glob("zerooffload-swap/*.swap")
        at_damage = _latest_step(out / "checkpoints")
        try:
            _damage(path, kind, rng)
        except OSError:  # the run found the first damaged bytes and removed its files under us: it stopped
            pass
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    lines = [line for line in stderr.splitlines() if line.startswith("zerooffload: ")]
    match = LINE.match(lines[-1]) if len(lines) == 1 else None
    saved = _latest_step(out / "checkpoints")
    result = {"one line": process.returncode == 1 and match is not None and match["file"] == str(path),
              "within 2 steps": saved - at_damage <= 1, "steps after": saved - at_damage, "line": lines[-1:]}
    merged = work / "model.safetensors"
    result["finite"] = _cli("checkpoint", "consolidate", str(out / "checkpoints"), str(merged)).returncode == 0 and \
        _finite(merged)
    resumed = _cli("train", "--model", "nano", "--steps", str(saved + 2), "--save-every", "1", "--resume",
                   "--out", str(out), "zero.stage=3", "offload.param.tier=nvme", "offload.optimizer.tier=nvme",
                   f"nvme.path={swap}")
    result["resumed"] = resumed.returncode == 0 and f"resumed from step {saved}" in resumed.stdout
    return result


def _finite(path: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    return all(bool(torch.isfinite(t).all()) for t in load_file(str(path)).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="trials per kind of damage")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    checks = ("one line", "within 2 steps", "finite", "resumed")
    table = {kind: dict.fromkeys(checks, 0) for kind in KINDS}
    print(f"machine: {os.cpu_count()} CPUs; {args.trials} trials per kind of damage under {args.dir}", flush=True)
    for number in range(args.trials):
        for kind in KINDS:
            work = Path(tempfile.mkdtemp(prefix="zo-fault-", dir=args.dir))
            try:
                result = trial(kind, work, rng)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            for check in checks:
                table[kind][check] += bool(result[check])
            print(f"  trial {number} {kind}: " + ", ".join(f"{c} {'yes' if result[c] else 'NO'}" for c in checks)
                  + f" (stopped {result['steps after']} step(s) after the damage)"
                  + ("" if result["one line"] else f"; line: {result['line']}"), flush=True)
    print("\n| damage | trials | stopped with the one line | within 2 steps | newest checkpoint finite | "
          "--resume continued |\n|---|---|---|---|---|---|")
    for kind in KINDS:
        print(f"| {kind} | {args.trials} | " + " | ".join(f"{table[kind][c]}/{args.trials}" for c in checks) + " |")
    met = all(table[kind][c] == args.trials for kind in KINDS for c in checks)
    print(f"\nevery trial met every point: {'yes' if met else 'NO'}")
    raise SystemExit(0 if met else 1)


if __name__ == "__main__":
    main()
