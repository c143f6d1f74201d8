"""An I/O error in the middle of a training step on the NVMe tier: every rank raises soon, well within the
collective timeout, naming the swap file and the offset that failed; the checkpoint saved before stays
intact and loads.

The fault is real: after the checkpoint is saved, RLIMIT_FSIZE is lowered in the rank processes with
SIGXFSZ ignored (else the first write past the limit kills the process), so the swap-file writes of the
next step fail with EFBIG. The limit covers every regular file a process writes, so it is raised again as
soon as the step has raised, and the checkpoint is verified and loaded afterwards, by a fresh engine.
"""
from __future__ import annotations

import contextlib
import errno
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerooffload as zo
from aio_helpers import file_size_limit
from harness import PROCESS_GROUP_TIMEOUT
from reference import make_batches, make_model
from zerooffload.checkpoint import read_manifest

GLOBAL_BATCH = 4
FAULTY_STEPS = 3
"""Steps tried under the limit: a healthy peer raises at its first collective after the failed rank left."""
LIMIT = 64 << 10
"""The file-size limit in those steps: below the extents a step writes (this model's reach past 240 KiB of
each rank's swap file), above what a rank's other files need (gloo's FileStore holds a few hundred bytes)."""
SAVED = "state_at_save.pt"
"""Where rank 0 keeps the full state it saved in the checkpoint, to compare a load with."""
PROMPT_S = PROCESS_GROUP_TIMEOUT.total_seconds() / 4
"""How soon every rank must raise: well before the collective timeout a blocked peer would wait out."""


def _config(nvme: Path) -> dict:
    """Stage 3, parameters and optimizer states on NVMe; clipping keeps every update in ``step``."""
    nvme.mkdir(exist_ok=True)  # the swap directory must exist: the engine creates only its subdirectory
    return {"zero": {"stage": 3}, "train": {"grad_clip": 0.05}, "optimizer": {"lr": 1e-2},
            "offload": {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}, "nvme": {"path": str(nvme)}}


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _train_step(engine, step: int) -> None:
    rank, world = _rank_world()
    (idx, targets), = make_batches(step + 1, 1, GLOBAL_BATCH)[step]
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    engine.backward(engine(idx[rows], targets[rows]))
    engine.step()



def _describe(error: Exception | None) -> dict | None:
    """What the test checks of an error, as plain values (a gloo error need not pickle)."""
    if error is None:
        return None
    return {"type": type(error).__name__, "message": str(error), "errno": getattr(error, "errno", None),
            "filename": getattr(error, "filename", None), "failed_offset": getattr(error, "failed_offset", None)}


def save_then_fail(root: str, faulty_ranks: tuple[int, ...]) -> dict:
    """Every rank: a step, a checkpoint, then steps under the file-size limit (on ``faulty_ranks``) until one
    raises. Returns what was raised and how soon, and this rank's swap files; rank 0 writes the state saved
    to ``SAVED`` (a rank whose group ended exits at once, so tensors cannot come back through the pool's
    queue, which shares their memory with the process that sent them)."""
    rank, _ = _rank_world()
    nvme = Path(root) / f"nvme{rank}"  # one directory per rank: its only swap file is this rank's
    with zo.initialize(make_model(), _config(nvme)) as engine:
        _train_step(engine, 0)
        engine.save_checkpoint(Path(root) / "ckpt")
        saved = engine.full_state_dict()
        if rank == 0:
            torch.save(saved, Path(root) / SAVED)
        swap_files = sorted(str(p) for p in nvme.rglob("*.swap"))
        error, start = None, time.monotonic()
        try:
            with file_size_limit(LIMIT) if rank in faulty_ranks else contextlib.nullcontext():
                for step in range(1, 1 + FAULTY_STEPS):
                    _train_step(engine, step)
        except Exception as exc:  # the outcome under test: returned, so that every rank's reaches the test
            error = exc
        seconds = time.monotonic() - start
    return {"error": _describe(error), "seconds": seconds, "swap_files": swap_files}


def load_fresh(root: str) -> dict | None:
    """Every rank: a fresh engine (another init, so a load that did nothing shows) loads the checkpoint
    and trains a step on it; rank 0 returns the state loaded."""
    rank, _ = _rank_world()
    with zo.initialize(make_model(seed=1), _config(Path(root) / f"nvme{rank}")) as engine:
        engine.load_checkpoint(Path(root) / "ckpt")
        loaded = engine.full_state_dict()
        _train_step(engine, 1)
    return loaded if rank == 0 else None


def _named_failure(error: dict) -> tuple[str, int]:
    """The file and offset an error's message names as where a transfer failed."""
    found = re.search(r" in (\S+) failed at offset (\d+): ", error["message"])
    assert found, error
    return found[1], int(found[2])


def _assert_own_swap_write_failed(outcome: dict) -> None:
    """The rank under the limit raised the AioError of a write to its own swap file, past the limit."""
    error = outcome["error"]
    assert error is not None and error["type"] == "AioError" and error["errno"] == errno.EFBIG, error
    assert _named_failure(error) == (error["filename"], error["failed_offset"])
    assert error["filename"] in outcome["swap_files"] and error["failed_offset"] >= LIMIT


def _assert_checkpoint_intact(pool, root: Path) -> None:
    read_manifest(root / "ckpt")  # verifies every file's checksum
    saved = torch.load(root / SAVED)
    loaded = pool.run(load_fresh, str(root))[0]
    assert list(loaded) == list(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)


def _fail(pool, root: Path, faulty_ranks: tuple[int, ...]) -> list[dict]:
    """``save_then_fail`` on every rank; a rank still running after the collective timeout fails it."""
    return pool.run(save_then_fail, str(root), faulty_ranks, timeout=PROCESS_GROUP_TIMEOUT.total_seconds())


@pytest.mark.parametrize("world", [1, 2])
def test_every_rank_raises_naming_a_swap_file_and_offset_and_the_checkpoint_survives(rank_pools, tmp_path, world):
    """The limit on every rank (a disk every rank fills): each raises soon, naming a swap file of the job
    and the offset past the limit where its write failed (its own, or that of the rank that failed first
    when the engine reports a peer's failure)."""
    outcomes = _fail(rank_pools(world), tmp_path, tuple(range(world)))
    swap_files = {path for outcome in outcomes for path in outcome["swap_files"]}
    for outcome in outcomes:
        assert outcome["seconds"] < PROMPT_S and outcome["error"] is not None
        if outcome["error"]["type"] == "AioError":
            _assert_own_swap_write_failed(outcome)
        path, offset = _named_failure(outcome["error"])
        assert path in swap_files and offset >= LIMIT
    _assert_checkpoint_intact(rank_pools(world), tmp_path)


@pytest.fixture(scope="module")
def one_faulty_rank_of_two(rank_pools, tmp_path_factory):
    """Two ranks, the limit on rank 1 only (its own disk fails): the outcomes of rank 0 and rank 1."""
    root = tmp_path_factory.mktemp("one-faulty")
    return root, _fail(rank_pools(2), root, (1,))


def test_a_healthy_peer_raises_soon_and_the_checkpoint_survives(rank_pools, one_faulty_rank_of_two):
    root, (healthy, faulty) = one_faulty_rank_of_two
    _assert_own_swap_write_failed(faulty)
    assert healthy["error"] is not None and healthy["seconds"] < PROMPT_S
    _assert_checkpoint_intact(rank_pools(2), root)


def test_a_healthy_peer_names_the_file_and_offset_that_failed(one_faulty_rank_of_two):
    _, (healthy, faulty) = one_faulty_rank_of_two
    assert _named_failure(healthy["error"]) == (faulty["error"]["filename"], faulty["error"]["failed_offset"])
