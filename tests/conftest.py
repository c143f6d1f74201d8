"""Shared fixtures: ``rank_pools(n)`` hands out one reused pool of n gloo ranks per session;
``engines(name)`` one AsyncIO per backend name per test module."""
from __future__ import annotations

import pytest

from aio_helpers import config
from harness import RankPool
from zerooffload.io import AsyncIO


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


@pytest.fixture(scope="module")
def engines():
    made: dict[str, AsyncIO] = {}

    def get(name: str) -> AsyncIO:
        if name not in made:
            made[name] = AsyncIO(config(name))
        return made[name]

    yield get
    for aio in made.values():
        aio.close()
