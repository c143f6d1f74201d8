"""The step's updates beside the next forward (step_updates' [Note: the step beside the next forward]): the
losses and weights bitwise those of the synchronous step (``optimizer.updates_in_flight = 0``) at stages 1-3,
host and NVMe optimizer states, with accumulation, a clip that binds and one that does not, at world sizes 1
and 2; the updates on the trace's ``updates`` track beside the next forward; a real I/O error in one raised by
the next engine call."""
from __future__ import annotations

import errno
import json
import re
import threading

import pytest
import torch
import torch.distributed as dist

import zerooffload as zo
from aio_helpers import file_size_limit
from reference import make_batches, make_model
from zerooffload.io import AioError
from zerooffload.zero.update_worker import UpdateWorker

MICRO = 2
"""Samples per rank per micro-batch."""


def _config(stage: int, tier: str, in_flight: int, *, clip: float, accum: int, nvme: str, in_backward: str = "off"
            ) -> dict:
    """bf16 (with fp32 and NVMe at stage 3 the shards are read from the masters: the step stays synchronous);
    ``in_backward`` off by default, so that every unit is updated by the step."""
    return {"zero": {"stage": stage, "bucket_size": "16KiB"},
            "train": {"precision": "bf16", "grad_accum_steps": accum, "grad_clip": clip, "micro_batch_size": MICRO},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "updates_in_flight": in_flight,
                          "update_in_backward": in_backward},
            "offload": {"optimizer": {"tier": tier}, "param": {"tier": tier if stage == 3 else "device"}},
            "nvme": {"path": nvme}}


def train(config: dict, steps: int = 2) -> dict | None:
    """Train ``steps`` windows on this rank's rows (every rank of a pool): rank 0's losses, norms, full state
    and the time the step's worker ran updates; None elsewhere."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    losses, norms = [], []
    with zo.initialize(make_model(), config) as engine:
        for window in make_batches(steps, config["train"]["grad_accum_steps"], MICRO * world):
            for idx, targets in window:
                loss = engine(idx[rows], targets[rows])
                losses.append(loss.item())
                engine.backward(loss)
                if engine.step():
                    norms.append(engine.stats.grad_norm)
        busy = engine._updater.step_updates.worker.busy_seconds
        full = engine.full_state_dict()
    return {"losses": losses, "norms": norms, "full": full, "busy": busy} if rank == 0 else None


def _assert_bitwise(synchronous: dict, beside: dict) -> None:
    assert synchronous["busy"] == 0 < beside["busy"]  # the step's worker ran the updates, only there
    assert beside["losses"] == synchronous["losses"] and beside["norms"] == synchronous["norms"]
    assert all(torch.equal(beside["full"][k], synchronous["full"][k]) for k in synchronous["full"])


WINDOWS = {"clip binds, accumulating": (0.05, 2), "clip does not bind": (1e9, 1)}


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("stage, tier", [(1, "host"), (1, "nvme"), (2, "host"), (2, "nvme"), (3, "host"),
                                         (3, "nvme")])
def test_the_step_beside_the_forward_is_bitwise_the_synchronous_step(tmp_path, stage, tier, window):
    clip, accum = WINDOWS[window]
    runs = [train(_config(stage, tier, depth, clip=clip, accum=accum, nvme=str(tmp_path))) for depth in (0, 1)]
    _assert_bitwise(*runs)


def test_redone_tentative_updates_run_beside_the_forward_bitwise(tmp_path):
    """Optimizer state on NVMe updated tentatively in backward: a binding clip undoes them, the step redoes them."""
    runs = [train(_config(2, "nvme", depth, clip=0.05, accum=1, nvme=str(tmp_path), in_backward="auto"))
            for depth in (0, 1)]
    _assert_bitwise(*runs)


@pytest.mark.parametrize("stage, tier, accum", [(1, "host", 2), (2, "host", 1), (3, "nvme", 2)])
def test_the_step_beside_the_forward_is_bitwise_at_world_2(rank_pools, tmp_path, stage, tier, accum):
    """Above world size 1, stages 1-2 all-gather each unit's new shards: started by the unit's forward pre-hook
    in the order sent, on every rank alike."""
    runs = [rank_pools(2).run(train, _config(stage, tier, depth, clip=0.05, accum=accum, nvme=str(tmp_path)))[0]
            for depth in (0, 1)]
    _assert_bitwise(*runs)


def test_the_steps_updates_run_beside_the_next_forward_in_the_trace(tmp_path):
    batches = make_batches(2, 1, MICRO)
    path = tmp_path / "trace.json"
    with zo.initialize(make_model(), _config(2, "host", 1, clip=1.0, accum=1, nvme=str(tmp_path))) as engine:
        engine.trace(path, steps=2)
        for (batch,) in batches:
            engine.backward(engine(*batch))
            engine.step()
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    step = min((e for e in spans if tracks[e["tid"]] == "main" and e["name"] == "step"), key=lambda e: e["ts"])
    updates = [e for e in spans if tracks[e["tid"]] == "updates" and e["ts"] >= step["ts"]]
    forward = [e for e in spans if tracks[e["tid"]] == "main" and e["name"].startswith("forward")
               and e["ts"] >= step["ts"] + step["dur"]]
    assert {e["name"] for e in updates} == {f"update {u.name}" for u in engine.units if u.layout.trainable}
    assert max(e["ts"] + e["dur"] for e in updates) > step["ts"] + step["dur"]  # they ran past the step's return
    assert min(e["ts"] for e in forward) < max(e["ts"] + e["dur"] for e in updates)  # the forward began under them



def _idle_after_the_next_forward(config: dict) -> int:
    """Bytes the tiers keep idle for reuse once the step's updates ended beside the next forward."""
    (first,), (second,) = make_batches(2, 1, MICRO)
    with zo.initialize(make_model(), config) as engine:
        engine.backward(engine(*first))
        engine.step()
        engine(*second)
        engine._updater.step_updates.worker.join()  # the last update ended (the forward waits for each)
        return sum(tier.idle for tier in engine.tiers.values())


def test_the_buffers_the_steps_updates_kept_go_when_the_last_ends(tmp_path):
    """buffer_arena's note: the host buffers the optimizer blocks streamed through go when the step's last
    update beside the next forward ends, as the synchronous step's go when it returns: no more is idle after
    that forward than after the synchronous step's. Kept idle, they were resident through the whole next
    backward (a 1b stage 3 NVMe run's RSS stood 1 GB above its accounting)."""
    synchronous, beside = (_idle_after_the_next_forward(_config(3, "nvme", depth, clip=1e9, accum=1,
                                                                 nvme=str(tmp_path))) for depth in (0, 1))
    assert beside <= synchronous  # (the forward's own buffers released with them are taken afresh)


def _failing_step(root, in_flight: int) -> tuple[AioError, str]:
    """A step whose optimizer blocks cannot be stored (EFBIG), then the next forward: what raised, and where."""
    (first,), (second,) = make_batches(2, 1, MICRO)
    with zo.initialize(make_model(), _config(2, "nvme", in_flight, clip=1.0, accum=1, nvme=str(root))) as engine:
        with file_size_limit(64 << 10), pytest.raises(AioError) as raised:
            engine.backward(engine(*first))
            where = "step"
            assert engine.step()
            where = "the next forward"
            engine(*second)
        assert not [t for t in threading.enumerate() if t.name == "zerooffload-update"]
    return raised.value, where


def test_a_failing_update_beside_the_forward_raises_at_the_next_call(tmp_path):
    """A real I/O fault (EFBIG on the swap file): the synchronous step raises it; beside the forward, the step
    returns and the next engine call raises the same one-line AioError, naming the swap file and the offset;
    the engine then closes cleanly, its worker gone."""
    (tmp_path / "sync").mkdir()
    (tmp_path / "beside").mkdir()
    synchronous, where_sync = _failing_step(tmp_path / "sync", 0)
    beside, where = _failing_step(tmp_path / "beside", 1)
    assert (where_sync, where) == ("step", "the next forward")
    assert beside.errno == synchronous.errno == errno.EFBIG
    # the same line but for the unit whose block failed first (the step goes in unit order, beside the forward
    # in forward order: the root unit first)
    unnamed = [re.sub(r"\d+", "N", re.sub(r"\S+\.swap", "F", str(e))) for e in (synchronous, beside)]
    assert unnamed[0] == unnamed[1] and "\n" not in unnamed[0]
    assert min(beside.failed_offset, synchronous.failed_offset) >= 64 << 10


def test_waiting_for_one_update_waits_for_those_before_and_a_failure_drops_the_rest():
    worker, ran, gates = UpdateWorker(4, torch.device("cpu")), [], [threading.Event(), threading.Event()]
    first = worker.submit("a", lambda: (gates[0].wait(5), ran.append("a")), lambda: None)
    second = worker.submit("b", lambda: ran.append("b"), lambda: ran.append("b released"))
    worker.submit("c", lambda: (gates[1].wait(5), 1 / 0), lambda: None)
    last = worker.submit("d", lambda: ran.append("d"), lambda: ran.append("d released"))
    threading.Timer(0.05, gates[0].set).start()
    worker.wait_for(second)
    assert ran == ["a", "b", "b released"] and first.state.value == "done"
    gates[1].set()
    with pytest.raises(ZeroDivisionError):
        worker.wait_for(last)
    assert ran[-1] == "d released" and "d" not in ran  # dropped after the failure, even once it was raised
    worker.join()


def _link_bytes(config: dict, steps: int = 3) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Each step's bytes host->device and device->host (``engine.stats.link``), and what one step's bf16
    weights and gradients come to: every trainable unit's part of this rank's shard, 2 bytes an element."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    measured = []
    with zo.initialize(make_model(), config) as engine:
        for (idx, targets), in make_batches(steps, 1, MICRO * world):
            engine.backward(engine(idx[rows], targets[rows]))
            engine.step()
            measured.append((engine.stats.link.host_to_device_bytes, engine.stats.link.device_to_host_bytes))
        trained = [u for u in engine.units if u.layout.trainable]
        grads = sum(u.trainable_span if u.grad_leaves else u.trainable_numel for u in trained)
        expected = (2 * sum(u.trainable_numel for u in trained), 2 * grads)
    return measured, expected


@pytest.mark.parametrize("stage, clip", [(1, 1.0), (2, 1.0), (2, 0.0)])
def test_the_link_counts_bf16_weights_up_and_bf16_gradients_down(rank_pools, tmp_path, stage, clip):
    """bf16 compute, optimizer on the host, world 2: each step the new weights cross up and the gradients
    down in bf16 (the sum over ranks is fp32 and is cast on the device before it leaves), counted as they
    would cross a PCIe link. The step's updates beside the next forward count in the next step's window,
    so every step after the first counts one update's bytes (in backward at clip 0: in its own)."""
    config = _config(stage, "host", 1, clip=clip, accum=1, nvme=str(tmp_path), in_backward="auto")
    for measured, expected in rank_pools(2).run(_link_bytes, config):
        assert measured[1:] == [expected] * (len(measured) - 1)


def test_the_updates_copies_reuse_two_host_buffers_across_updates():
    """update_copies' note: the gradient down and the weights up through two host buffers made once (grown to
    the largest unit, then reused: no update allocates), in the compute dtype; on a CPU device plain copies."""
    from zerooffload.config import MemoryConfig
    from zerooffload.tiers import Kind, make_tiers
    from zerooffload.zero.update_copies import UpdateCopies
    host = make_tiers(MemoryConfig(), torch.device("cpu"))["host"]
    copies = UpdateCopies(host, None)
    seen = set()
    for numel in (4096, 1024, 4096):  # a large unit, a small one, the large one again: one buffer each
        grad, target = torch.randn(numel).bfloat16(), torch.zeros(numel, dtype=torch.bfloat16)
        down = copies.grad_down(grad)
        staged = copies.weights_staging(target, read=False)
        assert down.dtype == staged.dtype == torch.bfloat16 and torch.equal(down, grad)
        staged.copy_(down * 2)
        copies.weights_up(target, staged)
        assert torch.equal(target, grad * 2)
        seen |= {down.data_ptr(), staged.data_ptr()}
        assert host.usage[Kind.BUFFER] == 2 * 4096 * 2  # two buffers of the largest: 2 bytes an element each
    assert len(seen) == 2
    split = copies.weights_staging(torch.full((8,), 3.0, dtype=torch.bfloat16), read=True)  # a split master's
    assert torch.equal(split, torch.full((8,), 3.0, dtype=torch.bfloat16))
    copies.close()
    assert host.usage[Kind.BUFFER] == 0


def _saved_after_a_step(root, in_flight: int) -> dict:
    """One step, then a checkpoint saved at once: its files' bytes (the manifest's step counts included)."""
    (batch,), = make_batches(1, 1, MICRO)
    config = _config(2, "host", in_flight, clip=1.0, accum=1, nvme=str(root))
    with zo.initialize(make_model(), config) as engine:
        engine.backward(engine(*batch))
        engine.step()
        path = engine.save_checkpoint(root / "ckpt", tag="t")
    manifest = json.loads((path / "manifest.json").read_text())
    files = {p.name: p.read_bytes() for p in path.iterdir() if not p.name.startswith("manifest.")}  # its time, path
    return {"steps": manifest["steps"], "files": files}


def test_a_checkpoint_saved_right_after_the_step_holds_its_updates(tmp_path):
    """The save joins the updates still running beside (its step counts are read before any block)."""
    (tmp_path / "sync").mkdir()
    (tmp_path / "beside").mkdir()
    assert _saved_after_a_step(tmp_path / "sync", 0) == _saved_after_a_step(tmp_path / "beside", 1)
