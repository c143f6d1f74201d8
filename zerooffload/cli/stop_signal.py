"""Stopping ``zerooffload train`` on SIGTERM or SIGINT at the end of a step, every rank after the same one.

[Note: stopping on a signal]
SIGTERM (a scheduler preempting the job; torchrun passes it on to its ranks) and SIGINT (Ctrl-C) stop
the run at the end of the current optimizer step, not wherever the signal lands: the handler only
records the signal, so no step, I/O request or collective is cut in half. Once per optimizer step the
ranks combine what they received with one tiny control all-reduce (which also averages the step's loss
over them), so every rank stops after the same step: the checkpoint that follows is a collective and
would deadlock if one rank went on training.
With ``--save-every`` that checkpoint holds the steps done (the same ``next_step`` client state and
directory as the periodic saves, so ``--resume`` continues exactly); summary.json is written as at a
normal end; rank 0 prints one line saying what was kept; the exit status is 128 + the signal number
(143 for SIGTERM, 130 for SIGINT), the shell's convention, so a scheduler sees a run that did not
finish. A second signal is noted and ignored: it arrives while the step or the save is finishing,
which is exactly what must not be torn (torchrun itself sends SIGTERM after the terminal's SIGINT).
Rank 0 says so as the first signal lands, not when the step ends: a large model's step takes minutes
on a CPU (a 1b at the default batch, ~17), and a Ctrl-C that seems ignored gets pressed again, then
killed; the line names SIGKILL as the way to abandon the step (the next run in that --out removes the
swap folder it leaves).
"""
from __future__ import annotations

import os
import signal
import threading

import torch

from ..comm import Comm, control_all_reduce

__all__ = ["StopOnSignal"]


class StopOnSignal:
    """SIGTERM and SIGINT handlers that only record the signal, installed for a ``with`` block and then
    put back as they were (see [Note: stopping on a signal]).

    Python runs signal handlers in the main thread only, so elsewhere (a training loop in a thread)
    nothing is installed and signals keep their previous meaning.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, rank: int):
        self._rank = rank
        self._previous: dict[int, object] = {}
        self.received: signal.Signals | None = None
        """The first of ``SIGNALS`` this process received, if any."""

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._record) for signum in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():  # None: a handler installed outside Python
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)

    def _record(self, signum: int, frame: object) -> None:
        received = signal.Signals(signum)
        name = received.name
        if self.received is None:
            self.received = received
            said = (f"{name}: stopping at the end of this step (a second signal is ignored; SIGKILL abandons the "
                    "step)")
        else:
            said = f"{name} ignored: already stopping at the end of this step"
        if self._rank == 0:  # os.write, not print: the main thread may be inside a write to stderr
            os.write(2, f"\nzerooffload: {said}\n".encode())

    def agreed(self, comm: Comm, loss: float) -> tuple[signal.Signals | None, float]:
        """The signal that stops every rank after this step, or None, and the step's loss averaged over
        the ranks (each rank's ``loss`` is its own micro-batches'; the mean is the global batch's, the
        loss a run reports); collective when several ranks run: one all-reduce carries both.

        Each rank reads its flag once, and ranks sum one count per signal, so all of them see the same
        counts and take the same decision (a sum of 0/1 flags is nonzero exactly when their MAX is 1);
        a rank that received nothing itself stops for the first signal some peer received.
        """
        mine = self.received
        if comm.world_size == 1:
            return mine, loss
        values = torch.tensor([loss, *(float(mine == s) for s in self.SIGNALS)], dtype=torch.float64)
        total, *counts = control_all_reduce(comm, values.to(comm.device)).cpu().tolist()
        return mine or next((s for s, n in zip(self.SIGNALS, counts) if n > 0), None), total / comm.world_size

