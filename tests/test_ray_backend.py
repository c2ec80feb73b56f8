"""--backend ray: every unit of a protocol is a Ray task and the run folder is a serial run's.

Each test starts a local Ray (a few seconds) with 2 CPUs, as CI has."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.run import main as run_main

from ._helpers import default_sigint, synthetic_protocol

pytest.importorskip("ray", reason="the Ray backend needs Ray: pip install -e '.[ray]'")

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _run(out: Path, protocols: list[Path], *extra: str) -> int:
    args = ["--quiet", "--out", str(out)] + [a for p in protocols for a in ("--protocol", str(p))] + list(extra)
    return run_main(args)


def _assert_same_run(a: Path, b: Path) -> None:
    """Every array (path, sha256, nbytes, dtype, shape), results.json byte for byte, and every other
    file but the wall times (timings.json) and the report that prints them."""
    ma, mb = (json.loads((x / "manifest.json").read_text()) for x in (a, b))
    assert ma["arrays"] == mb["arrays"]
    assert (a / "results.json").read_bytes() == (b / "results.json").read_bytes()
    skip = {"timings.json", "report.md", "report.html"}
    assert {k: v for k, v in ma["files"].items() if k not in skip} == {k: v for k, v in mb["files"].items() if k not in skip}
    assert ma["gates"] == mb["gates"] and ma["excluded"] == mb["excluded"]
    assert [p["name"] for p in ma["protocols"]] == [p["name"] for p in mb["protocols"]]


def _write(tmp_path: Path, proto: dict) -> Path:
    path = tmp_path / f"{proto['name']}.json"
    path.write_text(json.dumps(proto))
    return path


def test_ray_run_equals_serial_and_jobs_runs(tmp_path):
    """Synthetic studies of both sources (one unit per case): serial, --jobs 2 and Ray give one run."""
    protocols = [REPO / "protocols" / "residual_window.json", REPO / "protocols" / "ablation.json"]
    assert _run(tmp_path / "serial", protocols) == 0
    assert _run(tmp_path / "jobs", protocols, "--jobs", "2") == 0
    assert _run(tmp_path / "ray", protocols, "--backend", "ray", "--jobs", "2") == 0
    _assert_same_run(tmp_path / "serial", tmp_path / "jobs")
    _assert_same_run(tmp_path / "serial", tmp_path / "ray")
    rows = json.loads((tmp_path / "ray" / "results.json").read_text())["rows"]
    assert len({r["case"] for r in rows}) > 10  # many units, merged back in the serial order


def _model_or_skip():
    from testbed.sources import models

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}; install with: {models.INSTALL_HINT}")
    return models


@pytest.mark.capture
def test_ray_run_of_a_capture_and_a_live_study_equals_serial(tmp_path):
    """A capture (one unit per prompt, their manifests merged) and the live study (one unit per arm
    of a batch, every arm taking its batch's reference from the reference's task, and the oracle
    arms the batch's one float32 oracle pass with it)."""
    models = _model_or_skip()
    prose = ("The lighthouse keeper wrote the weather in a green ledger every evening, and on the night of the "
             "storm she wrote only one word before the lamp went out. ") * 12
    cap = {"name": "cap", "timing": {"repeats": 0},
           "source": {"kind": "capture", "model": models.MODEL_ID, "tokens": 64, "chunk": 32, "sink_tokens": 4,
                      "recent_tokens": 16, "layers": [0, 9], "queries": 8, "record_chunks": [-1],
                      "prompts": [{"id": "prose", "kind": "narrative prose", "text": prose},
                                  {"id": "digits", "kind": "repetitive list",
                                   "text": " ".join(str(i) for i in range(200))},
                                  {"id": "short", "kind": "too short", "text": "Too short."}]},
           "analyses": {"observation": {"block_tokens": 16}}}
    live = json.loads((REPO / "protocols" / "smollm2_quality.json").read_text())
    live["name"], live["default"] = "live_small", False
    live["live"].update({"segments": 3, "prefill": 32, "steps": 24, "batch": 2, "window": 16, "group": 8,
                         "evict_window": 16, "policies": ["int4", "int2_sink4", "streaming", "mix24_oracle_diffuse",
                                                          "int2_hh_oracle"], "peers": []})
    protocols = [_write(tmp_path, cap), _write(tmp_path, live)]
    assert _run(tmp_path / "serial", protocols) == 0
    assert _run(tmp_path / "ray", protocols, "--backend", "ray", "--jobs", "2") == 0
    _assert_same_run(tmp_path / "serial", tmp_path / "ray")
    m = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert [e["id"] for e in m["excluded"]] == ["cap/short"]  # the short prompt, once
    cm = json.loads((tmp_path / "ray" / "cap" / "capture_manifest.json").read_text())
    assert [r["id"] for r in cm["runs"]] == ["prose", "digits"]
    rows = json.loads((tmp_path / "ray" / "results.json").read_text())["rows"]
    live_rows = [r for r in rows if r["study"] == "live_small"]
    assert len(live_rows) == 3 * 6 and {r["case"] for r in live_rows} == {"seg000", "seg001", "seg002"}
    timings = json.loads((tmp_path / "ray" / "timings.json").read_text())
    # two batches (2 + 1 segments): one oracle pass each, serving both oracle arms
    assert sorted((t["case"], len(t["arms"])) for t in timings if t["op"] == "oracle") == [("batch0", 2), ("batch1", 2)]
    assert subprocess.run([sys.executable, "-m", "testbed.audit", str(tmp_path / "ray")], capture_output=True,
                          cwd=REPO).returncode == 0


def test_a_task_whose_worker_dies_is_retried(tmp_path, monkeypatch):
    proto = _write(tmp_path, synthetic_protocol("retry", seeds=[1, 2, 3]))
    assert _run(tmp_path / "serial", [proto]) == 0
    monkeypatch.setenv("TESTBED_RAY_FAULT", "1")  # the first attempt at unit 1 kills its worker
    monkeypatch.setenv("TESTBED_RAY_FAULT_DIR", str(tmp_path))
    assert _run(tmp_path / "ray", [proto], "--backend", "ray", "--jobs", "2") == 0
    assert (tmp_path / "fault-1").exists()  # the fault did happen; the retry made the run whole
    _assert_same_run(tmp_path / "serial", tmp_path / "ray")


def test_a_task_that_always_fails_writes_nothing(tmp_path, monkeypatch, capsys):
    proto = _write(tmp_path, synthetic_protocol("doomed", seeds=[1, 2]))
    monkeypatch.setenv("TESTBED_RAY_FAULT", "0:always")
    monkeypatch.setenv("TESTBED_RAY_FAULT_DIR", str(tmp_path))
    assert _run(tmp_path / "ray", [proto], "--backend", "ray", "--jobs", "2") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: doomed case 1/2 failed after 2 retries") and "nothing was written" in err[-1]
    assert not (tmp_path / "ray").exists() and not list(tmp_path.glob(".ray.partial-*"))


def test_a_protocol_error_inside_a_task_is_one_line_and_exit_2(tmp_path, capsys):
    # Passes the schema, cannot make a Case: raised inside the worker, reported as a serial run does.
    proto = _write(tmp_path, synthetic_protocol("bad", seeds=[1, 2], lengths=[64], focus_tokens=40))
    assert _run(tmp_path / "serial", [proto]) == 2
    serial_err = capsys.readouterr().err.strip().splitlines()[-1]
    assert _run(tmp_path / "ray", [proto], "--backend", "ray") == 2
    ray_err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "cannot build case 1/2 from source parameters" in serial_err and ray_err == serial_err
    assert not (tmp_path / "ray").exists()


def test_address_needs_the_ray_backend(tmp_path, capsys):
    assert run_main(["--out", str(tmp_path / "x"), "--address", "auto"]) == 2
    assert "--address needs --backend ray" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_ctrl_c_cancels_the_tasks_and_writes_nothing(tmp_path):
    proto = _write(tmp_path, synthetic_protocol("long", seeds=list(range(1, 41)), lengths=[512]))
    out = tmp_path / "ray"
    proc = subprocess.Popen([sys.executable, "-m", "testbed.run", "--out", str(out), "--protocol", str(proto),
                             "--backend", "ray", "--jobs", "2"], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=default_sigint)
    lines = []
    deadline = time.monotonic() + 120
    for line in proc.stderr:  # wait until tasks are finishing: Ray is up and the run is under way
        lines.append(line)
        if line.startswith("[ray] unit ") or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(lines) + rest
    assert "interrupted: nothing was written" in rest and "Traceback" not in rest
    assert not out.exists() and not list(tmp_path.glob(".ray.partial-*"))


def test_ray_run_of_a_retrieval_study_equals_serial(tmp_path):
    """The retrieval study on Ray: every arm's task takes its batch's shared prefill from the
    reference's task (the reference's output is a tuple, as every unit's; a bare object failed
    there), and the run is the serial run's."""
    _model_or_skip()
    proto = json.loads((REPO / "protocols" / "retrieval_small.json").read_text())
    proto["name"], proto["default"] = "retrieval_ray", False
    proto["retrieval"].update({"lengths": [256], "depths": [0.0, 1.0], "trials": 1, "policies": ["int4", "streaming"]})
    protocols = [_write(tmp_path, proto)]
    assert _run(tmp_path / "serial", protocols) == 0
    assert _run(tmp_path / "ray", protocols, "--backend", "ray", "--jobs", "2") == 0
    _assert_same_run(tmp_path / "serial", tmp_path / "ray")
    rows = json.loads((tmp_path / "ray" / "results.json").read_text())["rows"]
    assert {r["arm"] for r in rows} == {"dynamic_cache", "int4", "streaming"} and len(rows) == 2 * 3
