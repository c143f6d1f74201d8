"""A run cut into many: ``train --resume`` again and again gives the run that was never interrupted, bit
for bit, with the compact states (a split master and int8 moments, ``state_formats``' notes), whose
formats are the ones a save and load could change (int8 moments' exact resume: ``optim.state``'s
``keep_int8`` and the top-code rule of native/int8_moments.h).

Reference: the same command run straight through, in one process. Compared: the losses of every step
(summary.json), the final weights (``checkpoint consolidate``), and the bytes of the final checkpoint's
rank file, which hold the whole optimizer state (masters, int8 codes and scales)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cli_helpers import run_in_process
from zerooffload.checkpoint import consolidate, read_manifest

COMPACT = ["train.precision=bf16", "optimizer.master=split", "optimizer.moments=int8", "zero.stage=3",
           "offload.param.tier=nvme", "offload.optimizer.tier=nvme"]


def _train(out: Path, swap: Path, steps: int, *extra: str, model: str, fresh_process: bool) -> dict:
    args = ["train", "--model", model, "--steps", str(steps), "--out", str(out), *extra, *COMPACT, f"nvme.path={swap}"]
    if fresh_process:
        run = subprocess.run([sys.executable, "-m", "zerooffload", *args], capture_output=True, text=True,
                             timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    else:
        run = run_in_process(*args)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads((out / "summary.json").read_text())


def _final_state(out: Path, tmp_path: Path, name: str) -> tuple[dict, bytes]:
    """The consolidated weights and the rank file's bytes of ``out``'s newest checkpoint."""
    manifest = read_manifest(out / "checkpoints")
    weights = consolidate(out / "checkpoints", tmp_path / f"{name}.safetensors")  # what checkpoint consolidate runs
    return load_file(weights), (manifest.directory / "rank00000.bin").read_bytes()


def _chain_equals_the_straight_run(tmp_path: Path, cycles: int, model: str, fresh_process: bool) -> None:
    """``cycles`` runs of one step each, every one resuming the last, against one run of ``cycles`` steps.
    Each gives the schedule's length (``scheduler.total_steps``): else ``--steps`` sets it, and a run
    told to stop at step k would decay its learning rate by k (train_config's ``load_train_config``)."""
    swap = tmp_path / "swap"
    swap.mkdir()
    schedule = "scheduler.total_steps=100"  # past the warmup (20 steps), and past every run of the chain
    straight = _train(tmp_path / "straight", swap, cycles, "--save-every", str(cycles), schedule, model=model,
                      fresh_process=fresh_process)
    chain = tmp_path / "chain"
    for step in range(1, cycles + 1):
        resumed = _train(chain, swap, step, "--save-every", "1", "--keep-last", "2", schedule,
                         *(["--resume"] if step > 1 else []), model=model, fresh_process=fresh_process)
        assert resumed["first_step"] == step - 1
    assert resumed["losses"] == straight["losses"]
    (weights, rank_bytes), (reference, reference_bytes) = (_final_state(chain, tmp_path, "chain"),
                                                            _final_state(tmp_path / "straight", tmp_path, "straight"))
    assert weights.keys() == reference.keys()
    assert all(weights[name].equal(reference[name]) for name in reference)
    assert rank_bytes == reference_bytes


def test_three_resumes_of_compact_states_give_the_uninterrupted_run(tmp_path):
    """In this process (the command's ``main``, as ``python -m zerooffload`` calls it): CI's short chain."""
    _chain_equals_the_straight_run(tmp_path, 3, "nano", fresh_process=False)


@pytest.mark.slow  # ~4 minutes: 31 runs of the small GPT, each a fresh process
def test_thirty_resumes_of_the_small_gpt_give_the_uninterrupted_run(tmp_path):
    _chain_equals_the_straight_run(tmp_path, 30, "small", fresh_process=True)
