"""Fine-tune a Hugging Face causal LM with ZeRO stage 3, parameters and optimizer states on NVMe.

Read top to bottom: ``main`` is the whole job.

1. The model is a ``transformers`` causal LM built from a config, offline (no weights downloaded):
   a tiny Llama by default, ``--config-json FILE`` for any other config, or ``--model-dir DIR`` for
   a local Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``). It is built
   inside ``zo.init_context`` (meta tensors: no memory), so ``zo.initialize`` gives it values unit by
   unit; with ``--model-dir`` the weights are then streamed in with ``zo.load_safetensors``.
2. ``--lora RANK`` freezes the base and adds a low-rank adapter to every attention q and v
   projection (``LoRALinear`` below: plain PyTorch, nothing of zerooffload's). Only the adapters
   train; the frozen base gets no optimizer state and is never written back to NVMe, as
   ``summary.json`` shows (optimizer bytes held, NVMe bytes written per step).
3. The engine: ZeRO stage 3 with ``offload.param.tier = nvme`` and ``offload.optimizer.tier = nvme``
   under ``--nvme DIR``. It runs alone or under ``torchrun`` (each rank trains its slice of the batch).
4. Training data: the bytes of the Python standard library's sources (``zerooffload.data.ByteCorpus``),
   token = byte, so the vocabulary is 256 and no tokenizer is needed. Hugging Face's models shift the
   labels themselves: ``labels=input_ids``.
5. At the end it checks its own work. The engine's logits on a probe batch must equal those of a plain
   model holding ``engine.full_state_dict()``. The checkpoint is saved, consolidated into
   ``OUT/model/model.safetensors`` (adapters merged into their base weights: W + (alpha/r)·B·A) beside
   the model's ``config.json``, and ``AutoModelForCausalLM.from_pretrained(OUT/model)`` must give the
   same logits again. ``OUT/model`` is an ordinary Hugging Face checkpoint: ``--model-dir`` takes it.
6. ``OUT/summary.json``: losses, NVMe bytes read/written per step and optimizer-state bytes (summed
   over ranks), parameter counts, the logit differences; ``OUT/probe.pt`` the probe and engine logits.

Run:
    python examples/hf_finetune.py --out /tmp/hf --nvme /tmp/nvme
    torchrun --standalone --nproc-per-node 2 examples/hf_finetune.py --out /tmp/hf2 --nvme /tmp/nvme
    python examples/hf_finetune.py --model-dir /tmp/hf/model --lora 8 --out /tmp/hf-lora --nvme /tmp/nvme

Needs ``pip install transformers`` (or ``pip install -e ".[hf]"``). The checks build the whole model
once in rank 0's memory, which is fine for the small models this example is meant to be run with.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import zerooffload as zo
from zerooffload.data import ByteCorpus
from zerooffload.hf import hf_initializer

TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False)
"""The default model: ~0.1M parameters, with grouped-query attention and RoPE like the real ones."""

LORA_TARGETS = ("q_proj", "v_proj")
"""Linear layers that get an adapter (the LoRA paper's choice: attention queries and values)."""


# ---------------------------------------------------------------------------------------------- LoRA
class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` plus a trainable low-rank update: y = x Wᵀ + b + (alpha/r) · x Aᵀ Bᵀ.

    It *is* an ``nn.Linear`` (same ``weight``/``bias`` names), so a base checkpoint's keys still fit;
    the adapter adds ``lora_A`` (r × in, random) and ``lora_B`` (out × r, zero: training starts from
    exactly the base model).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, alpha: float,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank, self.scale = rank, alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=dtype))
        self.reset_lora_parameters()
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "lora_A"):  # nn.Linear.__init__ calls this before the adapter exists
            self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale


def add_lora(model: nn.Module, rank: int, alpha: float) -> nn.Module:
    """Freeze every parameter of ``model``, then swap each ``LORA_TARGETS`` Linear for a LoRALinear."""
    model.requires_grad_(False)
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if name in LORA_TARGETS and type(child) is nn.Linear]
    if not targets:
        raise SystemExit(f"no nn.Linear named {' or '.join(LORA_TARGETS)} in {type(model).__name__} to adapt")
    for parent, name, child in targets:
        setattr(parent, name, LoRALinear(child.in_features, child.out_features, child.bias is not None, rank, alpha,
                                         device=child.weight.device, dtype=child.weight.dtype))
    return model


def merge_lora(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A LoRA model's state dict as the plain model's: each W + scale·B·A, the adapter keys dropped."""
    merged = {}
    for key, value in state.items():
        if key.endswith((".lora_A", ".lora_B")):
            continue
        stem = key.removesuffix("weight")
        if key.endswith(".weight") and stem + "lora_A" in state:
            value = value + scale * (state[stem + "lora_B"] @ state[stem + "lora_A"])
        merged[key] = value.contiguous()
    return merged


# ---------------------------------------------------------------------------------------------- the job
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="hf-finetune-out", help="checkpoints, model/, summary.json, probe.pt")
    p.add_argument("--nvme", default="/tmp", help="swap directory for parameters and optimizer states")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--config-json", help="a transformers config.json to build (randomly initialized)")
    model.add_argument("--model-dir", help="a local Hugging Face checkpoint: config.json + *.safetensors")
    p.add_argument("--lora", type=int, default=0, metavar="RANK", help="train rank-RANK adapters on a frozen base")
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=None, help="default 3e-3, or 1e-2 with --lora")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.lora < 0:
        p.error("--steps must be at least 1 and --lora at least 0")
    if args.model_dir and not (Path(args.model_dir) / "config.json").is_file():
        raise SystemExit(f"hf_finetune: --model-dir {args.model_dir}: no config.json there; pass a local Hugging Face "
                         "checkpoint (config.json and *.safetensors), e.g. OUT/model of an earlier run")
    if args.config_json and not Path(args.config_json).is_file():
        raise SystemExit(f"hf_finetune: --config-json {args.config_json}: no such file")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    torch.manual_seed(args.seed)

    # 1-3. the model, built on the meta device, and the engine that gives it values unit by unit
    hf_config = load_hf_config(args)
    config = zo.Config.load({
        "train": {"micro_batch_size": args.batch_size, "seed": args.seed},
        "optimizer": {"type": "adamw", "lr": args.lr or (1e-2 if args.lora else 3e-3), "weight_decay": 0.0},
        "zero": {"stage": 3},
        "offload": {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}},
        "nvme": {"path": args.nvme},
    })
    with zo.init_context(config):
        model = build_model(hf_config, args)
    engine = zo.initialize(model, config, init_fn=initializer(model))
    if args.model_dir:
        load_base_weights(engine, model, Path(args.model_dir), lora=bool(args.lora))

    # 4. training, with the loss on fixed held-out batches before and after
    corpus = ByteCorpus(max_bytes=4 << 20)
    held_out = [batch(corpus, engine, args, step, split="eval") for step in range(4)]
    eval_before = eval_loss(engine, held_out)
    losses, io = train(engine, corpus, args)
    eval_after = eval_loss(engine, held_out)
    optimizer_bytes = sum(kinds["optimizer"] for kinds in engine.memory_report().bytes_by_tier.values())
    collective_elements = engine.stats.data_elements

    # 5. the checks, all ranks: the engine's logits on a probe batch, its full state, a checkpoint
    probe, _ = corpus.batch(0, batch_size=2, seq_len=args.seq_len, seed=args.seed + 1, split="eval")
    engine.eval()
    with torch.no_grad():
        engine_logits = engine(input_ids=probe, use_cache=False).logits.float()
    engine.train()
    state = engine.full_state_dict()  # collective: rank 0 gets the dict, the others {}
    engine.save_checkpoint(out / "checkpoints")  # collective
    io_totals = sum_over_ranks(torch.tensor(io, dtype=torch.float64)).long().tolist()  # per step: read, written
    optimizer_bytes = int(sum_over_ranks(torch.tensor(float(optimizer_bytes), dtype=torch.float64)))
    rank, world = engine.comm.rank, engine.comm.world_size
    engine.close()
    if rank != 0:
        return

    # 5. the checks, rank 0: a plain model holding full_state_dict, and from_pretrained of the export
    plain = build_model(hf_config, args)
    plain.load_state_dict(state)
    state_logits = logits(plain, probe)
    model_dir = export_hf_model(out, hf_config, args)
    pretrained_logits = logits(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), probe)

    # 6. the summary
    summary = {
        "world_size": world, "steps": args.steps, "lora_rank": args.lora, "model_type": hf_config.model_type,
        "losses": losses, "loss_first": losses[0], "loss_last": losses[-1],
        "eval_loss_before": eval_before, "eval_loss_after": eval_after,
        "params_total": sum(p.numel() for p in plain.parameters()),
        "params_trainable": sum(p.numel() for p in plain.parameters() if p.requires_grad),
        "nvme_read_bytes_per_step": [read for read, _ in io_totals],
        "nvme_write_bytes_per_step": [written for _, written in io_totals],
        "optimizer_bytes": optimizer_bytes,
        "collective_elements_per_rank_last_step": collective_elements,
        "logits_max_diff": {"full_state_dict": (state_logits - engine_logits).abs().max().item(),
                            "from_pretrained": (pretrained_logits - engine_logits).abs().max().item()},
    }
    torch.save({"input_ids": probe, "engine_logits": engine_logits}, out / "probe.pt")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (held out {eval_before:.4f} -> {eval_after:.4f}); trainable "
          f"{summary['params_trainable']:,} of {summary['params_total']:,} parameters; optimizer state "
          f"{optimizer_bytes:,} B; NVMe written in the last step {io_totals[-1][1]:,} B (all ranks)")
    print(f"max |logits - engine's|: full_state_dict {summary['logits_max_diff']['full_state_dict']:.2e}, "
          f"from_pretrained({model_dir}) {summary['logits_max_diff']['from_pretrained']:.2e}")
    if not torch.allclose(state_logits, engine_logits, atol=1e-5, rtol=1e-5):
        raise SystemExit("a plain model holding engine.full_state_dict() disagrees with the engine")
    if not torch.allclose(pretrained_logits, engine_logits, atol=1e-4, rtol=1e-4):
        raise SystemExit(f"from_pretrained({model_dir}) disagrees with the engine")


def train(engine, corpus: ByteCorpus, args: argparse.Namespace) -> tuple[list[float], list[list[int]]]:
    """``--steps`` optimizer steps; returns each step's loss (mean over ranks) and this rank's NVMe
    bytes [read, written] in each step's window."""
    losses, io = [], []
    for step in range(args.steps):
        input_ids = batch(corpus, engine, args, step)
        output = engine(input_ids=input_ids, labels=input_ids)  # the model shifts the labels itself
        engine.backward(output)  # an output with .loss
        engine.step()
        losses.append(mean_over_ranks(output.loss.detach()))
        io.append([engine.stats.io.read_bytes, engine.stats.io.write_bytes])
        if engine.comm.rank == 0:
            print(f"step {step + 1:3d}/{args.steps}  loss {losses[-1]:.4f}  NVMe read {io[-1][0]:,} B  "
                  f"written {io[-1][1]:,} B (rank 0)", flush=True)
    return losses, io


# ---------------------------------------------------------------------------------------------- helpers
def load_hf_config(args: argparse.Namespace):
    """The transformers config to build: --model-dir's, --config-json's, or the tiny Llama."""
    if args.model_dir:
        hf_config = AutoConfig.from_pretrained(args.model_dir)
    elif args.config_json:
        fields = json.loads(Path(args.config_json).read_text())
        hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        hf_config = LlamaConfig(**TINY_LLAMA)
    if hf_config.vocab_size < 256:
        raise SystemExit(f"the model's vocab_size is {hf_config.vocab_size}: byte tokens need at least 256")
    return hf_config


def build_model(hf_config, args: argparse.Namespace) -> nn.Module:
    """The causal LM of ``hf_config`` in fp32, with adapters when ``--lora`` is set."""
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return add_lora(model, args.lora, args.lora_alpha) if args.lora else model


def initializer(model: nn.Module):
    """``init_fn`` for a model built under ``zo.init_context``: Hugging Face's own per-module init
    (``zerooffload.hf.hf_initializer``: normal weights, unit norms, RoPE frequencies, on each module
    that owns parameters or buffers), then the adapters' init."""
    hf_init = hf_initializer(model)

    def init(module: nn.Module) -> None:
        hf_init(module)
        if isinstance(module, LoRALinear):
            module.reset_lora_parameters()
    return init


def load_base_weights(engine, model: nn.Module, model_dir: Path, lora: bool) -> None:
    """Stream ``model_dir``'s safetensors into the engine's shards (``zo.load_safetensors``, strict).
    With adapters the files lack the ``lora_*`` keys, so the load is not strict and the same check is
    made here with those keys left out: any other parameter missing, or key unused, is an error."""
    if lora:
        in_files = set()
        for file in sorted(model_dir.glob("*.safetensors")):
            with safetensors.safe_open(file, "pt") as f:
                in_files.update(f.keys())
        names_of: dict[int, list[str]] = {}  # a tied parameter is found under any of its names
        for name, param in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(param), []).append(name)
        missing = [names[0] for names in names_of.values()
                   if not names[0].endswith((".lora_A", ".lora_B")) and not in_files.intersection(names)]
        unexpected = sorted(in_files - set(model.state_dict()))
        if missing or unexpected:
            raise SystemExit(f"{model_dir}: not in the files: {missing}; not in the model: {unexpected}")
    zo.load_safetensors(engine, model_dir, strict=not lora)


def export_hf_model(out: Path, hf_config, args: argparse.Namespace) -> Path:
    """The saved checkpoint as a Hugging Face model directory: config.json + model.safetensors (with
    ``--lora``, the adapters merged; the unmerged weights stay in OUT/lora.safetensors)."""
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(model_dir)
    if not args.lora:
        zo.checkpoint.consolidate(out / "checkpoints", model_dir / "model.safetensors")
        return model_dir
    trained = zo.checkpoint.consolidate(out / "checkpoints", out / "lora.safetensors")
    merged = merge_lora(safetensors.torch.load_file(trained), args.lora_alpha / args.lora)
    safetensors.torch.save_file(merged, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


def batch(corpus: ByteCorpus, engine, args: argparse.Namespace, step: int, split: str = "train") -> torch.Tensor:
    """This rank's rows of global batch ``step``: ``--batch-size`` sequences of ``--seq-len`` bytes."""
    input_ids, _ = corpus.batch(step, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                                split=split, rank=engine.comm.rank, world_size=engine.comm.world_size)
    return input_ids


def eval_loss(engine, batches: list[torch.Tensor]) -> float:
    """The mean loss over ``batches`` (and over ranks), without training: no trace, no gradients."""
    engine.eval()
    with torch.no_grad():
        loss = torch.stack([engine(input_ids=b, labels=b, use_cache=False).loss for b in batches]).mean()
    engine.train()
    return mean_over_ranks(loss)


def logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=False).logits.float()


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def mean_over_ranks(loss: torch.Tensor) -> float:
    world = dist.get_world_size() if dist.is_initialized() else 1
    return sum_over_ranks(loss.double().clone()).item() / world


if __name__ == "__main__":
    main()
