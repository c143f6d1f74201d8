#!/usr/bin/env python3
"""Swap files damaged under a running job: does every run stop, at once, with checkpoints that still work?

Each trial starts ``zerooffload train`` as a user would (the nano preset, ZeRO stage 3, parameters and
optimizer states on NVMe, ``--save-every 1 --keep-last 3``, every other setting the default: swap
checksums on), waits a random 0.5-4 s into training, then damages its swap file the way another process
or a failing disk would:
- ``overwrite``: every byte of the file replaced by random bytes;
- ``truncate``: the file cut to a random length below half its size;
- ``zero-fill``: every byte of the file set to zero;
- ``sign-pairs``: the sign bits of 256 pairs of fp32 values 32 k values apart (k from 1 to 64), each
  pair in pages of the file that hold data (the damage a lane-sum digest missed);
- ``swap-blocks``: two 4 KiB pages that hold different data, at most 64 KiB apart, traded, 16 times
  at random places.
The last two are aimed at live entries by reading the file for pages that hold data (not all zero).
Nothing outside the run says which of those are live: at a step's end each optimizer block has a second,
dead version beside it (the version a binding clip discards), about half the file, which the next step
overwrites unread. 256 pairs, or 16 traded pairs, are where a hit on a live entry is all but certain
(a miss of all 16: 2^-16).
Judged per trial: the run exits 1 with one ``zerooffload: swap block ... is damaged`` line naming the
file and an offset whose range holds damaged bytes; it stopped within 2 steps of the damage (the checkpoint
``latest`` named when the damage struck, against the last one it saved); the newest checkpoint left
consolidates (``zerooffload checkpoint consolidate``) to finite weights; and ``train --resume`` continues
from it for two more steps and exits 0. The table counts the trials that met each point; with
$ZO_BENCH_RECORD set each kind's count is recorded (``pairs.record``).

    python bench/fault_sweep.py [--trials 10] [--kinds sign-pairs,swap-blocks] [--dir /tmp] [--seed 0]
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

from pairs import record

KINDS = ("overwrite", "truncate", "zero-fill", "sign-pairs", "swap-blocks")
PAGE = 4096
TRAIN = ["train", "--model", "nano", "--steps", "1000000", "--save-every", "1", "--keep-last", "3",
         "zero.stage=3", "offload.param.tier=nvme", "offload.optimizer.tier=nvme"]
LINE = re.compile(r"^zerooffload: swap block '(param|optimizer)\.\d+' is damaged: .* \((?P<length>\d+) bytes at "
                  r"offset (?P<offset>\d+) of (?P<file>\S+)\); .*resume from the last checkpoint$")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerooffload", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def _damage(path: Path, kind: str, rng: random.Random, changed: list[tuple[int, int]]) -> None:
    """Damage ``path`` as ``kind`` says, adding each byte range ``[start, end)`` it changed to ``changed``
    as it goes (the run may stop and remove the file before the last)."""
    size = path.stat().st_size
    if kind == "truncate":
        cut = rng.randrange(0, size // 2)
        changed.append((cut, size))
        os.truncate(path, cut)
    elif kind in ("sign-pairs", "swap-blocks"):
        _damage_pages(path, kind, rng, changed)
    else:
        changed.append((0, size))
        with open(path, "r+b") as file:
            for offset in range(0, size, 4 << 20):
                length = min(4 << 20, size - offset)
                file.write(os.urandom(length) if kind == "overwrite" else bytes(length))
            file.flush()
            os.fsync(file.fileno())


def _damage_pages(path: Path, kind: str, rng: random.Random, changed: list[tuple[int, int]]) -> None:
    """Sign pairs or traded pages (see the docstring) in pages of ``path`` that hold data, each value or
    page read from the file just before it is written."""
    import numpy as np

    pages = np.fromfile(path, dtype=np.uint8)
    pages = pages[:pages.size // PAGE * PAGE].reshape(-1, PAGE)
    held = np.flatnonzero(pages.any(axis=1)).tolist()
    holds = set(held)
    width, count = (4, 256) if kind == "sign-pairs" else (PAGE, 16)
    fd = os.open(path, os.O_RDWR)
    try:
        while len(changed) < 2 * count:
            page = rng.choice(held)
            if kind == "sign-pairs":
                first = page * PAGE + 4 * rng.randrange(PAGE // 4)
                pair = (first, first + 4 * 32 * rng.randrange(1, 65))
            else:
                pair = (page * PAGE, (page + rng.randrange(1, 17)) * PAGE)
            if pair[1] // PAGE not in holds:
                continue
            values = [os.pread(fd, width, offset) for offset in pair]
            if kind == "sign-pairs":  # little-endian fp32: the sign is the top bit of the last byte
                values = [value[:3] + bytes([value[3] ^ 0x80]) for value in values]
            elif values[0] == values[1]:
                continue
            else:
                values.reverse()
            for offset, value in zip(pair, values):
                os.pwrite(fd, value, offset)
            changed += [(offset, offset + width) for offset in pair]
        os.fsync(fd)
    finally:
        os.close(fd)


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
    changed: list[tuple[int, int]] = []
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
            _damage(path, kind, rng, changed)
        except OSError:  # the run found the first damaged bytes and removed its files under us: it stopped
            pass
        try:
            _, stderr = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # it trained on: judged below as not stopped
            process.kill()
            _, stderr = process.communicate()
    finally:
        process.kill()
    lines = [line for line in stderr.splitlines() if line.startswith("zerooffload: ")]
    match = LINE.match(lines[-1]) if len(lines) == 1 else None
    saved = _latest_step(out / "checkpoints")
    result = {"one line": process.returncode == 1 and match is not None and match["file"] == str(path),
              "within 2 steps": saved - at_damage <= 1, "steps after": saved - at_damage, "line": lines[-1:]}
    named = (int(match["offset"]), int(match["offset"]) + int(match["length"])) if match else (0, 0)
    result["names damage"] = any(start < named[1] and named[0] < end for start, end in changed)
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
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if not set(kinds) <= set(KINDS):
        parser.error(f"--kinds {args.kinds}: expected some of {', '.join(KINDS)}")
    rng = random.Random(args.seed)
    checks = ("one line", "names damage", "within 2 steps", "finite", "resumed")
    table = {kind: dict.fromkeys(checks, 0) for kind in kinds}
    every = dict.fromkeys(kinds, 0)  # trials that met every point
    print(f"machine: {os.cpu_count()} CPUs; {args.trials} trials per kind of damage under {args.dir}", flush=True)
    for number in range(args.trials):
        for kind in kinds:
            work = Path(tempfile.mkdtemp(prefix="zo-fault-", dir=args.dir))
            try:
                result = trial(kind, work, rng)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            for check in checks:
                table[kind][check] += bool(result[check])
            every[kind] += all(result[check] for check in checks)
            print(f"  trial {number} {kind}: " + ", ".join(f"{c} {'yes' if result[c] else 'NO'}" for c in checks)
                  + f" (stopped {result['steps after']} step(s) after the damage)"
                  + ("" if result["one line"] else f"; line: {result['line']}"), flush=True)
    print("\n| damage | trials | stopped with the one line | it names a damaged range | within 2 steps | "
          "newest checkpoint finite | --resume continued |\n|---|---|---|---|---|---|---|")
    for kind in kinds:
        print(f"| {kind} | {args.trials} | " + " | ".join(f"{table[kind][c]}/{args.trials}" for c in checks) + " |")
        record("check", title=f"swap file damaged under a running run, {kind}: trials that met every point",
               value=every[kind], target=f"= {args.trials}", met=every[kind] == args.trials,
               detail=", ".join(f"{c} {table[kind][c]}/{args.trials}" for c in checks))
    met = all(count == args.trials for count in every.values())
    print(f"\nevery trial met every point: {'yes' if met else 'NO'}")
    raise SystemExit(0 if met else 1)


if __name__ == "__main__":
    main()
