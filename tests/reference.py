"""A small model with every awkward feature, and plain-PyTorch training on the full global batch.

The engine's results are compared against this reference, never against themselves: same initial
weights, same data; the reference sees each global micro-batch whole, in one process, with torch's
own AdamW, ``clip_grad_norm_`` and (for fp16) ``GradScaler``-style skipping.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, SEQ = 96, 48, 8


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """Tied embedding/head, a frozen layer, an unused layer, and block 1 called twice."""

    def __init__(self, blocks: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(blocks))
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(WIDTH, WIDTH)
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx, targets):
        x = self.embed(idx)
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        x = self.blocks[1](x)
        for block in self.blocks[2:]:
            x = block(x)
        logits = self.head(self.ln_f(self.frozen(x)))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def make_batches(steps: int, accum: int, global_batch: int, seed: int = 1) -> list[list[tuple]]:
    """``steps`` windows of ``accum`` global micro-batches of (idx, targets)."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, VOCAB, (global_batch, SEQ), generator=g),
              torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)) for _ in range(accum)]
            for _ in range(steps)]


def reference_train(model: nn.Module, batches, *, lr=1e-2, weight_decay=0.1, clip=0.0, dtype=torch.float32,
                    parts: int = 1, average_each_micro_batch: bool = False, optimizer_class=torch.optim.AdamW):
    """Plain PyTorch: fp32 master weights, ``dtype`` compute copies, AdamW (or ``optimizer_class``) on the
    full global batch.

    With ``parts`` > 1 each global micro-batch is run as that many equal slices whose ``dtype``
    gradients are averaged in ``dtype``: the rounding that splitting a batch over ranks implies. In
    bf16 that alone moves updates by ~3e-2 at this model's size (checked with plain PyTorch against
    ``parts=1``), so bf16 engines are compared against the split their world size makes, averaged
    per window (stages 0–1) or per micro-batch and then accumulated (``average_each_micro_batch``,
    stage 2).
    """
    master = copy.deepcopy(model)
    params = [p for p in master.parameters() if p.requires_grad]
    optimizer = optimizer_class(params, lr=lr, weight_decay=weight_decay)
    for window in batches:
        copies = [copy.deepcopy(master).to(dtype) for _ in range(parts)]
        total: list = [None] * len(params)
        for number, (idx, targets) in enumerate(window):
            rows = len(idx) // parts
            for part, compute in enumerate(copies):
                chunk = slice(part * rows, (part + 1) * rows)
                (compute(idx[chunk], targets[chunk]) / len(window)).backward()
            if average_each_micro_batch or number == len(window) - 1:
                total = [_add(t, g, dtype) for t, g in zip(total, _averaged(copies, parts))]
                for compute in copies:
                    compute.zero_grad(set_to_none=True)
        for p, g in zip(params, total):
            p.grad = None if g is None else g.float()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in master.state_dict().items()}


def _averaged(copies: list[nn.Module], parts: int) -> list:
    """Per trainable parameter: the slices' gradients divided by their count and summed in fp32 (None if none)."""
    trainable = [[p for p in c.parameters() if p.requires_grad] for c in copies]
    out = []
    for same in zip(*trainable):
        grads = [p.grad.float() / parts for p in same if p.grad is not None]
        out.append(sum(grads[1:], grads[0]) if grads else None)
    return out


def _add(total, grad, dtype):
    """Accumulate an fp32 average into a ``dtype`` total, rounding once per addition as the engine does."""
    if grad is None:
        return total
    return (grad if total is None else total.float() + grad).to(dtype)


def update_errors(initial: dict, engine: dict, reference: dict) -> dict[str, float]:
    """‖Δ_engine − Δ_ref‖ / ‖Δ_ref‖ per parameter that moved in the reference (DESIGN §4)."""
    errors = {}
    for name, start in initial.items():
        delta_ref = reference[name].float() - start.float()
        delta = engine[name].float() - start.float()
        if delta_ref.norm() > 0:
            errors[name] = float((delta - delta_ref).norm() / delta_ref.norm())
    return errors


class BufferedNet(nn.Module):
    """Buffers of every shape and dtype beside the parameters: BatchNorm running statistics (with
    its 0-dim int64 ``num_batches_tracked``), a 0-dim counter and an n-dim bf16 trace that change in
    every training forward, a bool mask, and a non-persistent buffer (never saved)."""

    def __init__(self, blocks: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(blocks))
        self.norm = nn.BatchNorm1d(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("trace", torch.zeros(2, WIDTH, dtype=torch.bfloat16))
        self.register_buffer("mask", torch.arange(WIDTH) % 3 != 0)
        self.register_buffer("scratch", torch.ones(4), persistent=False)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x.transpose(1, 2)).transpose(1, 2) * self.mask
        if self.training:
            self.calls += 1
            self.trace.mul_(0.5).add_(x.detach().float().mean(dim=(0, 1)).to(torch.bfloat16))
        logits = self.head(x)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def make_buffered_model(seed: int = 0) -> BufferedNet:
    torch.manual_seed(seed)
    return BufferedNet()


# ---------------------------------------------------------------------------------------------- unit layouts
ALIGN = 1024
"""Shard granularity in elements: 4 KiB of fp32, the O_DIRECT alignment (README: every shard 4 KiB-aligned)."""


def units_of(model: nn.Module) -> list[tuple[str, list[nn.Parameter]]]:
    """The units the engine makes of ``model`` under the default ``zero.unit_modules``, written out here
    independently of the engine: each direct child of an ``nn.ModuleList``/``nn.Sequential`` (outermost
    ones only), in registration order, then the root unit for the rest; a parameter reached from several
    modules (tied) belongs to the unit of their lowest common ancestor; units without parameters are none.
    Each unit's parameters are listed trainable first (the flat layout's trainable prefix)."""
    roots: list[str] = []
    for path, module in model.named_modules():
        if any(path == r or path.startswith(r + ".") for r in roots):
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            roots += [f"{path}.{name}" if path else name for name, _ in module.named_children()]
    owners: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name.rpartition(".")[0])
        params[id(param)] = param
    members: dict[str, list[nn.Parameter]] = {root: [] for root in [*roots, ""]}
    for key, param in params.items():
        split = [path.split(".") if path else [] for path in owners[key]]
        common = []
        for parts in zip(*split):
            if len(set(parts)) > 1:
                break
            common.append(parts[0])
        owner = ".".join(common)
        unit = next((r for r in roots if owner == r or owner.startswith(r + ".")), "")
        members[unit].append(param)
    return [(root, sorted(members[root], key=lambda p: not p.requires_grad)) for root in [*roots, ""]
            if members[root]]


def shard_numel(numel: int, world: int) -> int:
    """Elements in each of ``world`` shards of a unit of ``numel``: its share, rounded up to ``ALIGN``."""
    return max(1, -(-(-(-numel // world)) // ALIGN)) * ALIGN


def unit_shards(model: nn.Module, world: int) -> list[int]:
    """Per unit of ``model`` (``units_of``), the elements of one shard at world size ``world``."""
    return [shard_numel(sum(p.numel() for p in params), world) for _, params in units_of(model)]


def padded_numel(model: nn.Module, world: int) -> int:
    """Every unit's flat size, padded to ``world`` aligned shards, summed: what the engine allocates for Ψ."""
    return world * sum(unit_shards(model, world))


def trainable_spans(model: nn.Module, world: int, rank: int) -> list[int]:
    """Per unit, rank ``rank``'s trainable part of its shard rounded up to ``ALIGN``: the size of the
    blocks (gradients, optimizer state) that hold it. A unit's trainable prefix ends at its first frozen
    parameter, or runs to the padded end when none is frozen."""
    spans = []
    for (_, params), shard in zip(units_of(model), unit_shards(model, world)):
        frozen_at = next((i for i, p in enumerate(params) if not p.requires_grad), None)
        prefix = world * shard if frozen_at is None else sum(p.numel() for p in params[:frozen_at])
        part = min(max(prefix - rank * shard, 0), shard)
        spans.append(-(-part // ALIGN) * ALIGN)
    return spans


class InfGrad(torch.autograd.Function):
    """Identity forward; backward turns the gradient to inf while ``armed``."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf") if InfGrad.armed else grad


class PoisonAfter(nn.Module):
    """Wraps a block: the gradient reaching everything below it (earlier blocks, embeddings) is inf."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return InfGrad.apply(self.block(x))
