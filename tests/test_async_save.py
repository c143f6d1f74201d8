"""Checkpoints saved in the background (``save_checkpoint(blocking=False)``, async_save's [Note: saving in
the background]): the same files as a blocking save, byte for byte; training on while they are written
resumes bitwise; a real write error (EFBIG) surfaces at the next engine call as one line; a second save
and ``close()`` wait for the first; the saves' thread runs in idle time. Kills at random moments of a run
saving so: bench/save_stall.py."""
from __future__ import annotations

import os
import resource
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerooffload as zo
from reference import make_batches, make_model
from zerooffload.checkpoint import CheckpointError, SaveHandle, read_latest

HOST = {"zero": {"stage": 1}, "offload": {"optimizer": {"tier": "host"}}}
FP32_NVME = {"zero": {"stage": 3}, "offload": {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}}
COMPACT_NVME = {"zero": {"stage": 3}, "train": {"precision": "bf16"},
                "offload": {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}},
                "optimizer": {"master": "split", "moments": "int8"}}
BATCHES = make_batches(6, 1, 4)


def _config(base: dict, tmp_path: Path, **train) -> dict:
    nvme = tmp_path / "swap"
    nvme.mkdir(exist_ok=True)
    return {**base, "nvme": {"path": str(nvme)}, "optimizer": {"lr": 1e-2, **base.get("optimizer", {})},
            "train": {**base.get("train", {}), **train}}


def _train(engine, first: int, last: int) -> None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    micro = 4 // world
    for (idx, targets), in BATCHES[first:last]:
        rows = slice(rank * micro, (rank + 1) * micro)
        engine.backward(engine(idx[rows], targets[rows]))
        engine.step()


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _trainable() -> torch.nn.Module:
    """TinyLM with its frozen parameters trainable: every unit, its root included, is copied in the kernel."""
    model = make_model()
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model


def save_both_ways(base: dict, root: str, trainable: bool = False) -> dict | None:
    """Every rank: two steps, a save loaded back, a step, then a non-blocking save into root/background (the
    step's updates may still run: with the state in memory the saves' thread waits for them) and a blocking
    one of the same state into root/blocking; rank 0 returns both tags' files."""
    root_path = Path(root)
    with zo.initialize(_trainable() if trainable else make_model(), _config(base, root_path)) as engine:
        _train(engine, 0, 2)
        engine.save_checkpoint(root_path / "first")
        engine.load_checkpoint(root_path / "first")  # its blocks rewritten whole from the checkpoint
        _train(engine, 2, 3)
        handle = engine.save_checkpoint(root_path / "background", tag="t", blocking=False)
        assert isinstance(handle, SaveHandle) and handle.wait() == root_path / "background" / "t" and handle.done()
        engine.save_checkpoint(root_path / "blocking", tag="t")
        stored = sum(state.block.nbytes for state in engine.opt_states  # TinyLM's root unit has frozen parameters
                     if all(slot.trainable for slot in state.unit.layout.slots))
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return {"stored": stored, **{side: _files(root_path / side / "t") for side in ("blocking", "background")}}


@pytest.mark.parametrize("base, kernel_copies, trainable", [(HOST, False, False), (FP32_NVME, True, False),
                                                           (FP32_NVME, True, True), (COMPACT_NVME, False, False)],
                         ids=["host-fp32", "nvme-fp32", "nvme-fp32-all-trainable", "nvme-split-int8"])
def test_a_non_blocking_save_writes_the_blocking_saves_bytes(tmp_path, monkeypatch, base, kernel_copies, trainable):
    """Rank file, buffers, RNG states, manifest and its digest: identical, byte for byte. fp32 state on NVMe
    is copied from the swap file to the rank file in the kernel (padding included: zeros there as in the
    segments, after a load too), its CRC32C joined from the swap's own digests; a unit with frozen
    parameters (their values are the weights'), a split master or int8 moments (another format on disk)
    are read and staged."""
    copies = []
    copy_file_range = os.copy_file_range

    def counted(*args):
        copies.append(args[2])
        return copy_file_range(*args)
    monkeypatch.setattr(os, "copy_file_range", counted)
    both = save_both_ways(base, str(tmp_path), trainable)
    assert both["blocking"].keys() == both["background"].keys() >= {"manifest.json", "manifest.sha256",
                                                                     "rank00000.bin"}
    assert both["blocking"] == both["background"]
    assert sum(copies) == both["stored"] if kernel_copies else not copies  # every block without frozen parameters


@pytest.mark.parametrize("base, trainable", [(COMPACT_NVME, False), (HOST, True)],
                         ids=["nvme-split-int8", "host-fp32-written-in-place"])
def test_at_world_2_a_non_blocking_save_writes_the_blocking_saves_bytes(tmp_path, rank_pools, base, trainable):
    """Two ranks: their files (and, written in place, their optimizer steps, read once the step's updates
    ran) gathered and published on the saves' own group, the same bytes."""
    both = rank_pools(2).run(save_both_ways, base, str(tmp_path), trainable)[0]
    assert {"rank00000.bin", "rank00001.bin"} <= both["background"].keys()
    assert both["blocking"] == both["background"]


def test_a_save_in_the_background_waits_for_the_steps_updates_still_running(tmp_path, make_engine, monkeypatch):
    """The step's updates run beside what follows the step (step_updates' note), here slowed so that each is
    still running when the save is called: the saves' thread waits for them, so the background save holds
    the updated state and step counts, the bytes a blocking save (which joins them first) then writes. Its
    writes start on the saves' staging thread (not in the saves' idle-time thread, nor on the caller's)."""
    import threading
    import time

    from zerooffload.checkpoint.files import ChecksummedWriter
    from zerooffload.zero.update_worker import UpdateWorker

    execute, write_from, writers = UpdateWorker._execute, ChecksummedWriter.write_from, set()
    monkeypatch.setattr(UpdateWorker, "_execute", lambda self, update: (time.sleep(0.05), execute(self, update)))
    monkeypatch.setattr(ChecksummedWriter, "write_from", lambda self, *args: (
        writers.add(threading.current_thread().name), write_from(self, *args)))
    engine = make_engine(_trainable(), _config(HOST, tmp_path))  # every shard written from where it lies
    _train(engine, 0, 2)
    assert engine._updater.step_updates.running  # the step's updates are not yet joined
    engine.save_checkpoint(tmp_path / "background", tag="t", blocking=False).wait()
    engine.save_checkpoint(tmp_path / "blocking", tag="t")
    assert _files(tmp_path / "background" / "t") == _files(tmp_path / "blocking" / "t")
    assert writers == {"zerooffload-save"}


@pytest.mark.parametrize("base, staging", [(HOST, "1GiB"), (HOST, 8192), (FP32_NVME, "1GiB")],
                         ids=["staged-whole", "ring-smaller-than-the-state", "nvme-kernel-copy"])
def test_training_on_while_a_save_is_written_resumes_bitwise(tmp_path, make_engine, base, staging):
    """Steps run while the save is in flight (a ring smaller than the state: the save waits for its oldest
    writes past it; on NVMe, the next update waits for the kernel's copy of the swap file); a fresh engine
    loading it and taking the same steps ends bitwise where this one does."""
    config = _config(base, tmp_path, save_staging=staging)
    engine = make_engine(make_model(), config)
    _train(engine, 0, 2)
    handle = engine.save_checkpoint(tmp_path / "ckpt", blocking=False, client_state={"next": 2})
    _train(engine, 2, 4)
    straight = engine.full_state_dict()
    engine.close()
    assert handle.done() and read_latest(tmp_path / "ckpt") == "step00000002"
    resumed = make_engine(make_model(seed=1), config)
    assert resumed.load_checkpoint(tmp_path / "ckpt") == {"next": 2}
    _train(resumed, 2, 4)
    after = resumed.full_state_dict()
    assert all(torch.equal(straight[k], after[k]) for k in straight)


def test_a_write_error_surfaces_at_the_next_engine_call_as_one_line(tmp_path, make_engine, monkeypatch):
    """A real EFBIG: the file size limit drops under the rank file once its preallocation succeeded, so
    its writes fail in the kernel after the call returned. Nothing is published (latest still names the
    last good tag), the next engine call raises the blocking save's one-line error, and only once."""
    engine = make_engine(make_model(), _config(HOST, tmp_path))
    _train(engine, 0, 1)
    engine.save_checkpoint(tmp_path / "ckpt", tag="good")
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    preallocate = os.posix_fallocate

    def preallocate_then_limit(fd: int, offset: int, length: int) -> None:
        preallocate(fd, offset, length)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limit[1]))
    monkeypatch.setattr(os, "posix_fallocate", preallocate_then_limit)
    try:
        handle = engine.save_checkpoint(tmp_path / "ckpt", tag="bad", blocking=False)
        monkeypatch.undo()
        deadline = time.monotonic() + 30
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    with pytest.raises(CheckpointError) as raised:
        _train(engine, 1, 2)
    message = str(raised.value)
    assert "file size limit (ulimit -f)" in message and "rank00000.bin" in message and "\n" not in message
    assert read_latest(tmp_path / "ckpt") == "good" and not (tmp_path / "ckpt" / "bad").exists()
    _train(engine, 1, 2)  # raised once; the engine trains on and saves again
    assert engine.save_checkpoint(tmp_path / "ckpt", tag="bad", blocking=False).wait().name == "bad"


def test_a_second_save_waits_for_the_first_and_close_waits_for_the_last(tmp_path, make_engine):
    engine = make_engine(make_model(), _config(HOST, tmp_path, save_staging=8192))
    _train(engine, 0, 1)
    first = engine.save_checkpoint(tmp_path / "ckpt", tag="a", blocking=False)
    second = engine.save_checkpoint(tmp_path / "ckpt", tag="b", blocking=False)
    assert first.done() and (tmp_path / "ckpt" / "a" / "manifest.json").exists()
    engine.close()
    assert second.done() and read_latest(tmp_path / "ckpt") == "b"
    assert zo.checkpoint.read_manifest(tmp_path / "ckpt", "b").data["tag"] == "b"  # verified: complete


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_a_save_publishes_in_idle_time_and_stages_at_training_priority(tmp_path, make_engine):
    """threads' [Note: work in idle time]: the thread that publishes (what nothing waits for) alone is in
    SCHED_IDLE; the one that stages (what the next backward may wait for) and training keep their class."""
    import threading

    engine = make_engine(make_model(), _config(HOST, tmp_path))
    _train(engine, 0, 1)
    engine.save_checkpoint(tmp_path / "ckpt", blocking=False).wait()
    named = {thread.name: thread for thread in threading.enumerate()}
    assert os.sched_getscheduler(named["zerooffload-publish"].native_id) == os.SCHED_IDLE
    assert os.sched_getscheduler(named["zerooffload-save"].native_id) == os.SCHED_OTHER
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_train_reports_what_its_saves_held_the_loop_for(tmp_path, monkeypatch):
    """summary.json's ``saves``: blocking saves hold the loop at least as long as their calls took (timed
    here, around the engine's own method) and not much longer (room made, the prune waited for)."""
    import json

    from cli_helpers import run_in_process
    from zerooffload.engine import Engine

    calls, save = [], Engine.save_checkpoint

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return save(self, *args, **kwargs)
        finally:
            calls.append(time.perf_counter() - start)
    monkeypatch.setattr(Engine, "save_checkpoint", timed)
    out = tmp_path / "out"
    run = run_in_process("train", "--steps", "3", "--save-every", "1", "--out", str(out), "train.async_save=false",
                         "train.micro_batch_size=4")
    saves = json.loads((out / "summary.json").read_text())["saves"]
    assert run.returncode == 0 and len(calls) == saves["count"] == 3 and not saves["in_background"], run.stderr
    assert sum(calls) <= saves["held_seconds"] <= sum(calls) + 0.5, (calls, saves)
    assert f"saves: 3 blocking; they held the loop {saves['held_seconds']:.2f} s" in run.stdout
