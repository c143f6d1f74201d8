"""The Trainer's flag and checkpoints across the two Trainers, on a tiny GPT-2 in this process: a
command line with ``--deepspeed ds.json`` runs ``zerooffload.hf.Trainer`` unchanged (TrainingArguments
takes the value out), a checkpoint-N the plain ``transformers.Trainer`` wrote resumes in ours with the
plain run's losses, and one ours wrote (the plain Trainer's layout) resumes in the plain Trainer with
them, and in ours bit for bit."""
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
from zerooffload.hf.checkpoints import newest_loadable
from safetensors import safe_open

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


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """Ours on the same command line plus ``--deepspeed`` (stage 3, NVMe): its run and its engine's config."""
    tmp = tmp_path_factory.mktemp("ours")
    args = _arguments(tmp / "run", "--deepspeed", str(_deepspeed(tmp)))
    assert args.deepspeed is None and args.zerooffload == str(tmp / "ds_config.json")
    trainer = Trainer(model=_model(), args=args, train_dataset=RandomTokens(64))
    trainer.train()
    return tmp / "run", _losses(trainer), trainer.engine.config


def test_a_deepspeed_command_line_trains_with_ours_as_the_plain_trainer_does(plain, ours):
    assert ours[2].zero.stage == 3 and ours[2].offload.param.tier == "nvme"
    assert ours[1].keys() == plain[1].keys() and max(abs(ours[1][s] - plain[1][s]) for s in ours[1]) <= 1e-5, \
        (ours[1], plain[1])


def _resume_copy(source: Path, run: Path) -> None:
    run.mkdir()
    shutil.copytree(source / f"checkpoint-{SAVE_AT}", run / f"checkpoint-{SAVE_AT}")


def test_our_checkpoint_is_the_plain_trainers_layout_its_bytes_once(plain, ours):
    folder = ours[0] / f"checkpoint-{SAVE_AT}"
    assert not (folder / "zerooffload").exists()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["dtype"] == "float32"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
        names = set(weights.keys())
    model = _model()
    assert "lm_head.weight" not in names and names == set(model.state_dict()) - {"lm_head.weight"}
    saved = torch.load(folder / "optimizer.pt", weights_only=True)
    theirs = torch.load(plain[0] / f"checkpoint-{SAVE_AT}" / "optimizer.pt", weights_only=True)
    assert [{k: v for k, v in g.items() if k not in ("lr", "initial_lr")} for g in saved["param_groups"]] \
        == [{k: v for k, v in g.items() if k not in ("lr", "initial_lr")} for g in theirs["param_groups"]]
    assert {i: {k: (v.dtype, v.shape) for k, v in s.items()} for i, s in saved["state"].items()} \
        == {i: {k: (v.dtype, v.shape) for k, v in s.items()} for i, s in theirs["state"].items()}
    assert all(float(s["step"]) == SAVE_AT for s in saved["state"].values())
    theirs_bytes = (plain[0] / f"checkpoint-{SAVE_AT}" / "optimizer.pt").stat().st_size
    assert (folder / "optimizer.pt").stat().st_size == pytest.approx(theirs_bytes, rel=0.01)


def test_the_plain_trainer_resumes_ours_and_continues_its_losses(plain, ours, tmp_path):
    _resume_copy(ours[0], tmp_path / "run")
    args = HfArgumentParser(transformers.TrainingArguments).parse_dict(
        {k: v for k, v in _arguments(tmp_path / "run").to_dict().items() if k != "zerooffload"})[0]
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=RandomTokens(64))
    trainer.train(resume_from_checkpoint=True)
    resumed = {step: loss for step, loss in _losses(trainer).items() if step > SAVE_AT}
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    assert max(abs(resumed[s] - plain[1][s]) for s in resumed) <= 1e-5, (resumed, plain[1])


def test_ours_resumes_ours_bit_for_bit_and_verifies_it_first(ours, tmp_path):
    _resume_copy(ours[0], tmp_path / "run")
    trainer = Trainer(model=_model(), args=_arguments(tmp_path / "run", "--deepspeed", str(_deepspeed(tmp_path))),
                      train_dataset=RandomTokens(64))
    trainer.train(resume_from_checkpoint=True)
    resumed = {step: loss for step, loss in _losses(trainer).items() if step > SAVE_AT}
    assert resumed == {step: loss for step, loss in ours[1].items() if step > SAVE_AT}
    with open(tmp_path / "run" / f"checkpoint-{STEPS}" / "optimizer.pt", "r+b") as f:
        f.seek(-100, 2)
        byte = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([byte[0] ^ 1]))
    assert newest_loadable(tmp_path / "run", 0) == str(tmp_path / "run" / f"checkpoint-{SAVE_AT}")
    with pytest.raises(CheckpointError, match="optimizer.pt: CRC32C .* the file is corrupt"):
        trainer._load_engine(tmp_path / "run" / f"checkpoint-{STEPS}")


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
