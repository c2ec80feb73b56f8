"""A policy as a selection and a storage, and policies declared by their fields in a protocol.

- every preset is the composition of its selection and storage (taken apart and put together again,
  it is the same policy);
- a declaration that states a preset's fields builds that preset's policy (the declared form and the
  presets describe the same space);
- the audit's own mapping of a declaration (``audit_checks.live_policies.declared_policy``) agrees
  with the run side's on every field the rows carry;
- bad declarations are refused at protocol time, naming the field;
- end to end: a live study with declared policies (K grouped by 8 where the protocol says 16, a
  StreamingLLM of its own sink and window) runs, passes the audit, and a consistent forgery of a
  declared arm's bytes or of its frozen declaration fails.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from testbed.audit import audit
from testbed.audit_checks.live_policies import declared_policy
from testbed.policies import PRESETS, preset
from testbed.policies.compose import Selection, Storage, compose, declared, decompose, policies_from
from testbed.protocol import ProtocolError
from tests import _arrays

REPO = Path(__file__).resolve().parent.parent
LIVE = {"window": 16, "group": 16, "evict_window": 24, "sink": 4}


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_is_a_selection_and_a_storage(name):
    p = preset(name, window=48, group=16, evict_window=64, sink=2)
    sel, sto = decompose(p)
    assert compose(p.name, sel, sto, p.description) == p
    assert (sel.kind == "sink_window") == p.evicts  # eviction is a selection, never a storage scheme
    assert sto.middle != "drop"


# declarations by fields that state a preset's policy, at the protocol values of LIVE
AS_PRESET = {
    "int4": {"storage": {"middle": "int4"}},
    "int2_sink4": {"selection": {"sink": 4}, "storage": {"middle": "int2"}},
    "int2_sinkmass4": {"selection": {"sink": 4, "sink_select": "mass"}, "storage": {"middle": "int2"}},
    "int2_ktoken": {"storage": {"middle": "int2", "key_axis": "token"}},
    "mxfp4": {"storage": {"middle": "mxfp4"}},
    "streaming": {"selection": {"kind": "sink_window", "sink": 4}},
    "window_only": {"selection": {"kind": "sink_window"}},
    "mix24_concentrated": {"storage": {"middle": "int4", "low": "int2", "low_share": 0.5, "alloc": "concentrated"}},
    "mix28_oracle_diffuse": {"storage": {"middle": "int8", "low": "int2", "low_share": 2 / 3, "alloc": "diffuse",
                                         "alloc_from": "oracle"}},
}


@pytest.mark.parametrize("name", sorted(AS_PRESET))
def test_a_declaration_of_a_presets_fields_is_that_preset(name):
    want = preset(name, window=LIVE["window"], group=LIVE["group"], evict_window=LIVE["evict_window"],
                  sink=LIVE["sink"])
    got = declared({"name": "mine", **AS_PRESET[name]}, window=LIVE["window"], group=LIVE["group"],
                   evict_window=LIVE["evict_window"])
    assert got == want.with_(name="mine", description="")


DECLARED = [
    {"name": "int4_g64", "storage": {"middle": "int4", "group": 64, "window": 100}},
    {"name": "int3_f16", "storage": {"middle": "int3", "feature_group": 16}},
    {"name": "stream2_40", "selection": {"kind": "sink_window", "sink": 2, "window": 40}, "storage": {"group": 8}},
    {"name": "hh3", "selection": {"heavy": 3, "heavy_rule": "first"}, "storage": {"middle": "int2", "window": 8}},
    {"name": "mix_late", "storage": {"middle": "int8", "low": "int4", "low_share": 0.25, "alloc": "late"}},
    {"name": "f32", "storage": {}},
    {"name": "mx8_sink", "selection": {"sink": 8}, "storage": {"middle": "mxfp8", "key_axis": "token"}},
]


@pytest.mark.parametrize("entry", DECLARED, ids=[e["name"] for e in DECLARED])
def test_the_audits_reading_of_a_declaration_is_the_runs(entry):
    pol = declared(entry, window=LIVE["window"], group=LIVE["group"], evict_window=LIVE["evict_window"])
    cfg = {k: v for k, v in pol.config().items() if k not in ("name", "description")}
    assert declared_policy(entry, {**LIVE, "policies": [entry]}) == cfg


@pytest.mark.parametrize("entry, expect", [
    ({"name": "x", "storage": {"middle": "int5"}}, "middle 'int5'"),
    ({"name": "x", "storage": {"middel": "int4"}}, r"unknown field\(s\) \['middel'\]"),
    ({"name": "x", "storage": {"middle": "drop"}}, "'drop' is a selection"),
    ({"name": "x", "selection": {"kind": "sink_window"}, "storage": {"middle": "int4"}}, "keeps its tokens float32"),
    ({"name": "x", "selection": {"kind": "topk"}}, "selection kind"),
    ({"name": "int4", "storage": {"middle": "int4"}}, "is taken"),
    ({"name": "quanto_int4"}, "is taken"),
    ({"name": "a b"}, "needs a name"),
    ({"name": "x", "storage": {"group": 48}}, "power of two"),
    ({"name": "x", "storage": {"window": "128"}}, "expected an integer"),
    ({"name": "x", "rules": 1}, r"unknown key\(s\) \['rules'\]"),
])
def test_bad_declarations_are_refused_naming_the_field(entry, expect):
    with pytest.raises(ValueError, match=expect):
        declared(entry, window=16, group=16, evict_window=24)


def test_an_arm_declared_twice_is_refused():
    entries = ["int4", {"name": "mine", "storage": {"middle": "int2"}}, {"name": "mine", "storage": {"middle": "int4"}}]
    with pytest.raises(ValueError, match=r"policies\[2\]: the arm 'mine' is listed twice"):
        policies_from(entries, window=16, group=16, evict_window=24, sink=4)


def test_a_live_protocol_refuses_a_bad_declaration_before_running(tmp_path):
    from testbed.protocol import load_protocol

    proto = json.loads((REPO / "protocols" / "smollm2_quality.json").read_text())
    proto["live"]["policies"] = ["int4", {"name": "int4_g48", "storage": {"middle": "int4", "group": 48}}]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(proto))
    with pytest.raises(ProtocolError, match=r"live\.policies\[1\] \(int4_g48\).*power of two"):
        load_protocol(path)


# -- end to end -------------------------------------------------------------------------------------

MINE = [{"name": "int4_g8", "storage": {"middle": "int4", "group": 8},
         "description": "int4 with K grouped over 8 tokens where the protocol's presets use 16"},
        {"name": "stream2_12", "selection": {"kind": "sink_window", "sink": 2, "window": 12}}]


@pytest.fixture(scope="module")
def declared_run(tmp_path_factory):
    from testbed.run import main as run_main
    from testbed.sources import models

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}")
    proto = json.loads((REPO / "protocols" / "smollm2_quality.json").read_text())
    proto.update(name="declared_tiny", default=False)
    proto["live"].update({"evidence_layer": 0, "segments": 1, "prefill": 32, "steps": 24, "batch": 1, "window": 16,
                          "group": 16, "evict_window": 16, "policies": ["int4", *MINE], "peers": []})
    base = tmp_path_factory.mktemp("declared")
    path = base / "declared_tiny.json"
    path.write_text(json.dumps(proto))
    out = base / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(path)]) == 0
    return out


def _rows(run: Path) -> list:
    return json.loads((run / "results.json").read_text())["rows"]


@pytest.mark.slow
def test_declared_policies_run_and_pass_the_audit(declared_run):
    ok, failures, _ = audit(declared_run)
    assert ok, failures[:5]
    rows = {r["arm"]: r for r in _rows(declared_run)}
    assert set(rows) == {"dynamic_cache", "int4", "int4_g8", "stream2_12"}
    g8, g16 = rows["int4_g8"], rows["int4"]
    assert g8["policy"]["group"] == 8 and g16["policy"]["group"] == 16
    # 56 tokens at the end: int4 at G = 16 packs 32 of the 40 behind its window, at G = 8 all 40,
    # so the G = 8 cache is smaller although each of its K groups carries twice the scales per token
    assert g8["context_final"] == g16["context_final"] == 56
    assert g8["bytes_final"] < g16["bytes_final"]
    # the declared StreamingLLM holds 2 + 12 tokens of 64 float32 K and V values, 3 KV heads, 30 layers
    assert rows["stream2_12"]["bytes_final"] == 30 * (16 + 14 * 2 * 3 * 64 * 4)


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    return dst


@pytest.mark.slow
def test_a_forged_declared_arms_bytes_fail(declared_run, tmp_path):
    run = _copy(declared_run, tmp_path)
    res = json.loads((run / "results.json").read_text())
    row = next(r for r in res["rows"] if r["arm"] == "int4_g8")
    rel = row["arrays"]["bytes"]
    x = _arrays.load(run, rel)
    x[-1] -= 64
    _arrays.save(run, rel, x)
    m = json.loads((run / "manifest.json").read_text())
    m["arrays"][rel]["sha256"] = _arrays.sha(run, rel)
    (run / "manifest.json").write_text(json.dumps(m, indent=1))
    ok, failures, _ = audit(run)
    assert not ok
    assert any("int4_g8" in f and "bytes" in f for f in failures), failures[:5]


@pytest.mark.slow
def test_a_forged_declaration_in_the_frozen_protocol_fails(declared_run, tmp_path):
    """The frozen protocol's declaration says G = 16 for int4_g8 (its copy re-hashed in the manifest):
    the rows that ran G = 8 no longer match what the audit derives from the fields."""
    run = _copy(declared_run, tmp_path)
    rel = "protocols/declared_tiny.json"
    proto = json.loads((run / rel).read_text())
    proto["live"]["policies"][1]["storage"]["group"] = 16
    (run / rel).write_text(json.dumps(proto))
    digest = hashlib.sha256((run / rel).read_bytes()).hexdigest()
    m = json.loads((run / "manifest.json").read_text())
    for e in m["protocols"]:
        if e["copy"] == rel:
            e["sha256"] = digest
    if rel in m.get("files", {}):
        m["files"][rel] = digest
    (run / "manifest.json").write_text(json.dumps(m, indent=1))
    ok, failures, _ = audit(run)
    assert not ok
    assert any("int4_g8" in f and "policy.group" in f for f in failures), failures[:5]


def test_selection_and_storage_defaults_are_the_documented_ones():
    assert Selection() == Selection("all", 0, "first", 0, 0, "attention")
    assert Storage().middle == "float32" and Storage().key_axis == "channel" and Storage().feature_group == 32
