"""A save killed by SIGKILL at any boundary — each rename, fsync, directory creation or removal, the
``latest`` write, inside a rank file — leaves ``latest`` naming a checkpoint that loads with every
checksum verified: the old state or the new one, never a mix. The next save cleans up after it.

Each kill point is one fresh process (SIGKILL cannot be survived), forked from a warm forkserver. The full sweep, every call of
every kind, killed before and after the call, for a new tag and for the same tag saved again, is
``slow``; CI runs one point of each kind.
"""
from __future__ import annotations

import os
import signal
import traceback
from dataclasses import dataclass

import pytest
import torch

import zerooffload as zo
from harness import fresh_process_context
from reference import make_batches, make_buffered_model
from zerooffload.checkpoint import read_manifest

CONFIG = {"zero": {"stage": 3, "persist_threshold": 0}, "optimizer": {"lr": 1e-2}}
KINDS = ("rename", "fsync", "mkdir", "remove", "latest", "rank file")


def train(engine) -> None:
    """One step: the state saved second differs from the one saved first."""
    (idx, targets), = make_batches(1, 1, 4, seed=5)[0]
    engine.backward(engine(idx, targets))
    engine.step()


def _save_killed(directory: str, tag: str, kind: str, number: int, when: str, report: str) -> None:
    """In a fresh process: save tag "old", train a step, then save ``tag`` with the ``number``-th call of
    ``kind`` (counted from 0) killing the process with SIGKILL just ``when`` ("before" or "after") it
    runs. A save that never reached that call writes the calls it made to ``report``; an error, its
    traceback (status 1)."""
    from zerooffload.checkpoint import files as checkpoint_files

    try:
        engine = zo.initialize(make_buffered_model(), CONFIG)  # never closed: the process is killed, or ends
        engine.save_checkpoint(directory, tag="old")
        train(engine)
        calls = [0]

        def killing(original):
            def patched(*args, **kwargs):
                hit = calls[0] == number
                calls[0] += 1
                if hit and when == "before":
                    os.kill(os.getpid(), signal.SIGKILL)
                try:
                    return original(*args, **kwargs)
                finally:  # after the call, whether it returned or raised (mkdir of an existing directory)
                    if hit:
                        os.kill(os.getpid(), signal.SIGKILL)
            return patched

        targets = {"rename": [(os, "replace"), (os, "rename")], "fsync": [(os, "fsync")], "mkdir": [(os, "mkdir")],
                   "remove": [(os, "unlink"), (os, "rmdir")],
                   "latest": [(checkpoint_files, "write_text_atomically")],
                   "rank file": [(checkpoint_files.ChecksummedWriter, "write")]}[kind]
        for owner, name in targets:
            setattr(owner, name, killing(getattr(owner, name)))
        engine.save_checkpoint(directory, tag=tag)
        with open(report, "w") as out:  # open and write: no patched call
            out.write(f"calls {calls[0]}")
    except BaseException:
        with open(report, "w") as out:
            out.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # at once: no exit handler may make a patched call (and be killed by it)


@dataclass(frozen=True)
class _Outcome:
    returncode: int
    report: str


def _kill_save(tmp_path, tag: str, kind: str, number: int, when: str) -> _Outcome:
    """``_save_killed`` in a fresh process, forked from the rank pools' forkserver (harness's [Note: rank
    pool]): torch and the engine are imported there already, so a kill point costs a fraction of a second
    instead of a new interpreter's seconds."""
    report = tmp_path.parent / f"{tmp_path.name}.report"
    process = fresh_process_context().Process(target=_save_killed, args=(str(tmp_path), tag, kind, number, when,
                                                                         str(report)))
    process.start()
    process.join(timeout=120)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail(f"the save of {tag} ({kind} {number} {when}) did not end in 120 s")
    return _Outcome(process.exitcode, report.read_text() if report.exists() else "")


@pytest.fixture(scope="module")
def states():
    """The old and the new full state, computed without any checkpoint; and a loading engine."""
    with zo.initialize(make_buffered_model(), CONFIG) as engine:
        old = engine.full_state_dict()
        train(engine)
        new = engine.full_state_dict()
    with zo.initialize(make_buffered_model(seed=1), CONFIG) as loader:
        yield old, new, loader


def _check_point(tmp_path, states, tag: str, kind: str, number: int, when: str) -> bool:
    """Kill one save at one point; True when the save finished before reaching it (the sweep's end)."""
    old, new, loader = states
    tmp_path.mkdir(exist_ok=True)
    done = _kill_save(tmp_path, tag, kind, number, when)
    if done.returncode == 0:
        return True
    assert done.returncode == -signal.SIGKILL, done.report[-3000:]
    read_manifest(tmp_path)  # latest names a complete tag; digest and every file's CRC verified
    loader.load_checkpoint(tmp_path)
    loaded = loader.full_state_dict()
    assert any(list(loaded) == list(s) and all(torch.equal(loaded[k], s[k]) for k in s) for s in (old, new))
    loader.save_checkpoint(tmp_path, tag="next")  # and the next save cleans up what the kill left
    assert sorted(p.name for p in tmp_path.iterdir() if p.name not in ("old", tag)) == ["latest", "next"]
    return False


def _sweep(tmp_path, states, tag: str, kind: str, when: str) -> int:
    number = 0
    while not _check_point(tmp_path / str(number), states, tag, kind, number, when):
        number += 1
    return number


@pytest.mark.parametrize("kind", KINDS)
def test_a_kill_at_one_point_of_each_kind_leaves_latest_loadable(tmp_path, states, kind):
    """The same tag saved again (the riskiest case: the old copy is moved aside), killed just before
    the last call of its kind — for renames, the one that publishes the new copy."""
    points = {"rename": 1, "fsync": 4, "mkdir": 0, "remove": 2, "latest": 0, "rank file": 1}
    assert not _check_point(tmp_path, states, "old", kind, points[kind], "before"), "the point was never reached"


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("tag", ["old", "new"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_kill_point_leaves_latest_loadable(tmp_path, states, kind, tag, when):
    points = _sweep(tmp_path, states, tag, kind, when)
    assert points > 0 or (kind, tag) == ("remove", "new")  # a save under a new tag removes nothing
