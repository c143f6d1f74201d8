"""One Trainer run, as a user script runs it (alone or under torchrun): the plain
``transformers.Trainer`` or ``zerooffload.hf.Trainer`` on a tiny GPT-2 or Llama (random init, offline)
and random tokens; writes ``OUT/result.json`` (the logged losses, gradient norms and learning rates)
and, with ``--save-model``, ``OUT/model`` (``save_model``); ``--init-from`` starts from a saved model, which
ours builds lazily in ``model_init``. Used by tests/test_hf_trainer.py.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import GPT2Config, LlamaConfig, AutoModelForCausalLM, TrainingArguments
import transformers

VOCAB, SEQ = 128, 32

MODELS = {
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": lambda: LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                 tie_word_embeddings=False),
}


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random sequences; labels = input_ids (the model shifts them)."""

    def __init__(self, size: int, seed: int = 1):
        self.tokens = torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def deepspeed_json(stage: int, nvme: str | None) -> dict:
    """A DeepSpeed config of "auto" values, as transformers' docs show it."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": "auto", "reduce_bucket_size": "auto"}
    if nvme:
        zero |= {"offload_param": {"device": "nvme", "nvme_path": nvme},
                 "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "zero_optimization": zero}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trainer", choices=["plain", "zerooffload"], required=True)
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--nvme")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--save-total-limit", type=int)
    p.add_argument("--resume", help="a checkpoint-N folder, or 'true' for the newest")
    p.add_argument("--save-model", action="store_true")
    p.add_argument("--init-from", help="a saved model: from_pretrained (plain), model_init + lazy_from_pretrained (ours)")
    a = p.parse_args()
    torch.set_num_threads(1)
    transformers.set_seed(0)
    if a.init_from:
        model = AutoModelForCausalLM.from_pretrained(a.init_from, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(MODELS[a.model](), dtype=torch.float32)
    args = TrainingArguments(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=a.micro,
        gradient_accumulation_steps=a.accum, learning_rate=3e-3, weight_decay=0.1, max_grad_norm=0.5,
        warmup_steps=2, lr_scheduler_type="linear", logging_steps=1, bf16=a.bf16, use_cpu=True,
        save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500,
        save_total_limit=a.save_total_limit, report_to=[], seed=0, dataloader_num_workers=0,
        disable_tqdm=True, ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    kwargs = dict(model=model, args=args, train_dataset=RandomTokens(a.samples), eval_dataset=RandomTokens(8, seed=2))
    if a.trainer == "plain":
        trainer = transformers.Trainer(**kwargs)
    else:
        from zerooffload.hf import Trainer, lazy_from_pretrained
        if a.init_from:  # the model too large for RAM's way in: built on meta, weights streamed into the shards
            kwargs |= {"model": None, "model_init": lambda: lazy_from_pretrained(a.init_from)}
        trainer = Trainer(**kwargs, zerooffload=deepspeed_json(a.stage, a.nvme))
    resume = True if a.resume == "true" else a.resume
    trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate()
    if a.save_model:
        trainer.save_model(str(Path(a.out) / "model"))
    if trainer.args.process_index == 0:
        logged = [e for e in trainer.state.log_history if "loss" in e and "step" in e]
        (Path(a.out) / "result.json").write_text(json.dumps({
            "steps": [e["step"] for e in logged], "losses": [e["loss"] for e in logged],
            "grad_norms": [e.get("grad_norm") for e in logged], "lrs": [e["learning_rate"] for e in logged],
            "eval_loss": metrics["eval_loss"], "world_size": trainer.args.world_size,
            "accum": trainer.args.gradient_accumulation_steps}))


if __name__ == "__main__":
    main()
