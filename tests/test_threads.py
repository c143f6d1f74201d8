"""torch's threads: ``train.threads`` sets their count, and OpenMP's waiting is left as the user set it
(threads' [Note: spinning under contention])."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from reference import make_model


def _fresh(code: str, **env: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                          env={**os.environ, **env}).stdout.strip()


def test_a_users_openmp_setting_is_kept():
    code = "import os, zerooffload.threads as t; import zerooffload; print(os.environ['GOMP_SPINCOUNT'], '|', t.openmp_wait())"
    assert _fresh(code, GOMP_SPINCOUNT="77") == "77 | yours: GOMP_SPINCOUNT=77"


def test_nothing_changes_when_torch_loaded_first():
    code = ("import os; os.environ.pop('GOMP_SPINCOUNT', None); import torch, zerooffload, zerooffload.threads as t; "
            "print('GOMP_SPINCOUNT' in os.environ, '|', t.openmp_wait())")
    assert _fresh(code) == "False | as torch was loaded with (it was imported before zerooffload)"


def test_train_threads_sets_torchs_thread_count(make_engine):
    before = torch.get_num_threads()
    try:
        make_engine(make_model(), {"train": {"threads": 1}})
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
