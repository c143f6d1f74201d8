"""Checkpoints: exact resume in fresh processes, resharding across layouts, atomicity under SIGKILL, and
corrupt, truncated or missing files refused by name (kills mid-save: test_checkpoint_kills.py)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerooffload as zo
from harness import RankPool
from reference import make_batches, make_model, update_errors
from zerooffload.checkpoint import CheckpointError
from zerooffload.io.checksum import crc32c

GLOBAL_BATCH = 4  # split evenly over 1, 2 or 4 ranks, so every layout trains on the same global batch
STEPS = 4
NVME = {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}


def _config(stage: int, offload: dict | None = None, precision: str = "fp32", optimizer: dict | None = None) -> dict:
    return {"zero": {"stage": stage}, "train": {"precision": precision, "grad_clip": 0.05},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, **(optimizer or {})},
            "scheduler": {"type": "warmup_cosine", "warmup_steps": 2, "total_steps": 10},
            "offload": offload or {}}


def _train(engine, first: int, last: int) -> None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    batches, micro = make_batches(STEPS + 2, 1, GLOBAL_BATCH), GLOBAL_BATCH // world
    for (idx, targets), in batches[first:last]:
        rows = slice(rank * micro, (rank + 1) * micro)
        engine.backward(engine(idx[rows], targets[rows]))
        engine.step()


def run_case(stage: int, offload: dict | None, first: int, last: int, save: str | None = None,
             load: str | None = None, precision: str = "fp32", optimizer: dict | None = None) -> dict | None:
    """Every rank: build (a different init when loading, so a load that did nothing shows), optionally
    load, train steps [first, last), optionally save; rank 0 returns the full state and client state."""
    with zo.initialize(make_model(seed=1 if load else 0), _config(stage, offload, precision, optimizer)) as engine:
        client = engine.load_checkpoint(load) if load else None
        loaded = engine.full_state_dict()
        _train(engine, first, last)
        if save:
            engine.save_checkpoint(save, client_state={"next_step": last})
        full = engine.full_state_dict()
        lr = engine.optimizer.param_groups[0]["lr"]
    if (dist.get_rank() if dist.is_initialized() else 0) != 0:
        return None
    return {"full": full, "loaded": loaded, "client": client, "lr": lr}


def _equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def straight_and_saved(tmp_path_factory, rank_pools):
    """Stage 3, parameters and optimizer on NVMe, world size 2: STEPS straight, and STEPS/2 then a save."""
    directory = str(tmp_path_factory.mktemp("ckpt"))
    straight = rank_pools(2).run(run_case, 3, NVME, 0, STEPS)[0]
    rank_pools(2).run(run_case, 3, NVME, 0, STEPS // 2, save=directory)
    return straight, directory


def test_resume_in_fresh_processes_is_bitwise_exact(straight_and_saved):
    straight, directory = straight_and_saved
    fresh = RankPool(2)  # new processes: nothing survives in memory from the saving run
    try:
        resumed = fresh.run(run_case, 3, NVME, STEPS // 2, STEPS, load=directory)[0]
    finally:
        fresh.close()
    assert resumed["client"] == {"next_step": STEPS // 2}
    assert _equal(resumed["full"], straight["full"])
    assert resumed["lr"] == straight["lr"]  # the LR schedule resumed where it was


@pytest.mark.parametrize("world, stage, offload", [(1, 1, {"optimizer": {"tier": "host"}}), (4, 2, None),
                                                   (2, 0, None)])
def test_reshard_to_other_world_sizes_stages_and_tiers(straight_and_saved, rank_pools, world, stage, offload):
    """Saved at world 2 (stage 3 on NVMe): the full state is bitwise equal right after loading elsewhere,
    and the next steps match continuing at the original layout."""
    straight, directory = straight_and_saved
    half = rank_pools(2).run(run_case, 3, NVME, 0, STEPS // 2)[0]
    pool = rank_pools(world) if world > 1 else None
    args = (run_case, stage, offload, STEPS // 2, STEPS)
    resumed = pool.run(*args, load=directory)[0] if pool else run_case(*args[1:], load=directory)
    assert _equal(resumed["loaded"], half["full"])
    errors = update_errors(half["full"], resumed["full"], straight["full"])
    assert max(errors.values()) < 1e-5, max(errors.items(), key=lambda kv: kv[1])


def test_compact_states_reshard_from_world_2_to_world_1(tmp_path, rank_pools):
    """A split master and int8 moments saved at world 2 (stage 3 on NVMe, bf16) load at world 1 (stage 1,
    host), whose pieces, and so int8 blocks, are cut elsewhere: the full state equal right after loading,
    the next steps as continuing at world 2 within int8's rounding."""
    compact = {"precision": "bf16", "optimizer": {"master": "split", "moments": "int8"}}
    directory = str(tmp_path / "ckpt")
    straight = rank_pools(2).run(run_case, 3, NVME, 0, STEPS, **compact)[0]
    half = rank_pools(2).run(run_case, 3, NVME, 0, STEPS // 2, save=directory, **compact)[0]
    resumed = run_case(1, {"optimizer": {"tier": "host"}}, STEPS // 2, STEPS, load=directory, **compact)
    assert _equal(resumed["loaded"], half["full"])
    errors = update_errors(half["full"], resumed["full"], straight["full"])
    assert max(errors.values()) < 5e-2, max(errors.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("how, message", [("flip", "CRC32C .* the file is corrupt"), ("truncate", "truncated"),
                                          ("missing", "missing")])
def test_damaged_files_are_refused_by_name(tmp_path, make_engine, how, message):
    engine = make_engine(make_model(), _config(2))
    _train(engine, 0, 1)
    engine.save_checkpoint(tmp_path)
    tag = (tmp_path / "latest").read_text().strip()
    path = tmp_path / tag / "rank00000.bin"
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[1000] ^= 1
        path.write_bytes(bytes(data))
    elif how == "truncate":
        os.truncate(path, path.stat().st_size - 4096)
    else:
        path.unlink()
    with pytest.raises(CheckpointError, match=rf"{path}: .*{message}"):
        engine.load_checkpoint(tmp_path)


def _as_version_1(directory: Path) -> None:
    """Rewrite a saved tag as version 1 wrote it: each data file's zlib CRC-32 under ``crc32`` (the
    format is otherwise the same), the manifest's SHA-256 beside it renewed."""
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["version"] = 1
    for name, record in manifest["files"].items():
        del record["crc32c"]
        record["crc32"] = zlib.crc32((directory / name).read_bytes())
    data = json.dumps(manifest).encode()
    (directory / "manifest.json").write_bytes(data)
    (directory / "manifest.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  manifest.json\n")


@pytest.mark.parametrize("flip", [False, True])
def test_a_version_1_checkpoint_with_crc_32_records_still_loads_and_is_verified(tmp_path, make_engine, flip):
    """Data files are digested with CRC32C, the swap's digest; checkpoints written before that (zlib's
    CRC-32 under ``crc32``) load all the same, and their files are still checked."""
    engine = make_engine(make_model(), _config(2))
    _train(engine, 0, 1)
    engine.save_checkpoint(tmp_path)
    saved = engine.full_state_dict()
    tag = tmp_path / (tmp_path / "latest").read_text().strip()
    record = json.loads((tag / "manifest.json").read_text())["files"]["rank00000.bin"]
    assert record["crc32c"] == crc32c((tag / "rank00000.bin").read_bytes())  # the file's, as read back
    _as_version_1(tag)
    if flip:
        data = bytearray((tag / "rank00000.bin").read_bytes())
        data[1000] ^= 1
        (tag / "rank00000.bin").write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=r"rank00000.bin: CRC-32 .* the file is corrupt"):
            engine.load_checkpoint(tmp_path)
        return
    _train(engine, 1, 2)
    engine.load_checkpoint(tmp_path)
    assert _equal(engine.full_state_dict(), saved)


def test_another_model_is_refused_with_the_parameters_named(tmp_path, make_engine):
    engine = make_engine(make_model(), _config(1))
    engine.save_checkpoint(tmp_path, tag="a")
    engine.close()
    torch.manual_seed(0)
    other = make_engine(torch.nn.Sequential(torch.nn.Linear(4, 4)), _config(1))
    with pytest.raises(CheckpointError, match=r"another model; parameters not in the checkpoint: \['0.bias', '0.weight'\]"):
        other.load_checkpoint(tmp_path, "a")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_consolidated_safetensors_load_strictly_into_a_plain_model(straight_and_saved, rank_pools, tmp_path, dtype):
    safetensors = pytest.importorskip("safetensors.torch")
    _, directory = straight_and_saved
    saved = rank_pools(2).run(run_case, 3, NVME, 0, STEPS // 2)[0]["full"]  # what the checkpoint holds
    out = tmp_path / "model.safetensors"
    done = subprocess.run([sys.executable, "-m", "zerooffload", "checkpoint", "consolidate", directory, str(out),
                           "--dtype", dtype], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    tensors = safetensors.load_file(str(out))
    assert set(tensors) == set(saved)  # every state_dict key, tied names included
    model = make_model(seed=1)
    model.load_state_dict(tensors, strict=True)
    for name, value in saved.items():
        expected = value if dtype == "fp32" else value.to(torch.bfloat16)
        assert torch.equal(tensors[name], expected), name


def test_loading_into_a_trained_engine_rolls_it_back_exactly(tmp_path, make_engine):
    """Stage 3 on NVMe, world size 1: save after 2 steps, train 2 more, load, train 2 again == 4 straight
    (the load must also replace parameter shards already read ahead for the next step)."""
    straight = run_case(3, NVME, 0, STEPS)["full"]
    engine = make_engine(make_model(), _config(3, NVME))
    _train(engine, 0, STEPS // 2)
    engine.save_checkpoint(tmp_path)
    _train(engine, STEPS // 2, STEPS)
    engine.load_checkpoint(tmp_path)
    _train(engine, STEPS // 2, STEPS)
    assert _equal(engine.full_state_dict(), straight)


def test_an_optimizer_without_moments_saves_and_loads(tmp_path, make_engine):
    """SGD without momentum keeps no moments, and fp32 masters on the device are the weights themselves:
    the rank file holds the masters alone."""
    config = {"zero": {"stage": 1}, "optimizer": {"type": "sgd", "momentum": 0.0, "lr": 0.1}}
    engine = make_engine(make_model(), config)
    _train(engine, 0, 1)
    engine.save_checkpoint(tmp_path)
    saved = engine.full_state_dict()
    engine.close()
    fresh = make_engine(make_model(seed=1), config)
    fresh.load_checkpoint(tmp_path)
    assert _equal(fresh.full_state_dict(), saved)
