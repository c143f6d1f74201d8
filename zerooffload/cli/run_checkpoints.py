"""Train's checkpoints: which one ``--resume`` continues from, and which old ones ``--keep-last`` removes.

[Note: resuming]
Every save's client state holds ``next_step`` (the data position) and ``losses``, the loss of every
step so far: the history travels inside the checkpoint it belongs to, so whichever tag a run resumes
from, summary.json's ``steps`` and ``losses`` describe steps 0..N of one run (a summary.json beside
it could be newer or older than that tag). ``--resume`` loads ``--tag``, else the tag ``latest``
names; when ``latest`` is missing or its checkpoint does not verify (``read_manifest``: digest,
format, sizes and CRCs), the newest ``stepNNNNNNNN`` tag that does, said in one line. Every rank
chooses alone, from the same files, so they agree without a collective before the load (a collective
that one rank left by raising would end the engine's group). The check reads the files once more
than the load does; a resume is rare enough to pay that for not dying on one bad tag.

[Note: pruning]
After each save is published rank 0 prunes by the rule the Trainer's folders share (checkpoint.pruning's
[Note: one pruning rule]): the newest ``--keep-last`` step tags stay, older ones go, never the tag
``latest`` names, never a tag of another name (someone's own save), and never the last tag saved before
a streak of skipped windows began (``skip_streak``'s note): while windows are skipped for inf/NaN values the
saves hold no newer model, and pruning them would leave nothing good to go back to. Before each save,
when the disk has less free space than the newest checkpoint took and ``--keep-last`` is 2 or more,
the oldest tags go first (the newest that verifies and that spared one stay), said in one line:
otherwise a full disk would fail every save, since the prune comes only after a save that succeeded.
A save in the background (``train.async_save``) is published, and pruned after, when it is waited for:
at the first step end that finds it done, else at the next save or the loop's end (a prune removes the
series' ``.partial`` directories, and until then one of them is that save's). The prune runs on a thread
of its own (``Pruner``) while training goes on: removing an old tag's files takes ~10 ms for the small
preset's 130 MB on ext4 here, which would otherwise be training time at every save. Nothing else
changes the directory meanwhile: the next save (``make_room`` first) and the run's end wait for it.
"""
from __future__ import annotations

import re
import shutil
import sys
import threading
from pathlib import Path

from ..checkpoint import CheckpointError, first_verified, pruning, read_latest, read_manifest, remove_tree, series
from ..log import current_rank

__all__ = ["STEP_TAG", "Pruner", "loadable_tag", "make_room", "prune", "resume", "resume_tag", "step_tags"]


STEP_TAG = re.compile(r"step(\d{8})")
"""The tags train saves (``checkpoint.default_tag``), by step: the only ones it falls back to or prunes."""


def resume_tag(checkpoints: Path, tag: str | None) -> str:
    """The tag ``--resume`` continues from, found before the engine is built: ``--tag``'s when its
    manifest reads (its files are verified as they load), else ``loadable_tag``'s."""
    if tag is None:
        return loadable_tag(checkpoints, current_rank())
    try:
        read_manifest(checkpoints, tag, verify=False)
    except CheckpointError as error:
        raise resume_error(error) from error
    return tag


def resume_error(error: CheckpointError) -> CheckpointError:
    return CheckpointError(f"{error}; resume from another tag with --tag NAME, or start again without --resume")


def resume(engine, checkpoints: Path, tag: str, shape: dict[str, int], verify: bool) -> tuple[int, list[float]]:
    """Load the checkpoint ``--resume`` continues from (see [Note: resuming]); the step it ends at and
    the losses of the steps before it. ``verify`` is off for a tag ``loadable_tag`` chose: it has
    read every file of it already. Where ``shape`` (this run's --steps and global batch) differs from
    the saved one, rank 0 says what that changes."""
    try:
        client = engine.load_checkpoint(checkpoints, tag, verify=verify)
    except CheckpointError as error:
        raise resume_error(error) from error
    if not isinstance(client, dict) or not isinstance(client.get("next_step"), int):
        raise CheckpointError(f"{checkpoints / tag}: its client state has no 'next_step' (not saved by zerooffload "
                              "train); resume from one of train's stepNNNNNNNN tags")
    if engine.comm.rank == 0:
        print(f"resumed from step {client['next_step']} (tag {tag})")
        for line in _changes(client, shape):
            print(f"zerooffload: warning: {line}", file=sys.stderr)
    return client["next_step"], list(client.get("losses", []))


def _changes(saved: dict, shape: dict[str, int]) -> list[str]:
    """What a resume changes of the run it continues (checkpoints from before these were saved say nothing)."""
    lines = []
    if saved.get("global_batch", shape["global_batch"]) != shape["global_batch"]:
        lines.append(f"the run saved a global batch of {saved['global_batch']} sequences per step and continues "
                     f"with {shape['global_batch']} (world size x train.micro_batch_size x train.grad_accum_steps): "
                     "the steps after the resume are not those of the run it continues")
    if saved.get("steps", shape["steps"]) != shape["steps"]:
        lines.append(f"the run was started with --steps {saved['steps']} and continues with --steps {shape['steps']}:"
                     " a decaying learning-rate schedule now spans the new count, so it differs from here on")
    return lines


def loadable_tag(checkpoints: Path, rank: int) -> str:
    """The tag ``latest`` names, or when it does not verify the newest step tag that does."""
    if not checkpoints.is_dir():
        raise CheckpointError(f"{checkpoints} does not exist, so there is nothing to resume from; start without "
                              "--resume, or pass the --out of the run to continue")
    tags = [None, *reversed(step_tags(checkpoints))]
    found, errors = first_verified([(checkpoints, tag) for tag in tags])
    if found == 0:
        return read_latest(checkpoints)
    if found is None:
        raise CheckpointError(f"{errors[0]}; no stepNNNNNNNN tag in {checkpoints} verifies either: start without "
                              "--resume")
    if rank == 0:
        print(f"zerooffload: warning: not resuming from latest ({errors[0]}); resuming from {tags[found]}, the newest "
              "step tag that verifies", file=sys.stderr)
    return tags[found]


def step_tags(checkpoints: Path) -> list[str]:
    """Train's step tags in ``checkpoints``, oldest first (a link among them is refused)."""
    return series(checkpoints, STEP_TAG)


def prune(checkpoints: Path, keep: int, spare: str | None = None) -> None:
    """Remove train's step tags older than the newest ``keep`` (0: keep all), sparing the one ``latest``
    names and ``spare`` (the last saved before a skip streak: [Note: pruning])."""
    pruning.prune(checkpoints, STEP_TAG, keep, {read_latest(checkpoints), spare})


class Pruner:
    """``prune`` on a thread of its own, one prune at a time ([Note: pruning]); ``wait`` before the
    directory changes otherwise, which raises the prune's error, if it failed."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, checkpoints: Path, keep: int, spare: str | None = None) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._prune, args=(checkpoints, keep, spare), name="zerooffload-prune")
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _prune(self, checkpoints: Path, keep: int, spare: str | None) -> None:
        try:
            prune(checkpoints, keep, spare)
        except BaseException as error:  # raised on the training thread by wait()
            self._error = error


def make_room(checkpoints: Path, keep: int, spare: str | None = None) -> list[str]:
    """Before a save: when the free space is short of what the newest checkpoint took and ``keep`` ≥ 2,
    remove the oldest step tags, never the newest that verifies nor ``spare``, until the save fits or
    none is left to remove; said in one line. The tags removed (see [Note: pruning])."""
    tags = step_tags(checkpoints) if keep >= 2 else []
    if not tags:
        return []
    need = _tree_bytes(checkpoints / tags[-1])
    if shutil.disk_usage(checkpoints).free >= need:
        return []
    kept = {spare, _newest_verified(checkpoints, tags)}
    removed = []
    for tag in tags:
        if shutil.disk_usage(checkpoints).free >= need:
            break
        if tag not in kept:
            remove_tree(checkpoints / tag)
            removed.append(tag)
    if removed and current_rank() == 0:
        print(f"zerooffload: warning: {checkpoints} had less free space than a checkpoint takes ({need:,} bytes): "
              f"removed {', '.join(removed)} before saving (--keep-last {keep}); kept "
              f"{', '.join(sorted(t for t in kept if t))}", file=sys.stderr)
    return removed


def _newest_verified(checkpoints: Path, tags: list[str]) -> str | None:
    for tag in reversed(tags):
        try:
            read_manifest(checkpoints, tag)
            return tag
        except CheckpointError:
            continue
    return None


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


