#!/usr/bin/env python3
"""What Adam's first update does to a preset, computed by plain PyTorch: the reference for the 7b's loss jump.

``zerooffload train --model 7b`` once went 5.59 -> 15.38 -> 6.32 in its first three steps, at a first
learning rate of 1.21e-6. This computes the same first step without the engine: the preset built with the
engine's initial values (seed 0, ``init_fn`` module by module, as lazy init draws them), weights in the
defaults' precision (the 7b's bf16, rounded from an fp32 master), the default batch (one sequence of 1024 tokens of the byte corpus, step 0),
every block checkpointed; the gradient's global norm for the clip (train's default 1.0); then for each
first learning rate, ``torch.optim.AdamW`` (the defaults' betas, eps and weight decay) steps each
parameter's fp32 master, regenerated from its module's random state, as its gradient arrives (so only bf16
weights and one parameter's fp32 state are ever held: the 7b's 26 GB of fp32 master would not fit in RAM
beside its activations), and the weights are its bf16 rounding. Reported per learning rate: the loss of
batch 0 (the one stepped on) and of batch 1 (the engine's second step) before and after.

    python bench/first_update.py --model 7b                # the defaults' first lr and the old 1.21e-6
    python bench/first_update.py --model 350m --lrs 1e-5 3e-6
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pairs import record
from zerooffload.cli.train_config import train_defaults
from zerooffload.config import Config
from zerooffload.data import ByteCorpus
from zerooffload.lazy_init import init_context, swap_in_placeholders
from zerooffload.models import GPT, PRESETS
from zerooffload.optim.schedule import lr_factor

OLD_FIRST_LR = 1.21e-6
"""The 7b's first learning rate before the warmup's start followed the model's size past 300M."""


class Reference:
    """A preset in the compute dtype whose fp32 initial values can be drawn again parameter by parameter."""

    def __init__(self, preset: str, dtype: torch.dtype):
        self.dtype = dtype
        torch.manual_seed(0)
        with init_context():
            self.model = GPT(PRESETS[preset])
        swap_in_placeholders(self.model)
        self.init = self.model.init_fn()
        self.names = {id(p): name for name, p in self.model.named_parameters()}
        self.owner: dict[str, tuple[torch.nn.Module, str, torch.Tensor]] = {}
        """Parameter name -> (its module, its name there, the random state before the module's init)."""

    def materialize(self) -> None:
        """bf16 weights from the initial values, drawn in lazy init's order (a shared weight once)."""
        torch.manual_seed(0)
        done: set[int] = set()
        for module in self.model.modules():
            own = [(name, p) for name, p in module._parameters.items() if p is not None]
            if not own:
                continue
            state = torch.get_rng_state()
            values = self._draw(module, state)
            for name, p in own:
                if id(p) not in done:
                    p.data = values[name].to(self.dtype)
                    self.owner.setdefault(self.names[id(p)], (module, name, state))
                    done.add(id(p))

    def master(self, param: torch.nn.Parameter) -> torch.Tensor:
        """``param``'s fp32 initial value, drawn again from its module's random state."""
        module, name, state = self.owner[self.names[id(param)]]
        return self._draw(module, state)[name]

    def _draw(self, module: torch.nn.Module, state: torch.Tensor) -> dict[str, torch.Tensor]:
        """The module's initializer run on fp32 stand-ins from ``state`` (the RNG advances as lazy init's)."""
        torch.set_rng_state(state)
        saved = dict(module._parameters)
        stand_ins = {name: torch.nn.Parameter(torch.empty(p.shape)) for name, p in saved.items() if p is not None}
        module._parameters.update(stand_ins)
        try:
            with torch.no_grad():
                self.init(module)
        finally:
            module._parameters.update(saved)
        return {name: p.detach() for name, p in stand_ins.items()}

    def loss(self, x: torch.Tensor, y: torch.Tensor, grad: bool) -> torch.Tensor:
        """The model's loss with every block checkpointed (as the engine's default run), logits in fp32."""
        model = self.model
        with torch.set_grad_enabled(grad):
            h = model.wte(x) + model.wpe(torch.arange(x.shape[1]))
            for block in model.h:
                h = checkpoint(block, h, use_reentrant=False) if grad else block(h)
            logits = model.lm_head(model.ln_f(h))
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def first_step(ref: Reference, batch, lr: float, coef: float, adamw: dict) -> None:
    """AdamW's first step at ``lr`` on ``batch``'s gradient times ``coef``, parameter by parameter."""
    def step(param: torch.nn.Parameter) -> None:
        master = torch.nn.Parameter(ref.master(param))
        master.grad = param.grad.float() * coef
        param.grad = None
        torch.optim.AdamW([master], lr=lr, **adamw).step()
        param.data = master.detach().to(ref.dtype)
    handles = [p.register_post_accumulate_grad_hook(step) for p in ref.model.parameters()]
    ref.loss(*batch, grad=True).backward()
    for handle in handles:
        handle.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="7b")
    parser.add_argument("--lrs", type=float, nargs="*", help="first learning rates (default: the defaults' and "
                        f"the old {OLD_FIRST_LR:g})")
    args = parser.parse_args()
    params = PRESETS[args.model].num_params
    config = Config.load(train_defaults(params), overrides=["scheduler.total_steps=1000000"])
    default_lr = config.optimizer.lr * lr_factor(0, config.scheduler, config.optimizer.lr)
    lrs = args.lrs or [default_lr, OLD_FIRST_LR]
    adamw = {"betas": tuple(config.optimizer.betas), "eps": config.optimizer.eps,
             "weight_decay": config.optimizer.weight_decay}
    batch_size = config.train.micro_batch_size
    corpus = ByteCorpus()
    batches = [corpus.batch(step, batch_size=batch_size, seq_len=PRESETS[args.model].block_size)
               for step in (0, 1)]
    started = time.monotonic()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[config.train.precision]
    ref = Reference(args.model, dtype)
    ref.materialize()
    before = [ref.loss(*b, grad=False).item() for b in batches]
    squares = []

    def square(param: torch.nn.Parameter) -> None:
        squares.append(param.grad.float().pow(2).sum().item())
        param.grad = None
    hooks = [p.register_post_accumulate_grad_hook(square) for p in ref.model.parameters()]
    ref.loss(*batches[0], grad=True).backward()
    for hook in hooks:
        hook.remove()
    norm = math.sqrt(sum(squares))
    clip = config.train.grad_clip
    coef = min(1.0, clip / (norm + 1e-6)) if clip else 1.0
    where = (f"{args.model} ({params / 1e9:.2f}B), {config.train.precision}, plain PyTorch AdamW, batch {batch_size} x "
             f"{PRESETS[args.model].block_size}")
    print(f"{where}: losses before {before[0]:.4f} (batch 0), {before[1]:.4f} (batch 1); gradient norm "
          f"{norm:.1f}, clip coefficient {coef:.4g} ({time.monotonic() - started:.0f} s)", flush=True)
    for i, lr in enumerate(lrs):
        if i:
            ref.materialize()
        first_step(ref, batches[0], lr, coef, adamw)
        after = [ref.loss(*b, grad=False).item() for b in batches]
        print(f"first lr {lr:.3g}{' (the defaults)' if lr == default_lr else ''}: batch 0 {before[0]:.4f} -> "
              f"{after[0]:.4f}, batch 1 {before[1]:.4f} -> {after[1]:.4f} ({time.monotonic() - started:.0f} s)",
              flush=True)
        record("check", title=f"{where}: loss of batch 1 after a first step at lr {lr:.3g}", value=after[1],
               target="—", met=None, detail=f"before {before[1]:.4f}; batch 0 (stepped on) {before[0]:.4f} -> "
               f"{after[0]:.4f}; gradient norm {norm:.1f}, clip coefficient {coef:.4g}"
               f"{'; the defaults first lr' if lr == default_lr else ''}")


if __name__ == "__main__":
    main()
