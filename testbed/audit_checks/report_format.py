"""How report.md prints a number, the audit's own statement: an expected cell is a tuple of literal
text and ``Num`` (a derived value with the format the report prints it in); ``cell_ok`` compares a
printed cell with it at its printed digits (tabulate's ``"g"`` for a plain decimal column, and any
value within ``TOLERANCES["report"]`` of the audit's own where the run's summation order may differ,
except for ``exact`` numbers). ``P`` and ``T`` are the expected paragraphs and tables of a section,
``holm_cells`` fills a table's Holm-adjusted p column. Used by ``report_md.py`` and by each
analysis's ``report_tables`` in its audit module; numpy and stdlib only.
"""

from __future__ import annotations

import itertools
import math
import re

from .stats import holm, median

__all__ = ["Num", "P", "T", "cell_ok", "cell_values", "fixed", "holm_cells", "isnum", "label", "ordered", "p_text",
           "pct", "pct_format", "pvalue", "render", "spread", "text"]

_FLOAT = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+|\d+(?:\.\d*)?[eE][+-]?\d+)")
_INT = re.compile(r"[+-]?\d+")


class Num:
    """A number the audit derived and the format the report prints it in."""

    __slots__ = ("value", "fmt", "exact")

    def __init__(self, value: float, fmt, exact: bool = False):
        self.value = float(value)
        self.fmt = fmt
        self.exact = exact  # computed by the same exact operations as the run (no tolerance)

    def text(self, shift: int, tol: dict) -> str:
        x = self.value
        if shift:
            x += shift * (tol["atol"] + tol["rtol"] * abs(x))
        return self.fmt(x)


def render(cell: tuple, tol: dict, shifts=None) -> str:
    out, k = [], 0
    for part in cell:
        if isinstance(part, Num) and not part.exact:
            out.append(part.text(shifts[k] if shifts else 0, tol))
            k += 1
        elif isinstance(part, Num):
            out.append(part.text(0, tol))
        else:
            out.append(part)
    return "".join(out)


def normalized(s: str) -> str:
    """A plain decimal number as tabulate prints a numeric column (Python's "g"); anything else as is."""
    s = s.strip()
    if _FLOAT.fullmatch(s):
        return format(float(s), "g")
    if _INT.fullmatch(s):
        return str(int(s))
    return s


def cell_ok(printed: str, cell: tuple, tol: dict) -> bool:
    """Whether ``printed`` is the text of ``cell``, some value within ``tol`` of each number allowed."""
    got = normalized(printed)
    if got == normalized(render(cell, tol)):
        return True
    n = sum(isinstance(p, Num) and not p.exact for p in cell)
    if not n or n > 4:
        return False
    return any(got == normalized(render(cell, tol, s)) for s in itertools.product((-1, 0, 1), repeat=n))


def isnum(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not (isinstance(x, float) and math.isnan(x))


def pct_format(digits: int):
    return lambda v: f"{100 * v:.{digits}f}%"


def pct(x, digits: int = 2, none: str = "n/a") -> tuple:
    return (Num(x, pct_format(digits)),) if isnum(x) else (none,)


def fixed(x, digits: int, none: str = "n/a", exact: bool = False) -> tuple:
    return (Num(x, lambda v: f"{v:.{digits}f}", exact),) if isnum(x) else (none,)


def p_text(v) -> str:
    return f"{v:.4f}" if v >= 1e-4 else f"{v:.1e}"


def pvalue(x, exact: bool = False, none: str = "n/a") -> tuple:
    """A p-value as the report prints it: four decimals, two significant digits below 0.0001."""
    return (Num(x, p_text, exact),) if isnum(x) else (none,)


def text(s) -> tuple:
    return ("" if s is None else str(s),)


def spread(xs, digits: int = 2) -> tuple:
    """``median [min-max]`` of the non-missing values, each a percentage."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return ("n/a",)
    f = pct_format(digits)
    return (Num(median(xs), f), " [", Num(min(xs), f), "-", Num(max(xs), f), "]")


def cell_values(cell: tuple) -> list[float]:
    """The numbers of an expected cell (for tests that compare other documents with the run)."""
    return [p.value for p in cell if isinstance(p, Num)]


def P(name: str, prefix: str, facts=()) -> dict:
    """A paragraph that must start with ``prefix`` and state each fact: (what, regex with one
    group, expected cell)."""
    return {"kind": "para", "name": name, "prefix": prefix, "facts": list(facts)}


def T(name: str, headers: list, key: int, rows: list) -> dict:
    return {"kind": "table", "name": name, "headers": list(headers), "key": key, "rows": rows}


def holm_cells(lines: list, col: int) -> None:
    """Replace the ``(p, exact)`` placeholder at ``col`` of each table line by its Holm-adjusted
    cell, over the family of every test of the table. Exact (no tolerance) when every p of the
    family is: integer multiples, min and max of exact values are exact."""
    ps = [line[col][0] for line in lines]
    exact = all(line[col][1] for line in lines)
    for line, adj in zip(lines, holm(ps)):
        line[col] = pvalue(adj, exact=exact)


def ordered(values) -> list:
    seen = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def label(r):
    return r["distribution"] if "distribution" in r else r["case"]
