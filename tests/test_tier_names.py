"""Placement is data: no module but the config, the placement and the tier classes names a tier.

Read from the source (AST), so later work cannot bring back ``if tier == "nvme"``,
``p.optimizer != COMPUTE`` or ``isinstance(t, NvmeTier)`` in the engine, the memory plan, the
planner or the sharded state: they ask a ``UnitPlacement`` which tier (and placement's ``addressable``
or ``leaves_device`` what a tier's name means), and the tier object what it can do. The planner may
still give the constants as values when it builds candidate configs.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zerooffload"
TIER_NAMES = {"device", "host", "nvme"}
TIER_CLASSES = {"DeviceTier", "HostTier", "NvmeTier"}
TIER_CONSTANTS = {"COMPUTE", "STAGING", "SWAP", "TIER_NAMES", "_NOT_ADDRESSABLE"}
"""placement's names for the tiers: a comparison against one is a branch on a tier."""
ALLOWED = {"config/sections.py", "config/root.py", "config/deepspeed.py", "config/deepspeed_keys.py", "zero/placement.py"}
TIERS = "tiers"
"""The tier classes and the refusals that name them: the tiers' own folder."""
FACES = "cli"
"""The faces (the command, training, benchmarks, doctor, estimate): they parse and print what users
type and read."""


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (or bare string statements)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}


def offences(source: str) -> list[str]:
    """Each tier-name string, and each use of a concrete tier class, in ``source``."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and node.value in TIER_NAMES and id(node) not in docs):
            found.append(f"line {node.lineno}: tier name {node.value!r}")
        elif isinstance(node, ast.Name) and node.id in TIER_CLASSES:
            found.append(f"line {node.lineno}: concrete tier class {node.id}")
        elif isinstance(node, ast.alias) and node.name in TIER_CLASSES:
            found.append(f"line {getattr(node, 'lineno', '?')}: imports {node.name}")
        elif isinstance(node, ast.Compare) and any(isinstance(name, ast.Name) and name.id in TIER_CONSTANTS
                                                   for side in (node.left, *node.comparators)
                                                   for name in ast.walk(side)):
            found.append(f"line {node.lineno}: compares against a tier constant")
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if p.relative_to(PACKAGE).as_posix() not in ALLOWED and p.relative_to(PACKAGE).parts[0] not in (FACES, TIERS))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_outside_placement_and_tiers_names_a_tier(path: Path) -> None:
    assert offences(path.read_text()) == []


@pytest.mark.parametrize("snippet", [
    'if name == "nvme":\n    pass\n',
    'x = tiers["host"]\n',
    'ok = isinstance(t, NvmeTier)\n',
    'from .tiers import DeviceTier\n',
    'if p.optimizer != COMPUTE:\n    pass\n',
    'streams = home in _NOT_ADDRESSABLE\n',
    'moved = tier in (STAGING, SWAP)\n',
])
def test_the_check_finds_each_kind_of_offence(snippet: str) -> None:
    assert offences(snippet), snippet


def test_docstrings_may_speak_of_tiers() -> None:
    assert offences('def f():\n    """Blocks on "nvme" stream."""\n') == []
