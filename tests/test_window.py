"""The accumulation window as a state machine (window's [Note: the window]): the states a real engine's
window passes through over accumulated, updated and skipped windows, and the moves it refuses."""
from __future__ import annotations

import pytest

from reference import make_batches, make_model
from zerooffload.zero.window import Verdict, WindowError, WindowState


def _config(accum: int) -> dict:
    return {"zero": {"stage": 2}, "train": {"grad_accum_steps": accum}, "optimizer": {"lr": 1e-2}}


def _backward(engine, batch, poison: float = 1.0) -> None:
    idx, targets = batch
    engine.backward(engine(idx, targets) * poison)


def test_a_window_accumulates_steps_and_closes(make_engine):
    engine = make_engine(make_model(), _config(accum=2))
    window = engine.window
    first, second = (batch for (batch,) in make_batches(2, 1, 2, seed=7))
    assert window.window_state is WindowState.OPEN and not window.step_due
    _backward(engine, first)
    assert window.window_state is WindowState.ACCUMULATING and engine.step() is False
    _backward(engine, second)
    assert window.window_state is WindowState.STEPPING and window.step_due
    assert engine.step() is True
    assert window.window_state is WindowState.CLOSED and (window.global_steps, window.micro_steps) == (1, 2)
    _backward(engine, first)  # the next window opens
    assert window.window_state is WindowState.ACCUMULATING


def test_a_skipped_window_counts_its_backwards_and_closes_skipped(make_engine):
    engine = make_engine(make_model(), _config(accum=2))
    window = engine.window
    first, second = (batch for (batch,) in make_batches(2, 1, 2, seed=7))
    _backward(engine, first, poison=float("nan"))
    assert window.window_state is WindowState.SKIPPED and window.reason == "non-finite loss on 1 rank(s)"
    _backward(engine, second)  # counted, nothing run
    assert window.window_state is WindowState.SKIPPED and window.step_due and window.micro_steps == 2
    assert engine.step() is False
    assert window.window_state is WindowState.CLOSED and window.skipped_steps == 1 and window.reason is None


def test_the_moves_the_window_refuses(make_engine):
    engine = make_engine(make_model(), _config(accum=1))
    window = engine.window
    (batch,), = make_batches(1, 1, 2, seed=7)
    with pytest.raises(WindowError, match="cannot close: it is OPEN, and close needs STEPPING or SKIPPED"):
        window.close(Verdict())
    _backward(engine, batch)
    with pytest.raises(WindowError, match=r"backward\(\) called again before step\(\)"):
        _backward(engine, batch)
    assert engine.step() is True and engine.step() is False  # one step a window
