"""Which old checkpoints go: one rule for train's step tags (``--keep-last``) and the Trainer's
``checkpoint-N`` folders (``save_total_limit``).

[Note: one pruning rule]
- A *series* is one run's checkpoints in one directory, named by a pattern whose group is the step:
  ``step(\\d{8})`` (train's tags) or ``checkpoint-(\\d+)`` (the Trainer's folders); oldest first by step.
  Names of no series (someone's own save, a user's folder) are never touched.
- After a save the newest ``keep`` of the series stay (0: all); older ones go unless spared (the tag
  ``latest`` names, the best checkpoint, the last saved before a skip streak: skip_streak's note).
- A doomed checkpoint is renamed ``<name>.partial`` and then removed (``remove_tree``), so a prune cut
  short never leaves a name that looks complete; every prune first removes such leftovers of its
  series, as the engine's next save removes the ``<tag>.partial`` a save left (files' note).
- A link among these names is refused before anything is removed (files' [Note: links in a checkpoint
  directory]).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from ..io.files import refuse_link
from .files import PARTIAL, remove_tree

__all__ = ["prune", "series"]

logger = logging.getLogger(__name__)


def series(directory: Path, pattern: re.Pattern[str]) -> list[str]:
    """The checkpoints of ``pattern``'s series in ``directory``, oldest first; a link among them or
    their ``.partial`` leftovers is refused. None when the directory does not exist."""
    return _scan(directory, pattern)[0]


def prune(directory: Path, pattern: re.Pattern[str], keep: int, spare: set[str | None]) -> list[str]:
    """Remove the ``<name>.partial`` leftovers of the series, then all but its newest ``keep`` (0: none
    goes), never a name in ``spare``; the names removed (see [Note: one pruning rule])."""
    names, leftovers = _scan(directory, pattern)
    for leftover in leftovers:
        logger.info("removing %s, left by a prune that did not finish", directory / leftover)
        shutil.rmtree(directory / leftover)
    doomed = [name for name in names[:-keep] if name not in spare] if keep else []
    for name in doomed:
        remove_tree(directory / name)
    return doomed


def _scan(directory: Path, pattern: re.Pattern[str]) -> tuple[list[str], list[str]]:
    """The series' checkpoints, oldest first, and its ``.partial`` leftovers (directories); a link
    among either is refused."""
    if not directory.is_dir():
        return [], []
    found, leftovers = [], []
    with os.scandir(directory) as entries:
        for entry in entries:
            if match := pattern.fullmatch(entry.name.removesuffix(PARTIAL)):
                if entry.is_symlink():
                    refuse_link(entry.path)
                if entry.is_dir():
                    if entry.name == match.group(0):
                        found.append((int(match.group(1)), entry.name))
                    else:
                        leftovers.append(entry.name)
    return [name for _, name in sorted(found)], leftovers
