"""The CLI's user errors, each from a real ``python -m zerooffload`` run: exactly one line on stderr,
``zerooffload: <what>: <fix>``, no traceback, exit status 2 for a usage or config error, 1 for a
problem met while running, 130 for Ctrl-C; ``--debug`` or ZEROOFFLOAD_DEBUG=1 add the traceback."""
from __future__ import annotations

import errno
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

from cli_helpers import finished_run, in_a_tmpfs, run_in_process

_TRAIN = ["train", "train.micro_batch_size=4", "scheduler.type=constant"]
_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerooffload", *args], capture_output=True, text=True, timeout=300,
                          env=env or _ENV)


def _one_line(run: subprocess.CompletedProcess, status: int) -> str:
    """The single stderr line of a run that failed with ``status``."""
    lines = run.stderr.splitlines()
    assert run.returncode == status and len(lines) == 1, (run.returncode, run.stderr[-4000:])
    assert lines[0].startswith("zerooffload: ") and "Traceback" not in run.stderr
    return lines[0]


# ------------------------------------------------------------------------------------- usage: exit 2
@pytest.mark.parametrize("args, line", [
    (["train", "--steps", "-5"],
     "argument --steps: '-5': expected a whole number of steps >= 1: see 'zerooffload train --help'"),
    (["train", "--save-every", "-1"],
     "argument --save-every: '-1': expected a whole number >= 0 (0: no checkpoints): see 'zerooffload train --help'"),
    (["--log-level", "loud", "doctor"],
     "argument --log-level: invalid choice: 'LOUD' (choose from 'DEBUG', 'INFO', 'WARNING', 'ERROR'): "
     "see 'zerooffload --help'"),
    (["estimate", "--params", "1.5X", "--dp", "8"],
     "argument --params: '1.5X' is not a positive parameter count: write it like 7.5e9, 1.5B, 350M or 2K: "
     "see 'zerooffload estimate --help'"),
    (["train", "--tag", "step00000002"],
     "--tag NAME needs --resume (it names the checkpoint to continue from): see 'zerooffload train --help'"),
    (["train", "--steps", "2", "--bogus"], "unrecognized arguments: --bogus: see 'zerooffload --help'"),
    (["tune", "io", "--budget", "0"], "argument --budget: '0': expected seconds, at least 1: see 'zerooffload tune io "
                                      "--help'"),
], ids=["negative-steps", "negative-save-every", "log-level", "params", "tag-without-resume", "unknown-flag",
        "tune-budget"])
def test_usage_errors_are_one_line_with_status_2(args, line):
    assert _one_line(_cli(*args), 2) == f"zerooffload: {line}"


def test_a_usage_error_is_answered_before_torch_is_imported():
    """A mistyped flag is said at once, not after the seconds torch takes to import."""
    code = ("import sys\nfrom zerooffload.cli.main import main\ntry:\n    main(['train', '--steps', '-5'])\n"
            "except SystemExit as stop:\n    print(stop.code, 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_ENV)
    assert run.stdout.split() == ["2", "False"], run.stdout + run.stderr


def test_output_read_by_a_reader_that_leaves_ends_quietly():
    """``zerooffload estimate ... | head``: the reader closes the pipe before the command writes, which
    then stops as a command killed by SIGPIPE does (status 141), printing nothing: no error line."""
    read, write = os.pipe()
    os.close(read)
    child = subprocess.run([sys.executable, "-m", "zerooffload", "estimate", "--params", "7.5e9", "--dp", "64"],
                           stdout=write, stderr=subprocess.PIPE, text=True, timeout=60, env=_ENV)
    os.close(write)
    assert (child.returncode, child.stderr) == (128 + signal.SIGPIPE, "")


def test_a_toml_syntax_error_names_the_file_and_line(tmp_path):
    config = tmp_path / "train.toml"
    config.write_text("[zero]\nstage = = 3\n")
    line = _one_line(run_in_process(*_TRAIN, "--config", str(config)), 2)
    assert line.startswith(f"zerooffload: config error: config file {config} ") and "line 2" in line


def test_a_bad_override_value_is_a_config_error():
    line = _one_line(run_in_process(*_TRAIN, "zero.stage=5"), 2)
    assert line.startswith("zerooffload: config error: zero.stage = 5: must be <= 3")


# ------------------------------------------------------------------------------ checkpoints: exit 1
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The --out of a 2-step run saved at step 2 (tag step00000002); tests copy it before changing it."""
    return finished_run(tmp_path_factory, "saved", *_TRAIN, "--steps", "2", "--save-every", "2")


def _corrupt_copy(saved: Path, tmp_path: Path, name: str) -> Path:
    """A copy of ``saved`` with one byte of checkpoint file ``name`` flipped."""
    out = tmp_path / "out"
    shutil.copytree(saved, out)
    path = out / "checkpoints" / "step00000002" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)
    return out


@pytest.mark.slow
def test_resume_without_checkpoints(tmp_path):
    out = tmp_path / "fresh"
    assert _one_line(_cli(*_TRAIN, "--resume", "--out", str(out)), 1) == (
        f"zerooffload: checkpoint error: {out}/checkpoints does not exist, so there is nothing to resume from; "
        "start without --resume, or pass the --out of the run to continue")


def test_resume_from_a_missing_tag(saved):
    checkpoints = saved / "checkpoints"
    assert _one_line(run_in_process(*_TRAIN, "--resume", "--tag", "nope", "--out", str(saved)), 1) == (
        f"zerooffload: checkpoint error: {checkpoints}/nope: no manifest.json: not a complete checkpoint (a save that "
        "did not finish leaves only a .partial directory); resume from another tag with --tag NAME, or start again "
        "without --resume")


def test_resume_when_no_tag_verifies(saved, tmp_path):
    out = _corrupt_copy(saved, tmp_path, "manifest.json")
    line = _one_line(run_in_process(*_TRAIN, "--resume", "--out", str(out)), 1)
    assert line.startswith(f"zerooffload: checkpoint error: {out}/checkpoints/step00000002/manifest.json: SHA-256 ")
    assert line.endswith(f"the manifest is corrupt; no stepNNNNNNNN tag in {out}/checkpoints verifies either: start "
                         "without --resume")


@pytest.mark.slow
def test_consolidate_a_corrupt_checkpoint_shows_the_traceback_with_debug_only(saved, tmp_path):
    out = _corrupt_copy(saved, tmp_path, "rank00000.bin")
    args = ["checkpoint", "consolidate", str(out / "checkpoints"), str(tmp_path / "model.safetensors")]
    line = _one_line(_cli(*args), 1)
    assert re.fullmatch(rf"zerooffload: checkpoint error: {out}/checkpoints/step00000002/rank00000\.bin: CRC32C "
                        r"0x[0-9a-f]+ but the manifest says 0x[0-9a-f]+: the file is corrupt; consolidate another "
                        r"tag with --tag NAME", line)
    for debug in (_cli("--debug", *args), _cli(*args, env={**_ENV, "ZEROOFFLOAD_DEBUG": "1"})):
        assert debug.returncode == 1 and debug.stderr.startswith("Traceback (most recent call last):")
        assert "zerooffload.errors.CheckpointError" in debug.stderr, debug.stderr[-4000:]
        assert debug.stderr.splitlines()[-1] == line


@pytest.mark.slow
def test_a_failed_rank_and_its_peer_each_print_one_line_under_torchrun(saved, tmp_path):
    """Every rank finds the flipped byte; the rank that ends the engine's group first reports the
    CheckpointError, the other (EngineGroupEnded) names that rank. torchrun may SIGTERM the second rank
    once the first has exited, so its line may be missing, never torn or a traceback."""
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun not on PATH")
    out = _corrupt_copy(saved, tmp_path, "rank00000.bin")
    run = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "zerooffload", *_TRAIN, "--steps",
                          "4", "--resume", "--tag", "step00000002", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env=_ENV)
    assert run.returncode != 0
    lines = re.findall(r"^zerooffload: rank (\d): (.*)$", run.stderr, re.MULTILINE)
    kinds = {rank: "group" if text.startswith("stopped because rank ") else "own" for rank, text in lines}
    assert 1 <= len(lines) == len(kinds) and "own" in kinds.values(), run.stderr[-4000:]
    for _, text in lines:
        assert re.fullmatch(r"(checkpoint error: |stopped because rank \d: CheckpointError: ).*rank00000\.bin: CRC32C "
                            r".*the file is corrupt; (resume from another tag with --tag NAME, or start again "
                            r"without --resume|fix that rank's error \(its own line\) and run again)", text), text
    assert not re.search(r'File ".*/zerooffload/', run.stderr)  # torchrun's own traceback aside


# ------------------------------------------------------------------------- paths and space: exit 1
@pytest.mark.slow
def test_a_swap_path_under_a_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    line = _one_line(_cli(*_TRAIN, "--out", str(tmp_path / "out"), "offload.optimizer.tier=nvme",
                          f"nvme.path={blocker}/swap"), 1)
    assert line.startswith("zerooffload: ") and f"{blocker}/swap" in line and "nvme.path" in line


@pytest.mark.slow  # the CI suite keeps the other start-up refusals (6 min budget)
def test_an_out_directory_that_cannot_be_made_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert _one_line(_cli(*_TRAIN, "--out", f"{blocker}/out"), 1) == (
        f"zerooffload: --out {blocker}/out cannot be written (Not a directory); pass a directory you can write to")


@pytest.mark.slow
def test_a_read_only_swap_path(tmp_path):
    point = tmp_path / "ro"
    run = in_a_tmpfs("ro,size=1m", point, *_TRAIN, "--out", str(tmp_path / "out"), "offload.optimizer.tier=nvme",
                      f"nvme.path={point}")
    line = _one_line(run, 1)
    assert str(point) in line and os.strerror(errno.EROFS) in line and "nvme.path" in line


def test_no_room_for_the_swap_files(tmp_path):
    point = tmp_path / "small"
    run = in_a_tmpfs("size=64k", point, *_TRAIN, "--out", str(tmp_path / "out"), "offload.optimizer.tier=nvme",
                      f"nvme.path={point}")
    line = _one_line(run, 1)
    assert re.fullmatch(rf"zerooffload: swap store of \d+ bytes .* does not fit: {point}/zerooffload-swap needs .* "
                        r"free\. Free space, add directories to nvme\.path, or keep more state in RAM", line)


def test_a_failed_swap_write_names_its_file_and_offsets(tmp_path):
    """An ``AioError`` met while training (a write refused by the kernel: the process's file-size limit,
    lowered with prlimit once the swap file is claimed) prints the write's file, offset and length."""
    swap = tmp_path / "swap"
    swap.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "zerooffload", *_TRAIN, "--steps", "400", "--out",
                                str(tmp_path / "out"), "zero.stage=3", "offload.param.tier=nvme",
                                "offload.optimizer.tier=nvme", f"nvme.path={swap}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_ENV)
    deadline = time.monotonic() + 120
    while not list(swap.glob("zerooffload-swap/*.swap")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    subprocess.run(["prlimit", "--pid", str(process.pid), "--fsize=1048576"], check=True)
    _, stderr = process.communicate(timeout=300)
    run = subprocess.CompletedProcess(process.args, process.returncode, "", stderr)
    line = _one_line(run, 1)
    assert re.fullmatch(rf"zerooffload: write of (\d+) bytes at offset (\d+) in {swap}/zerooffload-swap/\S+\.swap "
                        rf"failed at offset (\d+): \[Errno {errno.EFBIG}\] {os.strerror(errno.EFBIG)}; raise this "
                        r"process's file-size limit \(ulimit -f\) or the filesystem's", line), line
    length, offset, failed = map(int, re.fullmatch(r".*write of (\d+) bytes at offset (\d+) .* at offset (\d+):.*",
                                                   line).groups())
    assert offset <= failed < offset + length and failed >= 1048576  # the kernel refuses bytes past the limit only


# ----------------------------------------------------------------------- Ctrl-C, warnings: 130 and 0
@pytest.mark.slow
def test_ctrl_c_before_training_is_one_line_and_130(tmp_path):
    """SIGINT while train reads its config (a FIFO nobody writes to yet: the read blocks inside the
    command, after Python started, before training's own handlers)."""
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    process = subprocess.Popen([sys.executable, "-m", "zerooffload", "train", "--config", str(fifo), "--out",
                                str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=_ENV)
    deadline = time.monotonic() + 120
    while True:  # a writer's non-blocking open fails with ENXIO until the command opens the FIFO to read
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            assert exc.errno == errno.ENXIO and process.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
    try:
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        os.close(writer)
    run = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert _one_line(run, 130) == "zerooffload: interrupted (Ctrl-C); nothing was saved by this command"


def test_a_deepspeed_config_warning_is_one_clean_line(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": False,
                                  "zero_optimization": {"stage": 2, "contiguous_gradients": True}}))
    run = _cli("doctor", "--config", str(config), f"nvme.path={tmp_path}")
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerooffload: warning: DeepSpeed config keys "), run.stderr
    assert "wall_clock_breakdown" in lines[0] and "DeepSpeedConfigWarning" not in run.stderr
