"""``fused_adam_step``: one fused pass of Adam/AdamW over an fp32 master shard on the CPU
(``fused_adam_steps``: over many, as one pass).

[Note: fused Adam tensors]
- *param*: the fp32 master values, updated in place; or None for a *split* master: the bf16 weight
  *out* (read and written), an int16 *residual* and its bits in uint8 *residual_bits* from bit
  *residual_bit0* (``state_formats``' [Note: split masters]), bitwise the update of the fp32 master.
- *grad*: the gradient, fp32, bf16 or fp16 (the engine's reduced gradient as it lies), read only;
  multiplied by *grad_scale* first (the engine's unscale x clip coefficient), in fp32.
- *exp_avg*, *exp_avg_sq*: the first and second moments (torch's state names), updated in place: fp32,
  or bf16 rounded stochastically with noise keyed by *noise_key*, the step and *noise_base* + the
  element's index (``state_formats``' [Note: bf16 moments]), or uint8 codes with one fp32 scale per
  block in *exp_avg_scale* and *exp_avg_sq_scale*, rounded with the same noise ([Note: int8 moments]).
- *out*: optional low-precision copy of the new param (bf16, fp16 or fp32), written in the same pass
  and rounded exactly as torch's ``.to(dtype)`` rounds, NaN, inf and subnormals included.
All are contiguous CPU tensors of one numel, in any shapes; they must not overlap.

Why one pass: an offloaded step is bound by memory bandwidth. torch's fused step followed by a cast
into the compute-dtype copy reads every parameter twice (~36 B/param); this pass moves 30 B/param
(28 with a bf16 grad) once. The arithmetic is torch's fused CPU kernel's, operation for operation
(native/cpu_adam.h), so the result equals ``torch.optim.AdamW/Adam(fused=True)`` stepping with
``param.grad = grad.float() * grad_scale``: bit for bit on torch 2.13's CPU build except in the last
``numel % 16`` elements, where torch's own kernel leaves its vector code and may differ from itself by
an ulp; within an ulp or two on builds that fuse other products.

The pass is the optional native extension ``zerooffload._cpu_adam`` (built apart from the I/O engine
``zerooffload._aio``, so either may be missing alone). Without it the same math runs as torch ops (a few
times slower); ``simd_level()`` then says ``"torch"``.
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch

from .state_formats import (INT8_BLOCK, decode_int8, encode_int8, int8_blocks, join_master, read_bits, round_bf16_stochastic,
                            rounding_noise, split_master, write_bits)

try:
    from .. import _cpu_adam
except ImportError:  # built optional (setup.py): the torch fallback below takes over
    _cpu_adam = None

__all__ = ["AdamUpdate", "fused_adam_step", "fused_adam_steps", "simd_level", "sum_squares"]

_DTYPE_NAMES = {torch.float32: "FP32", torch.bfloat16: "BF16", torch.float16: "FP16"}
"""The grad and out dtypes the pass reads and writes, by their name in the native module (DTYPE_*)."""
_MOMENT_NAMES = {torch.float32: "FP32", torch.bfloat16: "BF16", torch.uint8: "INT8"}
"""The moments' dtypes (uint8: int8 codes), likewise."""


def simd_level() -> str:
    """The instruction set ``fused_adam_step`` runs on: "avx512", "avx2", "scalar" (always, off x86), or
    "torch" when the native extension is missing. The environment variable ZO_ADAM_SIMD (avx512 | avx2 |
    scalar), read once per process, forces a lower level than the CPU's best (tests use it to cover every
    path)."""
    if _cpu_adam is None:
        return "torch"
    try:
        return _cpu_adam.adam_simd()
    except OSError:
        raise ValueError(f"ZO_ADAM_SIMD={os.environ.get('ZO_ADAM_SIMD')!r} names no level: "
                         "expected avx512, avx2 or scalar") from None


@dataclasses.dataclass(frozen=True)
class AdamUpdate:
    """One update's tensors and hyperparameters, as ``fused_adam_step`` takes them."""
    param: torch.Tensor | None
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    out: torch.Tensor | None
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    step: int
    adamw: bool = True
    grad_scale: float = 1.0
    grad_sumsq: bool = False
    residual: torch.Tensor | None = None
    residual_bits: torch.Tensor | None = None
    residual_bit0: int = 0
    noise_key: int = 0
    noise_base: int = 0
    exp_avg_scale: torch.Tensor | None = None
    exp_avg_sq_scale: torch.Tensor | None = None

    @property
    def split(self) -> bool:
        return self.residual is not None

    @property
    def numel(self) -> int:
        return self.out.numel() if self.split else self.param.numel()


def fused_adam_step(param: torch.Tensor | None, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    out: torch.Tensor | None = None, *, lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float, step: int, adamw: bool = True, grad_scale: float = 1.0,
                    threads: int = 0, grad_sumsq: bool = False, residual: torch.Tensor | None = None,
                    residual_bits: torch.Tensor | None = None, residual_bit0: int = 0, noise_key: int = 0,
                    noise_base: int = 0, exp_avg_scale: torch.Tensor | None = None,
                    exp_avg_sq_scale: torch.Tensor | None = None) -> float | None:
    """One Adam (``adamw=False``: L2 decay added to the gradient) or AdamW (decoupled decay) update in
    place, with ``step`` counting from 1 as torch's state["step"] after its increment; see the module
    note for the tensors. ``threads`` bounds the native pass's threads (0: every CPU this process may
    use; passes under 256Ki elements run on the calling thread). With ``grad_sumsq`` it returns the
    sum of the squares of ``grad`` as given (before ``grad_scale``), summed in the same pass: the norm
    for statistics costs no pass of its own. Raises ValueError naming the argument at fault."""
    update = AdamUpdate(param, grad, exp_avg, exp_avg_sq, out, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        step=step, adamw=adamw, grad_scale=grad_scale, grad_sumsq=grad_sumsq, residual=residual,
                        residual_bits=residual_bits, residual_bit0=residual_bit0, noise_key=noise_key,
                        noise_base=noise_base, exp_avg_scale=exp_avg_scale, exp_avg_sq_scale=exp_avg_sq_scale)
    _check_threads(threads)
    return _run([_checked(update)], threads)[0]


def fused_adam_steps(updates: list[AdamUpdate], threads: int = 0) -> list[float | None]:
    """``fused_adam_step`` on each of ``updates`` (which must not overlap), all in one native pass: one
    start of its threads for them all, each update's elements streamed after the last one's. A step's
    updates of many units cost what one update of as many elements does, not one thread start and one
    cold return to Python per unit. Every update is checked before any runs (a ValueError names the
    update and the argument at fault)."""
    _check_threads(threads)
    checked = []
    for index, update in enumerate(updates):
        try:
            checked.append(_checked(update))
        except ValueError as error:
            raise ValueError(f"updates[{index}]: {error}") from None
    return _run(checked, threads)


def _run(updates: list[tuple[AdamUpdate, float, float]], threads: int) -> list[float | None]:
    """Checked updates (with their betas as floats) run by the native pass, or by torch's ops without it."""
    if _cpu_adam is None:
        return [_torch_update(update, beta1, beta2) for update, beta1, beta2 in updates]
    simd_level()  # a bad ZO_ADAM_SIMD surfaces here as a ValueError naming it, not as OSError(EINVAL)
    sums = _cpu_adam.adam_steps([_native_arguments(update, beta1, beta2) for update, beta1, beta2 in updates], threads)
    return [sumsq if sumsq is None or math.isfinite(sumsq) else sum_squares(update.grad).item()
            for sumsq, (update, _, _) in zip(sums, updates)]  # squares past fp32's range: sum_squares decides


def _native_arguments(u: AdamUpdate, beta1: float, beta2: float) -> tuple:
    """One update as the native module's ``adam_steps`` takes it."""
    split, int8 = u.split, u.exp_avg.dtype == torch.uint8
    return (0 if split else u.param.data_ptr(), u.grad.data_ptr(), _dtype_code(u.grad), u.exp_avg.data_ptr(),
            u.exp_avg_sq.data_ptr(), _dtype_code(u.exp_avg), u.exp_avg_scale.data_ptr() if int8 else 0,
            u.exp_avg_sq_scale.data_ptr() if int8 else 0, 0 if u.out is None else u.out.data_ptr(), _dtype_code(u.out),
            _cpu_adam.MASTER_SPLIT if split else _cpu_adam.MASTER_FP32, u.residual.data_ptr() if split else 0,
            u.residual_bits.data_ptr() if split else 0, u.residual_bit0, u.noise_key & 0xFFFFFFFF,
            u.noise_base & 0xFFFFFFFF, u.numel, float(u.lr), beta1, beta2, float(u.eps), float(u.weight_decay),
            float(u.grad_scale), u.step, bool(u.adamw), bool(u.grad_sumsq))


def _torch_update(u: AdamUpdate, beta1: float, beta2: float) -> float | None:
    """The update with torch's ops on fp32 values: a split master joined first and split after, bf16
    and int8 moments widened first and rounded after as the native pass rounds them."""
    sumsq = sum_squares(u.grad).item() if u.grad_sumsq else None  # the gradient as given, before the update
    n = u.numel
    param = u.param if not u.split else join_master(
        u.out, u.residual, read_bits(u.residual_bits, u.residual_bit0, n))
    int8 = u.exp_avg.dtype == torch.uint8
    if int8:
        exp_avg, exp_avg_sq = decode_int8(u.exp_avg, u.exp_avg_scale, True), decode_int8(u.exp_avg_sq,
                                                                                       u.exp_avg_sq_scale, False)
    else:
        exp_avg, exp_avg_sq = u.exp_avg.float(), u.exp_avg_sq.float()  # a copy when bf16
    _torch_step(param, u.grad, exp_avg, exp_avg_sq, None if u.split else u.out, lr=u.lr, beta1=beta1, beta2=beta2,
                eps=u.eps, weight_decay=u.weight_decay, step=u.step, adamw=u.adamw, grad_scale=u.grad_scale)
    if u.split:
        weight, residual, bits = split_master(param)
        u.out.view(-1).copy_(weight)
        u.residual.view(-1).copy_(residual)
        write_bits(u.residual_bits, u.residual_bit0, bits)
    noise = rounding_noise(u.noise_key, u.step, u.noise_base, n) if u.exp_avg.dtype != torch.float32 else None
    if u.exp_avg.dtype == torch.bfloat16:
        u.exp_avg.view(-1).copy_(round_bf16_stochastic(exp_avg, noise & 0xFFFF))
        u.exp_avg_sq.view(-1).copy_(round_bf16_stochastic(exp_avg_sq, noise >> 16))
    if int8:
        for codes, scales, values, noise16, signed in ((u.exp_avg, u.exp_avg_scale, exp_avg, noise & 0xFFFF, True),
                                                       (u.exp_avg_sq, u.exp_avg_sq_scale, exp_avg_sq, noise >> 16, False)):
            new_codes, new_scales = encode_int8(values, noise16, signed)
            codes.view(-1).copy_(new_codes)
            scales.copy_(new_scales)
    return sumsq


def sum_squares(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of the squares of ``tensor``'s elements, a float64 scalar on its device: a gradient's
    squared norm. Contiguous fp32/bf16/fp16 CPU tensors take one native read-only pass (every element
    squared in fp32, summed into a double, again in double when that is not finite), others torch's
    float64 norm: either way the result is finite exactly when every element is."""
    if _cpu_adam is not None and tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.dtype in _DTYPE_NAMES:
        simd_level()
        total = _cpu_adam.sum_squares(tensor.data_ptr(), _dtype_code(tensor), tensor.numel(), 0)
        return torch.tensor(total, dtype=torch.float64)
    return torch.linalg.vector_norm(tensor, dtype=torch.float64).square()


def _dtype_code(tensor: torch.Tensor | None) -> int:
    return _cpu_adam.DTYPE_NONE if tensor is None else getattr(_cpu_adam,
                                                              f"DTYPE_{(_DTYPE_NAMES | _MOMENT_NAMES)[tensor.dtype]}")


# ------------------------------------------------------------------------------------------------
# Validation


def _check_tensors(u: AdamUpdate) -> None:
    if u.split:
        if u.param is not None:
            raise ValueError("param must be None with a residual: a split master is out + residual")
        _check_tensor("out", u.out, (torch.bfloat16,), None)
        _check_tensor("residual", u.residual, (torch.int16,), u.out.numel())
        _check_tensor("residual_bits", u.residual_bits, (torch.uint8,), None)
        if isinstance(u.residual_bit0, bool) or not isinstance(u.residual_bit0, int) or u.residual_bit0 < 0:
            raise ValueError(f"residual_bit0 = {u.residual_bit0!r}: must be an int >= 0")
        if u.residual_bits.numel() * 8 < u.residual_bit0 + u.numel:
            raise ValueError(f"residual_bits has {u.residual_bits.numel() * 8} bits: {u.residual_bit0 + u.numel} "
                             f"needed from residual_bit0 = {u.residual_bit0}")
    else:
        _check_tensor("param", u.param, (torch.float32,), None)
        if u.out is not None:
            _check_tensor("out", u.out, tuple(_DTYPE_NAMES), u.numel)
    _check_tensor("grad", u.grad, tuple(_DTYPE_NAMES), u.numel)
    _check_tensor("exp_avg", u.exp_avg, tuple(_MOMENT_NAMES), u.numel)
    _check_tensor("exp_avg_sq", u.exp_avg_sq, (u.exp_avg.dtype,), u.numel)
    if u.exp_avg.dtype == torch.uint8:  # int8 codes: their blocks' scales
        for name, scales in (("exp_avg_scale", u.exp_avg_scale), ("exp_avg_sq_scale", u.exp_avg_sq_scale)):
            _check_tensor(name, scales, (torch.float32,), None)
            if scales.numel() != int8_blocks(u.numel):
                raise ValueError(f"{name} has {scales.numel()} elements: {int8_blocks(u.numel)} needed, a scale per "
                                 f"{INT8_BLOCK} elements of {u.numel}")


def _check_tensor(name: str, tensor, dtypes: tuple[torch.dtype, ...], numel: int | None) -> None:
    """The native pass sees only an address and param's numel, so everything else is checked here."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} is on {tensor.device}: the fused Adam pass runs on CPU tensors")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {str(tensor.dtype).removeprefix('torch.')}: expected {allowed}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous (strides {tensor.stride()}): pass {name}.contiguous()")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements but the master has {numel}")


def _checked(update: AdamUpdate) -> tuple[AdamUpdate, float, float]:
    """``update`` with its betas as floats, once its tensors and hyperparameters are checked."""
    _check_tensors(update)
    return (update, *_check_hyperparameters(update.lr, update.betas, update.eps, update.weight_decay, update.step))


def _check_hyperparameters(lr, betas, eps, weight_decay, step) -> tuple[float, float]:
    """The ranges torch.optim.Adam accepts, plus what the native pass needs; returns (beta1, beta2)."""
    if not lr >= 0:
        raise ValueError(f"lr = {lr}: must be >= 0")
    if not eps >= 0:
        raise ValueError(f"eps = {eps}: must be >= 0")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay = {weight_decay}: must be >= 0")
    beta1, beta2 = (float(b) for b in betas)
    for i, beta in enumerate((beta1, beta2)):
        if not 0 <= beta < 1:
            raise ValueError(f"betas[{i}] = {beta}: must be in [0, 1)")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step = {step!r}: must be an int >= 1 (the count after this update)")
    return beta1, beta2


def _check_threads(threads) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads = {threads!r}: must be an int >= 0 (0: every CPU)")


# ------------------------------------------------------------------------------------------------
# Fallback without the native extension


@torch.no_grad()
def _torch_step(param, grad, exp_avg, exp_avg_sq, out, *, lr, beta1, beta2, eps, weight_decay, step, adamw,
                grad_scale) -> None:
    """The native pass's math as torch ops, in the order torch's single-tensor Adam uses (which agrees
    with its fused kernel within an ulp or two); torch's own threads do the work."""
    p, m, v = param.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    g = grad.reshape(-1).float() * grad_scale
    if weight_decay != 0:
        if adamw:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = v.sqrt().div_(math.sqrt(1 - beta2 ** step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
    if out is not None:
        out.view(-1).copy_(p)
