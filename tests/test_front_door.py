"""The front door: README opens with the command CI runs; the CLI's exit codes. (Every config key and
command is documented in docs/: tests/test_docs.py.)"""
from __future__ import annotations

import ctypes
import errno
import importlib.util
import mmap
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_helpers import run_in_process

ROOT = Path(__file__).resolve().parents[1]


def test_readme_opens_with_the_commands_ci_runs():
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    assert "zerooffload" in blocks[0] and "pip install torch==2.13.0" in blocks[0]
    ci_lines = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert blocks[1] == ci_lines[-1], "CI must run README's test command exactly"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerooffload", *args], capture_output=True, text=True, timeout=120)


def _o_direct_works(directory: Path) -> bool:
    """Whether ``directory``'s filesystem takes an aligned 4 KiB O_DIRECT write and read, tried here by
    hand (tmpfs before Linux 6.6 refuses the open with EINVAL); the file is removed."""
    path = directory / "o_direct_probe"
    block, back = mmap.mmap(-1, 4096), mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
    block.write(b"z" * 4096)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        assert exc.errno == errno.EINVAL, exc  # anything else: the directory is unusable, not this test's case
        return False
    try:
        return os.pwritev(fd, [block], 0) == 4096 and os.preadv(fd, [back], 0) == 4096 and back[:] == block[:]
    finally:
        os.close(fd)
        path.unlink()


def _io_uring_works() -> bool:
    """Whether this kernel sets up an io_uring (the raw io_uring_setup system call, as the kernel offers
    it, seccomp and kernel.io_uring_disabled included) and is new enough for IORING_OP_READ/WRITE (5.6)."""
    number = {"x86_64": 425, "aarch64": 425}.get(platform.machine())
    if number is None:
        pytest.skip(f"no io_uring_setup number known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    fd = libc.syscall(ctypes.c_long(number), ctypes.c_uint(2), params)
    if fd < 0:
        return False
    os.close(fd)
    release = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    return release >= (5, 6)


def test_doctor_passes_on_a_usable_swap_path(tmp_path):
    """Each line says what this machine really has, as probed here independently of the package: O_DIRECT
    under the swap path, io_uring (ok only with the native extension, which the uring backend needs)."""
    direct = _o_direct_works(tmp_path)
    uring = _io_uring_works() and importlib.util.find_spec("zerooffload._aio") is not None
    run = run_in_process("doctor", f"nvme.path={tmp_path}")
    assert run.returncode == (0 if direct else 1), run.stdout + run.stderr
    swap = re.escape(f"swap path {tmp_path}")
    if direct:
        status = "ok" if shutil.disk_usage(tmp_path).free >= 1 << 30 else "warn"  # doctor warns under 1 GiB free
        assert re.search(rf"^\s*{status}\s+{swap}\s+O_DIRECT write\+read works", run.stdout, re.M), run.stdout
    else:
        assert re.search(rf"^\s*FAIL\s+{swap}\s+cannot open .* with O_DIRECT", run.stdout, re.M), run.stdout
    assert re.search(rf"^\s*{'ok' if uring else 'warn'}\s+io_uring\s", run.stdout, re.M), run.stdout
    assert re.search(rf"^\s*ok\s+torch\s+{re.escape(torch.__version__)}, distributed backends: .*gloo", run.stdout,
                     re.M), run.stdout
    assert list(tmp_path.iterdir()) == []  # the probe file is removed


def test_doctor_fails_with_a_line_per_problem(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    run = run_in_process("doctor", f"nvme.path=['{blocker}', '{blocker}/swap']")
    assert run.returncode == 1
    assert re.search(rf"FAIL\s+swap path {blocker}\s+is not a directory: set nvme.path to a directory", run.stdout)
    assert re.search(rf"FAIL\s+swap path {blocker}/swap\s+does not exist: .* or set nvme.path", run.stdout)


def test_config_errors_exit_2_naming_the_key(tmp_path):
    config = tmp_path / "train.toml"
    config.write_text("[zero]\nstgae = 3\n")
    run = run_in_process("doctor", "--config", str(config))
    assert run.returncode == 2
    assert "unknown key 'zero.stgae'; did you mean 'zero.stage'?" in run.stderr


def test_readme_cites_only_files_in_the_repository():
    readme = (ROOT / "README.md").read_text()
    assert "DESIGN" not in readme and "../" not in readme
    cited = set(re.findall(r"(?<![\w/.-])((?:zerooffload|tests|bench|native|examples|\.ci)/[\w./-]*\w)", readme))
    assert cited and not [path for path in cited if not (ROOT / path).exists()]


def test_help_says_what_the_tool_does_and_lists_the_commands():
    run = _cli("--help")
    assert run.returncode == 0 and "Train PyTorch models whose parameters, gradients and optimizer" in run.stdout
    for command in ("train", "checkpoint", "doctor", "estimate", "bench", "tune", "--debug", "Exit status"):
        assert command in run.stdout


def test_estimate_takes_suffixed_parameter_counts():
    from zerooffload.cli.estimate import parse_count

    assert [parse_count(t) for t in ("1.5B", "350M", "2K", "1T", "7.5e9")] == [1.5e9, 3.5e8, 2e3, 1e12, 7.5e9]
    suffixed = run_in_process("estimate", "--params", "1.5B", "--dp", "8")
    assert suffixed.returncode == 0 and "1.5e+09 parameters over 8" in suffixed.stdout


def test_the_deepspeed_side_of_bench_adam_is_where_the_command_looks():
    from zerooffload.cli import bench_adam
    assert bench_adam.DS_SIDE.is_file(), bench_adam.DS_SIDE
