"""No symlink traps (io.files' [Note: no links followed]): every name zerooffload creates, locks or removes
inside ``--out``, ``nvme.path`` or a checkpoint directory is refused in one line when someone planted a link
there, and what the link points to is left byte for byte as it was; ``--out`` and ``nvme.path`` themselves,
and the directories above them, may be links and still work."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import zerooffload as zo
from cli_helpers import run_in_process
from reference import make_model
from zerooffload.checkpoint import remove_tree, save_safetensors
from zerooffload.cli.run_checkpoints import prune
from zerooffload.cli.run_dir import write_summary
from zerooffload.hf.checkpoints import check_links, prune_checkpoints
from zerooffload.io import AsyncIO
from zerooffload.io.files import LinkRefused
from zerooffload.io.swap_space import PRIVATE_DIR
from zerooffload.io.swapfile import SwapStore

_TRAIN = ["train", "train.micro_batch_size=4", "scheduler.type=constant"]
_NVME = ["zero.stage=3", "offload.param.tier=nvme", "offload.optimizer.tier=nvme"]


def _refusal(link: Path) -> str:
    """The one line a planted ``link`` is refused with (its target named as the link holds it)."""
    return (f"{link} is a symbolic link to {os.readlink(link)}, and a link is never followed where files are "
            "created, locked or removed: remove it (the directories given, such as --out and nvme.path, and those "
            "above them may be links)")


def _snapshot(path: Path) -> dict[str, bytes | None]:
    """Every name under ``path`` (itself included) with a file's bytes (None for a directory): what a
    trap would have changed."""
    names = [path, *sorted(path.rglob("*"))] if path.is_dir() else [path]
    return {str(p): None if p.is_dir() else p.read_bytes() for p in names}


@pytest.fixture
def victims(tmp_path) -> tuple[Path, Path]:
    """A file of 800 bytes (a user's ~/.bashrc) and a private directory holding a file and an unlocked
    ``*.swap`` file: what the planted links point to."""
    victim = tmp_path / "victim" / "bashrc"
    victim.parent.mkdir()
    victim.write_bytes(bytes(range(200)) * 4)
    directory = tmp_path / "victim" / "private"
    directory.mkdir(mode=0o700)
    (directory / "notes.txt").write_text("another user's private files")
    (directory / "someone.swap").write_bytes(b"\x07" * 8192)
    return victim, directory


def _one_line(run) -> str:
    lines = [line for line in run.stderr.splitlines() if line.startswith("zerooffload: ")]
    assert run.returncode == 1 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    return lines[0].removeprefix("zerooffload: ")


# ------------------------------------------------------------------------------------------ --out
def test_a_summary_link_planted_while_the_run_trains_is_refused_and_its_target_unchanged(tmp_path, victims):
    """The start checks summary.json, but a link can come later: the write at the end opens it O_NOFOLLOW."""
    (tmp_path / "summary.json").symlink_to(victims[0])
    before = _snapshot(victims[0])
    with pytest.raises(LinkRefused, match="summary.json is a symbolic link"):
        write_summary(tmp_path, "{}")
    assert _snapshot(victims[0]) == before


@pytest.mark.parametrize("name, target", [(".lock", "file"), ("summary.json", "file"), ("checkpoints", "dir"),
                                          ("checkpoints/latest", "file"), ("checkpoints/latest.tmp", "file"),
                                          ("checkpoints/step00000001", "dir"),
                                          ("checkpoints/step00000002.partial", "dir"),
                                          ("checkpoints/last.replaced", "dir")])
def test_a_link_planted_in_out_is_refused_before_the_run_and_its_target_unchanged(tmp_path, victims, name, target):
    """A shared --out with a planted link: refused in one line naming it, in well under a second of the
    run (before the model is built), whether or not the run resumes; the target is as it was."""
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    link = out / name
    if name == "checkpoints":
        link.rmdir()
    link.symlink_to(victims[0] if target == "file" else victims[1])
    before = {**_snapshot(victims[0]), **_snapshot(victims[1])}
    for resume in ([], ["--resume"]):
        run = run_in_process(*_TRAIN, "--steps", "1", "--save-every", "1", *resume, "--out", str(out))
        assert _one_line(run) == _refusal(link)
    assert {**_snapshot(victims[0]), **_snapshot(victims[1])} == before
    assert os.readlink(link) == str(victims[0] if target == "file" else victims[1])  # the link itself left alone


def test_a_lock_file_with_a_second_name_is_refused_and_not_truncated(tmp_path, victims):
    """A hard link is no symlink, but truncating ``.lock`` would truncate the victim all the same."""
    out = tmp_path / "out"
    out.mkdir()
    os.link(victims[0], out / ".lock")
    before = victims[0].read_bytes()
    assert _one_line(run_in_process(*_TRAIN, "--steps", "1", "--out", str(out))) == (
        f"{out}/.lock is not a plain file of its own (2 names, mode -rw-r--r--): zerooffload truncates it; remove it")
    assert victims[0].read_bytes() == before


# ------------------------------------------------------------------------------------------ nvme.path
@pytest.fixture(scope="module")
def aio():
    with AsyncIO() as engine:
        yield engine


def test_a_swap_directory_link_to_another_private_directory_is_refused(tmp_path, victims, aio):
    """``zerooffload-swap`` linked to another 0700 directory of this user passed the stat check: its
    unlocked ``*.swap`` files were swept and new ones written there. Now refused, nothing touched."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    (nvme / PRIVATE_DIR).symlink_to(victims[1])
    before = _snapshot(victims[1])
    with pytest.raises(LinkRefused) as refused:
        SwapStore(str(nvme), aio)
    assert str(refused.value.strerror) == _refusal(nvme / PRIVATE_DIR)
    assert _snapshot(victims[1]) == before


@pytest.mark.parametrize("name", ["stale.swap", ".lock"])
def test_a_link_in_the_swap_directory_is_refused_not_swept(tmp_path, victims, aio, name):
    """A ``*.swap`` link is neither locked nor removed by the sweep of stale files; a ``.lock`` link is
    not opened."""
    with SwapStore(str(tmp_path), aio):  # makes the private directory, as a run before did
        pass
    link = tmp_path / PRIVATE_DIR / name
    if name == ".lock":
        link.unlink()
    link.symlink_to(victims[1] / "someone.swap")
    before = _snapshot(victims[1])
    with pytest.raises(LinkRefused) as refused:
        SwapStore(str(tmp_path), aio)
    assert refused.value.strerror == _refusal(link)
    assert _snapshot(victims[1]) == before and link.is_symlink()


def test_a_swap_file_replaced_by_a_link_is_not_removed_through_it(tmp_path, victims, aio):
    """A store removes the file it created, not whatever took its name since."""
    store = SwapStore(str(tmp_path), aio)
    path = store.paths[0]
    path.unlink()
    path.symlink_to(victims[0])
    before = _snapshot(victims[0])
    store.close()
    assert path.is_symlink() and _snapshot(victims[0]) == before


# ------------------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def engine():
    with zo.initialize(make_model(), {"zero": {"stage": 1}}) as engine:
        idx = torch.zeros(2, 8, dtype=torch.long)
        engine.backward(engine(idx, idx))
        engine.step()
        yield engine


@pytest.mark.parametrize("name, target", [("latest", "file"), ("latest.tmp", "file"), ("mine", "dir"),
                                          ("old.partial", "dir"), ("old.replaced", "dir")])
def test_a_save_refuses_a_planted_link_before_it_writes(tmp_path, victims, engine, name, target):
    """``engine.save_checkpoint(DIR, tag="mine")`` with a link at a name the save writes, replaces or
    removes: refused before anything is written; the target unchanged and no tag published."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / name).symlink_to(victims[0] if target == "file" else victims[1])
    before = {**_snapshot(victims[0]), **_snapshot(victims[1])}
    with pytest.raises(LinkRefused) as refused:
        engine.save_checkpoint(directory, tag="mine")
    assert refused.value.strerror == _refusal(directory / name)
    assert {**_snapshot(victims[0]), **_snapshot(victims[1])} == before
    assert sorted(p.name for p in directory.iterdir()) == [name]


def test_a_safetensors_export_refuses_a_link_at_its_temporary(tmp_path, victims, engine):
    """``save_safetensors`` (the Trainer's model.safetensors, ``checkpoint consolidate``) writes
    ``<file>.partial`` first: a link there is refused, the victim not truncated."""
    out = tmp_path / "model.safetensors"
    (tmp_path / "model.safetensors.partial").symlink_to(victims[0])
    before = _snapshot(victims[0])
    with pytest.raises(LinkRefused, match=re.escape(_refusal(tmp_path / "model.safetensors.partial"))):
        save_safetensors(engine, out)
    assert _snapshot(victims[0]) == before and not out.exists()


def test_latest_is_not_read_through_a_link(tmp_path, victims, engine):
    directory = tmp_path / "ckpt"
    engine.save_checkpoint(directory, tag="mine")
    (directory / "latest").unlink()
    (directory / "latest").symlink_to(victims[0])
    with pytest.raises(LinkRefused, match=re.escape(_refusal(directory / "latest"))):
        engine.load_checkpoint(directory)


def test_prunes_refuse_a_linked_checkpoint_and_remove_nothing(tmp_path, victims):
    """train's --keep-last and the Trainer's save_total_limit (one rule) meet a step tag or a
    checkpoint-N that is a link: refused before anything goes; so is a Trainer's save into one."""
    for number, (name, do_prune) in enumerate([("step00000001", lambda d: prune(d, 1)),
                                                ("checkpoint-1", lambda d: prune_checkpoints(d, 1, set())),
                                                ("checkpoint-1", check_links)]):
        directory = tmp_path / f"run{number}"
        directory.mkdir()
        for newer in ("step00000002", "checkpoint-2"):
            (directory / newer).mkdir()
        (directory / "latest").write_text("step00000002\n")
        (directory / name).symlink_to(victims[1])
        before = _snapshot(victims[1])
        with pytest.raises(LinkRefused, match=re.escape(_refusal(directory / name))):
            do_prune(directory)
        assert _snapshot(victims[1]) == before
        assert sorted(p.name for p in directory.iterdir()) == sorted(["step00000002", "checkpoint-2", "latest", name])
    with pytest.raises(LinkRefused):
        remove_tree(directory / name)
    assert _snapshot(victims[1]) == before


# ------------------------------------------------------------------------------------------ links that work
def test_a_linked_out_and_a_linked_nvme_path_still_work(tmp_path):
    """--out a link (whose parent is a link too) and nvme.path a link: a stage-3 NVMe run saves, prunes
    and resumes through them; its files land in the real directories."""
    disk = tmp_path / "disk"
    (disk / "runs").mkdir(parents=True)
    (disk / "swap").mkdir()
    (tmp_path / "mnt").symlink_to(disk)
    (disk / "runs" / "out-link").symlink_to(disk / "runs" / "out-real", target_is_directory=True)
    (disk / "runs" / "out-real").mkdir()
    (tmp_path / "swap-link").symlink_to(disk / "swap")
    out = tmp_path / "mnt" / "runs" / "out-link"
    args = [*_TRAIN, *_NVME, f"nvme.path={tmp_path / 'swap-link'}", "--save-every", "1", "--keep-last", "1",
            "--out", str(out)]
    first = run_in_process(*args, "--steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_in_process(*args, "--steps", "3", "--resume")
    assert resumed.returncode == 0 and "resumed from step 2" in resumed.stdout, resumed.stderr[-3000:]
    real = disk / "runs" / "out-real"
    assert sorted(p.name for p in (real / "checkpoints").iterdir()) == ["latest", "step00000003"]
    assert (real / "summary.json").is_file() and (real / ".lock").is_file()
    assert [p.name for p in (disk / "swap" / PRIVATE_DIR).iterdir()] == [".lock"]  # used, then removed
