"""One pruning rule for train's ``--keep-last`` and the Trainer's ``save_total_limit`` (checkpoint.pruning's
[Note: one pruning rule]), on real directories: the newest ``keep`` of a series stay, the spared ones stay,
names of no series are never touched, and what a prune cut short left (``<name>.partial``) goes at the
next save, for the Trainer's ``checkpoint-N`` folders as for the engine's tags."""
from __future__ import annotations

from pathlib import Path

import pytest

from zerooffload.cli.run_checkpoints import Pruner, prune
from zerooffload.io.files import LinkRefused
from zerooffload.hf.checkpoints import prune_checkpoints


def _make(directory: Path, *names: str) -> None:
    """Folders holding a file each, as checkpoints do (a prune must remove a tree, not an empty name)."""
    for name in names:
        (directory / name).mkdir(parents=True)
        (directory / name / "data.bin").write_bytes(name.encode())


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_trainers_leftover_partial_folder_goes_at_the_next_save(tmp_path):
    """A prune killed between its rename and its removal leaves ``checkpoint-3.partial``: the next save
    removes it even with no ``save_total_limit`` (nothing else goes then), and never a user's
    ``notes.partial`` nor a folder of no series."""
    run = tmp_path / "run"
    _make(run, "checkpoint-2", "checkpoint-9", "checkpoint-10", "checkpoint-3.partial", "notes.partial", "mine")
    prune_checkpoints(run, None, spare=set())
    assert _names(run) == ["checkpoint-10", "checkpoint-2", "checkpoint-9", "mine", "notes.partial"]
    prune_checkpoints(run, 1, spare={str(run / "checkpoint-2")})  # the best checkpoint, kept as the Trainer keeps it
    assert _names(run) == ["checkpoint-10", "checkpoint-2", "mine", "notes.partial"]  # by step: 10 is the newest


def test_train_and_the_trainer_keep_the_same_steps(tmp_path):
    """The same history in both namings (steps 1, 2, 3, 5, 8, a leftover of step 4; ``latest`` or the best
    at step 3, the last good save at step 1; keep 2): the same steps stay, the leftover goes."""
    cli, hf = tmp_path / "checkpoints", tmp_path / "run"
    _make(cli, *(f"step{s:08d}" for s in (1, 2, 3, 5, 8)), "step00000004.partial", "mine")
    (cli / "latest").write_text("step00000003\n")
    _make(hf, *(f"checkpoint-{s}" for s in (1, 2, 3, 5, 8)), "checkpoint-4.partial", "mine")
    prune(cli, 2, spare="step00000001")
    prune_checkpoints(hf, 2, spare={str(hf / "checkpoint-3"), str(hf / "checkpoint-1")})
    assert _names(cli) == ["latest", "mine", "step00000001", "step00000003", "step00000005", "step00000008"]
    assert _names(hf) == ["checkpoint-1", "checkpoint-3", "checkpoint-5", "checkpoint-8", "mine"]
    assert (cli / "mine" / "data.bin").read_bytes() == b"mine" and (hf / "mine" / "data.bin").read_bytes() == b"mine"


def test_a_prune_on_its_own_thread_removes_the_same_tags_and_its_error_surfaces_at_wait(tmp_path):
    """train prunes on a thread while the steps go on (run_checkpoints' [Note: pruning]): once waited for, the
    same tags are gone as ``prune`` removes; a prune that fails there (a tag planted as a link) raises its
    error at the next ``wait``, once, and removed nothing."""
    run, pruner = tmp_path / "checkpoints", Pruner()
    _make(run, *(f"step{s:08d}" for s in (1, 2, 3)))
    (run / "latest").write_text("step00000003\n")
    pruner.start(run, 1)
    pruner.wait()
    assert _names(run) == ["latest", "step00000003"]
    (tmp_path / "elsewhere").mkdir()
    (run / "step00000002").symlink_to(tmp_path / "elsewhere")
    pruner.start(run, 1)
    with pytest.raises(LinkRefused):
        pruner.wait()
    pruner.wait()  # raised once
    assert _names(run) == ["latest", "step00000002", "step00000003"] and (tmp_path / "elsewhere").is_dir()
