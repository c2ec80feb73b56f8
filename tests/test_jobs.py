"""--jobs N runs protocols in worker processes with results identical to a serial run."""

import json
from pathlib import Path

import pytest

from testbed.run import main as run_main

REPO = Path(__file__).resolve().parent.parent
PROTOCOLS = [REPO / "protocols" / "residual_window.json", REPO / "protocols" / "ablation.json"]


def _run(out: Path, *extra: str) -> dict:
    args = ["--quiet", "--out", str(out)] + [a for p in PROTOCOLS for a in ("--protocol", str(p))] + list(extra)
    assert run_main(args) == 0
    return json.loads((out / "manifest.json").read_text())


@pytest.mark.slow
def test_parallel_run_equals_serial_run(tmp_path):
    serial = _run(tmp_path / "serial")
    parallel = _run(tmp_path / "parallel", "--jobs", "2")
    assert serial["arrays"] == parallel["arrays"]  # every array: same path, sha256, nbytes, dtype, shape
    assert [p["name"] for p in parallel["protocols"]] == ["residual_window", "ablation"]  # protocol order kept
    # results.json byte for byte (report.md differs only in its creation time line)
    assert (tmp_path / "serial" / "results.json").read_bytes() == (tmp_path / "parallel" / "results.json").read_bytes()


def test_bad_jobs_refused(tmp_path, capsys):
    assert run_main(["--quiet", "--out", str(tmp_path / "x"), "--jobs", "0"]) == 2
    assert "--jobs" in capsys.readouterr().err and not (tmp_path / "x").exists()
