"""``results.csv``: the rows of ``results.json`` as one flat table (stdlib only).

One CSV row per result row, in the same order; the columns are every key any row has, in the
order they first appear. A nested object becomes dotted columns (``policy.window``,
``arrays.packed.key.codes``); a list becomes its JSON text (``[0, 16]``). Cells: strings as they
are, numbers as JSON writes them (floats round-trip exactly: ``float(cell)`` is the value),
``true``/``false``, ``NaN``/``Infinity`` as JSON writes them, and an empty cell where a row has no
such key or the value is null. A row's ``per_row`` object (one value per query row, thousands of
numbers, kept so that reports can pool rows over cases) is not a table cell: it is left out here
and read from ``results.json``. The audit parses the file with the stdlib ``csv`` module and fails
any cell that does not say what ``results.json`` says, and a ``per_row`` column.
"""

from __future__ import annotations

import csv
import io
import json

__all__ = ["flatten", "results_csv", "OMITTED"]

# top-level row fields that results.csv leaves out (per-query-row lists; results.json has them)
OMITTED = ("per_row",)


def flatten(row: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": 1, "c": [1, 2]}`` (lists are leaves)."""
    out = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            for sub, v in flatten(value, f"{name}.").items():
                if sub in out:
                    raise ValueError(f"results.csv: two fields flatten to the column {sub!r}")
                out[sub] = v
        elif name in out:
            raise ValueError(f"results.csv: two fields flatten to the column {name!r}")
        else:
            out[name] = value
    return out


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, allow_nan=True)


def results_csv(rows: list[dict]) -> bytes:
    """The CSV text of ``rows`` (UTF-8, ``\\n`` line ends)."""
    flat = [flatten({k: v for k, v in r.items() if k not in OMITTED}) for r in rows]
    columns = list(dict.fromkeys(k for r in flat for k in r))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in flat:
        w.writerow([_cell(r.get(c)) for c in columns])
    return buf.getvalue().encode("utf-8")
