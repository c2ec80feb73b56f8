"""testbed.compare: two runs compared numerically within the cross-machine tolerances."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from testbed.compare import TOLERANCES, main as compare_main
from tests._helpers import REPO, copy_run, heavy_imports, synthetic_run


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    return synthetic_run(tmp_path_factory.mktemp("cmp"), "cmp", distributions=["clean", "recent_focus"])


@pytest.fixture
def copy(small_run, tmp_path) -> Path:
    return copy_run(small_run, tmp_path / "b")


def run_compare(a, b, capsys) -> tuple[int, list[str]]:
    code = compare_main([str(a), str(b)])
    return code, capsys.readouterr().out.splitlines()


def edit_rows(run: Path, fn) -> None:
    res = json.loads((run / "results.json").read_text())
    fn(res["rows"])
    (run / "results.json").write_text(json.dumps(res))


def first_row(rows, field="rel_l2"):
    """The first row whose ``field`` is well above the absolute tolerance (so rtol decides)."""
    return next(r for r in rows if isinstance(r.get(field), float) and abs(r[field]) > 1e-3)


def test_a_run_compared_with_itself_passes_with_zero_difference(small_run, capsys):
    code, out = run_compare(small_run, small_run, capsys)
    assert code == 0
    assert out[0] == "no differences: every compared array and number is identical"
    assert out[-1].startswith("PASS: ")


def test_a_number_changed_beyond_the_tolerance_fails_naming_it(small_run, copy, capsys):
    rows = json.loads((copy / "results.json").read_text())["rows"]
    target = first_row(rows)
    def beyond(rows):
        row = first_row(rows)
        row["rel_l2"] *= 1 + 100 * TOLERANCES["float"]["rtol"]

    edit_rows(copy, beyond)
    code, out = run_compare(small_run, copy, capsys)
    assert code == 1
    fails = [line for line in out if line.startswith("FAIL: ")]
    assert len(fails) == 1 and "rel_l2" in fails[0] and f"case={target['case']}" in fails[0] \
        and f"arm={target['arm']}" in fails[0], out


def test_a_tiny_change_passes_but_is_shown(small_run, copy, capsys):
    def tiny(rows):
        row = first_row(rows, "cosine")
        row["cosine"] *= 1 - 1e-12

    edit_rows(copy, tiny)
    code, out = run_compare(small_run, copy, capsys)
    assert code == 0, out
    table = [line for line in out if line.startswith("  ")]
    assert any("cosine" in line for line in table[1:]), out  # after the table's header
    assert out[-1].startswith("PASS: ")


def test_a_missing_row_fails(small_run, copy, capsys):
    rows = json.loads((copy / "results.json").read_text())["rows"]
    gone = rows[-1]
    edit_rows(copy, lambda rs: rs.pop())
    code, out = run_compare(small_run, copy, capsys)
    assert code == 1
    fails = [line for line in out if line.startswith("FAIL: ")]
    assert len(fails) == 1 and "only in" in fails[0] and f"case={gone['case']}" in fails[0] and str(small_run) in fails[0]


def test_rows_are_matched_by_identity_not_position(small_run, copy, capsys):
    edit_rows(copy, lambda rs: rs.reverse())
    code, out = run_compare(small_run, copy, capsys)
    assert code == 0 and out[0].startswith("no differences"), out


def _array(run: Path, kind: str) -> str:
    m = json.loads((run / "manifest.json").read_text())
    return next(rel for rel, e in sorted(m["arrays"].items())
                if np.dtype(e["dtype"]).kind == kind and "query_positions" not in rel and "header" not in rel
                and e["shape"] and np.prod(e["shape"]) > 8)


def test_array_differences(small_run, copy, capsys):
    f = _array(copy, "f")
    x = np.load(copy / f)
    x.flat[3] = x.flat[3] * 1.01 + 1e-3  # beyond the float tolerance
    np.save(copy / f, x)
    c = _array(copy, "u") if any(np.dtype(e["dtype"]).kind == "u" for e in
                                 json.loads((copy / "manifest.json").read_text())["arrays"].values()) else _array(copy, "i")
    y = np.load(copy / c)
    y.flat[0] = y.flat[0] ^ 1
    np.save(copy / c, y)
    code, out = run_compare(small_run, copy, capsys)
    assert code == 1
    fails = [line for line in out if line.startswith("FAIL: ")]
    assert any(line.startswith(f"FAIL: {f}: differs by") for line in fails), fails
    assert any(line.startswith(f"FAIL: {c}: 1 of ") for line in fails), fails


def test_a_missing_array_fails(small_run, copy, capsys):
    m = json.loads((copy / "manifest.json").read_text())
    rel = sorted(m["arrays"])[0]
    del m["arrays"][rel]
    (copy / rel).unlink()
    (copy / "manifest.json").write_text(json.dumps(m))
    code, out = run_compare(small_run, copy, capsys)
    assert code == 1 and f"FAIL: {rel}: array only in {small_run}" in out


def test_bad_input_exits_2(small_run, tmp_path):
    (tmp_path / "empty").mkdir()
    for other in (tmp_path / "nope", tmp_path / "empty"):
        r = subprocess.run([sys.executable, "-m", "testbed.compare", str(small_run), str(other)], cwd=REPO,
                           capture_output=True, text=True)
        assert r.returncode == 2 and r.stdout == ""
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: "), r.stderr


def test_compare_imports_neither_torch_nor_testbed_numerics(small_run):
    call = "import testbed.compare as c; ok, _, _ = c.compare_runs(sys.argv[1], sys.argv[1])"
    assert heavy_imports(call, small_run) == ("True", [])
