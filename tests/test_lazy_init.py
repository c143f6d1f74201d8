"""init_context: a model built on the meta device gets an eager build's exact values, unit by unit."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerooffload as zo
from reference import TinyLM, make_batches, make_model


def _train_two_steps(engine) -> dict:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for (idx, targets), in make_batches(2, 1, 2 * world):
        rows = slice(rank * 2, (rank + 1) * 2)
        engine.backward(engine(idx[rows], targets[rows]))
        engine.step()
    return engine.full_state_dict(all_ranks=True)


def _decay_groups(model: nn.Module) -> list[dict]:
    """Weight decay on the weights only, as the Hugging Face Trainer groups them."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.5},
            {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0}]


def lazy_case(stage: int, offload: dict, grouped: bool = False) -> dict:
    """Every rank builds TinyLM twice, eagerly and under init_context: same values, same training (every
    rank compares the whole state, gathered to it); ``grouped``: with parameter groups made of each
    build's own parameters (the lazy build's are meta tensors then)."""
    config = {"zero": {"stage": stage}, "offload": offload}
    groups = _decay_groups if grouped else lambda model: None
    eager_model = make_model(seed=0)
    with zo.initialize(eager_model, config, param_groups=groups(eager_model)) as eager:
        initial_eager, trained_eager = eager.full_state_dict(all_ranks=True), _train_two_steps(eager)
    torch.manual_seed(0)
    with zo.init_context():
        model = TinyLM()
    assert all(p.is_meta for p in model.parameters())
    with zo.initialize(model, config, param_groups=groups(model)) as lazy:
        same_initial = _equal(lazy.full_state_dict(all_ranks=True), initial_eager)
        same_trained = _equal(_train_two_steps(lazy), trained_eager)
    tied = model.head.weight is model.embed.weight and not model.frozen.weight.requires_grad
    return {"same_initial": same_initial, "same_trained": same_trained, "tied": tied,
            "trained": not _equal(trained_eager, initial_eager), "keys": list(initial_eager) == list(make_model().state_dict())}


def _check_lazy(result: dict) -> None:
    assert result == {"same_initial": True, "same_trained": True, "tied": True, "trained": True, "keys": True}


def _equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stage, offload", [(1, {}), (3, {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}})])
def test_lazy_build_equals_eager_build_at_world_size_2(rank_pools, stage, offload):
    for result in rank_pools(2).run(lazy_case, stage, offload):
        _check_lazy(result)


def test_lazy_build_at_world_size_1_stage_0():
    _check_lazy(lazy_case(0, {}))


def test_a_lazy_build_takes_parameter_groups_of_its_meta_parameters():
    _check_lazy(lazy_case(3, {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}, grouped=True))


class RawParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_a_module_without_reset_parameters_needs_init_fn(make_engine):
    with zo.init_context():
        model = nn.Sequential(nn.Linear(3, 3), RawParameter())
    with pytest.raises(ValueError, match=r"RawParameter has parameters \(scale\) but no reset_parameters"):
        zo.initialize(model)
    with zo.init_context():
        model = nn.Sequential(nn.Linear(3, 3), RawParameter())
    engine = make_engine(model, init_fn=lambda m: [nn.init.constant_(p, 0.5) for p in m.parameters(recurse=False)])
    assert all(bool((v == 0.5).all()) for v in engine.full_state_dict().values())


def test_building_under_init_context_imports_no_dynamo():
    """nn.Embedding's normal_ on meta runs a decomposition that imports torch._dynamo (2.3 s and ~100 MiB
    in a process that never compiles); init_context leaves random fills of meta tensors undone."""
    code = ("import sys, torch, zerooffload as zo\nfrom zerooffload.models import GPT, PRESETS\n"
            "with zo.init_context():\n    model = GPT(PRESETS['nano'])\n    filled = torch.empty(3).normal_()\n"
            "print(all(p.is_meta for p in model.parameters()), filled.is_meta, 'torch._dynamo' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["True", "True", "False"], run.stdout + run.stderr
