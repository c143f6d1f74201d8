"""``zerooffload train``: the built-in GPT on the offline byte corpus, read top to bottom.

Without ``--config`` the run uses ``TRAIN_DEFAULTS`` (below) over the library defaults: a batch and
learning rate that make the small preset's loss fall visibly within a minute or two on a laptop
CPU. With ``--config`` the file alone decides (library defaults for what it leaves out). Overrides
(``key.path=value``) apply last either way. ``scheduler.total_steps = 0`` with a decaying schedule
means "the run's ``--steps``". Under ``torchrun`` every rank trains its slice and rank 0 reports.

[Note: stopping on a signal]
SIGTERM (a scheduler preempting the job; torchrun passes it on to its ranks) and SIGINT (Ctrl-C) stop
the run at the end of the current optimizer step, not wherever the signal lands: the handler only
records the signal, so no step, I/O request or collective is cut in half. Once per optimizer step the
ranks combine what they received with one tiny control all-reduce, so every rank stops after the same
step: the checkpoint that follows is a collective and would deadlock if one rank went on training.
With ``--save-every`` that checkpoint holds the steps done (the same ``next_step`` client state and
directory as the periodic saves, so ``--resume`` continues exactly); summary.json is written as at a
normal end; rank 0 prints one line saying what was kept; the exit status is 128 + the signal number
(143 for SIGTERM, 130 for SIGINT), the shell's convention, so a scheduler sees a run that did not
finish. A second signal is noted and ignored: it arrives while the step or the save is finishing,
which is exactly what must not be torn (torchrun itself sends SIGTERM after the terminal's SIGINT).

[Note: resuming]
Every save's client state holds ``next_step`` (the data position) and ``losses``, the loss of every
step so far: the history travels inside the checkpoint it belongs to, so whichever tag a run resumes
from, summary.json's ``steps`` and ``losses`` describe steps 0..N of one run (a summary.json beside
it could be newer or older than that tag). ``--resume`` loads ``--tag``, else the tag ``latest``
names; when ``latest`` is missing or its checkpoint does not verify (``read_manifest``: digest,
format, sizes and CRCs), the newest ``stepNNNNNNNN`` tag that does, said in one line. Every rank
chooses alone, from the same files, so they agree without a collective before the load (a collective
that one rank left by raising would end the engine's group). The check reads the files once more
than the load does; a resume is rare enough to pay that for not dying on one bad tag. After each
save rank 0 keeps the newest ``--keep-last`` step tags (step order is name order): older ones go,
never the tag ``latest`` names and never a tag of another name (someone's own save). A doomed tag is
renamed ``<tag>.partial`` first, so a prune cut short leaves what the next save's recovery removes,
never a tag that looks complete.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from ..checkpoint import read_manifest
from ..checkpoint_files import LATEST, PARTIAL, CheckpointError
from ..comm import Comm, control_all_reduce
from ..config import Config, ConfigError, apply_override
from ..data import ByteCorpus
from ..initialization import initialize
from ..lazy_init import init_context
from ..log import current_rank
from ..models import GPT, PRESETS
from ..telemetry import PHASES, Prediction
from ..tiers import BudgetError

__all__ = ["TRAIN_DEFAULTS", "load_train_config", "run_training"]

TRAIN_DEFAULTS = {
    "train": {"micro_batch_size": 16, "grad_clip": 1.0},
    "optimizer": {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.95]},
    "scheduler": {"type": "warmup_cosine", "warmup_steps": 20, "min_lr": 3e-4},
}
"""What ``zerooffload train`` uses when no ``--config`` is given (fp32: faster than bf16 at this size)."""


def load_train_config(config_path: str | None, overrides: list[str], steps: int) -> Config:
    """The run's config: file or TRAIN_DEFAULTS, overrides, and total_steps filled from ``--steps``."""
    data = Config.load(config_path).to_dict() if config_path else json.loads(json.dumps(TRAIN_DEFAULTS))
    for override in overrides:
        data = apply_override(data, override)
    scheduler = data.get("scheduler", {})
    if scheduler.get("type", "constant") != "constant" and not scheduler.get("total_steps"):
        data = apply_override(data, f"scheduler.total_steps={max(steps, scheduler.get('warmup_steps', 0) + 1)}")
    return Config.load(data)


def run_training(args: argparse.Namespace) -> int:
    """Train ``args.model`` up to ``args.steps`` optimizer steps; print a summary and write it to ``--out``.

    Returns the exit status: 0, or 128 + the signal that stopped the run early (see the note).
    """
    config, prediction = _planned_config(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)  # an --out that cannot be written fails now, not at the end
    checkpoints = Path(args.out) / "checkpoints"
    tag = _resume_tag(checkpoints, args.tag) if args.resume else None  # nothing to resume from fails now too
    torch.manual_seed(config.train.seed)
    model_config = PRESETS[args.model]
    with init_context(config):  # nothing is allocated before the engine checks that the run fits
        model = GPT(model_config)
    batch = torch.zeros(config.train.micro_batch_size, model_config.block_size, dtype=torch.long, device="meta")
    rss_at_start = psutil.Process().memory_info().rss
    try:
        engine = initialize(model, config, init_fn=model.init_fn(), example_inputs=(batch, batch),
                            prediction=prediction)
    except BudgetError as error:
        raise BudgetError(f"{error}; {_planned_layout(args, config)}") from error
    with _StopOnSignal(engine.comm.rank) as stop:
        first_step, losses = _resume(engine, checkpoints, tag, verify=args.tag is not None) if tag else (0, [])
        if first_step >= args.steps:
            engine.close()
            if engine.comm.rank == 0:
                print(f"nothing to train: {checkpoints} is at step {first_step} and --steps is {args.steps}")
            return 0
        run = _train(args, engine, config, model_config.block_size, (first_step, losses), checkpoints, stop)
        summary = _summary(args, engine, run, model_config)
        summary.update(_predicted_and_measured(engine, run, rss_at_start))
        engine.close()
        if engine.comm.rank == 0:  # before the handlers go back: torchrun may SIGTERM a rank that is finishing
            _print_summary(summary)
            if "predicted" in summary:
                print(_format_prediction(summary))
            (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2))
            for line in (_all_skipped_line(engine, config), run.stopped_by and _stop_line(run)):
                if line:
                    print(line, file=sys.stderr)
    return 0 if run.stopped_by is None else 128 + run.stopped_by


@dataclass(slots=True)
class _Run:
    """What the training loop did: the loss of each step, and why it ended early, if it did."""

    tokens_per_step: int
    first_step: int
    """The step this process started at: 0, or where ``--resume`` continued."""
    last_step: int
    """The number of optimizer steps done (the resumed ones included)."""
    losses: list[float] = field(default_factory=list)
    """Rank 0's loss of every step from step 0 (the resumed ones from the checkpoint: see [Note: resuming])."""
    seconds: float = 0.0
    """Wall time of this process's steps."""
    step_seconds: list[float] = field(default_factory=list)
    """Wall time of each of this process's steps."""
    phases: list[dict[str, float]] = field(default_factory=list)
    """``engine.stats.phase_seconds`` of each of this process's steps."""
    stopped_by: signal.Signals | None = None
    saved: Path | None = None
    """The last checkpoint this loop wrote: after a signal, the one holding the steps done."""


def _train(args, engine, config: Config, seq: int, resumed: tuple[int, list[float]], checkpoints: Path,
           stop: "_StopOnSignal") -> _Run:
    """The loop: steps ``first_step`` .. ``--steps`` - 1 (``resumed``: the first step and the losses
    before it), each followed by the periodic save when due, until the steps are done or the ranks
    agree that a signal stops them (see the notes)."""
    corpus = ByteCorpus()
    rank, world = engine.comm.rank, engine.comm.world_size
    micro, accum = config.train.micro_batch_size, config.train.grad_accum_steps
    first_step, losses = resumed
    run = _Run(tokens_per_step=micro * accum * world * seq, first_step=first_step, last_step=first_step, losses=losses)
    started = time.perf_counter()
    progress = _Progress(args, run.first_step, rank)
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
        run.losses.append(window_loss)
        run.last_step = step + 1
        elapsed = time.perf_counter() - step_start
        run.step_seconds.append(elapsed)
        run.phases.append(dict(engine.stats.phase_seconds))
        progress.update(run.last_step, {"loss": f"{window_loss:.3f}", "tok_s": f"{run.tokens_per_step / elapsed:,.0f}",
                                        "step_s": f"{elapsed:.3f}", **_engine_postfix(engine.stats)})
        run.stopped_by = stop.agreed(engine.comm)
        if args.save_every and (run.stopped_by is not None or run.last_step % args.save_every == 0
                                or run.last_step == args.steps):
            run.saved = engine.save_checkpoint(checkpoints, client_state={"next_step": run.last_step,
                                                                          "losses": run.losses})
            if rank == 0:
                _prune(checkpoints, args.keep_last)
        if run.stopped_by is not None:
            break
    progress.close()
    run.seconds = time.perf_counter() - started
    return run


# ------------------------------------------------------------------------------------ resume and prune
_STEP_TAG = re.compile(r"step\d{8}")
"""The tags train saves (``checkpoint.default_tag``): the only ones it falls back to or prunes."""


def _resume_tag(checkpoints: Path, tag: str | None) -> str:
    """The tag ``--resume`` continues from, found before the engine is built: ``--tag``'s when its
    manifest reads (its files are verified as they load), else ``_loadable_tag``'s."""
    if tag is None:
        return _loadable_tag(checkpoints, current_rank())
    try:
        read_manifest(checkpoints, tag, verify=False)
    except CheckpointError as error:
        raise _resume_error(error) from error
    return tag


def _resume_error(error: CheckpointError) -> CheckpointError:
    return CheckpointError(f"{error}; resume from another tag with --tag NAME, or start again without --resume")


def _resume(engine, checkpoints: Path, tag: str, verify: bool) -> tuple[int, list[float]]:
    """Load the checkpoint ``--resume`` continues from (see [Note: resuming]); the step it ends at and
    the losses of the steps before it. ``verify`` is off for a tag ``_loadable_tag`` chose: it has
    read every file of it already."""
    try:
        client = engine.load_checkpoint(checkpoints, tag, verify=verify)
    except CheckpointError as error:
        raise _resume_error(error) from error
    if not isinstance(client, dict) or not isinstance(client.get("next_step"), int):
        raise CheckpointError(f"{checkpoints / tag}: its client state has no 'next_step' (not saved by zerooffload "
                              "train); resume from one of train's stepNNNNNNNN tags")
    if engine.comm.rank == 0:
        print(f"resumed from step {client['next_step']} (tag {tag})")
    return client["next_step"], list(client.get("losses", []))


def _loadable_tag(checkpoints: Path, rank: int) -> str:
    """The tag ``latest`` names, or when it does not verify the newest step tag that does."""
    if not checkpoints.is_dir():
        raise CheckpointError(f"{checkpoints} does not exist, so there is nothing to resume from; start without "
                              "--resume, or pass the --out of the run to continue")
    try:
        read_manifest(checkpoints)
        return (checkpoints / LATEST).read_text().strip()
    except CheckpointError as error:
        problem = error
    for tag in sorted((p.name for p in checkpoints.iterdir() if _STEP_TAG.fullmatch(p.name)), reverse=True):
        try:
            read_manifest(checkpoints, tag)
        except CheckpointError:
            continue
        if rank == 0:
            print(f"zerooffload: warning: not resuming from latest ({problem}); resuming from {tag}, the newest "
                  "step tag that verifies", file=sys.stderr)
        return tag
    raise CheckpointError(f"{problem}; no stepNNNNNNNN tag in {checkpoints} verifies either: start without --resume")


def _prune(checkpoints: Path, keep: int) -> None:
    """Remove train's step tags older than the newest ``keep`` (0: keep all), sparing the one ``latest``
    names (see [Note: resuming])."""
    if not keep:
        return
    latest = (checkpoints / LATEST).read_text().strip()
    tags = sorted(p.name for p in checkpoints.iterdir() if _STEP_TAG.fullmatch(p.name) and p.is_dir())
    for tag in tags[:-keep]:
        if tag != latest:
            doomed = checkpoints / (tag + PARTIAL)
            os.replace(checkpoints / tag, doomed)
            shutil.rmtree(doomed)


def _stop_line(run: _Run) -> str:
    """The one line rank 0 prints when a signal ended the run: what was kept and how to go on."""
    kept = f"checkpoint saved to {run.saved}; resume with --resume" if run.saved else "nothing saved (no --save-every)"
    return f"zerooffload: stopped by {run.stopped_by.name} after step {run.last_step}; {kept}"


class _StopOnSignal:
    """SIGTERM and SIGINT handlers that only record the signal, installed for a ``with`` block and then
    put back as they were (see [Note: stopping on a signal]).

    Python runs signal handlers in the main thread only, so elsewhere (a training loop in a thread)
    nothing is installed and signals keep their previous meaning.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, rank: int):
        self._rank = rank
        self._previous: dict[int, object] = {}
        self.received: signal.Signals | None = None
        """The first of ``SIGNALS`` this process received, if any."""

    def __enter__(self) -> "_StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._record) for signum in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():  # None: a handler installed outside Python
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)

    def _record(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
        elif self._rank == 0:  # os.write, not print: the main thread may be inside a write to stderr
            os.write(2, f"\nzerooffload: {signal.Signals(signum).name} ignored: already stopping at the end of "
                        "this step\n".encode())

    def agreed(self, comm: Comm) -> signal.Signals | None:
        """The signal that stops every rank after this step, or None; collective when several ranks run.

        Each rank reads its flag once, and ranks sum one count per signal, so all of them see the same
        counts and take the same decision (a sum of 0/1 flags is nonzero exactly when their MAX is 1);
        a rank that received nothing itself stops for the first signal some peer received.
        """
        mine = self.received
        if comm.world_size == 1:
            return mine
        counts = torch.tensor([float(mine == s) for s in self.SIGNALS], dtype=torch.float64)
        counts = control_all_reduce(comm, counts.to(comm.device)).cpu().tolist()
        return mine or next((s for s, n in zip(self.SIGNALS, counts) if n > 0), None)


class _Progress:
    """Rank 0's progress. On a terminal, a tqdm bar; anywhere else (a log file, a pipe, a CI job) a
    bar's redraws are noise, so plain lines: after the first step, every tenth of the run or
    ``LINE_SECONDS``, whichever comes first, and after the last step."""

    LINE_SECONDS = 10.0

    def __init__(self, args: argparse.Namespace, first_step: int, rank: int):
        terminal = sys.stderr.isatty()
        # Counted by hand, not a wrapped range: one left by ``break`` would end a step short.
        self._bar = tqdm(desc=f"train {args.model}", disable=rank != 0 or not terminal, unit="step",
                         mininterval=1.0, initial=first_step, total=args.steps)
        self._lines = rank == 0 and not terminal
        self._first, self._total = first_step, args.steps
        self._every = max(1, args.steps // 10)
        self._printed = time.monotonic()

    def update(self, step: int, fields: dict[str, str]) -> None:
        self._bar.update()
        self._bar.set_postfix(fields)
        now = time.monotonic()
        if self._lines and (step in (self._first + 1, self._total) or step % self._every == 0
                            or now - self._printed >= self.LINE_SECONDS):
            self._printed = now
            print(f"step {step}/{self._total} " + " ".join(f"{k}={v}" for k, v in fields.items()), file=sys.stderr)

    def close(self) -> None:
        self._bar.close()


def _engine_postfix(stats) -> dict[str, str]:
    """Skipped steps, stage 3 and NVMe figures for the progress bar, when the run has them."""
    postfix = {}
    if stats.skipped_steps:
        postfix["skipped"] = str(stats.skipped_steps)
    if stats.prefetch_hit_rate is not None:
        postfix["prefetch"] = f"{stats.prefetch_hit_rate:.0%}"
    if stats.io.read_bytes or stats.io.write_bytes:
        postfix["nvme"] = f"{stats.io_gbps:.2f}GB/s"
        postfix["io_wait_s"] = f"{stats.io.wait_seconds:.2f}"
    if stats.link.host_to_device_bytes or stats.link.device_to_host_bytes:
        postfix["host<->device"] = f"{stats.link_gbps:.2f}GB/s"
    return postfix


def _all_skipped_line(engine, config: Config) -> str | None:
    """One line when every step of the run was skipped, so no update ever happened: the losses look
    like a run, and only this says that the model never changed."""
    steps = engine.global_steps
    if not steps or engine.skipped_steps < steps:
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
            "first_step": run.first_step, "world_size": engine.comm.world_size, "stage": engine.stage,
            "precision": engine.config.train.precision, "seconds": round(run.seconds, 2),
            "tokens_per_second": round(run.tokens_per_step * (run.last_step - run.first_step) / run.seconds),
            "first_loss_mean": first, "last_loss_mean": last, "loss_ratio": last / first, "window": window,
            "skipped_steps": engine.skipped_steps, "peak_bytes": dict(report.peaks), "losses": losses}


# ------------------------------------------------------------------------------ plan: predicted vs measured
def _planned_config(args: argparse.Namespace) -> tuple[Config, Prediction | None]:
    """The run's config and the plan's prediction of its step: ``--plan auto`` searches the layouts the
    user left free (``--config`` and overrides pin the rest), ``--plan FILE`` runs a written plan, and a
    plain run is predicted only when the machine's probe is cached (it never measures the disk)."""
    from ..planning import cached_probe, plan, predict_config, probe_machine
    from ..planning.model_spec import named_gpt

    if args.plan not in (None, "auto") and args.config:
        args.usage_error("--plan FILE is the run's config: leave --config out (or use --plan auto with it)")
    config = load_train_config(args.plan if args.plan not in (None, "auto") else args.config, args.overrides,
                               args.steps)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.plan == "auto":
        chosen = _on_rank_zero(world, lambda: _best_layout(plan(
            named_gpt(args.model, PRESETS[args.model]), config, pinned=_pinned(args),
            world_size=world, progress=lambda text: print(f"plan: {text}", file=sys.stderr))))
        config = Config.load(config, overrides=chosen[0])
        return config, chosen[1]
    cached = None if args.plan else cached_probe(config, world)
    if args.plan is None and cached is None:
        return config, None  # a plain run without a cached probe: nothing to predict, nothing measured
    return config, _on_rank_zero(world, lambda: predict_config(
        named_gpt(args.model, PRESETS[args.model]), config, cached or probe_machine(config, world_size=world), world))


def _planned_layout(args: argparse.Namespace, config: Config) -> str:
    """What the plan would train instead of a refused config, from the cached probe (a refusal never
    measures the disk); without one, how to have it chosen."""
    from ..planning import cached_probe, plan
    from ..planning.model_spec import named_gpt

    probe = cached_probe(config)
    if probe is None or int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return "or let zerooffload choose: train --plan auto (zerooffload plan lists the layouts that fit)"
    try:
        best = plan(named_gpt(args.model, PRESETS[args.model]), config, pinned=_pinned(args), probe=probe).best
    except ConfigError as error:
        return f"zerooffload plan finds none either ({error})"
    overrides = " ".join(f"{k}={json.dumps(v)}" for k, v in best.overrides.items())
    return (f"zerooffload plan's best here: {overrides} (predicted {best.prediction.step_seconds:.2f} s/step); "
            "train it with --plan auto")


def _pinned(args: argparse.Namespace) -> set[str]:
    """The searched keys the user set: in ``--config`` or as overrides (never TRAIN_DEFAULTS' choices)."""
    from ..planning import pinned_keys

    user = load_train_config(args.config, [], args.steps) if args.config else Config.load({})
    return pinned_keys(user, args.overrides)


def _best_layout(result) -> tuple[list[str], Prediction]:
    """The plan's best layout as overrides, with its prediction; one line about it."""
    best = result.best
    print(f"plan: {best.describe()} (of {len(result.fitting)} that fit): predicted {best.prediction.step_seconds:.2f} "
          f"s/step; {best.prediction.bottleneck}", file=sys.stderr)
    return [f"{key}={json.dumps(value)}" for key, value in best.overrides.items()], best.prediction


def _on_rank_zero(world: int, decide):
    """``decide()`` on rank 0, its result on every rank: a plan times the machine, and ranks that timed
    it apart could choose apart."""
    if world == 1:
        return decide()
    from ..comm import all_gather_object, init_comm

    comm = init_comm()  # the group the engine then uses as it is
    return all_gather_object(comm, decide() if comm.rank == 0 else None)[0]


def _predicted_and_measured(engine, run: _Run, rss_at_start: int) -> dict:
    """summary.json's ``predicted`` (the plan's) and ``measured`` (the median of this process's steps
    after the first; the engine's peak bytes per tier, and the process's peak RSS above its RSS before
    the engine was built: the independent figure for the device and host tiers on a CPU device)."""
    steps = run.step_seconds[1:] or run.step_seconds
    phases = run.phases[1:] or run.phases
    peaks = engine.memory_report().peaks
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    measured = {"step_seconds": statistics.median(steps) if steps else None,
                "phases": {k: statistics.median(p[k] for p in phases) for k in PHASES} if phases else {},
                "peak_bytes": {tier: peaks.get(tier, 0) for tier in ("device", "host", "nvme")},
                "rss_peak_above_start_bytes": rss_peak - rss_at_start}
    predicted = engine.stats.predicted if engine.stats else None
    return {"measured": measured, **({"predicted": predicted.as_json()} if predicted else {})}


def _format_prediction(s: dict) -> str:
    """The plan's step split next to the one measured, and the peak bytes per tier."""
    p, m = s["predicted"], s["measured"]
    lines = [f"{'predicted vs measured':<24}{'plan':>10}{'measured':>10}"]
    for phase in PHASES:
        lines.append(f"{phase + ' s':<24}{p['phases'][phase]:>10.3f}{m['phases'].get(phase, 0.0):>10.3f}")
    ratio = m["step_seconds"] / p["step_seconds"] if p["step_seconds"] else float("nan")
    lines.append(f"{'step s (wall)':<24}{p['step_seconds']:>10.3f}{m['step_seconds']:>10.3f}  (x{ratio:.2f})")
    for tier in ("device", "host", "nvme"):
        lines.append(f"{tier + ' peak MB':<24}{p['peak_bytes'][tier] / 1e6:>10.1f}{m['peak_bytes'][tier] / 1e6:>10.1f}")
    lines.append(f"{'RSS above start MB':<24}{'':>10}{m['rss_peak_above_start_bytes'] / 1e6:>10.1f}")
    return "\n".join(lines + [f"plan: {p['bottleneck']}"])


def _print_summary(s: dict) -> None:
    here = f"in {s['seconds']:.1f} s" if not s["first_step"] else \
        f"(resumed at step {s['first_step']}; {s['steps'] - s['first_step']} steps in {s['seconds']:.1f} s)"
    print(f"\ntrained {s['model']} ({s['params'] / 1e6:.2f}M params) for {s['steps']} steps {here} "
          f"on {s['world_size']} rank(s), ZeRO stage {s['stage']}, {s['precision']}")
    print(f"loss: mean of first {s['window']} steps {s['first_loss_mean']:.3f} -> last {s['window']} "
          f"{s['last_loss_mean']:.3f} (x{s['loss_ratio']:.2f}); {s['tokens_per_second']:,} tokens/s")
    print("peak engine memory: " + ", ".join(f"{tier} {n / 1e6:.1f} MB" for tier, n in s["peak_bytes"].items()))
