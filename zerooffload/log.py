"""Logging for every layer: one ``zerooffload`` logger tree, each line prefixed with the rank.

With several ranks writing to one terminal, a line is only useful if it says which rank wrote it,
so the formatter reads the rank from torch.distributed once a process group exists, else from the
launcher's ``RANK`` environment variable.
"""
from __future__ import annotations

import logging
import os
import sys

__all__ = ["configure_logging", "current_rank"]

_HANDLER_NAME = "zerooffload"


def current_rank() -> int:
    """This process's rank: the process group's when one exists, else $RANK, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = current_rank()
        return True


def configure_logging(level: int | str = logging.INFO) -> logging.Logger:
    """Attach one rank-prefixed stderr handler to the ``zerooffload`` logger (idempotent)."""
    logger = logging.getLogger("zerooffload")
    logger.setLevel(level)
    if not any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.set_name(_HANDLER_NAME)
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[rank %(rank)d] %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    return logger
