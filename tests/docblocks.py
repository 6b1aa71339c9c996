"""Command blocks out of the project's markdown pages (README.md, docs/*.md), for the tests that run them
as written. Owns the extraction only; what a block must do is each test's business."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def marked_lines(page: str | Path, block: str) -> list[str]:
    """The command lines of `page`'s block between `<!-- block -->` and `<!-- /block -->` (fences dropped).
    `page` is relative to the repository root."""
    text = (ROOT / page).read_text()
    assert f"<!-- {block} -->" in text, f"{page} has no block {block!r}"
    inner = text.split(f"<!-- {block} -->")[1].split(f"<!-- /{block} -->")[0]
    return [line for line in inner.splitlines() if line and not line.startswith("```")]


def section_blocks(page: str | Path, heading: str, lang: str = "bash") -> list[str]:
    """The ```lang fenced blocks of `page`'s section that starts at the line `heading` (e.g. "## Persistence"),
    up to the next heading of the same or a higher level."""
    text = (ROOT / page).read_text()
    start = text.index(heading + "\n") if heading + "\n" in text else text.index(heading)
    level = heading.split(" ")[0]
    section = text[start + len(heading):]
    ends = [m.start() for m in re.finditer(r"^(#{1,%d}) " % len(level), section, re.M)]
    section = section[:ends[0]] if ends else section
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)
