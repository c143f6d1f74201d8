#!/usr/bin/env python3
"""RESULTS.md and its plots from the benchmarks' runs (``results.Run``: each one's status, records, and the
CPU and machine it ran on), and what a run was measured on. ``results.py`` runs the benchmarks and calls
``write_results``; every table row names its CPU, as ratios differ between machines."""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import tempfile
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from results import Run

HERE = Path(__file__).resolve().parent


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
        for x, rec in zip(params, records if cpu == cpus[0] else []):  # depths once: every cpu runs the same
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
