"""Helpers shared by the I/O tests: the backends to run over, configs, buffers at chosen alignments."""
from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from zerooffload.config import AioConfig
from zerooffload.io import aligned_empty
from zerooffload.io.backends import BACKENDS

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """RLIMIT_FSIZE at ``nbytes`` for the block, SIGXFSZ ignored, so that writes past it fail with EFBIG: a real
    I/O fault in the middle of a run (the kernel's, not a mock's)."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
BACKEND_NAMES = ("uring", "pool", "python", "aiofiles")


def backend_params() -> list:
    """One pytest param per backend, skipped (with the reason) where it cannot run."""
    params = []
    for name in BACKEND_NAMES:
        reason = BACKENDS[name].unavailable_reason()
        params.append(pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=str(reason))))
    return params


def config(backend: str, **fields) -> AioConfig:
    """Small pieces by default, so that modest transfers still split into many pieces and chunks."""
    fields = {"block_size": 65536, "queue_depth": 8, "threads": 4} | fields
    return AioConfig(backend=backend, **fields)


def host_buffer(data: bytes | int, shift: int) -> torch.Tensor:
    """A uint8 tensor ``shift`` bytes past a page boundary, holding ``data`` (or zeros of that length)."""
    nbytes = data if isinstance(data, int) else len(data)
    buffer = aligned_empty(nbytes + shift)[shift:]
    if isinstance(data, int):
        buffer.zero_()
    else:
        buffer.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return buffer


def run_python(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter that imports this checkout of zerooffload and these helpers.
    A child still running after ``timeout`` seconds is sent SIGABRT, on which faulthandler prints every
    thread's Python stack, and the test fails with those stacks: a hang says where it hung."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), PYTHONFAULTHANDLER="1")
    with subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env, cwd=REPO) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGABRT)
            try:
                stdout, stderr = child.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # not even the signal ends it (a task stuck in the kernel)
                child.kill()
                stdout, stderr = child.communicate()
            pytest.fail(f"the child script ran past {timeout} s; its stacks then (stderr):\n{stderr[-6000:]}\n"
                        f"its stdout:\n{stdout[-2000:]}", pytrace=False)
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
