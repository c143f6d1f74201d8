"""The model a plan is for, built on the meta device, and its compute measured on one of its own blocks.

[Note: model specs]
``plan`` takes a model as people name it: a built-in preset (``50m``), a Hugging Face ``config.json``
(built with ``transformers`` under ``init_context``), a Python ``module:factory`` (called with no
arguments; the module may define ``example_inputs(micro_batch, seq_len)``, else the model is called
with one ``(micro_batch, seq_len)`` tensor of token ids), or a parameter count and shape (a GPT of
that many layers whose width gives the count). Nothing is allocated: every model is built on meta.

[Note: measured compute]
A transformer's time goes to its blocks, and what a block costs depends on its code (attention,
norms, activations), not only on its matmuls. So the compute of a step is measured, not derived:
one block unit, taken from a meta forward with the inputs it really receives (their shapes and
dtypes), is materialized alone on the device in the compute dtype and timed through forward and
forward + backward at the micro-batch (a smaller one, scaled, where that would take long:
``PROXY_SECONDS``). The rest of the model (the root unit: embeddings, head, loss) is counted in
floating-point operations (``FlopCounterMode`` on the same meta forward) at the probe's matmul rate.
A block costs a few hundred MB at most, whatever the model's size. Where nothing may be run (the
layout a refusal suggests, which must come in seconds), the blocks are counted in FLOPs as well.
"""
from __future__ import annotations

import copy
import importlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..activations import ActivationProfile, MetaBranches, measure_activations
from ..config import ConfigError
from ..lazy_init import init_context
from ..models import PRESETS, GPTConfig
from ..precision import COMPUTE_DTYPES
from ..zero.unit_layout import UnitLayout
from .probe import median_seconds

__all__ = ["BlockTimes", "ModelSpec", "gpt_of_size", "load_model"]


@dataclass
class ModelSpec:
    """A model on the meta device, and how to make one micro-batch of its inputs."""

    name: str
    module: nn.Module
    seq_len: int
    inputs: Callable[[int], tuple[tuple, dict]]
    """``inputs(micro_batch)``: positional and keyword arguments of one forward (meta tensors)."""

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def activations(self, layouts: list[UnitLayout], micro_batch: int, precision: str,
                    device: torch.device) -> ActivationProfile:
        args, kwargs = self.inputs(micro_batch)
        return measure_activations(self.module, layouts, COMPUTE_DTYPES[precision].itemsize, args, kwargs, device)


@dataclass(frozen=True, slots=True)
class BlockTimes:
    """Measured seconds of one micro-batch ([Note: measured compute])."""

    forward: float
    """Forward of every block, plus the root unit's share."""
    backward: float
    """Backward alone (forward + backward less forward), all blocks and the root."""
    recompute: float
    """Forward of the blocks alone: what activation checkpointing adds to backward."""


def load_model(spec: str, seq_len: int | None = None, layers: int | None = None) -> ModelSpec:
    """The model ``spec`` names ([Note: model specs]); ``layers`` with a parameter count for its shape."""
    if spec in PRESETS:
        return _gpt(spec, PRESETS[spec], seq_len)
    if spec.endswith(".json"):
        return _hf(Path(spec), seq_len)
    if ":" in spec:
        return _factory(spec, seq_len)
    raise ConfigError(f"model {spec!r}: name a preset ({', '.join(PRESETS)}), a Hugging Face config.json, a "
                     "Python module:factory, or give --params with --layers")


def gpt_of_size(params: float, layers: int, seq_len: int) -> GPTConfig:
    """The built-in GPT with ``layers`` blocks whose width (a multiple of 64) comes nearest ``params``."""
    width = max(64, round(math.sqrt(params / (12 * layers)) / 64) * 64)
    return GPTConfig(n_layer=layers, n_embd=width, n_head=max(1, width // 64), block_size=seq_len)


def named_gpt(name: str, config: GPTConfig, seq_len: int | None = None) -> ModelSpec:
    return _gpt(name, config, seq_len)


def _gpt(name: str, config: GPTConfig, seq_len: int | None) -> ModelSpec:
    from ..models import GPT

    seq = seq_len or config.block_size
    if seq > config.block_size:
        raise ConfigError(f"--seq {seq}: the {name} model's positions cover {config.block_size} tokens at most")
    with init_context():
        module = GPT(config)

    def inputs(micro: int) -> tuple[tuple, dict]:
        tokens = torch.zeros(micro, seq, dtype=torch.long, device="meta")
        return (tokens, tokens), {}
    return ModelSpec(name, module, seq, inputs)


def _hf(path: Path, seq_len: int | None) -> ModelSpec:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"{path}: a Hugging Face config needs transformers: pip install transformers") from None
    if not path.is_file():
        raise ConfigError(f"{path}: no such config.json")
    config = transformers.AutoConfig.from_pretrained(path.parent if path.name == "config.json" else path)
    with init_context():
        module = transformers.AutoModelForCausalLM.from_config(config)
    seq = seq_len or min(getattr(config, "max_position_embeddings", 2048), 2048)

    def inputs(micro: int) -> tuple[tuple, dict]:
        ids = torch.zeros(micro, seq, dtype=torch.long, device="meta")
        mask = torch.ones(micro, seq, dtype=torch.long, device="meta")  # given, so nothing inspects the ids' values
        return (), {"input_ids": ids, "attention_mask": mask, "labels": ids, "use_cache": False}  # no KV cache
    return ModelSpec(path.parent.name or str(path), module, seq, inputs)


def _factory(spec: str, seq_len: int | None) -> ModelSpec:
    module_name, _, attribute = spec.partition(":")
    try:
        source = importlib.import_module(module_name)
        factory = getattr(source, attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"model {spec!r}: {exc}") from None
    with init_context():
        module = factory()
    seq = seq_len or 1024
    example = getattr(source, "example_inputs", None)

    def inputs(micro: int) -> tuple[tuple, dict]:
        if example is not None:
            args = example(micro, seq)
            return (args, {}) if isinstance(args, tuple) else ((), args)
        return (torch.zeros(micro, seq, dtype=torch.long, device="meta"),), {}
    return ModelSpec(spec, module, seq, inputs)


# --------------------------------------------------------------------------------------- measured compute
PROXY_SECONDS = 0.5
"""Longest a timed block's forward + backward should take by its FLOPs at the probe's rate: past it the
block is timed at a smaller micro-batch (a block's time grows with the micro-batch in proportion) and
scaled, so that planning a large model (a 2B block at 16 x 1024 tokens: ~45 s in fp32 here) takes
seconds, not minutes."""


def measure_compute(model: ModelSpec, layouts: list[UnitLayout], micro_batch: int, precision: str,
                    matmul_flops: float, device: torch.device, *, timed: bool = True) -> BlockTimes:
    """One micro-batch's forward, backward and recompute seconds ([Note: measured compute]); with
    ``timed=False`` the blocks are counted in FLOPs too (backward: twice the forward), nothing is run."""
    blocks = [layout for layout in layouts if layout.name]
    total, block_flops, _ = _flops(model, blocks, micro_batch)
    if not blocks:
        seconds = total / matmul_flops
        return BlockTimes(forward=seconds, backward=2 * seconds, recompute=0.0)
    root_seconds = max(total - block_flops * len(blocks), 0) / matmul_flops
    if timed:
        proxy = max(1, min(micro_batch, int(micro_batch * PROXY_SECONDS * matmul_flops / (3 * block_flops or 1))))
        _, _, inputs = _flops(model, blocks, proxy)
        forward, both = (t * micro_batch / proxy for t in _time_block(blocks[0].module, inputs,
                                                                       COMPUTE_DTYPES[precision], device))
    else:
        forward = block_flops / matmul_flops
        both = 3 * forward
    n = len(blocks)
    return BlockTimes(forward=n * forward + root_seconds, backward=n * (both - forward) + 2 * root_seconds,
                      recompute=n * forward)


def _flops(model: ModelSpec, blocks: list[UnitLayout], micro_batch: int) -> tuple[int, int, Any]:
    """A meta forward at ``micro_batch``: its FLOPs, one block's, and that block's inputs (shapes, dtypes)."""
    from torch.utils.flop_counter import FlopCounterMode  # here: it costs every command importing this 0.5 s

    args, kwargs = model.inputs(micro_batch)
    captured: dict[str, Any] = {}
    hooks = [layout.module.register_forward_pre_hook(
        lambda module, a, k, name=layout.name: captured.setdefault(name, (a, k)), with_kwargs=True)
        for layout in blocks[:1]]
    counter = FlopCounterMode(display=False)
    try:
        with torch.enable_grad(), counter, MetaBranches():
            model.module(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    if not blocks:
        return counter.get_total_flops(), 0, None
    per_module = counter.get_flop_counts()
    block_key = next((k for k in per_module if k.split(".", 1)[-1] == blocks[0].name), None)
    block_flops = sum(per_module[block_key].values()) if block_key else 0
    return counter.get_total_flops(), block_flops, captured[blocks[0].name]


_BLOCK_SECONDS = 0.4
"""How long each phase of a block is timed (after a warm-up a third as long). The median of a small block's
runs moved ~10% between repeats at 0.2, 0.4 and 1.2 s alike (the nano and small presets, 2-core EPYC): the
machine's drift, not the sample count, sets it; a large block is timed 7 times whatever this says. At 1.2 s,
the two phases took 3.2 s of every ``train``'s start."""


def _time_block(meta_block: nn.Module, meta_inputs: tuple[tuple, dict], dtype: torch.dtype,
                device: torch.device) -> tuple[float, float]:
    """Seconds of one forward, and of one forward + backward, of a real copy of ``meta_block``."""
    block = copy.deepcopy(meta_block).to_empty(device=device)
    with torch.no_grad():
        for tensor in [*block.parameters(), *block.buffers()]:
            if tensor.is_floating_point():
                tensor.normal_(0.0, 0.02)
            else:
                tensor.zero_()
    block = block.to(dtype)
    args, kwargs = meta_inputs
    args = tuple(_real(a, dtype, device) for a in args)
    kwargs = {k: _real(v, dtype, device) for k, v in kwargs.items()}

    def forward() -> None:
        with torch.no_grad():
            block(*args, **kwargs)

    def forward_backward() -> None:
        out = block(*args, **kwargs)
        _first_tensor(out).float().sum().backward()
    return median_seconds(forward, _BLOCK_SECONDS), median_seconds(forward_backward, _BLOCK_SECONDS)


def _real(value: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """A real tensor shaped as the meta ``value`` (floats random in ``dtype``, integers zero, masks true)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_real(v, dtype, device) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        real = torch.randn(value.shape, device=device).to(dtype)
        return real.requires_grad_(value.requires_grad)
    if value.dtype == torch.bool:
        return torch.ones(value.shape, dtype=torch.bool, device=device)
    return torch.zeros(value.shape, dtype=value.dtype, device=device)


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return _first_tensor(out[0])
    if isinstance(out, dict):
        return _first_tensor(next(iter(out.values())))
    raise TypeError(f"a block returned {type(out).__name__}, not tensors: its time cannot be measured")
