#!/usr/bin/env python3
"""RESULTS.md and its plots from the benchmarks' runs (``results.Run``: each one's status, records, and the
CPU, machine and commit it ran on), and what a run was measured on. ``results.py`` runs the benchmarks, or
with ``--report`` only reads their kept records, and calls ``write_results``; every table row names its CPU,
as ratios differ between machines.

RESULTS.md is a function of the records alone (no clock, no machine read while writing it), so writing it
twice gives the same file and a stale one shows as a diff. Every row carries an anchor made of its
benchmark, CPU and title (``row_anchor``), not of its position, so README and docs/ can link a figure to
the row that holds it and the link survives new rows.
"""
from __future__ import annotations

import os
import platform
import re
import statistics
import subprocess
import tempfile
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from pairs import resolution

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
    cpuinfo = dict(map(str.strip, line.split(":", 1)) for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if ":" in line)  # the last core's lines: every core's are the same
    family = {key: cpuinfo.get(key, "?") for key in ("cpu family", "model")}
    temp = tempfile.gettempdir()
    found = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "-T", temp], capture_output=True, text=True,
                           check=False).stdout.split()
    disk = f"{found[0]} on {os.path.basename(found[1])}" if len(found) == 2 else "an unknown filesystem"
    return (f"{cpu} (family {family['cpu family']} model {family['model']}), {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, kernel "
            f"{platform.release()}; torch {torch.__version__}, fused Adam SIMD level {simd_level()}; swap and test "
            f"files in {temp} ({disk}); {deepspeed_note}")


CODE_PATHS = ("zerooffload", "native", "bench", "setup.py", "pyproject.toml")
"""What a measurement depends on: a change here, uncommitted, marks the run's commit "-dirty"."""
OUTPUTS = re.compile(r"^bench/(RESULTS\.md|results_runs\.json|[^/]+\.png)$")
"""The benchmarks' own outputs, rewritten by every run: no mark of a changed measurement."""


def measured_commit(root: Path = HERE.parent) -> str:
    """The commit the working tree at ``root`` is at (``git rev-parse HEAD``), with "-dirty" when the package,
    native code or benchmarks differ from it (changed or untracked files but the benchmarks' outputs); ""
    outside a git checkout (shown as "unknown", as are the runs recorded before commits were)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=False)
    if head.returncode != 0:
        return ""
    status = subprocess.run(["git", "status", "--porcelain", "--", *CODE_PATHS], cwd=root, capture_output=True,
                            text=True, check=False).stdout
    changed = [line[3:].split(" -> ")[-1].strip('"') for line in status.splitlines()]
    return head.stdout.strip() + ("-dirty" if any(not OUTPUTS.match(path) for path in changed) else "")


def shown_commit(commit: str) -> str:
    """A run's commit as RESULTS.md shows it: 10 hex digits and the dirty mark, or "unknown"."""
    if not commit:
        return "unknown"
    return commit[:10] + ("-dirty" if commit.endswith("-dirty") else "")


def slug(text: str) -> str:
    """Lower-case words joined by "-": "Intel(R) Xeon(R) Processor (avx512)" -> "intel-xeon-avx512"."""
    return re.sub(r"[^a-z0-9]+", "-", re.sub(r"\(R\)|Processor", "", text).lower()).strip("-")


class Anchors:
    """The rows' ids, unique within RESULTS.md: the slugs of their parts, "-2", "-3" ... on a repeat."""

    def __init__(self) -> None:
        self.taken: set[str] = set()

    def cell(self, text: str, *parts: object) -> str:
        """``text`` linking to its own row, the row's anchor before it (GitHub keeps ``<a id>``)."""
        base = "-".join(slug(str(part)) for part in parts)
        anchor, repeat = base, 1
        while anchor in self.taken:
            repeat += 1
            anchor = f"{base}-{repeat}"
        self.taken.add(anchor)
        return f'<a id="{anchor}"></a>[{text}](#{anchor})'


def spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def verdict(record: dict) -> str:
    """A reference (the figure others are divided by) is reported as such, never as a target it met."""
    if record.get("reference"):
        return "reference"
    return "—" if record["met"] is None else "met" if record["met"] else "**NOT met**"


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


def runs_table(runs: list[Run], anchors: Anchors) -> list[str]:
    return markdown_table(["benchmark", "cpu", "command", "commit", "status", "seconds", "ran"],
                          [[anchors.cell(r.bench.name, "run", r.bench.name, r.cpu), r.cpu, f"`{r.shown}`",
                            f"`{shown_commit(r.commit)}`", r.status, f"{r.seconds:.0f}", r.when] for r in runs])


def pairs_table(runs: list[Run], anchors: Anchors) -> list[str]:
    rows = records_of(runs, "pairs")
    if not rows:
        return ["No comparisons recorded."]
    return [("Ratio = ours / theirs (time) per pair or round, the two sides interleaved; judged on the median. "
             "A target of — means none is set. The median's interval holds the true median ratio with the "
             "coverage shown, whatever the noise's distribution (the order statistics' interval, "
             "`pairs.median_interval`); where it holds the target, the verdict could go either way."), ""
            ] + markdown_table(
        ["benchmark", "cpu", "comparison", "ours / theirs", "ratio min / median / max",
         "the median's interval (coverage)", "target", "verdict"],
        [[anchors.cell(name, name, cpu, rec["title"]), cpu, rec["title"], f"{rec['names'][0]} / {rec['names'][1]}",
          spread(rec["ratios"]), resolution(rec["ratios"], rec["target"]),
          "—" if rec["target"] is None else f"≤ {rec['target']:.2f}", verdict(rec)]
         for name, cpu, rec in rows])


def checks_table(runs: list[Run], anchors: Anchors) -> list[str]:
    rows = records_of(runs, "check")
    if not rows:
        return ["No single-figure checks recorded."]
    return markdown_table(["benchmark", "cpu", "check", "value", "target", "verdict", "detail"],
                          [[anchors.cell(name, name, cpu, rec["title"]), cpu, rec["title"], f"{rec['value']:.4g}",
                            rec["target"], verdict(rec), rec["detail"]] for name, cpu, rec in rows])


CURVES = {"formats_accuracy": ("formats_loss.png", "small preset, bf16: the optimizer state's formats",
                               "The `small` preset in bf16 with each optimizer state format"),
          "zeropp_losses": ("zeropp_loss.png", "small preset, stage 3, 2 nodes x 2 ranks, fp32: ZeRO++'s parts",
                            "The `small` preset at stage 3 on two nodes (network namespaces) with each ZeRO++ part"),
          "zeropp_losses_bf16": ("zeropp_loss_bf16.png",
                                 "small preset, stage 3, 2 nodes x 2 ranks, bf16: ZeRO++'s parts",
                                 "The same in bf16, on a CPU with AVX512-BF16")}
"""The benchmarks whose loss curves RESULTS.md plots: their plot's file, title and caption."""


def curves_section(runs: list[Run], name: str) -> list[str]:
    """The loss curves of benchmark ``name``'s last run that recorded them; a run that recorded only its
    last-50-step means keeps the plot it drew itself then."""
    png, title, caption = CURVES[name]
    ran = sorted((r for r in runs if r.bench.name == name and (r.status == "ok" or _has_curves(r))),
                 key=lambda r: r.when)  # a run that missed its bound still drew every curve
    if not ran:
        return [f"{name} has not run: no plot."]
    with_curves = [r for r in ran if _has_curves(r)]
    if with_curves:
        run = with_curves[-1]
        plot_curves({rec["title"]: rec["values"] for rec in run.records if rec["kind"] == "curve"}, HERE / png, title)
        source = f"{run.bench.command} on {run.cpu}, {run.when}: its recorded losses"
    else:
        source = (f"{ran[-1].bench.command} on {ran[-1].cpu}, {ran[-1].when}, as it drew it then: that run recorded no "
                  "curves, so the plot is redrawn from the records after its next run")
    return [f"{caption} ({source}; the last-50-step means are in the checks above).", "", f"![{title}]({png})"]


def _has_curves(run: Run) -> bool:
    return any(rec["kind"] == "curve" for rec in run.records)


def split_section(runs: list[Run], anchors: Anchors) -> list[str]:
    rows = records_of(runs, "split")
    if not rows:
        return ["No step-time split recorded (optimizer_phase.py's iteration phase did not run): no plot."]
    plot_split([(cpu, rec) for _, cpu, rec in rows], HERE / "results_split.png")
    table = markdown_table(["iteration", "cpu", "side", "forward", "backward", "step", "total"],
                           [[anchors.cell(rec["title"], name, cpu, rec["title"], rec["side"]), cpu, rec["side"],
                             *(f"{rec['phases'][k]:.3f}" for k in PHASES), f"{sum(rec['phases'].values()):.3f}"]
                            for name, cpu, rec in rows])
    return (["Mean seconds per iteration (optimizer_phase.py, iteration phase).", ""] + table
            + ["", "![forward / backward / step per side](results_split.png)"])


def rss_section(runs: list[Run], anchors: Anchors) -> list[str]:
    rows = records_of(runs, "rss")
    if not rows:
        return ["No RSS rows recorded (rss_depth.py did not run or recorded none): no plot."]
    plot_rss([(cpu, rec) for _, cpu, rec in rows], HERE / "results_rss.png")
    table = markdown_table(
        ["benchmark", "cpu", "layers", "params (M)", "RSS above baseline (GB)", "engine's report (GB)", "ratio"],
        [[anchors.cell(name, name, cpu, f"{rec['layers']} layers"), cpu, rec["layers"], f"{rec['params'] / 1e6:.0f}",
          f"{rec['rss_bytes'] / 1e9:.2f}", f"{rec['report_bytes'] / 1e9:.2f}", f"{rec['ratio']:.2f}"]
         for name, cpu, rec in rows])
    return table + ["", "![RSS above baseline against the engine's report](results_rss.png)"]


def notes_list(runs: list[Run]) -> list[str]:
    notes = [f"- {r.bench.name}: {note}" for r in runs for note in r.notes]
    return notes or ["None: every benchmark ran in full."]


def write_results(runs: list[Run], quick: bool = False) -> Path:
    """RESULTS.md (and its plots) from ``runs`` alone, in their order; a plot whose records are absent is
    removed, not kept stale."""
    for stale in ("results_split.png", "results_rss.png"):
        (HERE / stale).unlink(missing_ok=True)
    anchors = Anchors()
    lines = ["# Benchmark results", "",
             ("Generated by `python bench/results.py --report` from `bench/results_runs.json`: each benchmark's "
              "last full run on each CPU, with the command, the commit it measured (\"-dirty\": uncommitted "
              "changes to the package, native code or benchmarks; \"unknown\": recorded before commits were), "
              "the date and every sample. `python bench/results.py` reruns all but the slow benchmarks and "
              "writes this file too. Each row links to itself: its anchor is made of its benchmark, CPU and "
              "title, so a link to it holds while they do."),
             *(["", ("**Quick run (--quick): the smallest arguments, for checking the script; the figures "
                     "are not measurements.**")] if quick else []),
             "", "Machines (every row below names its CPU and the fused Adam pass's SIMD level):", "",
             *machines_table(runs), "",
             ("The disk and CPUs are shared and noisy: compare ratios measured in one run, never absolute figures "
              "across runs."), "",
             "## Runs", "", *runs_table(runs, anchors), "",
             "## Comparisons", "", *pairs_table(runs, anchors), "",
             "## Single-figure checks", "", *checks_table(runs, anchors), "",
             "## Peak RSS against depth", "", *rss_section(runs, anchors), "",
             "## Step-time split", "", *split_section(runs, anchors), "",
             "## Optimizer state formats: loss curves", "", *curves_section(runs, "formats_accuracy"), "",
             "## ZeRO++: loss curves", "", *curves_section(runs, "zeropp_losses"), "",
             *curves_section(runs, "zeropp_losses_bf16"), "",
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


def plot_curves(curves: dict[str, list[float]], path: Path, title: str) -> None:
    """Each run's loss against the step, smoothed over the last 10 steps (loss_tails.py's curves)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, values in curves.items():
        smooth = [statistics.fmean(values[max(0, i - 9):i + 1]) for i in range(len(values))]
        ax.plot(range(1, len(values) + 1), smooth, label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean of the last 10 steps)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
