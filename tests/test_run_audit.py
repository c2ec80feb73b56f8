"""End to end: the default residual-window protocol runs, the audit passes it and catches tampering."""

import json
import shutil
from pathlib import Path

import pytest

from testbed.audit import audit
from testbed.run import main as run_main
from tests import _arrays
from tests._helpers import finished_run as run_once, forge_results, heavy_imports

REPO = Path(__file__).resolve().parent.parent
PROTOCOL = REPO / "protocols" / "residual_window.json"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    return run_once(tmp_path_factory, "residual_window.json", "rw")


def test_run_has_the_54_comparisons_and_the_extra_arms(finished_run):
    rows = json.loads((finished_run / "results.json").read_text())["rows"]
    residual = [r for r in rows if r["arm"].startswith("R=")]
    assert len(residual) == 54
    assert {r["residual"] for r in residual} == {0, 16, 64}
    assert {r["arm"] for r in rows} == {"float32", "R=0", "R=16", "R=64", "first16"}
    for r in rows:
        for key in ("study", "case", "distribution", "seed", "n", "residual", "scheme", "rel_l2", "cosine",
                    "payload_bytes", "baseline_bytes", "recent_mass", "arrays"):
            assert key in r
        assert r["baseline_bytes"] == 2 * r["n"] * 32 * 4


def test_recent_window_protects_recent_focus_only(finished_run):
    rows = json.loads((finished_run / "results.json").read_text())["rows"]

    def mean_err(dist, arm):
        sel = [r["rel_l2"] for r in rows if r["distribution"] == dist and r["arm"] == arm]
        return sum(sel) / len(sel)

    assert mean_err("recent_focus", "R=16") < 0.5 * mean_err("recent_focus", "R=0")
    assert mean_err("early_focus", "R=16") > 0.9 * mean_err("early_focus", "R=0")
    assert mean_err("early_focus", "first16") < 0.5 * mean_err("early_focus", "R=0")


def test_audit_passes_on_the_run(finished_run):
    ok, failures, summary = audit(finished_run)
    assert ok, failures
    assert summary.startswith("PASS")


def test_audit_fails_on_one_flipped_bit(finished_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    target = next(rel for rel in sorted(json.loads((copy / "manifest.json").read_text())["arrays"])
                  if rel.endswith("key.codes.npy"))
    data = bytearray(_arrays.read(copy, target))
    data[-1] ^= 0x10
    _arrays.write(copy, target, bytes(data))
    ok, failures, _ = audit(copy)
    assert not ok
    assert any(target in line for line in failures)


def test_audit_recomputes_numbers_even_when_hashes_are_forged(finished_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    res = json.loads((copy / "results.json").read_text())
    res["rows"][3]["rel_l2"] *= 0.5
    forge_results(copy, res)
    ok, failures, _ = audit(copy)
    assert not ok and any(f.startswith("FAIL: results.json row 3 ") and "rel_l2" in f for f in failures)


def test_payload_bytes_rederived_from_arrays(finished_run):
    rows = json.loads((finished_run / "results.json").read_text())["rows"]
    for r in rows:
        if r["arrays"]["packed"]:
            total = sum(_arrays.load(finished_run, p).nbytes for p in r["arrays"]["packed"].values())
            assert total == r["payload_bytes"]


def test_existing_out_refused_and_untouched(tmp_path, capsys):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(PROTOCOL)]) == 2
    assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 1
    assert "already exists" in capsys.readouterr().err


def test_audit_imports_neither_torch_nor_testbed_numerics(finished_run):
    assert heavy_imports("import testbed.audit as a; ok, f, s = a.audit(sys.argv[1])", finished_run) == ("True", [])


def test_archived_evidence_stays_under_20_mb():
    """evidence/ is kept under 20 MB both as bytes and as the blocks a checkout takes on disk
    (what ``du`` reports: every file costs at least one block, which is why arrays are packed one
    zip per case)."""
    files = [p for p in (REPO / "evidence").rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    blocks = sum(-(-p.stat().st_size // 4096) * 4096 for p in files)  # 4 KiB blocks, as on ext4 and most checkouts
    assert files and size < 20 * 10 ** 6 and blocks < 20 * 2 ** 20, (len(files), size, blocks)
