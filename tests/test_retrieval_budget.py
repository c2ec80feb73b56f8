"""Retrieval at byte budgets, with the question after and inside the compressed prefill (issue #44
step 5): budgets derived per trial land within the tolerance below, an unreachable one is an
error naming the arm before anything is written; with the question inside, a float32 policy
scores as the reference and a prefill-mode scorer really compresses haystack + question; the
audit catches forged placements and kept counts.

The budget tests need no model; the run tests are marked ``capture`` (the SmolLM2 GGUF)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from testbed import retrieval, retrieval_study
from testbed.audit import audit
from testbed.protocol import ProtocolError
from tests import _arrays
from tests._helpers import forge_results, tiny_retrieval_run

ROOT = Path(__file__).resolve().parent.parent
# SmolLM2-135M: layers, KV heads, head dim (written here from the model card, not imported)
L, H, D = 30, 3, 64
HEADER = 16


def _params(policies, **extra) -> dict:
    raw = {"tasks": ["passkey"], "lengths": [2048], "depths": [0.5], "trials": 1, "policies": policies, **extra}
    return retrieval.validate(raw, "retrieval")


def _declared(name, selection, fraction):
    return {"name": name, "selection": selection, "budget": {"fp16_fraction": fraction}}


BUDGETED = [_declared(f"{kind}_{mode}_{int(1 / f)}", {"kind": kind, "mode": mode}, f)
            for kind, mode in (("snapkv", "prefill"), ("knorm", "prefill"), ("tova", "online"), ("h2o", "online"))
            for f in (0.5, 0.25, 0.125)] + [
    _declared(f"stream_{int(1 / f)}", {"kind": "sink_window", "sink": 4}, f) for f in (0.5, 0.25, 0.125)]


def _bytes_at_end(pol, length: int, n_q: int, n_a: int, question: str) -> int:
    """Whole-cache bytes at the trial's end, from the docs' closed form (docs/live.md, "Scored
    selections"): per layer a 16-byte header and, per KV head and held token, float32 K and V plus,
    for a scored selection, an int32 index and a float32 score."""
    n = length + n_q + n_a
    prefill = length + (n_q if question == "inside" else 0)
    if pol.scored:
        held = pol.keep if pol.scorer_mode == "online" else min(pol.keep, prefill) + n - prefill
        per = 8 * D + 8
    else:
        held, per = min(n, pol.sink + pol.window), 8 * D
    return L * (HEADER + H * min(held, n) * per)


@pytest.mark.parametrize("length", [2048, 4096, 8064])
@pytest.mark.parametrize("question", ["after", "inside"])
def test_budgets_land_within_one_percent_below_at_every_trial_end(length, question):
    """Every budgeted arm, at each haystack length and question placement, for the question and
    answer token counts of passkey (12 + 6) and kv tasks (up to 40 + 8): its bytes at the trial's
    end are at most the budget and at most 1 % below it; the kept count depends on the length."""
    p = _params(BUDGETED)
    keeps = {}
    for n_q, n_a in ((12, 6), (33, 8), (40, 8)):
        arms = retrieval_study.arms_of(p, length, n_q, n_a, question)
        for name, pol in arms[1:]:
            fraction = next(e["budget"]["fp16_fraction"] for e in BUDGETED if e["name"] == name)
            n = length + n_q + n_a
            target = fraction * n * L * 2 * H * D * 2
            got = _bytes_at_end(pol, length, n_q, n_a, question)
            assert got <= target and (target - got) / target <= 0.01, (name, n_q, n_a, got, target)
            keeps[name] = pol.keep or pol.window
    short = dict(retrieval_study.arms_of(p, 2048 if length != 2048 else 4096, 12, 6, question)[1:])
    assert all((short[k].keep or short[k].window) != v for k, v in keeps.items())


def test_inside_keeps_the_question_in_a_prefill_mode_budget():
    """At one budget a prefill-mode arm's kept prefill is n_q tokens larger when the question is
    inside it (the question is no longer a decode step it must keep); an online arm's is the same."""
    p = _params(BUDGETED)
    after = dict(retrieval_study.arms_of(p, 2048, 12, 6, "after"))
    inside = dict(retrieval_study.arms_of(p, 2048, 12, 6, "inside"))
    assert inside["snapkv_prefill_2"].keep == after["snapkv_prefill_2"].keep + 12
    assert inside["tova_online_2"].keep == after["tova_online_2"].keep


def test_an_unreachable_budget_is_one_error_naming_the_arm(tmp_path):
    """snapkv at 1/8 of float16 on a 512-token haystack would keep fewer than its observation window
    of 64: the protocol is refused with one error line naming the arm, and nothing is written."""
    from testbed.run import main as run_main

    proto = json.loads((ROOT / "protocols" / "retrieval_small.json").read_text())
    proto.update(name="unreach", default=False)
    proto["retrieval"].update(lengths=[512], policies=["int4", _declared("snapkv_pre_eighth",
                                                                         {"kind": "snapkv", "mode": "prefill"}, 0.125)],
                              question=["after", "inside"])
    path = tmp_path / "unreach.json"
    path.write_text(json.dumps(proto))
    out = tmp_path / "out"
    with pytest.raises(ProtocolError, match="snapkv_pre_eighth"):
        retrieval.validate(proto["retrieval"], "retrieval")
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(path)]) == 2
    assert not out.exists()


def test_a_budget_out_of_tolerance_at_the_trials_counts_is_refused_before_any_unit():
    """The fields pass at the protocol's reading (no tolerance there: the token counts are the
    tokenizer's); at plan, the trials' exact counts and a tolerance no kept count meets name the arm."""
    p = _params([_declared("tova_q", {"kind": "tova"}, 0.25)], budget_tolerance=0.0001)
    ids = list(range(2048 + 12 + 6))
    trials = [{"case": "t0000", "task": "passkey", "length": 2048, "depth": 0.5, "trial": 0, "seed": 1,
               "question_ids": ids[2048:2060], "answer_ids": ids[2060:], "ids": ids}]
    units = retrieval_study.batch_units(p, trials)
    with pytest.raises(ProtocolError, match="tova_q"):
        retrieval_study.check_units(p, units, "study.retrieval")


def test_after_only_units_are_as_before_and_inside_doubles_them():
    """A study without ``question`` plans the units it planned before (no placement in them); with
    both placements every batch has two sets, the inside ones marked."""
    ids = list(range(256 + 12 + 6))
    trials = [{"case": "t0000", "task": "passkey", "length": 256, "depth": 0.5, "trial": 0, "seed": 1,
               "question_ids": ids[256:268], "answer_ids": ids[268:], "ids": ids}]
    p = _params(["int4", "streaming"], lengths=[256])
    units = retrieval_study.batch_units(p, trials)
    assert [u["label"] for u in units] == ["batch 1/1 dynamic_cache", "batch 1/1 int4", "batch 1/1 streaming"]
    assert all("question" not in u for u in units) and [u["needs"] for u in units] == [None, 0, 0]
    both = retrieval_study.batch_units({**p, "question": ["after", "inside"]}, trials)
    assert [u.get("question") for u in both] == [None] * 3 + ["inside"] * 3
    assert [u["needs"] for u in both] == [None, 0, 0, None, 3, 3]


# -- runs inside the model -------------------------------------------------------------------------

ARMS = ["dynamic_cache", "float32", "knorm_pre_half", "stream_half"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_retrieval_run(tmp_path_factory, "rb", ["float32",
                                                      _declared("knorm_pre_half", {"kind": "knorm", "mode": "prefill"}, 0.5),
                                                      _declared("stream_half", {"kind": "sink_window", "sink": 4}, 0.5)],
                              tasks=["passkey"], lengths=[256], depths=[0.0, 1.0], trials=1, budget_tolerance=0.03)


def _res(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())


def _row(res, arm, question, case="t0000"):
    return next(r for r in res["rows"] if r["arm"] == arm and r["question"] == question and r["case"] == case)


@pytest.mark.capture
@pytest.mark.slow
def test_run_passes_its_audit_with_a_row_per_trial_placement_and_arm(run):
    ok, failures, _ = audit(run)
    assert ok, failures[:5]
    res = _res(run)
    assert {(r["case"], r["question"], r["arm"]) for r in res["rows"]} == {
        (c, q, a) for c in ("t0000", "t0001") for q in ("after", "inside") for a in ARMS}
    report = (run / "report.md").read_text()
    assert "Task passkey, question after the compressed prefill:" in report
    assert "Task passkey, question inside the compressed prefill:" in report


@pytest.mark.capture
@pytest.mark.slow
def test_inside_float32_policy_scores_as_the_reference_and_the_first_token_is_shared(run):
    """With the question inside and no compression (float32) the answer log-probs are the
    reference's (|Δ| <= 1e-5); the first answer token's log-prob is the shared prefill's, the same
    in every arm, compressing or not."""
    res = _res(run)
    for case in ("t0000", "t0001"):
        ref = _arrays.load(run, _row(res, "dynamic_cache", "inside", case)["arrays"]["logprob"])
        f32 = _arrays.load(run, _row(res, "float32", "inside", case)["arrays"]["logprob"])
        assert np.max(np.abs(ref - f32)) <= 1e-5
        for arm in ARMS[2:]:
            lp = _arrays.load(run, _row(res, arm, "inside", case)["arrays"]["logprob"])
            assert lp[0] == ref[0]


@pytest.mark.capture
@pytest.mark.slow
def test_inside_reference_equals_one_full_forward(run):
    """Independent of the cache machinery: the model over the whole sequence in one forward gives
    the stored inside reference log-probs and argmaxes."""
    from testbed.sources import models

    model, _, _ = models.load_model()
    res = _res(run)
    for case, rec in res["cases"]["rb"].items():
        ids = _arrays.load(run, rec["arrays"]["token_ids"]).astype(np.int64)
        n_a = rec["meta"]["answer_tokens"]
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(ids)[None], use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits[-n_a - 1:-1], -1)
        row = _row(res, "dynamic_cache", "inside", case)
        lp = _arrays.load(run, row["arrays"]["logprob"])
        np.testing.assert_allclose(lp, logp.gather(-1, torch.from_numpy(ids[-n_a:])[:, None])[:, 0].numpy(), atol=2e-3)


@pytest.mark.capture
@pytest.mark.slow
def test_inside_prefill_is_compressed_to_keep_tokens_of_haystack_and_question():
    """snapkv at the prefill, question inside: after the shared prefill of haystack + question every
    layer holds exactly ``keep`` tokens, fewer than the prefill, the question's among them (its
    observation window is the prefill's last 64 tokens); with the question after, the question is
    not in the compressed prefill and the kept count is n_q smaller."""
    from transformers import DynamicCache  # noqa: F401 - transformers present (capture extra)

    from testbed.live import shared_prefill
    from testbed.sources import models

    model, tokenizer, _ = models.load_model()
    kw = models.forward_kwargs(model)
    tr = retrieval.make_trial(tokenizer, "passkey", 512, 0.5, 7)
    P, n_q, n_a = 512, len(tr["question_ids"]), len(tr["answer_ids"])
    ids = torch.tensor([tr["prefill_ids"] + tr["question_ids"] + tr["answer_ids"]])
    p = _params([_declared("snap", {"kind": "snapkv", "mode": "prefill"}, 0.5)], lengths=[512])
    for question, pre in (("inside", P + n_q), ("after", P)):
        (_, pol), = retrieval_study.arms_of(p, P, n_q, n_a, question)[1:]
        with torch.no_grad():
            shared, _ = shared_prefill(model, kw, ids[:, :pre], query_tail=64)
            cache = retrieval_study._new_cache(model, pol, p)
            shared.load_into(cache)
        assert pol.keep < pre
        for layer in cache.layers:
            assert layer.held_tokens() == pol.keep
            kept = set(layer.kept_index[0].flatten().tolist())
            assert max(kept) == pre - 1
            if question == "inside":
                assert set(range(P, P + n_q)) <= kept
        if question == "inside":
            keep_inside = pol.keep
    assert keep_inside == pol.keep + n_q


@pytest.mark.capture
@pytest.mark.slow
@pytest.mark.parametrize("what", ["question_flipped", "keep_changed", "question_dropped"])
def test_forged_placements_and_kept_counts_fail(run, tmp_path, what):
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    res = _res(dst)
    row = _row(res, "knorm_pre_half", "inside")
    if what == "question_flipped":  # an inside row claimed as one of the question after
        row["question"] = "after"
        expect = "question inside arm knorm_pre_half is missing"
    elif what == "keep_changed":  # one more kept token claimed
        row["policy"]["keep"] += 1
        expect = "policy.keep"
    else:  # the placement left out of a row of a study that has two
        del row["question"]
        expect = "question None"
    forge_results(dst, res, redraw=False)
    ok, failures, _ = audit(dst)
    assert not ok
    assert any(expect in f for f in failures), failures[:6]
