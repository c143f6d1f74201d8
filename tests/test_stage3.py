"""Stage 3 specifics: the live bound, placeholders, persistence, the trace and its invalidation, eval,
``gathered()``; training results always against plain PyTorch."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerooffload as zo
from reference import make_batches, make_model, reference_train, shard_numel, update_errors

MICRO = 2


def _unit_bytes(numel: int, world: int) -> int:
    """Gathered fp32 bytes of a unit of ``numel`` parameters: padded to ``world`` aligned shards."""
    return shard_numel(numel, world) * world * 4


def _tiny_lm_units(world: int) -> tuple[int, int]:
    """(root unit bytes, block unit bytes) of the reference TinyLM, gathered, fp32."""
    model = make_model()
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - block * len(model.blocks)
    return _unit_bytes(root, world), _unit_bytes(block, world)


def bounded_case(max_live: int, prefetch: int, steps: int = 3) -> dict:
    """Train TinyLM at stage 3 under a live bound; report the scheduler's numbers and the update errors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(steps, 1, MICRO * world)
    model = make_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with zo.initialize(model, {"zero": {"stage": 3, "max_live_size": max_live, "prefetch_size": prefetch},
                               "optimizer": {"lr": 1e-2, "weight_decay": 0.1}}) as engine:
        peaks, gathers, hits = [], [], []
        for (idx, targets), in batches:
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(engine(idx[rows], targets[rows]))
            engine.step()
            peaks.append(engine.stats.prefetch.peak_live_bytes)
            gathers.append(engine.stats.prefetch.gathers)
            hits.append(engine.stats.prefetch.hits)
        full = engine.full_state_dict(all_ranks=True)
        gathered_after = engine.memory_report().bytes("device", "gathered")
    reference = reference_train(make_model(), batches)
    return {"peaks": peaks, "gathers": gathers, "hits": hits, "gathered_after": gathered_after,
            "error": max(update_errors(initial, full, reference).values())}


def test_gathered_bytes_never_exceed_max_live_size(rank_pools):
    root, block = _tiny_lm_units(2)
    max_live = root + 2 * block  # the root, the block computing and one block fetched ahead
    for result in rank_pools(2).run(bounded_case, max_live, block):
        assert max(result["peaks"]) <= max_live
        assert max(result["peaks"]) == max_live  # prefetch did fill the bound
        assert result["hits"][-1] > 0 and result["gathered_after"] == 0
        assert result["error"] < 1e-5


def test_prefetch_keeps_a_unit_called_twice_gathered_between_its_uses(rank_pools):
    """TinyLM calls block 1 twice per forward. On demand every use gathers (5 in forward, 5 in
    backward); once the trace is known, a unit used again within the window is kept."""
    root, block = _tiny_lm_units(2)
    on_demand, ahead = (rank_pools(2).run(bounded_case, 10 * block, prefetch)[0] for prefetch in (0, 8 * block))
    assert on_demand["gathers"] == [10, 10, 10]
    assert ahead["gathers"][0] == 10 and ahead["gathers"][1:] == [4, 4]  # each unit once a pass
    assert on_demand["error"] < 1e-5 and ahead["error"] < 1e-5


def test_a_max_live_size_too_small_is_refused_up_front():
    root, block = _tiny_lm_units(1)
    with pytest.raises(zo.ConfigError, match=rf"zero.max_live_size = {root + block - 1} bytes cannot hold unit "
                                             rf"'blocks.0' .* raise zero.max_live_size to at least {root + block}"):
        zo.initialize(make_model(), {"zero": {"stage": 3, "max_live_size": root + block - 1, "prefetch_size": 0}})


def test_parameters_are_nan_placeholders_outside_forward_and_real_inside_gathered(make_engine):
    model = make_model()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    engine = make_engine(model, {"zero": {"stage": 3}})
    weight = engine.module.blocks[0].fc1.weight
    assert weight.shape == (96, 48) and bool(weight.isnan().all())
    with engine.gathered() as module:
        assert all(torch.equal(module.state_dict()[k], v) for k, v in expected.items())
        module.blocks[0].fc1.weight.data.fill_(0.25)
    assert bool(weight.isnan().all())  # sharded again
    assert engine.memory_report().bytes("device", "gathered") == 0
    full = engine.full_state_dict()
    assert torch.equal(full["blocks.0.fc1.weight"], torch.full((96, 48), 0.25))
    assert all(torch.equal(full[k], v) for k, v in expected.items() if k != "blocks.0.fc1.weight")


def gathered_write_case() -> list[float]:
    """Rank 1 writes inside gathered(modifier_rank=1); every rank must see it after a step's gather."""
    with zo.initialize(make_model(), {"zero": {"stage": 3}, "train": {"precision": "bf16"}}) as engine:
        with engine.gathered(modifier_rank=1) as module:
            if dist.get_rank() == 1:
                module.ln_f.weight.data.fill_(2.0)
        full = engine.full_state_dict(all_ranks=True)
    return [float(full["ln_f.weight"].min()), float(full["ln_f.weight"].max())]


def test_gathered_writes_of_the_modifier_rank_reach_every_shard(rank_pools):
    assert rank_pools(2).run(gathered_write_case) == [[2.0, 2.0], [2.0, 2.0]]


def persistent_case() -> dict:
    """The root unit (fewer parameters than a block) persists; the blocks are partitioned."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    block = sum(p.numel() for p in model.blocks[0].parameters())
    batches = make_batches(2, 1, MICRO * world)
    with zo.initialize(model, {"zero": {"stage": 3, "persist_threshold": block},
                               "optimizer": {"lr": 1e-2, "weight_decay": 0.1}}) as engine:
        for (idx, targets), in batches:
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(engine(idx[rows], targets[rows]))
            engine.step()
        full = engine.full_state_dict(all_ranks=True)
        live = {name: torch.equal(p.detach(), full[name]) for name, p in engine.module.named_parameters()}
        placeholder = {name: bool(p.isnan().all()) for name, p in engine.module.named_parameters()}
    return {"live": live, "placeholder": placeholder,
            "error": max(update_errors(initial, full, reference_train(make_model(), batches)).values())}


def test_persistent_units_stay_gathered_and_are_all_gathered_after_the_step(rank_pools):
    """Outside any forward, a persistent unit's parameters are its live, updated weights; a partitioned
    unit's are NaN placeholders (partition's [Note: partitioned units (stage 3)])."""
    for result in rank_pools(2).run(persistent_case):
        in_blocks = {name for name in result["live"] if name.startswith("blocks.")}
        assert in_blocks and len(in_blocks) < len(result["live"])
        assert {n for n, live in result["live"].items() if not live} == in_blocks
        assert {n for n, nan in result["placeholder"].items() if nan} == in_blocks
        assert result["error"] < 1e-5


class Reorderable(nn.Module):
    """Three equal blocks whose order of use the test can change between steps."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.order = [0, 1, 2]

    def forward(self, x):
        for index in self.order:
            x = torch.tanh(self.blocks[index](x))
        return x.square().mean()


def test_a_changed_unit_order_invalidates_the_trace_and_still_trains_exactly(caplog, make_engine):
    torch.manual_seed(0)
    model = Reorderable()
    plain = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    engine = make_engine(model, {"zero": {"stage": 3}, "optimizer": {"lr": 1e-3}})
    orders = [[0, 1, 2], [0, 1, 2], [2, 0, 1], [2, 0, 1], [2, 0, 1]]  # step 3 records the new order
    with caplog.at_level(logging.INFO, logger="zerooffload.zero.scheduler"):
        for step, order in enumerate(orders):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            model.order = plain.order = order
            engine.backward(engine(x))
            engine.step()
            plain(x).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 2:
                assert "unit order changed at use 0 (trace: 'blocks.0', now: 'blocks.2')" in caplog.text
                assert engine.stats.prefetch.misses > 0
    assert engine.stats.prefetch.misses == 1  # the new order was recorded and followed: only the pass's
    assert engine.stats.prefetch.hits == 5  # first unit waits (nothing runs before it to fetch it ahead)
    full = engine.full_state_dict()
    assert all(torch.allclose(full[k], v, atol=1e-6, rtol=0) for k, v in plain.state_dict().items())


def test_eval_forward_frees_parameters_and_leaves_the_trace_alone(caplog, make_engine):
    """An eval forward (forward only, no backward) neither records nor breaks the training trace: the
    step after it prefetches exactly as the step before it did, with nothing out of order."""
    model = make_model()
    plain = copy.deepcopy(model)
    engine = make_engine(model, {"zero": {"stage": 3}})
    (idx, targets), = make_batches(1, 1, 4)[0]

    def train_step() -> tuple[int, int, int]:
        """The step's uses served ahead and waited for, and its peak gathered bytes: what the trace governs.
        (Not its all-gathers: the window's count includes those of eval forwards and gathered() in it.)"""
        engine.backward(engine(idx, targets))
        engine.step()
        stats = engine.stats.prefetch
        return stats.hits, stats.misses, stats.peak_live_bytes

    train_step()  # records the trace
    followed = train_step()
    assert followed[0] > 0 and followed[1] == 1  # the trace is followed: only the pass's first use waits
    gathered_before = engine.memory_report().bytes("device", "gathered")
    engine.eval()
    with torch.no_grad():
        loss = engine(idx, targets)
    engine.train()
    assert engine.memory_report().bytes("device", "gathered") == gathered_before == 0
    with engine.gathered() as module:
        plain.load_state_dict(module.state_dict())
    with torch.no_grad():
        assert torch.allclose(loss, plain.eval()(idx, targets), atol=1e-6, rtol=0)
    with caplog.at_level(logging.INFO, logger="zerooffload.zero.scheduler"):
        assert train_step() == followed
    assert "unit order changed" not in caplog.text
