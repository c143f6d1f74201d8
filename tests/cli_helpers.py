"""The ``zerooffload`` command run in this process, for tests of what it answers to bad input.

``main`` is what ``python -m zerooffload`` calls, so its exit status, stdout and stderr are the
command's; a fresh interpreter would add only its ~3 s import of torch, paid by every such test. The
tests that need a process of their own (signals, a dropped privilege, a missing extension, a warning
printed once per process) still start one.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerooffload.cli.main import main


def run_in_process(*args: str) -> subprocess.CompletedProcess:
    """``zerooffload ARGS`` as a finished process: its status and what it printed. The ``zerooffload``
    logger is put back afterwards (its handler would keep this call's captured stderr)."""
    logger = logging.getLogger("zerooffload")
    handlers, level = list(logger.handlers), logger.level
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                status = main(list(args))
            except SystemExit as exit:
                status = exit.code if isinstance(exit.code, int) else 1
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
    return subprocess.CompletedProcess(["zerooffload", *args], status, stdout.getvalue(), stderr.getvalue())


def in_a_tmpfs(options: str, point: Path, *args: str) -> subprocess.CompletedProcess:
    """``zerooffload ARGS`` in a private mount namespace with a tmpfs (``options``) at ``point``;
    skipped where this process may not make one (CI runs as root, which may)."""
    point.mkdir()
    command = f'mount -t tmpfs -o {options} tmpfs "$1" && shift && exec "$@"'
    run = subprocess.run(["unshare", "-m", "sh", "-c", command, "sh", str(point), sys.executable, "-m",
                          "zerooffload", *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if "mount:" in run.stderr or "unshare:" in run.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {run.stderr.strip()}")
    return run


def finished_run(tmp_path_factory, name: str, *args: str) -> Path:
    """The ``--out`` of a finished ``zerooffload ARGS`` run in a fresh directory named ``name``."""
    out = tmp_path_factory.mktemp(name) / "out"
    run = run_in_process(*args, "--out", str(out))
    assert run.returncode == 0, run.stderr[-4000:]
    return out
