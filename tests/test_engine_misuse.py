"""Misuse and poison: backward twice without step, calls on a closed engine, odd param_groups,
inf/NaN losses and gradients (``train.skip_nonfinite``), and failures inside collectives the user
drives (``gathered``, ``load_safetensors``) that must not strand the other ranks or end the user's
own process group."""
from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

import zerooffload as zo
from reference import InfGrad, PoisonAfter, make_batches, make_model

NVME = {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _config(stage: int, clip: float = 0.0, offload: dict | None = None, **train) -> dict:
    return {"zero": {"stage": stage, "persist_threshold": 0}, "train": {"grad_clip": clip, **train},
            "optimizer": {"lr": 1e-2}, "offload": offload or {}}


def _backward(engine, batch, poison: float = 1.0) -> None:
    rank, world = _rank_world()
    idx, targets = batch
    rows = slice(rank * len(idx) // world, (rank + 1) * len(idx) // world)
    engine.backward(engine(idx[rows], targets[rows]) * poison)


# ---------------------------------------------------------------------------------------------- misuse
@pytest.mark.parametrize("offload", [None, {"optimizer": {"tier": "nvme"}}])
def test_backward_twice_without_step_is_refused(make_engine, offload):
    engine = make_engine(make_model(), _config(2, offload=offload))
    (batch,), = make_batches(1, 1, 2)
    _backward(engine, batch)
    with pytest.raises(RuntimeError, match=r"backward\(\) called again before step\(\): with "
                                           r"train.grad_accum_steps = 1"):
        _backward(engine, batch)
    assert engine.step()  # the first window still updates, once


def test_every_call_on_a_closed_engine_says_so(tmp_path, make_engine):
    engine = make_engine(make_model(), _config(3, offload=NVME))
    (batch,), = make_batches(1, 1, 2)
    _backward(engine, batch)
    engine.step()
    engine.save_checkpoint(tmp_path)
    engine.close()
    engine.close()  # twice is fine
    calls = {"forward": lambda: engine(*batch), "backward": lambda: engine.backward(torch.ones(())),
             "step": engine.step, "save_checkpoint": lambda: engine.save_checkpoint(tmp_path),
             "load_checkpoint": lambda: engine.load_checkpoint(tmp_path), "full_state_dict": engine.full_state_dict,
             "gathered": lambda: engine.gathered().__enter__(), "memory_report": engine.memory_report,
             "train": engine.train, "load_safetensors": lambda: zo.load_safetensors(engine, tmp_path)}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="engine is closed"):
            call()
            pytest.fail(f"{name} ran on a closed engine")


def _trained(param_groups=None, steps: int = 2) -> dict:
    model = make_model()
    groups = param_groups(model) if param_groups else None
    with zo.initialize(model, _config(1), param_groups=groups) as engine:
        for (batch,) in make_batches(steps, 1, 2):
            _backward(engine, batch)
            engine.step()
        return engine.full_state_dict()


def test_a_plain_list_of_parameters_is_one_group_as_in_torch():
    default = _trained()
    listed = _trained(lambda m: [p for p in m.parameters() if p.requires_grad])
    generator = _trained(lambda m: (p for p in m.parameters() if p.requires_grad))
    for name in default:
        assert torch.equal(listed[name], default[name]) and torch.equal(generator[name], default[name]), name


@pytest.mark.parametrize("groups, error, message", [
    (lambda m: [{"params": [m.embed.weight]}, {"params": [m.embed.weight, *m.blocks.parameters()]}], ValueError,
     r"parameter 'embed.weight' is in param_groups\[0\] and param_groups\[1\]"),
    (lambda m: [{"params": [*m.parameters(), torch.nn.Parameter(torch.zeros(3, 5))]}], ValueError,
     r"param_groups\[0\]: a tensor \[3, 5\] that is not a parameter of the model"),
    (lambda m: [{"params": list(m.parameters()), "lr": "fast"}], TypeError,
     r"param_groups\[0\]\['lr'\] = 'fast': expected a number"),
    (lambda m: [{"params": list(m.parameters()), "betas": (0.9,)}], TypeError,
     r"param_groups\[0\]\['betas'\] = \(0.9,\): expected two numbers"),
    (lambda m: [{"lr": 0.1}], TypeError, r"param_groups\[0\]: expected a dict with 'params'"),
    (lambda m: {"params": list(m.parameters())}, TypeError, "must be an iterable of parameters or of dicts"),
])
def test_bad_param_groups_are_refused_by_name(groups, error, message):
    model = make_model()
    with pytest.raises(error, match=message):
        zo.initialize(model, _config(1), param_groups=groups(model))


# ---------------------------------------------------------------------------------------------- non-finite
POISONED = 2
"""The window whose loss is multiplied by NaN (on the last rank only)."""


def nonfinite_case(stage: int, clip: float, offload: dict | None, skip: bool = True) -> dict | None:
    """Train 4 windows with window POISONED's loss NaN on the last rank, and 3 windows without that
    window at all; rank 0 returns both states and what the engine reported."""
    rank, world = _rank_world()
    batches = make_batches(4, 1, 2 * world, seed=4)
    states = []
    for poisoned in (True, False):
        with zo.initialize(make_model(), _config(stage, clip, offload, skip_nonfinite=skip)) as engine:
            for number, (batch,) in enumerate(batches):
                if number == POISONED and not poisoned:
                    continue
                bad = poisoned and number == POISONED and rank == world - 1
                _backward(engine, batch, poison=float("nan") if bad else 1.0)
                updated = engine.step()
                if number == POISONED and poisoned:
                    skipped_update = updated
            states.append((engine.full_state_dict(), engine.stats.skipped_steps))
    if rank:
        return None
    (poisoned, skipped), (clean, _) = states
    return {"poisoned": poisoned, "clean": clean, "skipped": skipped, "updated": skipped_update}


@pytest.mark.parametrize("world, stage, clip, offload", [
    (1, 2, 0.0, {"optimizer": {"tier": "nvme"}}),  # updates in backward
    (1, 3, 0.5, NVME),                              # updates in the step, after the global norm
    (2, 1, 0.0, None),
    (2, 3, 0.0, NVME),                              # NaN on rank 1 only, updates in backward on both
])
def test_a_nonfinite_loss_skips_the_window_on_every_rank(rank_pools, world, stage, clip, offload):
    """The poisoned window changes nothing: the run equals one that never saw that batch, bitwise."""
    args = (nonfinite_case, stage, clip, offload)
    result = rank_pools(world).run(*args)[0] if world > 1 else nonfinite_case(*args[1:])
    assert result["skipped"] == 1 and result["updated"] is False
    for name, value in result["clean"].items():
        assert torch.equal(result["poisoned"][name], value), name


def test_skip_nonfinite_off_updates_with_nan_as_torch_does():
    result = nonfinite_case(2, 0.0, None, skip=False)
    assert result["skipped"] == 0 and result["updated"] is True
    assert torch.isnan(result["poisoned"]["blocks.0.fc1.weight"]).all()


def skip_streak_case(tmp: str) -> dict:
    """One good window and a checkpoint, then NaN losses (on the last rank only) until the engine stops
    (train.max_skip_streak = 3): what each rank saw."""
    rank, world = _rank_world()
    batches = make_batches(6, 1, 2 * world, seed=5)
    with zo.initialize(make_model(), _config(2, max_skip_streak=3)) as engine:
        _backward(engine, batches[0][0])
        engine.step()
        saved = engine.save_checkpoint(tmp)
        for number, (batch,) in enumerate(batches[1:], start=1):
            _backward(engine, batch, poison=float("nan") if rank == world - 1 else 1.0)
            try:
                engine.step()
            except zo.SkipStreakError as error:
                return {"window": number, "message": str(error), "checkpoint": error.checkpoint, "saved": str(saved),
                        "skipped": engine.window.skipped_steps}
    return {"window": None}


@pytest.mark.parametrize("world", [1, 2])
def test_a_streak_of_skipped_windows_stops_every_rank_naming_the_checkpoint_before_it(rank_pools, tmp_path, world):
    """The third NaN window in a row raises SkipStreakError on every rank (each its own, no group torn
    down), naming the checkpoint saved before the first skip."""
    results = rank_pools(world).run(skip_streak_case, str(tmp_path)) if world > 1 else [skip_streak_case(str(tmp_path))]
    for result in results:
        assert result["window"] == 3 and result["skipped"] == 3, result
        assert result["checkpoint"] == result["saved"] == f"{tmp_path}/step00000001"
        assert re.fullmatch(r"3 optimizer steps in a row were skipped for non-finite values \(the last, step 4: "
                            r"non-finite loss on 1 rank\(s\); train.max_skip_streak = 3\): .* the model is as it "
                            rf"was after step 1; the last checkpoint saved before the first skip: {tmp_path}/step00000001"
                            r"\. Lower optimizer.lr .*", result["message"]), result["message"]


def test_fp16_overflows_do_not_count_toward_a_skip_streak():
    """Every window overflows the loss scale (2^64): expected of fp16, so no stop however many there are."""
    config = {**_config(1, max_skip_streak=2), "train": {"precision": "fp16", "initial_scale_power": 64,
                                                         "max_skip_streak": 2}}
    with zo.initialize(make_model(), config) as engine:
        for (batch,) in make_batches(4, 1, 2, seed=5):
            _backward(engine, batch)
            assert engine.step() is False
        assert engine.window.skipped_steps == 4 and engine.window.streak.length == 0


@pytest.mark.parametrize("poisoned_block, clip, outcome", [(2, 0.0, "skipped"), (0, 0.0, "raises"),
                                                          (0, 1.0, "skipped")])
def test_a_nonfinite_gradient_with_a_finite_loss(tmp_path, make_engine, poisoned_block, clip, outcome):
    """Without clipping, blocks update in backward last to first. An inf gradient reaching the first
    unit to update (everything below block 2's output) skips the window; one found after blocks 2 and
    1 updated (below block 0) cannot be undone: a clear error naming the unit and the last checkpoint.
    With clipping those updates were tentative (backward_updates' [Note: tentative updates]): undone, their
    weights published again from the old masters, and the window skipped."""
    def build():
        model = make_model()
        model.blocks[poisoned_block] = PoisonAfter(model.blocks[poisoned_block])
        return make_engine(model, _config(2, clip, offload={"optimizer": {"tier": "nvme"}}))

    engine = build()
    try:
        (good,), (bad,) = make_batches(2, 1, 2, seed=6)
        _backward(engine, good)
        engine.step()
        engine.save_checkpoint(tmp_path)
        before = engine.full_state_dict()
        InfGrad.armed = True
        if outcome == "raises":
            with pytest.raises(RuntimeError, match=rf"unit 'blocks.0' has a non-finite .* after 2 unit\(s\) were "
                                                   rf"already updated .* last good checkpoint \({tmp_path}/step"):
                _backward(engine, bad)
            return
        _backward(engine, bad)
        assert engine.step() is False and engine.stats.skipped_steps == 1
        after = engine.full_state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())
        InfGrad.armed = False
        _backward(engine, good)
        assert engine.step()  # and training goes on, from the weights as they were: as from the checkpoint
        twin = build()
        twin.load_checkpoint(tmp_path)
        _backward(twin, good)
        twin.step()
        assert all(torch.equal(v, engine.full_state_dict()[k]) for k, v in twin.full_state_dict().items())
    finally:
        InfGrad.armed = False


# ---------------------------------------------------------------------------------------------- failing together
def fail_inside(where: str, directory: str) -> dict:
    """Every rank: rank 1 fails inside ``where`` (a collective the user drives); each rank reports what
    it raised and how long it took, then proves the user's own (default) group still works."""
    rank, _ = _rank_world()
    with zo.initialize(make_model(), _config(1)) as engine:
        start, error = time.monotonic(), None
        try:
            if where == "gathered":
                with engine.gathered():
                    if rank == 1:
                        raise ValueError("planted failure inside gathered()")
            else:
                zo.load_safetensors(engine, directory if rank == 0 else directory + "-missing")
            (batch,), = make_batches(1, 1, 4)  # a peer that got through meets the failure in its next collective
            _backward(engine, batch)
            engine.step()
        except Exception as exc:  # what each rank saw is the result
            error = f"{type(exc).__name__}: {exc}"
        seconds = time.monotonic() - start
    total = torch.ones(1)
    dist.all_reduce(total)  # the user's process group is alive
    return {"error": error, "seconds": seconds, "world": float(total)}


@pytest.mark.parametrize("where", ["gathered", "load_safetensors"])
def test_a_failure_inside_a_user_collective_stops_every_rank_and_spares_the_users_group(rank_pools, tmp_path,
                                                                                        where):
    safetensors = pytest.importorskip("safetensors.torch")
    safetensors.save_file({k: v.contiguous() for k, v in make_model().state_dict().items()
                           if k != "head.weight"}, str(tmp_path / "model.safetensors"))
    healthy, failed = rank_pools(2).run(fail_inside, where, str(tmp_path))
    planted = "planted failure inside gathered()" if where == "gathered" else "-missing"
    assert planted in failed["error"]
    assert healthy["error"].startswith("EngineGroupEnded: stopped because rank 1:") and planted in healthy["error"]
    assert healthy["seconds"] < 20 and failed["seconds"] < 20
    assert healthy["world"] == failed["world"] == 2
