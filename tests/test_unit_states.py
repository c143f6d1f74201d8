"""Units as state machines (partition's [Note: unit states]): the states a real engine's units pass
through over windows (accumulation, reduction, updates in backward, a skipped window, stage 3's
gathers), that a move the note does not list raises naming the unit and both states, and that only a
unit's own methods change its fields."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import zerooffload
from reference import InfGrad, PoisonAfter, make_batches, make_model
from zerooffload.zero.partition import GradState, ParamState, UnitStateError

HOST = {"optimizer": {"tier": "host"}}


def _config(stage: int, *, accum: int = 1, offload: dict | None = None, **zero) -> dict:
    return {"zero": {"stage": stage, "persist_threshold": 0, **zero},
            "train": {"grad_accum_steps": accum, "grad_clip": 0.0}, "optimizer": {"lr": 1e-2},
            "offload": offload or {}}


def _grad_states(engine) -> dict[str, GradState]:
    return {unit.name: unit.grad_state for unit in engine.units}


def _all(engine, state: GradState) -> dict[str, GradState]:
    return {unit.name: state for unit in engine.units}


def _unit(engine, name: str):
    return next(unit for unit in engine.units if unit.name == name)


def _seen_during_backward(engine, name: str, param: nn.Parameter) -> list[GradState]:
    """``name``'s gradient state each time ``param``'s gradient has just been accumulated (a hook
    registered after the engine's, so it runs after it)."""
    seen: list[GradState] = []
    param.register_post_accumulate_grad_hook(lambda p: seen.append(_unit(engine, name).grad_state))
    return seen


def test_stage_2_accumulates_and_reduces_each_micro_batch_then_the_step_empties(make_engine):
    model = make_model()
    engine = make_engine(model, _config(2, accum=2, overlap_comm=False))  # reduced after backward: observable
    assert [u.index for u in engine.units] == list(range(len(engine.units)))
    assert _grad_states(engine) == _all(engine, GradState.EMPTY)
    seen = _seen_during_backward(engine, "blocks.2", model.blocks[2].fc1.weight)
    (first, second), = make_batches(1, 2, 2)
    engine.backward(engine(*first))
    assert seen == [GradState.ACCUMULATING]
    assert _grad_states(engine) == _all(engine, GradState.REDUCED)
    assert engine.step() is False  # mid-window: nothing changes
    assert _grad_states(engine) == _all(engine, GradState.REDUCED)
    engine.backward(engine(*second))
    assert seen == [GradState.ACCUMULATING] * 2  # REDUCED → ACCUMULATING: the next micro-batch
    assert _grad_states(engine) == _all(engine, GradState.REDUCED)
    assert engine.step() is True
    assert _grad_states(engine) == _all(engine, GradState.EMPTY)


@pytest.mark.parametrize("stage", [0, 1])
def test_stages_0_and_1_accumulate_the_whole_window_and_reduce_in_the_backward_that_closes_it(make_engine, stage):
    engine = make_engine(make_model(), _config(stage, accum=2))
    first, last = make_batches(1, 2, 2)[0]
    engine.backward(engine(*first))
    assert _grad_states(engine) == _all(engine, GradState.ACCUMULATING)
    assert engine.step() is False
    engine.backward(engine(*last))
    assert _grad_states(engine) == _all(engine, GradState.REDUCED)  # reduced as backward completed each unit
    assert engine.step() is True
    assert _grad_states(engine) == _all(engine, GradState.EMPTY)


@pytest.mark.parametrize("accum", [1, 2])
def test_units_updated_in_backward_end_the_window_updated_with_the_norm_they_used(make_engine, accum):
    engine = make_engine(make_model(), _config(2, accum=accum, offload=HOST))  # no clip: updates in backward
    assert all(u.placement.updates_in_backward and u.grad_leaves for u in engine.units)
    micro_batches = make_batches(1, accum, 2)[0]
    for micro_batch in micro_batches[:-1]:
        engine.backward(engine(*micro_batch))
        assert _grad_states(engine) == _all(engine, GradState.REDUCED)  # kept on the host tier
        assert all(u.offloaded_grad.written for u in engine.units)
        engine.step()
    engine.backward(engine(*micro_batches[-1]))
    assert _grad_states(engine) == _all(engine, GradState.UPDATED)
    assert all(u.updated_in_backward for u in engine.units)
    assert engine.step() is True
    assert _grad_states(engine) == _all(engine, GradState.EMPTY)
    assert not any(u.updated_in_backward for u in engine.units)


def test_a_window_skipped_in_backward_leaves_every_unit_discarded_until_the_step(make_engine):
    model = make_model()
    model.blocks[2] = PoisonAfter(model.blocks[2])  # the first unit to update in backward gets inf
    engine = make_engine(model, _config(2, offload=HOST))
    (batch,), = make_batches(1, 1, 2)
    InfGrad.armed = True
    try:
        engine.backward(engine(*batch))
    finally:
        InfGrad.armed = False
    assert _grad_states(engine) == _all(engine, GradState.DISCARDED)
    assert engine.step() is False
    assert _grad_states(engine) == _all(engine, GradState.EMPTY)


def test_stage_3_units_are_sharded_between_uses_and_gathered_while_computing(make_engine):
    model = make_model()
    engine = make_engine(model, _config(3))
    assert all(u.partitioned for u in engine.units)

    def param_states() -> dict[str, ParamState]:
        return {unit.name: unit.param_state for unit in engine.units}

    sharded = {unit.name: ParamState.SHARDED for unit in engine.units}
    assert param_states() == sharded
    seen: list[ParamState] = []
    model.blocks[1].register_forward_pre_hook(lambda module, args: seen.append(_unit(engine, "blocks.1").param_state))
    (batch,), = make_batches(1, 1, 2)
    engine.backward(engine(*batch))
    assert seen == [ParamState.GATHERED] * 2  # block 1 runs twice
    assert param_states() == sharded
    engine.step()
    assert param_states() == sharded
    with engine.gathered():
        assert param_states() == {unit.name: ParamState.GATHERED for unit in engine.units}
    assert param_states() == sharded


def test_a_move_the_note_does_not_list_raises_naming_the_unit_and_both_states(make_engine):
    engine = make_engine(make_model(), _config(3))
    unit, tier = _unit(engine, "blocks.1"), engine.state.compute
    with pytest.raises(UnitStateError, match=r"unit 'blocks\.1': cannot reshard: its parameters are SHARDED, and "
                                             r"reshard moves them from GATHERED to SHARDED"):
        unit.reshard(tier)
    buffer = unit.begin_gather(tier)
    assert unit.param_state is ParamState.GATHERING and buffer is unit.flat_param
    with pytest.raises(UnitStateError, match=r"unit 'blocks\.1': cannot begin_gather: its parameters are "
                                             r"GATHERING, and begin_gather moves them from SHARDED to GATHERING"):
        unit.begin_gather(tier)
    with pytest.raises(UnitStateError, match=r"cannot reshard: its parameters are GATHERING"):
        unit.reshard(tier)  # an all-gather in flight is waited for first
    assert unit.param_state is ParamState.GATHERING  # a refused move changes nothing
    unit.finish_gather()
    unit.reshard(tier)
    assert unit.param_state is ParamState.SHARDED
    with pytest.raises(UnitStateError, match=r"unit 'blocks\.1': cannot local_grad: its gradients are EMPTY, and "
                                             r"local_grad needs them REDUCED"):
        unit.local_grad()


def test_an_updated_unit_takes_no_more_gradients_and_a_stage_0_reduced_unit_none_before_the_step(make_engine):
    engine = make_engine(make_model(), _config(2, offload=HOST))
    (batch,), = make_batches(1, 1, 2)
    engine.backward(engine(*batch))
    unit, tier = _unit(engine, "blocks.0"), engine.state.compute
    grad = torch.zeros(unit.layout.slots[0].shape)
    with pytest.raises(UnitStateError, match=r"unit 'blocks\.0': cannot accumulate: its gradients are UPDATED, and "
                                             r"accumulate moves them from EMPTY, ACCUMULATING or REDUCED to "
                                             r"ACCUMULATING"):
        unit.accumulate(0, grad, tier)
    assert unit.grad_state is GradState.UPDATED
    with pytest.raises(UnitStateError, match=r"unit 'blocks\.0': cannot begin_backward: its gradients are UPDATED"):
        unit.begin_backward()

    stage_0 = make_engine(make_model(), _config(0))
    unit, tier = _unit(stage_0, "blocks.0"), stage_0.state.compute
    unit.begin_reduction(tier)
    unit.reduced_in_place()
    with pytest.raises(UnitStateError, match=r"unit 'blocks\.0': cannot accumulate: its gradients are REDUCED, and "
                                             r"accumulate moves them from EMPTY or ACCUMULATING to ACCUMULATING"):
        unit.accumulate(0, grad, tier)
    with pytest.raises(UnitStateError, match=r"cannot reduced_in_place: its gradients are REDUCED"):
        unit.reduced_in_place()  # reduced twice in a window


def test_what_the_placement_decided_is_read_only(make_engine):
    engine = make_engine(make_model(), _config(2, offload=HOST))
    unit = engine.units[0]
    for name in ("index", "partitioned", "keep_full_grad", "keep_grad_shard", "grad_leaves", "master_is_param",
                 "param_state", "grad_state", "offloaded_grad", "updated_in_backward"):
        with pytest.raises(AttributeError):
            setattr(unit, name, getattr(unit, name))
    with pytest.raises(UnitStateError, match=r"unit 'blocks\.0': keep_grads_on needs"):
        unit.keep_grads_on(None)  # after materialize: too late, and not where this placement keeps them


def _outside_writes() -> list[str]:
    """Assignments to a unit's attribute outside partition.py: ``unit.x = ``, ``u.x = ``, ``….unit.x = ``."""
    package = Path(zerooffload.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "partition.py" and path.parent == package:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for part in ast.walk(target):
                    if not (isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store)):
                        continue
                    owner = part.value
                    if ((isinstance(owner, ast.Name) and owner.id in ("unit", "u"))
                            or (isinstance(owner, ast.Attribute) and owner.attr == "unit")):
                        found.append(f"{path.relative_to(package)}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_only_a_units_own_methods_change_its_fields():
    assert _outside_writes() == []


ALL_THREADS = torch.profiler._ExperimentalConfig(profile_all_threads=True)
"""Updates in backward run on the update worker (update_worker's note): its labels are another thread's."""


def test_a_profiled_stage_3_step_shows_its_gathers_and_publications(make_engine):
    engine = make_engine(make_model(), _config(3, offload=HOST))
    (batch,), = make_batches(1, 1, 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=ALL_THREADS) as profile:
        engine.backward(engine(*batch))
        engine.step()
    counts = {name: sum(1 for event in profile.events() if event.name == name)
              for name in ("zerooffload::gather", "zerooffload::publish")}
    assert counts["zerooffload::gather"] >= 2 * len(engine.units)  # launched and waited for, each unit at least once
    assert counts["zerooffload::publish"] >= len(engine.units)  # each unit's new shard sent home, then finished


LABELS = ("gather", "all_gather", "reduce_scatter", "block_read", "block_write", "block_wait", "optimizer_update",
          "publish")


def profiled_labels(tmp: str) -> dict[str, int]:
    """One stage-3 step with parameters and optimizer on NVMe, profiled: how often each label ran."""
    config = {**_config(3, offload={"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}),
              "nvme": {"path": tmp}}
    (batch,), = make_batches(1, 1, 2)
    with zerooffload.initialize(make_model(), config) as engine:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    experimental_config=ALL_THREADS) as profile:
            engine.backward(engine(*batch))
            engine.step()
    names = [event.name for event in profile.events()]
    return {label: names.count(f"zerooffload::{label}") for label in LABELS}


def test_a_profiled_nvme_step_at_world_2_shows_every_phase_label(rank_pools, tmp_path):
    for counts in rank_pools(2).run(profiled_labels, str(tmp_path)):
        assert {label: n for label, n in counts.items() if n == 0} == {}
