"""The analysis contract: every registered analysis runs on a synthetic case, a video case and a
case read back from a trace file; the audit passes each run, and a consistently forged number of
each analysis's rows fails it, naming the row.

A new analysis joins by being registered (``testbed.analyses.ANALYSES``) and having an entry in
``PARAMS`` and ``FORGE`` below: the test refuses an analysis it has no entry for.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.analyses import ANALYSES
from testbed.audit import audit
from testbed.sources.traces import save_trace
from testbed.sources.video import make_llm_case, make_video_case

from ._helpers import copy_run, forge_results, run_main

pytestmark = pytest.mark.slow  # a run of every analysis on three sources

# the smallest parameters that exercise each analysis
PARAMS = {
    "observation": {"block_tokens": 8, "spatial_tiles": 2},
    "ablation": {"ablations": ["none", "drop_sink", "control_sink", "mass_control_sink", "drop_recent", "drop_history"]},
    "mx_paths": {},
    "residual_window": {"bits": 4, "group_size": 16, "residuals": [0, 8], "early_window": 4, "recent_mass_window": 8},
    "selective": {"random_draws": 2, "budget": 0.5},
}
# per analysis: which rows to forge (a predicate) and a field the audit re-derives
FORGE = {
    "observation": (lambda r: r.get("scope") == "case", "support_mean"),
    "ablation": (lambda r: r.get("ablation") == "drop_sink" and r.get("arm") == "float32", "tv"),
    "mx_paths": (lambda r: r.get("path") == "qk", "tv_mean"),
    "residual_window": (lambda r: r.get("arm") == "R=8", "rel_l2"),
    "selective": (lambda r: r.get("arm") == "reversed", "rel_l2"),
}
SOURCES = {
    "synthetic": {"kind": "synthetic", "seeds": [1], "lengths": [64], "distributions": ["clean", "early_focus"],
                  "head_dim": 16, "queries": 8, "heads": 2, "kv_heads": 1, "focus_tokens": 8},
    "video": {"kind": "synthetic_video", "seeds": [1], "layouts": ["video", "llm"], "head_dim": 16},
    "trace": {"kind": "trace", "files": ["cases.safetensors"]},
}


def test_every_registered_analysis_has_a_contract_entry():
    assert set(ANALYSES) == set(PARAMS) == set(FORGE)


def _protocol(base: Path, source: str, analysis: str) -> Path:
    if source == "trace":
        save_trace(base / "cases.safetensors", [make_video_case(2), make_llm_case(2)])
    proto = {"name": f"contract_{analysis}_{source}", "source": SOURCES[source],
             "analyses": {analysis: PARAMS[analysis]}, "timing": {"repeats": 0}}
    path = base / "p.json"
    path.write_text(json.dumps(proto))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for analysis in ANALYSES:
        for source in SOURCES:
            base = tmp_path_factory.mktemp(f"{analysis}-{source}")
            proto = _protocol(base, source, analysis)
            assert run_main(["--quiet", "--out", str(base / "run"), "--protocol", str(proto)]) == 0, (analysis, source)
            out[(analysis, source)] = base / "run"
    return out


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("analysis", sorted(PARAMS))
def test_analysis_runs_and_its_audit_passes(runs, analysis, source):
    run = runs[(analysis, source)]
    rows = json.loads((run / "results.json").read_text())["rows"]
    assert rows and {r["analysis"] for r in rows} == {analysis}
    ok, fails, _ = audit(run, check_sources=False)
    assert ok, fails[:5]


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("analysis", sorted(PARAMS))
def test_a_forged_number_fails_the_audit(runs, analysis, source, tmp_path):
    run = copy_run(runs[(analysis, source)], tmp_path / "r")
    res = json.loads((run / "results.json").read_text())
    pick, field = FORGE[analysis]
    i = next(i for i, r in enumerate(res["rows"]) if pick(r) and isinstance(r.get(field), float))
    res["rows"][i][field] = res["rows"][i][field] * 1.5 + 0.01
    forge_results(run, res)
    ok, fails, _ = audit(run, check_sources=False)
    assert not ok and any(f"row {i} " in f and field in f for f in fails), fails[:5]
