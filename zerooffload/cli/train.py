"""``zerooffload train``: the built-in GPT on the offline byte corpus, read top to bottom.

Without ``--config`` the run uses ``train_defaults`` for the model's size over the library defaults
(train_config's [Note: defaults by model size]): the nano preset's loss falls visibly within a minute
on a laptop CPU, and every preset up to 350m trains stably. With ``--config`` the file alone decides
(library defaults for what it leaves out). Overrides (``key.path=value``) apply last either way.
``scheduler.total_steps = 0`` with a decaying schedule means "the run's ``--steps``". Without a config
file, a plan or a layout key, the run pages its states to NVMe in a swap folder of its own
(train_config's [Note: the default layout]). Under ``torchrun`` every rank trains its slice and rank 0
reports.

The parts: ``train_config`` (the config), ``train_plan`` (``--plan`` and predicted vs measured),
``swap_folder`` (the default run's swap), ``run_checkpoints`` (resume and prune), ``stop_signal``
(SIGTERM/SIGINT), ``progress``, ``tier_report`` (the last lines: what lived on each tier, what moved).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import SaveHandle
from ..config import Config
from ..data import ByteCorpus
from ..initialization import initialize
from ..lazy_init import init_context
from ..log import current_rank
from ..models import GPT, PRESETS
from ..tiers import BudgetError
from .measured import RunMemory
from .progress import Progress, engine_postfix
from .run_checkpoints import Pruner, make_room, resume, resume_tag
from .run_dir import owned_out, write_summary
from .stop_signal import StopOnSignal
from .swap_folder import swap_folder
from .tier_report import TierLog, tier_lines, tier_summary
from .train_config import default_layout, load_train_config, train_defaults
from .train_plan import format_prediction, planned_config, planned_layout, predicted_and_measured

__all__ = ["load_train_config", "run_training", "train_defaults"]


def run_training(args: argparse.Namespace) -> int:
    """Train ``args.model`` up to ``args.steps`` optimizer steps; print a summary and write it to ``--out``,
    which this run owns throughout (run_dir's [Note: owning --out]).

    Returns the exit status: 0, or 128 + the signal that stopped the run early (stop_signal's note).
    """
    with owned_out(args, current_rank()):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """A run with the user's layout, or the default one in its swap folder (train_config's note). A run
    without ``--save-every`` never saves, so none in the background: its staging ring is neither counted
    by the plan nor made (``train.async_save`` off; the 7b under 5 GiB budgets fits only without it)."""
    if not args.save_every:
        args.overrides = [*args.overrides, "train.async_save=false"]
    checkpoints = Path(args.out) / "checkpoints"
    tag = resume_tag(checkpoints, args.tag) if args.resume else None  # nothing to resume from: refused first
    if not default_layout(args.config, args.plan, args.overrides):
        return _run_layout(args, *planned_config(args), checkpoints, tag)[0]  # (with a cached probe: a block timed)
    with swap_folder(Path(args.out)) as folder:
        config, prediction = planned_config(args, default=True)
        config = Config.load(config, overrides=[f"nvme.path={json.dumps(str(folder))}"])
        if current_rank() == 0:
            print(f"swap: {folder}, a folder of this run's on --out's disk, removed at the end", file=sys.stderr)
        status, summary = _run_layout(args, config, prediction, checkpoints, tag)
    if summary is not None and current_rank() == 0:
        print(f"swap: removed {folder} (its files held {summary['measured']['peak_bytes']['nvme'] / 1e6:.1f} MB of "
              "disk at the end)")
    return status


def _run_layout(args: argparse.Namespace, config: Config, prediction, checkpoints: Path,
                tag: str | None) -> tuple[int, dict | None]:
    """Build the engine for ``config``, train, report; the exit status and the summary (None: nothing trained)."""
    torch.manual_seed(config.train.seed)
    model_config = PRESETS[args.model]
    with init_context(config):  # nothing is allocated before the engine checks that the run fits
        model = GPT(model_config)
    batch = torch.zeros(config.train.micro_batch_size, model_config.block_size, dtype=torch.long, device="meta")
    corpus = ByteCorpus()  # before the measurement starts: the data is the user's memory, not the run's
    memory = RunMemory()
    try:
        engine = initialize(model, config, init_fn=model.init_fn(), example_inputs=(batch, batch),
                            prediction=prediction)
    except BudgetError as error:
        raise BudgetError(f"{error}; {planned_layout(args, config)}") from error
    with StopOnSignal(engine.comm.rank) as stop:
        shape = _run_shape(args, config, engine.comm.world_size)
        first_step, losses = resume(engine, checkpoints, tag, shape, verify=args.tag is not None) if tag else (0, [])
        if first_step >= args.steps:
            engine.close()
            if engine.comm.rank == 0:
                print(f"nothing to train: {checkpoints} is at step {first_step} and --steps is {args.steps}")
            return 0, None
        run = _train(args, engine, config, corpus, (first_step, losses, shape), checkpoints, stop)
        summary = _summary(args, engine, run, model_config)
        summary.update(predicted_and_measured(engine, run.step_seconds, run.phases, run.redone, memory))
        summary.update(tier_summary(engine, run.tiers, run.step_seconds))
        engine.close()
        if engine.comm.rank == 0:  # before the handlers go back: torchrun may SIGTERM a rank that is finishing
            _report(args, engine, config, run, summary)
    return (0 if run.stopped_by is None else 128 + run.stopped_by), summary


def _report(args, engine, config: Config, run: "_Run", summary: dict) -> None:
    """Rank 0's last words: the summary, the plan against the run, the tiers; summary.json; the warnings."""
    _print_summary(summary)
    if "predicted" in summary:
        print(format_prediction(summary))
    print("\n".join(tier_lines(summary)))
    write_summary(Path(args.out), json.dumps(summary, indent=2))
    for line in (_all_skipped_line(engine, config), run.stopped_by and _stop_line(run)):
        if line:
            print(line, file=sys.stderr)


@dataclass(slots=True)
class _Run:
    """What the training loop did: the loss of each step, and why it ended early, if it did."""

    tokens_per_step: int
    first_step: int
    """The step this process started at: 0, or where ``--resume`` continued."""
    last_step: int
    """The number of optimizer steps done (the resumed ones included)."""
    shape: dict[str, int] = field(default_factory=dict)
    """``_run_shape``: saved with every checkpoint, compared by ``--resume``."""
    losses: list[float] = field(default_factory=list)
    """The loss of every step from step 0, the global batch's (the ranks' mean: ``StopOnSignal.agreed``); the
    resumed ones from the checkpoint (see [Note: resuming])."""
    seconds: float = 0.0
    """Wall time of this process's steps."""
    step_seconds: list[float] = field(default_factory=list)
    """Wall time of each of this process's steps."""
    phases: list[dict[str, float]] = field(default_factory=list)
    """``engine.stats.phase_seconds`` of each of this process's steps."""
    redone: list[bool] = field(default_factory=list)
    """Whether each of this process's steps redid tentative updates (``engine.stats.undone_updates``)."""
    tiers: TierLog = field(default_factory=TierLog)
    """What each of this process's steps moved, and what the tiers held at its end (tier_report's note)."""
    stopped_by: signal.Signals | None = None
    saved: Path | None = None
    """The last checkpoint this loop wrote: after a signal, the one holding the steps done."""
    pending: SaveHandle | None = None
    """The handle of a save still being written in the background (``train.async_save``), if any."""
    good: str | None = None
    """The tag of the last checkpoint saved outside a skip streak: never pruned (run_checkpoints' note)."""
    pruner: Pruner = field(default_factory=Pruner)
    """Rank 0's prune after each save, while the steps go on (run_checkpoints' [Note: pruning])."""
    unpruned: bool = False
    """Whether the last save is yet to be pruned after."""
    saves: int = 0
    save_seconds: float = 0.0
    """Time the loop spent in its saves' calls: room made, the save started (a blocking one whole), waits
    for the last one and its prune; ``engine.saves.waited_seconds`` adds the engine's own waits for them."""


def _train(args, engine, config: Config, corpus: ByteCorpus, resumed: tuple[int, list[float], dict],
           checkpoints: Path, stop: "StopOnSignal") -> _Run:
    """The loop (``_loop``; ``resumed``: the first step, the losses before it and the run's shape) and its
    time, the last save's writes included (stop_signal's note: a signal ends it early)."""
    tokens = config.train.micro_batch_size * config.train.grad_accum_steps * engine.comm.world_size
    first_step, losses, shape = resumed
    run = _Run(tokens_per_step=tokens * PRESETS[args.model].block_size, first_step=first_step, last_step=first_step,
               losses=losses, shape=shape)
    started = time.perf_counter()
    progress = Progress(args, run.first_step, engine.comm.rank)
    try:
        _loop(args, engine, config, corpus, checkpoints, stop, run, progress)
    except BaseException:  # a save in flight holds steps done before the failure: it lands, and is pruned after
        with contextlib.suppress(Exception):  # its own error (if that is what stopped the run) is raised already
            _saved(engine, checkpoints, run, args.keep_last)
            run.pruner.wait()
        raise
    with _holding(run):  # the loop's time includes the last save's writes
        _saved(engine, checkpoints, run, args.keep_last)
        run.pruner.wait()
    progress.close()
    run.seconds = time.perf_counter() - started
    return run


def _loop(args, engine, config: Config, corpus: ByteCorpus, checkpoints: Path, stop: "StopOnSignal", run: _Run,
          progress: Progress) -> None:
    """Steps ``run.first_step`` .. ``--steps`` - 1, each followed by the periodic save when due, until the
    steps are done or the ranks agree that a signal stops them."""
    seq, accum, micro = PRESETS[args.model].block_size, config.train.grad_accum_steps, config.train.micro_batch_size
    rank, world = engine.comm.rank, engine.comm.world_size
    for step in range(run.first_step, args.steps):
        if args.trace and step == run.first_step + 1:  # the first step warms up; the trace writes itself
            engine.trace(args.trace, steps=min(args.trace_steps, args.steps - step))
        step_start, window_loss = time.perf_counter(), 0.0
        for micro_step in range(accum):
            x, y = corpus.batch(step * accum + micro_step, batch_size=micro, seq_len=seq, seed=config.train.seed,
                                rank=rank, world_size=world)
            loss = engine(x.to(engine.comm.device), y.to(engine.comm.device))
            engine.backward(loss)
            engine.step()
            window_loss += loss.item() / accum
        elapsed = time.perf_counter() - step_start
        run.stopped_by, window_loss = stop.agreed(engine.comm, window_loss)
        run.losses.append(window_loss)
        run.last_step = step + 1
        run.step_seconds.append(elapsed)
        run.phases.append(dict(engine.stats.phase_seconds))
        run.redone.append(engine.stats.undone_updates > 0)
        run.tiers.add(engine.stats)
        progress.update(run.last_step, {"loss": f"{window_loss:.3f}", "tok_s": f"{run.tokens_per_step / elapsed:,.0f}",
                                        "step_s": f"{elapsed:.3f}", **engine_postfix(engine.stats)})
        if args.save_every and (run.stopped_by is not None or run.last_step % args.save_every == 0
                                or run.last_step == args.steps):
            with _holding(run):
                _save(engine, checkpoints, run, args.keep_last, background=config.train.async_save)
            run.saves += 1
        elif run.pending is not None and run.pending.done():  # published: prune now, not at the next save
            with _holding(run):
                _saved(engine, checkpoints, run, args.keep_last)
        if run.stopped_by is not None:
            break


@contextlib.contextmanager
def _holding(run: _Run):
    """The block's wall time is the loop's time spent on saves (``run.save_seconds``)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        run.save_seconds += time.perf_counter() - start


def _run_shape(args: argparse.Namespace, config: Config, world: int) -> dict[str, int]:
    """What a resumed run should keep to continue the same run: the steps its schedule spans and the
    sequences of one optimizer step (``run_checkpoints.resume`` says when they change)."""
    train = config.train
    return {"steps": args.steps, "global_batch": train.micro_batch_size * train.grad_accum_steps * world}


def _save(engine, checkpoints: Path, run: _Run, keep: int, background: bool) -> None:
    """The periodic save, with room made first and old tags pruned once it is published (run_checkpoints'
    [Note: pruning]); with ``background`` (``train.async_save``) written while the loop goes on."""
    _saved(engine, checkpoints, run, keep)
    run.pruner.wait()
    if engine.comm.rank == 0:
        make_room(checkpoints, keep, spare=run.good)
    saved = engine.save_checkpoint(checkpoints, client_state={"next_step": run.last_step, "losses": run.losses,
                                                              **run.shape}, blocking=not background)
    run.pending, run.saved = (saved, saved.path) if background else (None, saved)
    run.unpruned = True
    if engine.window.streak.length == 0:
        run.good = run.saved.name
    if not background:
        _saved(engine, checkpoints, run, keep)


def _saved(engine, checkpoints: Path, run: _Run, keep: int) -> None:
    """The last save published (a save in the background waited for: its error raises here), then the
    prune after it, started on the pruner's thread (``run.pruner``: waited for before the directory changes
    again)."""
    if run.pending is not None:
        pending, run.pending = run.pending, None
        pending.wait()
    if run.unpruned and engine.comm.rank == 0:
        run.pruner.start(checkpoints, keep, spare=run.good)
    run.unpruned = False


def _stop_line(run: _Run) -> str:
    """The one line rank 0 prints when a signal ended the run: what was kept and how to go on."""
    kept = f"checkpoint saved to {run.saved}; resume with --resume" if run.saved else "nothing saved (no --save-every)"
    return f"zerooffload: stopped by {run.stopped_by.name} after step {run.last_step}; {kept}"


def _all_skipped_line(engine, config: Config) -> str | None:
    """One line when every step of the run was skipped, so no update ever happened: the losses look
    like a run, and only this says that the model never changed."""
    steps = engine.window.global_steps
    if not steps or engine.window.skipped_steps < steps:
        return None
    train = config.train
    if train.precision != "fp16":
        fix = "(inf/NaN loss or gradients): lower optimizer.lr or check the model's inputs"
    elif train.loss_scale:
        fix = f"(fp16 overflow): lower train.loss_scale (now {train.loss_scale:g}), or set 0 for a dynamic scale"
    else:
        fix = (f"(fp16 overflow): lower train.initial_scale_power (now {train.initial_scale_power}), or use "
               "train.precision=bf16")
    return f"zerooffload: warning: all {steps} steps were skipped {fix}"


def _summary(args, engine, run: _Run, model_config) -> dict:
    """summary.json: ``steps``, ``losses`` and the loss means cover the whole run from step 0 across
    resumes; ``first_step``, ``seconds`` and ``tokens_per_second`` describe this process's steps (a
    resumed run may have another world size, so rates of earlier segments are not comparable)."""
    losses = run.losses
    window = min(20, max(1, len(losses) // 2))
    first, last = statistics.fmean(losses[:window]), statistics.fmean(losses[-window:])
    report = engine.memory_report()
    return {"model": args.model, "params": model_config.num_params, "steps": run.last_step,
            "first_step": run.first_step, "world_size": engine.comm.world_size, "stage": engine.config.zero.stage,
            "precision": engine.config.train.precision, "seconds": round(run.seconds, 2),
            "tokens_per_second": round(run.tokens_per_step * (run.last_step - run.first_step) / run.seconds),
            "first_loss_mean": first, "last_loss_mean": last, "loss_ratio": last / first, "window": window,
            "skipped_steps": engine.window.skipped_steps, "peak_bytes": dict(report.peaks), "losses": losses,
            "saves": {"count": run.saves, "in_background": engine.config.train.async_save,
                      "held_seconds": round(run.save_seconds + engine.saves.waited_seconds, 4)}}


def _print_summary(s: dict) -> None:
    here = f"in {s['seconds']:.1f} s" if not s["first_step"] else \
        f"(resumed at step {s['first_step']}; {s['steps'] - s['first_step']} steps in {s['seconds']:.1f} s)"
    print(f"\ntrained {s['model']} ({s['params'] / 1e6:.2f}M params) for {s['steps']} steps {here} "
          f"on {s['world_size']} rank(s), ZeRO stage {s['stage']}, {s['precision']}")
    print(f"loss: mean of first {s['window']} steps {s['first_loss_mean']:.3f} -> last {s['window']} "
          f"{s['last_loss_mean']:.3f} (x{s['loss_ratio']:.2f}); {s['tokens_per_second']:,} tokens/s")
    if saves := s["saves"]["count"]:
        how = "in the background" if s["saves"]["in_background"] else "blocking"
        print(f"saves: {saves} {how}; they held the loop {s['saves']['held_seconds']:.2f} s "
              f"({s['saves']['held_seconds'] / saves * 1e3:.1f} ms a save)")
