"""Errors users meet by name, defined apart from what raises them so that the command line can tell
them from bugs without importing torch first (``cli.main``'s [Note: user errors])."""
from __future__ import annotations

__all__ = ["CheckpointError", "EngineGroupEnded"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used or written: missing, corrupt, truncated, for another model,
    or no room to save it."""


class EngineGroupEnded(RuntimeError):
    """Another rank failed, so this rank's engine stopped too; the message is that rank's error."""
