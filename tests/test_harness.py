"""The rank pool itself: real spawned gloo ranks, a real collective, real failures."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankFailure


def _all_reduce_rank_plus_one() -> tuple[int, int, float]:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), torch.get_num_threads(), value.item()


def _fail_on_rank(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.all_reduce(torch.ones(1))  # the others block here: the harness must not wait for them


def _die_on_rank(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        os._exit(3)
    dist.barrier()


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_four_rank_all_reduce(rank_pools):
    results = rank_pools(4).run(_all_reduce_rank_plus_one)
    assert results == [(r, 1, 1.0 + 2 + 3 + 4) for r in range(4)]


def test_failing_rank_reaches_pytest_without_hang(rank_pools):
    pool = rank_pools(4)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        pool.run(_fail_on_rank, 2)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "ValueError: deliberate failure on rank 2" in message
    assert 'in _fail_on_rank' in message and "--- rank 2: FAILED" in message
    assert pool.run(_all_reduce_rank_plus_one)[3][2] == 10.0  # the pool respawned and works again


def test_dead_rank_is_reported(rank_pools):
    with pytest.raises(RankFailure, match="rank 1 died with exit code 3"):
        rank_pools(2).run(_die_on_rank, 1)


def test_task_timeout_is_reported(rank_pools):
    start = time.monotonic()
    with pytest.raises(RankFailure, match="no result"):
        rank_pools(2).run(_sleep, 60, timeout=1)
    assert time.monotonic() - start < 15
