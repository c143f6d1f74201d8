"""``zerooffload plan``: the layouts of a model that fit this machine, ranked by predicted step time.

It probes the machine once (``plan.probe``'s cache; ``--refresh`` measures again), prints the top
candidates with their predicted step split and peak memory per tier, says what bounds the best one,
and with ``--out`` writes it as a complete config that ``zerooffload train --plan FILE`` (or
``--config FILE``) runs, its prediction inside (``PlanResult.to_toml``). Without ``--config`` it plans
over the defaults ``train`` would use for the model (train_config's [Note: defaults by model size]),
so the batch it plans is the batch ``train`` trains.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import Config
from ..planning import PlanResult, model_spec, plan, state_format_words
from ..planning.search import Candidate
from .train_config import load_train_config

__all__ = ["format_plan", "run_plan"]

_GB = 1e9


def run_plan(args: argparse.Namespace) -> int:
    """Plan ``--model`` over ``train``'s defaults for its size (or ``--config``) and the overrides."""
    model = model_spec(args.model, args.seq, args.params, args.layers)
    config = load_train_config(args.config, args.overrides, model.num_params)
    result = plan(model, config, pinned=_pinned(args), world_size=args.world, batch_size=args.batch,
                  refresh=args.refresh, progress=lambda text: print(f"plan: {text}", file=sys.stderr),
                  ranks_per_node=args.ranks_per_node, inter_node_gbps=args.inter_node_rate)
    if args.json:
        print(json.dumps([_as_json(c) for c in result.fitting[:args.top]], indent=1))
    else:
        print(format_plan(result, args.top))
    if args.out:
        Path(args.out).write_text(result.to_toml())
        print(f"wrote {args.out}: train it with zerooffload train --plan {args.out}")
    return 0


def _pinned(args: argparse.Namespace) -> set[str]:
    """The searched keys the user fixed: in ``--config`` (as ``pinned_keys`` reads it) and as overrides."""
    from ..planning import pinned_keys

    return pinned_keys(Config.load(args.config or {}), args.overrides)


def format_plan(result: PlanResult, top: int) -> str:
    """The table of the ``top`` best layouts, the refusals in short, and the best one's bottleneck."""
    best = result.best
    fastest = best.prediction.step_seconds
    shown = [(candidate, candidate.describe()) for candidate in result.fitting[:top]]
    width = max([70, *(len(layout) + 2 for _, layout in shown)])  # a long layout widens the column, not the row
    lines = [f"{result.model.name}: {result.model.num_params / 1e6:.1f}M parameters, batch {result.batch_size} x "
             f"{result.model.seq_len} tokens, world size {result.world_size}; {len(result.fitting)} layouts fit, "
             f"{len(result.refused)} do not",
             f"{'#':>2}  {'layout':<{width}}{'step s':>8}{'fwd':>7}{'bwd':>7}{'step':>7}"
             f"{'device GB':>10}{'host GB':>9}{'nvme GB':>9}  why"]
    chosen = state_format_words(best.config)
    if any(state_format_words(c.config) != chosen for c in result.refused):
        lines.insert(1, f"no layout of the formats before fits: these keep {chosen} (optimizer.master, "
                        "optimizer.moments, aio.blocks_in_flight)")
    for i, (candidate, layout) in enumerate(shown, 1):
        p = candidate.prediction
        why = p.bottleneck.split(":")[0] if i == 1 else _why_slower(candidate, best, fastest)
        lines.append(f"{i:>2}  {layout:<{width}}{p.step_seconds:>8.2f}" + "".join(
            f"{p.phases[k]:>7.2f}" for k in ("forward", "backward", "step")) + "".join(
            f"{p.peak_bytes[t] / _GB:>{w}.2f}" for t, w in (("device", 10), ("host", 9), ("nvme", 9))) + f"  {why}")
    for candidate in _refusals(result.refused):
        lines.append(f"    refused: {candidate.describe()}: {candidate.refusal}")
    lines.append(f"best: {best.describe()}: {best.prediction.bottleneck}")
    if note := result.precision_note:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _why_slower(candidate: Candidate, best: Candidate, fastest: float) -> str:
    """What a layout pays against the best one: its time, or (tied) the bytes it puts on disk or in memory."""
    p, q = candidate.prediction, best.prediction
    if p.step_seconds > fastest * 1.03:
        worst = max(p.work, key=lambda k: p.work[k] - q.work.get(k, 0.0))
        return f"+{p.step_seconds / fastest - 1:.0%}: {worst} +{p.work[worst] - q.work[worst]:.2f} s"
    if p.peak_bytes["nvme"] > q.peak_bytes["nvme"]:
        return "as fast, but uses the disk"
    return "as fast, but holds more memory"


def _refusals(refused: list[Candidate], shown: int = 3) -> list[Candidate]:
    """A few refused layouts, one per distinct reason, the simplest first."""
    seen, out = set(), []
    for candidate in refused:
        reason = candidate.refusal.split(" needs ")[0]
        if reason not in seen:
            seen.add(reason)
            out.append(candidate)
    return out[:shown]


def _as_json(candidate: Candidate) -> dict:
    return {"layout": candidate.describe(), "overrides": candidate.overrides, **candidate.prediction.as_json()}
