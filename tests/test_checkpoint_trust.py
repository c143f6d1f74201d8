"""Checkpoints under odd models and damage: buffers of every shape and dtype, refused loads that change
nothing, manifests with digests, leftovers of failed saves, and a full disk."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import zerooffload as zo
from reference import BufferedNet, make_batches, make_buffered_model, make_model
from zerooffload.checkpoint import CheckpointError, read_manifest

STEPS = 4
NVME = {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}


def _config(stage: int = 3, offload: dict | None = None, path: str | None = None) -> dict:
    config = {"zero": {"stage": stage, "persist_threshold": 0}, "train": {"grad_clip": 0.05},
              "optimizer": {"lr": 1e-2}, "offload": offload or {}}
    if path:
        config["nvme"] = {"path": path}
    return config


def _train(engine, first: int, last: int) -> None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    micro = 4 // world
    for (idx, targets), in make_batches(STEPS, 1, 4, seed=3)[first:last]:
        rows = slice(rank * micro, (rank + 1) * micro)
        engine.backward(engine(idx[rows], targets[rows]))
        engine.step()


def resume_case(directory: str, swap: str, split: bool) -> dict | None:
    """Every rank: BufferedNet at stage 3 on NVMe, STEPS straight, or STEPS/2 + save + a fresh engine
    (other initial values) that loads and trains the rest; rank 0 returns its full state dict."""
    config = _config(3, NVME, swap)
    with zo.initialize(make_buffered_model(), config) as engine:
        _train(engine, 0, STEPS // 2 if split else STEPS)
        if not split:
            return engine.full_state_dict() or None
        engine.save_checkpoint(directory, tag="last")
    with zo.initialize(make_buffered_model(seed=1), config) as engine:
        engine.load_checkpoint(directory)
        _train(engine, STEPS // 2, STEPS)
        return engine.full_state_dict() or None


def _equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world", [1, 2])
def test_buffers_of_every_shape_and_dtype_resume_bitwise(tmp_path, rank_pools, world):
    run = (lambda *a: rank_pools(world).run(resume_case, *a)[0]) if world > 1 else resume_case
    straight = run(str(tmp_path / "unused"), str(tmp_path), False)
    resumed = run(str(tmp_path / "ckpt"), str(tmp_path), True)
    assert _equal(resumed, straight)
    assert resumed["calls"] == STEPS and resumed["norm.num_batches_tracked"] == STEPS  # 0-dim int64, changed
    assert "scratch" not in resumed  # non-persistent
    saved = {b["name"]: b for b in read_manifest(tmp_path / "ckpt").data["buffers"]}
    assert set(saved) == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked", "calls", "trace",
                          "mask"}
    assert saved["calls"]["shape"] == [] and saved["mask"]["dtype"] == "bool" and saved["trace"]["dtype"] == "bfloat16"


def test_consolidated_buffers_load_strictly_into_a_plain_model(tmp_path):
    with zo.initialize(make_buffered_model(), _config(2)) as engine:
        _train(engine, 0, 2)
        engine.save_checkpoint(tmp_path / "ckpt")
        full = engine.full_state_dict()
    out = tmp_path / "model.safetensors"
    done = subprocess.run([sys.executable, "-m", "zerooffload", "checkpoint", "consolidate", str(tmp_path / "ckpt"),
                           str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    safetensors = pytest.importorskip("safetensors.torch")
    plain = make_buffered_model(seed=1)
    plain.load_state_dict(safetensors.load_file(str(out)), strict=True)
    assert _equal(plain.state_dict(), full)


class _ExtraBuffer(BufferedNet):
    """The same parameters with one buffer more: a load must refuse it up front."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))


class _TwoGroups:
    """param_groups that split the parameters in two (the checkpoint was saved with one group)."""

    @staticmethod
    def of(model):
        params = [p for p in model.parameters()]
        return [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]


@pytest.mark.parametrize("mismatch", ["buffer name", "param groups", "moments"])
def test_a_refused_load_changes_nothing(tmp_path, mismatch):
    """Stage 3 on NVMe: masters, moments, weights and buffers are exactly as before the refused load."""
    with zo.initialize(make_buffered_model(), _config(3, NVME, str(tmp_path))) as engine:
        _train(engine, 0, 2)
        engine.save_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(1)
    model, groups, config = _ExtraBuffer(), None, _config(3, NVME, str(tmp_path))
    if mismatch != "buffer name":
        model = make_buffered_model(seed=1)
    if mismatch == "param groups":
        groups = _TwoGroups.of(model)
    if mismatch == "moments":
        config["optimizer"] = {"type": "sgd", "momentum": 0.0}
    with zo.initialize(model, config, param_groups=groups) as engine:
        _train(engine, 0, 1)
        before = engine.full_state_dict()
        message = {"buffer name": r"another model; buffers not in the checkpoint: \['count'\]$",
                   "param groups": "saved with 1 parameter group", "moments": "saved with optimizer moments"}
        with pytest.raises(CheckpointError, match=message[mismatch]):
            engine.load_checkpoint(tmp_path / "ckpt")
        assert _equal(engine.full_state_dict(), before)
        _train(engine, 1, 2)  # and it trains on from where it was


def _saved(tmp_path):
    with zo.initialize(make_model(), _config(1)) as engine:
        _train(engine, 0, 1)
        engine.save_checkpoint(tmp_path)
    return tmp_path / (tmp_path / "latest").read_text().strip()


@pytest.mark.parametrize("damage, message", [
    ("lr 0.01 -> 0.09", "manifest.json: SHA-256 .* the manifest is corrupt"),
    ("truncate", "manifest.json: SHA-256 .* the manifest is corrupt"),
    ("garble", "manifest.json: SHA-256 .* the manifest is corrupt"),
    # cut in half: where the cut falls (between tokens or in a string) depends on the manifest's length
    ("truncate, no digest", r"manifest.json: not a valid manifest \((Expecting|Unterminated string)"),
    ("garble, no digest", r"manifest.json: not a valid manifest \('utf-8' codec"),
    ("missing key, no digest", r"manifest.json: not a valid manifest: missing or malformed counters"),
    ("digest garbage", "manifest.json: SHA-256 .* says nothing"),
])
def test_a_damaged_manifest_is_refused_by_name(tmp_path, damage, message):
    tag = _saved(tmp_path)
    manifest, digest = tag / "manifest.json", tag / "manifest.sha256"
    text = manifest.read_bytes()
    if damage.startswith("lr"):
        assert b'"lr": 0.01' in text
        manifest.write_bytes(text.replace(b'"lr": 0.01', b'"lr": 0.09'))  # still valid JSON
    elif damage.startswith("truncate"):
        manifest.write_bytes(text[:len(text) // 2])
    elif damage.startswith("garble"):
        manifest.write_bytes(text[:100] + b"\xff\xfe" + text[102:])
    elif damage.startswith("missing key"):
        data = json.loads(text)
        del data["counters"]
        manifest.write_text(json.dumps(data))
    else:
        digest.write_text("\n")
    if "no digest" in damage:
        digest.unlink()
    with pytest.raises(CheckpointError, match=message):
        read_manifest(tmp_path)
    with zo.initialize(make_model(), _config(1)) as engine, pytest.raises(CheckpointError, match=message):
        engine.load_checkpoint(tmp_path)


def test_a_checkpoint_without_a_digest_loads_with_a_warning(tmp_path, caplog):
    tag = _saved(tmp_path)
    (tag / "manifest.sha256").unlink()
    with caplog.at_level(logging.WARNING), zo.initialize(make_model(seed=1), _config(1)) as engine:
        engine.load_checkpoint(tmp_path)
    assert "no manifest.sha256" in caplog.text


def test_leftovers_of_killed_saves_are_removed_by_the_next_save(tmp_path):
    """A partial directory (killed save) and a set-aside copy whose replacement landed both go; a
    set-aside copy whose tag is missing comes back (the kill fell between the two renames)."""
    with zo.initialize(make_model(), _config(1)) as engine:
        engine.save_checkpoint(tmp_path, tag="a")
        engine.save_checkpoint(tmp_path, tag="b")
        (tmp_path / "old.partial").mkdir()
        (tmp_path / "old.partial" / "rank00000.bin").write_bytes(b"x" * 4096)
        os.rename(tmp_path / "a", tmp_path / "a.replaced")  # as a kill between the renames leaves it
        (tmp_path / "b.replaced").mkdir()
        assert read_manifest(tmp_path, "a").directory.name == "a.replaced"  # the loader finds it meanwhile
        engine.save_checkpoint(tmp_path, tag="c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c", "latest"]
    read_manifest(tmp_path, "a")


@pytest.fixture
def small_disk(tmp_path):
    """A 768 KiB tmpfs: a real filesystem that fills up (needs root and mount, as CI has)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=768k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_a_clear_error_and_the_previous_checkpoint_stays(small_disk):
    """The model's masters and moments (~0.5 MB a save) fit once, not twice."""
    with zo.initialize(make_model(), _config(1)) as engine:
        engine.save_checkpoint(small_disk, tag="first")
        _train(engine, 0, 1)
        with pytest.raises(CheckpointError, match=rf"{small_disk}/second.partial: no room to save the checkpoint "
                                                  rf"\({small_disk}/second.partial/rank00000\.bin: claiming [\d,]+ "
                                                  r"bytes: No space left on device\): this rank needs [\d,]+ "
                                                  r"bytes there and the filesystem "
                                                  r"has [\d,]+ bytes free; the previous checkpoint is unchanged"):
            engine.save_checkpoint(small_disk, tag="second")
    assert (small_disk / "latest").read_text().strip() == "first"
    read_manifest(small_disk)
    assert not list((small_disk / "second.partial").iterdir())  # this rank's files removed, space given back
