"""The documentation holds together: the generated references match the code, every config key and every
command-line argument is documented, every relative link in README.md and docs/ reaches its file and
anchor, and README stays a page a newcomer reads to the end."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from zerooffload.cli.main import _parser
from zerooffload.config import Config

ROOT = Path(__file__).resolve().parents[1]
README_LINES = 250


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_generated_references_match_the_code():
    generator = _generator()
    for name, build in generator.PAGES.items():
        page = ROOT / "docs" / name
        if not page.is_file() or page.read_text() != build():  # the diff itself: git diff after the command
            pytest.fail(f"docs/{name} is stale: run python docs/generate.py and commit it", pytrace=False)


def _key_paths(section, prefix=""):
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from _key_paths(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f.metadata.get("doc", "")


def test_every_config_key_has_a_row_with_its_doc():
    reference = (ROOT / "docs" / "configuration-reference.md").read_text()
    for key, doc in _key_paths(Config()):
        assert doc.strip(), f"{key} has no doc: give its option(...) one in zerooffload/config/sections.py"
        row = re.search(rf"^\| `{re.escape(key)}` \|.*\|$", reference, re.M)
        assert row, f"docs/configuration-reference.md has no row for {key}"
        assert " ".join(doc.split()).replace("|", "\\|") in row.group(0), f"{key}'s row lacks its doc"


def _parsers(parser: argparse.ArgumentParser, name: str = "zerooffload"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_command_and_argument_is_in_the_reference_with_its_help():
    reference = (ROOT / "docs" / "commands-reference.md").read_text()
    sections = dict(re.findall(r"^## `(zerooffload[^`]*)`\n(.*?)(?=^## |\Z)", reference, re.M | re.S))
    for name, parser in _parsers(_parser()):
        text = sections.get(name, "") if name != "zerooffload" else reference.split("\n## ", 1)[0]
        assert text, f"docs/commands-reference.md has no section for {name}"
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            label = action.option_strings[0] if action.option_strings else action.metavar or action.dest
            assert action.help, f"{name} {label} has no help: add help= in zerooffload/cli/main.py"
            assert f"| `{label}" in text or f"| `[{label}" in text, f"{name}: {label} is not in its section"
            assert " ".join(action.help.split()).replace("|", "\\|") in text, f"{name} {label}: its help is missing"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped,
    spaces as hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))


def _anchors(page: Path) -> set[str]:
    text = page.read_text()
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S), re.M):
        slug = _slug(heading)
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found | set(re.findall(r"""<a\s+(?:id|name)=["']([^"']+)["']""", text))


def test_every_relative_link_reaches_its_file_and_anchor():
    broken = []
    for page in _pages():
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:: not ours to check offline
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)} -> {target}"
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{where}: no such file in the repository")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{where}: no heading or <a id> '{anchor}' in {resolved.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_readme_is_short_and_points_into_docs():
    readme = (ROOT / "README.md").read_text()
    lines = len(readme.splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines (at most {README_LINES}): move detail into docs/"
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", readme))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert linked and linked <= pages
    unreachable = pages - linked - {n for p in (ROOT / "docs").glob("*.md")
                                      for n in re.findall(r"\]\(([\w-]+\.md)", p.read_text())}
    assert not unreachable, f"docs pages no README or docs link reaches: {sorted(unreachable)}"


@pytest.mark.parametrize("page", ["README.md", "docs"])
def test_docs_cite_no_file_outside_the_repository(page):
    """Paths named in prose (``bench/results.py``, ``tests/test_cuda.py``) exist in this checkout."""
    texts = [ROOT / page] if page.endswith(".md") else sorted((ROOT / page).glob("*.md"))
    for text_page in texts:
        text = text_page.read_text()
        assert "DESIGN.md" not in text, f"{text_page.name} cites DESIGN.md, which is not in the repository"
        cited = set(re.findall(r"(?<![\w/.-])((?:zerooffload|tests|bench|native|examples|docs|\.ci)/[\w./-]*\w)", text))
        missing = sorted(path for path in cited if not (ROOT / path).exists())
        assert not missing, f"{text_page.name} names paths that do not exist: {missing}"
