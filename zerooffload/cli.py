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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerooffload", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    doctor = commands.add_parser("doctor", help="check the native backend, io_uring, O_DIRECT, CUDA, free space")
    _add_config_arguments(doctor)
    doctor.set_defaults(run=_cmd_doctor)
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
