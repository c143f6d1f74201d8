"""``optimizer.moments = "bf16"`` through the engine: every tier and stage, checkpoints, accounting.

References: the same engine with fp32 moments (itself checked against plain PyTorch in
test_engine_equivalence.py), and the bytes DESIGN's formula gives per element (4 for the master, 2 per
bf16 moment).
"""
from __future__ import annotations

import pytest
import torch

from reference import make_batches, make_model, update_errors
from zerooffload.config import Config, ConfigError

NVME = {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}
LAYOUTS = {
    "stage0-device": (0, {}, 0.0),
    "stage1-host": (1, {"optimizer": {"tier": "host"}}, 0.0),
    "stage2-nvme-clipped": (2, {"optimizer": {"tier": "nvme"}}, 0.05),  # tentative updates in backward
    "stage3-nvme": (3, NVME, 0.0),
}


def _config(moments: str, stage: int, offload: dict, clip: float, swap: str) -> dict:
    return {"zero": {"stage": stage}, "train": {"grad_clip": clip},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "moments": moments}, "offload": offload,
            "nvme": {"path": swap}}


def _train(engine, first: int, last: int) -> None:
    for (idx, targets), in make_batches(6, 1, 4)[first:last]:
        engine.backward(engine(idx, targets))
        engine.step()


def _run(make_engine, tmp_path, moments: str, layout: str, steps: int = 5) -> dict:
    stage, offload, clip = LAYOUTS[layout]
    swap = tmp_path / f"{moments}-{layout}"
    swap.mkdir()
    engine = make_engine(make_model(0), _config(moments, stage, offload, clip, str(swap)))
    initial = engine.full_state_dict()
    _train(engine, 0, steps)
    report = engine.memory_report()
    held = sum(report.bytes(tier, "optimizer") for tier in report.bytes_by_tier)
    dtypes = {state.moment(name).dtype for state in engine.opt_states for name in state.moment_names
              if state.block.resident}
    expected = sum(s.unit.trainable_span * (4 * s.has_master + len(s.moment_names) * (2 if moments == "bf16" else 4))
                   * (2 if s.unit.placement.updates_tentatively else 1)  # a version aside until the step
                   for s in engine.opt_states)  # DESIGN: an fp32 master (unless the weights are fp32), 2 moments
    result = {"initial": initial, "final": engine.full_state_dict(), "optimizer_bytes": held, "dtypes": dtypes,
              "expected_bytes": expected}
    engine.close()
    return result


def _equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_moments_follow_fp32_moments_in_fewer_bytes(make_engine, tmp_path, layout):
    fp32 = _run(make_engine, tmp_path, "fp32", layout)
    bf16 = _run(make_engine, tmp_path, "bf16", layout)
    errors = update_errors(fp32["initial"], bf16["final"], fp32["final"])
    assert 0 < max(errors.values()) < 1e-2, errors  # moved as fp32 moments move it, and not bitwise so
    assert bf16["optimizer_bytes"] == bf16["expected_bytes"] < fp32["optimizer_bytes"] == fp32["expected_bytes"]
    assert bf16["dtypes"] <= {torch.bfloat16}


def test_bf16_moments_give_the_same_bits_on_every_tier_and_stage(make_engine, tmp_path):
    """The rounding noise is keyed by parameter and element, not by shard or tier."""
    runs = {layout: _run(make_engine, tmp_path, "bf16", layout)["final"]
            for layout in LAYOUTS if "clipped" not in layout}
    first = next(iter(runs.values()))
    assert all(_equal(first, other) for other in runs.values())


def test_a_checkpoint_of_bf16_moments_resumes_bitwise_and_loads_into_fp32_moments(make_engine, tmp_path):
    stage, offload, clip = LAYOUTS["stage3-nvme"]
    (tmp_path / "swap").mkdir()
    config = _config("bf16", stage, offload, clip, str(tmp_path / "swap"))
    straight = make_engine(make_model(0), config)
    _train(straight, 0, 2)
    straight.save_checkpoint(tmp_path / "ckpt")
    _train(straight, 2, 4)
    expected = straight.full_state_dict()
    straight.close()
    resumed = make_engine(make_model(1), config)
    resumed.load_checkpoint(tmp_path / "ckpt")
    _train(resumed, 2, 4)
    assert _equal(resumed.full_state_dict(), expected)
    resumed.close()
    widened = make_engine(make_model(1), {**config, "optimizer": {**config["optimizer"], "moments": "fp32"}})
    widened.load_checkpoint(tmp_path / "ckpt")
    narrow = make_engine(make_model(1), config)
    narrow.load_checkpoint(tmp_path / "ckpt")
    for wide_state, narrow_state in zip(widened.state_dicts.visit(write=False), narrow.state_dicts.visit(write=False)):
        for name in wide_state.moment_names:
            assert torch.equal(wide_state.moment(name), narrow_state.moment(name).float())


def test_sgd_keeps_fp32_momentum():
    with pytest.raises(ConfigError, match=r"optimizer.moments = 'bf16' is for Adam's moments: optimizer.type = 'sgd'"):
        Config.load({"optimizer": {"type": "sgd", "moments": "bf16"}})


def test_bf16_moments_without_the_native_pass_are_refused_by_key(make_engine, monkeypatch):
    from zerooffload.optim import optimizer
    monkeypatch.setattr(optimizer, "simd_level", lambda: "torch")
    with pytest.raises(ConfigError, match=r"optimizer.moments = 'bf16' needs the native CPU Adam pass, .* not built"):
        make_engine(make_model(0), {"optimizer": {"moments": "bf16"}})

