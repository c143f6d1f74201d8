"""Errors users meet by name, defined apart from what raises them so that the command line can tell
them from bugs without importing torch first (``cli.main``'s [Note: user errors])."""
from __future__ import annotations

__all__ = ["CheckpointError", "EngineGroupEnded", "SkipStreakError"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used or written: missing, corrupt, truncated, for another model,
    or no room to save it."""


class EngineGroupEnded(RuntimeError):
    """Another rank failed, so this rank's engine stopped too; the message is that rank's error."""


class SkipStreakError(RuntimeError):
    """Too many windows in a row were skipped for inf/NaN values (``skip_streak``'s note); ``checkpoint``
    names the last one saved before the streak began (None when there was none)."""

    agreed = True
    """Every rank raises it at the same step, from the same all-reduced values: it ends no process group
    (comm's [Note: failing together])."""

    def __init__(self, message: str, checkpoint: str | None = None):
        super().__init__(message)
        self.checkpoint = checkpoint
