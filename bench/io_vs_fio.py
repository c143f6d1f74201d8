#!/usr/bin/env python3
"""Our async-I/O backends and DeepSpeed's aio handle against fio, on one file, in interleaved rounds.

What it measures: GB/s (1e9 B/s) of writing then reading ``--size`` (1 GiB) with O_DIRECT,
``--block-size`` (1 MiB) pieces and ``--queue-depth`` (32) in flight, by
  fio        ``fio --ioengine=io_uring --direct=1 --bs=1M --iodepth=32 --size=1G`` (write with
             ``--end_fsync=1``), ``bw_bytes`` from ``--output-format=json``: the reference;
  uring, pool, python, aiofiles   zerooffload.io.AsyncIO(raw=True) on each backend; the thread
             backends get ``--queue-depth`` threads (one piece in flight per thread), so every side
             has the same number of pieces in flight;
  deepspeed  DeepSpeed's aio_handle (libaio) in its own venv (bench/ds_aio_side.py), skipped with a
             note when the venv or its async_io op is missing.
Every write is timed up to and including its fsync (after O_DIRECT overwrites it costs ~0.1 ms here, so
it does not matter whether fio's bw_bytes counts its end_fsync). Every side uses the same file, created once,
preallocated and written whole before round 1, so every timed write overwrites written blocks in
place and every read comes from the device (O_DIRECT: never the page cache); fio's read job reads the
file as the side before it in the round left it. Our sides and DeepSpeed check every byte they read
back against what they wrote (outside the timing).

The rule (DESIGN §4): ``--rounds`` (>= 5) rounds, each running every side once (write then read),
the order reversed every other round; a side is judged on the median over rounds of its per-round
ratio to fio's figure in the same round; min/median/max are reported. The disk is shared and noisy
(±30%): only ratios measured in one run mean anything.

Run (a few minutes; never in CI), from the repository root:
    python bench/io_vs_fio.py [--rounds 5] [--dir /tmp] [--size 1GiB]
Machine it was written on: 2 vCPU Xeon (AVX-512), 24 GiB, ext4 on a shared virtio disk (512 B logical /
4 KiB physical blocks, 4 MiB max request), kernel 6.18; the script prints the machine it ran on.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from zerooffload.config import AioConfig, format_size, parse_size
from zerooffload.io import AsyncIO, aligned_empty, open_file
from zerooffload.cli.peer_process import PeerProcess
from pairs import record

OURS = ("uring", "pool", "python", "aiofiles")
HERE = Path(__file__).resolve().parent
DS_PYTHON = "/tmp/anchors/dsvenv/bin/python"


# ------------------------------------------------------------------------------------------------
# Sides: each has write(path) -> seconds and read(path) -> seconds, and close()


class FioSide:
    """fio's io_uring engine, one process per op; the figure is fio's own bw_bytes."""

    name = "fio"

    def __init__(self, args: argparse.Namespace, workdir: str):
        self.args = args
        self.output = os.path.join(workdir, "fio.json")

    def _run(self, rw: str, path: str) -> float:
        a = self.args
        cmd = ["fio", "--name=ref", f"--filename={path}", f"--size={a.size}", f"--bs={a.block_size}",
               f"--iodepth={a.queue_depth}", "--ioengine=io_uring", "--direct=1", f"--rw={rw}",
               "--fallocate=none", "--output-format=json", f"--output={self.output}"]
        if rw == "write":
            cmd.append("--end_fsync=1")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(self.output) as f:
            bw = json.load(f)["jobs"][0][rw]["bw_bytes"]
        return a.size / bw

    def write(self, path: str) -> float:
        return self._run("write", path)

    def read(self, path: str) -> float:
        return self._run("read", path)

    def close(self) -> None:
        if os.path.exists(self.output):
            os.unlink(self.output)


class OurSide:
    """One zerooffload backend through the public facade, raw (no bounce copies), O_DIRECT."""

    def __init__(self, backend: str, args: argparse.Namespace, payload: torch.Tensor, readback: torch.Tensor):
        self.name = backend
        config = AioConfig(backend=backend, block_size=args.block_size, queue_depth=args.queue_depth,
                           threads=args.queue_depth, direct=True)
        self.aio = AsyncIO(config, raw=True)
        self.payload, self.readback = payload, readback

    def write(self, path: str) -> float:
        self.payload.add_(1)  # new bytes each time: a write that moved nothing would read back stale
        with open_file(path, "rw", direct=True, create=False) as file:
            start = time.perf_counter()
            self.aio.write(file, self.payload, 0).wait()
            os.fsync(file.fd)
            return time.perf_counter() - start

    def read(self, path: str) -> float:
        self.readback.zero_()
        with open_file(path, "r", direct=True) as file:
            start = time.perf_counter()
            self.aio.read(file, self.readback, 0).wait()
            seconds = time.perf_counter() - start
        if not torch.equal(self.payload, self.readback):
            raise RuntimeError(f"{self.name}: read back differs from what was written")
        return seconds

    def close(self) -> None:
        self.aio.close()


class DeepSpeedSide:
    """DeepSpeed's aio_handle in a long-lived child process of its venv (see ds_aio_side.py)."""

    name = "deepspeed"

    def __init__(self, args: argparse.Namespace):
        self.peer = PeerProcess([args.ds_python, str(HERE / "ds_aio_side.py"), f"--bytes={args.size}",
                                 f"--block-size={args.block_size}", f"--queue-depth={args.queue_depth}"])

    def write(self, path: str) -> float:
        return self.peer.ask(f"write {path}")["seconds"]

    def read(self, path: str) -> float:
        return self.peer.ask(f"read {path}")["seconds"]

    def close(self) -> None:
        self.peer.close()


# ------------------------------------------------------------------------------------------------
# Setup


def ensure_fio() -> None:
    """Install fio with apt-get when it is missing (the reference side cannot be skipped)."""
    if shutil.which("fio"):
        return
    print("fio is missing: installing it with apt-get", file=sys.stderr)
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], check=True, env={**os.environ,
                   "DEBIAN_FRONTEND": "noninteractive"})


def open_sides(args: argparse.Namespace, workdir: str) -> list:
    """fio first, then each of our usable backends, then DeepSpeed; unusable ones skipped with a note."""
    sides: list = [FioSide(args, workdir)]
    payload, readback = aligned_empty(args.size), aligned_empty(args.size)
    payload.random_(0, 256, generator=torch.Generator().manual_seed(0))
    for backend in OURS:
        try:
            sides.append(OurSide(backend, args, payload, readback))
        except RuntimeError as exc:
            print(f"note: skipping {backend}: {exc}", file=sys.stderr)
    if not os.path.exists(args.ds_python):
        print(f"note: skipping deepspeed: no venv at {args.ds_python} (see shared/anchors/setup_env.sh)",
              file=sys.stderr)
    else:
        try:
            sides.append(DeepSpeedSide(args))
        except RuntimeError as exc:
            print(f"note: skipping deepspeed: {exc}", file=sys.stderr)
    return sides


def make_file(path: str, size: int) -> None:
    """Create, preallocate and write the whole file once, so that every timed write is an overwrite."""
    block = aligned_empty(min(size, 64 << 20))
    block.fill_(0x5A)
    with open_file(path, "rw", direct=True) as file:
        os.posix_fallocate(file.fd, 0, size)
        for offset in range(0, size, block.numel()):
            n = min(block.numel(), size - offset)
            os.pwritev(file.fd, [memoryview(block[:n].numpy())], offset)
        os.fsync(file.fd)


FIO_SIZE = 1 << 30
"""Bytes of fio's reference runs in benchmarks that compare against the disk's bound."""


def rounds_against_fio(rounds: int, workdir: Path, measure: Callable[[], float]) -> Iterator[tuple[float, float, float]]:
    """Per round: ``measure()``'s seconds and fio's read and write bandwidth (bytes/s) in the same round,
    fio first in even rounds and second in odd ones (DESIGN §4); fio's 1 GiB file is removed after."""
    fio = FioSide(argparse.Namespace(size=FIO_SIZE, block_size="1M", queue_depth=32), str(workdir))
    path = str(workdir / "fio.dat")
    make_file(path, FIO_SIZE)

    def bandwidths() -> tuple[float, float]:
        return FIO_SIZE / fio.read(path), FIO_SIZE / fio.write(path)
    try:
        for number in range(rounds):
            if number % 2 == 0:
                read_bw, write_bw = bandwidths()
                seconds = measure()
            else:
                seconds = measure()
                read_bw, write_bw = bandwidths()
            yield seconds, read_bw, write_bw
    finally:
        fio.close()
        os.unlink(path)


def judge_against_fio(label: str, rounds: int, workdir: Path, measure: Callable[[], float],
                      moved: Callable[[], tuple[int, int]], target: float, note: Callable[[], str] = lambda: "", *,
                      title: str) -> None:
    """Time ``measure`` against the disk's bound R/read_bw + W/write_bw, fio measured in the same rounds
    (``moved()``: the bytes R read and W written by the measure just done); print every round (and
    ``note()``), then min/median/max of the times and of the ratios, judged on the median against ``target``
    (and recorded as a check named ``title``)."""
    times, ratios = [], []
    for number, (seconds, read_bw, write_bw) in enumerate(rounds_against_fio(rounds, workdir, measure)):
        read_bytes, write_bytes = moved()
        bound = read_bytes / read_bw + write_bytes / write_bw
        times.append(seconds)
        ratios.append(seconds / bound)
        print(f"  round {number}: {label} {seconds:.2f} s, bound {bound:.2f} s (fio read {read_bw / 1e9:.2f}, write "
              f"{write_bw / 1e9:.2f} GB/s), ratio {ratios[-1]:.3f}{note()}", flush=True)
    median = statistics.median(ratios)
    spread = f"{min(ratios):.3f} / {median:.3f} / {max(ratios):.3f}"
    print(f"\n{label} s min/median/max {mmm(times)}; ratio to the fio bound min/median/max "
          f"{spread} (target ≤ {target}: {'met' if median <= target else 'NOT met'})")
    record("check", title=title, value=median, target=f"≤ {target}", met=median <= target,
           detail=f"{label} / (R/read_bw + W/write_bw), median of {rounds} rounds (min / median / max {spread}); "
                  f"{label} s {mmm(times)}")


# ------------------------------------------------------------------------------------------------
# Rounds and report


def run_rounds(sides: list, path: str, args: argparse.Namespace) -> dict:
    """{(side, op): [GB/s per round]}: every side once per round, the order reversed every other round."""
    speeds: dict = {}
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            for op in ("write", "read"):
                seconds = getattr(side, op)(path)
                speeds.setdefault((side.name, op), []).append(args.size / seconds / 1e9)
        line = "  ".join(f"{s.name} {speeds[(s.name, 'write')][-1]:.2f}/{speeds[(s.name, 'read')][-1]:.2f}"
                         for s in sides)
        print(f"round {r + 1}/{args.rounds} (write/read GB/s): {line}", file=sys.stderr, flush=True)
    return speeds


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM: starts afresh at exec, unlike getrusage's maxrss in a
    child, which can carry its parent's)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024


def record_ratios(speeds: dict, sides: list, args: argparse.Namespace) -> None:
    """One check per side and op: the median per-round GB/s ratio to fio (no target is set for these)."""
    for side in sides[1:]:
        for op in ("write", "read"):
            ratios = [a / b for a, b in zip(speeds[(side.name, op)], speeds[("fio", op)])]
            record("check", title=f"{side.name} {op} GB/s / fio's in the same round (higher: faster)",
                   value=statistics.median(ratios), target="none set", met=None,
                   detail=f"ratio min / median / max {mmm(ratios)}, GB/s {mmm(speeds[(side.name, op)])}; "
                          f"{args.rounds} rounds of {format_size(args.size)}, O_DIRECT")


def mmm(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def report(speeds: dict, sides: list, args: argparse.Namespace) -> str:
    lines = [f"{args.rounds} rounds, {format_size(args.size)} per op, O_DIRECT, block {format_size(args.block_size)},"
             f" {args.queue_depth} in flight, fsync in write; GB = 1e9 B; ratio = side / fio in the same round",
             "", "| side | op | GB/s min / median / max | ratio to fio min / median / max |", "|---|---|---|---|"]
    for side in sides:
        for op in ("write", "read"):
            mine, fio = speeds[(side.name, op)], speeds[("fio", op)]
            ratios = [a / b for a, b in zip(mine, fio)]
            lines.append(f"| {side.name} | {op} | {mmm(mine)} | {mmm(ratios)} |")
    return "\n".join(lines)


def machine(directory: str) -> str:
    """One line naming what the figures were measured on."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    fs = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "-T", directory], capture_output=True,
                        text=True).stdout.split()
    fio = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
    return (f"machine: {cpu}, {os.cpu_count()} CPUs, {mem:.0f} GiB, kernel {platform.release()}, "
            f"{directory} on {' '.join(fs) or '?'}; {fio}, torch {torch.__version__}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the test file goes")
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--block-size", default="1MiB")
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--ds-python", default=DS_PYTHON, help="python of the DeepSpeed venv")
    args = ap.parse_args()
    args.size, args.block_size = parse_size(args.size), parse_size(args.block_size)
    if args.rounds < 5:
        ap.error("--rounds: DESIGN §4 asks for at least 5")
    return args


def main() -> int:
    args = parse_args()
    ensure_fio()
    if shutil.disk_usage(args.dir).free < 2 * args.size:
        sys.exit(f"{args.dir}: less than {2 * args.size} bytes free")
    workdir = tempfile.mkdtemp(prefix="zerooffload-io-vs-fio-", dir=args.dir)
    path = os.path.join(workdir, "data.bin")
    sides: list = []
    try:
        make_file(path, args.size)
        sides = open_sides(args, workdir)
        speeds = run_rounds(sides, path, args)
    finally:
        for side in sides:
            side.close()
        shutil.rmtree(workdir, ignore_errors=True)
    print(machine(args.dir))
    print(report(speeds, sides, args))
    record_ratios(speeds, sides, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
