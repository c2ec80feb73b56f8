"""The needle retrieval study on SmolLM2 (issue #32): a finished tiny run, its rows against an
independent computation, and forgeries the audit catches.

Marked ``capture``: needs the capture extra and the SmolLM2 GGUF; skipped with that reason otherwise.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from testbed.audit import audit
from testbed.sources import models
from tests import _arrays
from tests._helpers import drop_row, forge_array, forge_results

pytestmark = [pytest.mark.capture, pytest.mark.slow]

ARMS = ["dynamic_cache", "float32", "int4", "streaming", "float32_pre"]
# float32 with keys stored before the rotary embedding: the shared prefill must hand it its rotary cos / sin
FLOAT32_PRE = {"name": "float32_pre", "storage": {"middle": "float32", "key_rope": "pre"},
               "description": "float32, keys stored before RoPE (rotated at every read)"}


def _tiny_protocol(tmp_path: Path) -> Path:
    proto = json.loads((Path(__file__).resolve().parent.parent / "protocols" / "retrieval_small.json").read_text())
    proto["name"] = "retrieval_tiny"
    proto["default"] = False
    proto["retrieval"].update({"tasks": ["passkey", "kv_needle"], "lengths": [128], "depths": [0.0, 1.0], "trials": 1,
                               "batch": 2, "window": 16, "group": 16, "evict_window": 16,
                               "policies": ["float32", "int4", "streaming", FLOAT32_PRE]})
    path = tmp_path / "retrieval_tiny.json"
    path.write_text(json.dumps(proto))
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from testbed.run import main as run_main

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}; install with: {models.INSTALL_HINT}")
    tmp = tmp_path_factory.mktemp("retrieval")
    out = tmp / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(_tiny_protocol(tmp))]) == 0
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    return dst


def _res(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())


def _row(res: dict, arm: str, case: str = "t0000") -> dict:
    return next(r for r in res["rows"] if r["arm"] == arm and r["case"] == case)


def test_tiny_run_passes_its_audit_with_every_trial_and_arm(tiny_run):
    ok, failures, _ = audit(tiny_run)
    assert ok, failures[:5]
    res = _res(tiny_run)
    cases = res["cases"]["retrieval_tiny"]
    assert sorted(cases) == ["t0000", "t0001", "t0002", "t0003"]
    assert {(r["case"], r["arm"]) for r in res["rows"]} == {(c, a) for c in cases for a in ARMS}
    assert [cases[c]["meta"]["task"] for c in sorted(cases)] == ["passkey", "passkey", "kv_needle", "kv_needle"]
    report = (tiny_run / "report.md").read_text()
    assert "Task passkey:" in report and "Task kv_needle:" in report and "McNemar" in report
    assert "retrieval_heatmap/retrieval_tiny" in (tiny_run / "report.html").read_text()


@pytest.mark.parametrize("arm", ["float32", "float32_pre"])
def test_float32_policy_scores_as_the_reference(tiny_run, arm):
    """The float32 policy stores what DynamicCache stores: the same argmaxes, generated tokens and
    answer log-probs (up to float rounding of the chunking), so a broken hand-over of the shared
    prefill or of the question through a policy cache shows here; with keys stored before RoPE
    (float32_pre), also a wrong rotary (cos, sin) handed over with the shared prefill."""
    res = _res(tiny_run)
    for case in res["cases"]["retrieval_tiny"]:
        ref, f32 = _row(res, "dynamic_cache", case), _row(res, arm, case)
        assert f32["policy"]["name"] == arm
        for name in ("argmax", "generated"):
            assert np.array_equal(_arrays.load(tiny_run, ref["arrays"][name]), _arrays.load(tiny_run, f32["arrays"][name]))
        assert f32["answer_logprob"] == pytest.approx(ref["answer_logprob"], abs=1e-3)


def test_reference_logprobs_equal_one_full_forward(tiny_run):
    """Independent of the cache machinery: the model over the whole sequence in one forward, no
    cache, gives the stored reference log-probs of the answer and its argmaxes."""
    model, _, _ = models.load_model()
    res = _res(tiny_run)
    for case, rec in res["cases"]["retrieval_tiny"].items():
        ids = _arrays.load(tiny_run, rec["arrays"]["token_ids"]).astype(np.int64)
        n_a = rec["meta"]["answer_tokens"]
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(ids)[None], use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits[-n_a - 1:-1], -1)
        answer = torch.from_numpy(ids[-n_a:])
        row = _row(res, "dynamic_cache", case)
        lp = _arrays.load(tiny_run, row["arrays"]["logprob"])
        np.testing.assert_allclose(lp, logp.gather(-1, answer[:, None])[:, 0].numpy(), atol=2e-3)
        assert np.array_equal(_arrays.load(tiny_run, row["arrays"]["argmax"]), logp.argmax(-1).numpy())


def test_evicting_a_needle_costs_what_keeping_it_does_not(tiny_run):
    """A needle at depth 0 of 128 tokens leaves streaming's sink + newest 16 tokens, so that arm
    cannot copy the key from the needle; the reference (which keeps everything) is far more
    confident in the answer."""
    res = _res(tiny_run)
    ref, stream = _row(res, "dynamic_cache", "t0000"), _row(res, "streaming", "t0000")
    assert ref["answer_logprob"] > stream["answer_logprob"] + 5.0


@pytest.mark.parametrize("what", ["argmax_and_em", "em_only", "needle_start", "row_deleted", "wilson_cell"])
def test_forgeries_of_retrieval_fail(tiny_run, tmp_path, what):
    run = _copy(tiny_run, tmp_path)
    res = _res(run)
    row = _row(res, "dynamic_cache")
    label = f"retrieval {row['case']} arm={row['arm']}"
    if what == "argmax_and_em":
        # the reference's argmax at its most confident answer position made wrong, the row's EM and
        # token count with it, results.csv, report.md and report.html rewritten to agree (re-hashed)
        lp = _arrays.load(run, row["arrays"]["logprob"])
        i = int(np.argmax(lp))
        assert lp[i] > np.log(0.5) and row["tf_em"] == 1
        forge_array(run, row["arrays"]["argmax"], lambda x: x.__setitem__(i, x[i] + 1))
        row["tf_em"], row["tf_tokens_correct"] = 0, row["tf_tokens_correct"] - 1
        forge_results(run, res)
        expect = f"argmax[{i}]"
    elif what == "em_only":
        row["tf_em"] = 1 - row["tf_em"]
        forge_results(run, res, redraw=False)
        expect = "tf_em"
    elif what == "needle_start":  # the needle claimed one token later than where it sits
        rec = res["cases"]["retrieval_tiny"][row["case"]]
        rec["meta"]["needle_start"] += 1
        rec["meta"]["needle_end"] += 1
        forge_results(run, res)
        expect, label = "needle", "cases.retrieval_tiny.t0000"
    elif what == "row_deleted":  # a failing row taken out, its arrays with it, all re-hashed
        drop_row(run, res, _row(res, "streaming"))
        expect, label = "t0000 arm streaming is missing", "retrieval_tiny"
    else:  # a narrower interval printed for the reference
        doc = (run / "report.md").read_text()
        line = next(ln for ln in doc.splitlines() if ln.startswith("| dynamic_cache "))
        cells = line.split("|")
        cells[5] = cells[5].replace("[", "[9", 1)
        (run / "report.md").write_text(doc.replace(line, "|".join(cells), 1))
        m = json.loads((run / "manifest.json").read_text())
        m["files"]["report.md"] = hashlib.sha256((run / "report.md").read_bytes()).hexdigest()
        (run / "manifest.json").write_text(json.dumps(m, indent=1))
        expect, label = "Wilson 95 %", "(dynamic_cache, 128)"
    ok, failures, _ = audit(run)
    assert not ok
    assert any(expect in f and label in f for f in failures), failures[:6]


def _forge_file(run: Path, rel: str, text: str) -> None:
    """A run file rewritten and its SHA-256 recorded in the manifest, as a consistent forger does."""
    (run / rel).write_text(text)
    m = json.loads((run / "manifest.json").read_text())
    m["files"][rel] = hashlib.sha256((run / rel).read_bytes()).hexdigest()
    (run / "manifest.json").write_text(json.dumps(m, indent=1))


def _swap_trials(run: Path, res: dict, a: str, b: str) -> None:
    """Trials ``a`` and ``b`` exchange everything but their grid coordinates: token ids, needle,
    seed, answer, metadata and every arm's row (numbers and arrays), all re-hashed."""
    cases = res["cases"]["retrieval_tiny"]
    coords = ("task", "length", "depth", "trial")
    ma, mb = cases[a]["meta"], cases[b]["meta"]
    na, nb = {**mb, **{k: ma[k] for k in coords}}, {**ma, **{k: mb[k] for k in coords}}
    ma.clear(), ma.update(na), mb.clear(), mb.update(nb)
    pairs = [(cases[a]["arrays"][n], cases[b]["arrays"][n]) for n in ("token_ids", "needle_ids")]
    for arm in ARMS:
        ra, rb = _row(res, arm, a), _row(res, arm, b)
        for key in ("seed", "answer_tokens", "answer_logprob", "tf_tokens_correct", "tf_em", "greedy_tokens_correct",
                    "greedy_em"):
            ra[key], rb[key] = rb[key], ra[key]
        pairs += [(ra["arrays"][n], rb["arrays"][n]) for n in ra["arrays"]]
    for x, y in pairs:
        xa, xb = _arrays.load(run, x).copy(), _arrays.load(run, y).copy()
        assert xa.shape == xb.shape  # one task and length: the same counts of tokens
        forge_array(run, x, lambda z, v=xb: z.__setitem__(slice(None), v))
        forge_array(run, y, lambda z, v=xa: z.__setitem__(slice(None), v))
    forge_results(run, res)


GRID_FORGERIES = {
    "swap": "trials t0000 (depth 0) and t0001 (depth 1) swap ids, needle, seed, answer and rows; coordinates kept",
    "needle_to_start": "trial t0001's needle (depth 1) moved to the start of its prefill, needle_start/end updated",
    "needle_of_another": "trial t0000's needle (in its prefill and needle_ids) replaced by trial t0001's",
    "manifest_sha": "retrieval_manifest.json: the model's GGUF SHA-256 zeroed",
    "manifest_gguf": "retrieval_manifest.json: another GGUF file named",
    "manifest_torch": "retrieval_manifest.json: another torch version",
    "manifest_arms": "retrieval_manifest.json: an arm left out of the arms list",
    "manifest_trials": "retrieval_manifest.json: one more trial claimed",
    "manifest_duplicate_key": "retrieval_manifest.json: a forged \"trials\" key before the real one",
    "figure_duplicate_key": "report.html: a figure's JSON data block with a forged \"key\" before the real one",
}


@pytest.mark.parametrize("what", sorted(GRID_FORGERIES))
def test_forgeries_of_the_grid_binding_and_manifest_fail(tiny_run, tmp_path, what, reliability):
    """Issue #48: a trial bound to its grid slot without a tokenizer (seed, needle, answer, the
    needle's place against the depth), the retrieval manifest checked as the live one is, and a
    duplicate key refused in every JSON the audit reads; each forgery consistent (re-hashed)."""
    run = _copy(tiny_run, tmp_path)
    res = _res(run)
    rel = "retrieval_tiny/retrieval_manifest.json"
    manifest = json.loads((run / rel).read_text())
    if what == "swap":
        assert _res(run)["cases"]["retrieval_tiny"]["t0001"]["meta"]["depth"] == 1.0
        _swap_trials(run, res, "t0000", "t0001")
        expect, label = "meta.seed", "retrieval_tiny t0000"
    elif what == "needle_to_start":
        rec = res["cases"]["retrieval_tiny"]["t0001"]
        meta = rec["meta"]
        s, e, n = meta["needle_start"], meta["needle_end"], meta["length"]
        assert s > 64  # depth 1 of 128 tokens: near the end

        def move(x):
            pre = x[:n].copy()
            x[:n] = np.concatenate([pre[s:e], pre[:s], pre[e:]])
        forge_array(run, rec["arrays"]["token_ids"], move)
        meta["needle_start"], meta["needle_end"] = 0, e - s
        forge_results(run, res)
        expect, label = "needle at token 0", "retrieval_tiny t0001"
    elif what == "needle_of_another":
        cases = res["cases"]["retrieval_tiny"]
        mine, other = cases["t0000"], cases["t0001"]
        theirs = _arrays.load(run, other["arrays"]["needle_ids"]).copy()
        s, e = mine["meta"]["needle_start"], mine["meta"]["needle_end"]
        assert e - s == theirs.size and not np.array_equal(_arrays.load(run, mine["arrays"]["needle_ids"]), theirs)
        forge_array(run, mine["arrays"]["needle_ids"], lambda x: x.__setitem__(slice(None), theirs))
        forge_array(run, mine["arrays"]["token_ids"], lambda x: x.__setitem__(slice(s, e), theirs))
        forge_results(run, res)
        expect, label = "do not occur in the needle's ids", "retrieval_tiny t0000"
    elif what == "figure_duplicate_key":
        doc = (run / "report.html").read_text()
        head = '<script type="application/json" id="figdata-1">{'
        assert head in doc
        _forge_file(run, "report.html", doc.replace(head, head + '"key":"forged",', 1))
        expect, label = "duplicate key 'key'", "report.html figure 1"
    else:
        text = None
        if what == "manifest_sha":
            manifest["model"]["gguf_sha256"] = "0" * 64
            expect = "model.gguf_sha256"
        elif what == "manifest_gguf":
            manifest["model"]["gguf"] = "SmolLM2-360M-Instruct.Q4_1.gguf"
            expect = "model.gguf"
        elif what == "manifest_torch":
            manifest["software"]["torch"] = "2.0.0"
            expect = "software.torch"
        elif what == "manifest_arms":
            manifest["arms"] = manifest["arms"][:-1]
            expect = "arms is"
        elif what == "manifest_trials":
            manifest["trials"] += 1
            expect = "trials is"
        else:
            text = json.dumps(manifest, indent=1).replace('"trials":', '"trials": 99,\n "trials":', 1)
            expect = "duplicate key 'trials'"
        _forge_file(run, rel, text or json.dumps(manifest, indent=1) + "\n")
        label = rel
    ok, failures, _ = audit(run, check_sources=False)
    hit = [f for f in failures if expect in f and label in f]
    reliability("tamper: consistent forger", GRID_FORGERIES[what], "audit FAIL naming what is wrong",
                hit[0] if hit else (failures[0] if failures else "audit PASSED"))
    assert not ok
    assert hit, failures[:6]


def test_protocol_errors_name_the_key(tmp_path):
    from testbed.protocol import ProtocolError, load_protocol

    base = json.loads(_tiny_protocol(tmp_path).read_text())
    for edit, key in ((lambda p: p["retrieval"].update(tasks=["haystack"]), "retrieval.tasks"),
                      (lambda p: p["retrieval"].update(lengths=[32]), "retrieval.lengths"),
                      (lambda p: p["retrieval"].update(policies=["int5"]), "retrieval.policies"),
                      (lambda p: p.update(extra=1), "extra")):
        proto = copy.deepcopy(base)
        edit(proto)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(proto))
        with pytest.raises(ProtocolError, match=key.replace(".", r"\.")):
            load_protocol(path)
