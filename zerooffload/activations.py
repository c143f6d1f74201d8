"""Activation memory, measured before anything is allocated.

[Note: measuring activations]
What a forward keeps for backward depends on the model's code, not only on its parameters, so it is
measured rather than guessed: a model built under ``init_context`` runs one forward on the meta device
(shapes only: no memory, no arithmetic, a fraction of a second even at billions of parameters) with
``saved_tensors_hooks`` recording every tensor autograd saves, each storage once (views share it),
parameters left out (the tiers hold those), and attributed to the unit whose forward saved it.
Floating fp32 tensors are counted at the compute dtype's size: the engine runs the model in it.
On the meta device ``scaled_dot_product_attention`` falls back to its math path, which saves the
T×T attention weights; for real tensors torch picks a fused kernel wherever it can, which saves only
q, k, v, the output and its log-sum-exp. So where torch would pick a fused kernel on the compute
device, the measurement runs the fused kernel's meta twin instead (``_FusedAttention``).

From that one forward, both ways of running it:
- plainly, every unit's saved tensors live until backward reaches them;
- with ``train.activation_checkpointing`` the block units keep only their inputs (the checkpoint) and
  one block's saved tensors exist at a time, while it is recomputed in backward; the root unit (the
  embeddings and the head) is never checkpointed.
Backward's own temporaries (gradients of activations, and with checkpointing the recompute's
transients) are bounded by three times the largest unit's saved bytes: against the peak RSS of the
built-in GPT the estimate is then 1.0-1.4x plain and 1.0-2.4x checkpointed (tests/test_activations.py),
over rather than under. Transients inside a forward that nothing saves are not counted: they are
freed before the next op, and the RAM margin covers them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

from .zero.unit_layout import UnitLayout

__all__ = ["ActivationProfile", "MetaBranches", "checkpoint_blocks", "checkpoint_forward", "measure_activations"]


@dataclass(frozen=True, slots=True)
class ActivationProfile:
    """Bytes a forward of one micro-batch keeps for backward, per rank (see [Note: measuring activations])."""

    plain: int
    """Without activation checkpointing."""
    checkpointed: int
    """With ``train.activation_checkpointing``."""
    checkpoint_inputs: int = 0
    """Of ``checkpointed``: the block inputs kept from forward to backward (what ``offload.activations``
    may move off the device)."""
    backward_temporaries: int = 0
    """Of both: the bound on backward's own temporaries (three times the largest unit's saved bytes)."""

    def bytes(self, checkpointing: bool) -> int:
        return self.checkpointed if checkpointing else self.plain

    @property
    def bound_excess(self) -> int:
        """What the bound on backward's temporaries adds over one unit's worth, the amount a backward
        usually holds (against the built-in GPT's RSS): a prediction's peak leaves it out, a memory
        check never does."""
        return self.backward_temporaries - self.backward_temporaries // 3


class _SavedBytes:
    """Bytes of the tensors autograd saves, each storage once, by the unit running when it was saved."""

    def __init__(self, module: nn.Module, compute_bytes: int):
        self.compute_bytes = compute_bytes
        self.skip = {_storage_id(p) for p in module.parameters()} | {_storage_id(b) for b in module.buffers()}
        self.seen: set[int] = set()
        self.by_unit: dict[str, int] = {}
        self.inputs: dict[str, int] = {}
        self.current = ""

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_id(tensor)
        if key not in self.skip and key not in self.seen:
            self.seen.add(key)
            self.by_unit[self.current] = self.by_unit.get(self.current, 0) + self._nbytes(tensor)
        return tensor

    def enter(self, name: str, args: tuple) -> None:
        self.current = name
        self.inputs[name] = self.inputs.get(name, 0) + sum(
            self._nbytes(a) for a in args if isinstance(a, torch.Tensor) and _storage_id(a) not in self.skip)

    def _nbytes(self, tensor: torch.Tensor) -> int:
        nbytes = tensor.untyped_storage().nbytes()
        return nbytes * self.compute_bytes // 4 if tensor.dtype == torch.float32 else nbytes


def _storage_id(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class MetaBranches(TorchFunctionMode):
    """``bool()`` of a meta tensor taken as True, so a model's data-dependent checks pass on meta.

    Some models branch on their inputs' values before the work (Hugging Face's mask code asks whether
    a mask is all ones, whether positions are packed): a meta tensor has no value, and such a branch
    would end the measurement. True is the case of a training batch without padding or packing, the
    one these measurements are of; ``.item()`` of a number stays an error (a size is never guessed).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__bool__ and args and args[0].is_meta:
            return True
        return func(*args, **(kwargs or {}))


class _FusedAttention(TorchFunctionMode):
    """Attention measured as the kernel torch would pick on ``device`` saves it (see the note)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self._fused(*args, **kwargs):
            query, key, value = args[:3]
            extra = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale"), args[3:])) | kwargs
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, extra.get("dropout_p", 0.0), extra.get("is_causal", False),
                attn_mask=extra.get("attn_mask"), scale=extra.get("scale"))[0]
        return func(*args, **kwargs)

    def _fused(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False) -> bool:
        """Whether torch picks a fused kernel for real tensors like these on the compute device."""
        if query.dim() != 4 or key.shape[-3] != query.shape[-3] or enable_gqa:
            return False
        small = [torch.zeros(1, t.shape[1], min(t.shape[2], 8), t.shape[3], dtype=t.dtype, device=self.device)
                 for t in (query, key, value)]  # this mode is off inside __torch_function__
        mask = None if attn_mask is None else torch.zeros(1, 1, small[0].shape[2], small[1].shape[2],
                                                          dtype=attn_mask.dtype, device=self.device)
        return torch._fused_sdp_choice(*small, mask, dropout_p, is_causal, scale=scale) != SDPBackend.MATH.value


def measure_activations(module: nn.Module, layouts: list[UnitLayout], compute_bytes: int, inputs: tuple,
                        kwargs: dict | None = None, device: torch.device = torch.device("cpu")) -> ActivationProfile:
    """The activation bytes of one forward of the meta-device ``module`` on ``inputs`` (meta tensors,
    or real ones, whose shapes are used), with its units found as ``layouts``, for compute on ``device``."""
    saved = _SavedBytes(module, compute_bytes)
    blocks = [layout for layout in layouts if layout.name]
    hooks = []
    for layout in blocks:
        hooks.append(layout.module.register_forward_pre_hook(
            lambda _, args, name=layout.name: saved.enter(name, args)))
        hooks.append(layout.module.register_forward_hook(lambda *_: setattr(saved, "current", "")))
    meta_inputs = tuple(_on_meta(a) for a in inputs)
    meta_kwargs = {k: _on_meta(v) for k, v in (kwargs or {}).items()}
    try:
        with (torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t),
              MetaBranches(), _FusedAttention(device)):
            output = module(*meta_inputs, **meta_kwargs)
        del output
    finally:
        for hook in hooks:
            hook.remove()
    in_blocks = [saved.by_unit.get(layout.name, 0) for layout in blocks]
    root, largest = saved.by_unit.get("", 0), max(in_blocks, default=0)
    backward_temporaries = 3 * max(largest, root)
    inputs = sum(saved.inputs.values())
    return ActivationProfile(plain=root + sum(in_blocks) + backward_temporaries,
                             checkpointed=root + inputs + largest + backward_temporaries, checkpoint_inputs=inputs,
                             backward_temporaries=backward_temporaries)


def _on_meta(value: Any) -> Any:
    """A tensor's meta twin (same shape and dtype, no data); anything else as is."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    return value


def checkpoint_blocks(layouts: list[UnitLayout], offload: Any = None) -> None:
    """``checkpoint_forward`` on every block unit's module; the root unit, which holds the embeddings and
    the head, runs as it is."""
    for layout in layouts:
        if layout.name:
            checkpoint_forward(layout.module, offload)


def checkpoint_forward(module: nn.Module, offload: Any = None) -> None:
    """Recompute ``module``'s activations in backward (``train.activation_checkpointing``).

    The module's own ``forward`` is wrapped on the instance (its class is left alone) with torch's
    non-reentrant checkpoint, only while gradients are enabled so evaluation runs plainly. ``offload``
    (``activation_offload.HostActivations``) keeps the inputs the checkpoint saves off the device.
    """
    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with offload.hooks() if offload is not None else contextlib.nullcontext():
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
