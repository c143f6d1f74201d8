"""Memory and communication accounting against DESIGN §3's formulas; budgets refused up front."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerooffload as zo
from cli_helpers import run_in_process
from placements import grads_waiting_on
from reference import ALIGN, padded_numel, trainable_spans, unit_shards, units_of
from zerooffload.cli.estimate import estimate
from zerooffload.tiers import BudgetError


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Linear(64, 10))


def _one_step(engine) -> None:
    x = torch.randn(4, 64)
    engine.backward(engine(x).square().mean())
    engine.step()


def accounting_case(stage: int, precision: str, prefetch_size: str = "0", steps: int = 1) -> dict:
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = _mlp()
    psi = sum(p.numel() for p in model.parameters())
    shards = world if stage >= 1 else 1  # stage 0 replicates: every unit is one whole "shard"
    padded, units = padded_numel(model, shards), len(units_of(model))
    with zo.initialize(model, {"zero": {"stage": stage, "prefetch_size": prefetch_size},
                               "train": {"precision": precision}}) as engine:
        for _ in range(steps):
            _one_step(engine)
        report, stats = engine.memory_report(), engine.stats
    return {"psi": psi, "padded": padded, "world": world, "units": units,
            "param": report.bytes("device", "param"), "grad": report.bytes("device", "grad"),
            "optimizer": report.bytes("device", "optimizer"), "gathered": report.bytes("device", "gathered"),
            "data_elements": stats.data_elements}


def _expected(stage: int, precision: str, psi: int, nd: int) -> dict:
    """DESIGN §3: bf16 params 2Ψ, grads 2Ψ, optimizer 12Ψ; fp32 4Ψ, 4Ψ, 8Ψ; each / Nd once sharded."""
    weight, grad, optimizer = (2, 2, 12) if precision == "bf16" else (4, 4, 8)
    return {"param": weight * psi / (nd if stage >= 3 else 1), "grad": grad * psi / (nd if stage >= 2 else 1),
            "optimizer": optimizer * psi / (nd if stage >= 1 else 1)}


CASES = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")]


def _check_memory(result: dict, stage: int, precision: str) -> None:
    nd = result["world"]
    exact = _expected(stage, precision, result["padded"], nd)  # the formula on the padded count
    for kind in ("param", "grad", "optimizer"):
        assert result[kind] == exact[kind], kind
    assert result["gathered"] == 0  # stage 3 frees every gathered unit by the end of the step
    slack = result["units"] * nd * ALIGN  # padding: at most one aligned block per unit shard
    assert result["psi"] <= result["padded"] <= result["psi"] + slack
    loose = _expected(stage, precision, result["psi"], nd)
    for kind in ("param", "grad", "optimizer"):
        assert abs(result[kind] - loose[kind]) <= slack * 16, kind


@pytest.mark.parametrize("stage, precision", CASES)
def test_memory_report_matches_formulas_at_nd_1(stage, precision):
    result = accounting_case(stage, precision)
    _check_memory(result, stage, precision)
    assert result["data_elements"] == 0  # world size 1 moves nothing


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_and_collectives_at_nd_2_and_4(rank_pools, world, stage):
    for precision in ("fp32", "bf16"):
        results = rank_pools(world).run(accounting_case, stage, precision)
        for result in results:
            _check_memory(result, stage, precision)
            # 2Ψ per step for stages 0–2; 3Ψ at stage 3 (gathered for forward, again for backward)
            assert result["data_elements"] == (3 if stage == 3 else 2) * result["padded"]


def test_stage_3_prefetch_keeps_units_reused_soon_and_moves_less(rank_pools):
    """Once the first step has recorded the trace, a unit used again within the prefetch window stays
    gathered (here: the last layer between its forward and its backward), so a step moves less than 3Ψ
    but never less than 2Ψ."""
    for result in rank_pools(2).run(accounting_case, 3, "fp32", "64MiB", steps=2):
        _check_memory(result, 3, "fp32")
        assert 2 * result["padded"] <= result["data_elements"] < 3 * result["padded"]


def test_budget_one_byte_short_is_refused_before_training(make_engine):
    with pytest.raises(BudgetError) as info:
        zo.initialize(_mlp(), {"memory": {"device_budget": 4096}})
    needed = int(re.search(r"the device tier needs (\d+) bytes", str(info.value)).group(1))
    assert "memory.device_budget is 4096 bytes" in str(info.value)
    model = _mlp()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(BudgetError, match=f"needs {needed} bytes .* memory.device_budget is {needed - 1} bytes "
                                          r"\(1 short\)"):
        zo.initialize(model, {"memory": {"device_budget": needed - 1}})
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # refused before touching it
    engine = make_engine(_mlp(), {"memory": {"device_budget": needed}})
    for _ in range(3):
        _one_step(engine)  # the plan is an upper bound: the run never passes it
    assert engine.memory_report().peaks["device"] <= needed


def test_host_budget_names_the_host_tier():
    with pytest.raises(BudgetError, match=r"the host tier needs \d+ bytes \(optimizer \d+.*memory.host_budget"):
        zo.initialize(_mlp(), {"zero": {"stage": 1}, "offload": {"optimizer": {"tier": "host"}},
                               "memory": {"host_budget": 4096}})


def test_estimate_reproduces_the_zero_paper_example():
    rows = estimate(7.5e9, 64)
    assert [round(r.device / 1e9, 2) for r in rows] == [120.0, 31.41, 16.64, 1.88]
    run = run_in_process("estimate", "--params", "7.5e9", "--dp", "64")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for figure in ("120.00", "31.41", "16.64", "1.88"):
        assert figure in out


@pytest.mark.parametrize("master, moments, k", [("split", "fp32", 2.125 + 8), ("fp32", "bf16", 4 + 4),
                                                ("split", "int8", 2.125 + 2 * (1 + 4 / 256))])
def test_estimate_takes_the_state_formats(master, moments, k):
    """K by the formats' definitions: a split master 2 bytes + 2 + 1/8, a bf16 moment 2, an int8 one a byte
    and a 4-byte scale per 256; stage 3 with everything on the device holds (2 + 2 + K) bytes per parameter."""
    run = run_in_process("estimate", "--params", "1e9", "--dp", "1", "--stage", "3", "--master", master,
                         "--moments", moments)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert f"K = {k:.4g} bytes" in out and f"{(4 + k):.2f}" in out.splitlines()[-1], out


def offload_accounting_case(root: str, moments: str = "fp32") -> dict:
    """Stage 3, bf16, parameter shards and optimizer states both on NVMe (this rank's own swap directory
    under ``root``): what each tier holds, and the swap files there before and after close()."""
    model = _mlp()
    swap = os.path.join(root, f"nvme{dist.get_rank()}")
    os.makedirs(swap, exist_ok=True)
    shard = sum(unit_shards(model, dist.get_world_size()))
    with zo.initialize(model, {"zero": {"stage": 3}, "train": {"precision": "bf16"}, "nvme": {"path": swap},
                               "optimizer": {"moments": moments},
                               "offload": {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}}) as engine:
        for _ in range(2):
            _one_step(engine)
        report = engine.memory_report()
        result = {"shard": shard, "bytes": {t: dict(k) for t, k in report.bytes_by_tier.items()},
                  "peaks": dict(report.peaks), "swap_files": [str(p) for p in Path(swap).rglob("*.swap")]}
    result["swap_files_left"] = [str(p) for p in Path(swap).rglob("*")]
    return result


@pytest.mark.parametrize("moments, state_bytes", [("fp32", 12), ("bf16", 8)])
def test_offloaded_states_are_accounted_on_their_tiers(rank_pools, tmp_path, moments, state_bytes):
    for result in rank_pools(2).run(offload_accounting_case, str(tmp_path), moments):
        shard, held = result["shard"], result["bytes"]
        assert held["nvme"]["param"] == 2 * shard  # bf16 shards: 2Ψ/Nd (padded)
        assert held["nvme"]["optimizer"] == state_bytes * shard  # fp32 master, m, v: 12Ψ/Nd (bf16 m, v: 8Ψ/Nd)
        assert held["device"]["param"] == held["device"]["optimizer"] == held["device"]["gathered"] == 0
        assert held["device"]["grad"] == 0 and held["nvme"]["grad"] == 0  # reduced shards go straight to the update
        # after the step only the next pass's first shards are staged in host memory (read ahead)
        assert 0 < held["host"]["buffer"] <= 2 * shard < result["peaks"]["host"]
        assert result["swap_files"] and not any(p.endswith(".swap") for p in result["swap_files_left"])  # close()
        # removes the swap files


def test_fp32_parameter_shards_on_nvme_are_read_from_the_optimizer_blocks(make_engine):
    """fp32, both on NVMe: a shard is its optimizer block's master segment, so it takes no swap space and
    the step writes only the optimizer blocks (the gradients kept for the step wait in host memory)."""
    model = _mlp()
    shard_bytes = 4 * sum(unit_shards(model, 1))
    engine = make_engine(model, {"zero": {"stage": 3}, "train": {"grad_clip": 1.0},
                                 "optimizer": {"update_in_backward": "off"},  # the step's own reads and writes
                                 "offload": {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}})
    report = engine.memory_report()
    assert report.bytes("nvme", "param") == 0 and report.bytes("nvme", "optimizer") == 3 * shard_bytes
    assert report.bytes("host", "grad") == shard_bytes and report.bytes("nvme", "grad") == 0
    for _ in range(2):
        _one_step(engine)
        io = engine.stats.io
        blocks = 3 * shard_bytes
        assert io.write_bytes == blocks  # no parameter shard written, no gradient
        assert io.read_bytes >= blocks + shard_bytes  # and each shard at least once, from the blocks
    # that the shards read are the updated masters: test_engine_equivalence's offloaded-parameter runs


def _deep_mlp(depth: int = 12) -> nn.Module:
    """Many small units: their gradient shards together outweigh the host buffers that stream one."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(64, 64) for _ in range(depth)))


@pytest.mark.parametrize("update_in_backward", ["off", "on"])  # the step's update, or a tentative one
def test_kept_gradients_wait_on_nvme_when_host_memory_cannot_hold_them(make_engine, update_in_backward):
    """[Note: where kept gradients wait]: gradient shards kept for a clipped step wait in host memory,
    but with a ``memory.host_budget`` that holds only what streaming them needs they wait on NVMe,
    written there each step; the weights trained are the same either way."""
    config = {"zero": {"stage": 3}, "train": {"grad_clip": 1.0},
              "optimizer": {"update_in_backward": update_in_backward},
              "offload": {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}}
    grad_bytes = 4 * sum(unit_shards(_deep_mlp(), 1))
    runs = {}
    for tier in ("host", "nvme"):
        engine = make_engine(_deep_mlp(), grads_waiting_on(tier, _deep_mlp(), config))
        assert engine.memory_report().bytes(tier, "grad") == grad_bytes  # where they wait
        writes = []
        for step in range(2):
            torch.manual_seed(step)
            _one_step(engine)
            writes.append(engine.stats.io.write_bytes)  # the step's
        runs[tier] = (writes, engine.full_state_dict())
        engine.close()
    blocks = 3 * grad_bytes  # fp32 master, m and v of every shard
    assert runs["host"][0] == [blocks] * 2 and runs["nvme"][0] == [blocks + grad_bytes] * 2
    for key, value in runs["host"][1].items():
        assert torch.equal(value, runs["nvme"][1][key]), key


@pytest.mark.parametrize("offload, to_device, to_host", [
    ({"optimizer": {"tier": "host"}}, 1, 1),  # up: new weights; down: reduced gradients
    ({"param": {"tier": "host"}}, 2, 1),  # up: shards for forward and backward; down: new shards
    ({"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}, 2, 1),  # up: shards; down: gradients
])
def test_host_device_link_bytes_per_step(make_engine, offload, to_device, to_host):
    """engine.stats.link: bytes across the host-device link per step, in units of the bf16 shards (2 B
    per parameter): what crosses is fixed by where each state lives (stage 3, nothing kept gathered).
    link_gbps is those bytes over the window's wall time, which lies within the time this test saw pass."""
    model = _mlp()
    shard_bytes = 2 * sum(unit_shards(model, 1))
    mark = time.perf_counter()  # before the first window opens (in initialize)
    engine = make_engine(model, {"zero": {"stage": 3, "prefetch_size": 0}, "train": {"precision": "bf16"},
                                 "offload": offload})
    for _ in range(2):
        started = time.perf_counter()
        _one_step(engine)
        seen = time.perf_counter() - mark  # covers the window: it opened as the previous step ended, after mark
        mark = started
        stats = engine.stats
        link = stats.link
        assert (link.host_to_device_bytes, link.device_to_host_bytes) == (to_device * shard_bytes, to_host * shard_bytes)
        moved = (to_device + to_host) * shard_bytes
        assert 0 < stats.seconds <= seen
        assert stats.link_gbps == pytest.approx(moved / stats.seconds / 1e9, rel=1e-9)
        assert stats.link_gbps >= moved / seen / 1e9


@pytest.mark.parametrize("clip, accum, grad_trips, grads_on", [
    (1.0, 1, 1, "host"), (1.0, 1, 1, "nvme"), (0.0, 1, 0, "host"), (1.0, 2, 2, "host"), (1.0, 2, 2, "nvme"),
    (0.0, 2, 1, "host"), (0.0, 2, 1, "nvme")])
def test_nvme_traffic_per_step_is_every_optimizer_block_once_each_way(make_engine, clip, accum, grad_trips,
                                                                       grads_on):
    """Optimizer blocks: read and written once per window. Gradient shards, when the step needs their
    global norm (clipping): written when first reduced (their norm taken then), read back, added to and
    written again for each further micro-batch, read once by the update; on NVMe only when host memory
    cannot hold them (``grads_on``), else no byte of them moves. Without clipping the closing
    micro-batch's part goes straight into the update (backward_updates' [Note: updates in backward]): one trip
    fewer, and with one micro-batch none at all and no memory kept for them."""
    model = _deep_mlp()
    config = {"zero": {"stage": 2}, "train": {"grad_clip": clip, "grad_accum_steps": accum},
              "optimizer": {"update_in_backward": "off" if clip else "auto"},
              "offload": {"optimizer": {"tier": "nvme"}}}
    engine = make_engine(model, grads_waiting_on(grads_on, model, config))
    report = engine.memory_report()
    blocks = report.bytes("nvme", "optimizer")
    grads = 4 * sum(trainable_spans(model, 1, 0))  # fp32, each unit's trainable part rounded up for O_DIRECT
    assert blocks == 3 * grads  # fp32 master, m and v over the same spans
    kept = grads if grad_trips else 0  # no memory kept for nothing
    assert (report.bytes("host", "grad"), report.bytes("nvme", "grad")) == ((kept, 0) if grads_on == "host"
                                                                            else (0, kept))
    assert report.bytes("device", "grad") == 0
    moved = blocks + (grad_trips * grads if grads_on == "nvme" else 0)
    mark = time.perf_counter()  # the first window opened in initialize, before: only the later are bounded
    for window in range(3):
        started = time.perf_counter()
        for _ in range(accum):
            _one_step(engine)
        seen = time.perf_counter() - mark if window else float("inf")
        mark = started
        if window == 0 and clip:  # the step's updates run beside the next forward: counted in the next window
            continue
        stats = engine.stats
        assert (stats.io.read_bytes, stats.io.write_bytes) == (moved, moved)
        assert 0 < stats.stall_seconds <= stats.seconds <= seen
        assert stats.io_gbps == pytest.approx(2 * moved / stats.seconds / 1e9, rel=1e-9)


@pytest.mark.parametrize("grads_on", ["host", "nvme"])
@pytest.mark.parametrize("clip, accum", [(1e9, 1), (1e-4, 1), (1e9, 2), (1e-4, 2)])
def test_nvme_traffic_of_tentative_updates_in_backward(make_engine, clip, accum, grads_on):
    """Clipping, updates in backward are tentative (backward_updates' [Note: tentative updates]): the
    blocks are kept twice on NVMe; in backward each is read and written once (aside) and the gradient
    kept as the step would keep it (in host memory, or on NVMe when host memory cannot hold it).
    Unclipped, the step commits the blocks and reads no gradient; clipped, it redoes every unit: the
    blocks once more each way and the kept gradient read."""
    model = _deep_mlp()
    config = {"zero": {"stage": 2}, "train": {"grad_clip": clip, "grad_accum_steps": accum},
              "offload": {"optimizer": {"tier": "nvme"}}}
    engine = make_engine(model, grads_waiting_on(grads_on, model, config))
    blocks = engine.memory_report().bytes("nvme", "optimizer") // 2
    grads = 4 * sum(trainable_spans(model, 1, 0))
    assert blocks == 3 * grads and engine.memory_report().bytes(grads_on, "grad") == grads
    on_nvme = int(grads_on == "nvme")
    for step in range(3):
        for _ in range(accum):
            _one_step(engine)
        redo = int(clip < 1)
        assert engine.stats.undone_updates == redo * len(engine.units)
        if step == 0 and redo:  # the redone updates run beside the next forward: counted in the next window
            continue
        io = engine.stats.io
        assert io.read_bytes == (1 + redo) * blocks + on_nvme * (accum - 1 + redo) * grads
        assert io.write_bytes == (1 + redo) * blocks + on_nvme * accum * grads


def test_fraction_splits_optimizer_state_between_the_tier_and_the_device(make_engine):
    """Whole units in order, at most the fraction: here the first two of four equal-ish units."""
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    shards = unit_shards(model, 1)
    assert len(shards) == 4
    engine = make_engine(model, {"zero": {"stage": 1}, "train": {"precision": "bf16"},
                                 "offload": {"optimizer": {"tier": "host", "fraction": 0.6}}})
    report = engine.memory_report()
    assert report.bytes("host", "optimizer") == 12 * sum(shards[:2])
    assert report.bytes("device", "optimizer") == 12 * sum(shards[2:])
    _one_step(engine)
    assert engine.memory_report().bytes("host", "optimizer") == 12 * sum(shards[:2])


def test_a_model_larger_than_ram_is_refused_before_anything_is_allocated():
    """memory.*_budget = "auto" on CPU: device and host share the RAM the machine really has. A model
    built under init_context whose states need ~40x this machine's RAM is refused in seconds, with
    the bytes per tier, before its units are materialized (RSS barely moves)."""
    import psutil
    from torch import nn

    layers = max(1, int(40 * psutil.virtual_memory().total / 16 / (8192 * 8192)))
    with zo.init_context():
        model = nn.Sequential(*(nn.Linear(8192, 8192, bias=False) for _ in range(layers)))
    rss, start = psutil.Process().memory_info().rss, time.monotonic()
    with pytest.raises(BudgetError, match=r"the run needs [\d,]+ bytes of RAM per rank \("
                                          r"(host tier [\d,]+ \(buffer [\d,]+\); )?device tier [\d,]+ \(param "
                                          r"[\d,]+, grad .*\) but this machine has [\d,]+ for it \([\d,]+ available, "
                                          r"less [\d,]+ kept for activations.*no layout of this model fits here"):
        zo.initialize(model, {"zero": {"stage": 1}})
    assert time.monotonic() - start < 30
    assert psutil.Process().memory_info().rss - rss < 200 << 20


def _planned(model, config: dict, world: int) -> dict[str, int]:
    """The bytes the engine plans per tier for ``model`` (the same on every rank of a symmetric model)."""
    from zerooffload.config import Config
    from zerooffload.memory_plan import plan_for_machine
    from zerooffload.zero.unit_layout import find_units

    config = Config.load(config)
    layouts = find_units(model, config.zero.unit_modules, world if config.zero.stage >= 1 else 1)
    _, plan = plan_for_machine(layouts, config, world, torch.device("cpu"), None)
    return {tier: sum(kinds.values()) for tier, kinds in plan.items()}


def _gpt():
    torch.manual_seed(0)
    from zerooffload.models import GPT, PRESETS
    return GPT(PRESETS["nano"])


def plan_bound_case(config: dict) -> dict:
    """Budgets set to exactly what the plan says: a run that ever held more would raise BudgetError."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    budgets = {tier: n for tier, n in _planned(_gpt(), config, world).items() if tier in ("device", "host")}
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(dist.get_rank() if
                                                                                dist.is_initialized() else 0))
    with zo.initialize(_gpt(), {**config, "memory": {f"{t}_budget": n for t, n in budgets.items()}}) as engine:
        for _ in range(2 * config.get("train", {}).get("grad_accum_steps", 1)):
            engine.backward(engine(x, x))
            engine.step()
        peaks = engine.memory_report().peaks
    return {"budgets": budgets, "peaks": dict(peaks)}


PLAN_LAYOUTS = [
    {"zero": {"stage": 2}, "offload": {"optimizer": {"tier": "host"}}},
    {"zero": {"stage": 2}, "offload": {"optimizer": {"tier": "nvme"}}, "train": {"grad_clip": 1.0}},
    {"zero": {"stage": 3}, "offload": {"optimizer": {"tier": "nvme"}, "param": {"tier": "nvme"}},
     "train": {"precision": "bf16", "grad_accum_steps": 2}},
    {"zero": {"stage": 3}, "offload": {"param": {"tier": "host"}, "optimizer": {"tier": "host"}},
     "train": {"grad_clip": 1.0, "activation_checkpointing": True}},
]


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])  # world 2 stages and exchanges
@pytest.mark.parametrize("layout", range(len(PLAN_LAYOUTS)))
def test_a_run_never_holds_more_than_its_plan(rank_pools, world, layout):
    """The plan's bounds on temporaries (one unit's update at a time, the root unit's gradient plus the
    blocks in flight, no staging at world size 1) hold on a real GPT: budgets equal to the plan, a
    byte over would raise."""
    config = PLAN_LAYOUTS[layout]
    results = [plan_bound_case(config)] if world == 1 else rank_pools(world).run(plan_bound_case, config)
    for result in results:
        for tier, budget in result["budgets"].items():
            assert 0 < result["peaks"][tier] <= budget, tier
