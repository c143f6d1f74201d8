"""Stages 0–3 × {fp32, bf16} × world sizes match plain PyTorch AdamW on the full global batch."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerooffload as zo
from reference import make_batches, make_model, reference_train, update_errors

MICRO = 2  # samples per rank per micro-batch
TOLERANCE = {"fp32": 2e-5, "bf16": 3e-3}
"""fp32: ranks sum gradients in another order than one process does, and Adam's m/sqrt(v) magnifies that
rounding on small updates: worst 5.4e-6 on the Xeon (AVX-512) machines, 1.01e-5 (layer-norm bias,
accumulation of four) on the AMD EPYC (AVX2) ones; a real bug moves updates by 1e-2 or more."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _config(stage: int, precision: str, accum: int, clip: float, **extra) -> dict:
    config = {"zero": {"stage": stage, "bucket_size": "16KiB"},
              "train": {"precision": precision, "grad_accum_steps": accum, "grad_clip": clip,
                        "micro_batch_size": MICRO},
              "optimizer": {"lr": 1e-2, "weight_decay": 0.1}}
    for section, values in extra.items():
        config.setdefault(section, {}).update(values)
    return config


def train_case(stage: int, precision: str, accum: int = 2, clip: float = 0.05, steps: int = 3, eval_between: bool = False,
               **extra) -> dict | None:
    """Run in every rank: train with the engine on this rank's slice; rank 0 compares with the reference.

    ``eval_between`` runs an evaluation forward (``engine.eval()``, no grad) after every step.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    batches = make_batches(steps, accum, MICRO * world)
    model = make_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    engine = zo.initialize(model, _config(stage, precision, accum, clip, **extra))
    updates = []
    for window in batches:
        for idx, targets in window:
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(engine(idx[rows], targets[rows]))
            updates.append(engine.step())
        if eval_between:
            _evaluate(engine, *window[0])
    full = engine.full_state_dict()
    stats = engine.stats
    engine.close()
    if rank != 0:
        return None
    parts = world if precision == "bf16" else 1  # see reference_train: bf16 rounding of a split batch
    reference = reference_train(make_model(), batches, clip=clip, dtype=DTYPES[precision], parts=parts,
                                average_each_micro_batch=stage >= 2)
    return {"errors": update_errors(initial, full, reference), "updates": updates,
            "keys": list(full) == list(initial),
            "frozen": float((full["frozen.weight"] - initial["frozen.weight"]).abs().max()),
            "unused": float((full["unused.weight"] - initial["unused.weight"]).abs().max()),
            "tied": bool(torch.equal(full["embed.weight"], full["head.weight"])),
            "data_elements": stats.data_elements}


def _evaluate(engine, idx, targets) -> None:
    engine.eval()
    with torch.no_grad():
        loss = engine(idx, targets)
    engine.train()
    assert torch.isfinite(loss)


def _check(result: dict, precision: str, accum: int = 2) -> None:
    worst = max(result["errors"].items(), key=lambda kv: kv[1])
    assert worst[1] < TOLERANCE[precision], f"update error {worst[1]:.2e} on {worst[0]}"
    assert result["keys"] and result["tied"]
    assert result["frozen"] == 0.0 and result["unused"] == 0.0
    assert result["updates"] == [(i + 1) % accum == 0 for i in range(len(result["updates"]))]


GRID = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")]


@pytest.mark.parametrize("stage, precision", GRID)
def test_world_size_1_without_a_launcher(stage, precision):
    _check(train_case(stage, precision), precision)


@pytest.mark.parametrize("stage, precision", GRID)
def test_world_size_2(rank_pools, stage, precision):
    _check(rank_pools(2).run(train_case, stage, precision)[0], precision)


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16"), (3, "fp32"),
                                              (3, "bf16")])
def test_world_size_4(rank_pools, stage, precision):
    _check(rank_pools(4).run(train_case, stage, precision)[0], precision)


def test_host_optimizer_tier_equals_device_tier(rank_pools):
    device = rank_pools(2).run(train_case, 2, "bf16")[0]
    host = rank_pools(2).run(train_case, 2, "bf16", offload={"optimizer": {"tier": "host"}})[0]
    assert host["errors"] == device["errors"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_optimizer_tier_equals_device_tier(rank_pools, stage):
    """Optimizer blocks paged through swap files (O_DIRECT) give exactly the device tier's training."""
    for precision in ("fp32", "bf16"):
        device = rank_pools(2).run(train_case, stage, precision)[0]
        nvme = rank_pools(2).run(train_case, stage, precision, offload={"optimizer": {"tier": "nvme"}})[0]
        _check(nvme, precision)
        assert nvme["errors"] == device["errors"]


def test_nvme_optimizer_tier_world_size_1():
    _check(train_case(3, "bf16", offload={"optimizer": {"tier": "nvme"}}), "bf16")


def test_accumulation_of_four_without_clipping(rank_pools):
    _check(rank_pools(2).run(train_case, 2, "fp32", accum=4, clip=0.0)[0], "fp32", accum=4)


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")])
def test_activation_checkpointing_changes_nothing(rank_pools, stage, precision):
    result = rank_pools(2).run(train_case, stage, precision, train={"activation_checkpointing": True})[0]
    _check(result, precision)


def test_activation_checkpointing_with_updates_in_backward(rank_pools):
    """Recomputed forwards run inside backward, beside the updates of the units already done."""
    train = {"activation_checkpointing": True}
    device = rank_pools(2).run(train_case, 3, "fp32", accum=1, clip=0.0, train=train)[0]
    offload = {"optimizer": {"tier": "nvme"}, "param": {"tier": "nvme"}}
    result = rank_pools(2).run(train_case, 3, "fp32", accum=1, clip=0.0, train=train, offload=offload)[0]
    _check(result, "fp32", accum=1)
    assert result["errors"] == device["errors"]


def test_stage_2_without_overlap_comm(rank_pools):
    _check(rank_pools(2).run(train_case, 2, "fp32", zero={"overlap_comm": False})[0], "fp32")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage_3_with_an_eval_forward_between_steps(rank_pools, precision):
    _check(rank_pools(2).run(train_case, 3, precision, eval_between=True)[0], precision)


def test_stage_3_on_demand_without_prefetch(rank_pools):
    _check(rank_pools(2).run(train_case, 3, "fp32", zero={"prefetch_size": 0})[0], "fp32")


@pytest.mark.parametrize("param_tier", ["host", "nvme"])
def test_stage_3_offloaded_parameters_equal_the_device_run(rank_pools, param_tier):
    """Parameter shards on host or NVMe (staged ahead along the trace), with the optimizer on each tier."""
    device = rank_pools(2).run(train_case, 3, "fp32", eval_between=True)[0]
    for optimizer_tier in ("device", "host", "nvme"):
        offload = {"param": {"tier": param_tier}, "optimizer": {"tier": optimizer_tier}}
        result = rank_pools(2).run(train_case, 3, "fp32", eval_between=True, offload=offload)[0]
        _check(result, "fp32")
        assert result["errors"] == device["errors"], optimizer_tier


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_fraction_of_the_optimizer_offloaded_equals_the_device_run(rank_pools, tier):
    """offload.optimizer.fraction = 0.5: the first units' states on the tier, the rest on the device."""
    for stage in (2, 3):
        device = rank_pools(2).run(train_case, stage, "bf16")[0]
        half = rank_pools(2).run(train_case, stage, "bf16", offload={"optimizer": {"tier": tier, "fraction": 0.5}})[0]
        _check(half, "bf16")
        assert half["errors"] == device["errors"]


class _LargeRoot(torch.nn.Module):
    """Five small block units, then a root unit (the embedding) many times their size."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))
        self.embed = torch.nn.Embedding(4000, 8)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _large_root_run(offload: dict) -> dict:
    torch.manual_seed(0)
    engine = zo.initialize(_LargeRoot(), {"zero": {"stage": 2}, "offload": offload})
    for step in range(2):
        engine.backward(engine(torch.randint(0, 4000, (4, 3), generator=torch.Generator().manual_seed(step))))
        engine.step()
    full = engine.full_state_dict()
    engine.close()
    return full


def test_nvme_streams_units_of_different_sizes():
    """The stream's host buffers come back whole: a large block after small ones still fits."""
    device, nvme = _large_root_run({}), _large_root_run({"optimizer": {"tier": "nvme"}})
    assert all(torch.equal(device[k], nvme[k]) for k in device)


@pytest.mark.parametrize("stage", [2, 3])
def test_updates_in_backward_equal_the_updates_in_the_step(rank_pools, stage):
    """No clipping, one micro-batch per step: offloaded units are updated inside backward (engine's
    [Note: updates in backward]), bitwise what the device run does in its step; half offloaded mixes both."""
    cases = [("host", 1.0, "device"), ("nvme", 1.0, "device"), ("nvme", 0.5, "device")]
    zero = {"persist_threshold": 9420} if stage == 3 else {}  # the root unit stays gathered, updated in place
    if stage == 3:
        cases.append(("nvme", 1.0, "nvme"))
    for precision in ("fp32", "bf16"):
        device = rank_pools(2).run(train_case, stage, precision, accum=1, clip=0.0, zero=zero)[0]
        _check(device, precision, accum=1)
        for tier, fraction, param_tier in cases:
            offload = {"optimizer": {"tier": tier, "fraction": fraction}, "param": {"tier": param_tier}}
            result = rank_pools(2).run(train_case, stage, precision, accum=1, clip=0.0, zero=zero, offload=offload)[0]
            assert result["errors"] == device["errors"], (precision, tier, fraction, param_tier)


def _backward_then_step(clip: float) -> dict:
    """Stage 3, everything on NVMe, world 1: what one backward changes before its step, the NVMe bytes
    per step, and the weights after two steps. A clip (even one that never binds) needs the global
    norm, so it keeps the updates in the step."""
    batches = make_batches(2, 1, MICRO)
    model = make_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    offload = {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}
    engine = zo.initialize(model, _config(3, "fp32", 1, clip, offload=offload))
    (idx, targets), = batches[0]
    engine.backward(engine(idx, targets))
    moved_in_backward = any(not torch.equal(v, initial[k]) for k, v in engine.full_state_dict().items())
    engine.step()
    (idx, targets), = batches[1]
    engine.backward(engine(idx, targets))
    engine.step()
    io, full = engine.stats.io, engine.full_state_dict()
    grad_bytes = 4 * sum(u.layout.shard_numel for u in engine.units)  # fp32 shards
    engine.close()
    return {"moved": moved_in_backward, "io": io, "full": full, "grad_bytes": grad_bytes}


def test_updates_in_backward_skip_the_gradients_round_trip_through_nvme():
    on, off = _backward_then_step(0.0), _backward_then_step(1e9)
    assert on["moved"] and not off["moved"]
    assert all(torch.equal(on["full"][k], off["full"][k]) for k in off["full"])
    assert off["io"].write_bytes - on["io"].write_bytes == on["grad_bytes"]
    assert off["io"].read_bytes - on["io"].read_bytes == on["grad_bytes"]


WINDOWS = {"updates in the step": (2, 0.05), "updates in backward": (1, 0.0),
           "accumulation, updates in backward": (2, 0.0)}


@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2])
def test_every_tier_combination(rank_pools, world, stage, window):
    """Optimizer tier × parameter tier (stage 3), fp32, at world size 1 (no launcher) and 2: within the
    bound of plain PyTorch AdamW and bitwise the device run. Clipping keeps the updates in the step;
    without it offloaded units are updated at stages 2–3 in the backward that closes the window (with
    accumulation, their earlier gradient parts read back from the tier)."""
    accum, clip = WINDOWS[window]

    def run(**offload) -> dict:
        if world == 1:
            return train_case(stage, "fp32", accum=accum, clip=clip, **offload)
        return rank_pools(world).run(train_case, stage, "fp32", accum=accum, clip=clip, **offload)[0]

    device = run()
    _check(device, "fp32", accum)
    for optimizer_tier in ("device", "host", "nvme"):
        for param_tier in ("device", "host", "nvme") if stage == 3 else ("device",):
            result = run(offload={"optimizer": {"tier": optimizer_tier}, "param": {"tier": param_tier}})
            _check(result, "fp32", accum)
            assert result["errors"] == device["errors"], (optimizer_tier, param_tier)
