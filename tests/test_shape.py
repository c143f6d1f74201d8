"""The package's shape, read from the source and from one real ``zo.initialize``: small modules, a thin
engine, small functions, and every decision made once (DESIGN.md's bounds: files <= 450 lines, the
engine <= 300, functions <= 60; so the next feature splits a module instead of growing it)."""
from __future__ import annotations

import ast
from pathlib import Path

import torch

import zerooffload as zo
from reference import make_model
from zerooffload import initialization, memory_plan

PACKAGE = Path(zo.__file__).parent
ENGINE_LINES = 300
MODULE_LINES = 450
FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_engine_stays_thin():
    lines = len((PACKAGE / "engine.py").read_text().splitlines())
    assert lines <= ENGINE_LINES, f"engine.py has {lines} lines: move what grew into the module that owns it"


def test_no_module_passes_its_size():
    big = {str(p.relative_to(PACKAGE)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MODULE_LINES}
    assert big == {}, f"split these by concept into a folder, never grow them: {big}"


def test_no_function_passes_its_size():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - first + 1 > FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.name} ({node.end_lineno - first + 1})")
    assert long == []


def test_initialize_finds_the_units_and_places_them_once(monkeypatch):
    """One ``zo.initialize``: ``initialize`` -> ``find_units`` (once, for the activations and the engine
    alike) -> ``Engine`` -> ``check_memory`` -> ``plan_for_machine`` -> ``plan_for_config`` -> ``place``
    (once; it asks the memory plan whether the kept gradients fit in host memory)."""
    calls = {"find_units": 0, "place": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(initialization, "find_units", counted("find_units", initialization.find_units))
    monkeypatch.setattr(memory_plan, "place", counted("place", memory_plan.place))
    config = {"zero": {"stage": 3}, "offload": {"optimizer": {"tier": "host"}}}
    with zo.init_context(config):
        model = make_model()
    idx = torch.zeros(2, 8, dtype=torch.long, device="meta")
    with zo.initialize(model, config, example_inputs=(idx, idx)):
        pass
    assert calls == {"find_units": 1, "place": 1}
