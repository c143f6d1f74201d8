"""The Trainer's flag and checkpoints across the two Trainers, on a tiny GPT-2 in this process: a
command line with ``--deepspeed ds.json`` runs ``zerooffload.hf.Trainer`` unchanged (TrainingArguments
takes the value out), and a checkpoint-N the plain ``transformers.Trainer`` wrote resumes in ours with
the plain run's losses."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, HfArgumentParser

from hf_trainer_job import RandomTokens, deepspeed_json
from zerooffload.checkpoint import CheckpointError
from zerooffload.config import ConfigError
from zerooffload.hf import Trainer, TrainingArguments

STEPS, SAVE_AT = 4, 2


def _model() -> torch.nn.Module:
    transformers.set_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _arguments(out: Path, *extra: str) -> TrainingArguments:
    line = ["--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size", "4",
            "--learning_rate", "1e-3", "--weight_decay", "0.1", "--logging_steps", "1", "--save_steps",
            str(SAVE_AT), "--use_cpu", "--report_to", "none", "--seed", "0", "--dataloader_num_workers", "0", *extra]
    return HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(line)[0]


def _losses(trainer: transformers.Trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain Trainer's run of STEPS steps, a checkpoint-N every SAVE_AT (its arguments: transformers')."""
    out = tmp_path_factory.mktemp("plain")
    torch.set_num_threads(1)
    args = HfArgumentParser(transformers.TrainingArguments).parse_dict(
        {k: v for k, v in _arguments(out).to_dict().items() if k != "zerooffload"})[0]
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=RandomTokens(64))
    trainer.train()
    return out, _losses(trainer)


def _deepspeed(tmp: Path) -> Path:
    (tmp / "swap").mkdir(exist_ok=True)
    path = tmp / "ds_config.json"
    path.write_text(json.dumps(deepspeed_json(3, str(tmp / "swap"))))
    return path


def test_a_deepspeed_command_line_trains_with_ours_as_the_plain_trainer_does(plain, tmp_path):
    args = _arguments(tmp_path / "ours", "--deepspeed", str(_deepspeed(tmp_path)))
    assert args.deepspeed is None and args.zerooffload == str(tmp_path / "ds_config.json")
    trainer = Trainer(model=_model(), args=args, train_dataset=RandomTokens(64))
    trainer.train()
    assert trainer.engine.config.zero.stage == 3 and trainer.engine.config.offload.param.tier == "nvme"
    ours, theirs = _losses(trainer), plain[1]
    assert ours.keys() == theirs.keys() and max(abs(ours[s] - theirs[s]) for s in ours) <= 1e-5, (ours, theirs)


def test_ours_resumes_a_plain_trainer_checkpoint_and_continues_its_losses(plain, tmp_path):
    out, theirs = plain
    run = tmp_path / "resumed"
    run.mkdir()
    shutil.copytree(out / f"checkpoint-{SAVE_AT}", run / f"checkpoint-{SAVE_AT}")
    args = _arguments(run, "--deepspeed", str(_deepspeed(tmp_path)))
    trainer = Trainer(model=_model(), args=args, train_dataset=RandomTokens(64))
    with torch.no_grad():  # other weights: a resume that loaded nothing shows
        for p in trainer.model.parameters():
            p.add_(0.01)
    trainer.train(resume_from_checkpoint=True)
    ours = {step: loss for step, loss in _losses(trainer).items() if step > SAVE_AT}  # before: the saved log
    assert sorted(ours) == list(range(SAVE_AT + 1, STEPS + 1))
    assert max(abs(ours[s] - theirs[s]) for s in ours) <= 1e-5, (ours, theirs)


def test_no_config_and_a_folder_of_another_kind_are_refused_saying_so(tmp_path):
    with pytest.raises(ConfigError, match="no zerooffload config: pass --deepspeed"):
        Trainer(model=_model(), args=_arguments(tmp_path), train_dataset=RandomTokens(8))
    (tmp_path / "checkpoint-2").mkdir()
    trainer = Trainer(model=_model(), args=_arguments(tmp_path, "--deepspeed", str(_deepspeed(tmp_path))),
                      train_dataset=RandomTokens(64))
    with pytest.raises(CheckpointError, match="neither a zerooffload Trainer checkpoint .* nor a plain Trainer's"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
