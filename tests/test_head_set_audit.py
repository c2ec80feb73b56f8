"""The audit re-derives the block-predictability fields of observation rows: frame x spatial tile
key blocks and each query against its head's leave-one-out block set, beside the nulls."""

from __future__ import annotations

import json

import pytest

from testbed.audit import audit

from ._helpers import copy_run, forge_results, run_main

FIELDS = ["head_set_jaccard", "head_set_jaccard_null", "head_set_mass", "head_set_mass_null", "head_set_size", "block"]


@pytest.fixture(scope="module")
def tiles_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiles")
    proto = {"name": "tiles", "source": {"kind": "synthetic_video", "seeds": [1, 2], "layouts": ["video", "llm"]},
             "analyses": {"observation": {"spatial_tiles": 2}}, "timing": {"repeats": 0}}
    (base / "p.json").write_text(json.dumps(proto))
    assert run_main(["--quiet", "--out", str(base / "run"), "--protocol", str(base / "p.json")]) == 0
    return base / "run"


def _rows(run):
    return json.loads((run / "results.json").read_text())


def test_tiles_run_passes_and_uses_half_frames(tiles_run):
    ok, fails, _ = audit(tiles_run, check_sources=False)
    assert ok, fails[:5]
    rows = [r for r in _rows(tiles_run)["rows"] if r["scope"] == "case"]
    video = [r for r in rows if r["distribution"] == "video"]
    assert video and all(r["block"] * 2 == r["frame"] and r["spatial_tiles"] == 2 for r in video)
    # a head's set from its other queries predicts them better than a random set of as many blocks
    assert all(r["head_set_mass"] > r["head_set_mass_null"] for r in rows)


@pytest.mark.parametrize("scope", ["case", "head"])
@pytest.mark.parametrize("field", FIELDS)
def test_a_forged_head_set_field_fails(tiles_run, tmp_path, field, scope):
    run = copy_run(tiles_run, tmp_path / "r")
    res = _rows(run)
    i, row = next((i, r) for i, r in enumerate(res["rows"]) if r["scope"] == scope and r["distribution"] == "video")
    row[field] = row[field] + 1 if field == "block" else row[field] * 1.01 + 1e-3
    forge_results(run, res)
    ok, fails, _ = audit(run, check_sources=False)
    assert not ok and any(f"row {i} " in f and field in f for f in fails), fails[:5]
