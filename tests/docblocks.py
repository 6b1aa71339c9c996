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
    up to the next heading of the same or a higher level outside a fence (a `# comment` in a block is none)."""
    lines = (ROOT / page).read_text().splitlines()
    level = len(heading.split(" ")[0])
    start = next(n for n, line in enumerate(lines) if line.startswith(heading))
    blocks, block, fenced = [], None, False
    for line in lines[start + 1:]:
        if line.startswith("```"):
            fenced = not fenced
            if fenced and line == "```" + lang:
                block = []
            elif not fenced and block is not None:
                blocks.append("\n".join(block) + "\n")
                block = None
            continue
        if not fenced and re.match(r"#{1,%d} " % level, line):
            break
        if block is not None:
            block.append(line)
    return blocks
