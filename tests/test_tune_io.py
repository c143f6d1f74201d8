"""``tune io``: the search against synthetic disks with a known optimum, and the command on a real one.

The synthetic disk has its best setting at io_uring, 2 MiB blocks, queue depth 16 (a smooth peak on the
log2 grid; the pool backend a fifth slower), measured with seeded multiplicative noise and a fake
clock, so each case is exact and repeatable. This machine's disk is flat across settings and swings
±30% from run to run: a flat synthetic disk with that noise stands for it.
"""
from __future__ import annotations

import math
import random
import subprocess
import sys
import tomllib

import pytest

import zerooffload as zo
from zerooffload.planning.scratch_disk import Unavailable
from zerooffload.cli.tune_io import Point, search

OPTIMUM = Point("uring", 2 << 20, 16)


def _truth(point: Point, flat: bool = False) -> tuple[float, float]:
    """The synthetic disk's real (write, read) GB/s at ``point``."""
    if flat:
        return 1.0, 1.2
    peak = 3.0 if point.backend == "uring" else 2.4
    db = math.log2(point.block_size / OPTIMUM.block_size)
    dd = math.log2(point.depth / OPTIMUM.depth)
    shape = math.exp(-db * db / 4 - dd * dd / 6)
    return 0.8 * peak * shape, peak * shape


def _quality(point: Point) -> float:
    """The found point's real score against the optimum's (geometric means of write and read)."""
    return math.sqrt(math.prod(_truth(point))) / math.sqrt(math.prod(_truth(OPTIMUM)))


def _disk(noise: float, seed: int, *, flat: bool = False, seconds_per_run: float = 0.6, unavailable=()):
    rng, now = random.Random(seed), [0.0]

    def measure(point: Point) -> tuple[float, float]:
        if point.backend in unavailable:
            raise Unavailable(f"{point.backend} is not built here")
        now[0] += seconds_per_run
        return tuple(v * (1 + rng.uniform(-noise, noise)) for v in _truth(point, flat))

    return measure, lambda: now[0]


def _search(noise: float, seed: int, **disk) -> tuple[Point, int, str]:
    measure, clock = _disk(noise, seed, **disk)
    result = search(measure, budget=100, clock=clock)
    return result.best, sum(len(samples) for samples in result.measured.values()), result.stopped


def test_a_quiet_disk_gives_its_optimum_exactly():
    for noise in (0.0, 0.1):
        for seed in range(10):
            best, runs, stopped = _search(noise, seed)
            assert _quality(best) >= (1.0 if noise == 0 else 0.9), (noise, seed, best)
            assert stopped == "converged" and runs <= 40


def test_a_disk_swinging_30_percent_mostly_gives_a_setting_within_10_percent():
    qualities = sorted(_quality(_search(0.3, seed)[0]) for seed in range(30))
    assert qualities[len(qualities) // 2] >= 0.95  # the median run finds the optimum or next to it
    assert sum(q >= 0.9 for q in qualities) >= 0.7 * len(qualities)


def test_a_flat_disk_stops_after_the_coarse_grid_and_one_round():
    """Nothing beats the best by more than the noise: one climbing round, then the finalists."""
    _, runs, stopped = _search(0.3, 0, flat=True)
    assert stopped == "converged" and runs <= 12 + 1 + 4 + 6


def test_the_budget_stops_the_search_where_it_is():
    best, runs, stopped = _search(0.0, 0, seconds_per_run=10.0)
    assert stopped == "budget" and runs <= 11


def test_a_backend_that_cannot_run_is_left_out():
    best, _, _ = _search(0.0, 0, unavailable=("uring",))
    assert best.backend == "pool" and (best.block_size, best.depth) == (OPTIMUM.block_size, OPTIMUM.depth)


def test_the_command_writes_a_config_of_its_aio_section_and_the_probe_cache(tmp_path):
    out, cache = tmp_path / "aio.toml", tmp_path / "cache"
    done = subprocess.run([sys.executable, "-m", "zerooffload", "tune", "io", "--path", str(tmp_path), "--size",
                           "8MiB", "--budget", "3", "--out", str(out)], capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "XDG_CACHE_HOME": str(cache)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "best of" in done.stdout and "GB/s" in done.stdout
    written = tomllib.loads(out.read_text())
    assert set(written) == {"aio"} and written["aio"]["backend"] in ("uring", "pool")
    config = zo.Config.load(str(out))
    assert (config.aio.backend, config.aio.block_size) == (written["aio"]["backend"], written["aio"]["block_size"])
    assert config.train == zo.Config().train and config.offload == zo.Config().offload
    probe = __import__("json").loads((cache / "zerooffload" / "probe.json").read_text())
    (entry,) = probe["io"].values()
    assert entry["aio"] == written["aio"] and entry["read_gbps"] > 0 and entry["write_gbps"] > 0
    assert not list(tmp_path.glob("zerooffload-bench-*"))  # the test file is gone


@pytest.mark.parametrize("args, message", [(["--size", "1000"], "multiple of 4096"),
                                           (["--path", "/nonexistent/dir"], "not a directory")])
def test_bad_arguments_are_one_line(tmp_path, capsys, args, message):
    from zerooffload.cli.main import main

    assert main(["tune", "io", "--path", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
