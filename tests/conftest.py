"""Shared fixtures: ``rank_pools(n)`` hands out one reused pool of n gloo ranks per session."""
from __future__ import annotations

import pytest

from harness import RankPool


@pytest.fixture(scope="session")
def rank_pools():
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
