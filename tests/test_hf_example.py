"""examples/hf_finetune.py, run as a user runs it: a transformers Llama fine-tuned at ZeRO-3 on NVMe,
exported, reloaded with ``from_pretrained``; then LoRA on that export, with the base frozen.

Every check is against something the engine did not produce: the export loaded by transformers in
this process, the base model's file on disk, parameter counts from the model's config.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_finetune.py"
LORA_RANK = 4
ADAM_BYTES_PER_PARAM = 12
"""fp32 master + two fp32 Adam moments (README/DESIGN's K = 12)."""
SEGMENT_SLACK = 3 * 4096
"""Per unit and rank, what alignment may add to the three segments (master, two moments): O_DIRECT
writes and shards are 4 KiB-aligned (``unit_layout.ALIGN_ELEMENTS``)."""


def _run(launcher: list[str], out: Path, *args: str, timeout: int = 240) -> dict:
    nvme = out.parent / f"{out.name}-nvme"
    nvme.mkdir(parents=True)
    run = subprocess.run([*launcher, str(EXAMPLE), "--out", str(out), "--nvme", str(nvme), *args],
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    left = [p.name for p in (nvme / "zerooffload-swap").iterdir() if p.name != ".lock"]
    assert not left, f"swap files left behind: {left}"
    return json.loads((out / "summary.json").read_text())


def test_a_missing_model_dir_is_one_line(tmp_path):
    """The example's own argument check, run in this process (a SystemExit with a message: Python prints
    it as the one line on stderr and exits with status 1)."""
    spec = importlib.util.spec_from_file_location("hf_finetune", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with pytest.raises(SystemExit) as stop:
        example.parse_args(["--model-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert str(stop.value.code).splitlines() == [
        f"hf_finetune: --model-dir {tmp_path / 'missing'}: no config.json there; pass a local Hugging Face "
        "checkpoint (config.json and *.safetensors), e.g. OUT/model of an earlier run"]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """A full fine-tune of the tiny Llama, one process."""
    out = tmp_path_factory.mktemp("hf") / "full"
    return out, _run([sys.executable], out)


@pytest.fixture(scope="module")
def lora(full, tmp_path_factory):
    """LoRA on the full run's export (``--model-dir``), one process."""
    out = tmp_path_factory.mktemp("hf") / "lora"
    return out, _run([sys.executable], out, "--model-dir", str(full[0] / "model"), "--lora", str(LORA_RANK))


def _hf_config(model_dir: Path):
    return transformers.AutoConfig.from_pretrained(model_dir)


def _adapter_params(config, rank: int) -> int:
    """q_proj and v_proj adapters of every layer: A (r × in) + B (out × r), from the config alone."""
    head_dim = config.hidden_size // config.num_attention_heads
    q_out, v_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return config.num_hidden_layers * rank * (config.hidden_size + q_out + config.hidden_size + v_out)


def _reproduces_engine_logits(out: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
    probe = torch.load(out / "probe.pt")
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], use_cache=False).logits
    torch.testing.assert_close(logits, probe["engine_logits"], atol=1e-4, rtol=1e-4)
    fresh = transformers.AutoModelForCausalLM.from_config(_hf_config(out / "model"))
    with safetensors.safe_open(out / "model" / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(fresh.state_dict())


def test_full_finetune_export_loads_with_from_pretrained(full):
    out, summary = full
    assert summary["world_size"] == 1 and summary["lora_rank"] == 0
    assert all(0 < loss < 10 for loss in summary["losses"])
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.5  # 5.5 -> 4.1 measured
    assert summary["logits_max_diff"]["full_state_dict"] < 1e-5
    _reproduces_engine_logits(out)
    plain = transformers.AutoModelForCausalLM.from_config(_hf_config(out / "model"))
    assert summary["params_trainable"] == summary["params_total"] == sum(p.numel() for p in plain.parameters())


@pytest.mark.slow
def test_lora_trains_adapters_and_leaves_the_base_bitwise_unchanged(full, lora):
    (full_out, full_summary), (out, summary) = full, lora
    config = _hf_config(full_out / "model")
    assert summary["params_trainable"] == _adapter_params(config, LORA_RANK)
    # B starts at zero, so training starts exactly from the base: its held-out loss, then lower
    assert summary["eval_loss_before"] == pytest.approx(full_summary["eval_loss_after"], rel=1e-6)
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    base, trained = load_file(full_out / "model" / "model.safetensors"), load_file(out / "lora.safetensors")
    adapters = sorted(set(trained) - set(base))
    assert len(adapters) == config.num_hidden_layers * 2 * 2  # q and v, A and B
    assert all(k.endswith(("q_proj.lora_A", "q_proj.lora_B", "v_proj.lora_A", "v_proj.lora_B")) for k in adapters)
    assert all(torch.equal(trained[k], base[k]) for k in base), "a frozen base weight changed"
    assert all(trained[k].abs().sum() > 0 for k in adapters if k.endswith("lora_B"))  # zero at start: it trained
    _reproduces_engine_logits(out)  # the merged export: W + (alpha/r)·B·A


@pytest.mark.slow
def test_lora_writes_and_holds_only_adapter_state(full, lora):
    (full_out, full_summary), (_, summary) = full, lora
    config = _hf_config(full_out / "model")
    adapter, params = _adapter_params(config, LORA_RANK), full_summary["params_total"]
    slack = SEGMENT_SLACK * config.num_hidden_layers * summary["world_size"]  # the adapters live in the layers
    full_written, lora_written = full_summary["nvme_write_bytes_per_step"][-1], summary["nvme_write_bytes_per_step"][-1]
    assert full_written >= ADAM_BYTES_PER_PARAM * params  # a full step rewrites every master and moment
    assert lora_written / full_written <= (ADAM_BYTES_PER_PARAM * adapter + slack) / (ADAM_BYTES_PER_PARAM * params)
    assert ADAM_BYTES_PER_PARAM * adapter <= summary["optimizer_bytes"] <= ADAM_BYTES_PER_PARAM * adapter + slack


@pytest.mark.slow
def test_lora_under_torchrun_two_ranks(full, tmp_path):
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun not on PATH")
    summary = _run([torchrun, "--standalone", "--nproc-per-node", "2"], tmp_path / "lora2",
                   "--model-dir", str(full[0] / "model"), "--lora", str(LORA_RANK), "--steps", "10")
    assert summary["world_size"] == 2 and all(0 < loss < 10 for loss in summary["losses"])
    assert summary["logits_max_diff"]["full_state_dict"] < 1e-5
    base = load_file(full[0] / "model" / "model.safetensors")
    trained = load_file(tmp_path / "lora2" / "lora.safetensors")
    assert all(torch.equal(trained[k], base[k]) for k in base)
    _reproduces_engine_logits(tmp_path / "lora2")
