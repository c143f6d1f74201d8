"""Causal-LM training with the Hugging Face Trainer, zerooffload underneath: a ``run_clm``-style script.

The whole switch from DeepSpeed is the import: ``from zerooffload.hf import Trainer`` and the config
passed as ``zerooffload=`` (a DeepSpeed JSON of "auto" values, as the Trainer's docs show one, or a
zerooffload TOML); every TrainingArguments flag works as it does with ``transformers.Trainer``.

- Data: a local text file (``--train_file``), tokenized as its UTF-8 bytes (vocabulary 256, so no
  tokenizer is downloaded), cut into blocks of ``--block_size`` tokens as run_clm's ``group_texts``
  does; ``--validation_split_percentage`` of the blocks are held out for ``evaluate``.
- Model: a local Hugging Face checkpoint (``--model_dir``: built on the meta device with
  ``zerooffload.hf.lazy_from_pretrained`` and its safetensors streamed into the engine's shards, so a
  model larger than RAM fits), or a config built from scratch (``--config_json``, default a small
  Llama), in both cases never materialized whole.
- Engine: ``--zerooffload CONFIG``; by default ZeRO stage 3 with parameters and optimizer states on
  NVMe under ``--nvme``.

Run (one process, then two under torchrun; --resume_from_checkpoint true continues a run):
    python examples/hf_trainer.py --train_file README.md --output_dir /tmp/hf-trainer --nvme /tmp \\
        --max_steps 20 --per_device_train_batch_size 4 --logging_steps 5 --save_steps 10 --use_cpu
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --train_file README.md \\
        --output_dir /tmp/hf-trainer2 --nvme /tmp --max_steps 20 --ddp_backend gloo --use_cpu

Needs ``pip install -e ".[hf]"``. The trained model is in ``--output_dir`` (config.json and
model.safetensors: ``AutoModelForCausalLM.from_pretrained`` loads it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, LlamaConfig, TrainingArguments

import zerooffload as zo
from zerooffload.hf import Trainer, lazy_from_pretrained

SMALL_LLAMA = dict(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                   tie_word_embeddings=False)
"""The default model: ~3M parameters, grouped-query attention and RoPE like the large ones."""


@dataclass
class ScriptArguments:
    train_file: str = field(metadata={"help": "a local text file to train on"})
    block_size: int = field(default=128, metadata={"help": "tokens (bytes) per training sequence"})
    validation_split_percentage: int = field(default=5, metadata={"help": "share of blocks held out for evaluate"})
    model_dir: str | None = field(default=None, metadata={"help": "a local checkpoint (config.json + *.safetensors)"})
    config_json: str | None = field(default=None, metadata={"help": "a transformers config.json to train from scratch"})
    zerooffload: str | None = field(default=None, metadata={"help": "a zerooffload TOML or DeepSpeed JSON; default: "
                                                                    "stage 3, parameters and optimizer on NVMe"})
    nvme: str = field(default="/tmp", metadata={"help": "swap directory of the default config"})


def default_config(nvme: str) -> dict:
    """A DeepSpeed JSON of "auto" values (the Trainer fills them), stage 3 with NVMe offload."""
    offload = {"device": "nvme", "nvme_path": nvme}
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload}}


class ByteBlocks(torch.utils.data.Dataset):
    """Blocks of byte tokens; labels = input_ids (the model shifts them)."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


def datasets(script: ScriptArguments) -> tuple[ByteBlocks, ByteBlocks]:
    """run_clm's grouped texts: the file's bytes cut into whole blocks (the remainder dropped), the
    last ``--validation_split_percentage`` of them held out."""
    data = Path(script.train_file).read_bytes()
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    blocks = tokens[:len(tokens) // script.block_size * script.block_size].view(-1, script.block_size)
    held_out = max(1, len(blocks) * script.validation_split_percentage // 100)
    if len(blocks) <= held_out:
        raise SystemExit(f"{script.train_file}: {len(data)} bytes make {len(blocks)} blocks of {script.block_size}: "
                         "too few to train and evaluate on; use a longer file or a smaller --block_size")
    return ByteBlocks(blocks[:-held_out]), ByteBlocks(blocks[-held_out:])


def build_model(script: ScriptArguments) -> torch.nn.Module:
    """The model on the meta device: no memory until the engine gives it values unit by unit."""
    if script.model_dir:
        return lazy_from_pretrained(script.model_dir)
    config = (AutoConfig.from_pretrained(script.config_json) if script.config_json else LlamaConfig(**SMALL_LLAMA))
    if config.vocab_size < 256:
        raise SystemExit(f"the model's vocab_size is {config.vocab_size}: byte tokens need at least 256")
    with zo.init_context():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def main() -> None:
    script, training = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    train, evaluation = datasets(script)
    trainer = Trainer(model=build_model(script), args=training, train_dataset=train, eval_dataset=evaluation,
                      zerooffload=script.zerooffload or default_config(script.nvme))
    resume = training.resume_from_checkpoint
    trainer.train(resume_from_checkpoint={"true": True, "false": None}.get(str(resume).lower(), resume))
    trainer.save_model()
    metrics = trainer.evaluate()
    metrics["perplexity"] = math.exp(min(metrics["eval_loss"], 50.0))
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
