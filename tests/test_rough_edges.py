"""Rough edges of the command lines (issue #15 part 6): each failed before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.audit import audit
from testbed.protocol import PROTOCOL_DIR, estimate_protocol, load_protocol
from testbed.run import main as run_main
from tests import _arrays
from tests._helpers import REPO, copy_run, synthetic_run

EXAMPLE = REPO / "examples" / "capture_any_model.py"


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    return synthetic_run(tmp_path_factory.mktemp("edges"), "edges", distributions=["clean", "early_focus"])


@pytest.fixture
def run_copy(small_run, tmp_path) -> Path:
    return copy_run(small_run, tmp_path / "run")


def _used_array(run: Path) -> str:
    """An array that result rows (not only a case) depend on."""
    rows = json.loads((run / "results.json").read_text())["rows"]
    packed = [r for r in rows if r["arrays"].get("packed")]
    return next(iter(packed[0]["arrays"]["packed"].values()))


# -- the audit: each cause once ---------------------------------------------------------------

def test_a_missing_array_is_reported_once_and_its_rows_in_one_line(run_copy):
    rel = _used_array(run_copy)
    _arrays.delete(run_copy, rel)
    ok, failures, _ = audit(run_copy, check_sources=False)
    assert not ok
    naming = [f for f in failures if f.startswith(f"FAIL: {rel}:")]
    assert len(naming) == 1, failures
    # the rows that could not be re-derived are one summary line, which names the cause
    rest = [f for f in failures if f not in naming]
    assert len(rest) == 1 and "row(s) not re-derived" in rest[0] and rel in rest[0], failures


def test_a_flipped_byte_is_one_cause_and_one_summary(run_copy):
    rel = _used_array(run_copy)
    data = bytearray(_arrays.read(run_copy, rel))
    data[-1] ^= 0x01
    _arrays.write(run_copy, rel, bytes(data))
    ok, failures, _ = audit(run_copy, check_sources=False)
    assert not ok
    assert failures[0] == f"FAIL: {rel}: sha256 differs from the manifest"
    assert len(failures) == 2 and "not in the manifest" not in failures[1], failures


def test_audit_into_a_closed_pipe_ends_silently(run_copy):
    # thousands of FAIL lines (files the manifest does not name): more than a pipe buffer holds
    for i in range(3000):
        (run_copy / f"extra_file_number_{i:05d}_added_after_the_run.txt").write_text("x")
    proc = subprocess.Popen([sys.executable, "-m", "testbed.audit", "--quiet", "--no-sources", str(run_copy)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # what `| head -1` does
    err = proc.stderr.read().decode()
    proc.wait(timeout=300)
    assert first.startswith(b"FAIL: ")
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode != 0


# -- the run ----------------------------------------------------------------------------------

def test_ctrl_c_during_the_imports_is_one_line_and_exit_130(tmp_path):
    """SIGINT delivered exactly while ``python -m testbed.run`` imports torch (an import hook sends it)."""
    code = (
        "import importlib.abc, os, runpy, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # even under a parent that ignores SIGINT\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "class Hook(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'torch':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Hook())\n"
        "sys.argv = ['testbed.run', '--out', sys.argv[1]]\n"
        "runpy.run_module('testbed.run', run_name='__main__', alter_sys=True)\n")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 130, r.stderr
    assert r.stderr.splitlines() == ["interrupted: nothing was written"], r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_every_protocol_has_a_memory_estimate():
    """No protocol of the repository makes the run say "memory guard skipped"."""
    for path in sorted(PROTOCOL_DIR.glob("*.json")):
        proto, _ = load_protocol(path)
        est = estimate_protocol(proto)
        assert isinstance(est, int) and est > 0, path.name


def test_the_ablation_estimate_covers_its_largest_case_and_the_note_is_gone(tmp_path, capsys):
    from testbed.resources import OVERHEAD
    from testbed.sources import video

    proto = json.loads((PROTOCOL_DIR / "ablation.json").read_text())
    proto["source"].update(seeds=[1], chunks=[3, 5])
    proto["default"] = False
    params = video.validate(proto["source"], "source")
    biggest = max(sum(getattr(c, n).numel() * getattr(c, n).element_size() for n in ("q", "k", "v"))
                  for c in video.cases(params))
    assert video.estimate_bytes(params) > OVERHEAD + biggest
    path = tmp_path / "ablation_small.json"
    path.write_text(json.dumps(proto))
    assert run_main(["--out", str(tmp_path / "run"), "--protocol", str(path)]) == 0
    err = capsys.readouterr().err
    assert "[ablation] case 1/3" in err  # progress with the number of cases
    assert "memory guard skipped" not in err


# -- traces -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_trace_files_follow_the_umask(tmp_path, mask, mode):
    from testbed.sources.synthetic import make_case
    from testbed.sources.traces import save_trace

    old = os.umask(mask)
    try:
        path = save_trace(tmp_path / "t.safetensors", [make_case("clean", 1, 64, 16, 4)])
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode


# -- examples/capture_any_model.py ---------------------------------------------------------------

def test_example_missing_model_folder_is_one_line_exit_2(tmp_path):
    out = tmp_path / "t.safetensors"
    r = subprocess.run([sys.executable, str(EXAMPLE), "--model", str(tmp_path / "no_such_model"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no_such_model" in lines[0] and lines[0].startswith("error: "), r.stderr
    assert not out.exists()


@pytest.mark.capture
def test_example_refuses_a_layer_the_model_does_not_have(tmp_path, capsys):
    import importlib.util

    from testbed.sources import models

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}")
    spec = importlib.util.spec_from_file_location("capture_any_model", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "t.safetensors"
    assert mod.main(["--out", str(out), "--layers", "0", "30", "--tokens", "64", "--chunk", "32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--layers 30" in err[0] and "0..29" in err[0], err
    assert not out.exists()
