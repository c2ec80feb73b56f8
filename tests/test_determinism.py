"""Determinism: the same protocol on the same machine gives the same bytes.

Two runs of the default protocol -- in separate processes, with different hash seeds and different
thread settings in the environment -- must record identical array hashes and a byte-identical
results.json (timings, created_utc, wall time and report.md aside). The run pins torch to one
intra-op thread and to deterministic algorithms, so the cores of the machine do not matter; what
still varies across CPUs (SIMD level, BLAS build) is listed in docs/reliability.md.

Because a run is deterministic, a re-run is also the check against the one forgery the audit
cannot see: a run whose inputs were replaced and every array and number re-computed from them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from testbed import audit as audit_mod
from testbed.run import main as run_main
from tests import _arrays

pytestmark = pytest.mark.slow  # full runs in subprocesses

REPO = Path(__file__).resolve().parent.parent
PROTOCOL = REPO / "protocols" / "residual_window.json"


def run_subprocess(out: Path, **env) -> None:
    full = dict(os.environ, **env)
    r = subprocess.run([sys.executable, "-m", "testbed.run", "--quiet", "--out", str(out), "--protocol", str(PROTOCOL)],
                       cwd=REPO, env=full, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("det")
    a, b = base / "a", base / "b"
    run_subprocess(a, PYTHONHASHSEED="1", OMP_NUM_THREADS="1")
    run_subprocess(b, PYTHONHASHSEED="2", OMP_NUM_THREADS="2", MKL_NUM_THREADS="2")
    return a, b


def test_two_processes_give_identical_bytes(two_runs, reliability):
    a, b = two_runs
    diff = audit_mod.compare(a, b)
    ma, mb = (json.loads((r / "manifest.json").read_text()) for r in (a, b))
    reliability("determinism", "default protocol run twice (other process, hash seed, OMP/MKL threads)",
                "identical array hashes and results.json", f"{len(ma['arrays'])} arrays, {len(diff)} differences")
    assert diff == []
    assert ma["arrays"] == mb["arrays"]
    assert (a / "results.json").read_bytes() == (b / "results.json").read_bytes()
    for rel in ma["arrays"]:
        assert _arrays.read(a, rel) == _arrays.read(b, rel), rel
    containers = sorted(p.relative_to(a).as_posix() for p in (a / "arrays").rglob("*.npz"))
    assert containers and containers == sorted(p.relative_to(b).as_posix() for p in (b / "arrays").rglob("*.npz"))
    for rel in containers:  # fixed member dates and order: the zips themselves are byte-identical on one machine
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    # and what is allowed to differ is only descriptive
    # (sources too: other work may edit the checkout between the two runs)
    same_keys = set(ma) - {"created_utc", "wall_seconds", "environment", "files", "memory_guard", "sources"}
    assert {k: ma[k] for k in same_keys} == {k: mb[k] for k in same_keys}


def test_run_records_its_pinning(two_runs, reliability):
    env = json.loads((two_runs[1] / "manifest.json").read_text())["environment"]
    reliability("determinism", "pinning recorded in the manifest", "torch_threads 1, deterministic algorithms on",
                f"torch_threads {env['torch_threads']}, deterministic {env['torch_deterministic_algorithms']}, "
                f"capability {env['torch_cpu_capability']}")
    assert env["torch_threads"] == 1
    assert env["torch_deterministic_algorithms"] is True
    assert env["thread_env"].get("OMP_NUM_THREADS") == "2"  # the environment asked for 2; the run pinned 1


def test_same_as_cli(two_runs, tmp_path, capsys, reliability):
    a, b = two_runs
    assert audit_mod.main([str(a), "--no-sources", "--same-as", str(b)]) == 0
    assert "identical array, result and protocol hashes" in capsys.readouterr().out
    assert audit_mod.main([str(a), "--no-sources", "--same-as", str(tmp_path / "missing")]) == 2


def test_in_process_run_is_restored_and_matches(two_runs, tmp_path, reliability):
    """run_protocols pins torch only for the run: the caller's settings come back afterwards."""
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    out = tmp_path / "c"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(PROTOCOL)]) == 0
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == before
    diff = audit_mod.compare(out, two_runs[0])
    reliability("determinism", "third run in the test process itself", "identical array hashes", f"{len(diff)} differences")
    assert diff == []


def test_consistent_refabrication_passes_audit_but_not_a_rerun(two_runs, tmp_path, monkeypatch, reliability):
    """Replace the inputs of one case in memory and let the run re-compute everything from them: the
    source files are untouched, so even the source hashes agree. The audit cannot tell; --same-as can."""
    from testbed.sources import synthetic

    real = synthetic.base_arrays

    def forged(seed, n, *args, **kw):
        q, k, v = real(seed, n, *args, **kw)
        if seed == 19 and n == 128:
            k = k * 1.5
        return q, k, v

    monkeypatch.setattr(synthetic, "base_arrays", forged)
    out = tmp_path / "forged"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(PROTOCOL)]) == 0
    ok, failures, _ = audit_mod.audit(out, check_sources=False)
    diff = audit_mod.compare(out, two_runs[0])
    reliability("gap", "inputs of 3 cases replaced in memory and every array and number re-computed from them "
                "(source files untouched)", "not caught by the audit (a consistent run); a re-run with --same-as catches it",
                f"audit {'PASS' if ok else 'FAIL'}")
    reliability("determinism", "re-fabricated run compared with a re-run (audit --same-as)",
                "FAIL naming the replaced arrays", diff[0] if diff else "no difference")
    assert ok, failures[:3]
    assert diff and all("-s19-n128/" in line or line.startswith(("FAIL: results.json", "FAIL: results.csv")) for line in diff)
    assert any("/k.npy" in line for line in diff)
