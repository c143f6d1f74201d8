"""Shared fixtures: ``rank_pools(n)`` hands out one reused pool of n gloo ranks per session;
``engines(name)`` one AsyncIO per backend name per test module; ``make_engine(...)`` builds training
engines (``zo.initialize``) that are all closed when the test ends, whether it passed or failed.

Functions that run on a rank pool (tests/harness.py) are outside pytest's fixtures: they build their
engines with ``with zo.initialize(...) as engine:``, which closes them on exit, on error too."""
from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported in the fixtures: this module must load without torch, so that
    from harness import RankPool  # pytest_configure can say what this Python lacks
    from zerooffload.io import AsyncIO


def _missing_requirements() -> list[str]:
    """The packages pyproject.toml asks for (dependencies and the ``test`` extra) that this Python cannot
    import: a Python without the project installed fails once, saying so, not once per test module."""
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    names = (re.match(r"[A-Za-z0-9_.-]+", requirement).group() for requirement in wanted)
    return [name for name in names if importlib.util.find_spec(name) is None]


def pytest_configure(config):
    if missing := _missing_requirements():
        raise pytest.UsageError(f"this Python ({sys.executable}) lacks {', '.join(missing)}: install the project and "
                                'its test extra into it (pip install torch==2.13.0 && pip install -e ".[test]"), or '
                                "run the tests from the environment that has them")


@pytest.fixture(scope="session")
def rank_pools():
    from harness import RankPool

    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture
def make_engine():
    """``make_engine(model, config, ...)`` is ``zo.initialize``; every engine it built is closed at
    teardown, last built first (closing one already closed is a no-op), so a failing assertion leaves
    no hooks, accounting or swap files behind for the next test."""
    import zerooffload as zo

    made = []

    def make(*args, **kwargs):
        engine = zo.initialize(*args, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.close()


@pytest.fixture(scope="module")
def engines():
    from aio_helpers import config
    from zerooffload.io import AsyncIO

    made: dict[str, AsyncIO] = {}

    def get(name: str) -> AsyncIO:
        if name not in made:
            made[name] = AsyncIO(config(name))
        return made[name]

    yield get
    for aio in made.values():
        aio.close()
