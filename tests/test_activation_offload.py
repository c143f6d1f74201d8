"""Checkpointed inputs kept in the host tier between forward and backward (activation_offload's note).

The hooks run here on CPU tensors, built directly (the engine installs them only off a CPU device,
where a copy would gain nothing): what they hold is counted in a real host tier, they come back in
backward order, and the gradients are bitwise those of the same checkpointed model without them.
The CUDA copies on the side stream are checked by tests/test_cuda.py on a lent GPU.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerooffload as zo
from zerooffload.activation_offload import HostActivations
from zerooffload.activations import ActivationProfile, checkpoint_forward
from zerooffload.config import ConfigError
from zerooffload.memory_plan import place_activations
from zerooffload.tiers import HostTier, Kind
from zerooffload.tiers.streams import SideStreams

WIDTH, BATCH, BLOCKS = 32, 8, 4


def _model(offload: HostActivations | None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(BLOCKS)))
    for block in model:
        checkpoint_forward(block, offload)
    return model


def _grads(offload: HostActivations | None, during_backward=lambda: None) -> tuple[dict, float]:
    model = _model(offload)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)
    if offload is not None:
        offload.begin_forward()
    out = model(x * 1.0)
    held = offload.host.usage[Kind.ACTIVATION] if offload is not None else 0
    if offload is not None:
        offload.prefetch_last()
    out.pow(2).sum().backward()
    return {name: p.grad for name, p in model.named_parameters()} | {"x": x.grad}, held


def test_checkpointed_inputs_wait_in_the_host_tier_and_return_in_backward_order():
    host = HostTier("host", torch.device("cpu"), None)
    offload = HostActivations(host, torch.device("cpu"), SideStreams(torch.device("cpu")))
    plain, _ = _grads(None)
    grads, held = _grads(offload)
    assert all(torch.equal(grads[k], plain[k]) for k in plain)
    assert held == BLOCKS * BATCH * WIDTH * 4  # every block's input, fp32, and nothing else
    assert host.usage[Kind.ACTIVATION] == 0 and host.peak >= held  # each freed once it was back
    # the last one fetched before backward, and each next one while backward takes the one before
    assert offload.trace == [("fetch", 3), ("fetch", 2), ("use", 3), ("fetch", 1), ("use", 2), ("fetch", 0),
                             ("use", 1), ("use", 0)]


def test_a_cpu_run_moves_nothing_and_a_gpu_plan_counts_the_inputs_on_the_host():
    config = zo.Config.load({"train": {"activation_checkpointing": True}, "offload": {"activations": {"tier": "host"}}})
    profile = ActivationProfile(plain=1000, checkpointed=400, checkpoint_inputs=150)
    cpu_plan, gpu_plan = {}, {}
    assert place_activations(cpu_plan, profile, config, torch.device("cpu")) == 400 and cpu_plan == {}
    assert place_activations(gpu_plan, profile, config, torch.device("cuda")) == 250
    assert gpu_plan["host"][Kind.ACTIVATION] == 150
    with zo.initialize(_model(None), config) as engine:
        assert engine.host_activations is None  # the hooks are not installed on a CPU device


def test_moving_activations_needs_checkpointing():
    with pytest.raises(ConfigError, match=r"^offload\.activations\.tier = 'host' needs train\.activation_checkpointing"):
        zo.Config.load({"offload": {"activations": {"tier": "host"}}})
