"""ZeRO++ (issue 44): hpZ bitwise plain stage 3, qwZ and qgZ within a stated bound of plain PyTorch,
each with parameters and optimizer states on NVMe once, a checkpoint saved with hpZ at world 4 resumed at
world 2, the refusals, the memory the secondary shards take; at world 4 as 2 nodes of 2 ranks
(``LOCAL_WORLD_SIZE=2`` in the pool's ranks, as torchrun would set it)."""
from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import zerooffload as zo
from reference import make_batches, make_model, reference_train, shard_numel, update_errors

MICRO = 2
LR = 1e-2


def _units(world: int) -> tuple[int, int]:
    """(root unit, block unit) of TinyLM, gathered fp32 bytes at ``world`` ranks."""
    model = make_model()
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - block * len(model.blocks)
    return (shard_numel(root, world) * world * 4, shard_numel(block, world) * world * 4)


@contextlib.contextmanager
def _nodes_of(local: int):
    """This rank's process as torchrun would start it with ``local`` ranks a node."""
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    try:
        yield
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def train_case(zero: dict, *, steps: int = 3, accum: int = 1, local: int = 2, extra: dict | None = None,
               save: str | None = None, load: str | None = None) -> dict:
    """TinyLM at stage 3 under a live bound small enough that backward gathers again (the root, the block
    computing and one ahead); losses, final weights, bytes per node link, the secondary shards' peak."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root, block = _units(world)
    batches = make_batches(steps, accum, MICRO * world)
    model = make_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    config = {"zero": {"stage": 3, "max_live_size": root + 2 * block, "prefetch_size": block, **zero},
              "train": {"grad_accum_steps": accum}, "optimizer": {"lr": LR, "weight_decay": 0.1}}
    for key, value in (extra or {}).items():
        config.setdefault(key, {}).update(value)
    losses, inter, intra, secondary = [], [], [], 0
    with _nodes_of(local), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zo.initialize(model, config) as engine:
            if load:
                engine.load_checkpoint(load)
            for window in batches:
                for idx, targets in window:
                    rows = slice(rank * MICRO, (rank + 1) * MICRO)
                    loss = engine(idx[rows], targets[rows])
                    secondary = max(secondary, engine.memory_report().bytes("device", "secondary"))
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
                inter.append(engine.stats.inter_node_bytes)
                intra.append(engine.stats.intra_node_bytes)
            if save:
                engine.save_checkpoint(save)
            full = engine.full_state_dict(all_ranks=True)
            after = engine.memory_report().bytes("device", "secondary")
    reference = reference_train(make_model(), batches, lr=LR)
    return {"losses": losses, "weights": full, "inter": inter, "intra": intra, "secondary": secondary,
            "secondary_after": after, "error": max(update_errors(initial, full, reference).values())}


def _bitwise(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


def test_hpz_alone_is_bitwise_plain_stage3_and_keeps_backward_in_the_node(rank_pools):
    pool = rank_pools(4)
    plain = pool.run(train_case, {})[0]
    hpz = pool.run(train_case, {"hpz_partition_size": 2})[0]
    assert _bitwise(hpz, plain)
    assert plain["error"] < 1e-5
    # backward's gathers stayed in the node: forward's gathers and the reduce-scatter alone cross
    assert hpz["inter"][-1] < 0.8 * plain["inter"][-1]
    root, block = _units(4)
    assert hpz["secondary"] == (root + 3 * block) // 2  # every unit's half, from forward to the pass's end
    assert hpz["secondary_after"] == 0 and plain["secondary"] == 0


def plan_case(config: dict) -> dict:
    from test_engine_accounting import plan_bound_case

    with _nodes_of(2):
        return plan_bound_case(config)


def test_a_zeropp_run_never_holds_more_than_its_plan(rank_pools):
    """Budgets equal to the plan, which counts the secondary shards on the device: a byte over would raise."""
    config = {"zero": {"stage": 3, "hpz_partition_size": 2,
                       "prefetch_size": "64KiB", "max_live_size": "1MiB"},
              "offload": {"param": {"tier": "host"}, "optimizer": {"tier": "host"}}}
    for result in rank_pools(4).run(plan_case, config):
        for tier, budget in result["budgets"].items():
            assert 0 < result["peaks"][tier] <= budget, tier


def refusal_case(hpz: int, local: int) -> str:
    with _nodes_of(local), pytest.raises(zo.ConfigError) as refused:
        zo.initialize(make_model(), {"zero": {"stage": 3, "hpz_partition_size": hpz}})
    return str(refused.value)


def test_an_hpz_partition_other_than_the_node_is_refused_in_one_line(rank_pools):
    pool = rank_pools(4)
    assert pool.run(refusal_case, 4, 2)[0] == (
        "zero.hpz_partition_size = 4: it must equal the ranks per node, 2 (torchrun's LOCAL_WORLD_SIZE); set it to "
        "2, or 1 (off)")
    assert pool.run(refusal_case, 2, 4)[0].startswith(
        "zero.hpz_partition_size = 2: it must equal the ranks per node, 4 (torchrun's LOCAL_WORLD_SIZE), whose "
        "process group the backward gathers run on; a divisor of it would need a group per part of a node")
    assert pool.run(refusal_case, 2, 1)[0].startswith("zero.hpz_partition_size = 2: this job runs one rank a node")
    with pytest.raises(zo.ConfigError, match="zero.hpz_partition_size = 2: it changes stage 3's parameter gathers, "
                                             "and zero.stage = 2; set zero.stage = 3"):
        zo.Config.load({"zero": {"stage": 2, "hpz_partition_size": 2}})
