"""Compact optimizer states through the engine: ``optimizer.master = "split"`` and ``optimizer.moments =
"bf16"`` on every tier and stage, in checkpoints and in the accounting.

References: the same engine with an fp32 master and fp32 moments (itself checked against plain PyTorch
in test_engine_equivalence.py), which a split master must equal bit for bit, and the bytes per element
DESIGN's formula gives (4 for an fp32 master, 2 + 1/8 for a split one, 2 per bf16 moment).
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from reference import make_batches, make_model, update_errors
from zerooffload.checkpoint import consolidate
from zerooffload.config import Config, ConfigError

NVME = {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}
LAYOUTS = {
    "stage0-device": (0, {}, 0.0),
    "stage1-host": (1, {"optimizer": {"tier": "host"}}, 0.0),
    "stage2-nvme-clipped": (2, {"optimizer": {"tier": "nvme"}}, 0.05),  # tentative updates in backward
    "stage3-nvme": (3, NVME, 0.0),
}


def _config(moments: str, stage: int, offload: dict, clip: float, swap: str, master: str = "fp32",
            precision: str = "fp32") -> dict:
    return {"zero": {"stage": stage}, "train": {"grad_clip": clip, "precision": precision},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "moments": moments, "master": master}, "offload": offload,
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
    dtypes = {engine.optimizer.state[piece][name].dtype for state in engine.opt_states if state.block.resident
              for _, piece in state.pieces for name in state.moment_names}
    per_moment = {"fp32": 4, "bf16": 2, "int8": 1 + 4 / 256}[moments]  # int8: a code, and a scale per 256
    expected = sum(s.unit.trainable_span * (4 * s.has_master + len(s.moment_names) * per_moment)
                   * (2 if s.unit.placement.updates_tentatively else 1)  # a version aside until the step
                   for s in engine.opt_states)  # DESIGN: an fp32 master (unless the weights are fp32), 2 moments
    result = {"initial": initial, "final": engine.full_state_dict(), "optimizer_bytes": held, "dtypes": dtypes,
              "expected_bytes": expected}
    engine.close()
    return result


def _equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("moments, tolerance, dtype", [("bf16", 1e-2, torch.bfloat16), ("int8", 5e-2, torch.uint8)])
def test_compact_moments_follow_fp32_moments_in_fewer_bytes(make_engine, tmp_path, layout, moments, tolerance, dtype):
    fp32 = _run(make_engine, tmp_path, "fp32", layout)
    compact = _run(make_engine, tmp_path, moments, layout)
    errors = update_errors(fp32["initial"], compact["final"], fp32["final"])
    assert 0 < max(errors.values()) < tolerance, errors  # moved as fp32 moments move it, and not bitwise so
    assert fp32["optimizer_bytes"] == fp32["expected_bytes"]
    # int8: the scales of a piece's last block, partly filled, and 16-byte alignment: a few bytes more
    assert compact["expected_bytes"] <= compact["optimizer_bytes"] <= compact["expected_bytes"] * 1.01 + 1024
    assert compact["optimizer_bytes"] < fp32["optimizer_bytes"]
    assert compact["dtypes"] <= {dtype}


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_compact_moments_give_the_same_bits_on_every_tier_and_stage(make_engine, tmp_path, moments):
    """The rounding noise is keyed by parameter and element, not by shard or tier (int8 blocks start at
    each piece's first element: at world 1 the pieces are the same on every stage)."""
    runs = {layout: _run(make_engine, tmp_path, moments, layout)["final"]
            for layout in LAYOUTS if "clipped" not in layout}
    first = next(iter(runs.values()))
    assert all(_equal(first, other) for other in runs.values())


def _saved_and_continued(make_engine, config: dict, directory) -> tuple[dict, dict]:
    """Two steps, a checkpoint in ``directory``, two more: the full state when saved, and at the end."""
    engine = make_engine(make_model(0), config)
    _train(engine, 0, 2)
    engine.save_checkpoint(directory)
    saved = engine.full_state_dict()
    _train(engine, 2, 4)
    final = engine.full_state_dict()
    engine.close()
    return saved, final


def _resumed(make_engine, config: dict, directory) -> dict:
    """The full state after loading ``directory`` into a fresh engine (another init) and two steps."""
    engine = make_engine(make_model(1), config)
    engine.load_checkpoint(directory)
    _train(engine, 2, 4)
    final = engine.full_state_dict()
    engine.close()
    return final


def _stored_int8(engine) -> list[torch.Tensor]:
    return [part.clone() for state in engine.state_dicts.visit(write=False) for name in state.moment_names
            for part in state.stored_moment(name)]


@pytest.mark.parametrize("layout", ["stage1-host", "stage3-nvme"])
def test_int8_moments_load_their_codes_and_scales_as_saved(make_engine, tmp_path, layout):
    """At the saved world size a load stores int8 codes and scales as they were saved, even where a
    block's largest codes below the top (as runs before the top-code rule wrote once in 65,536 blocks,
    constructed here): decoded and encoded anew, such a block takes a new scale and 256 new codes."""
    stage, offload, clip = LAYOUTS[layout]
    (tmp_path / "swap").mkdir()
    config = _config("int8", stage, offload, clip, str(tmp_path / "swap"))
    engine = make_engine(make_model(0), config)
    _train(engine, 0, 2)
    lowered = 0
    for state in engine.state_dicts.visit(write=True):
        codes = state.stored_moment("exp_avg_sq")[0]
        top = codes == 248  # q = 1: each block's largest v
        codes[top] = 247
        lowered += int(top.sum())
    assert lowered > 10
    saved = _stored_int8(engine)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    loaded = make_engine(make_model(1), config)
    loaded.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(saved, _stored_int8(loaded),
                                                                                     strict=True))


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_a_checkpoint_of_compact_moments_resumes_bitwise_and_loads_into_fp32_moments(make_engine, tmp_path, moments):
    stage, offload, clip = LAYOUTS["stage3-nvme"]
    (tmp_path / "swap").mkdir()
    config = _config(moments, stage, offload, clip, str(tmp_path / "swap"))
    _, expected = _saved_and_continued(make_engine, config, tmp_path / "ckpt")
    assert _equal(_resumed(make_engine, config, tmp_path / "ckpt"), expected)
    widened = make_engine(make_model(1), {**config, "optimizer": {**config["optimizer"], "moments": "fp32"}})
    widened.load_checkpoint(tmp_path / "ckpt")
    narrow = make_engine(make_model(1), config)
    narrow.load_checkpoint(tmp_path / "ckpt")
    for wide_state, narrow_state in zip(widened.state_dicts.visit(write=False), narrow.state_dicts.visit(write=False)):
        narrow_state.unpack_moments()  # int8: decoded (bf16: as stored)
        for name in wide_state.moment_names:
            assert torch.equal(wide_state.moment(name), narrow_state.moment(name).float())
        narrow_state.drop_moments()


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_sgd_keeps_fp32_momentum(moments):
    with pytest.raises(ConfigError, match=rf"optimizer.moments = '{moments}' is for Adam's moments: optimizer.type = "):
        Config.load({"optimizer": {"type": "sgd", "moments": moments}})


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_compact_moments_without_the_native_pass_are_refused_by_key(make_engine, monkeypatch, moments):
    from zerooffload.optim import optimizer
    monkeypatch.setattr(optimizer, "simd_level", lambda: "torch")
    with pytest.raises(ConfigError, match=rf"optimizer.moments = '{moments}' needs the native CPU Adam pass, .* not "):
        make_engine(make_model(0), {"optimizer": {"moments": moments}})



# ------------------------------------------------------------------------------------ split masters
def _split_run(make_engine, tmp_path, master: str, layout: str, steps: int = 5, moments: str = "fp32") -> dict:
    stage, offload, clip = LAYOUTS[layout]
    swap = tmp_path / f"{master}-{moments}-{layout}"
    swap.mkdir()
    engine = make_engine(make_model(0), _config(moments, stage, offload, clip, str(swap), master, "bf16"))
    initial = engine.full_state_dict()
    written = 0
    for first in range(steps):
        _train(engine, first, first + 1)
        written += engine.stats.io.write_bytes
    report = engine.memory_report()
    spans = [(s.unit.trainable_span, 2 if s.unit.placement.updates_tentatively else 1) for s in engine.opt_states]
    result = {"initial": initial, "final": engine.full_state_dict(), "optimizer_bytes": sum(report.bytes(t, "optimizer")
                                                                           for t in report.bytes_by_tier),
              "spans": spans, "written": written, "swap": report.bytes("nvme", "optimizer") + report.bytes("nvme", "param")
              if "nvme" in report.bytes_by_tier else 0,
              "weights": {n: p.detach().clone() for n, p in engine.module.named_parameters()} if stage < 3 else {}}
    engine.close()
    return result


@pytest.mark.parametrize("layout", list(LAYOUTS)[1:])  # stage 0 keeps no optimizer shards to split apart
def test_a_split_master_trains_bitwise_as_the_fp32_master(make_engine, tmp_path, layout):
    fp32 = _split_run(make_engine, tmp_path, "fp32", layout)
    split = _split_run(make_engine, tmp_path, "split", layout)
    assert _equal(split["final"], fp32["final"]) and _equal(split["weights"], fp32["weights"])
    expected = sum((2 * span + span // 8 + 8 * span) * versions for span, versions in split["spans"])
    assert split["optimizer_bytes"] == expected < fp32["optimizer_bytes"]


def test_a_split_master_on_nvme_writes_and_keeps_fewer_bytes(make_engine, tmp_path):
    """Stage 3, parameters and optimizer on NVMe, bf16: swap bytes and bytes written per step within
    0.88 of the fp32 master's (bf16 weights 2 B + state 12 B against 2 + 10.125 B: 0.866)."""
    fp32 = _split_run(make_engine, tmp_path, "fp32", "stage3-nvme")
    split = _split_run(make_engine, tmp_path, "split", "stage3-nvme")
    assert split["swap"] <= 0.88 * fp32["swap"] and split["written"] <= 0.88 * fp32["written"], (split, fp32)


def test_a_split_master_and_int8_moments_on_nvme_keep_and_write_under_half_the_bytes(make_engine, tmp_path):
    """Stage 3, parameters and optimizer on NVMe, bf16: 2 B of weights + 2.125 of split master + 2 and
    1/32 of int8 moments against 2 + 12 B: 0.44, and training moves as with fp32 states."""
    fp32 = _split_run(make_engine, tmp_path, "fp32", "stage3-nvme")
    compact = _split_run(make_engine, tmp_path, "split", "stage3-nvme", moments="int8")
    assert compact["swap"] <= 0.46 * fp32["swap"] and compact["written"] <= 0.46 * fp32["written"], (compact, fp32)
    errors = update_errors(fp32["initial"], compact["final"], fp32["final"])
    assert 0 < max(errors.values()) < 5e-2, errors


def test_a_checkpoint_of_a_split_master_resumes_bitwise_and_consolidates_to_the_fp32_master(make_engine, tmp_path):
    stage, offload, clip = LAYOUTS["stage3-nvme"]
    (tmp_path / "swap").mkdir()
    split, fp32 = (_config("fp32", stage, offload, clip, str(tmp_path / "swap"), master, "bf16")
                   for master in ("split", "fp32"))
    saved, expected = _saved_and_continued(make_engine, split, tmp_path / "ckpt")
    for config in (split, fp32):  # the checkpoint holds the fp32 master: either format resumes it
        assert _equal(_resumed(make_engine, config, tmp_path / "ckpt"), expected)
    consolidated = load_file(consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors"))
    assert all(torch.equal(consolidated[name], value) for name, value in saved.items())


def test_writes_in_gathered_reach_a_split_master_as_they_reach_the_fp32_one(make_engine, tmp_path):
    """Where a write changes a weight, the master becomes it exactly; elsewhere it keeps its fp32 value."""
    finals = []
    for master in ("fp32", "split"):
        engine = make_engine(make_model(0), _config("fp32", 1, {"optimizer": {"tier": "host"}}, 0.0, str(tmp_path),
                                                    master, "bf16"))
        _train(engine, 0, 2)
        with engine.gathered() as module:
            for param in module.parameters():
                param.data[::3] = 0.375
        _train(engine, 2, 3)  # and it trains on from there
        finals.append(engine.full_state_dict())
        engine.close()
    assert _equal(*finals)


@pytest.mark.parametrize("overrides, line", [
    ({"train": {"precision": "fp32"}}, "optimizer.master = 'split' needs train.precision = 'bf16' (the fp32 master "
                                        "is the weight itself: there is nothing to split)"),
    ({"train": {"precision": "fp16"}}, "optimizer.master = 'split' needs train.precision = 'bf16' (fp16 weights "
                                        "keep an fp32 master"),
    ({"train": {"precision": "bf16", "grad_clip": 1.0}, "optimizer": {"master": "split", "update_in_backward": "on"}},
     "optimizer.update_in_backward = 'on' cannot go with optimizer.master = 'split' and train.grad_clip = 1.0"),
])
def test_a_split_master_is_refused_where_it_cannot_apply(overrides, line):
    config = {"optimizer": {"master": "split"}, **overrides}
    with pytest.raises(ConfigError) as info:
        Config.load(config)
    assert str(info.value).startswith(line)


@pytest.mark.parametrize("moments, ratio", [("bf16", (4 + 2 * 2) / 12), ("int8", (4 + 2 * (1 + 4 / 256)) / 12)])
def test_a_checkpoint_keeps_compact_moments_in_their_bytes(make_engine, tmp_path, moments, ratio):
    """Moments are saved as they are kept: the rank files of a compact run take the fp32 master's 4 bytes
    per element and each moment's own (bf16 2, int8 1 and a scale per 256), against 12 with fp32
    moments, and they resume bitwise (the test above)."""
    sizes = {}
    for kept in ("fp32", moments):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 256))
        engine = make_engine(model, {"zero": {"stage": 1}, "offload": {"optimizer": {"tier": "host"}},
                                     "optimizer": {"moments": kept}})
        engine.backward(engine(torch.randn(8, 512)).square().mean())
        engine.step()
        saved = engine.save_checkpoint(tmp_path / kept)
        sizes[kept] = sum(path.stat().st_size for path in saved.glob("rank*.bin"))
    pages = 2 * 2 * len(engine.units)  # each moment's values (and int8 scales) end on a 4 KiB page, per unit
    assert sizes[moments] <= ratio * sizes["fp32"] + pages * 4096, sizes


@pytest.mark.parametrize("master", ["fp32", "split"])
def test_the_swap_file_is_the_size_of_what_it_holds(make_engine, tmp_path, master):
    """The store reserves what the memory plan counts, each block in whole 4 KiB extents: a split master's
    blocks (10.125 bytes per element, not whole pages) once grew the file by a 64 MiB step past it (640 MiB
    for 582 on bench/zero3_nvme.py's model)."""
    torch.manual_seed(0)
    d, f = 256, 768  # the bench's MLP, an eighth as wide: unit shards of whole 1024-element granules
    model = torch.nn.Sequential(torch.nn.Linear(d, f), torch.nn.GELU(), torch.nn.Linear(f, d))
    stage, offload, clip = LAYOUTS["stage3-nvme"]
    engine = make_engine(model, _config("fp32", stage, offload, clip, str(tmp_path), master, "bf16"))
    engine.backward(engine(torch.randn(4, d).bfloat16()).float().square().mean())
    engine.step()
    report = engine.memory_report()
    held = report.bytes("nvme", "optimizer") + report.bytes("nvme", "param")
    size = sum(path.stat().st_size for path in tmp_path.rglob("*.swap"))
    assert held <= size < held + (1 << 20), (size, held)  # pages of alignment, never a growth step
