"""Capture provenance (audit_checks/capture.py): the capture manifest, the model's identity, the
gates, the stored token ids and each case's metadata are checked against the protocol and the
audit's own table of the model, not taken at their word.

Every forgery is consistent at the level of files: whatever is edited (the capture manifest, an
array, results.json) gets its new sha256 in manifest.json, so only the cross-checks can notice.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from testbed.audit import audit
from testbed.run import main as run_main
from tests import _arrays
from tests._helpers import forge_results

pytestmark = [pytest.mark.capture, pytest.mark.slow]  # a capture run of SmolLM2

STUDY = "cap"
REL = f"{STUDY}/capture_manifest.json"


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A small capture: one 64-token prompt in two chunks of 32, layers 0 and 29, the last chunk recorded."""
    from testbed.sources import models

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}")
    base = tmp_path_factory.mktemp("provenance")
    text = "The ferry to the island ran twice a week in winter, and the harbour master kept a ledger of every crossing. " * 4
    proto = {"name": STUDY, "default": False, "timing": {"repeats": 0, "seed": 0},
             "source": {"kind": "capture", "model": models.MODEL_ID, "tokens": 64, "chunk": 32, "sink_tokens": 4,
                        "recent_tokens": 16, "layers": [0, 29], "kv_heads": [1], "queries": 8,
                        "prompts": [{"id": "ferry", "kind": "prose", "text": text}]},
             "analyses": {"observation": {}}}
    path = base / "cap.json"
    path.write_text(json.dumps(proto, indent=1))
    out = base / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(path)]) == 0
    return out


@pytest.fixture
def run(finished, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(finished, dst)
    return dst


def failures(run_dir: Path) -> list[str]:
    ok, fails, _ = audit(run_dir, check_sources=False)
    assert ok == (not fails)
    return fails


def _json(run_dir: Path, rel: str) -> dict:
    return json.loads((run_dir / rel).read_text())


def _rehash_file(run_dir: Path, rel: str, obj: dict) -> None:
    data = (json.dumps(obj, indent=1) + "\n").encode()
    (run_dir / rel).write_bytes(data)
    m = _json(run_dir, "manifest.json")
    m["files"][rel] = hashlib.sha256(data).hexdigest()
    (run_dir / "manifest.json").write_text(json.dumps(m, indent=1))


def _rewrite_array(run_dir: Path, rel: str, arr: np.ndarray) -> None:
    """Replace a stored array and record its new sha256 (and shape) in the manifest."""
    _arrays.save(run_dir, rel, arr)
    m = _json(run_dir, "manifest.json")
    m["arrays"][rel].update(sha256=_arrays.sha(run_dir, rel), nbytes=int(arr.nbytes),
                            shape=list(arr.shape), dtype=arr.dtype.str)
    (run_dir / "manifest.json").write_text(json.dumps(m, indent=1))


def _edit_manifest(run_dir: Path, edit) -> None:
    m = _json(run_dir, "manifest.json")
    edit(m)
    (run_dir / "manifest.json").write_text(json.dumps(m, indent=1))


def _cases(run_dir: Path) -> dict:
    return _json(run_dir, "results.json")["cases"][STUDY]


CATEGORY = "tamper: capture"


def _only(fails: list[str], *words: str, rec=None) -> None:
    """Some FAIL line holds every one of ``words``; ``rec = (reliability, case)`` records the try."""
    hit = [f for f in fails if all(w in f for w in words)]
    if rec is not None:
        rec[0](CATEGORY, rec[1], f"FAIL naming {' / '.join(words)}", hit[0] if hit else (fails[0] if fails else "audit PASSED"))
    assert fails, "the forgery passed the audit"
    assert hit, fails


def test_untouched_capture_passes_and_stores_its_token_ids(finished):
    assert failures(finished) == []
    cases = _cases(finished)
    assert sorted(cases) == ["ferry-L00-c01", "ferry-L29-c01"]
    paths = {rec["arrays"]["token_ids"] for rec in cases.values()}
    assert len(paths) == 1  # one file for the prompt, shared by its cases
    ids = _arrays.load(finished, paths.pop())
    assert ids.dtype == np.int32 and ids.shape == (64,)
    run = _json(finished, REL)["runs"][0]
    assert hashlib.sha256(ids.tobytes()).hexdigest() == run["token_ids_sha256"]


def test_token_ids_replaced_with_the_array_rehashed(run, reliability):
    rel = next(iter(_cases(run).values()))["arrays"]["token_ids"]
    ids = _arrays.load(run, rel)
    ids[10] = (ids[10] + 1) % 49152
    _rewrite_array(run, rel, ids)
    _only(failures(run), "token_ids hash", "not the capture manifest's",
          rec=(reliability, "one token id changed, the array's sha256 re-computed"))


def test_token_ids_dropped_from_a_case(run, reliability):
    res = _json(run, "results.json")
    del res["cases"][STUDY]["ferry-L29-c01"]["arrays"]["token_ids"]
    forge_results(run, res, redraw=False)
    _only(failures(run), "ferry-L29-c01", "token_ids: not stored",
          rec=(reliability, "a case's token_ids dropped from results.json"))


def test_gate_met_but_not_the_protocols(run, reliability):
    """forwards expected = actual = 3 (a gate that looks met) where 64 tokens / 32 per forward make 2."""
    def edit(m):
        m["gates"][f"{STUDY}.ferry.forwards"] = {"expected": 3, "actual": 3}
    _edit_manifest(run, edit)
    _only(failures(run), "gates.cap.ferry.forwards", "the protocol and model give 2",
          rec=(reliability, "a gate rewritten as met at a count the protocol does not give"))


def test_a_gate_deleted(run, reliability):
    """The remaining gates are all met; the one that would show a problem is simply gone."""
    def edit(m):
        del m["gates"][f"{STUDY}.ferry.observer_calls"]
    _edit_manifest(run, edit)
    _only(failures(run), "gates.cap.ferry.observer_calls", "missing", rec=(reliability, "a gate deleted from manifest.json"))


def test_another_model_file_under_the_same_name(run, reliability):
    m = _json(run, REL)
    m["load"]["gguf_sha256"] = "0" * 64
    _rehash_file(run, REL, m)
    _only(failures(run), "load.gguf_sha256", rec=(reliability, "another GGUF's sha256 under the same model name"))


def test_model_dimensions_forged_with_their_counts(run, reliability):
    """A 24-layer model with the observer-call counts that would follow from it."""
    m = _json(run, REL)
    m["config"]["transformer_layers"] = 24
    m["config"]["model_config"]["num_hidden_layers"] = 24
    for r in m["runs"]:
        r["expected_observer_calls"] = r["actual_observer_calls"] = 2 * 24
    _rehash_file(run, REL, m)
    fails = failures(run)
    _only(fails, "config.transformer_layers is 24, expected 30",
          rec=(reliability, "the model's layer count and the counts that follow from it forged"))
    _only(fails, "actual_observer_calls is 48, expected 60")


def test_prompt_text_swapped_in_the_capture_manifest(run, reliability):
    m = _json(run, REL)
    m["runs"][0]["text"] = "A different prompt."
    _rehash_file(run, REL, m)
    _only(failures(run), "runs.ferry", "text", rec=(reliability, "a prompt's text swapped in the capture manifest"))


def test_capture_software_is_not_the_runs(run, reliability):
    m = _json(run, REL)
    m["software"]["torch"] = "2.99.0"
    _rehash_file(run, REL, m)
    _only(failures(run), "software.torch", "not the run environment's", rec=(reliability, "the capture's torch version changed"))


def test_query_selection_forged_in_meta_and_positions(run, reliability):
    """The first 8 queries claimed instead of every 4th from the end, positions shifted to agree."""
    res = _json(run, "results.json")
    rec = res["cases"][STUDY]["ferry-L00-c01"]
    rec["meta"]["query_index"] = list(range(8))
    forge_results(run, res, redraw=False)
    rel = rec["arrays"]["query_positions"]
    _rewrite_array(run, rel, np.arange(32, 40, dtype=np.int64))
    fails = failures(run)
    _only(fails, "ferry-L00-c01", "meta.query_index", rec=(reliability, "query selection and positions forged together"))
    _only(fails, "query_positions are not the selected queries' positions")


def test_layout_sink_widened(run, reliability):
    res = _json(run, "results.json")
    lay = res["cases"][STUDY]["ferry-L29-c01"]["layout"]
    lay[0]["stop"], lay[1]["start"] = 8, 8
    forge_results(run, res, redraw=False)
    _only(failures(run), "ferry-L29-c01", "layout", rec=(reliability, "a case's sink widened in its layout"))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="known gap: the audit has no tokenizer and cannot run "
                   "the model, so token ids replaced with every hash that records them pass (--same-as against a "
                   "re-run is the check)")
def test_gap_token_ids_replaced_with_every_hash(run, reliability):
    cases = _cases(run)
    rel = next(iter(cases.values()))["arrays"]["token_ids"]
    ids = _arrays.load(run, rel)
    ids[10] = (ids[10] + 1) % 49152
    _rewrite_array(run, rel, ids)
    digest = hashlib.sha256(ids.tobytes()).hexdigest()
    res = _json(run, "results.json")
    for rec in res["cases"][STUDY].values():
        rec["meta"]["token_ids_sha256"] = digest
    forge_results(run, res, redraw=False)
    m = _json(run, REL)
    m["runs"][0]["token_ids_sha256"] = digest
    _rehash_file(run, REL, m)
    reliability("gap", "capture token ids replaced with every hash recomputed",
                "not caught (no tokenizer or model in the audit)")
    assert failures(run)


def test_unsorted_kv_heads_and_a_single_newest_query_pass(tmp_path):
    """Legitimate settings the audit must not mistake for forgeries: KV heads listed out of order
    (the observer keeps them sorted) and one query per chunk (the newest token, which sees every
    key, so the case is recorded as not causal)."""
    from testbed.sources import models

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}")
    text = "A short note on the tides, the harbour and the ferry that crosses twice a week in winter. " * 4
    proto = {"name": "cap2", "default": False, "timing": {"repeats": 0, "seed": 0},
             "source": {"kind": "capture", "model": models.MODEL_ID, "tokens": 64, "chunk": 32, "sink_tokens": 4,
                        "recent_tokens": 16, "layers": [3], "kv_heads": [2, 0], "queries": 1,
                        "prompts": [{"id": "tide", "kind": "prose", "text": text}]},
             "analyses": {"observation": {}}}
    path = tmp_path / "cap2.json"
    path.write_text(json.dumps(proto))
    out = tmp_path / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(path)]) == 0
    rec = json.loads((out / "results.json").read_text())["cases"]["cap2"]["tide-L03-c01"]
    assert rec["meta"]["kv_heads"] == [0, 2] and rec["causal"] is False
    assert failures(out) == []
