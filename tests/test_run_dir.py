"""``zerooffload train``'s ``--out``: owned by one run, never taken over by a fresh one, checked before the
model is built (run_dir's [Note: owning --out]); and the ways a run stops rather than lose or spoil its
checkpoints: a skip streak, a damaged swap file, a full disk (run_checkpoints' [Note: pruning]). Each
through the command a user runs, asserting its one line."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from aio_helpers import run_python
from cli_helpers import finished_run, in_a_tmpfs, run_in_process

_TRAIN = ["train", "train.micro_batch_size=4", "scheduler.type=constant"]
_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _one_line(run: subprocess.CompletedProcess, status: int) -> str:
    """The single ``zerooffload:`` line on stderr of a run that failed with ``status``."""
    lines = [line for line in run.stderr.splitlines() if line.startswith("zerooffload: ")]
    assert run.returncode == status and len(lines) == 1, (run.returncode, run.stderr[-4000:])
    assert "Traceback" not in run.stderr, run.stderr[-4000:]
    return lines[0]


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def old_run(tmp_path_factory) -> Path:
    """The --out of a finished 2-step run, saved at steps 1 and 2."""
    return finished_run(tmp_path_factory, "old", *_TRAIN, "--steps", "2", "--save-every", "1")


def test_a_fresh_run_into_an_old_out_is_refused_and_changes_nothing(old_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(old_run, out)
    before = _tree(out)
    assert _one_line(run_in_process(*_TRAIN, "--steps", "3", "--out", str(out)), 1) == (
        f"zerooffload: --out {out} holds the checkpoints of an earlier run (newest: step00000002); continue it with "
        "--resume, or pass --overwrite to remove them and start afresh, or pass another --out")
    assert _tree(out) == before
    run = run_in_process(*_TRAIN, "--steps", "1", "--save-every", "1", "--overwrite", "--out", str(out))
    assert run.returncode == 0 and f"--overwrite: removed the earlier run's checkpoints in {out}/checkpoints" in run.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step00000001"]
    assert _one_line(run_in_process(*_TRAIN, "--resume", "--overwrite", "--out", str(out)), 2) == (
        "zerooffload: config error: --overwrite starts afresh and --resume continues: pass one of them")


def test_a_second_run_on_an_out_in_use_is_refused_and_a_killed_holder_resumes(tmp_path):
    """A run holds --out; a second is refused at once naming its PID; SIGKILL frees it for --resume."""
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-m", "zerooffload", *_TRAIN, "--steps", "100000", "--save-every", "1",
                               "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_ENV)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "latest").exists():
            assert holder.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        started = time.monotonic()
        line = _one_line(run_in_process(*_TRAIN, "--steps", "1", "--resume", "--out", str(out)), 1)
        assert time.monotonic() - started < 10
        assert re.fullmatch(rf"zerooffload: --out {out} is in use by another zerooffload train \(pid {holder.pid} on "
                            r"\S+\); wait for it to finish, or pass another --out", line), line
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    saved = int((out / "checkpoints" / "latest").read_text().strip()[4:])
    run = run_in_process(*_TRAIN, "--steps", str(saved + 1), "--resume", "--out", str(out))
    assert run.returncode == 0 and f"resumed from step {saved}" in run.stdout, run.stderr[-4000:]


_AS_NOBODY = """
import os, sys, time
from zerooffload.cli.main import main
import zerooffload.cli.train  # imported as root: nobody may not read root's Python
os.setgid(65534)
os.setuid(65534)
started = time.monotonic()
status = main(sys.argv[1:])
print(f"seconds {time.monotonic() - started:.1f} status {status}")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to drop to nobody (a non-root user may own the dirs)")
def test_a_read_only_out_is_refused_in_seconds_before_the_model_is_built():
    """An existing --out nobody may write (root may, so the run drops to nobody): refused in one line
    before the model is built, not at summary.json after the run."""
    top = Path(tempfile.mkdtemp(prefix="zo-ro-"))
    try:
        os.chmod(top, 0o755)
        out = top / "out"
        out.mkdir(mode=0o755)
        run = run_python(_AS_NOBODY, *_TRAIN, "--model", "small", "--steps", "5", "--out", str(out))
        assert _one_line(run, 0) == (f"zerooffload: --out {out} cannot be written (Permission denied); pass a "
                                     "directory you can write to")
        seconds = float(re.search(r"seconds (\S+) status 1", run.stdout).group(1))
        assert seconds < 5, seconds
    finally:
        shutil.rmtree(top)


def test_an_unwritable_trace_is_refused_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    started = time.monotonic()
    assert _one_line(run_in_process(*_TRAIN, "--steps", "5", "--trace", f"{blocker}/trace.json",
                                    "--out", str(tmp_path / "out")), 1) == (
        f"zerooffload: --trace {blocker}/trace.json cannot be written (Not a directory); pass a path you can write to")
    assert time.monotonic() - started < 5


def test_a_skip_streak_stops_in_one_line_and_its_checkpoint_is_never_pruned(tmp_path):
    """A learning rate of 1e6 sends the gradients to inf after two updates: every later window skips,
    the eighth in a row stops the run naming step 2's checkpoint, which --keep-last 2 kept."""
    out = tmp_path / "out"
    run = run_in_process(*_TRAIN, "--steps", "30", "--save-every", "1", "--keep-last", "2", "optimizer.lr=1e6",
                         "--out", str(out))
    line = _one_line(run, 1)
    match = re.fullmatch(r"zerooffload: stopped: 8 optimizer steps in a row were skipped for non-finite values \(the "
                         r"last, step (\d+): non-finite gradient norm; train.max_skip_streak = 8\): .* the model is as it "
                         rf"was after step (\d+); the last checkpoint saved before the first skip: {out}/checkpoints/"
                         r"step(\d{8})\. Lower optimizer.lr or check the data, then resume from that checkpoint", line)
    assert match, line
    last, updated, good = map(int, match.groups())
    assert good == updated == last - 8
    tags = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step"))
    assert tags == [f"step{good:08d}", f"step{last - 2:08d}", f"step{last - 1:08d}"]


def test_a_resume_says_what_it_changes_of_the_run(old_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(old_run, out)
    run = run_in_process(*_TRAIN[:1], "train.micro_batch_size=2", "scheduler.type=constant", "--steps", "3",
                         "--resume", "--out", str(out))
    assert run.returncode == 0, run.stderr[-4000:]
    warnings = [line for line in run.stderr.splitlines() if line.startswith("zerooffload: warning:")]
    assert warnings == [
        "zerooffload: warning: the run saved a global batch of 4 sequences per step and continues with 2 (world size "
        "x train.micro_batch_size x train.grad_accum_steps): the steps after the resume are not those of the run it "
        "continues",
        "zerooffload: warning: the run was started with --steps 2 and continues with --steps 3: a decaying "
        "learning-rate schedule now spans the new count, so it differs from here on"]


def test_a_damaged_swap_file_stops_the_run_in_one_line(tmp_path):
    """A swap file truncated under a running stage-3 NVMe job: the run stops within a step with the
    block, the file and the offset: a read past the new end is short; once a write has grown the file
    again, a read of the hole before it comes back zeros, which the checksum (on by default) finds."""
    out, swap = tmp_path / "out", tmp_path / "swap"
    swap.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "zerooffload", *_TRAIN, "--steps", "100000", "--out", str(out),
                                "zero.stage=3", "offload.param.tier=nvme", "offload.optimizer.tier=nvme",
                                f"nvme.path={swap}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_ENV)
    try:
        deadline = time.monotonic() + 120
        while not list(swap.glob("zerooffload-swap/*.swap")):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(2)  # into training
        (path,) = swap.glob("zerooffload-swap/*.swap")
        os.truncate(path, 0)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    line = _one_line(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), 1)
    assert re.fullmatch(rf"zerooffload: swap block '(param|optimizer)\.\d+' is damaged: (the swap file ends at byte "
                        r"\d+, before the block's end \(truncated\)|its checksum differs from the one taken when it "
                        rf"was written( \(segment \d of \d\))?) \(\d+ bytes at offset \d+ of {path}\); something "
                        r"other than this run changed the swap file .*: keep other writers out of nvme.path and "
                        r"resume from the last checkpoint",
                        line), line


def test_a_full_disk_removes_old_tags_before_the_save(tmp_path):
    """Checkpoints of ~10 MB on a 32 MiB disk with --keep-last 3: the third save would fail, since the
    prune comes after a save; the oldest tag goes first instead, said in one line, and every save lands."""
    point = tmp_path / "disk"
    run = in_a_tmpfs("size=32m", point, *_TRAIN, "--steps", "5", "--save-every", "1", "--keep-last", "3",
                     "--out", str(point / "out"))
    assert run.returncode == 0, run.stderr[-4000:]
    warnings = re.findall(rf"^zerooffload: warning: {point}/out/checkpoints had less free space than a checkpoint "
                          r"takes \([\d,]+ bytes\): removed (step\d+) before saving \(--keep-last 3\); kept (step\d+)$",
                          run.stderr, re.MULTILINE)
    assert warnings == [("step00000001", "step00000003"), ("step00000002", "step00000004")], run.stderr[-3000:]
