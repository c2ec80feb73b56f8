"""Multi-query retrieval (issue #45 step 6): one prefill holding several needles, compressed once,
then one question per needle fed one after the other, each answer scored on its own by question
order. The trial construction, the protocol rules and the batching need no model; the run tests
are marked ``capture`` (the SmolLM2 GGUF): a tiny run passes its audit, its reference equals one
full forward over the whole sequence, and forged per-question results fail the audit.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from testbed import retrieval, retrieval_study
from testbed.audit import audit
from testbed.audit_checks import retrieval as audit_side
from testbed.schema import ProtocolError
from tests import _arrays
from tests._helpers import drop_row, forge_array, forge_results, protocol_run

ROOT = Path(__file__).resolve().parent.parent
KV_LINE = "\nThe special magic number for {key} is {value}."
KV_ASK = ("\nWhat is the special magic number for {key} mentioned in the provided text? The special magic number for "
          "{key} mentioned in the provided text is")


class ByteTokenizer:
    """Every UTF-8 byte one id (offset by 3)."""

    def encode(self, text, add_special_tokens=True):
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")


# -- trials (no model) ------------------------------------------------------------------------------

@pytest.mark.parametrize("needles", [2, 4, 6])
def test_every_needle_is_asked_once_in_order_and_each_answer_sits_in_its_own_needle(needles):
    tok = ByteTokenizer()
    for seed, depth in ((0, 0.0), (5, 0.5), (9, 1.0)):
        t = retrieval.make_trial(tok, "multi_query", 2000, depth, seed, needles=needles)
        ids, meta, queries = t["prefill_ids"], t["meta"], t["queries"]
        assert len(ids) == 2000 and len(queries) == len(meta["queries"]) == needles
        facts = retrieval.needles_of("multi_query", seed, needles)
        assert len({f["key"] for f in facts}) == len({f["value"] for f in facts}) == needles
        for q, m, f in zip(queries, meta["queries"], facts):
            # the k-th question asks for the k-th needle's key; its answer is that needle's value
            assert tok.decode(q["question_ids"]) == KV_ASK.format(key=f["key"])
            assert tok.decode(q["answer_ids"]) == " " + f["value"]
            assert tok.decode(ids[m["start"]:m["end"]]) == KV_LINE.format(key=f["key"], value=f["value"])
            assert (m["key"], m["value"]) == (f["key"], f["value"])
            assert (m["question_tokens"], m["answer_tokens"]) == (len(q["question_ids"]), len(q["answer_ids"]))
            assert tok.decode(ids).count(f["value"]) == 1  # the value is stated by its needle only
        # question 1 is the trial's asked needle: at its depth, as a multi_kv trial's
        assert (meta["queries"][0]["start"], meta["queries"][0]["end"]) == (t["needle_start"], t["needle_end"])
        assert t["question_ids"] == queries[0]["question_ids"] and t["answer_ids"] == queries[0]["answer_ids"]
        # the ids fed after the prefill: question 1, answer 1, question 2, answer 2, ...
        tail = retrieval.interleaved(t)
        text = "".join(KV_ASK.format(key=f["key"]) + " " + f["value"] for f in facts)
        assert tok.decode(tail) == text
        spans = sorted((m["start"], m["end"]) for m in meta["queries"])
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_the_audit_places_and_binds_a_multi_query_trial_and_catches_a_swapped_value():
    tok = ByteTokenizer()
    t = retrieval.make_trial(tok, "multi_query", 1500, 0.5, 3)
    w = {"task": "multi_query", "length": 1500, "depth": 0.5, "seed": 3,
         "facts": audit_side.needles_of("multi_query", 3, 4)}
    meta = {**t["meta"], "needle_start": t["needle_start"], "needle_end": t["needle_end"],
            "question_tokens": sum(len(q["question_ids"]) for q in t["queries"]),
            "answer_tokens": sum(len(q["answer_ids"]) for q in t["queries"])}
    assert [f["value"] for f in w["facts"]] == [q["value"] for q in meta["queries"]]
    prefill = np.asarray(t["prefill_ids"])
    assert audit_side._placement(meta, w, prefill, len(t["needle_ids"]), {}, "") == []

    class Ctx:
        numbers = 0

        def __init__(self):
            self.failures = []

        def fail(self, where, what):
            self.failures.append(f"{where}: {what}")

    ids = np.asarray(t["prefill_ids"] + retrieval.interleaved(t))
    ctx = Ctx()
    out = audit_side._bind_queries(ctx, "t", w, meta, ids, np.asarray(t["needle_ids"]), {}, "")
    assert ctx.failures == [] and [text for text, _ in out] == [" " + f["value"] for f in w["facts"]]
    # question 3's answer ids replaced by question 2's (same length): its needle does not state them
    forged = ids.copy()
    starts = np.cumsum([0] + [len(q["question_ids"]) + len(q["answer_ids"]) for q in t["queries"]])
    a2 = 1500 + starts[1] + len(t["queries"][1]["question_ids"])
    a3 = 1500 + starts[2] + len(t["queries"][2]["question_ids"])
    forged[a3:a3 + 8] = ids[a2:a2 + 8]
    ctx = Ctx()
    audit_side._bind_queries(ctx, "t", w, meta, forged, np.asarray(t["needle_ids"]), {}, "")
    assert any("query 3: answer ids" in f for f in ctx.failures), ctx.failures


def _raw(**extra) -> dict:
    return {"name": "mq", "kind": "retrieval", "default": False,
            "retrieval": {"tasks": ["multi_query"], "lengths": [512], "depths": [0.5], "trials": 1,
                          "policies": ["int4"], **extra}}


@pytest.mark.parametrize("change, message", [
    ({"question": ["after", "inside"]}, r"question: \['after', 'inside'\]: multi_query asks its questions"),
    ({"question": ["inside"]}, "multi_query asks its questions one after the other"),
    ({"lengths": [200]}, r"lengths\[0\]: 200 tokens cannot hold multi_query's 4 needles"),
    ({"needles": 1}, "needles"),
])
def test_a_bad_multi_query_block_is_a_protocol_error_naming_the_key(change, message):
    from testbed.protocol import validate_protocol

    validate_protocol(_raw(), "p")
    with pytest.raises(ProtocolError, match=message):
        validate_protocol(_raw(**change), "p")


def test_the_frontier_multiquery_protocol_validates_and_stays_out_of_the_default_run():
    from testbed.protocol import validate_protocol

    raw = json.loads((ROOT / "protocols" / "frontier_multiquery.json").read_text())
    proto = validate_protocol(raw, "frontier_multiquery")
    assert proto["default"] is False and proto["retrieval"]["tasks"] == ["multi_query"]
    assert proto["retrieval"]["lengths"] == [2048]
    defaults = [json.loads(p.read_text()) for p in (ROOT / "protocols").glob("*.json")]
    assert not any(d.get("default") and "multi_query" in json.dumps(d) for d in defaults)


def test_trials_of_other_query_layouts_are_never_batched_together():
    """multi_query trials of equal total question and answer tokens but another split between the
    queries go to separate batches (each batch feeds one layout), and the budget of a unit is
    derived at the trial's end: prefill + every question and answer."""
    p = retrieval.validate(_raw(policies=[{"name": "snap", "selection": {"kind": "snapkv", "mode": "prefill"},
                                           "budget": {"fp16_fraction": 0.5}}], batch=4)["retrieval"], "r")
    base = {"task": "multi_query", "length": 512, "depth": 0.5, "seed": 0, "ids": []}
    trials = [{**base, "case": f"t{i}", "trial": i, "question_ids": [0] * 40, "answer_ids": [0] * 8,
               "layout": lay} for i, lay in enumerate([[(30, 4), (10, 4)], [(30, 4), (10, 4)], [(20, 4), (20, 4)]])]
    units = retrieval_study.batch_units(p, trials)
    assert [[t["case"] for t in u["trials"]] for u in units if u["arm"] == 0] == [["t0", "t1"], ["t2"]]
    (_, pol), = retrieval_study.unit_arms(p, units[1])[1:]
    ctx = retrieval.budget_context(p, 512, 40, 8, "after")
    assert ctx["prefill"] == 512 and ctx["steps"] == 48
    assert pol.keep == dict(retrieval_study.arms_of(p, 512, 40, 8))["snap"].keep


# -- a tiny run on SmolLM2 --------------------------------------------------------------------------

ARMS = ["dynamic_cache", "float32", "streaming"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from testbed.sources import capture

    try:
        capture.load_model()
    except capture.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}; install with: {capture.INSTALL_HINT}")
    tmp = tmp_path_factory.mktemp("multiquery")
    proto = {"name": "mq", "kind": "retrieval", "description": "tiny", "default": False,
             "retrieval": {"tasks": ["multi_query"], "lengths": [256], "depths": [0.0, 1.0], "trials": 1,
                           "batch": 2, "window": 16, "group": 16, "evict_window": 16,
                           "policies": ["float32", "streaming"]},
             "timing": {"repeats": 0, "seed": 0}}
    return protocol_run(tmp, proto)


def _res(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())


def _row(res, arm, query, case="t0000"):
    return next(r for r in res["rows"] if r["arm"] == arm and r["query"] == query and r["case"] == case)


@pytest.mark.capture
@pytest.mark.slow
def test_run_passes_its_audit_with_a_row_per_trial_query_and_arm(run):
    ok, failures, _ = audit(run)
    assert ok, failures[:5]
    res = _res(run)
    assert sorted((r["case"], r["query"], r["arm"]) for r in res["rows"]) == sorted(
        (c, q, a) for c in ("t0000", "t0001") for q in (1, 2, 3, 4) for a in ARMS)
    report = (run / "report.md").read_text()
    assert "Task multi_query, teacher-forced exact match by question order:" in report
    header = next(ln for ln in report.splitlines() if ln.startswith("| arm ") and "question 1" in ln)
    assert [c.strip() for c in header.strip("|").split("|")][3:8] == [
        "question 1", "question 2", "question 3", "question 4", "all 4"]


@pytest.mark.capture
@pytest.mark.slow
def test_reference_equals_one_full_forward_at_every_answer_and_float32_matches_it(run):
    """Independent of the cache machinery: the model over the whole sequence (prefill, question 1,
    answer 1, ..., answer 4) in one forward, no cache, gives the stored reference log-probs and
    argmaxes of each question's answer, located from the case's recorded per-query token counts;
    the float32 policy's (which stores what DynamicCache stores) are the same."""
    from testbed.sources import capture

    model, _, _ = capture.load_model()
    res = _res(run)
    for case, rec in res["cases"]["mq"].items():
        ids = _arrays.load(run, rec["arrays"]["token_ids"]).astype(np.int64)
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(ids)[None], use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        pos = rec["meta"]["length"]
        for k, q in enumerate(rec["meta"]["queries"], start=1):
            start = pos + q["question_tokens"]
            answer = torch.from_numpy(ids[start:start + q["answer_tokens"]])
            want = logp[start - 1:start - 1 + q["answer_tokens"]]
            row = _row(res, "dynamic_cache", k, case)
            lp = _arrays.load(run, row["arrays"]["logprob"])
            np.testing.assert_allclose(lp, want.gather(-1, answer[:, None])[:, 0].numpy(), atol=2e-3)
            assert np.array_equal(_arrays.load(run, row["arrays"]["argmax"]), want.argmax(-1).numpy())
            assert row["tf_em"] == int(bool((want.argmax(-1) == answer).all()))
            f32 = _row(res, "float32", k, case)
            assert np.array_equal(_arrays.load(run, f32["arrays"]["argmax"]), want.argmax(-1).numpy())
            pos = start + q["answer_tokens"]
        assert pos == ids.size


FORGERIES = {
    "em_flipped": "query 3's reference row claims the other exact match (the report rewritten to agree)",
    "argmax_and_em": "query 2's argmax at its most confident position made wrong, EM and token count with it",
    "queries_swapped": "the reference rows of queries 1 and 4 exchange their query index",
    "row_dropped": "the streaming row of query 4 taken out with its arrays",
    "query_out_of_range": "a row claims query 5 of a 4-needle trial",
    "order_cell": "report.md's question 4 cell of the reference printed as another accuracy",
}


@pytest.mark.capture
@pytest.mark.slow
@pytest.mark.parametrize("what", sorted(FORGERIES))
def test_forged_per_question_results_fail_the_audit(run, tmp_path, what):
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    res = _res(dst)
    ref3 = _row(res, "dynamic_cache", 3)
    if what == "em_flipped":
        ref3["tf_em"] = 1 - ref3["tf_em"]
        forge_results(dst, res)
        expect = "query=3: tf_em"
    elif what == "argmax_and_em":
        row = _row(res, "dynamic_cache", 2)
        lp = _arrays.load(dst, row["arrays"]["logprob"])
        i = int(np.argmax(lp))
        assert lp[i] > np.log(0.5)  # so the stored argmax there is the answer's token: the audit requires it
        forge_array(dst, row["arrays"]["argmax"], lambda x: x.__setitem__(i, x[i] + 1))
        row["tf_tokens_correct"] -= 1
        row["tf_em"] = 0
        forge_results(dst, res)
        expect = f"query=2: argmax[{i}]"
    elif what == "queries_swapped":  # the arrays then score another needle's answer
        a, b = _row(res, "dynamic_cache", 1), _row(res, "dynamic_cache", 4)
        a["query"], b["query"] = 4, 1
        forge_results(dst, res)
        expect = "arm=dynamic_cache query="
    elif what == "row_dropped":
        drop_row(dst, res, _row(res, "streaming", 4))
        expect = "query 4 arm streaming is missing"
    elif what == "query_out_of_range":
        ref3["query"] = 5
        forge_results(dst, res, redraw=False)
        expect = "query 5: a multi_query row names its question, 1 to 4"
    else:
        doc = (dst / "report.md").read_text()
        line = next(ln for ln in doc.splitlines() if ln.startswith("| dynamic_cache ") and ln.count("%") >= 5)
        cells = line.split("|")
        cells[7] = " 37.5 % " if cells[7].strip() != "37.5 %" else " 62.5 % "
        (dst / "report.md").write_text(doc.replace(line, "|".join(cells), 1))
        m = json.loads((dst / "manifest.json").read_text())
        m["files"]["report.md"] = hashlib.sha256((dst / "report.md").read_bytes()).hexdigest()
        (dst / "manifest.json").write_text(json.dumps(m, indent=1))
        expect = "column 'question 4'"
    ok, failures, _ = audit(dst)
    assert not ok
    assert any(expect in f for f in failures), failures[:6]


@pytest.mark.capture
@pytest.mark.slow
def test_replay_refuses_a_multi_query_study_by_name(run):
    """replay rebuilds a retrieval unit's question and answer as the ids after the prefill in one
    piece; a multi_query trial's are interleaved, so replay says it does not support the task yet
    rather than feed the wrong tokens."""
    from testbed.replay import BadInput, plan_units

    with pytest.raises(BadInput, match="multi_query is not supported yet"):
        plan_units(run)


def test_accuracy_by_question_order_counts_each_question_over_trials():
    """The run side's table by question order and the audit's expected cells, on rows whose exact
    matches are written here: 4 trials x 4 questions of one arm; per question 4, 3, 1, 0 found;
    all four found in none; the last question against the first: b = 4 (first right, last
    wrong), c = 0, exact McNemar p = 2 * 0.5**4 = 0.125."""
    from testbed.audit_checks import report_format as fmt

    hits = {"t0": [1, 1, 1, 0], "t1": [1, 1, 0, 0], "t2": [1, 1, 0, 0], "t3": [1, 0, 0, 0]}
    rows = [{"task": "multi_query", "arm": "dynamic_cache", "length": 512, "case": c, "query": k + 1, "tf_em": h[k],
             "greedy_em": h[k], "answer_logprob": -float(k)} for c, h in hits.items() for k in range(4)]
    (e,) = retrieval_study.by_order(rows)
    assert (e["trials"], e["correct"], e["all"]) == (4, [4, 3, 1, 0], 0)
    assert (e["mcnemar"]["b"], e["mcnemar"]["c"]) == (4, 0) and e["mcnemar"]["p"] == pytest.approx(0.125)
    assert e["mean_logprob"] == pytest.approx(-1.5)
    p = {**audit_side.DEFAULTS, "tasks": ["multi_query"], "policies": [], "needles": 4, "depths": [0.5]}
    blocks = audit_side._order_tables(rows, p)
    (table,) = [b for b in blocks if b["kind"] == "table"]
    tol = {"atol": 0.0, "rtol": 0.0}
    (line,) = table["rows"]
    assert [fmt.render(c, tol) for c in line] == [
        "dynamic_cache", "512", "4", "100.0 %", "75.0 %", "25.0 %", "0.0 %", "0.0 %", "-1.500", "0.1250 (4/0)"]
    text = retrieval_study.report(rows, {"needles": 4, "trials": 4, "depths": [0.5]})
    line = next(ln for ln in text.splitlines() if ln.startswith("| dynamic_cache"))
    assert [c.strip() for c in line.strip("|").split("|")] == [fmt.render(c, tol) for c in table["rows"][0]]
