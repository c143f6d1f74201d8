"""``engine.trace``: a Chrome trace of real steps (stage 3, everything on NVMe), checked against the
engine's own counters and the test's own clock (trace's [Note: step traces])."""
from __future__ import annotations

import json
import time

import torch.distributed as dist

import zerooffload as zo
from zerooffload.trace import memory_series
from reference import make_batches, make_model

CONFIG = {"zero": {"stage": 3}, "offload": {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}},
          "train": {"grad_clip": 1.0}}  # tentative updates in backward, and their commits


def trace_case(path: str, traced: int = 2) -> dict | None:
    """Every rank: one step, ``traced`` traced steps (their own clock and NVMe counters kept), one
    more; rank 0 returns the file and what it measured."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    batches = make_batches(2 + traced, 1, 2 * world, seed=3)
    rows = slice(2 * rank, 2 * rank + 2)
    windows, io_bytes = [], 0
    with zo.initialize(make_model(), CONFIG) as engine:
        for number, ((idx, targets),) in enumerate(batches):
            if number == 1:
                engine.trace(path, steps=traced)
            start = time.perf_counter()
            engine.backward(engine(idx[rows], targets[rows]))
            engine.step()
            if 1 <= number <= traced:
                windows.append((start, time.perf_counter()))
                io_bytes += engine.stats.io.read_bytes + engine.stats.io.write_bytes
    if rank:
        return None
    with open(path) as file:
        return {"trace": json.load(file), "windows": windows, "io_bytes": io_bytes}


def _checked(trace: dict) -> list[dict]:
    """The events, each with the fields its phase needs; async spans paired."""
    events = trace["traceEvents"]
    for event in events:
        assert {"name", "ph", "pid"} <= set(event), event
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["ts"] >= 0 and isinstance(event["tid"], int)
    opened = {(e["pid"], e["id"]) for e in events if e["ph"] == "b"}
    closed = {(e["pid"], e["id"]) for e in events if e["ph"] == "e"}
    assert opened and opened == closed
    return events


def test_a_trace_covers_each_step_and_counts_the_nvme_bytes_the_engine_counts(tmp_path):
    result = trace_case(str(tmp_path / "trace.json"), traced=3)
    events = _checked(result["trace"])
    origin = result["trace"]["otherData"]["origin_perf_counter"]
    main = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert {"backward: reduce", "step"} <= {e["name"] for e in main}
    assert any(e["name"].startswith("forward blocks.") for e in main)
    assert any(e["name"].startswith("backward blocks.") for e in main)
    assert any(e["name"].startswith("update ") for e in main)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in main)
    assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:]))  # disjoint segments, never double counted
    for start, end in result["windows"][:-1]:  # the test's own clock, forward start to step end (the last
        # traced step also writes the file)
        lo, hi = (start - origin) * 1e6, (end - origin) * 1e6
        covered = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)
        assert covered >= 0.95 * (hi - lo), covered / (hi - lo)
    nvme = sum(e["args"]["bytes"] for e in events if e["ph"] == "b")
    assert nvme == result["io_bytes"] > 0
    assert any(e["ph"] == "C" and e["name"] == "host bytes" for e in events)
    assert (tmp_path / "trace.json.memory.png").stat().st_size > 0
    series = memory_series([{k: v for k, v in e.items() if k != "pid"} for e in events if "ts" in e])
    end = max(points[-1][0] for points in series.values())
    assert {"device bytes", "host bytes", "nvme bytes"} <= set(series)
    for name, points in series.items():  # the swap files' bytes never change here: one sample, held to the end
        assert len(points) >= 2 and points[-1][0] == end and points[0][0] < end, name


def test_a_trace_at_world_2_is_one_file_with_a_process_per_rank(rank_pools, tmp_path):
    result = rank_pools(2).run(trace_case, str(tmp_path / "trace.json"), 1)[0]
    events = _checked(result["trace"])
    assert {e["pid"] for e in events} == {0, 1}
    for rank in (0, 1):
        assert any(e["ph"] == "X" and e["pid"] == rank and e["name"] == "step" for e in events)
        assert any(e["ph"] == "X" and e["pid"] == rank and e["name"] == "zerooffload::all_gather" for e in events)

