"""Windows skipped in a row for non-finite values, and the stop when there are too many of them.

[Note: skip streaks]
``train.skip_nonfinite`` skips a window whose loss or gradient norm is inf/NaN, so that one bad batch
costs one update and not the run. A run whose windows are skipped again and again has not met a bad
batch: it diverged, or it reads damaged state, and every further step only burns time (and, under
``--keep-last``, prunes the good checkpoints). So after ``train.max_skip_streak`` such windows in a row
the engine raises ``SkipStreakError`` at the end of the step, naming the checkpoint saved before the
first skip of the streak: the state to go back to. fp16 overflows of the loss scale are expected (the
scale halves and tries again) and neither count nor break a streak; an update ends one.
"""
from __future__ import annotations

from .errors import SkipStreakError

__all__ = ["SkipStreak"]


class SkipStreak:
    """The current streak of skipped windows (see [Note: skip streaks])."""

    def __init__(self, limit: int):
        self.limit = limit
        """``train.max_skip_streak``; 0: never stop."""
        self.length = 0
        """Windows skipped for non-finite values since the last update."""
        self.checkpoint_before: str | None = None
        """The engine's last checkpoint when the streak began: the state to resume from."""

    def updated(self) -> None:
        """A window updated: the streak, if any, is over."""
        self.length, self.checkpoint_before = 0, None

    def skipped(self, reason: str, step: int, last_checkpoint: str | None) -> None:
        """A window was skipped for ``reason`` at optimizer step ``step``; raises once the streak is too long."""
        if self.length == 0:
            self.checkpoint_before = last_checkpoint
        self.length += 1
        if self.limit and self.length >= self.limit:
            raise SkipStreakError(
                f"{self.length} optimizer steps in a row were skipped for non-finite values (the last, step {step}: "
                f"{reason}; train.max_skip_streak = {self.limit}): the run diverged or reads damaged data, so it "
                f"stops; the model is as it was after step {step - self.length}; the last checkpoint saved before "
                f"the first skip: {self.checkpoint_before or 'none'}. Lower optimizer.lr or check the data, then "
                "resume from that checkpoint", checkpoint=self.checkpoint_before)
