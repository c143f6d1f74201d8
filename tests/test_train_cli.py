"""``zerooffload train``: the main job, alone and under torchrun (the CI smoke test)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from zerooffload.models import GPT, PRESETS


def _run(args: list[str], tmp_path, timeout: int = 300) -> dict:
    out = tmp_path / "out"
    run = subprocess.run([*args, "--out", str(out)], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "trained nano" in run.stdout
    return json.loads((out / "summary.json").read_text())


def test_train_smoke_30_steps(tmp_path):
    summary = _run([sys.executable, "-m", "zerooffload", "train", "--steps", "30"], tmp_path)
    assert summary["steps"] == 30 and summary["stage"] == 2 and summary["world_size"] == 1
    assert summary["loss_ratio"] < 0.9  # the loss falls even in 30 steps
    assert all(0 < loss < 6 for loss in summary["losses"])


@pytest.mark.parametrize("stage", [1, 3])
def test_train_under_torchrun_two_ranks(tmp_path, stage):
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun not on PATH")
    summary = _run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "zerooffload", "train", "--steps", "8",
                    f"zero.stage={stage}"], tmp_path)
    assert summary["world_size"] == 2 and summary["stage"] == stage and summary["steps"] == 8
    assert summary["loss_ratio"] < 1.0


def test_presets_span_1m_to_2b_and_the_largest_outgrows_this_machine():
    sizes = {name: config.num_params for name, config in PRESETS.items()}
    assert min(sizes.values()) < 1.5e6 and max(sizes.values()) > 1.9e9
    assert max(sizes.values()) * 16 > 24 * 2**30  # bf16 model states of the largest exceed 24 GiB
    assert sum(p.numel() for p in GPT(PRESETS["small"]).parameters()) == PRESETS["small"].num_params


def test_train_resumes_from_its_checkpoint_exactly(tmp_path):
    """10 steps straight == 5 steps with --save-every 5, then --resume to 10 (a fresh process)."""
    common = [sys.executable, "-m", "zerooffload", "train", "train.micro_batch_size=4", "scheduler.type=constant"]
    straight = _run([*common, "--steps", "10"], tmp_path / "a")
    _run([*common, "--steps", "5", "--save-every", "5"], tmp_path / "b")
    resumed = _run([*common, "--steps", "10", "--resume"], tmp_path / "b")
    assert resumed["steps"] == 5 and resumed["losses"] == straight["losses"][5:]
    again = subprocess.run([*common, "--steps", "5", "--resume", "--out", str(tmp_path / "b" / "out")],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 0 and "nothing to train" in again.stdout, again.stderr[-2000:]
