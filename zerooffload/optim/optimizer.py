"""``ZeroOptimizer``: torch-style param groups over this rank's fp32 master pieces.

[Note: optimizer pieces]
The tensors in ``param_groups[i]["params"]`` are *pieces*: views of the fp32 master shards, one per
parameter part this rank owns (``unit_layout.Piece``). Before a step the engine points each piece's
``.grad`` at its averaged fp32 gradient, or leaves it ``None`` when no rank produced a gradient for
that parameter in the window, so torch skips it exactly as it skips an unused parameter. The update
itself is torch's own (fused AdamW/Adam/SGD kernels where the device has them), sharing these group
dicts, so LR schedulers and per-group settings behave as with any torch optimizer; except that Adam
and AdamW on CPU tensors run the native fused pass (``cpu_adam``: torch's arithmetic, in one pass
that also writes the compute-dtype copy of each piece, ``outs``). Moments live in the unit's optimizer
block (``optim.state``), accounted on its tier, and pieces' state are views of it (int8 moments' codes,
with their scales beside them as ``exp_avg_scale`` and ``exp_avg_sq_scale``). A split master's
pieces are views of its int16 residuals instead (state_formats' [Note: split masters]): the native
pass reads each piece's weights from ``outs`` and rewrites them with the residual.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..config import ConfigError, OptimizerConfig
from .cpu_adam import AdamUpdate, fused_adam_steps, simd_level

__all__ = ["ZeroOptimizer", "moment_names"]

_TORCH = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def _defaults(config: OptimizerConfig) -> dict:
    if config.type == "sgd":
        return {"lr": config.lr, "momentum": config.momentum, "weight_decay": config.weight_decay}
    return {"lr": config.lr, "betas": config.betas, "eps": config.eps, "weight_decay": config.weight_decay}


def _fusable(groups: list[dict]) -> bool:
    """torch's fused kernels need fp32 tensors on a CPU or CUDA device."""
    return all(p.dtype == torch.float32 and p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])


def moment_names(config: OptimizerConfig) -> tuple[str, ...]:
    """The per-element state tensors the update keeps (and the optimizer tier must hold)."""
    if config.type == "sgd":
        return ("momentum_buffer",) if config.momentum else ()
    return ("exp_avg", "exp_avg_sq")


def _why_not_native(groups: list[dict]) -> str:
    if simd_level() == "torch":
        return "the extension zerooffload._cpu_adam is not built: reinstall with a C compiler"
    return "its optimizer state is on a GPU: set offload.optimizer.tier = 'host' or 'nvme'"


class ZeroOptimizer(torch.optim.Optimizer):
    """torch-style ``param_groups`` whose params are master pieces (see [Note: optimizer pieces])."""

    def __init__(self, groups: list[dict], config: OptimizerConfig):
        super().__init__(groups, _defaults(config))
        self.kind = config.type
        self.fused = _fusable(self.param_groups)
        """Whether torch's update (where it runs) is its fused kernel."""
        self._torch_update: torch.optim.Optimizer | None = None
        self._stepping: Callable[[], None] | None = None
        """The engine's update of its units while ``step_with`` runs ``step``."""
        self._noise: dict[torch.Tensor, tuple[int, int]] = {}
        """Each piece's bf16 moments' rounding noise: its key and first element number (``attach_state``)."""
        self.native = config.type in ("adam", "adamw") and simd_level() != "torch" and all(
            p.device.type == "cpu" for g in self.param_groups for p in g["params"])
        for key, value in (("master", config.master), ("moments", config.moments)):
            if value != "fp32" and not self.native:
                raise ConfigError(f"optimizer.{key} = {value!r} needs the native CPU Adam pass, which this run does not "
                                  f"have ({_why_not_native(self.param_groups)}); set optimizer.{key} = 'fp32'")

    def add_param_group(self, param_group: dict) -> None:
        """torch's own, without the wrapper around it that imports ``torch._dynamo`` on first use (4 s and
        ~100 MiB of modules here, for a guard that matters only under ``torch.compile``, which never runs
        these pieces). The native update then imports none of it; torch's update does, when it runs."""
        add = torch.optim.Optimizer.add_param_group
        getattr(add, "__wrapped__", add)(self, param_group)

    def attach_state(self, piece: torch.Tensor, moments: dict[str, torch.Tensor], noise: tuple[int, int] = (0, 0)
                     ) -> None:
        """Give a piece its moment tensors (views into tier-owned buffers) before the first step, and the
        key and first element number of its bf16 moments' rounding noise (``cpu_adam``'s note)."""
        self._noise[piece] = noise
        state = dict(moments)
        if self.kind != "sgd":
            state["step"] = torch.zeros((), dtype=torch.float32, device=piece.device if self.fused else "cpu")
        self.state[piece] = state

    def _torch(self) -> torch.optim.Optimizer:
        """torch's optimizer over the same groups and state, made on its first use."""
        if self._torch_update is None:
            self._torch_update = _TORCH[self.kind](self.param_groups, fused=self.fused)
            self._torch_update.state = self.state
        return self._torch_update

    @torch.no_grad()
    def step(self, closure=None):
        """torch's step. The engine calls it once per optimizer step (``step_with``) and updates its units
        inside, so step hooks, the profiler's range and LR schedulers' bookkeeping see one step, however
        many units it updates (and however many backward updated already). Called alone, it updates
        the pieces whose ``.grad`` is set."""
        if self._stepping is not None:
            return self._stepping()
        if not self.native:
            return self._torch_step(closure, {}, 1.0, {})
        self.update({p: p.grad for g in self.param_groups for p in g["params"] if p.grad is not None})
        return None

    def step_with(self, update_units: Callable[[], None]) -> None:
        """One torch ``step`` whose work is ``update_units`` (which calls ``update`` per unit)."""
        self._stepping = update_units
        try:
            self.step()
        finally:
            self._stepping = None

    def hyperparameters(self) -> list[dict]:
        """The groups' settings as they are now (each group's dict copied, its pieces shared): for updates
        that run after the LR scheduler has moved on (step_updates' [Note: the step beside the next forward])."""
        return [dict(group) for group in self.param_groups]

    def update(self, grads: dict[torch.Tensor, torch.Tensor], grad_scale: float = 1.0,
               outs: dict[torch.Tensor, torch.Tensor] | None = None, *, sumsq: bool = False,
               groups: list[dict] | None = None) -> torch.Tensor | None:
        """The update over the pieces in ``grads`` (piece -> its gradient), without torch's step wrapper:
        the per-unit work of a step. Each piece in ``outs`` also gets its new value written (cast) into
        ``outs[piece]``. ``grad_scale`` multiplies the gradients first: the native pass takes any dtype,
        torch's update fp32 gradients with ``grad_scale`` 1. With ``sumsq`` (the native pass only),
        returns the sum of the squares of the gradients as given (before ``grad_scale``; float64),
        summed as the pass reads them. ``groups``: the native pass's settings (``hyperparameters``), by
        default the groups as they are."""
        if not self.native:
            if sumsq:
                raise ValueError("update(sumsq=True) runs the native pass: this optimizer is not native")
            self._torch_step(None, grads, grad_scale, outs or {})
            return None
        total = self._native_steps(grads, grad_scale, outs or {}, sumsq, groups or self.param_groups)
        return torch.tensor(total, dtype=torch.float64) if sumsq else None

    @torch.no_grad()
    def _torch_step(self, closure, grads: dict, grad_scale: float, outs: dict):
        if grad_scale != 1.0:
            raise ValueError("torch's update takes gradients already scaled: pass grad_scale = 1.0")
        for piece, grad in grads.items():
            piece.grad = grad
        try:
            loss = self._torch().step(closure)
        finally:
            for piece in grads:
                piece.grad = None
        for piece, out in outs.items():
            out.copy_(piece)
        return loss

    def _native_steps(self, grads: dict, grad_scale: float, outs: dict, grad_sumsq: bool, groups: list[dict]
                      ) -> float:
        """Every piece in ``grads`` updated by one native pass (``fused_adam_steps``) with ``groups``' settings;
        returns the sum of their gradients' squares (0 without ``grad_sumsq``)."""
        updates, copies = [], []
        for group in groups:
            for piece in group["params"]:
                grad = grads.get(piece)
                if grad is None:
                    continue
                state = self.state[piece]
                state["step"] += 1
                out = outs.get(piece)
                split = dict(residual=piece, residual_bits=state["residual_bits"], residual_bit0=state["residual_bit0"]
                             ) if piece.dtype == torch.int16 else {}  # a split master: the piece is its residual
                fused_out, copied_from = _pass_out(out, piece, bool(split))
                if copied_from is not None:
                    copies.append((out, copied_from))
                key, base = self._noise.get(piece, (0, 0))
                scales = {f"{name}_scale": state[f"{name}_scale"] for name in ("exp_avg", "exp_avg_sq")
                          } if state["exp_avg"].dtype == torch.uint8 else {}  # int8 moments' scales
                updates.append(AdamUpdate(None if split else piece, grad, state["exp_avg"], state["exp_avg_sq"],
                                          fused_out, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                          weight_decay=group["weight_decay"], step=int(state["step"].item()),
                                          adamw=self.kind == "adamw", grad_scale=grad_scale, grad_sumsq=grad_sumsq,
                                          noise_key=key, noise_base=base, **split, **scales))
        sums = fused_adam_steps(updates) if updates else []
        for out, source in copies:
            out.copy_(source)
        return sum(sumsq or 0.0 for sumsq in sums)


def _pass_out(out: torch.Tensor | None, piece: torch.Tensor, split: bool
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The out the native pass writes (it writes CPU memory) and what a GPU ``out`` is copied from after
    it: the fp32 master, cast on the way; or, for a split master, whose weights are half of it and read
    by the pass, those weights staged on the host and written back."""
    if out is None or out.device.type == "cpu":
        return out, None
    if split:
        staged = out.to("cpu")
        return staged, staged
    return None, piece
