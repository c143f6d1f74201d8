"""The ``zerooffload`` command: parse arguments, call one library function, print its result.

Each subcommand is a ``_cmd_*`` function taking the parsed arguments and returning an exit
status; no training or I/O logic lives here (DESIGN §3: the CLI is a face).
"""
from __future__ import annotations

import argparse
import sys

from .config import Config, ConfigError
from .log import configure_logging

__all__ = ["main"]


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
    from .train import run_training

    return run_training(args)


def _cmd_estimate(args: argparse.Namespace) -> int:
    from .estimate import estimate, format_table

    rows = estimate(args.params, args.dp)
    if args.stage is not None:
        rows = [r for r in rows if r.stage == args.stage]
    print(format_table(rows, args.params, args.dp))
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
                      help="python of a DeepSpeed venv (e.g. /tmp/anchors/dsvenv/bin/python): adds DeepSpeedCPUAdam")
    adam.set_defaults(run=_cmd_bench_adam)


def _cmd_consolidate(args: argparse.Namespace) -> int:
    from .checkpoint import consolidate
    from .precision import COMPUTE_DTYPES

    path = consolidate(args.checkpoint, args.out, COMPUTE_DTYPES[args.dtype], args.tag)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


def _add_checkpoint(commands) -> None:
    checkpoint = commands.add_parser("checkpoint", help="work with saved checkpoints")
    kinds = checkpoint.add_subparsers(dest="checkpoint_command", required=True, metavar="WHAT")
    merge = kinds.add_parser("consolidate", help="write a checkpoint's model as one safetensors file")
    merge.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory (holding 'latest' and tags)")
    merge.add_argument("out", metavar="OUT.safetensors")
    merge.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="parameter dtype (default fp32)")
    merge.add_argument("--tag", help="tag to read (default: the one 'latest' names)")
    merge.set_defaults(run=_cmd_consolidate)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerooffload", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from .models import PRESETS

    train = commands.add_parser("train", help="train the built-in GPT on the offline byte corpus")
    train.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    train.add_argument("--model", default="nano", choices=list(PRESETS), help="GPT preset (default nano)")
    train.add_argument("--out", default="zerooffload-out", help="directory for summary.json and checkpoints/")
    train.add_argument("--save-every", type=int, default=0, metavar="N",
                       help="save a checkpoint to OUT/checkpoints every N steps (and at the end)")
    train.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/latest")
    _add_config_arguments(train)
    train.set_defaults(run=_cmd_train)
    _add_checkpoint(commands)
    doctor = commands.add_parser("doctor", help="check the native backend, io_uring, O_DIRECT, CUDA, free space")
    _add_config_arguments(doctor)
    doctor.set_defaults(run=_cmd_doctor)
    estimate = commands.add_parser("estimate", help="model-state memory per device by the ZeRO paper's formulas")
    estimate.add_argument("--params", type=float, required=True, help="parameter count, e.g. 7.5e9")
    estimate.add_argument("--dp", type=int, required=True, help="data-parallel ranks")
    estimate.add_argument("--stage", type=int, choices=range(4), help="show one stage only")
    estimate.set_defaults(run=_cmd_estimate)
    _add_bench(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script and ``python -m zerooffload``."""
    args = _parser().parse_args(argv)
    configure_logging(args.log_level.upper())
    try:
        return args.run(args)
    except ConfigError as exc:
        print(f"zerooffload: config error: {exc}", file=sys.stderr)
        return 2
