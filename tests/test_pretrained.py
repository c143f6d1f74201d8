"""load_safetensors: published-style files (sharded with an index, key prefix, bf16) into any layout."""
from __future__ import annotations

import json

import pytest
import torch

import zerooffload as zo
from reference import make_model

safetensors = pytest.importorskip("safetensors.torch")


def write_published(directory: str, dtype: torch.dtype) -> dict:
    """The reference model's weights as two shards plus an index, keys prefixed "model."; returns them."""
    weights = {k: v.to(dtype).clone() for k, v in make_model(seed=7).state_dict().items()}
    keys = sorted(weights)
    shards = {"part-1.safetensors": keys[:len(keys) // 2], "part-2.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        safetensors.save_file({f"model.{k}": weights[k] for k in part}, f"{directory}/{name}")
    index = {"weight_map": {f"model.{k}": name for name, part in shards.items() for k in part}}
    with open(f"{directory}/model.safetensors.index.json", "w") as f:
        json.dump(index, f)
    return weights


def load_case(directory: str, stage: int, offload: dict, dtype: torch.dtype) -> dict:
    """Every rank: load the files, then compare every weight (gathered to every rank) with the files' and
    an eval forward on the whole batch with plain PyTorch's on those weights."""
    with zo.initialize(make_model(seed=0), {"zero": {"stage": stage}, "offload": offload}) as engine:
        zo.load_safetensors(engine, directory, prefix="model.")
        full = engine.full_state_dict(all_ranks=True)
        weights = {k: v.to(dtype).float() for k, v in make_model(seed=7).state_dict().items()}
        x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            engine.eval()
            loss = engine(x, x)
            plain = make_model(seed=0)
            plain.load_state_dict(weights)
            expected = plain.eval()(x, x)
    return {"keys": sorted(full) == sorted(weights), "differ": [k for k in weights if not torch.equal(full[k], weights[k])],
            "loss": float(loss), "expected": float(expected)}


def _check_loaded(result: dict) -> None:
    assert result["keys"] and result["differ"] == []
    assert result["loss"] == pytest.approx(result["expected"], abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_prefixed_files_load_into_stage_3_on_nvme(rank_pools, tmp_path, dtype):
    write_published(str(tmp_path), dtype)
    offload = {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}
    for result in rank_pools(2).run(load_case, str(tmp_path), 3, offload, dtype):
        _check_loaded(result)


def test_load_at_world_size_1_stage_1(tmp_path):
    write_published(str(tmp_path), torch.float32)
    _check_loaded(load_case(str(tmp_path), 1, {}, torch.float32))


def test_missing_unexpected_and_misshapen_keys_are_named(tmp_path, make_engine):
    weights = make_model().state_dict()
    bad = {k: v.clone() for k, v in weights.items() if k not in ("head.weight", "embed.weight", "ln_f.bias")}
    bad["ln_f.weight"] = torch.zeros(3)
    bad["extra.weight"] = torch.zeros(2)
    safetensors.save_file(bad, str(tmp_path / "model.safetensors"))
    engine = make_engine(make_model(), {"zero": {"stage": 2}})
    with pytest.raises(ValueError, match=r"shapes differ: \['ln_f.weight: file \[3\], model \[48\]'\]; "
                                         r"not in the files: \['embed.weight', 'ln_f.bias'\]; "
                                         r"not in the model: \['extra.weight'\]"):
        zo.load_safetensors(engine, tmp_path)
