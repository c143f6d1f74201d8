"""``zerooffload.hf.Trainer`` through the public Trainer API, in the processes a user runs: one script
(tests/hf_trainer_job.py) trains with ``transformers.Trainer`` (DDP under torchrun) and with ours
(ZeRO-3, parameters and optimizer on NVMe, a DeepSpeed JSON of "auto" values); every figure is checked
against the plain Trainer's run or against files on disk, never against our own output.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import transformers

from zerooffload.config import ConfigError
from zerooffload.hf.arguments import resolve

JOB = Path(__file__).with_name("hf_trainer_job.py")
FP32_RTOL = 2e-5
"""The issue's bound on per-step losses against the plain Trainer in fp32."""
BF16_RTOL = 2e-2
"""bf16: ours computes with bf16 weights (rounded from the fp32 masters), the plain Trainer with fp32
weights under bf16 autocast; the two round differently, and the logged losses differ by ~1e-3."""


def _train(tmp: Path, name: str, *args: str, world: int = 1, trainer: str = "zerooffload") -> tuple[dict, str]:
    return _finish(_start(tmp, name, *args, world=world, trainer=trainer))


def _train_pair(tmp: Path, common: tuple[str, ...], ours: tuple[str, ...] = (), world: int = 1) -> tuple[dict, dict]:
    """The plain Trainer and ours on the same arguments (``ours`` added to ours), run side by side."""
    runs = [_start(tmp, "plain", *common, world=world, trainer="plain"),
            _start(tmp, "ours", *common, *ours, world=world, trainer="zerooffload")]
    try:
        return tuple(_finish(run)[0] for run in runs)
    finally:  # a failed first run leaves no second one running past the test
        for process, *_ in runs:
            process.kill()


def _start(tmp: Path, name: str, *args: str, world: int, trainer: str) -> tuple:
    out = tmp / name
    nvme = tmp / "nvme"
    nvme.mkdir(exist_ok=True)
    launcher = [sys.executable] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    process = subprocess.Popen([*launcher, str(JOB), "--trainer", trainer, "--out", str(out), "--nvme", str(nvme), *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    return process, out, nvme, trainer


def _finish(run: tuple) -> tuple[dict, str]:
    process, out, nvme, trainer = run
    try:
        stdout, stderr = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 0, stdout[-3000:] + stderr[-5000:]
    left = [p.name for p in (nvme / "zerooffload-swap").glob("*") if p.name != ".lock"] if trainer != "plain" else []
    assert not left, f"swap files left behind: {left}"
    return json.loads((out / "result.json").read_text()), stderr


def _close(ours: list[float], plain: list[float], rtol: float) -> None:
    assert len(ours) == len(plain)
    for step, (a, b) in enumerate(zip(ours, plain), 1):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: {a} vs plain {b} (rtol {rtol})"


def _logits(model_dir: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(ids).logits


def _run_from(tmp: Path, name: str, checkpoints: tuple[str, ...]) -> Path:
    """A new output_dir ``tmp/name`` holding copies of the run ``ours``'s ``checkpoints``."""
    run = tmp / name
    run.mkdir()
    for checkpoint in checkpoints:
        shutil.copytree(tmp / "ours" / checkpoint, run / checkpoint)
    return run


def _flip_a_byte(checkpoint: Path) -> None:
    with open(checkpoint / "optimizer.pt", "r+b") as f:  # the plain Trainer's layout, zerooffload.json's digests
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory):
    """GPT-2, one process, 4 micro-batches per step over 10 per epoch (a short last window), saves
    every 2 steps keeping 2: the plain Trainer and ours."""
    tmp = tmp_path_factory.mktemp("hf-gpt2")
    common = ("--model", "gpt2", "--samples", "40", "--micro", "4", "--accum", "4", "--steps", "6", "--save-model")
    plain, ours = _train_pair(tmp, common, ("--save-steps", "2", "--save-total-limit", "2"))
    return tmp, plain, ours


def test_gpt2_losses_norms_and_learning_rates_equal_the_plain_trainers(gpt2_runs):
    _, plain, ours = gpt2_runs
    assert ours["steps"] == plain["steps"] == [1, 2, 3, 4, 5, 6]
    _close(ours["losses"], plain["losses"], FP32_RTOL)
    _close(ours["grad_norms"], plain["grad_norms"], 1e-5)
    assert ours["lrs"] == plain["lrs"]
    _close([ours["eval_loss"]], [plain["eval_loss"]], FP32_RTOL)


def test_save_model_gives_from_pretrained_the_plain_runs_logits(gpt2_runs):
    tmp, _, _ = gpt2_runs
    assert torch.allclose(_logits(tmp / "ours" / "model"), _logits(tmp / "plain" / "model"), atol=1e-5, rtol=1e-5)


def test_save_total_limit_keeps_the_newest_and_checkpoints_are_the_trainers_layout(gpt2_runs):
    tmp, _, _ = gpt2_runs
    kept = sorted(p.name for p in (tmp / "ours").iterdir() if p.name.startswith("checkpoint"))
    assert kept == ["checkpoint-4", "checkpoint-6"]
    newest = tmp / "ours" / "checkpoint-6"
    assert {"model.safetensors", "optimizer.pt", "zerooffload.json", "trainer_state.json"} <= \
        {p.name for p in newest.iterdir()} and not (newest / "zerooffload").exists()


def test_resume_passes_over_a_damaged_checkpoint_and_continues_the_plain_runs_losses(gpt2_runs):
    tmp, plain, _ = gpt2_runs
    run = _run_from(tmp, "resumed", ("checkpoint-4", "checkpoint-6"))
    _flip_a_byte(run / "checkpoint-6")
    resumed, stderr = _train(tmp, "resumed", "--model", "gpt2", "--samples", "40", "--micro", "4", "--accum", "4",
                             "--steps", "6", "--resume", "true")
    assert "not resuming from checkpoint-6" in stderr and "resuming from checkpoint-4" in stderr, stderr[-2000:]
    _close(resumed["losses"][4:], plain["losses"][4:], FP32_RTOL)


@pytest.fixture(scope="module")
def llama_world2(tmp_path_factory):
    """Llama (GQA, RoPE), two processes under torchrun, micro-batch 2 × accumulation 2, a save at step 3,
    both starting from one saved model: the plain Trainer loads it with ``from_pretrained``, ours builds
    it on the meta device in ``model_init`` and streams its safetensors into the shards."""
    tmp = tmp_path_factory.mktemp("hf-llama")
    torch.manual_seed(3)
    base = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))
    base.save_pretrained(tmp / "base")
    common = ("--model", "llama", "--micro", "2", "--accum", "2", "--steps", "6", "--init-from", str(tmp / "base"))
    plain, ours = _train_pair(tmp, common, ("--save-steps", "3"), world=2)
    return tmp, plain, ours


def test_llama_from_streamed_weights_at_world_2_equals_the_plain_trainer_under_ddp(llama_world2):
    _, plain, ours = llama_world2
    assert ours["world_size"] == plain["world_size"] == 2
    _close(ours["losses"], plain["losses"], FP32_RTOL)
    _close(ours["grad_norms"], plain["grad_norms"], 1e-5)


def test_resuming_at_world_1_keeps_the_global_batch_and_the_losses(llama_world2):
    tmp, plain, _ = llama_world2
    run = _run_from(tmp, "at-world-1", ("checkpoint-3",))
    resumed, stderr = _train(tmp, "at-world-1", "--model", "llama", "--micro", "2", "--accum", "2", "--steps", "6",
                             "--init-from", str(tmp / "base"), "--resume", str(run / "checkpoint-3"))
    assert resumed["accum"] == 4 and "gradient_accumulation_steps 2 -> 4" in stderr
    _close(resumed["losses"][3:], plain["losses"][3:], FP32_RTOL)


@pytest.mark.slow
def test_resuming_at_world_2_is_exact(llama_world2):
    tmp, _, ours = llama_world2
    _run_from(tmp, "at-world-2", ("checkpoint-3",))
    resumed, _ = _train(tmp, "at-world-2", "--model", "llama", "--micro", "2", "--accum", "2", "--steps", "6",
                        "--init-from", str(tmp / "base"), "--resume", "true", world=2)
    assert resumed["losses"][3:] == ours["losses"][3:]


@pytest.mark.slow
@pytest.mark.parametrize("model, world", [("gpt2", 2), ("llama", 1)])
def test_the_other_model_at_the_other_world_size_equals_the_plain_trainer(tmp_path, model, world):
    common = ("--model", model, "--micro", "2", "--accum", "2", "--steps", "6")
    plain, ours = _train_pair(tmp_path, common, world=world)
    _close(ours["losses"], plain["losses"], FP32_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_bf16_losses_are_near_the_plain_trainers_autocast(tmp_path, model):
    common = ("--model", model, "--bf16", "--steps", "6")
    plain, ours = _train_pair(tmp_path, common)
    _close(ours["losses"], plain["losses"], BF16_RTOL)


# ---------------------------------------------------------------------------------------------- the config
def _args(tmp_path, **kwargs) -> "transformers.TrainingArguments":
    return transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kwargs)


def test_auto_values_come_from_the_training_arguments(tmp_path):
    args = _args(tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=5, max_grad_norm=0.25,
                 learning_rate=2e-4, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7, weight_decay=0.05, bf16=True)
    auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    config = resolve(auto, args).engine
    assert (config.train.micro_batch_size, config.train.grad_accum_steps, config.train.grad_clip) == (3, 5, 0.25)
    assert config.train.precision == "bf16" and config.zero.stage == 3
    assert (config.optimizer.type, config.optimizer.lr, tuple(config.optimizer.betas), config.optimizer.eps,
            config.optimizer.weight_decay) == ("adamw", 2e-4, (0.8, 0.95), 1e-7, 0.05)
    ours = resolve({"zero": {"stage": 2}}, args).engine  # our format: absent keys take the arguments' values
    assert (ours.train.micro_batch_size, ours.optimizer.lr, ours.train.precision) == (3, 2e-4, "bf16")


def test_disagreements_are_refused_by_name(tmp_path):
    args = _args(tmp_path, max_grad_norm=1.0, learning_rate=3e-3)
    with pytest.raises(ConfigError) as error:
        resolve({"gradient_clipping": 0.5, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                 "zero_optimization": {"stage": 3}}, args)
    message = str(error.value)
    assert "gradient_clipping = 0.5 but TrainingArguments max_grad_norm = 1.0" in message
    assert "optimizer.params.lr = 0.0001 but TrainingArguments learning_rate = 0.003" in message
    with pytest.raises(ConfigError, match=r"train.micro_batch_size = 4 but TrainingArguments "
                                          r"per_device_train_batch_size = 8"):
        resolve({"train": {"micro_batch_size": 4}}, args)


@pytest.mark.parametrize("argument, fix", [
    ({"activation_checkpointing": True}, "train.activation_checkpointing"),
    ({"optim": "adafactor"}, "use an AdamW optim"),
])
def test_arguments_the_engine_cannot_honour_are_refused_with_the_fix(tmp_path, argument, fix):
    with pytest.raises(ConfigError, match=fix):
        resolve({"zero_optimization": {"stage": 3}}, _args(tmp_path, **argument))


def test_a_deepspeed_scheduler_gets_the_runs_warmup_and_total_steps(tmp_path):
    args = _args(tmp_path, warmup_steps=7, learning_rate=1e-3)
    resolved = resolve({"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_num_steps": "auto", "total_num_steps": "auto", "warmup_max_lr": "auto", "warmup_min_lr": "auto"}}},
        args)
    assert resolved.has_schedule
    schedule = resolved.schedule(args, max_steps=120)
    assert (schedule.type, schedule.warmup_steps, schedule.total_steps, schedule.min_lr) == ("warmup_linear", 7, 120, 0)


@pytest.mark.slow
def test_the_example_trains_resumes_and_saves_a_loadable_model(tmp_path):
    """examples/hf_trainer.py as the README runs it, smaller: train, resume from its checkpoint, load the result."""
    example = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"
    (tmp_path / "nvme").mkdir()
    base = [sys.executable, str(example), "--train_file", str(example), "--output_dir", str(tmp_path / "out"),
            "--nvme", str(tmp_path / "nvme"), "--block_size", "64", "--per_device_train_batch_size", "2",
            "--logging_steps", "1", "--save_steps", "2", "--use_cpu", "--report_to", "none"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for steps, resume in (("2", []), ("4", ["--resume_from_checkpoint", "true"])):
        run = subprocess.run([*base, "--max_steps", steps, *resume], capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert metrics["epoch"] > 0 and 1 < metrics["perplexity"] < 300
    state = json.loads((tmp_path / "out" / "checkpoint-4" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3, 4]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert sum(p.numel() for p in model.parameters()) > 1e6


def test_a_second_engine_is_refused_before_the_trainer_sets_it_up(tmp_path):
    from zerooffload.hf import Trainer
    with pytest.raises(ConfigError, match="TrainingArguments.fsdp is set: zerooffload shards the model itself"):
        Trainer(model=torch.nn.Linear(2, 2), args=_args(tmp_path, fsdp=True), zerooffload={"zero": {"stage": 3}})
