"""Rank 0's progress of ``zerooffload train``: a bar on a terminal, plain lines anywhere else.
"""
from __future__ import annotations

import argparse
import sys
import time

from tqdm import tqdm

__all__ = ["Progress", "engine_postfix"]


class Progress:
    """Rank 0's progress. On a terminal, a tqdm bar; anywhere else (a log file, a pipe, a CI job) a
    bar's redraws are noise, so plain lines: after the first step, every tenth of the run or
    ``LINE_SECONDS``, whichever comes first, and after the last step."""

    LINE_SECONDS = 10.0

    def __init__(self, args: argparse.Namespace, first_step: int, rank: int):
        terminal = sys.stderr.isatty()
        # Counted by hand, not a wrapped range: one left by ``break`` would end a step short.
        self._bar = tqdm(desc=f"train {args.model}", disable=rank != 0 or not terminal, unit="step",
                         mininterval=1.0, initial=first_step, total=args.steps)
        self._lines = rank == 0 and not terminal
        self._first, self._total = first_step, args.steps
        self._every = max(1, args.steps // 10)
        self._printed = time.monotonic()

    def update(self, step: int, fields: dict[str, str]) -> None:
        self._bar.update()
        self._bar.set_postfix(fields)
        now = time.monotonic()
        if self._lines and (step in (self._first + 1, self._total) or step % self._every == 0
                            or now - self._printed >= self.LINE_SECONDS):
            self._printed = now
            print(f"step {step}/{self._total} " + " ".join(f"{k}={v}" for k, v in fields.items()), file=sys.stderr)

    def close(self) -> None:
        self._bar.close()


def engine_postfix(stats) -> dict[str, str]:
    """Skipped steps, stage 3 and NVMe figures for the progress bar, when the run has them."""
    postfix = {}
    if stats.skipped_steps:
        postfix["skipped"] = str(stats.skipped_steps)
    if stats.prefetch_hit_rate is not None:
        postfix["prefetch"] = f"{stats.prefetch_hit_rate:.0%}"
    if stats.io.read_bytes or stats.io.write_bytes:
        postfix["nvme"] = f"{stats.io_gbps:.2f}GB/s"
        postfix["io_wait_s"] = f"{stats.io.wait_seconds:.2f}"
    if stats.link.host_to_device_bytes or stats.link.device_to_host_bytes:
        postfix["host<->device"] = f"{stats.link_gbps:.2f}GB/s"
    return postfix
