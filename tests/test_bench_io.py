"""``zerooffload bench io``: records, cleanup, plot and refusals, through the real command line.

Each subprocess costs ~1.5 s (importing torch), so the runs are few and small (8 MiB).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cli_helpers import run_in_process
from zerooffload.cli import bench
from zerooffload.planning import scratch_disk

KEYS = {"backend", "op", "block_size", "queue_depth", "threads", "bytes", "seconds", "gbps"}
SIZE = 8 << 20


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerooffload", "bench", "io", *args],
                          capture_output=True, text=True, timeout=120)


def leftovers(directory) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith("zerooffload-bench-")]


def test_json_records_every_usable_backend(tmp_path):
    done = run_cli("--path", str(tmp_path), "--size", "8MiB", "--json")
    assert done.returncode == 0, done.stderr
    records = json.loads(done.stdout)
    assert {r["backend"] for r in records} <= set(bench.BACKENDS)
    assert "python" in {r["backend"] for r in records}  # needs no native extension: always usable
    for record in records:
        assert set(record) == KEYS
        assert record["op"] in ("read", "write")
        assert record["bytes"] == SIZE and record["seconds"] > 0
        assert record["gbps"] == pytest.approx(SIZE / record["seconds"] / 1e9)
        assert record["block_size"] == 1 << 20
        in_flight = record["queue_depth"] if record["backend"] == "uring" else record["threads"]
        ignored = record["threads"] if record["backend"] == "uring" else record["queue_depth"]
        assert in_flight >= 1 and ignored is None
    for backend in {r["backend"] for r in records}:
        assert sorted(r["op"] for r in records if r["backend"] == backend) == ["read", "write"]
    assert leftovers(tmp_path) == []


def test_flags_sweep_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "io.png"
    done = run_cli("--path", str(tmp_path), "--size", "8MiB", "--backend", "python", "--sweep",
                   "--block-size", "512KiB", "--plot", str(png))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["backend", "op", "block_size", "queue_depth", "threads", "GB/s"]
    threads = [line.split()[4] for line in lines[1:]]  # the pinned block size, every thread count
    assert [line.split()[2] for line in lines[1:]] == ["512KiB"] * len(threads)
    assert threads == [str(t) for t in bench.SWEEP_PYTHON_THREADS for _ in ("write", "read")]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("args, message", [
    (["--backend", "urng"], "did you mean 'uring'"),
    (["--size", "1000TiB"], "does not fit"),
    (["--size", "5000"], "multiple of 4096"),
    (["--block-size", "1000"], "--block-size 1000"),
])
def test_refusals_are_clear(tmp_path, args, message):
    done = run_in_process("bench", "io", "--path", str(tmp_path), *args)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert leftovers(tmp_path) == []


def test_mismatch_names_first_bad_offset():
    written = torch.arange(3 * 4096, dtype=torch.int64).to(torch.uint8)
    read = written.clone()
    read[5000] += 1
    read[9000] += 1
    with pytest.raises(scratch_disk.BenchError, match="first at byte offset 5000"):
        scratch_disk._verify("uring", written, read, chunk=4096)


def test_test_file_removed_on_error(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with scratch_disk._test_file(str(tmp_path), SIZE) as file:
            assert os.path.getsize(file.path) == SIZE  # preallocated: writes overwrite
            raise KeyboardInterrupt
    assert leftovers(tmp_path) == []


def test_sweep_grid_leaves_pinned_knobs_alone():
    assert len(bench.sweep_grid("uring", set())) == len(bench.SWEEP_BLOCK_SIZES) * len(bench.SWEEP_QUEUE_DEPTHS)
    assert bench.sweep_grid("uring", {"block_size"}) == [{"queue_depth": q} for q in bench.SWEEP_QUEUE_DEPTHS]
    assert bench.sweep_grid("python", {"block_size", "threads"}) == [{}]
