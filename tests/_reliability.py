"""Recording what the reliability suites try, for the generated "Reliability" table.

Each test of tests/test_tamper.py, test_run_cli.py, test_determinism.py, test_fuzz_inputs.py and
test_resource_guard.py takes the ``reliability`` fixture (offered to every test module by
tests/conftest.py) and calls it once per thing it tries::

    reliability("tamper", "flip one bit in arrays/.../q.npy", expect="audit FAIL naming the file",
                observed=first_fail_line)

When ``TESTBED_RELIABILITY_DIR`` is set (tools/reliability_table.py sets it) the records are appended
as JSON lines to ``$TESTBED_RELIABILITY_DIR/records-<pid>.jsonl``; otherwise nothing is written.
Whether the test passed is not recorded here: the table tool reads it from pytest's JUnit XML, so a
failing assertion can never be reported as a success.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ENV = "TESTBED_RELIABILITY_DIR"

__all__ = ["reliability", "ENV"]


class Recorder:
    def __init__(self, nodeid: str):
        self.nodeid = nodeid
        self.entries: list[dict] = []

    def __call__(self, category: str, case: str, expect: str, observed: str = "") -> None:
        # A hypothesis test calls this once per example: one record per (category, case) is kept.
        if any(e["category"] == category and e["case"] == case for e in self.entries):
            return
        self.entries.append({"nodeid": self.nodeid, "category": category, "case": case, "expect": expect,
                             "observed": str(observed)[:300]})

    def flush(self) -> None:
        folder = os.environ.get(ENV)
        if not folder or not self.entries:
            return
        path = Path(folder) / f"records-{os.getpid()}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            for e in self.entries:
                f.write(json.dumps(e) + "\n")


@pytest.fixture
def reliability(request):
    rec = Recorder(request.node.nodeid)
    yield rec
    rec.flush()


def record_audit_verdicts(reliability, request, monkeypatch, category: str):
    """For a suite that calls ``audit`` itself (imported into its module): record each test's last
    audit verdict — a control that PASSED under category ``tamper``, a forgery under ``category``
    with its first FAIL line — as a generator fixture body (``yield from`` it). Whether the test
    passed comes from pytest, as for every record."""
    mod = request.module
    seen = []
    real = mod.audit

    def wrapped(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(mod, "audit", wrapped)
    yield
    if not seen:
        return
    ok, fails, summary = seen[-1]
    case = request.node.name.removeprefix("test_").replace("_", " ")
    if ok:
        reliability("tamper", f"{case} (control)", "audit PASS", summary)
    else:
        reliability(category, case, "audit FAIL naming what is wrong", fails[0])
