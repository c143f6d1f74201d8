"""``zerooffload bench io``: write then read one test file through each I/O backend; report GB/s.

[Note: bench vocabulary]
- A *setting* is one ``AioConfig`` to measure: a backend with a block size and either a queue depth
  (``uring``: pieces in flight in the ring) or a thread count (``pool``, ``python``, ``aiofiles``:
  one piece in flight per worker). The knob a backend ignores is recorded as ``None``, so a table
  never suggests that ``queue_depth`` changed a thread pool's result.
- A *run* measures one setting: one timed write of the whole *payload* (page-aligned random bytes,
  changed before every run so a write that did nothing cannot pass), ``os.fsync`` included, then one
  timed read into the *readback* buffer (zeroed first, so a read that did nothing cannot pass), then
  a byte-for-byte check outside the timing.
- A *record* is one op of one run: backend, op ("write" | "read"), the setting's knobs, bytes,
  seconds and ``gbps`` (GB = 1e9 bytes, the unit disks are sold in).

Transfers use ``AsyncIO(raw=True)`` on an O_DIRECT file, so no page cache and no bounce copy is ever
measured (``planning.scratch_disk``, where the runs happen, for the probe too). This module is a face
(DESIGN §3): it parses, measures, prints and plots; it holds no I/O logic of its own.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import json
import logging
import sys
from collections.abc import Callable

from tqdm import tqdm

from ..config import ALIGNMENT, AioConfig, Config, ConfigError, format_size, parse_size
from ..planning.scratch_disk import QUEUE_BACKENDS, BenchError, Record, Unavailable, preflight, scratch_disk

__all__ = ["SWEEP_BLOCK_SIZES", "exit_status", "parse_total", "run_io_bench", "sweep_grid"]

log = logging.getLogger("zerooffload.cli.bench")

BACKENDS = ("uring", "pool", "python", "aiofiles")
"""Every backend ``bench io`` knows, in the order they are measured (fastest expected first)."""


SWEEP_BLOCK_SIZES = (256 << 10, 1 << 20, 4 << 20)
SWEEP_QUEUE_DEPTHS = (4, 16, 32)
"""io_uring's grid: 4 shows the latency-bound end, 32 is the aio.queue_depth default (deeper did not help
fio on the disks measured, shared/anchors/README.md)."""
SWEEP_NATIVE_THREADS = (4, 16, 32)
"""The native pool's analogue of queue depth (one piece in flight per worker)."""
SWEEP_PYTHON_THREADS = (1, 4)
"""The Python baselines' grid: 1 shows the single-stream cost, 4 what the GIL lets threads overlap."""


# ------------------------------------------------------------------------------------------------
# Entry point


def run_io_bench(args: argparse.Namespace, config: Config) -> int:
    """Measure every chosen setting, then print a table (or JSON) and save the plot; the exit status.

    Usage problems (a bad flag, too little space) exit 2 before any I/O; a byte that does not read
    back as written exits 1; Ctrl-C exits 130. The test file is deleted in every case.
    """
    return exit_status("bench io", lambda: _bench_io(args, config))


def exit_status(command: str, work: Callable[[], int]) -> int:
    """``work()``'s exit status; a ``BenchError`` prints its one line and exits with its code, Ctrl-C
    with 130 (the test file is gone either way: ``scratch_disk``)."""
    try:
        return work()
    except BenchError as exc:
        print(f"zerooffload {command}: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print(f"zerooffload {command}: interrupted (no test file left behind)", file=sys.stderr)
        return 130


def _bench_io(args: argparse.Namespace, config: Config) -> int:
    size = parse_total(args.size)
    directory = args.path or config.nvme.paths[0]
    if args.plot:
        _require_matplotlib()
    settings = _settings(args, config.aio)
    preflight(directory, size)
    records = _measure(settings, directory, size)
    print(json.dumps([r.as_json() for r in records], indent=1) if args.json else format_table(records))
    if args.plot:
        try:
            plot(records, args.plot)
        except OSError as exc:
            print(f"zerooffload bench io: cannot save --plot {args.plot}: {exc.strerror}", file=sys.stderr)
            return 1
        log.info("saved plot %s", args.plot)
    return 0


# ------------------------------------------------------------------------------------------------
# Parsing: flags and config into settings


def parse_total(text: str) -> int:
    """``--size`` in bytes: positive and a multiple of 4096, as O_DIRECT transfers must be."""
    try:
        size = parse_size(text, "--size")
    except ConfigError as exc:
        raise BenchError(str(exc), code=2) from None
    if size <= 0 or size % ALIGNMENT:
        raise BenchError(f"--size {text}: must be a positive multiple of {ALIGNMENT} bytes (O_DIRECT)", code=2)
    return size


def _backend_names(asked: list[str] | None) -> list[str]:
    """The backends to measure: those asked for (checked), else all (any that cannot run here is skipped
    with a warning when its turn comes, so one missing extension does not cost the other results)."""
    if asked:
        for name in asked:
            if name not in BACKENDS:
                near = difflib.get_close_matches(name, BACKENDS, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise BenchError(f"--backend {name!r} is not a backend{hint} (choose from {', '.join(BACKENDS)})",
                                 code=2)
        return list(dict.fromkeys(asked))
    return list(BACKENDS)


def _settings(args: argparse.Namespace, base: AioConfig) -> list[AioConfig]:
    """One AioConfig per run: the flags over ``config.aio``; with ``--sweep``, each backend's grid over
    the knobs that no flag pins (``--sweep --block-size 1MiB`` sweeps queue depths and threads only)."""
    base = dataclasses.replace(base, direct=True)
    pinned = set()
    for flag, key, value in (("--block-size", "block_size", args.block_size),
                             ("--queue-depth", "queue_depth", args.queue_depth),
                             ("--threads", "threads", args.threads)):
        if value is not None:
            try:  # AioConfig checks the value; the message names the flag as well as the aio.* key
                base = dataclasses.replace(base, **{key: value})
                pinned.add(key)
            except ConfigError as exc:
                raise BenchError(f"{flag} {value}: {exc}", code=2) from None
    grids = {name: sweep_grid(name, pinned) if args.sweep else [{}] for name in _backend_names(args.backend)}
    return [dataclasses.replace(base, backend=name, **point) for name, grid in grids.items() for point in grid]


def sweep_grid(backend: str, pinned: set[str] | frozenset[str] = frozenset()) -> list[dict]:
    """The sweep for one backend: block sizes x its own in-flight knob (see the constants above),
    less the knobs in ``pinned``."""
    if backend in QUEUE_BACKENDS:
        axes = {"block_size": SWEEP_BLOCK_SIZES, "queue_depth": SWEEP_QUEUE_DEPTHS}
    else:
        axes = {"block_size": SWEEP_BLOCK_SIZES,
                "threads": SWEEP_NATIVE_THREADS if backend == "pool" else SWEEP_PYTHON_THREADS}
    points = [{}]
    for key, values in axes.items():
        if key not in pinned:
            points = [{**point, key: value} for point in points for value in values]
    return points


def _require_matplotlib() -> None:
    """Fail before measuring, not after minutes of I/O, when ``--plot`` cannot be honoured."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'zerooffload[plot]'", code=2) from None


# ------------------------------------------------------------------------------------------------
# Measuring


def _measure(settings: list[AioConfig], directory: str, size: int) -> list[Record]:
    """Run every setting on one test file, one progress tick per run; skip backends that cannot run."""
    records: list[Record] = []
    skipped: set[str] = set()
    with scratch_disk(directory, size) as disk, tqdm(total=len(settings), unit="run", file=sys.stderr,
                                                     disable=None, desc="bench io") as bar:
        for setting in settings:
            if setting.backend not in skipped:
                try:
                    records += disk.run(setting)
                except Unavailable as exc:
                    skipped.add(setting.backend)
                    log.warning("skipping backend %s: %s", setting.backend, exc)
            bar.update(1)
    if not records:
        raise BenchError(f"no backend could run here (skipped: {', '.join(sorted(skipped))})")
    return records


# ------------------------------------------------------------------------------------------------
# Output


def _knob(value: int | None) -> str:
    return "-" if value is None else str(value)


def format_table(records: list[Record]) -> str:
    """A fixed-width table, one line per record, in the order measured."""
    header = ("backend", "op", "block_size", "queue_depth", "threads", "GB/s")
    rows = [(r.backend, r.op, str(format_size(r.block_size)), _knob(r.queue_depth), _knob(r.threads),
             f"{r.gbps:.2f}") for r in records]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i >= 2 else cell.ljust(w) for i, (cell, w) in
                       enumerate(zip(row, widths))) for row in [header, *rows]]
    return "\n".join(lines)


def _label(record: Record) -> str:
    knob = f"qd{record.queue_depth}" if record.queue_depth is not None else f"t{record.threads}"
    return f"{record.backend}\n{format_size(record.block_size)} {knob}"


def plot(records: list[Record], path: str) -> None:
    """A grouped bar chart (write and read side by side per setting) saved as PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(_label(r) for r in records))
    width = 0.4
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels)), 4.5))
    for shift, op in ((-width / 2, "write"), (width / 2, "read")):
        speed = {_label(r): r.gbps for r in records if r.op == op}
        ax.bar([i + shift for i in range(len(labels))], [speed.get(x, 0.0) for x in labels], width, label=op)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("GB/s (1e9 bytes)")
    ax.set_title(f"zerooffload bench io: {format_size(records[0].bytes)} O_DIRECT, fsync in write")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)
