"""A GPT in plain PyTorch, read top to bottom (after nanoGPT): byte-level tokens, tied embeddings.

The blocks sit in an ``nn.ModuleList``, so each becomes one ZeRO unit by the default rule; the
embeddings, final norm and tied head form the root unit. ``forward(idx, targets=None)`` returns the
logits, or the mean cross-entropy loss when ``targets`` are given.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .presets import GPTConfig

__all__ = ["GPT"]


class SelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = SelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _gpt2_init(name: str, param: torch.Tensor, config: GPTConfig) -> None:
    if name.endswith("bias"):
        nn.init.zeros_(param)
    elif param.dim() >= 2:
        std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("proj.weight") else 0.02
        nn.init.normal_(param, mean=0.0, std=std)
    else:
        nn.init.ones_(param)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's init: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers), zero biases."""
        for name, param in self.named_parameters():
            _gpt2_init(name, param, self.config)

    def init_fn(self) -> Callable[[nn.Module], None]:
        """GPT-2's init one module at a time, for ``zo.initialize(..., init_fn=model.init_fn())`` of a model
        built under ``zo.init_context`` (the same rules as ``reset_parameters``)."""
        names = {id(module): name for name, module in self.named_modules()}

        def init(module: nn.Module) -> None:
            prefix = names[id(module)]
            for name, param in module.named_parameters(recurse=False):
                _gpt2_init(f"{prefix}.{name}" if prefix else name, param, self.config)
        return init

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
