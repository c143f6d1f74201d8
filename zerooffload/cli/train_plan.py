"""``zerooffload train``'s plan: the layout ``--plan`` chooses, its prediction, and the measurement beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from ..config import Config, ConfigError
from ..models import PRESETS
from ..log import current_rank
from ..telemetry import PHASES, Prediction
from ..tiers import swap_paths
from ..zero.placement import TIER_NAMES
from .measured import RunMemory
from .train_config import DEFAULT_LAYOUT, load_train_config

__all__ = ["best_layout", "format_prediction", "on_rank_zero", "pinned", "planned_config", "planned_layout",
           "predicted_and_measured", "predicted_peaks"]


def planned_config(args: argparse.Namespace, default: bool = False) -> tuple[Config, Prediction | None]:
    """The run's config and the plan's prediction of its step: ``--plan auto`` searches the layouts the
    user left free (``--config`` and overrides pin the rest), ``--plan FILE`` runs a written plan with the
    prediction inside it, ``default`` (a plain run taking train_config's [Note: the default layout])
    pins ``DEFAULT_LAYOUT`` and plans the rest, and any other plain run is predicted only when the
    machine's probe is cached (it never measures the disk; the block it times is said)."""
    from ..planning import cached_probe, predict_config, probe_machine, read_prediction
    from ..planning.model_spec import named_gpt

    if args.plan not in (None, "auto") and args.config:
        args.usage_error("--plan FILE is the run's config: leave --config out (or use --plan auto with it)")
    if default:
        return _default_config(args)
    plan_file = args.plan not in (None, "auto")
    config = load_train_config(args.plan if plan_file else args.config, args.overrides, PRESETS[args.model].num_params,
                               args.steps, plan_file=plan_file)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.plan == "auto":
        return _plan_auto(args, config, pinned(args))
    if args.plan is not None:  # a plan file: the prediction it was chosen by (a fresh one for a file without)
        prediction = read_prediction(args.plan)
        if prediction is not None:
            return config, prediction
    cached = None if args.plan else cached_probe(config, world)
    if args.plan is None and cached is None:
        return config, None  # a plain run without a cached probe: nothing to predict, nothing measured
    progress = (lambda text: print(f"plan: {text}", file=sys.stderr)) if current_rank() == 0 else (lambda text: None)
    return config, on_rank_zero(world, lambda: predict_config(
        named_gpt(args.model, PRESETS[args.model]), config, cached or probe_machine(config, world_size=world), world,
        progress))


def _default_config(args: argparse.Namespace) -> tuple[Config, Prediction]:
    """``DEFAULT_LAYOUT`` and ``train_defaults``' batch pinned, the rest planned (train_config's note). The
    plan's swap directory is one on ``--out``'s disk whose rates the probe's cache holds (``--out`` itself
    when none is: measured then, and kept, as ``--out`` outlives the run), not the swap folder: a folder
    new each run would have the disk measured again each run (2.2 s and 512 MiB written on the project's
    machine). Train sets ``nvme.path`` to the folder afterwards."""
    from ..planning.probe import measured_on_filesystem

    disk = measured_on_filesystem(args.out) or os.path.realpath(args.out)
    layout = [f"{key}={json.dumps(value)}" for key, value in DEFAULT_LAYOUT.items()]
    config = load_train_config(None, [*layout, f"nvme.path={json.dumps(disk)}", *args.overrides],
                               PRESETS[args.model].num_params, args.steps)
    return _plan_auto(args, config, {*DEFAULT_LAYOUT, "train.micro_batch_size", *pinned(args)})


def _plan_auto(args: argparse.Namespace, config: Config, pinned_keys: set[str]) -> tuple[Config, Prediction]:
    """``config`` with the layout plan ranks best among those keeping ``pinned_keys``, and its prediction;
    rank 0 plans (``on_rank_zero``) and says how long that took, and whether the machine's probe was
    read from its cache or measured (then kept there for the next run)."""
    from ..planning import cached_probe, plan
    from ..planning.model_spec import named_gpt
    from ..planning.probe import cache_path

    world = int(os.environ.get("WORLD_SIZE", 1))

    def decide() -> tuple[list[str], Prediction]:
        started, cached = time.perf_counter(), cached_probe(config, world) is not None
        chosen = best_layout(plan(named_gpt(args.model, PRESETS[args.model]), config, pinned=pinned_keys,
                                  world_size=world, progress=lambda text: print(f"plan: {text}", file=sys.stderr)))
        probe = f"this machine's probe read from {cache_path()}" if cached else \
            f"what {cache_path()} lacked of this machine and disk measured first, and kept there for the next runs"
        print(f"plan: chosen in {time.perf_counter() - started:.1f} s ({probe})", file=sys.stderr)
        return chosen

    chosen = on_rank_zero(world, decide)
    return Config.load(config, overrides=chosen[0]), chosen[1]


def planned_layout(args: argparse.Namespace, config: Config) -> str:
    """What the plan would train instead of a refused config, from the cached probe and the model's FLOPs
    (a refusal measures nothing, so it comes in seconds on any machine); without a probe, how to have it
    chosen."""
    from ..planning import cached_probe, plan
    from ..planning.model_spec import named_gpt

    probe = cached_probe(config)
    if probe is None or int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return "or let zerooffload choose: train --plan auto (zerooffload plan lists the layouts that fit)"
    try:
        best = plan(named_gpt(args.model, PRESETS[args.model]), config, pinned=pinned(args), probe=probe,
                    timed=False).best
    except ConfigError as error:
        return f"zerooffload plan finds none either ({error})"
    overrides = " ".join(f"{k}={json.dumps(v)}" for k, v in best.overrides.items())
    return (f"zerooffload plan's best here: {overrides} (predicted {best.prediction.step_seconds:.2f} s/step by "
            "its FLOPs); train it with --plan auto")


def pinned(args: argparse.Namespace) -> set[str]:
    """The searched keys the user set: in ``--config`` or as overrides (never ``train_defaults``' choices)."""
    from ..planning import pinned_keys

    user = load_train_config(args.config, [], PRESETS[args.model].num_params) if args.config else Config.load({})
    return pinned_keys(user, args.overrides)


def best_layout(result) -> tuple[list[str], Prediction]:
    """The plan's best layout as overrides, with its prediction; one line about it."""
    best = result.best
    print(f"plan: {best.describe()} (of {len(result.fitting)} that fit): predicted {best.prediction.step_seconds:.2f} "
          f"s/step; {best.prediction.bottleneck}", file=sys.stderr)
    if note := result.precision_note:
        print(f"plan: note: {note}", file=sys.stderr)
    return [f"{key}={json.dumps(value)}" for key, value in best.overrides.items()], best.prediction


def on_rank_zero(world: int, decide):
    """``decide()`` on rank 0, its result on every rank: a plan times the machine, and ranks that timed
    it apart could choose apart."""
    if world == 1:
        return decide()
    from ..comm import all_gather_object, init_comm

    comm = init_comm()  # the group the engine then uses as it is
    return all_gather_object(comm, decide() if comm.rank == 0 else None)[0]


def predicted_and_measured(engine, step_seconds: list[float], step_phases: list[dict[str, float]],
                           step_redone: list[bool], memory: RunMemory) -> dict:
    """summary.json's ``predicted`` (the plan's) and ``measured``: the median of this process's steps
    after the first, how many of those redid tentative updates under the clip (``step_redone``), and
    the peak bytes per tier measured apart from the engine (``measured``'s note: the process's RAM, the
    device's own peak, the swap files' blocks); the engine's own accounting beside them as
    ``engine_peak_bytes``."""
    steps = step_seconds[1:] or step_seconds
    phases = step_phases[1:] or step_phases
    redone = step_redone[1:] or step_redone
    peaks = engine.memory_report().peaks
    measured = {"step_seconds": statistics.median(steps) if steps else None,
                "phases": {k: statistics.median(p[k] for p in phases) for k in PHASES} if phases else {},
                "steps": len(steps), "redone_steps": sum(redone),
                "peak_bytes": memory.peaks(swap_paths(engine.config)),
                "engine_peak_bytes": {tier: peaks.get(tier, 0) for tier in TIER_NAMES}}
    predicted = engine.stats.predicted if engine.stats else None
    return {"measured": measured, **({"predicted": predicted.as_json()} if predicted else {})}


def predicted_peaks(predicted: dict, measured: dict) -> dict[str, int]:
    """The prediction's peaks per measured tier: ``device+host``, where the two are one RAM, is their
    peak together (``Prediction.ram_peak_bytes``)."""
    peaks = predicted["peak_bytes"]
    return {tier: predicted.get("ram_peak_bytes") or sum(peaks[part] for part in tier.split("+")) if "+" in tier
            else peaks[tier] for tier in measured["peak_bytes"]}


def format_prediction(s: dict) -> str:
    """The plan's step split next to the one measured, and the peak bytes per tier (see predicted_peaks).
    Where the plan predicts the step both ways (tentative updates redone under the clip or not), the
    split shown is the one most measured steps took, and a line says how many took which."""
    p, m = s["predicted"], s["measured"]
    case, clip_line = _predicted_case(p, m)
    lines = [f"{'predicted vs measured':<24}{'plan':>10}{'measured':>10}"]
    for phase in PHASES:
        lines.append(f"{phase + ' s':<24}{case['phases'][phase]:>10.3f}{m['phases'].get(phase, 0.0):>10.3f}")
    wall = case["step_seconds"]
    ratio = m["step_seconds"] / wall if wall else float("nan")
    lines.append(f"{'step s (wall)':<24}{wall:>10.3f}{m['step_seconds']:>10.3f}  (x{ratio:.2f})")
    lines += _moved_rows(case.get("moved_bytes") or {}, s.get("traffic"))
    for tier, bytes_ in predicted_peaks(p, m).items():
        lines.append(f"{tier + ' peak MB':<24}{bytes_ / 1e6:>10.1f}{m['peak_bytes'][tier] / 1e6:>10.1f}")
    return "\n".join(lines + [f"plan: {p['bottleneck']}"] + ([clip_line] if clip_line else []))


def _moved_rows(moved: dict, traffic: dict | None) -> list[str]:
    """The bytes a step moves, planned and measured (the median step: tier_report's note), where either moved."""
    if not moved or traffic is None:
        return []
    rows = (("nvme read MB", moved.get("nvme_read", 0), traffic["nvme_read_bytes"]),
            ("nvme written MB", moved.get("nvme_write", 0), traffic["nvme_write_bytes"]),
            ("host<->device MB", moved.get("host_device", 0),
             traffic["host_to_device_bytes"] + traffic["device_to_host_bytes"]))
    return [f"{label:<24}{planned / 1e6:>10.1f}{measured / 1e6:>10.1f}" for label, planned, measured in rows
            if planned or measured]


def _predicted_case(p: dict, m: dict) -> tuple[dict, str | None]:
    """The prediction of the case most measured steps took (``p`` or its ``redone``), and the line saying
    so (None where the plan predicted one case only)."""
    redone = p.get("redone")
    if redone is None:
        return p, None
    count, steps = m.get("redone_steps", 0), m.get("steps", 0)
    line = (f"plan: train.grad_clip bound in {count} of {steps} measured steps, whose tentative updates were "
            f"redone in the step: {redone['step_seconds']:.3f} s predicted for those, {p['step_seconds']:.3f} s for "
            "the others")
    return (redone if 2 * count > steps else p), line
