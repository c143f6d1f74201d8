"""``bench/results.py --report``: RESULTS.md regenerates from the committed records alone, the same bytes
every time (so the committed file is never stale), each row with an anchor of its own, a reference never
judged against itself, and a run's commit marked "-dirty" only by changes to what it measured."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path


BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # results_report imports its sibling pairs, as it does when results.py runs it


def regenerate(tmp_path: Path) -> Path:
    """``--report`` run on a copy of bench/'s report inputs, as on a clean clone (nothing else of bench/)."""
    for name in ("results.py", "results_report.py", "pairs.py", "results_runs.json", "formats_loss.png"):
        shutil.copy(BENCH / name, tmp_path / name)
    done = subprocess.run([sys.executable, "results.py", "--report"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return tmp_path / "RESULTS.md"


def test_committed_results_are_the_records_report(tmp_path):
    text = regenerate(tmp_path).read_text()
    assert text == (BENCH / "RESULTS.md").read_text(), "bench/RESULTS.md is stale: run python bench/results.py --report"
    for plot in ("results_split.png", "results_rss.png"):
        assert (tmp_path / plot).stat().st_size > 0
    anchors = re.findall(r'<a id="([^"]+)"></a>\[[^]]*\]\(#([^)]+)\)', text)
    ids = [anchor for anchor, _ in anchors]
    assert len(ids) == len(set(ids)) == text.count('<a id="') > 0
    assert all(anchor == link for anchor, link in anchors)


def test_no_figure_is_judged_against_itself(tmp_path):
    runs = json.loads((BENCH / "results_runs.json").read_text())
    records = [rec for run in runs for rec in run["records"]]
    assert all(rec["names"][0] != rec["names"][1] for rec in records if rec["kind"] == "pairs")
    references = [rec for rec in records if rec.get("reference")]
    assert references and all(rec["met"] is None for rec in references)
    rows = [line for line in regenerate(tmp_path).read_text().splitlines() if ": the reference" in line]
    assert rows and all("| reference |" in row and "| met |" not in row for row in rows)


def test_commit_marked_dirty_by_measured_code_only(tmp_path):
    spec = importlib.util.spec_from_file_location("results_report_under_test", BENCH / "results_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    assert report.measured_commit(tmp_path) == ""  # not a checkout: shown as "unknown"
    assert report.shown_commit("") == "unknown"
    git = lambda *args: subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True)
    git("init", "-q")
    for name in ("zerooffload/engine.py", "bench/RESULTS.md", "README.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = git("rev-parse", "HEAD").stdout.strip()
    (tmp_path / "bench" / "RESULTS.md").write_text("regenerated\n")  # an output: not a change of what ran
    (tmp_path / "bench" / "results_rss.png").write_bytes(b"png")
    (tmp_path / "README.md").write_text("docs\n")
    assert report.measured_commit(tmp_path) == head
    (tmp_path / "native").mkdir()
    (tmp_path / "native" / "new.c").write_text("int x;\n")  # untracked code is measured too
    assert report.measured_commit(tmp_path) == head + "-dirty"
    assert report.shown_commit(head + "-dirty") == head[:10] + "-dirty"


def test_links_into_results_name_rows_that_exist():
    """README.md and docs/ quote figures by linking their RESULTS.md rows: a link whose row is gone (a
    benchmark's title, CPU or name changed) fails here, not on a reader's click."""
    root = BENCH.parent
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', (BENCH / "RESULTS.md").read_text()))
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    links = {(page.name, anchor) for page in pages if page.exists()
             for anchor in re.findall(r"RESULTS\.md#([A-Za-z0-9_-]+)", page.read_text())}
    assert not [link for link in links if link[1] not in anchors]
