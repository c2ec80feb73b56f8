"""Completeness of a run (audit_checks/completeness.py): a consistent forger who removes, adds or
relabels cases and rows, or changes a row's parameter, is caught by the expansion of the frozen
protocol copies, not by a re-derived number.

Every forgery here is consistent: results.json is edited and its sha256 re-computed in the
manifest; deleted arrays are deleted from the run and from the manifest's ``arrays``; report.html and
report.md are redrawn from the forged rows with the run's own builders (the audit recomputes the
figures and every table cell).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from testbed.audit import audit
from testbed.audit_checks.common import softmax_attention
from testbed.run import main as run_main
from tests import _arrays
from tests._helpers import REPO, forge_report_md, forge_results
from tests._reliability import record_audit_verdicts

SMALL = {
    "residual_window": {"seeds": [7, 19], "lengths": [128]},
    "ablation": {"seeds": [1, 2]},
}


@pytest.fixture(autouse=True)
def _recorded(reliability, request, monkeypatch):
    """Each test's audit verdict goes to the generated reliability table (docs/reliability.md)."""
    yield from record_audit_verdicts(reliability, request, monkeypatch, "tamper: completeness")


def _small(name: str) -> dict:
    proto = json.loads((REPO / "protocols" / f"{name}.json").read_text())
    proto["source"].update(SMALL[name])
    proto.update(default=False, timing={"repeats": 0, "seed": 0})
    return proto


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """One run of small copies of the residual-window and ablation protocols."""
    base = tmp_path_factory.mktemp("complete")
    args = ["--quiet", "--out", str(base / "run")]
    for name in SMALL:
        path = base / f"{name}.json"
        path.write_text(json.dumps(_small(name), indent=1))
        args += ["--protocol", str(path)]
    assert run_main(args) == 0
    return base / "run"


@pytest.fixture
def run(finished, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(finished, dst, symlinks=True)
    return dst


def failures(run_dir: Path) -> list[str]:
    ok, fails, _ = audit(run_dir, check_sources=False)
    assert ok == (not fails)
    return fails


def load(run_dir: Path, rel: str) -> dict:
    return json.loads((run_dir / rel).read_text())


def forge(run_dir: Path, res: dict, drop_arrays=(), redraw: bool = True) -> None:
    """Delete ``drop_arrays`` from the run and the manifest, then forge results.json, results.csv and
    report.html consistently (`forge_results`)."""
    m = load(run_dir, "manifest.json")
    for rel in drop_arrays:
        _arrays.delete(run_dir, rel)
        del m["arrays"][rel]
    (run_dir / "manifest.json").write_text(json.dumps(m, indent=1))
    forge_results(run_dir, res, redraw)


def array_paths(obj) -> set[str]:
    if isinstance(obj, dict):
        return set().union(*(array_paths(v) for v in obj.values())) if obj else set()
    if isinstance(obj, list):
        return set().union(*(array_paths(v) for v in obj)) if obj else set()
    return {obj} if isinstance(obj, str) and obj.startswith("arrays/") else set()


def unused_arrays(res: dict, run_dir: Path) -> list[str]:
    """Arrays of the manifest no case or row of ``res`` uses any more (what the forger deletes)."""
    return sorted(set(load(run_dir, "manifest.json")["arrays"]) - array_paths(res))


def find(res: dict, **labels) -> int:
    return next(i for i, r in enumerate(res["rows"]) if all(r.get(k) == v for k, v in labels.items()))


def test_untouched_run_passes(run):
    assert failures(run) == []


def test_untouched_evidence_passes():
    """The archived evidence (every source but traces, every analysis, the live study) is complete."""
    assert failures(REPO / "evidence") == []


def test_row_deleted_whose_arrays_are_shared(run):
    """The float32 arm's drop_sink ablation row owns no arrays (its numbers come from the case):
    deleting it leaves nothing orphaned, and every other row still re-derives."""
    res = load(run, "results.json")
    i = find(res, study="ablation", case="llm-s2", arm="float32", ablation="drop_sink")
    assert res["rows"][i]["arrays"] == {}
    del res["rows"][i]
    assert unused_arrays(res, run) == []
    forge(run, res)
    fails = failures(run)
    assert fails == ["FAIL: results.json ablation/llm-s2 ablation arm=float32 ablation=drop_sink: "
                     "missing: the protocol produces this row"]


def test_row_deleted_with_its_own_arrays(run):
    """A residual-window row deleted with the packed arrays only it used (its key codes, scales and
    zeros; the store is content-addressed, so its other arrays are shared with other rows and stay)."""
    res = load(run, "results.json")
    i = find(res, study="residual_window", case="clean-s7-n128", arm="R=0")
    del res["rows"][i]
    gone = unused_arrays(res, run)
    assert len(gone) == 3 and all(rel.endswith(("R=0.key.codes.npy", "R=0.key.scale.npy", "R=0.key.zero.npy")) for rel in gone)
    forge(run, res, gone)
    assert failures(run) == ["FAIL: results.json residual_window/clean-s7-n128 residual_window arm=R=0: "
                             "missing: the protocol produces this row"]


def test_whole_seed_deleted(run):
    """Seed 19 of the residual-window study: its cases, their rows and every array they used."""
    res = load(run, "results.json")
    cases = res["cases"]["residual_window"]
    gone_cases = sorted(c for c in cases if cases[c]["meta"]["seed"] == 19)
    assert len(gone_cases) == 3
    for c in gone_cases:
        del cases[c]
    res["rows"] = [r for r in res["rows"] if not (r["study"] == "residual_window" and r["seed"] == 19)]
    forge(run, res, unused_arrays(res, run))
    fails = failures(run)
    assert sorted(fails) == [f"FAIL: results.json cases.residual_window.{c}: missing: the protocol produces this case "
                             "(and it is not excluded)" for c in gone_cases]


def test_near_duplicate_row_with_another_arm_name(run):
    """The int4 arm's 'none' row copied as arm 'int4_copy': it names the same packed arrays and
    quantizer, so the per-row check re-derives all its numbers; the protocol has no such arm."""
    res = load(run, "results.json")
    i = find(res, study="ablation", case="video-s1-c3", arm="int4", ablation="none")
    dup = copy.deepcopy(res["rows"][i])
    dup["arm"] = "int4_copy"
    res["rows"].append(dup)
    forge(run, res)
    fails = failures(run)
    n = len(res["rows"]) - 1
    assert fails == [f"FAIL: results.json row {n} ablation ablation video-s1-c3 arm=int4_copy ablation=none: "
                     "not a row the protocol produces for this case (arm=int4_copy ablation=none is not one of its rows)"]


def test_near_duplicate_row_with_one_count_changed(run):
    """A copy of a row that differs from it only in its 'rows' count: not an exact duplicate, but a
    second row with the same identity (and a count the audit derives from the case's shapes)."""
    res = load(run, "results.json")
    i = find(res, study="ablation", case="llm-s1", arm="float32", ablation="drop_recent")
    dup = copy.deepcopy(res["rows"][i])
    dup["rows"] += 1
    res["rows"].append(dup)
    forge(run, res)
    fails = failures(run)
    n = len(res["rows"]) - 1
    assert all(f.startswith(f"FAIL: results.json row {n} ablation ablation llm-s1 arm=float32") for f in fails), fails
    assert any(f"duplicate: rows [{i}, {n}] are the one row ablation/llm-s1 ablation arm=float32 ablation=drop_recent"
               in f for f in fails), fails
    assert any("rows: reported" in f for f in fails), fails


def test_control_seed_changed(run):
    res = load(run, "results.json")
    i = find(res, study="ablation", case="video-s1-c3", arm="float32", ablation="control_sink")
    assert res["rows"][i]["control_seed"] == 0
    res["rows"][i]["control_seed"] = 5
    forge(run, res)
    fails = failures(run)
    assert ("FAIL: results.json row %d ablation ablation video-s1-c3 arm=float32 ablation=control_sink: "
            "control_seed: row says 5, the protocol gives 0" % i) in fails


def test_recent_mass_window_changed_and_its_number_rederived(run):
    """The R=0 arm's recent-mass window (the protocol's 16) set to 32, and recent_mass recomputed
    for it: every number agrees with the row, the parameter does not agree with the protocol."""
    res = load(run, "results.json")
    i = find(res, study="residual_window", case="early_focus-s7-n128", arm="R=0")
    row = res["rows"][i]
    assert row["recent_mass_window"] == 16
    rec = res["cases"]["residual_window"][row["case"]]
    q, k, v, qp = (_arrays.load(run, rec["arrays"][n]) for n in ("q", "k", "v", "query_positions"))
    probs, _ = softmax_attention(q, k, v, qp, rec["causal"])
    row["recent_mass_window"] = 32
    row["recent_mass"] = float(probs[..., 128 - 32:].sum(-1).mean())
    forge(run, res)
    assert failures(run) == [f"FAIL: results.json row {i} residual_window residual_window early_focus-s7-n128 arm=R=0 "
                             "scheme=int4_grouped_g32+residual: "
                             "recent_mass_window: row says 32, the protocol gives 16"]


def test_residual_window_of_an_arm_changed(run):
    """The int4_window arm's float32 window (the recent region, 24 tokens in the video layout)
    recorded as 8 in its quantizer config."""
    res = load(run, "results.json")
    i = find(res, study="ablation", case="video-s2-c3", arm="int4_window", ablation="none")
    assert res["rows"][i]["quant"]["recent"] == 24
    res["rows"][i]["quant"]["recent"] = 8
    forge(run, res)
    lines = [f for f in failures(run) if f.startswith(f"FAIL: results.json row {i} ") and ": quant: row says" in f]
    assert len(lines) == 1 and "'recent': 8" in lines[0] and "'recent': 24" in lines[0]


def test_group_size_changed(run):
    res = load(run, "results.json")
    i = find(res, study="residual_window", case="clean-s19-n128", arm="R=64")
    res["rows"][i]["quant"]["key"]["group_size"] = 16
    forge(run, res)
    lines = [f for f in failures(run) if f.startswith(f"FAIL: results.json row {i} ") and ": quant: row says" in f]
    assert len(lines) == 1 and "'group_size': 16" in lines[0] and "'group_size': 32" in lines[0]


def test_case_added_that_the_protocol_does_not_produce(run):
    """A fourth distribution's worth of case: an existing case's arrays under a new id and seed."""
    res = load(run, "results.json")
    cases = res["cases"]["residual_window"]
    extra = copy.deepcopy(cases["clean-s7-n128"])
    extra["id"] = "clean-s99-n128"
    extra["meta"]["seed"] = 99
    cases["clean-s99-n128"] = extra
    forge(run, res)
    assert failures(run) == ["FAIL: results.json cases.residual_window.clean-s99-n128: not a case the protocol produces"]


def test_case_meta_relabelled(run):
    """A case's seed label changed together with every row's copy of it (the row-vs-case check agrees)."""
    res = load(run, "results.json")
    res["cases"]["ablation"]["llm-s2"]["meta"]["seed"] = 3
    for r in res["rows"]:
        if r["study"] == "ablation" and r["case"] == "llm-s2":
            r["seed"] = 3
    forge(run, res)
    assert failures(run) == ["FAIL: results.json cases.ablation.llm-s2: meta.seed: case says 3, the protocol gives 2"]


def test_forged_exclusion(run):
    """An exclusion the protocols do not allow (a synthetic source excludes nothing)."""
    m = load(run, "manifest.json")
    m["excluded"].append({"id": "residual_window/clean-s7-n128", "stage": "tokenize", "error": "too short"})
    (run / "manifest.json").write_text(json.dumps(m, indent=1))
    forge_report_md(run)  # report.md lists the exclusions too
    assert failures(run) == ["FAIL: manifest.json excluded[0]: 'residual_window/clean-s7-n128' (stage 'tokenize': "
                             "'too short') is not an exclusion the protocols allow"]


def test_malformed_labels_are_fail_lines_not_a_crash(run):
    """A row's case and an exclusion's id of the wrong JSON type (an object, a list) give FAIL lines."""
    res = load(run, "results.json")
    i = find(res, study="ablation", case="llm-s1", arm="int4", ablation="drop_sink")
    res["rows"][i]["case"] = {"not": "a string"}
    forge(run, res, redraw=False)
    m = load(run, "manifest.json")
    m["excluded"] = [{"id": ["cap", "x"], "stage": "tokenize", "error": "?"}]
    (run / "manifest.json").write_text(json.dumps(m, indent=1))
    fails = failures(run)
    assert fails and all(f.startswith("FAIL: ") and "\n" not in f for f in fails)
    assert not any("could not complete" in f or "cannot expand" in f for f in fails)
    assert ("FAIL: results.json ablation/llm-s1 ablation arm=int4 ablation=drop_sink: "
            "missing: the protocol produces this row") in fails
    assert any(f.startswith("FAIL: manifest.json excluded[0]: ['cap', 'x']") for f in fails)


# -- capture: prompts, layers and recorded chunks; short prompts excluded -------------------------

LONG = ("The river ran quietly past the old mill, where the miller's daughter kept the ledgers of every sack of "
        "grain that came down from the hills. Each autumn the carts arrived in long lines, and she counted them, "
        "wrote their weights in a careful hand, and sent the drivers home with bread. ") * 3


@pytest.fixture(scope="module")
def capture_run(tmp_path_factory) -> Path:
    from testbed.sources import models

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}")
    base = tmp_path_factory.mktemp("capture_complete")
    proto = {"name": "cap", "source": {
        "kind": "capture", "model": models.MODEL_ID, "tokens": 64, "chunk": 32, "sink_tokens": 4,
        "recent_tokens": 16, "layers": [0, 29], "queries": 4, "record_chunks": [-1],
        "prompts": [{"id": "prose", "kind": "narrative prose", "text": LONG},
                    {"id": "again", "kind": "narrative prose", "text": LONG[::-1]},
                    {"id": "short", "kind": "too short", "text": "Hello."}]},
        "analyses": {"observation": {"block_tokens": 16}}, "timing": {"repeats": 0, "seed": 0}}
    path = base / "cap.json"
    path.write_text(json.dumps(proto, indent=1))
    assert run_main(["--quiet", "--out", str(base / "run"), "--protocol", str(path)]) == 0
    return base / "run"


@pytest.mark.slow
@pytest.mark.capture
def test_capture_untouched_passes_with_its_short_prompt_excluded(capture_run, tmp_path):
    m = load(capture_run, "manifest.json")
    assert [e["id"] for e in m["excluded"]] == ["cap/short"]
    assert sorted(load(capture_run, "results.json")["cases"]["cap"]) == [
        "again-L00-c01", "again-L29-c01", "prose-L00-c01", "prose-L29-c01"]
    assert failures(capture_run) == []


def _without_prompt_again(capture_run: Path, tmp_path: Path) -> Path:
    """A copy of the capture run with prompt "again"'s cases, rows and arrays deleted, consistently."""
    run = tmp_path / "run"
    shutil.copytree(capture_run, run)
    res = load(run, "results.json")
    for c in [c for c in res["cases"]["cap"] if c.startswith("again-")]:
        del res["cases"]["cap"][c]
    res["rows"] = [r for r in res["rows"] if r.get("prompt") != "again"]
    forge(run, res, unused_arrays(res, run))
    return run


@pytest.mark.slow
@pytest.mark.capture
def test_capture_prompt_deleted_while_not_excluded(capture_run, tmp_path):
    run = _without_prompt_again(capture_run, tmp_path)
    fails = failures(run)
    missing = [f"FAIL: results.json cases.cap.again-{c}: missing: the protocol produces this case (and it is not excluded)"
               for c in ("L00-c01", "L29-c01")]
    assert set(missing) <= set(fails)
    # the rest is the capture provenance check seeing the same hole: the prompt's gates count cases that are gone
    assert all("again" in f for f in fails), fails


@pytest.mark.slow
@pytest.mark.capture
def test_capture_prompt_excluded_with_a_forged_reason(capture_run, tmp_path):
    """The prompt deleted and excluded, but with a reason that is not 'too short for the protocol'."""
    run = _without_prompt_again(capture_run, tmp_path)
    m = load(run, "manifest.json")
    m["excluded"].append({"id": "cap/again", "stage": "tokenize", "error": "prompt has 80 tokens, the protocol needs 64"})
    (run / "manifest.json").write_text(json.dumps(m, indent=1))
    fails = failures(run)
    assert "FAIL: manifest.json excluded[1]: 'cap/again' (stage 'tokenize': 'prompt has 80 tokens, the protocol needs 64') " \
           "is not an exclusion the protocols allow" in fails
    assert ("FAIL: results.json cases.cap.again-L00-c01: "
            "missing: the protocol produces this case (and it is not excluded)") in fails


def test_capture_whose_model_did_not_load(tmp_path, monkeypatch):
    """Without the weights the capture study is excluded as a whole (one entry naming STUDY/MODEL):
    the audit accepts it with no cases; the same run with the exclusion removed misses every case."""
    from testbed.protocol import PROTOCOL_DIR, load_protocol
    from testbed.run import run_protocols
    from testbed.sources import models

    monkeypatch.setattr(models, "locate_gguf", lambda: None)
    monkeypatch.setattr(models, "_LOADED", {})
    path = PROTOCOL_DIR / "smollm2.json"
    proto, raw = load_protocol(path)
    out = tmp_path / "run"
    out.mkdir()
    manifest = run_protocols(out, [(path, proto, raw)], progress=lambda m: None)
    assert [e["id"] for e in manifest["excluded"]] == [f"smollm2/{models.MODEL_ID}"]
    assert failures(out) == []
    m = load(out, "manifest.json")
    m["excluded"] = []
    (out / "manifest.json").write_text(json.dumps(m, indent=1))
    forge_report_md(out)  # report.md lists the exclusions too
    fails = failures(out)
    src = proto["source"]
    want = len(src["prompts"]) * len(src["layers"]) * len(src["record_chunks"])
    missing = [f for f in fails if f.startswith("FAIL: results.json cases.smollm2.") and
               f.endswith(": missing: the protocol produces this case (and it is not excluded)")]
    assert len(missing) == want
    # and the capture provenance check's one line: the manifest names no loaded model
    assert [f for f in fails if f not in missing] == [
        "FAIL: smollm2/capture_manifest.json: records no loaded model, yet the study is not excluded"]


@pytest.mark.parametrize("field", ["study", "analysis"])
def test_a_row_label_of_the_wrong_type_is_a_fail_line(run, field):
    res = load(run, "results.json")
    res["rows"][0][field] = ["not", "a", "string"]
    forge(run, res, redraw=False)
    fails = failures(run)
    assert "FAIL: results.json row 0: study and analysis must be strings" in fails
    assert not any("could not complete" in f for f in fails)
