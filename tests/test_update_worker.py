"""The update worker (update_worker's [Note: the update worker]): updates in backward run off the autograd
thread, bounded, joined before any use, failures raised at the next join; and an engine's result with it is
bitwise the synchronous one (``optimizer.updates_in_flight = 0``), and within plain PyTorch AdamW's bound."""
from __future__ import annotations

import errno
import json
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

import zerooffload as zo
from aio_helpers import file_size_limit
from reference import make_batches, make_model, reference_train, update_errors
from zerooffload.io import AioError
from zerooffload.zero.update_worker import UpdateWorker

MICRO = 2
"""Samples per rank per micro-batch."""


# ---------------------------------------------------------------------------------------------- the worker
def _worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "zerooffload-update"]


def test_updates_run_in_order_off_the_submitting_thread_at_most_depth_at_once():
    worker, ran, released, gate = UpdateWorker(2, torch.device("cpu")), [], [], threading.Event()
    seen = []

    def run(i):
        seen.append(worker.in_flight)
        gate.wait(5)
        ran.append((i, threading.current_thread().name))

    for i in range(2):
        worker.submit(f"u{i}", lambda i=i: run(i), lambda i=i: released.append(i))
    assert worker.in_flight == 2 and not ran  # both handed over, the first held at the gate
    timer = threading.Timer(0.2, gate.set)
    timer.start()
    worker.submit("u2", lambda: run(2), lambda: released.append(2))  # waits for room: the gate opens it
    worker.join()
    assert ran == [(i, "zerooffload-update") for i in range(3)] and released == [0, 1, 2]
    assert max(seen) <= 2 and worker.wait_seconds >= 0.1 and not _worker_threads()


def test_depth_0_runs_each_update_where_it_is_submitted():
    worker, ran = UpdateWorker(0, torch.device("cpu")), []
    worker.submit("u", lambda: ran.append(threading.current_thread().name), lambda: ran.append("released"))
    assert ran == [threading.current_thread().name, "released"] and not _worker_threads()
    with pytest.raises(ValueError, match="boom"):
        worker.submit("bad", lambda: (_ for _ in ()).throw(ValueError("boom")), lambda: None)


def test_a_failure_is_the_next_joins_error_and_later_updates_are_dropped():
    worker, ran, released = UpdateWorker(3, torch.device("cpu")), [], []
    error = OSError(errno.EIO, "the block's read failed")
    gate = threading.Event()

    def fail():
        gate.wait(5)
        raise error

    worker.submit("bad", fail, lambda: released.append("bad"))
    worker.submit("next", lambda: ran.append("next"), lambda: released.append("next"))
    gate.set()
    with pytest.raises(OSError) as raised:
        worker.join()
    assert raised.value is error and ran == [] and released == ["bad", "next"]
    worker.join()  # raised once: the worker is clean again
    worker.submit("after", lambda: ran.append("after"), lambda: None)
    worker.join()
    assert ran == ["after"]


def test_a_failure_is_raised_by_the_next_submission_and_abandon_raises_nothing():
    worker, released = UpdateWorker(1, torch.device("cpu")), []
    worker.submit("bad", lambda: 1 / 0, lambda: released.append("bad"))
    with pytest.raises(ZeroDivisionError):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # until the failure is seen: the next submission raises it
            worker.submit("next", lambda: None, lambda: released.append("next"))
    assert released[0] == "bad" and released.count("next") >= 1  # a refused submission released what it held
    worker.abandon()
    assert not _worker_threads()


def test_abandon_waits_for_the_running_update_and_drops_the_rest():
    worker, ran, released, gate = UpdateWorker(2, torch.device("cpu")), [], [], threading.Event()
    worker.submit("running", lambda: (gate.wait(5), ran.append("running")), lambda: released.append("running"))
    worker.submit("queued", lambda: ran.append("queued"), lambda: released.append("queued"))
    threading.Timer(0.1, gate.set).start()
    worker.abandon()
    assert ran == ["running"] and released == ["running", "queued"] and not _worker_threads()


def test_ended_waits_on_another_thread_for_the_update_and_says_whether_it_ran():
    """``ended``: a reader of the updated state (a save's staging thread) waits for one update, told whether
    it ran; the owner's failure stays the owner's to raise."""
    worker, seen, gate = UpdateWorker(2, torch.device("cpu")), [], threading.Event()
    good = worker.submit("good", lambda: gate.wait(5), lambda: seen.append("released good"))
    bad = worker.submit("bad", lambda: 1 / 0, lambda: seen.append("released bad"))
    readers = [threading.Thread(target=lambda u=u, n=n: seen.append((n, worker.ended(u)))) for u, n in
               ((good, "good ended"), (bad, "bad ended"))]
    for reader in readers:
        reader.start()
    time.sleep(0.1)
    assert seen == []  # the first update is held at the gate: neither reader returned
    gate.set()
    for reader in readers:
        reader.join(5)
    assert ("good ended", True) in seen and ("bad ended", False) in seen
    assert seen.index("released good") < seen.index(("good ended", True))
    assert seen.index("released bad") < seen.index(("bad ended", False))
    with pytest.raises(ZeroDivisionError):  # not taken by the readers
        worker.join()
    assert worker.ended(good) is True  # ended already: at once


# ---------------------------------------------------------------------------------------------- the engine
def _config(stage: int, tier: str, in_flight: int, *, clip: float = 0.0, accum: int = 1, precision: str = "fp32",
            nvme: str | None = None) -> dict:
    offload = {"optimizer": {"tier": tier}, "param": {"tier": tier if stage == 3 else "device"}}
    config = {"zero": {"stage": stage, "bucket_size": "16KiB"},
              "train": {"precision": precision, "grad_accum_steps": accum, "grad_clip": clip,
                        "micro_batch_size": MICRO},
              "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "updates_in_flight": in_flight},
              "offload": offload}
    if nvme is not None:
        config["nvme"] = {"path": nvme}
    return config


def train(config: dict, steps: int = 3) -> dict:
    """Train ``steps`` windows on this rank's rows (every rank of a pool): rank 0's full state, norms, undone
    updates and the time its updates in backward ran; None elsewhere."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    accum = config["train"]["grad_accum_steps"]
    norms, undone, busy = [], 0, 0.0
    with zo.initialize(make_model(), config) as engine:
        for window in make_batches(steps, accum, MICRO * world):
            for idx, targets in window:
                engine.backward(engine(idx[rows], targets[rows]))
                if engine.step():
                    norms.append(engine.stats.grad_norm)
                    undone += engine.stats.undone_updates
        busy = engine.window.updates.worker.busy_seconds
        full = engine.full_state_dict()
    return {"full": full, "norms": norms, "undone": undone, "busy": busy} if rank == 0 else None


def _assert_same(synchronous: dict, worker: dict, in_backward: bool = True) -> None:
    """Bitwise the same weights, norms and undone updates; updates ran in backward, if any were due there."""
    assert (synchronous["busy"] > 0) == (worker["busy"] > 0) == in_backward
    assert worker["norms"] == synchronous["norms"] and worker["undone"] == synchronous["undone"]
    assert all(torch.equal(worker["full"][k], synchronous["full"][k]) for k in synchronous["full"])


WINDOWS = {"in backward": (0.0, 1), "accumulating": (0.0, 2), "tentative, kept": (1e9, 1),
           "tentative, redone": (0.05, 2)}
"""(clip, accumulation): updates in backward; over an accumulation window (the earlier parts read and added);
under a clip that does not bind (NVMe: tentative updates committed; host: updates in the step) and one that
does (NVMe: undone and redone in the step)."""


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("stage, tier", [(2, "host"), (2, "nvme"), (3, "host"), (3, "nvme")])
def test_the_worker_is_bitwise_the_synchronous_update(tmp_path, stage, tier, window):
    clip, accum = WINDOWS[window]
    runs = {depth: train(_config(stage, tier, depth, clip=clip, accum=accum, nvme=str(tmp_path)))
            for depth in (0, 2)}
    in_backward = tier == "nvme" or not clip  # under a clip, host state updates in the step
    _assert_same(runs[0], runs[2], in_backward)
    assert (runs[2]["undone"] > 0) == (window == "tentative, redone" and tier == "nvme")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_worker_trains_like_plain_pytorch(tmp_path, precision):
    """Stage 3, everything on NVMe, accumulation, bf16's rounding of the window's parts included."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    config = _config(3, "nvme", 1, accum=2, precision=precision, nvme=str(tmp_path))
    batches = make_batches(3, 2, MICRO)
    initial = make_model().state_dict()
    result = train(config)
    reference = reference_train(make_model(), batches, clip=0.0, dtype=dtype, average_each_micro_batch=True)
    worst = max(update_errors(initial, result["full"], reference).values())
    assert worst < {"fp32": 2e-5, "bf16": 3e-3}[precision]


@pytest.mark.parametrize("stage, tier, accum, precision", [(2, "nvme", 1, "bf16"), (3, "host", 2, "fp32")])
def test_the_worker_is_bitwise_the_synchronous_update_at_world_2(rank_pools, tmp_path, stage, tier, accum,
                                                                  precision):
    """Above world size 1 the update reads a copy of the reducer's part (rounded to bf16 where it is the
    window's whole gradient), and stage 2's all-gathers start in the autograd thread at the join."""
    runs = {depth: rank_pools(2).run(train, _config(stage, tier, depth, accum=accum, precision=precision,
                                                    nvme=str(tmp_path)))[0]
            for depth in (0, 2)}
    _assert_same(runs[0], runs[2])



def _failing_backward(root, in_flight: int) -> tuple[AioError, float]:
    """A step, then a backward whose updates' optimizer blocks cannot be stored: what it raised, how soon."""
    (first,), (second,) = make_batches(2, 1, MICRO)
    with zo.initialize(make_model(), _config(2, "nvme", in_flight, nvme=str(root))) as engine:
        engine.backward(engine(*first))
        engine.step()
        start = time.monotonic()
        with file_size_limit(64 << 10), pytest.raises(AioError) as raised:
            engine.backward(engine(*second))
        assert not _worker_threads()
    return raised.value, time.monotonic() - start


def test_a_failing_update_raises_in_backward_as_the_synchronous_one_does(tmp_path):
    """A real I/O fault (EFBIG on the swap file) in an update the worker runs: backward raises the same
    one-line AioError the synchronous update raises, naming the swap file and the offset, at once."""
    (tmp_path / "sync").mkdir()
    (tmp_path / "worker").mkdir()
    synchronous, _ = _failing_backward(tmp_path / "sync", 0)
    worker, seconds = _failing_backward(tmp_path / "worker", 2)
    assert worker.errno == synchronous.errno == errno.EFBIG and seconds < 30
    unnamed = [re.sub(r"\S+\.swap", "F", str(e)) for e in (synchronous, worker)]
    assert unnamed[0] == unnamed[1] and "\n" not in unnamed[0] and worker.failed_offset == synchronous.failed_offset


def test_the_workers_updates_are_their_own_track_in_a_trace(tmp_path):
    (batch,), = make_batches(1, 1, MICRO)
    path = tmp_path / "trace.json"
    with zo.initialize(make_model(), _config(3, "host", 1)) as engine:
        engine.trace(path)
        engine.backward(engine(*batch))
        engine.step()
        names = {unit.name for unit in engine.units if unit.layout.trainable}
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    updates = {e["name"] for e in events if e.get("ph") == "X" and tracks[e["tid"]] == "updates"}
    assert updates == {f"update {name}" for name in names}
