"""Reading report.md as text: ``parse_blocks`` splits it into blank-line separated headings,
paragraphs and GitHub pipe tables, ``parse_table`` reads a table's header and body cells, ``split_at``
groups blocks under their headings. Stdlib only; used by ``report_md.py``.
"""

from __future__ import annotations

import re

__all__ = ["parse_blocks", "parse_table", "split_at"]

_SEP = re.compile(r":?-+:?")


def parse_blocks(doc: str) -> list[dict]:
    """Blank-line separated blocks: {"kind": h1 | h2 | h3 | table | para, "line": first line number,
    "text": the block's text (a heading's title), "lines": its lines}."""
    blocks, cur = [], []
    for no, line in enumerate(doc.split("\n") + [""], 1):
        if line.strip():
            cur.append((no, line))
            continue
        if cur:
            lines = [ln for _, ln in cur]
            first = lines[0]
            kind = "para"
            for mark, k in (("# ", "h1"), ("## ", "h2"), ("### ", "h3")):
                if first.startswith(mark):
                    kind = k
            if first.lstrip().startswith("|"):
                kind = "table"
            title = first[first.index(" ") + 1:].strip() if kind.startswith("h") else "\n".join(lines)
            blocks.append({"kind": kind, "line": cur[0][0], "text": title, "lines": lines})
            cur = []
    return blocks


def parse_table(lines: list[str]) -> tuple[list[str], list[list[str]]]:
    """(header cells, body rows of cells) of a GitHub pipe table; ValueError if it is not one."""
    cells = []
    for ln in lines:
        s = ln.strip()
        if not (s.startswith("|") and s.endswith("|")) or len(s) < 2:
            raise ValueError(f"line {s[:60]!r} is not a table row")
        cells.append([c.strip() for c in s[1:-1].split("|")])
    if len(cells) < 2 or not all(_SEP.fullmatch(c) for c in cells[1]):
        raise ValueError("no |---| separator line under the header")
    return cells[0], cells[2:]


def split_at(blocks: list, kind: str) -> tuple[list, list]:
    """(blocks before the first ``kind`` heading, [(title, line, blocks under it)])."""
    head, parts = [], []
    for b in blocks:
        if b["kind"] == kind:
            parts.append((b["text"], b["line"], []))
        elif parts:
            parts[-1][2].append(b)
        else:
            head.append(b)
    return head, parts
