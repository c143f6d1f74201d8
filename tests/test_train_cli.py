"""``zerooffload train``: the main job, alone and under torchrun (the CI smoke test)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerooffload.checkpoint import read_manifest
from zerooffload.models import GPT, PRESETS


def _completed(args: list[str], out: Path, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    run = subprocess.run([*args, "--out", str(out)], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run


def _run(args: list[str], tmp_path, timeout: int = 300, model: str = "nano") -> dict:
    run = _completed(args, tmp_path / "out", timeout)
    assert f"trained {model}" in run.stdout
    return json.loads((tmp_path / "out" / "summary.json").read_text())


_PROGRESS_LINE = re.compile(r"^step (\d+)/(\d+) loss=\d+\.\d{3} tok_s=[\d,]+ step_s=\d+\.\d{3}", re.MULTILINE)


def test_train_smoke_30_steps(tmp_path):
    """The default run; off a terminal its progress is plain lines: the first step, every tenth, the last.
    With --trace it writes a trace of steps 2-3 too (trace's note; tests/test_trace.py checks traces whole).
    A plain run never probes the machine: no probe cache is made, and nothing is predicted."""
    trace = tmp_path / "trace.json"
    run = _completed([sys.executable, "-m", "zerooffload", "train", "--steps", "30", "--trace", str(trace)],
                     tmp_path / "out", env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert not (tmp_path / "cache" / "zerooffload").exists()  # (matplotlib may keep its own cache there)
    main = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    assert sum(e["name"] == "step" for e in main) >= 2 and any(e["name"].startswith("forward h.") for e in main)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["stage"] == 2 and summary["world_size"] == 1
    assert "predicted" not in summary and summary["measured"]["step_seconds"] > 0
    assert summary["loss_ratio"] < 0.9  # the loss falls even in 30 steps
    assert all(0 < loss < 6 for loss in summary["losses"])
    steps = [int(step) for step, _ in _PROGRESS_LINE.findall(run.stderr)]
    assert steps[0] == 1 and steps[-1] == 30 and {3, 6, 9, 27} <= set(steps), run.stderr[-2000:]
    assert len(steps) < 20 and "\r" not in run.stderr  # not a line a step (only lines 10 s apart come extra)


@pytest.mark.slow  # CI trains under torchrun at stage 3 in test_sigterm_to_one_rank_under_torchrun_stops_both_...
@pytest.mark.parametrize("stage", [1, 3])
def test_train_under_torchrun_two_ranks(tmp_path, stage):
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun not on PATH")
    summary = _run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "zerooffload", "train", "--steps", "8",
                    f"zero.stage={stage}"], tmp_path)
    assert summary["world_size"] == 2 and summary["stage"] == stage and summary["steps"] == 8
    assert summary["loss_ratio"] < 1.0


def test_presets_span_1m_to_7b_and_the_largest_outgrows_this_machine():
    sizes = {name: config.num_params for name, config in PRESETS.items()}
    assert min(sizes.values()) < 1.5e6 and 6.3e9 < max(sizes.values()) < 6.5e9
    assert sizes["2b"] * 16 > 24 * 2**30  # bf16 model states of 2b already exceed 24 GiB
    assert sum(p.numel() for p in GPT(PRESETS["small"]).parameters()) == PRESETS["small"].num_params


@pytest.mark.slow  # ~10 min: 30 steps of 50m, 3 of 350m (the batch --plan auto chose for it, 8 x 2)
@pytest.mark.parametrize("model, steps, layout", [("50m", 30, []),
                                                  ("350m", 3, ["zero.stage=1", "train.micro_batch_size=8",
                                                               "train.grad_accum_steps=2"])])
def test_presets_train_stably_under_the_defaults(tmp_path, model, steps, layout):
    """train's defaults by size (train_config's note): 50m's loss falls over its first 30 steps, and
    350m's first steps no longer rise (the defaults of 3e-3 from 3e-4 sent it 5.4 -> 7.0 -> 7.3)."""
    summary = _run([sys.executable, "-m", "zerooffload", "train", "--model", model, "--steps", str(steps), *layout],
                   tmp_path, timeout=1800, model=model)
    losses = summary["losses"]
    if model == "350m":
        assert losses[0] > losses[1] > losses[2], losses
    else:
        assert summary["last_loss_mean"] < 0.8 * summary["first_loss_mean"] and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_train_resumes_from_its_checkpoint_exactly(tmp_path):
    """10 steps straight == 5 steps with --save-every 5, then --resume to 10 (a fresh process); the
    resumed summary covers all 10 steps."""
    common = [sys.executable, "-m", "zerooffload", "train", "train.micro_batch_size=4", "scheduler.type=constant"]
    straight = _run([*common, "--steps", "10"], tmp_path / "a")
    _run([*common, "--steps", "5", "--save-every", "5"], tmp_path / "b")
    resumed = _run([*common, "--steps", "10", "--resume"], tmp_path / "b")
    assert resumed["steps"] == 10 and resumed["first_step"] == 5 and resumed["losses"] == straight["losses"]
    assert resumed["first_loss_mean"] == straight["first_loss_mean"]
    again = subprocess.run([*common, "--steps", "5", "--resume", "--out", str(tmp_path / "b" / "out")],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 0 and "nothing to train" in again.stdout, again.stderr[-2000:]


# ------------------------------------------------------------------------- stopping on SIGTERM / SIGINT
_TRAIN = [sys.executable, "-m", "zerooffload", "train", "train.micro_batch_size=4", "scheduler.type=constant"]
_STOP_LINE = re.compile(r"^zerooffload: stopped by (SIG\w+) after step (\d+); (.*)$", re.MULTILINE)


class _Started:
    """A training process whose stdout and stderr go to files, so a test can watch them while it runs."""

    def __init__(self, args: list[str], out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self._stdout, self._stderr = out, out.parent / "stdout", out.parent / "stderr"
        with open(self._stdout, "w") as stdout, open(self._stderr, "w") as stderr:
            self.process = subprocess.Popen([*args, "--out", str(out)], stdout=stdout, stderr=stderr,
                                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    def output(self) -> str:
        return self._stdout.read_text() + self._stderr.read_text()

    def wait_until(self, ready, timeout: float = 120) -> None:
        """Poll ``ready()`` until it holds; fail if the process ends first or the time runs out."""
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.process.poll() is None, f"ended early ({self.process.returncode}):\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, self.output()[-4000:]
            time.sleep(0.02)

    def stop_with(self, signum: int, pid: int | None = None, timeout: float = 120) -> tuple[int, str, int, str]:
        """Send ``signum`` (to ``pid``, default the process); return its status, output and stop line."""
        os.kill(self.process.pid if pid is None else pid, signum)
        returncode = self.process.wait(timeout=timeout)
        output = self.output()
        lines = _STOP_LINE.findall(output)
        assert len(lines) == 1, output[-4000:]
        name, step, kept = lines[0]
        assert name == signal.Signals(signum).name, output[-4000:]
        return returncode, output, int(step), kept


@pytest.fixture
def start():
    """``start(args, out)`` runs a ``_Started``; one still running when the test ends (it failed) gets
    SIGTERM, then SIGKILL, so no 1000-step run outlives its test (torchrun passes SIGTERM on)."""
    started: list[_Started] = []

    def start_one(args: list[str], out: Path) -> _Started:
        started.append(_Started(args, out))
        return started[-1]
    yield start_one
    for run in started:
        if run.process.poll() is None:
            run.process.terminate()
            try:
                run.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                run.process.kill()
                run.process.wait()


def test_sigterm_saves_the_steps_done_and_resume_matches_an_uninterrupted_run(tmp_path, start):
    """SIGTERM once a checkpoint exists: status 143, one line naming the checkpoint of the steps done
    (``latest``, CRCs verified), summary.json of those steps; ``--resume`` then gives the losses of an
    uninterrupted run (its 16 steps run alongside: a constant schedule does not depend on --steps)."""
    straight = start([*_TRAIN, "--steps", "16"], tmp_path / "a" / "out")
    run = start([*_TRAIN, "--steps", "1000", "--save-every", "1"], tmp_path / "b" / "out")
    checkpoints = run.out / "checkpoints"
    run.wait_until((checkpoints / "latest").exists)
    returncode, output, done, kept = run.stop_with(signal.SIGTERM)
    assert returncode == 143 and "Traceback" not in output and 1 <= done < 16, output[-4000:]
    manifest = read_manifest(checkpoints)
    assert kept == f"checkpoint saved to {manifest.directory}; resume with --resume"
    assert manifest.data["client_state"]["next_step"] == done
    assert straight.process.wait(timeout=120) == 0, straight.output()[-4000:]
    reference = json.loads((straight.out / "summary.json").read_text())["losses"]
    assert manifest.data["client_state"]["losses"] == reference[:done]
    assert json.loads((run.out / "summary.json").read_text())["losses"] == reference[:done]
    resumed = _run([*_TRAIN, "--steps", "16", "--resume"], tmp_path / "b")
    assert resumed["steps"] == 16 and resumed["first_step"] == done and resumed["losses"] == reference


@pytest.mark.slow  # CI keeps SIGTERM with a save and under torchrun
def test_sigint_without_save_every_stops_cleanly_with_130(tmp_path, start):
    """Ctrl-C after the first step: status 130, one line saying nothing was saved, no KeyboardInterrupt."""
    run = start([*_TRAIN, "--steps", "1000"], tmp_path / "out")
    run.wait_until(lambda: "loss=" in run.output())  # the progress bar's first step
    returncode, output, done, kept = run.stop_with(signal.SIGINT)
    assert returncode == 130 and "Traceback" not in output and "KeyboardInterrupt" not in output, output[-4000:]
    assert kept == "nothing saved (no --save-every)" and not (run.out / "checkpoints").exists()
    assert json.loads((run.out / "summary.json").read_text())["steps"] == done


def _worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker of ``rank``, read from /proc (None until it has started)."""
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            with contextlib.suppress(FileNotFoundError):
                if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    return int(pid)
    return None


def test_sigterm_to_one_rank_under_torchrun_stops_both_at_the_same_step(tmp_path, start):
    """Only rank 1 gets SIGTERM; the ranks agree on the step, save together (no deadlock) and stop. Also
    CI's run of ``train`` under torchrun: two ranks at stage 3 (the summary says so, its losses finite)."""
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun not on PATH")
    run = start([torchrun, "--standalone", "--nproc-per-node", "2", *_TRAIN[1:], "--steps", "1000",
                 "--save-every", "1", "zero.stage=3"], tmp_path / "out")
    checkpoints = run.out / "checkpoints"
    run.wait_until((checkpoints / "latest").exists)
    rank1 = _worker_pid(run.process.pid, rank=1)
    assert rank1 is not None, run.output()[-4000:]
    returncode, output, done, kept = run.stop_with(signal.SIGTERM, pid=rank1)
    assert returncode != 0 and re.search(r"exitcode\s*:\s*143", output), output[-4000:]  # torchrun's report
    manifest = read_manifest(checkpoints)
    assert kept == f"checkpoint saved to {manifest.directory}; resume with --resume"
    assert manifest.data["client_state"]["next_step"] == done and manifest.data["world_size"] == 2
    summary = json.loads((run.out / "summary.json").read_text())
    assert summary["steps"] == done and summary["world_size"] == 2 and summary["stage"] == 3
    assert len(summary["losses"]) == done and all(0 < loss < 6 for loss in summary["losses"])


# ------------------------------------------------------------------------------ resume, tags, progress
def _train_cli(args: list[str], out: Path) -> subprocess.CompletedProcess:
    return _completed([*_TRAIN, *args], out)


def _tags(checkpoints: Path) -> set[str]:
    return {p.name for p in checkpoints.iterdir() if p.is_dir()}


@pytest.mark.slow  # 20 s: six steps saved every two, then two resumes
def test_keep_last_prunes_old_step_tags_and_resume_falls_back_past_a_corrupt_latest(tmp_path):
    """--keep-last 2 keeps the newest two step tags and a user's own directory; a corrupt ``latest``
    makes --resume fall back, saying so, to the newest tag that verifies; --tag picks an older one and
    the tag ``latest`` then names survives pruning though newer ones exist. Every resumed summary
    holds the losses of steps 0..N of the uninterrupted run."""
    out = tmp_path / "out"
    checkpoints = out / "checkpoints"
    first = _train_cli(["--steps", "6", "--save-every", "2", "--keep-last", "2"], out)
    reference = json.loads((out / "summary.json").read_text())["losses"]
    assert _tags(checkpoints) == {"step00000004", "step00000006"}, first.stderr[-2000:]
    (checkpoints / "mine").mkdir()
    (checkpoints / "mine" / "notes.txt").write_text("a user's own directory")

    with open(checkpoints / "step00000006" / "manifest.json", "ab") as manifest:
        manifest.write(b" ")
    fell_back = _train_cli(["--steps", "6", "--save-every", "2", "--keep-last", "2", "--resume"], out)
    warnings = [line for line in fell_back.stderr.splitlines() if line.startswith("zerooffload: warning:")]
    assert len(warnings) == 1 and "manifest is corrupt" in warnings[0], fell_back.stderr[-2000:]
    assert warnings[0].endswith("resuming from step00000004, the newest step tag that verifies")
    assert "resumed from step 4 (tag step00000004)" in fell_back.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["first_step"] == 4 and summary["losses"] == reference

    older = _train_cli(["--steps", "5", "--save-every", "5", "--keep-last", "1", "--resume", "--tag", "step00000004"],
                       out)
    assert "resumed from step 4 (tag step00000004)" in older.stdout
    assert (checkpoints / "latest").read_text().strip() == "step00000005"
    assert _tags(checkpoints) == {"step00000005", "step00000006", "mine"}  # newest 1, latest's, the user's
    assert (checkpoints / "mine" / "notes.txt").exists()
    assert json.loads((out / "summary.json").read_text())["losses"] == reference[:5]


@pytest.mark.slow
def test_fp16_run_with_every_step_skipped_says_so_and_progress_is_plain_lines(tmp_path):
    """Off a terminal the progress is one plain line a step here (fewer than 20 steps), with the skipped
    count; a run whose every step overflowed ends with one warning naming the setting to lower."""
    run = _train_cli(["--steps", "2", "train.precision=fp16", "train.initial_scale_power=64"], tmp_path / "out")
    lines = _PROGRESS_LINE.findall(run.stderr)
    assert lines == [("1", "2"), ("2", "2")] and "\r" not in run.stderr, run.stderr[-2000:]
    assert re.search(r"^step 2/2 .* skipped=2$", run.stderr, re.MULTILINE), run.stderr[-2000:]
    assert run.stderr.splitlines()[-1] == ("zerooffload: warning: all 2 steps were skipped (fp16 overflow): lower "
                                           "train.initial_scale_power (now 64), or use train.precision=bf16")
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["skipped_steps"] == 2

