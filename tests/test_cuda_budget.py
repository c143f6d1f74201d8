"""A device budget CUDA enforces (device_memory's note): what it leaves the engine, the plan that moves
checkpointed activations to the host when they would pass it, and on a GPU the allocator's cap.

The plan is for a CUDA device given as numbers (a probe's rates, a budget): nothing runs on a device, so
these run on any machine; the model is a stack of MLP blocks, whose activations are measured on the meta
device without asking a GPU which attention kernel it would pick."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerooffload as zo
from zerooffload.config import Config
from zerooffload.memory_plan import check_memory
from zerooffload.planning import plan
from zerooffload.planning.model_spec import ModelSpec
from zerooffload.planning.probe import DiskRates, Probe
from zerooffload.tiers import BudgetError, make_tiers
from zerooffload.tiers.device_memory import (CONTEXT_ESTIMATE, cublas_workspace_bytes, out_of_budget_line,
                                             outside_tensors)
from zerooffload.zero.unit_layout import find_units

CUDA = torch.device("cuda")
MICRO, SEQ, LAYERS = 8, 512, 32
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class _Stack(nn.Module):
    """Embeddings, ``LAYERS`` MLP blocks (the units), a head and the loss: a transformer without attention."""

    def __init__(self, width: int = 256, vocab: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(LAYERS))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _spec() -> ModelSpec:
    with zo.init_context():
        module = _Stack()

    def inputs(micro: int):
        tokens = torch.zeros(micro, SEQ, dtype=torch.long, device="meta")
        return (tokens, tokens), {}
    return ModelSpec("MLP stack", module, SEQ, inputs)


def _gpu_probe(nvme: str) -> Probe:
    """An H200-like GPU's rates, as numbers (nothing is measured)."""
    return Probe(device="cuda", device_copy_gbps=3000.0, first_touch_gbps=5.0, link_gbps=50.0,
                 matmul_flops={"bf16": 7e14, "fp32": 5e13}, adam_elements_per_s={"bf16": 2e9},
                 disks={os.path.realpath(nvme): DiskRates(5.0, 5.0, {}, "plan")})


def test_plan_puts_checkpointed_activations_on_the_host_when_they_pass_a_cuda_budget(tmp_path):
    """The budget holds the checkpointed activations less half their block inputs, beside the CUDA
    context and cuBLAS's workspaces: no layout keeping the inputs on the device fits, so the plan
    chooses ``offload.activations.tier = host``; its prediction fits the budget and the engine's start
    check accepts it, while the same layout with the inputs on the device is refused naming the budget."""
    spec = _spec()
    layouts = find_units(spec.module, Config.load({}).zero.unit_modules, 1)
    activations = spec.activations(layouts, MICRO, "bf16", CUDA)
    assert activations.checkpoint_inputs > 0 and activations.plain > activations.checkpointed
    budget = outside_tensors(CUDA) + activations.checkpointed - activations.checkpoint_inputs // 2
    config = Config.load({"nvme": {"path": str(tmp_path)}, "memory": {"device_budget": budget},
                          "train": {"precision": "bf16", "micro_batch_size": MICRO, "grad_clip": 0.0}})
    result = plan(spec, config, probe=_gpu_probe(str(tmp_path)), timed=False)
    best = result.best
    assert best.config.train.activation_checkpointing and best.config.offload.activations.tier == "host"
    assert {c.config.offload.activations.tier for c in result.fitting} == {"host"}
    assert best.prediction.peak_bytes["device"] <= budget - outside_tensors(CUDA)
    chosen = best.config
    check_memory(spec.module, layouts, chosen, make_tiers(chosen.memory, CUDA), activations, 1, CUDA)
    on_device = Config.load(chosen, overrides=["offload.activations.tier=device"])
    with pytest.raises(BudgetError, match=r"memory\.device_budget = \d+ leaves \d+ bytes for the engine \(less "
                                          r"\d+ for the CUDA context and \d+ for cuBLAS's workspaces\)"):
        check_memory(spec.module, layouts, on_device, make_tiers(on_device.memory, CUDA), activations, 1, CUDA)


def test_a_cuda_budget_leaves_out_the_context_and_cublas_workspaces(monkeypatch):
    """On CUDA the device tier's budget is ``memory.device_budget`` less the context and the workspaces;
    on a CPU device it is the budget as set; a budget below what CUDA itself holds is refused in one line."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")  # torch's default before Hopper
    assert cublas_workspace_bytes(CUDA) == 2 * (2 * 4096 + 8 * 16) * 1024
    config = Config.load({"memory": {"device_budget": "8GiB"}}).memory
    assert make_tiers(config, torch.device("cpu"))["device"].budget == 8 << 30
    overhead = outside_tensors(CUDA)
    if not torch.cuda.is_available():  # nothing measured here: the documented estimate
        assert overhead == CONTEXT_ESTIMATE + 2 * (2 * 4096 + 8 * 16) * 1024
    assert make_tiers(config, CUDA)["device"].budget == (8 << 30) - overhead
    small = Config.load({"memory": {"device_budget": overhead}}).memory
    with pytest.raises(BudgetError, match=r"raise memory\.device_budget past \d+ bytes"):
        make_tiers(small, CUDA)


def test_only_an_out_of_memory_past_a_cap_is_a_budget_line():
    """Without a cap (no GPU, or ``memory.device_budget = "auto"``) CUDA's out-of-memory error keeps its
    traceback: the GPU was full, not a budget passed; other errors are not this module's."""
    assert out_of_budget_line(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None
    if not torch.cuda.is_available():
        assert out_of_budget_line(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None


# ------------------------------------------------------------------------------------------------ on a GPU


@pytest.mark.cuda
@on_gpu
def test_the_allocator_stops_at_the_budget_with_one_line_naming_it(make_engine):
    from reference import make_model
    from zerooffload.cli.main import _user_error

    budget = 2 << 30
    try:
        make_engine(make_model(), {"memory": {"device_budget": budget}, "zero": {"stage": 2}})
        torch.cuda.empty_cache()
        fits = torch.empty(budget // 2, dtype=torch.uint8, device="cuda")
        del fits
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(budget, dtype=torch.uint8, device="cuda")
        status, line = _user_error(info.value)
        assert status == 1 and "past memory.device_budget = 2,147,483,648 bytes" in line
        make_engine(make_model(), {"zero": {"stage": 2}})  # "auto": the cap goes
        torch.cuda.empty_cache()
        beyond = torch.empty(budget + (1 << 30), dtype=torch.uint8, device="cuda")
        del beyond
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@pytest.mark.cuda
@on_gpu
def test_the_context_is_measured_in_a_process_that_makes_it():
    """NVML's used memory before torch makes the context, ``mem_get_info``'s after: a few hundred MB."""
    code = ("from zerooffload.tiers.device_memory import _CONTEXTS, note_context; note_context(0); "
            "print(_CONTEXTS.get(0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    if out == "None":
        pytest.skip("no NVML here (nvidia-ml-py): the estimate stands in")
    assert 50e6 < int(out) < 4e9, out


@pytest.mark.cuda
@on_gpu
def test_the_measured_device_peak_is_what_the_allocator_reserved():
    from zerooffload.cli.measured import RunMemory

    memory = RunMemory()
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del block
    peaks = memory.peaks([])
    assert peaks["device"] == torch.cuda.max_memory_reserved() >= 256 << 20
