"""The documentation holds together: every relative link in README.md and docs/*.md resolves (a file that
exists, and for `#anchor` links into markdown, a heading with that GitHub slug), none leaves the
repository, the README stays a short user-facing page, and its sections come in the order a user needs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
# the README's sections, in order: a pattern its heading must match (case-insensitive)
README_ORDER = ["what it is|why", "guarantees", "quick start", "your own model", "cluster",
                "limitations", "numbers", "documentation|docs"]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped except hyphens (and underscores, which
    are word characters), spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", text, re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")  # GitHub numbers repeated headings
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with each relative link of `path`: a target outside `root`, a missing file, or an
    anchor that names no heading. Links with a scheme (https:, mailto:) are not checked."""
    problems = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path.resolve()
        if not dest.is_relative_to(root.resolve()):
            problems.append(f"{path.name}: {target}: outside the repository")
        elif not dest.exists():
            problems.append(f"{path.name}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{path.name}: {target}: no heading #{anchor}")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page):
    assert broken_links(page) == []


def test_the_link_checker_catches_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Its part, two\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md) [ok](docs/a.md#its-part-two) [ok](#top) [web](https://example.com)\n"
                    "# Top\n"
                    "[gone](docs/b.md) [bad anchor](docs/a.md#nothing) [out](../elsewhere.md)\n"
                    "```\n[in a fence](docs/ignored.md)\n```\n")
    (tmp_path.parent / "elsewhere.md").write_text("x")
    assert broken_links(page, tmp_path) == [
        "README.md: docs/b.md: no such file",
        "README.md: docs/a.md#nothing: no heading #nothing",
        "README.md: ../elsewhere.md: outside the repository"]


def test_slugs_follow_github():
    assert slug("`overhead.py` (against plain DDP)") == "overheadpy-against-plain-ddp"
    assert slug("The test suite's wall time (target: 15 minutes)") == "the-test-suites-wall-time-target-15-minutes"
    assert slug("`hsdp_overhead.py` (target 1.05)") == "hsdp_overheadpy-target-105"


def test_the_readme_is_at_most_200_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)


def test_the_readme_s_sections_come_in_order():
    text = FENCE.sub("", (ROOT / "README.md").read_text())
    headings = re.findall(r"^## +(.+)$", text, re.M)
    at = [next((i for i, h in enumerate(headings) if re.search(p, h, re.I)), None) for p in README_ORDER]
    assert None not in at, dict(zip(README_ORDER, at)) | {"headings": headings}
    assert at == sorted(at) and len(set(at)) == len(at), list(zip(README_ORDER, at))
    assert re.search("quick start", headings[at[2]], re.I)  # the heading says "Quick start"


def results_sections() -> dict[str, str]:
    """benchmarks/RESULTS.md's sections by GitHub slug: each heading's text up to the next heading of its
    level or above."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    heads = [(m.start(), len(m.group(1)), slug(m.group(2))) for m in re.finditer(r"^(#{1,6}) +(.+?) *#*$", text, re.M)]
    out = {}
    for k, (at, level, name) in enumerate(heads):
        end = next((a for a, lv, _ in heads[k + 1:] if lv <= level), len(text))
        out.setdefault(name, text[at:end])
    return out


def test_each_headline_figure_is_in_the_results_section_it_names_with_its_command():
    """Every item of the README's "Numbers" list links a RESULTS.md section, and that section holds each
    figure the item states (numbers with a decimal point) and the command that measured it (`python
    benchmarks/...` or `unbroken ...`)."""
    readme = (ROOT / "README.md").read_text()
    numbers = readme.split("## Numbers", 1)[1].split("\n## ", 1)[0]
    items = re.split(r"\n(?=\d+\. )", numbers.strip())[1:]
    sections = results_sections()
    assert len(items) >= 6, items
    for item in items:
        anchors_ = re.findall(r"\]\(benchmarks/RESULTS\.md#([^)]+)\)", item)
        assert len(anchors_) == 1 and anchors_[0] in sections, (item, anchors_)
        section = sections[anchors_[0]]
        figures = [f for f in re.findall(r"\d+\.\d+", item.split("](")[0]) if not re.match(r"^\d+\.0$", f)]
        missing = [f for f in figures if f not in section]
        assert not missing, f"{item[:60]}...: {missing} not in RESULTS.md#{anchors_[0]}"
        assert re.search(r"`(PYTHONPATH=\S+\s+)?(python|\.venv/bin/python)\s+(-m unbroken\.cli|benchmarks/)|`unbroken ", section), \
            f"RESULTS.md#{anchors_[0]} names no command"
