"""results.csv: the rows of results.json as a flat table, checked cell by cell by the audit."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
from pathlib import Path

import pytest

from testbed.audit import audit
from tests._helpers import copy_run, synthetic_run


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    return synthetic_run(tmp_path_factory.mktemp("csv"), "csvrun")


@pytest.fixture
def run(small_run, tmp_path) -> Path:
    return copy_run(small_run, tmp_path / "run")


def table(run: Path) -> list[dict]:
    return list(csv.DictReader(io.StringIO((run / "results.csv").read_text(encoding="utf-8"), newline="")))


def write_table(run: Path, rows: list[dict], forge: bool = True) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    (run / "results.csv").write_text(buf.getvalue(), encoding="utf-8")
    if forge:  # a consistent forger also records the new sha256
        m = json.loads((run / "manifest.json").read_text())
        m["files"]["results.csv"] = hashlib.sha256((run / "results.csv").read_bytes()).hexdigest()
        (run / "manifest.json").write_text(json.dumps(m, indent=1))


def test_one_row_per_result_with_every_number_and_nested_field(small_run):
    rows = json.loads((small_run / "results.json").read_text())["rows"]
    got = table(small_run)
    assert len(got) == len(rows) > 0
    manifest = json.loads((small_run / "manifest.json").read_text())
    assert manifest["files"]["results.csv"] == hashlib.sha256((small_run / "results.csv").read_bytes()).hexdigest()
    for r, c in zip(rows, got):
        assert (c["study"], c["case"], c["arm"]) == (r["study"], r["case"], r["arm"])
        assert float(c["rel_l2"]) == r["rel_l2"] and int(c["payload_bytes"]) == r["payload_bytes"]
        for name, path in r["arrays"].get("packed", {}).items():  # nested objects: dotted columns
            assert c[f"arrays.packed.{name}"] == path
        if isinstance(r.get("quant"), dict):
            assert c["quant.key.bits"] == str(r["quant"]["key"]["bits"])


def test_the_untouched_csv_passes(small_run):
    ok, failures, _ = audit(small_run, check_sources=False)
    assert ok, failures[:3]


def test_a_changed_cell_fails_naming_the_row(run):
    rows = table(run)
    i = next(i for i, r in enumerate(rows) if r["rel_l2"])
    rows[i]["rel_l2"] = repr(float(rows[i]["rel_l2"]) * (1 + 1e-9))
    write_table(run, rows)
    ok, failures, _ = audit(run, check_sources=False)
    assert not ok
    assert any(f.startswith(f"FAIL: results.csv row {i} ") and "rel_l2" in f for f in failures), failures


@pytest.mark.parametrize("edit", ["drop a row", "reorder two rows", "add a column", "blank a label"])
def test_other_forgeries_fail(run, edit):
    rows = table(run)
    if edit == "drop a row":
        rows = rows[:-1]
    elif edit == "reorder two rows":
        rows[0], rows[1] = rows[1], rows[0]
    elif edit == "add a column":
        for r in rows:
            r["note"] = "forged"
    else:
        rows[0]["case"] = ""
    write_table(run, rows)
    ok, failures, _ = audit(run, check_sources=False)
    assert not ok and any(f.startswith("FAIL: results.csv") for f in failures), failures


def test_a_naive_edit_fails_by_its_hash(run):
    rows = table(run)
    rows[0]["rel_l2"] = "0.5"
    write_table(run, rows, forge=False)
    ok, failures, _ = audit(run, check_sources=False)
    assert not ok and any("results.csv: sha256 differs" in f for f in failures)


def test_nan_and_nested_cells_round_trip():
    from testbed.audit import _cell_says, _leaves
    from testbed.tables import results_csv

    rows = [{"a": math.nan, "b": {"c": [1, 2.5], "d": None}, "e": True}, {"a": 1, "f": "x,y\n\"z\""}]
    parsed = list(csv.reader(io.StringIO(results_csv(rows).decode(), newline="")))
    header = parsed[0]
    assert header == ["a", "b.c", "b.d", "e", "f"]
    for row, cells in zip(rows, parsed[1:]):
        leaves = _leaves(row)
        assert all(_cell_says(cell, leaves.get(col)) for col, cell in zip(header, cells))
    assert not _cell_says("1", "1.0") and not _cell_says("true", 1) and not _cell_says("", 0)


def test_per_row_lists_are_left_out_of_the_table_and_a_forged_per_row_column_fails(run):
    """Per-query-row lists stay in results.json only (each is thousands of numbers in one cell);
    every other leaf keeps its column, and a per_row column put back with values is a forgery."""
    from testbed.audit import CSV_OMITTED
    from testbed.tables import OMITTED, results_csv

    assert set(OMITTED) == set(CSV_OMITTED)  # the run and the audit state the same rule
    rows = [{"a": 1, "per_row": {"tv": [0.1, 0.2]}, "b": {"c": 2}}]
    header = next(csv.reader(io.StringIO(results_csv(rows).decode(), newline="")))
    assert header == ["a", "b.c"]
    forged = table(run)
    for r in forged:
        r["per_row.tv"] = "[0.5]"
    write_table(run, forged)
    ok, failures, _ = audit(run, check_sources=False)
    assert not ok and any("per_row.tv" in f for f in failures), failures
