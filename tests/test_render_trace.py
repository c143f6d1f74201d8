"""``bench/render_trace.py`` on a trace recorded through ``zerooffload.trace``'s own recorder and
``write_trace`` (so a change of the file format shows here), at two ranks."""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import time

import matplotlib.image

from zerooffload.trace import Recorder, write_trace

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "bench" / "render_trace.py"


def load_script():
    spec = importlib.util.spec_from_file_location("render_trace", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def record_step(rec: Recorder) -> None:
    """One step as the engine records it: forward, backward, reduce, step with an update inside,
    two overlapping NVMe reads (a prefetch), a write, a wait and the tier counters."""
    pause = lambda: time.sleep(0.002)
    rec.push("forward")
    rec.push("forward h.0")
    rec.counter("device", 4 << 20)
    pause()
    rec.pop()
    rec.pop()
    rec.push("backward")
    first = rec.transfer_started("nvme read", 2 << 20, "optimizer.0")
    second = rec.transfer_started("nvme read", 2 << 20, "optimizer.1")
    pause()
    rec.finish_as("backward h.0", then="backward: reduce")
    wrote = rec.transfer_started("nvme write", 1 << 20, "grad.0")
    pause()
    rec.pop()
    rec.push("step")
    start = time.perf_counter()
    pause()
    rec.transfer_done("nvme read", first, "optimizer.0")
    rec.complete("wait: nvme read optimizer.1", "waits", start, time.perf_counter(), bytes=2 << 20)
    rec.transfer_done("nvme read", second, "optimizer.1")
    rec.push("update h.0")
    rec.counter("host", 3 << 20)
    pause()
    rec.pop()
    rec.transfer_done("nvme write", wrote, "grad.0")
    pause()
    rec.pop()


def write_sample(path: pathlib.Path, steps: int = 2) -> None:
    rec = Recorder()
    rec.start()
    for _ in range(steps):
        record_step(rec)
    events = rec.stop()
    write_trace(path, [events, events])  # two ranks that did the same


def assert_png(path: pathlib.Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
    height, width, _ = matplotlib.image.imread(path).shape
    assert width > 500 and height > 300


def test_renders_one_lane_per_rank_and_track(tmp_path):
    script = load_script()
    trace, out = tmp_path / "trace.json", tmp_path / "trace.png"
    write_sample(trace)
    lanes = script.main([str(trace), str(out), "--width", "10"])
    assert_png(out)
    # collectives hold no events here, so they get no lane
    assert [(lane.pid, lane.track) for lane in lanes] == [
        (pid, track) for pid in (0, 1) for track in ("main", "waits", "nvme read", "nvme write")]
    rows = {lane.track: len(lane.rows) for lane in lanes if lane.pid == 0}
    assert rows == {"main": 1, "waits": 1, "nvme read": 2, "nvme write": 1}  # the two reads overlap


def test_steps_keeps_only_the_first(tmp_path):
    script = load_script()
    trace = tmp_path / "trace.json"
    write_sample(trace, steps=3)
    spans, _, names = script.load(str(trace))
    ends = script.step_ends(spans, names)
    assert len(ends) == 3 and ends == sorted(ends)
    lanes = script.main([str(trace), str(tmp_path / "one.png"), "--steps", "1"])
    assert_png(tmp_path / "one.png")
    kept = [span for lane in lanes for row in lane.rows for span in row]
    assert kept and max(span.end for span in kept) <= ends[0]
    main = [span.name for lane in lanes if lane.pid == 0 and lane.track == "main" for span in lane.rows[0]]
    assert main.count("forward h.0") == 1 and "update h.0" in main


def test_layout_packs_only_what_overlaps():
    """Back-to-back segments whose ``ts + dur`` overshoots the next ``ts`` by float rounding share a
    row; truly overlapping transfers do not."""
    script = load_script()
    names = {(0, 0): "main", (0, 2): "nvme read"}
    spans = [script.Span(0, 0, "forward", 0.1, 0.1 + 0.2), script.Span(0, 0, "backward", 0.3, 0.5),
             script.Span(0, 2, "a", 0.0, 0.4), script.Span(0, 2, "b", 0.2, 0.6), script.Span(0, 2, "c", 0.45, 0.7)]
    lanes = script.layout_lanes(spans, names)
    assert [(lane.track, [[s.name for s in row] for row in lane.rows]) for lane in lanes] == [
        ("main", [["forward", "backward"]]), ("nvme read", [["a", "c"], ["b"]])]
