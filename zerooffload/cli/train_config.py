"""The config of ``zerooffload train`` and ``zerooffload plan``: ``train_defaults`` for the model without
``--config``, then overrides, and for ``train`` the schedule's length from ``--steps``; and the layout a
plain ``train`` runs (``DEFAULT_LAYOUT``).

[Note: the default layout]
What the tool is for is a model whose states do not fit in memory, so a plain ``zerooffload train``
pages them: ZeRO stage 3 with the parameters and every optimizer state (fp32 master, Adam's moments)
on NVMe, in a temporary swap folder on ``--out``'s disk that the run removes (train's ``swap_folder``),
and ``plan`` choosing the rest of the layout (activation checkpointing, the stage-3 window, a compact
state format only where nothing else fits) for ``train_defaults``' batch, which it keeps: one block
timed instead of one per micro-batch size (the nano preset's plan: 4.4 s instead of 14.4 on the
project's 2-core machine; left free it chose that batch in one micro-batch anyway). Budgets stay the
machine's: no budget makes a plan put the nano preset's states on NVMe, as its NVMe layouts' host
staging buffers (13.1-15.5 MB) outweigh its whole optimizer state kept on the host (10.9 MB), so the
default pins the tiers rather than pretend the machine is small.
How it composes with what the user says:
- ``--config FILE``, ``--plan FILE`` or ``--plan auto``: the user's file or plan lays the run out; no
  default layout.
- A *layout key* given as an override (``LAYOUT_KEYS``: where states live and what a step holds in
  memory): the user lays the run out, and the default layout steps aside whole; ``train_defaults`` and
  the library's defaults fill what the user left (``--plan auto`` has plan choose it instead). Whole,
  because its parts hold only together: parameters on NVMe need stage 3, the swap folder serves only
  an NVMe tier, and a user's ``offload.param.tier=device`` must not leave a stage-3 optimizer on NVMe.
- Any other key composes with it, the user's value winning: the optimizer, the schedule, the precision,
  the state formats (``optimizer.master``, ``optimizer.moments``: the swap shrinks), ``nvme.checksum``,
  ``nvme.max_bytes``, ``[aio]``.

[Note: defaults by model size]
One learning rate does not suit models from 1M to 2B parameters: the first Adam steps move every
weight by about the learning rate, and what that does to a layer's output grows with its width.
So the peak learning rate follows GPT-3's table by size (Brown et al. 2020, Table 2.1: 6e-4 at 125M,
3e-4 at 350M, 2.5e-4 at 760M, 2e-4 at 1.3B, 1.6e-4 at 2.7B, 1.2e-4 at 6.7B), on a log-log line
between its rows and, below 125M, on to 3e-3 at 1M (the tiny presets, whose loss must fall visibly in
a minute). Adam's first update moves every weight by the full learning rate (its moments' ratio is
the gradient's sign), which a deep, wide model does not survive at its peak rate: on the 350m preset
(16 x 1024 tokens a step) a first update at 1e-5 already raised the loss from 5.4 to 6.7, at 3e-6 it
fell to 4.6; yet the nano preset, started at a hundredth of its peak, spiked from 3.3 to 6.2 at the
end of its warmup, and not from a tenth. Past 1B the first update must be smaller still: the 7b's
first step at 1.21e-6 (a hundredth of its peak) took the loss of the batch it stepped on from 5.59 to
13.6 and of the next from 6.04 to 15.3 (the engine's run: 5.59, 15.38), and the same first AdamW step
computed in plain PyTorch on the same weights and batch does the same (``bench/first_update.py``,
recorded as ``first_update_7b``: 13.66 and 15.38; at the 7b's first rate now, 1.52e-7, 4.70 and 5.458, the
engine's second loss 5.458): a sign update of that size is no engine defect. So the warmup's
start falls a decade per 30x in parameters: a tenth of the peak up to 10M parameters, a hundredth at
300M, a thousandth from 9B on, log-linearly between (``min_lr``, also where the cosine ends; the 7b
starts at 1.52e-7), and lasts longer the larger the model: ``warmup_steps`` (20, or one per 3M
parameters). The rule past 1B: from ``BF16_FROM`` on the batch is one sequence (1,024 tokens), 2,048
times smaller than the batch GPT-3's rate was tuned for, and Adam's rate follows the batch's square root
(Malladi et al. 2022), so the peak is GPT-3's over 45 (the 7b's 2.68e-6) while the warmup still starts
at GPT-3's share above: started at 1.52e-7 and climbing toward 1.21e-4, the 7b's losses fell 5.59 ->
5.46 -> 4.24 -> 4.12, then rose with the rate, 4.26 at 3.2e-7 and 5.63 at 3.8e-7; toward 2.68e-6
they went 5.59 -> 5.46 -> 4.30 -> 4.50 -> 3.55 -> 5.37 (``python bench/results.py --only learns_7b``:
none above the first, the sixth below it; the batches differ by ~0.5 at the same weights). The
initialization is GPT-2's (``models.gpt``: residual projections scaled by 1/sqrt(2 x layers)). From
``BF16_FROM`` parameters on (the ``7b`` preset) the defaults are bf16 and a batch of one sequence: fp32
matmuls run ~6x slower than bf16 on these CPUs, and a step of 16 x 1024 tokens would take an hour.
``plan`` starts from the same defaults, so a plan it writes trains the batch ``train`` would have
trained.
"""
from __future__ import annotations

import json
import math

from ..config import Config, apply_override

__all__ = ["DEFAULT_LAYOUT", "DEFAULT_STEPS", "LAYOUT_KEYS", "WARMUP_STEPS", "default_layout", "learning_rate",
           "load_train_config", "train_defaults", "warmup_start", "warmup_steps"]

_LR_BY_SIZE = ((1e6, 3e-3), (125e6, 6e-4), (350e6, 3e-4), (760e6, 2.5e-4), (1.3e9, 2e-4), (2.7e9, 1.6e-4),
               (6.7e9, 1.2e-4))
"""(parameters, peak learning rate): GPT-3's table, and 3e-3 for a model of 1M (see the note)."""
BF16_FROM = 5e9
"""From this many parameters on, ``train_defaults`` are bf16 and a micro-batch of 1 (see the note)."""
ONE_SEQUENCE_TOKENS = 1024
"""Tokens a step of the ``BF16_FROM`` defaults: one sequence of the 7b preset's 1024."""
GPT3_BATCH_TOKENS = 2 ** 21
"""GPT-3's batch for its 6.7B model (Table 2.1: 2M tokens), the batch its rate was tuned for."""
WARMUP_STEPS = 20
"""The shortest warmup (``warmup_steps``)."""
WARMUP_PARAMS_PER_STEP = 3e6
DEFAULT_STEPS = 300
"""``train``'s ``--steps`` by default; the schedule length ``plan`` writes (``train --plan`` replaces it)."""
DEFAULT_LAYOUT = {"zero.stage": 3, "offload.param.tier": "nvme", "offload.optimizer.tier": "nvme",
                  "offload.optimizer.fraction": 1.0}
"""What a plain ``train`` pins ([Note: the default layout]); ``nvme.path`` is its swap folder."""
LAYOUT_KEYS = frozenset({
    "zero.stage", "zero.prefetch_size", "zero.max_live_size", "offload.param.tier", "offload.param.path",
    "offload.optimizer.tier", "offload.optimizer.path", "offload.optimizer.fraction", "offload.activations.tier",
    "train.micro_batch_size", "train.grad_accum_steps", "train.activation_checkpointing", "memory.device_budget",
    "memory.host_budget", "nvme.path"})
"""The keys of a run's layout: an override of any of them lays the run out ([Note: the default layout])."""


def learning_rate(params: float) -> float:
    """The peak learning rate for a model of ``params`` parameters (see the note), log-log between rows."""
    sizes, rates = zip(*_LR_BY_SIZE)
    if params <= sizes[0] or params >= sizes[-1]:
        return rates[0] if params <= sizes[0] else rates[-1]
    upper = next(i for i, size in enumerate(sizes) if size >= params)
    share = math.log(params / sizes[upper - 1]) / math.log(sizes[upper] / sizes[upper - 1])
    return math.exp(math.log(rates[upper - 1]) + share * math.log(rates[upper] / rates[upper - 1]))


def warmup_steps(params: float) -> int:
    """Steps of warmup for a model of ``params`` parameters (see the note)."""
    return max(WARMUP_STEPS, round(params / WARMUP_PARAMS_PER_STEP))


def warmup_start(params: float) -> float:
    """The share of the peak learning rate the warmup starts from (see the note): 1/10 up to 10M
    parameters, 1/100 at 300M, 1/1000 from 9B on, log-linear between."""
    decades = min(max(math.log(params / 1e7) / math.log(30), 0.0), 2.0)
    return 10 ** (-1 - decades)


def train_defaults(params: float) -> dict:
    """What ``train`` and ``plan`` use without ``--config`` for a model of ``params`` parameters: a batch
    of 16, clipping at 1.0, AdamW at ``learning_rate(params)`` with a warmup-cosine schedule from and
    to ``warmup_start(params)`` of it (fp32: faster than bf16 at the small presets' sizes; from
    ``BF16_FROM`` parameters, bf16 and a batch of 1)."""
    lr = learning_rate(params)
    large = {"micro_batch_size": 1, "precision": "bf16"} if params >= BF16_FROM else {}
    peak = lr * math.sqrt(ONE_SEQUENCE_TOKENS / GPT3_BATCH_TOKENS) if large else lr
    return {"train": {"micro_batch_size": 16, "grad_clip": 1.0, **large},
            "optimizer": {"lr": float(f"{peak:.3g}"), "weight_decay": 0.1, "betas": [0.9, 0.95]},
            "scheduler": {"type": "warmup_cosine", "warmup_steps": warmup_steps(params),
                          "min_lr": float(f"{lr * warmup_start(params):.3g}")}}


def default_layout(config_path: str | None, plan: str | None, overrides: list[str]) -> bool:
    """Whether a ``train`` run takes ``DEFAULT_LAYOUT``: no config file, no ``--plan`` and no layout key
    among the overrides ([Note: the default layout])."""
    return config_path is None and plan is None and not any(
        override.partition("=")[0].strip() in LAYOUT_KEYS for override in overrides)


def load_train_config(config_path: str | None, overrides: list[str], params: float, steps: int = DEFAULT_STEPS, *,
                      plan_file: bool = False) -> Config:
    """The run's config: the file or ``train_defaults(params)``, then overrides; a decaying schedule
    without ``total_steps`` spans ``steps`` (train's ``--steps``). A ``plan_file``'s ``total_steps`` is
    the length plan assumed, not the run's: it is replaced the same way."""
    data = Config.load(config_path).to_dict() if config_path else json.loads(json.dumps(train_defaults(params)))
    if plan_file:
        data.get("scheduler", {}).pop("total_steps", None)
    for override in overrides:
        data = apply_override(data, override)
    scheduler = data.get("scheduler", {})
    if scheduler.get("type", "constant") != "constant" and not scheduler.get("total_steps"):
        data = apply_override(data, f"scheduler.total_steps={max(steps, scheduler.get('warmup_steps', 0) + 1)}")
    return Config.load(data)
