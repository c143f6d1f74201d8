"""The ``zerooffload`` command: parse arguments, call one library function, print its result.

Each subcommand is a ``_cmd_*`` function taking the parsed arguments and returning an exit
status; no training or I/O logic lives here (the CLI is a face over the library).

[Note: user errors]
A mistake the user can fix (a bad flag or config value, a checkpoint that does not verify, a swap
path that cannot be written, no room for the swap files, a peer rank that failed, CUDA memory past
``memory.device_budget``'s cap, Ctrl-C) ends the command with one line on stderr, ``zerooffload:
<what>: <fix>``, and no traceback: a traceback says "bug", and these are not bugs. Exit status 2: the command line or the config is wrong (nothing
ran); 1: it ran and hit a problem in the files or the machine; 130: interrupted. Anything else (the
engine's RuntimeErrors for API misuse, a bug) keeps Python's traceback. ``--debug`` or
``ZEROOFFLOAD_DEBUG=1`` prints the traceback of a user error too, above the same line, with the
same status.
"""
from __future__ import annotations

import argparse
import errno
import os
import select
import signal
import sys
import traceback
import warnings
from typing import Callable, TextIO

from ..config import Config, ConfigError, DeepSpeedConfigWarning
from ..errors import CheckpointError, EngineGroupEnded, SkipStreakError
from ..log import configure_logging, current_rank
from .checkpoints import add_checkpoint
from .train_config import DEFAULT_STEPS

__all__ = ["main"]

USAGE_ERROR, RUNTIME_ERROR, INTERRUPTED = 2, 1, 130
"""Exit statuses of user errors (see [Note: user errors])."""

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

_DESCRIPTION = """\
Train PyTorch models whose parameters, gradients and optimizer states do not fit in accelerator
memory: ZeRO stages 1-3 over torch.distributed, each kind of state kept on the device, in host RAM
or on NVMe and moved ahead of need. Runs alone or under torchrun with the same arguments."""

_EPILOG = """\
examples:
  zerooffload train --steps 100 --model nano      train the built-in GPT for 100 steps
  zerooffload train --resume --save-every 50      continue from OUT/checkpoints/latest
  zerooffload estimate --params 1.5B --dp 8       memory per GPU by stage
  zerooffload doctor nvme.path=/mnt/nvme          can this machine run it?

Run 'zerooffload COMMAND --help' for a command's flags. Exit status: 0 done, 1 a runtime problem
(checkpoint, disk, another rank), 2 a usage or config error, 130/143 stopped by SIGINT/SIGTERM.
--debug (or ZEROOFFLOAD_DEBUG=1) adds the traceback to an error's one line."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (see [Note: user errors]) instead of the usage and a message."""

    def error(self, message: str) -> None:
        self.exit(USAGE_ERROR, f"zerooffload: {message}: see '{self.prog} --help'\n")


def _number(parse: Callable[[str], float], minimum: float, meaning: str) -> Callable[[str], float]:
    """An argparse ``type`` for a number >= ``minimum``, whose error says what the flag takes."""
    def checked(text: str) -> float:
        try:
            value = parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {meaning}") from exc
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {meaning}")
        return value
    return checked


def _params(text: str) -> float:
    """``--params`` of ``estimate``: a count with an optional K/M/B/T suffix (see ``parse_count``)."""
    from .estimate import parse_count  # here, as each command's own imports: a usage error needs no torch

    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _link_rate(text: str) -> float:
    """``--inter-node-rate``: bits a second as tc writes them (``200mbit``, ``25gbit``, ``100kbit``), in GB/s."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    unit = next((u for u in units if text.lower().endswith(u)), None)
    if unit is None:
        raise ValueError(text)
    return float(text[:-len(unit)]) * units[unit] / 8 / 1e9


def _load_config(args: argparse.Namespace) -> Config:
    """The config a subcommand runs with: ``--config`` (or defaults), then ``key.path=value`` overrides."""
    return Config.load(args.config or {}, overrides=args.overrides)


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML or JSON config, ours or DeepSpeed's")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help="config overrides, e.g. zero.stage=3 nvme.path=/mnt/nvme")


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import Status, run_checks

    checks = run_checks(_load_config(args))
    width = max(len(c.name) for c in checks)
    for check in checks:
        print(f"{check.status.value:>4}  {check.name:<{width}}  {check.detail}")
    failed = [c for c in checks if c.status is Status.FAIL]
    print(f"\n{len(failed)} problem(s): zerooffload cannot run as configured" if failed
          else "\nzerooffload can run here")
    return 1 if failed else 0


def _cmd_train(args: argparse.Namespace) -> int:
    if args.tag and not args.resume:  # before train's imports (torch): a usage error is answered at once
        args.usage_error("--tag NAME needs --resume (it names the checkpoint to continue from)")
    from .train import run_training

    return run_training(args)


def _cmd_estimate(args: argparse.Namespace) -> int:
    from .estimate import estimate, format_table, format_volumes, k_adam

    k = k_adam(args.master, args.moments)
    rows = estimate(args.params, args.dp, k)
    if args.stage is not None:
        rows = [r for r in rows if r.stage == args.stage]
    print(format_table(rows, args.params, args.dp, k))
    if args.dp > 1 and args.stage in (None, 3):
        print("\n" + format_volumes(args.params, args.dp, args.ranks_per_node or args.dp))
    return 0


def _cmd_bench_io(args: argparse.Namespace) -> int:
    from .bench import run_io_bench

    return run_io_bench(args, _load_config(args))


def _cmd_bench_adam(args: argparse.Namespace) -> int:
    from .bench_adam import run_adam_bench

    return run_adam_bench(args)


def _add_bench(commands) -> None:
    bench = commands.add_parser("bench", help="measure swap throughput and the optimizer pass against their limits")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="WHAT")
    io = kinds.add_parser("io", help="write then read --size through the I/O backends; verify every byte")
    io.add_argument("--path", metavar="DIR", help="directory for the test file (default: nvme.path)")
    io.add_argument("--size", default="1GiB", help="bytes to write and read back (default 1GiB)")
    io.add_argument("--backend", action="append", metavar="B",
                    help="uring, pool, python or aiofiles; repeat for several (default: every usable one)")
    io.add_argument("--block-size", metavar="S", help="request piece size (default: aio.block_size)")
    io.add_argument("--queue-depth", type=int, metavar="N", help="pieces in flight (default: aio.queue_depth)")
    io.add_argument("--threads", type=int, metavar="N", help="worker threads (default: aio.threads)")
    io.add_argument("--sweep", action="store_true", help="try a grid of block sizes, queue depths and threads")
    io.add_argument("--json", action="store_true", help="print a JSON list of records instead of a table")
    io.add_argument("--plot", metavar="FILE", help="save a PNG bar chart (needs matplotlib: pip install '.[plot]')")
    _add_config_arguments(io)
    io.set_defaults(run=_cmd_bench_io)
    adam = kinds.add_parser("adam", help="time the CPU optimizer phase (AdamW + low-precision copy): ours vs peers")
    adam.add_argument("--params", type=float, default=100e6, metavar="N",
                      help="parameters, as tensors of 10M (default 1e8)")
    adam.add_argument("--pairs", type=int, default=5, metavar="N",
                      help="rounds, each running every side once (default 5)")
    adam.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="dtype of the copies (default bf16)")
    adam.add_argument("--threads", type=int, default=0, metavar="N", help="threads of our pass (default 0: all CPUs)")
    adam.add_argument("--deepspeed-python", metavar="PATH",
                      help="python of a venv with DeepSpeed installed: adds DeepSpeedCPUAdam")
    adam.set_defaults(run=_cmd_bench_adam)


def _cmd_tune_io(args: argparse.Namespace) -> int:
    from .tune_io import run_tune_io

    return run_tune_io(args, _load_config(args))


def _add_tune(commands) -> None:
    tune = commands.add_parser("tune", help="find settings for this machine by measuring it")
    kinds = tune.add_subparsers(dest="tune", required=True, metavar="WHAT")
    io = kinds.add_parser("io", help="search the [aio] settings (backend, block size, depth) for one disk")
    io.add_argument("--path", metavar="DIR", help="directory on the disk to tune (default: nvme.path)")
    io.add_argument("--out", metavar="FILE", help="write a config whose only section is the tuned [aio]")
    io.add_argument("--size", default="256MiB", help="bytes each run writes and reads back (default 256MiB)")
    io.add_argument("--budget", type=_number(float, 1, "seconds, at least 1"), default=100.0, metavar="S",
                    help="seconds the search may take; it stops where it is then (default 100)")
    io.add_argument("--compare", action="store_true",
                    help="also run the full bench io --sweep grid and compare its best with the tuned setting")
    _add_config_arguments(io)
    io.set_defaults(run=_cmd_tune_io)


def _cmd_plan(args: argparse.Namespace) -> int:
    from .plan import run_plan

    if args.params is not None and args.layers is None:
        args.usage_error("--params needs --layers (the model's shape: a GPT that deep, as wide as the count gives)")
    return run_plan(args)


def _add_plan(commands) -> None:
    plan = commands.add_parser("plan", help="rank the layouts of a model that fit this machine by predicted step "
                                            "time; write the best as a config")
    plan.add_argument("--model", default="nano",
                      help="a preset, a Hugging Face config.json, a Python module:factory, or a name with --params")
    plan.add_argument("--params", type=_params, help="parameter count of a GPT to plan for (with --layers)")
    plan.add_argument("--layers", type=_number(int, 1, "a whole number of layers >= 1"), help="its blocks")
    plan.add_argument("--world", type=_number(int, 1, "a whole number of ranks >= 1"), default=1,
                      help="ranks the run will have (default 1)")
    plan.add_argument("--batch", type=_number(int, 1, "a whole number of sequences >= 1"),
                      help="sequences per optimizer step over all ranks (default: the config's)")
    plan.add_argument("--seq", type=_number(int, 1, "a whole number of tokens >= 1"),
                      help="sequence length (default: the model's)")
    plan.add_argument("--top", type=_number(int, 1, "a whole number >= 1"), default=8, help="layouts shown (default 8)")
    plan.add_argument("--ranks-per-node", type=_number(int, 1, "a whole number of ranks >= 1"),
                      help="ranks a node of the --world ranks (default: all on one node)")
    plan.add_argument("--inter-node-rate", type=_number(_link_rate, 1e-9, "a link rate such as 200mbit or 25gbit"),
                      help="the link between nodes (tc's units: 200mbit, 25gbit): over a slow one ZeRO++ is tried")
    plan.add_argument("--out", metavar="FILE", help="write the best layout as a complete TOML config")
    plan.add_argument("--refresh", action="store_true", help="measure the machine again instead of the cached probe")
    plan.add_argument("--json", action="store_true", help="print the ranked layouts as JSON")
    _add_config_arguments(plan)
    plan.set_defaults(run=_cmd_plan, usage_error=plan.error)


def _add_train(commands) -> None:
    from ..models import PRESETS

    train = commands.add_parser("train", help="train the built-in GPT on the offline byte corpus")
    train.add_argument("--steps", type=_number(int, 1, "a whole number of steps >= 1"), default=DEFAULT_STEPS,
                       help="optimizer steps in all, the resumed ones included (default 300)")
    train.add_argument("--model", default="nano", choices=list(PRESETS), help="GPT preset (default nano)")
    train.add_argument("--out", default="zerooffload-out", help="directory for summary.json and checkpoints/")
    train.add_argument("--save-every", type=_number(int, 0, "a whole number >= 0 (0: no checkpoints)"), default=0,
                       metavar="N", help="save a checkpoint to OUT/checkpoints every N steps (and at the end)")
    train.add_argument("--keep-last", type=_number(int, 0, "a whole number >= 0 (0: keep every one)"), default=3,
                       metavar="K", help="after each save keep only the newest K step tags (default 3; 0: all)")
    train.add_argument("--resume", action="store_true",
                       help="continue from OUT/checkpoints/latest (or the newest step tag that verifies)")
    train.add_argument("--tag", metavar="NAME", help="with --resume: continue from this tag instead")
    train.add_argument("--overwrite", action="store_true",
                       help="start afresh in an --out that holds an earlier run's checkpoints, removing them "
                            "(without it such an --out is refused)")
    train.add_argument("--plan", metavar="auto|FILE",
                       help="auto: the layout zerooffload plan ranks best, within what --config and overrides pin; "
                            "FILE: train a plan written by zerooffload plan --out; either way the plan's predicted "
                            "step is printed beside the measured one")
    train.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of steps 2.. (see --trace-steps)")
    train.add_argument("--trace-steps", type=_number(int, 1, "a whole number of steps >= 1"), default=2, metavar="N",
                       help="with --trace: how many steps it records after the first (default 2)")
    _add_config_arguments(train)
    train.set_defaults(run=_cmd_train, usage_error=train.error)


def _add_estimate(commands) -> None:
    estimate = commands.add_parser("estimate", help="model-state memory per device by the ZeRO paper's formulas")
    estimate.add_argument("--params", type=_params, required=True, help="parameter count, e.g. 7.5e9 or 1.5B")
    estimate.add_argument("--dp", type=_number(int, 1, "a whole number of ranks >= 1"), required=True,
                          help="data-parallel ranks")
    estimate.add_argument("--stage", type=int, choices=range(4), help="show one stage only")
    estimate.add_argument("--ranks-per-node", type=_number(int, 1, "a whole number of ranks >= 1"),
                          help="ranks a node, for stage 3's bytes within and across nodes (default: --dp, one node)")
    estimate.add_argument("--master", choices=("fp32", "split"), default="fp32",
                          help="optimizer.master's format (split: 2.125 bytes, not 4)")
    estimate.add_argument("--moments", choices=("fp32", "bf16", "int8"), default="fp32",
                          help="optimizer.moments' format (bf16: 2 bytes each, int8: 1 and 1/64)")
    estimate.set_defaults(run=_cmd_estimate)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zerooffload", description=_DESCRIPTION, epilog=_EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                        help="logging level: " + ", ".join(LOG_LEVELS) + " (default WARNING)")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error too (also: ZEROOFFLOAD_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(commands)
    add_checkpoint(commands)
    doctor = commands.add_parser("doctor", help="check the native backend, io_uring, O_DIRECT, CUDA, free space")
    _add_config_arguments(doctor)
    doctor.set_defaults(run=_cmd_doctor)
    _add_estimate(commands)
    _add_bench(commands)
    _add_tune(commands)
    _add_plan(commands)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``, taking ``key.path=value`` overrides wherever they stand: argparse alone takes them
    only as one run, so ``train a=1 --steps 5 b=2`` would refuse ``b=2``."""
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _os_error_line(exc: OSError) -> str:
    """An OSError's line. A damaged swap file says itself what happened, where, and what to do; an
    ``AioError`` names the operation, file and offset (whatever its errno's wording), and gets what to
    check (no room, a file-size limit, a path); the library words its other errors with the fix (no room
    for the swap files, an ``--out`` in use); a bare system message gets what to check."""
    if getattr(exc, "advice_included", False):  # SwapDamage (imported here, it would bring in torch)
        return str(exc)
    if type(exc).__str__ is not OSError.__str__:  # AioError: the operation, file and offset
        text = str(exc)
    elif exc.errno is None or exc.strerror != os.strerror(exc.errno):
        return exc.strerror or str(exc)
    else:
        text = exc.strerror if exc.filename is None else f"{exc.strerror}: {exc.filename}"
    if exc.errno == errno.ENOSPC:
        return f"{text}; free space there, or point nvme.path or --out at another disk"
    if exc.errno == errno.EFBIG:
        return f"{text}; raise this process's file-size limit (ulimit -f) or the filesystem's"
    return f"{text}; check that the path exists and is writable (nvme.path, offload.*.path, --out)"


def _user_error(exc: Exception) -> tuple[int, str] | None:
    """The exit status and line of a user error (see [Note: user errors]); None for anything else."""
    if isinstance(exc, ConfigError):
        return USAGE_ERROR, f"config error: {exc}"
    if isinstance(exc, CheckpointError):
        return RUNTIME_ERROR, f"checkpoint error: {exc}"
    if isinstance(exc, EngineGroupEnded):
        return RUNTIME_ERROR, f"{exc}; fix that rank's error (its own line) and run again"
    if isinstance(exc, SkipStreakError):
        return RUNTIME_ERROR, f"stopped: {exc}"
    if isinstance(exc, OSError):
        return RUNTIME_ERROR, _os_error_line(exc)
    if type(exc).__name__ == "OutOfMemoryError":  # CUDA's, past memory.device_budget's cap (imported here: torch)
        from ..tiers.device_memory import out_of_budget_line
        line = out_of_budget_line(exc)
        return None if line is None else (RUNTIME_ERROR, line)
    return None


def _fail(status: int, line: str, debug: bool) -> int:
    """Print a user error's line (after its traceback with ``debug``); return its exit status."""
    if debug:
        traceback.print_exc()
    rank = f"rank {current_rank()}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    _write_line(f"zerooffload: {rank}{_one_line(line)}", sys.stderr)
    return status


def _write_line(line: str, file: TextIO) -> None:
    """``line`` and its newline in one write: ``print`` writes them apart, two system calls on stderr,
    and under torchrun the ranks' lines, ending at the same moment, tore into each other."""
    file.write(line + "\n")
    file.flush()


def _warning_printer(python_showwarning: Callable) -> Callable:
    """A ``warnings.showwarning`` printing ours as ``zerooffload: warning: <message>`` (a user reads the
    message, not the library line that raised it); other warnings as Python shows them."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, DeepSpeedConfigWarning):
            _write_line(f"zerooffload: warning: {_one_line(str(message))}", sys.stderr if file is None else file)
        else:
            python_showwarning(message, category, filename, lineno, file, line)
    return show


def _end_process_groups() -> None:
    """After a command that ran to its end: its process groups ended, so that gloo's threads cannot abort
    the finished process at exit (``comm.end_process_groups``). A command that never imported
    torch.distributed has none, and is not made to import torch for it."""
    if "torch.distributed" in sys.modules:
        from ..comm import end_process_groups

        end_process_groups()


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's StringIO), no poll
        return False


def _output_closed() -> int:
    """The reader of the command's output went away (``zerooffload estimate ... | head``): stop quietly,
    as a command killed by SIGPIPE does, with stdout pointed at /dev/null so that the interpreter's last
    flush has nowhere to fail."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script and ``python -m zerooffload``."""
    debug = os.environ.get("ZEROOFFLOAD_DEBUG", "0") not in ("", "0")
    try:
        args = _parse(_parser(), argv)
        debug = debug or args.debug
        configure_logging(args.log_level)
        with warnings.catch_warnings():  # puts showwarning back afterwards (main may run inside a test)
            warnings.showwarning = _warning_printer(warnings.showwarning)
            status = args.run(args)
        _end_process_groups()
        return status
    except KeyboardInterrupt:
        return _fail(INTERRUPTED, "interrupted (Ctrl-C); nothing was saved by this command", debug)
    except BrokenPipeError as exc:
        if not _stdout_closed():  # a pipe of the command's own (a --trace FIFO), not its output
            return _fail(*_user_error(exc), debug)
        return _output_closed()
    except Exception as exc:
        error = _user_error(exc)
        if error is None:
            raise
        return _fail(*error, debug)
