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
than the load does; a resume is rare enough to pay that for not dying on one bad tag. After each
save rank 0 keeps the newest ``--keep-last`` step tags (step order is name order): older ones go,
never the tag ``latest`` names and never a tag of another name (someone's own save). A doomed tag is
renamed ``<tag>.partial`` first, so a prune cut short leaves what the next save's recovery removes,
never a tag that looks complete.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from ..checkpoint import read_manifest
from ..checkpoint_files import LATEST, PARTIAL, CheckpointError
from ..log import current_rank

__all__ = ["STEP_TAG", "loadable_tag", "prune", "resume", "resume_tag"]


STEP_TAG = re.compile(r"step\d{8}")
"""The tags train saves (``checkpoint.default_tag``): the only ones it falls back to or prunes."""


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


def resume(engine, checkpoints: Path, tag: str, verify: bool) -> tuple[int, list[float]]:
    """Load the checkpoint ``--resume`` continues from (see [Note: resuming]); the step it ends at and
    the losses of the steps before it. ``verify`` is off for a tag ``loadable_tag`` chose: it has
    read every file of it already."""
    try:
        client = engine.load_checkpoint(checkpoints, tag, verify=verify)
    except CheckpointError as error:
        raise resume_error(error) from error
    if not isinstance(client, dict) or not isinstance(client.get("next_step"), int):
        raise CheckpointError(f"{checkpoints / tag}: its client state has no 'next_step' (not saved by zerooffload "
                              "train); resume from one of train's stepNNNNNNNN tags")
    if engine.comm.rank == 0:
        print(f"resumed from step {client['next_step']} (tag {tag})")
    return client["next_step"], list(client.get("losses", []))


def loadable_tag(checkpoints: Path, rank: int) -> str:
    """The tag ``latest`` names, or when it does not verify the newest step tag that does."""
    if not checkpoints.is_dir():
        raise CheckpointError(f"{checkpoints} does not exist, so there is nothing to resume from; start without "
                              "--resume, or pass the --out of the run to continue")
    try:
        read_manifest(checkpoints)
        return (checkpoints / LATEST).read_text().strip()
    except CheckpointError as error:
        problem = error
    for tag in sorted((p.name for p in checkpoints.iterdir() if STEP_TAG.fullmatch(p.name)), reverse=True):
        try:
            read_manifest(checkpoints, tag)
        except CheckpointError:
            continue
        if rank == 0:
            print(f"zerooffload: warning: not resuming from latest ({problem}); resuming from {tag}, the newest "
                  "step tag that verifies", file=sys.stderr)
        return tag
    raise CheckpointError(f"{problem}; no stepNNNNNNNN tag in {checkpoints} verifies either: start without --resume")


def prune(checkpoints: Path, keep: int) -> None:
    """Remove train's step tags older than the newest ``keep`` (0: keep all), sparing the one ``latest``
    names (see [Note: resuming])."""
    if not keep:
        return
    latest = (checkpoints / LATEST).read_text().strip()
    tags = sorted(p.name for p in checkpoints.iterdir() if STEP_TAG.fullmatch(p.name) and p.is_dir())
    for tag in tags[:-keep]:
        if tag != latest:
            doomed = checkpoints / (tag + PARTIAL)
            os.replace(checkpoints / tag, doomed)
            shutil.rmtree(doomed)
