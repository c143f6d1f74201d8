#!/usr/bin/env python3
"""Rerun the benchmarks in ``bench/`` and regenerate ``bench/RESULTS.md`` with its plots, in one command.

Usage (from the repository root; meant to take at most 20 minutes on a 2-core machine; never in CI):
    python bench/results.py                      every benchmark in BENCHES with its full arguments
    python bench/results.py --quick              every benchmark with its smallest arguments (~3 min):
                                                 checks this script, its figures mean nothing
    python bench/results.py --only nvme_step,io_vs_fio   those again; the others' last results are kept
    python bench/results.py --only formats_accuracy,showcase_7b   the slow ones (never in a plain run)
    python bench/results.py --list               the table below and what this machine lacks
    python bench/results.py --deepspeed-python PATH   DeepSpeed's venv (default DEFAULT_DEEPSPEED_PYTHON)

Each benchmark runs as a child (``python <command> <args>``, cwd ``bench/``, a timeout each, its
process group killed on timeout). It reports what it measured by appending JSON lines to the file
named by $ZO_BENCH_RECORD (``pairs.record``), a fresh one per benchmark, in four kinds:
  pairs  ``report_pairs``: ours against theirs in interleaved pairs, ratio = ours / theirs per pair
  check  one figure against a target (``met`` None: reported without a numeric target)
  split  forward / backward / step seconds of one side of an iteration (optimizer_phase.py)
  rss    peak RSS above the baseline against the engine's memory report, one per depth (rss_depth.py)
``zerooffload bench adam`` records nothing (it is a command of the package): its ratio lines are
parsed instead. Each child's stdout and stderr go to ``bench/results_logs/<name>.txt`` (not committed).

Each full run's results are kept in ``bench/results_runs.json`` by benchmark and CPU, so ``--only`` reruns
some benchmarks and RESULTS.md still shows every other one's last results (the runs table dates each), and
a run on another kind of machine (say an AVX2 AMD EPYC after an AVX-512 Xeon) is shown beside the first
one's, never in its place: every row names the CPU it was measured on, as ratios differ between them. The *slow* benchmarks
(tens of minutes: training runs for accuracy, the 7b showcase) run only when ``--only`` names them.

Without fio the benchmarks that measure against it are skipped; without DeepSpeed the comparisons
with it are dropped (a script's own sides still run) and listed as skipped, never failed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOGS = HERE / "results_logs"
DEFAULT_DEEPSPEED_PYTHON = "/tmp/anchors/dsvenv/bin/python"
"""The DeepSpeed venv shared/anchors/setup_env.sh builds, where the benchmarks look for it by default."""
QUICK_TIMEOUT = 120
"""Seconds each benchmark may take under --quick."""


@dataclass(frozen=True)
class Bench:
    """One benchmark: how to run it fully and quickly, how long to allow, and what it needs."""

    name: str
    command: str
    """After ``python``, in bench/: a script, or ``-m module ...``."""
    args: str
    quick: str
    """The smallest arguments that still run every part (for checking this script)."""
    timeout: int
    """Seconds the full run may take; one that overruns is killed and reported failed, the rest still run."""
    needs: str = ""
    """"fio": skipped when fio is not on PATH (the reference side cannot be dropped)."""
    deepspeed: str = ""
    """The option naming DeepSpeed's python, for a benchmark with a DeepSpeed side."""
    slow: bool = False
    """Run only when ``--only`` names it (its last results are kept meanwhile)."""


BENCHES = [
    Bench("optimizer_phase", "optimizer_phase.py", "--rounds 5 --steps 2", "--rounds 1 --steps 1 --only step", 600),
    Bench("step_overhead", "step_overhead.py", "--pairs 5 --steps 2", "--pairs 1 --steps 1 --preset nano", 420),
    Bench("rss_depth", "rss_depth.py", "--steps 3", "--layers 1 --width 1024", 360),
    Bench("nvme_step", "nvme_step.py", "--rounds 5", "--rounds 1 --layers 2 --width 1024", 300, needs="fio"),
    Bench("checkpoint_io", "checkpoint_io.py", "--rounds 5", "--rounds 1 --layers 2 --width 1024", 240, needs="fio"),
    Bench("zero3_nvme", "zero3_nvme.py", "--pairs 5 --steps 2", "--pairs 1 --steps 1", 900,
          deepspeed="--deepspeed-python"),
    Bench("io_vs_fio", "io_vs_fio.py", "--rounds 5 --size 256MiB", "--rounds 5 --size 16MiB", 180, needs="fio",
          deepspeed="--ds-python"),
    Bench("clip_rate", "clip_rate.py", "--steps 60", "--steps 3", 300),
    Bench("bench_adam", "-m zerooffload bench adam", "--params 1e8 --pairs 5", "--params 1e7 --pairs 1", 180,
          deepspeed="--deepspeed-python"),
    Bench("zero3_formats", "zero3_nvme.py", "--only formats --pairs 5 --steps 2",
          "--only formats --pairs 1 --steps 1", 1500, deepspeed="--deepspeed-python", slow=True),
    Bench("formats_accuracy", "formats_accuracy.py", "--steps 500 --plot formats_loss.png", "--steps 60", 3600,
          slow=True),
    Bench("showcase_7b", "showcase_7b.py", "--steps 3", "--steps 1 --cases cap", 7200, slow=True),
]
RUNS = HERE / "results_runs.json"
"""Every benchmark's last full run (``Run.saved``), read back for those a run does not repeat."""


@dataclass
class Run:
    """What one benchmark did: its status, time, records and the notes RESULTS.md lists."""

    bench: Bench
    status: str  # "ok", "failed" or "skipped"
    seconds: float = 0.0
    shown: str = ""
    """The command line as RESULTS.md shows it (DeepSpeed's python, outside the repository, not named)."""
    records: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    when: str = ""
    """When it ran (RESULTS.md's runs table)."""
    cpu: str = ""
    """The CPU and the fused Adam SIMD level it ran on (``cpu_label``): what its rows are kept and shown by."""
    machine: str = ""
    """The whole machine it ran on (``machine``): RESULTS.md's list of machines."""

    def saved(self) -> dict:
        return {"name": self.bench.name, "status": self.status, "seconds": self.seconds, "shown": self.shown,
                "records": self.records, "notes": self.notes, "when": self.when, "cpu": self.cpu,
                "machine": self.machine}


def kept_runs() -> dict[tuple[str, str], Run]:
    """The last full run of each benchmark still in BENCHES on each CPU, by (name, cpu)."""
    benches = {b.name: b for b in BENCHES}
    saved = json.loads(RUNS.read_text()) if RUNS.exists() else []
    return {(s["name"], s["cpu"]): Run(benches[s.pop("name")], **s) for s in saved if s["name"] in benches}


# ------------------------------------------------------------------------------------------------
# Running


def deepspeed_version(python: str) -> str | None:
    """DeepSpeed's version in the venv of ``python``, or None when it has none (read from its metadata:
    importing deepspeed takes seconds)."""
    if not python or not os.access(python, os.X_OK):
        return None
    done = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('deepspeed'))"],
                          capture_output=True, text=True, timeout=60, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def arguments(bench: Bench, quick: bool, deepspeed: str | None) -> list[str]:
    """The child's arguments after ``python``: DeepSpeed's python passed when there is one; else an
    empty one, which the scripts and ``bench adam`` take as "no DeepSpeed side"."""
    args = shlex.split(bench.command) + shlex.split(bench.quick if quick else bench.args)
    if not bench.deepspeed:
        return args
    if deepspeed:
        return args + [bench.deepspeed, deepspeed]
    return args + [bench.deepspeed, ""]


def shown_command(bench: Bench, quick: bool, deepspeed: str | None) -> str:
    argv = arguments(bench, quick, deepspeed and "DEEPSPEED_PYTHON")
    return "python " + ("" if argv[0] == "-m" else "bench/") + shlex.join(argv)


def run(bench: Bench, quick: bool, deepspeed: str | None, workdir: Path) -> Run:
    """Run ``bench`` (or skip it), its output to its log and its records read back."""
    result = Run(bench, "ok", shown=shown_command(bench, quick, deepspeed))
    if bench.needs == "fio" and not shutil.which("fio"):
        result.status = "skipped"
        result.notes.append("skipped: fio not installed")
        return result
    records = workdir / f"{bench.name}.jsonl"
    log = LOGS / f"{bench.name}.txt"
    timeout = QUICK_TIMEOUT if quick else bench.timeout
    env = {**os.environ, "ZO_BENCH_RECORD": str(records), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, *arguments(bench, quick, deepspeed)], cwd=HERE, env=env,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # timed out or interrupted: its ranks and sides go too (they share its process group)
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    result.seconds = time.perf_counter() - start
    if code != 0:
        result.status = "failed"
        result.notes.append(f"failed: timed out after {timeout} s" if code is None else f"failed: exit status {code}")
    output = log.read_text(errors="replace")
    if bench.deepspeed and not deepspeed:
        result.notes.append("DeepSpeed comparison skipped: DeepSpeed not available")
    result.records = read_records(records) + (parse_bench_adam(output) if bench.name == "bench_adam" else [])
    return result


def read_records(path: Path) -> list[dict]:
    """The JSON lines a benchmark appended; a line cut short by a kill is dropped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


ADAM_RATIO = re.compile(r"^(ours(?: bf16-grad)?) vs (.+): [\d.]+x \(per-round ratios ([\d.]+) / ([\d.]+) / ([\d.]+)\)$",
                        re.MULTILINE)


def parse_bench_adam(output: str) -> list[dict]:
    """``bench adam``'s lines "ours vs PEER: ... (per-round ratios min / median / max)" as pairs records.

    It prints PEER / ours (higher: ours faster); these are inverted to ours / PEER like every other pairs
    row, so ``ratios`` holds the three figures, not every round (the median is exact for an odd count
    of rounds). It sets no target.
    """
    records = []
    for ours, peer, low, mid, high in ADAM_RATIO.findall(output):
        records.append({"kind": "pairs", "title": f"AdamW step + low-precision copy: {ours} vs {peer}",
                        "names": [ours, peer], "ratios": [1 / float(high), 1 / float(mid), 1 / float(low)],
                        "target": None, "met": None})
    return records


# ------------------------------------------------------------------------------------------------
# RESULTS.md


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
                platform.processor())


def cpu_label() -> str:
    """This CPU and the SIMD level the fused Adam pass runs at, e.g. "AMD EPYC (avx2)": the rows' key.
    (zerooffload is imported here, after the runs, so this process stays small while they run.)"""
    from zerooffload.optim import simd_level

    return f"{cpu_name()} ({simd_level()})"


def machine(deepspeed_note: str) -> str:
    """What the figures were measured on (imported here, as in ``cpu_label``)."""
    import psutil
    import torch

    from zerooffload.optim import simd_level

    cpu = cpu_name()
    temp = tempfile.gettempdir()
    found = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "-T", temp], capture_output=True, text=True,
                           check=False).stdout.split()
    disk = f"{found[0]} on {os.path.basename(found[1])}" if len(found) == 2 else "an unknown filesystem"
    return (f"{cpu}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, kernel "
            f"{platform.release()}; torch {torch.__version__}, fused Adam SIMD level {simd_level()}; swap and test "
            f"files in {temp} ({disk}); {deepspeed_note}")


def spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def verdict(met: bool | None) -> str:
    return "—" if met is None else "met" if met else "**NOT met**"


def records_of(runs: list[Run], kind: str) -> list[tuple[str, str, dict]]:
    """(benchmark name, cpu, record) for every record of ``kind``, in run order."""
    return [(r.bench.name, r.cpu, rec) for r in runs for rec in r.records if rec["kind"] == kind]


PHASES = ("forward", "backward", "step")
"""The step-time split's parts, in the order optimizer_phase.py records and the plot stacks them."""


def markdown_table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table: the header row, its separator, then one line per row (cells already formatted)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def machines_table(runs: list[Run]) -> list[str]:
    """Each CPU the runs were measured on and its whole machine (its latest run's description)."""
    latest = {}
    for r in sorted(runs, key=lambda r: r.when):
        latest[r.cpu] = r.machine
    return markdown_table(["cpu", "machine"], [[cpu, described] for cpu, described in latest.items()])


def runs_table(runs: list[Run]) -> list[str]:
    return markdown_table(["benchmark", "cpu", "command", "status", "seconds", "ran"],
                          [[r.bench.name, r.cpu, f"`{r.shown}`", r.status, f"{r.seconds:.0f}", r.when]
                           for r in runs])


def pairs_table(runs: list[Run]) -> list[str]:
    rows = records_of(runs, "pairs")
    if not rows:
        return ["No comparisons recorded."]
    return [("Ratio = ours / theirs (time) per pair or round, the two sides interleaved; judged on the median. "
             "A target of — means none is set."), ""] + markdown_table(
        ["benchmark", "cpu", "comparison", "ours / theirs", "ratio min / median / max", "target", "verdict"],
        [[name, cpu, rec["title"], f"{rec['names'][0]} / {rec['names'][1]}", spread(rec["ratios"]),
          "—" if rec["target"] is None else f"≤ {rec['target']:.2f}", verdict(rec["met"])]
         for name, cpu, rec in rows])


def checks_table(runs: list[Run]) -> list[str]:
    rows = records_of(runs, "check")
    if not rows:
        return ["No single-figure checks recorded."]
    return markdown_table(["benchmark", "cpu", "check", "value", "target", "verdict", "detail"],
                          [[name, cpu, rec["title"], f"{rec['value']:.4g}", rec["target"], verdict(rec["met"]),
                            rec["detail"]] for name, cpu, rec in rows])


def formats_section(runs: list[Run]) -> list[str]:
    """formats_accuracy.py's plot of each format's loss, when it ran (its figures: the checks above)."""
    ran = sorted((r for r in runs if r.bench.name == "formats_accuracy" and r.status == "ok"), key=lambda r: r.when)
    if not ran:
        return ["formats_accuracy.py has not run: no plot."]
    return [f"The `small` preset in bf16 with each optimizer state format (formats_accuracy.py on {ran[-1].cpu}, "
            "its last run; the last-50-step means are in the checks above).", "",
            "![loss with each optimizer state format](formats_loss.png)"]


def split_section(runs: list[Run]) -> list[str]:
    rows = records_of(runs, "split")
    if not rows:
        return ["No step-time split recorded (optimizer_phase.py's iteration phase did not run): no plot."]
    plot_split([(cpu, rec) for _, cpu, rec in rows], HERE / "results_split.png")
    table = markdown_table(["iteration", "cpu", "side", "forward", "backward", "step", "total"],
                           [[rec["title"], cpu, rec["side"], *(f"{rec['phases'][k]:.3f}" for k in PHASES),
                             f"{sum(rec['phases'].values()):.3f}"] for _, cpu, rec in rows])
    return (["Mean seconds per iteration (optimizer_phase.py, iteration phase).", ""] + table
            + ["", "![forward / backward / step per side](results_split.png)"])


def rss_section(runs: list[Run]) -> list[str]:
    rows = records_of(runs, "rss")
    if not rows:
        return ["No RSS rows recorded (rss_depth.py did not run or recorded none): no plot."]
    plot_rss([(cpu, rec) for _, cpu, rec in rows], HERE / "results_rss.png")
    table = markdown_table(
        ["benchmark", "cpu", "layers", "params (M)", "RSS above baseline (GB)", "engine's report (GB)", "ratio"],
        [[name, cpu, rec["layers"], f"{rec['params'] / 1e6:.0f}", f"{rec['rss_bytes'] / 1e9:.2f}",
          f"{rec['report_bytes'] / 1e9:.2f}", f"{rec['ratio']:.2f}"] for name, cpu, rec in rows])
    return table + ["", "![RSS above baseline against the engine's report](results_rss.png)"]


def notes_list(runs: list[Run]) -> list[str]:
    notes = [f"- {r.bench.name}: {note}" for r in runs for note in r.notes]
    return notes or ["None: every benchmark ran in full."]


def write_results(runs: list[Run], command: str, quick: bool) -> Path:
    """RESULTS.md (and its plots) from ``runs``; a plot whose records are absent is removed, not kept stale.
    ``command``: how it was generated, and where (Markdown)."""
    for stale in ("results_split.png", "results_rss.png"):
        (HERE / stale).unlink(missing_ok=True)
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines = ["# Benchmark results", "",
             (f"Generated by {command}, {when}, beside the other benchmarks' last results (dated in the "
              "runs table); `python bench/results.py` reruns all but the slow ones."),
             *(["", ("**Quick run (--quick): the smallest arguments, for checking the script; the figures "
                     "are not measurements.**")] if quick else []),
             "", "Machines (every row below names its CPU and the fused Adam pass's SIMD level):", "",
             *machines_table(runs), "",
             ("The disk and CPUs are shared and noisy: compare ratios measured in one run, never absolute figures "
              "across runs."), "",
             "## Runs", "", *runs_table(runs), "",
             "## Comparisons", "", *pairs_table(runs), "",
             "## Single-figure checks", "", *checks_table(runs), "",
             "## Peak RSS against depth", "", *rss_section(runs), "",
             "## Step-time split", "", *split_section(runs), "",
             "## Optimizer state formats: loss curves", "", *formats_section(runs), "",
             "## Skipped, failed or partial", "", *notes_list(runs), ""]
    path = HERE / "RESULTS.md"
    path.write_text("\n".join(lines))
    return path


# ------------------------------------------------------------------------------------------------
# Plots


def _pyplot():
    """matplotlib's pyplot on the Agg backend: files only, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_split(rows: list[tuple[str, dict]], path: Path) -> None:
    """Stacked bars, one per (iteration, side, and cpu where there are several): forward, backward and step
    seconds."""
    plt = _pyplot()
    several = len({cpu for cpu, _ in rows}) > 1
    labels = [f"{textwrap.fill(rec['title'], 10)}\n{rec['side']}" + (f"\n{textwrap.fill(cpu, 10)}" if several else "")
              for cpu, rec in rows]
    records = [rec for _, rec in rows]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(records) + 1.5), 4.5))
    bottom = [0.0] * len(records)
    for phase in PHASES:
        heights = [rec["phases"][phase] for rec in records]
        ax.bar(labels, heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("seconds per iteration")
    ax.set_title("Step-time split: engine vs torch")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_rss(rows: list[tuple[str, dict]], path: Path) -> None:
    """Peak RSS above the baseline and the engine's report against parameters, each point's depth marked;
    a pair of lines per cpu, named where there are several."""
    plt = _pyplot()
    cpus = list(dict.fromkeys(cpu for cpu, _ in rows))
    fig, ax = plt.subplots(figsize=(6.0, 4.5))
    for cpu in cpus:
        records = sorted((rec for row_cpu, rec in rows if row_cpu == cpu), key=lambda rec: rec["params"])
        params = [rec["params"] / 1e6 for rec in records]
        suffix = f" ({cpu})" if len(cpus) > 1 else ""
        ax.plot(params, [rec["rss_bytes"] / 1e9 for rec in records], "o-", label="peak RSS above baseline" + suffix)
        ax.plot(params, [rec["report_bytes"] / 1e9 for rec in records], "s--",
                label="engine's memory report" + suffix)
        for x, rec in zip(params, records):
            ax.annotate(f"{rec['layers']} layers", (x, rec["rss_bytes"] / 1e9), textcoords="offset points",
                        xytext=(4, 6), fontsize=8)
    ax.margins(x=0.15)
    ax.set_xlabel("parameters (M)")
    ax.set_ylabel("GB")
    ax.set_ylim(0, 1.2 * max(max(rec["rss_bytes"], rec["report_bytes"]) for _, rec in rows) / 1e9)
    ax.set_title("Peak RSS against depth (parameters, optimizer on NVMe)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# Command line


def requirements(bench: Bench, deepspeed: str | None) -> str:
    """What ``bench`` needs, each marked when this machine lacks it."""
    needs = []
    if bench.needs == "fio":
        needs.append("fio" + ("" if shutil.which("fio") else " (missing: skipped)"))
    if bench.deepspeed:
        needs.append("DeepSpeed" + ("" if deepspeed else " (missing: its side dropped)"))
    return ", ".join(needs) or "-"


def list_benches(deepspeed: str | None) -> None:
    """The table as it would run here: full command, quick arguments, timeout and needs."""
    for bench in BENCHES:
        print(f"{bench.name}: {shown_command(bench, False, deepspeed)}\n    quick: {bench.quick or '-'}; "
              f"timeout {bench.timeout} s ({QUICK_TIMEOUT} s quick); needs: {requirements(bench, deepspeed)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated benchmark names: " + ", ".join(b.name for b in BENCHES))
    parser.add_argument("--quick", action="store_true", help="every benchmark with its smallest arguments")
    parser.add_argument("--list", action="store_true", help="print the benchmarks and exit")
    parser.add_argument("--deepspeed-python", default=DEFAULT_DEEPSPEED_PYTHON,
                        help="python of a venv with DeepSpeed ('' for none; default %(default)s)")
    args = parser.parse_args()
    names = {b.name for b in BENCHES}
    args.only = args.only.split(",") if args.only else [b.name for b in BENCHES if not b.slow]
    if unknown := [name for name in args.only if name not in names]:
        parser.error(f"--only: unknown benchmark(s) {', '.join(unknown)} (choose from {', '.join(sorted(names))})")
    return args


def main() -> int:
    args = parse_args()
    version = deepspeed_version(args.deepspeed_python)
    deepspeed = args.deepspeed_python if version else None
    if args.list:
        list_benches(deepspeed)
        return 0
    LOGS.mkdir(exist_ok=True)
    chosen = [b for b in BENCHES if b.name in args.only]
    runs = {} if args.quick else kept_runs()  # a quick run's figures mean nothing: nothing kept, nothing saved
    fresh = []
    with tempfile.TemporaryDirectory(prefix="zo-results-") as workdir:
        for number, bench in enumerate(chosen, 1):
            print(f"[{number}/{len(chosen)}] {bench.name:<16}", end=" ", flush=True)
            done = run(bench, args.quick, deepspeed, Path(workdir))
            done.when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M")
            fresh.append(done)
            print(f"{done.status:<8} {done.seconds:5.0f} s  {'; '.join(done.notes)}", flush=True)
    cpu = cpu_label()
    described = machine(f"DeepSpeed {version} in its own venv" if version else "DeepSpeed not available")
    for done in fresh:
        done.cpu, done.machine = cpu, described
        runs[(done.bench.name, cpu)] = done
    runs = sorted(runs.values(), key=lambda r: ([b.name for b in BENCHES].index(r.bench.name), r.cpu))
    if not args.quick:
        RUNS.write_text(json.dumps([r.saved() for r in runs], indent=1) + "\n")
    command = " ".join(["python bench/results.py", *(["--quick"] if args.quick else []),
                        *(["--only", ",".join(args.only)] if chosen != [b for b in BENCHES if not b.slow] else [])])
    path = write_results(runs, f"`{command}` on {cpu}", args.quick)
    print(f"wrote {path.relative_to(HERE.parent)} (logs in {LOGS.relative_to(HERE.parent)}/)")
    return 0 if all(r.status != "failed" for r in fresh) else 1


if __name__ == "__main__":
    sys.exit(main())
