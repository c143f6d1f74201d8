"""Render a step trace (``zerooffload train --trace FILE``, see [Note: step traces] in
``zerooffload/trace.py``) into one PNG that reads like Perfetto's timeline, for a report or a review
where nobody will open the JSON in a viewer.

Usage: python bench/render_trace.py TRACE.json OUT.png [--width 16] [--steps N]

Top panel: one lane per track that holds events (``main``, ``waits``, ``nvme read``, ``nvme write``,
``collectives``), per rank when the file holds several. Each event is a bar: ``main``'s segments
coloured by kind (forward / backward / reduce / step / update), waits red, transfers labelled with
their GB/s when the bar is wide enough. Overlapping transfers (prefetch keeps several in flight)
stack in sub-rows as in Perfetto. A transfer's span ends at the wait that saw it done, so its GB/s
is a lower bound: a prefetched read looks slow because nobody waited for it sooner.
Bottom panel: the ``<tier> bytes`` counters in MB (10^6 B) over the same time axis. A tier whose
bytes did not change while tracing has no counter events, hence no line.
Dashed lines mark step ends: the end of each run of ``step`` / ``update`` segments on ``main``.
Times are ms from the trace's first event (its ``ts`` count from the recorder's creation, not 0).
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

KIND_COLOURS = {"forward": "#4e79a7", "backward": "#f28e2b", "reduce": "#b07aa1", "step": "#59a14f",
                "update": "#8cd17d", "wait": "#e15759", "nvme read": "#76b7b2", "nvme write": "#9c755f",
                "collectives": "#edc948"}


@dataclass
class Span:
    pid: int
    tid: int
    name: str
    start: float  # ms from the trace's first event
    end: float
    args: dict = field(default_factory=dict)


@dataclass
class Lane:
    pid: int
    track: str
    rows: list[list[Span]]  # sub-rows: the spans of one never overlap


def load(path: str) -> tuple[list[Span], list[dict], dict[tuple[int, int], str]]:
    """The spans (complete events, and async b/e pairs joined by id), the counter events (ts in ms)
    and the track names by (pid, tid), all on one clock starting at the first event."""
    with open(path) as file:
        events = json.load(file)["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    timed = [e for e in events if e["ph"] != "M"]
    t0 = min((e["ts"] for e in timed), default=0.0)
    spans, counters, begun = [], [], {}
    for e in timed:
        ts = (e["ts"] - t0) / 1e3
        if e["ph"] == "X":
            spans.append(Span(e["pid"], e["tid"], e["name"], ts, ts + e["dur"] / 1e3, e.get("args", {})))
        elif e["ph"] == "b":  # the bytes are on the begin event only
            begun[e["pid"], e.get("cat"), e["id"]] = (ts, e)
        elif e["ph"] == "e" and (e["pid"], e.get("cat"), e["id"]) in begun:
            start, b = begun.pop((e["pid"], e.get("cat"), e["id"]))
            spans.append(Span(b["pid"], b["tid"], b["name"], start, ts, {**b.get("args", {}), **e.get("args", {})}))
        elif e["ph"] == "C":
            counters.append({**e, "ts": ts})
    return spans, counters, names


def kind(span: Span, track: str) -> str:
    """The colour key: on ``main`` the segment's first word (``backward: reduce`` is a reduce, not a
    backward), elsewhere the track, so every wait reads as one red."""
    if track != "main":
        return "wait" if track == "waits" else track
    return "reduce" if span.name.startswith("backward:") else span.name.split()[0]


def step_ends(spans: list[Span], names: dict) -> list[float]:
    """Where each step ends: a step's ``step`` segment is cut into pieces by the ``update`` segments
    inside it, so a step ends where a run of step/update pieces on main is followed by other work."""
    first = min((pid for pid, _ in names), default=0)  # the ranks step together: rank 0 marks them
    main = sorted((s for s in spans if s.pid == first and names.get((s.pid, s.tid)) == "main"), key=lambda s: s.start)
    stepping = [kind(s, "main") in ("step", "update") for s in main]
    return [s.end for s, here, after in zip(main, stepping, stepping[1:] + [False]) if here and not after]


def layout_lanes(spans: list[Span], names: dict) -> list[Lane]:
    """One lane per (rank, track) holding spans, in rank then track order; within a lane spans are
    packed greedily into sub-rows so that overlapping async transfers stay visible side by side
    (main's segments, disjoint by construction, keep one row)."""
    by_lane: dict[tuple[int, int], list[Span]] = defaultdict(list)
    for s in spans:
        by_lane[s.pid, s.tid].append(s)
    lanes = []
    for (pid, tid), members in sorted(by_lane.items()):
        rows: list[list[Span]] = []
        for s in sorted(members, key=lambda s: s.start):
            row = next((r for r in rows if r[-1].end <= s.start + 1e-3), None)  # 1 us: float rounding
            if row is None:
                rows.append(row := [])
            row.append(s)
        lanes.append(Lane(pid, names.get((pid, tid), f"tid {tid}"), rows))
    return lanes


def label(span: Span, track: str, width_pt: float, fontsize: float) -> str:
    """The longest of the span's candidate labels that fits its bar (about 0.6 em per character)."""
    gbps = span.args.get("bytes", 0) / max(span.end - span.start, 1e-9) / 1e6  # bytes per ms -> GB/s
    if track.startswith("nvme"):
        candidates = [f"{span.name} {gbps:.2f} GB/s", f"{gbps:.2f} GB/s", f"{gbps:.2f}", f"{gbps:.1f}"]
    else:
        candidates = [span.name, span.name.split()[-1]]
    return next((c for c in candidates if len(c) * 0.6 * fontsize < width_pt - 2), "")


def draw_lanes(ax, lanes: list[Lane], multi_rank: bool) -> tuple[set[str], list[tuple[Span, str, float]]]:
    """Bars top to bottom, one sub-row 1 unit tall; returns the kinds drawn (for the legend) and the
    bars to label with their track and row centre (labelled once the layout fixes the axes' width)."""
    kinds, y, ticks, pending = set(), 0.0, [], []
    for lane in lanes:
        name = f"rank {lane.pid}: {lane.track}" if multi_rank else lane.track
        ticks.append((y + len(lane.rows) / 2, name + ("\n(GB/s)" if lane.track.startswith("nvme") else "")))
        for r, row in enumerate(lane.rows):
            for s in row:
                k = kind(s, lane.track)
                kinds.add(k)
                ax.broken_barh([(s.start, s.end - s.start)], (y + r + 0.1, 0.8),
                               facecolors=KIND_COLOURS.get(k, "#bab0ac"), edgecolors="white", linewidth=0.3)
                pending.append((s, lane.track, y + r + 0.5))
        y += len(lane.rows) + 0.4
        ax.axhline(y - 0.2, color="#dddddd", linewidth=0.6)
    ax.set_ylim(y, 0)
    ax.set_yticks([t for t, _ in ticks], [n for _, n in ticks])
    return kinds, pending


def label_bars(ax, pending: list[tuple[Span, str, float]], fontsize: float = 7) -> None:
    """Each bar's label that fits, measured against the axes' drawn width in points."""
    left, right = ax.get_xlim()
    pt_per_ms = ax.get_window_extent().width * 72 / ax.figure.dpi / max(right - left, 1e-9)
    for s, track, y in pending:
        text = label(s, track, (s.end - s.start) * pt_per_ms, fontsize)
        if text:
            ax.text((s.start + s.end) / 2, y, text, ha="center", va="center", fontsize=fontsize, clip_on=True)


def draw_counters(ax, counters: list[dict], t_end: float, multi_rank: bool) -> None:
    """Each ``<tier> bytes`` counter as a step line held to the trace's end (a value holds until it
    changes)."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for c in sorted(counters, key=lambda c: c["ts"]):
        series[f"rank {c['pid']}: {c['name']}" if multi_rank else c["name"]].append((c["ts"], c["args"]["bytes"] / 1e6))
    for name, points in sorted(series.items()):
        points.append((t_end, points[-1][1]))
        ax.step([t for t, _ in points], [v for _, v in points], where="post", label=name)
    ax.set_ylabel("MB held")
    if series:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0))


def render(trace: str, out: str, width: float = 16.0, steps: int | None = None) -> list[Lane]:
    """Draw ``trace`` into ``out`` (only its first ``steps`` steps, when it holds more); returns the lanes."""
    spans, counters, names = load(trace)
    ends = step_ends(spans, names)
    t_end = max((s.end for s in spans), default=0.0)
    if steps is not None and steps < len(ends):
        t_end, ends = ends[steps - 1], ends[:steps]
        spans = [Span(s.pid, s.tid, s.name, s.start, min(s.end, t_end), s.args) for s in spans if s.start < t_end]
        counters = [c for c in counters if c["ts"] <= t_end]
    lanes = layout_lanes(spans, names)
    multi_rank = len({pid for pid, _ in names}) > 1
    rows = sum(len(lane.rows) + 0.4 for lane in lanes)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(width, 1.2 + 0.28 * rows + 2.2),
                                      gridspec_kw={"height_ratios": [max(rows, 1) * 0.28, 2.0]})
    kinds, pending = draw_lanes(top, lanes, multi_rank)
    draw_counters(bottom, counters, t_end, multi_rank)
    for i, end in enumerate(ends):
        for ax in (top, bottom):
            ax.axvline(end, color="black", linestyle="--", linewidth=0.7)
        top.text(end, 0, f"step {i + 1} ends ", fontsize=7, ha="right", va="bottom")
    bottom.set_xlim(0, t_end)
    bottom.set_xlabel("ms from the first traced event")
    waited = defaultdict(float)  # per rank: ranks wait at the same time, a sum would overstate it
    for lane in (lane for lane in lanes if lane.track == "waits"):
        waited[lane.pid] += sum(s.end - s.start for row in lane.rows for s in row)
    top.set_title(f"{os.path.basename(trace)}: {len(ends)} step(s), {t_end:.1f} ms, "
                  f"{len({pid for pid, _ in names})} rank(s), {'up to ' if multi_rank else ''}"
                  f"{max(waited.values(), default=0.0):.1f} ms waiting on NVMe", pad=14)
    shown = [k for k in KIND_COLOURS if k in kinds] + (["other"] if kinds - KIND_COLOURS.keys() else [])
    top.legend(handles=[Patch(color=KIND_COLOURS.get(k, "#bab0ac"), label=k) for k in shown],
               fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0))
    fig.tight_layout()
    label_bars(top, pending)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return lanes


def main(argv: list[str] | None = None) -> list[Lane]:
    """The command line (argv None: sys.argv); returns the lanes drawn, for tests."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="the JSON that zerooffload train --trace wrote")
    parser.add_argument("out", help="the PNG to write")
    parser.add_argument("--width", type=float, default=16.0, help="figure width in inches")
    parser.add_argument("--steps", type=int, default=None, help="show only the first N steps")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: show at least one step")
    return render(args.trace, args.out, args.width, args.steps)


if __name__ == "__main__":
    main()
