"""Evidence in two tiers: a capture that keeps the Q/K/V of some KV heads of some prompts, and the
per-row statistics of every case, from which the audit re-derives the ablation rows.

The capture runs need the capture extra and the SmolLM2 GGUF (marked ``capture``, skipped with the
reason otherwise); the validation tests do not.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from testbed.audit import audit
from testbed.protocol import ProtocolError, validate_protocol
from testbed.run import run_protocols
from testbed.sources import capture, models

from . import _arrays
from ._helpers import copy_run, forge_results

pytestmark = pytest.mark.slow  # capture runs of SmolLM2

TEXT = ("The harbour master counted the boats every morning and wrote their names in a ledger kept under the "
        "counter, beside the tide tables and a jar of pencils that nobody was allowed to borrow. ") * 8
DIGITS = " ".join(str(i) for i in range(300))
ABLATIONS = ["none", "drop_sink", "control_sink", "mass_control_sink", "drop_recent", "control_recent"]


def protocol(archive) -> dict:
    return {"name": "tiers",
            "source": {"kind": "capture", "model": models.MODEL_ID,
                       "prompts": [{"id": "ledger", "kind": "narrative prose", "text": TEXT},
                                   {"id": "digits", "kind": "repetitive list", "text": DIGITS}],
                       "tokens": 96, "chunk": 32, "sink_tokens": 4, "recent_tokens": 16, "layers": [0, 29],
                       "kv_heads": None, "queries": None, "record_chunks": [-1], "archive": archive},
            "analyses": {"ablation": {"ablations": ABLATIONS, "kv_arms": [{"name": "float32"}]}},
            "timing": {"repeats": 0}}


ARCHIVE = {"prompts": ["ledger"], "kv_heads": [1]}


def _run(base: Path, raw: dict) -> Path:
    proto = validate_protocol(copy.deepcopy(raw))
    base.mkdir(parents=True)
    out = base / "run"
    out.mkdir()
    run_protocols(out, [(base / "p.json", proto, json.dumps(raw).encode())], progress=lambda m: None)
    return out


@pytest.fixture(scope="module")
def tiers(smollm2, tmp_path_factory):
    return _run(tmp_path_factory.mktemp("tiers") / "two", protocol(ARCHIVE))


@pytest.fixture(scope="module")
def full(smollm2, tmp_path_factory):
    return _run(tmp_path_factory.mktemp("tiers") / "full", protocol(None))


def _results(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())


def _fails(run: Path) -> list[str]:
    ok, fails, _ = audit(run, check_sources=False)
    assert ok == (not fails)
    return fails


def _rewrite_array(run: Path, rel: str, arr: np.ndarray) -> None:
    """A consistent forger's edit of one array: new bytes, new sha256 in the manifest."""
    _arrays.save(run, rel, arr)
    m = json.loads((run / "manifest.json").read_text())
    m["arrays"][rel].update(sha256=hashlib.sha256(_arrays.read(run, rel)).hexdigest(), nbytes=int(arr.nbytes))
    (run / "manifest.json").write_text(json.dumps(m, indent=1))


def _none_row(res: dict, case: str) -> dict:
    return next(r for r in res["rows"] if r["case"] == case and r["ablation"] == "none")


def _edit_heads(run: Path, case: str, ablation: str, edit) -> None:
    """Apply ``edit(heads[A, H, F], a)`` to one case's stored per-head sums, ``a`` the index of
    ``ablation``, and record the array's new sha256 (a consistent forger)."""
    none = _none_row(_results(run), case)
    rel = none["arrays"]["stats"]["heads"]
    heads = _arrays.load(run, rel).copy()
    edit(heads, none["stats_layout"]["ablations"].index(ablation))
    _rewrite_array(run, rel, heads)


# -- validation: no model needed ----------------------------------------------------------------

@pytest.mark.parametrize("edit, says", [
    (lambda p: p["analyses"].update(observation={}), "only the ablation analysis"),
    (lambda p: p["analyses"]["ablation"]["kv_arms"].append(
        {"name": "int4", "key": {"kind": "int_grouped", "bits": 4, "group_size": 32, "axis": "channel"},
         "value": {"kind": "int_grouped", "bits": 4, "group_size": 32, "axis": "token"}}), "float32 arm alone"),
    (lambda p: p["source"]["archive"].update(prompts=["nowhere"]), "not prompt ids"),
    (lambda p: p["source"].update(kv_heads=[0]), "among the recorded KV heads"),
    (lambda p: p["source"]["archive"].update(kv_heads=[1, 1]), "listed twice"),
    (lambda p: p["source"]["archive"].pop("kv_heads"), "exactly the keys"),
])
def test_a_partial_archive_is_refused_where_the_audit_could_not_follow(edit, says):
    raw = protocol(copy.deepcopy(ARCHIVE))
    edit(raw)
    with pytest.raises(ProtocolError, match=says):
        validate_protocol(raw)


def test_archived_kv_heads_are_case_indices_in_ascending_order():
    """Given in any order, the archived heads are the case's KV-axis indices, ascending (as the
    case and the audit record them); with a subset of KV heads recorded, indices into that subset."""
    raw = protocol({"prompts": ["ledger"], "kv_heads": [2, 0]})
    src = validate_protocol(raw)["source"]
    assert capture.archived_kv_heads(src, "ledger", 3) == [0, 2] and capture.archived_kv_heads(src, "digits", 3) == []
    raw["source"].update(kv_heads=[1, 2], archive={"prompts": ["ledger"], "kv_heads": [2]})
    assert capture.archived_kv_heads(validate_protocol(raw)["source"], "ledger", 3) == [1]
    raw["source"]["archive"] = None
    assert capture.archived_kv_heads(validate_protocol(raw)["source"], "ledger", 3) is None


# -- the two tiers --------------------------------------------------------------------------------

@pytest.mark.capture
def test_two_tier_run_passes_the_audit(tiers):
    assert _fails(tiers) == []


@pytest.mark.capture
def test_only_the_listed_heads_of_the_listed_prompt_are_archived(tiers, full):
    two, one = _results(tiers)["cases"]["tiers"], _results(full)["cases"]["tiers"]
    assert set(two) == set(one) == {f"{p}-L{layer:02d}-c02" for p in ("ledger", "digits") for layer in (0, 29)}
    for cid, rec in two.items():
        assert "archive" not in one[cid]
        if cid.startswith("digits"):
            assert not {"q", "k", "v"} & set(rec["arrays"]), cid
            assert rec["archive"]["kv_heads"] == []
            continue
        # KV head 1 of 3 and its query heads 3, 4, 5 of 9: bit for bit the full run's slices
        assert rec["archive"]["kv_heads"] == [1] and rec["archive"]["q_heads"] == [3, 4, 5]
        assert rec["archive"]["shapes"]["k"] == list(_arrays.load(full, one[cid]["arrays"]["k"]).shape)
        for name, sl in (("q", slice(3, 6)), ("k", slice(1, 2)), ("v", slice(1, 2))):
            assert np.array_equal(_arrays.load(tiers, rec["arrays"][name]), _arrays.load(full, one[cid]["arrays"][name])[sl])


@pytest.mark.capture
def test_rows_are_the_same_whichever_tier_keeps_them(tiers, full):
    """The statistics tier changes what is stored, not what is measured: every number of every
    ablation row equals the fully archived run's (both runs audited)."""
    def numbers(run):
        out = {}
        for r in _results(run)["rows"]:
            for k, v in r.items():
                if isinstance(v, float) or (isinstance(v, list) and v and isinstance(v[0], float)):
                    out[(r["case"], r["ablation"], k)] = v
        return out
    a, b = numbers(tiers), numbers(full)
    assert a.keys() == b.keys() and len(a) > 100
    for key in a:
        assert np.allclose(np.asarray(a[key], float), np.asarray(b[key], float), rtol=1e-12, atol=0, equal_nan=True), key
    assert _fails(full) == []


@pytest.mark.capture
def test_a_row_that_disagrees_with_its_statistics_fails(tiers, tmp_path):
    run = copy_run(tiers, tmp_path / "r")
    res = _results(run)
    row = next(r for r in res["rows"] if r["case"] == "digits-L29-c02" and r["ablation"] == "drop_sink")
    row["rel_l2"] *= 1.01
    forge_results(run, res)
    fails = _fails(run)
    assert any("digits-L29-c02" in f and "drop_sink" in f and "rel_l2" in f for f in fails), fails[:5]


@pytest.mark.capture
def test_statistics_of_an_archived_head_are_checked_against_its_qkv(tiers, tmp_path):
    run = copy_run(tiers, tmp_path / "r")

    def edit(heads, a):
        heads[a, 4, 1] *= 1.05  # err2 of query head 4 (archived: KV head 1)

    _edit_heads(run, "ledger-L29-c02", "drop_sink", edit)
    fails = _fails(run)
    assert any("of the archived heads" in f and "err2" in f for f in fails), fails[:5]


@pytest.mark.capture
def test_mass_band_is_checked_from_the_statistics(tiers, tmp_path):
    run = copy_run(tiers, tmp_path / "r")

    def edit(heads, a):
        heads[a, :, 17] = 0.05  # mismatch_max: 5 %, outside the documented 1 % band

    _edit_heads(run, "digits-L00-c02", "mass_control_sink", edit)
    res = _results(run)
    row = next(r for r in res["rows"] if r["case"] == "digits-L00-c02" and r["ablation"] == "mass_control_sink")
    if row["matched_rows"]:
        row["mass_mismatch_max"] = 0.05
        forge_results(run, res)
    fails = _fails(run)
    assert any("1 % band" in f for f in fails), fails[:5]


def _forge_damage(run: Path, case: str, scale: float, keep_identities: bool) -> None:
    """A forger who makes dropping the sink in one unarchived case ``scale`` times as damaging:
    err2 (and, with ``keep_identities``, own_err2 and dot with it, so that every identity of the
    statistics still holds) and every number of the row that follows from them."""
    sums = {}

    def edit(heads, a):
        ref2, out2 = heads[a, :, 2], heads[a, :, 4]
        heads[a, :, 1] *= scale ** 2                             # err2
        if keep_identities:
            heads[a, :, 5] = heads[a, :, 1]                      # own_err2: the float32 arm's own errors
            heads[a, :, 3] = (out2 + ref2 - heads[a, :, 1]) / 2  # dot, from ||O' - O||^2 = ||O'||^2 + ||O||^2 - 2 <O', O>
        sums.update(dot=heads[a, :, 3].sum(), out2=out2.sum(), ref2=ref2.sum())

    _edit_heads(run, case, "drop_sink", edit)
    res = _results(run)
    row = next(r for r in res["rows"] if r["case"] == case and r["ablation"] == "drop_sink")
    row["rel_l2"] *= scale
    row["rel_l2_per_mass"] *= scale
    row["rel_l2_heads"] = [scale * x for x in row["rel_l2_heads"]]
    if keep_identities:
        row["rel_l2_own"] *= scale
        row["cosine"] = float(sums["dot"] / np.sqrt(sums["out2"] * sums["ref2"]))
    forge_results(run, res)


@pytest.mark.capture
def test_a_statistic_edited_alone_breaks_an_identity(tiers, tmp_path):
    run = copy_run(tiers, tmp_path / "r")
    _forge_damage(run, "digits-L29-c02", 2.0, keep_identities=False)
    fails = _fails(run)
    assert any("err2 = out2 + ref2 - 2 dot" in f for f in fails), fails[:5]


@pytest.mark.capture
def test_an_archive_entry_outside_a_capture_that_asks_for_one_fails(tiers, tmp_path):
    """A forger who drops a case's Q/K/V and writes statistics instead, in a study whose protocol
    keeps every array, is refused (here: the archive taken out of the frozen protocol copy)."""
    import hashlib as _h

    run = copy_run(tiers, tmp_path / "r")
    path = run / "protocols" / "tiers.json"
    proto = json.loads(path.read_text())
    proto["source"]["archive"] = None
    path.write_text(json.dumps(proto, indent=1) + "\n")
    m = json.loads((run / "manifest.json").read_text())
    entry = next(e for e in m["protocols"] if e["name"] == "tiers")
    entry["sha256"] = _h.sha256(path.read_bytes()).hexdigest()
    (run / "manifest.json").write_text(json.dumps(m, indent=1))
    fails = _fails(run)
    assert any("has an archive entry, but its protocol's source keeps every array" in f for f in fails), fails[:5]


@pytest.mark.capture
@pytest.mark.xfail(strict=True, reason="an unarchived case's statistics and its rows forged together, every identity of "
                                       "the statistics kept, agree with each other: without its Q/K/V only a re-run of "
                                       "the deterministic capture can tell (python -m testbed.compare against a fresh run)")
def test_consistent_forgery_of_an_unarchived_case_is_caught(tiers, tmp_path):
    run = copy_run(tiers, tmp_path / "r")
    _forge_damage(run, "digits-L29-c02", 2.0, keep_identities=True)
    assert _fails(run) != []


def test_default_two_tier_study_reads_prefixes_of_the_broad_prompts():
    """smollm2_prompts keeps the first characters of smollm2_broad's prompts (enough for its 256
    tokens), so its cases are the same attention as the broad study's 256-token chunk."""
    from testbed.protocol import PROTOCOL_DIR, load_protocol

    tiers, _ = load_protocol(PROTOCOL_DIR / "smollm2_prompts.json")
    broad, _ = load_protocol(PROTOCOL_DIR / "smollm2_broad.json")
    b = {p["id"]: p["text"] for p in broad["source"]["prompts"]}
    assert [p["id"] for p in tiers["source"]["prompts"]] == list(b) and len(b) >= 16
    assert all(b[p["id"]].startswith(p["text"]) for p in tiers["source"]["prompts"])
    assert tiers["source"]["tokens"] == (broad["source"]["record_chunks"][0] + 1) * broad["source"]["chunk"]
    assert tiers["source"]["kv_heads"] is None and tiers["source"]["queries"] is None
    assert tiers["default"] and tiers["source"]["archive"]["prompts"] == [tiers["source"]["prompts"][0]["id"]]
