"""Audit of the needle retrieval study's rows (numpy and stdlib only; no model, no tokenizer).

For every (trial, arm) row, from the stored arrays and the frozen protocol:

- the trial: its stored ``token_ids`` are the prefill (exactly ``length`` tokens), the question
  and the answer (the case's recorded counts), and the stored ``needle_ids`` sit at
  ``[needle_start, needle_end)`` of the prefill (:func:`retrieval_stats.trial_problems`); the
  answer ids a row is scored against are the last ``answer_tokens`` of ``token_ids``;
- the row's numbers: ``answer_tokens``, ``answer_logprob`` (the float64 sum of the stored per-token
  log-probabilities), ``tf_tokens_correct`` and ``tf_em`` (stored argmax against the answer ids),
  ``greedy_tokens_correct`` and ``greedy_em`` (stored generated tokens against the answer ids);
  the row's task, length, depth, trial and seed against its case; a policy's config against the
  audit's own table of the presets (``live_quality.POLICY_TABLE``), a peer's parameters;
- between the arrays: a log-prob above ln 1/2 must be the argmax's, the argmax's log-prob is at
  least -ln V, and the greedy tokens equal the teacher-forced argmaxes up to the first miss
  (:func:`_cross_checks`);
- once per study: exactly the trials of the grid (task x length x depth x trial, in that order,
  ``t0000`` on), each with its coordinates, distinct seeds and distinct answers, and exactly one row
  per (trial, arm) of the protocol's arms.

What it cannot re-derive: the log-probabilities, argmaxes and generated tokens rest on model
forward passes (checked for shape, dtype, finiteness and sign only), and the token ids rest on the
tokenizer: that the needle, question and answer ids encode the recorded texts is not checked (the
audit has no tokenizer), nor that the seeds are the ones the study seed derives.
The report's accuracies, Wilson intervals and McNemar p-values are re-derived from these rows in
``report_md.py`` with :mod:`retrieval_stats`.
"""

from __future__ import annotations

import math

import numpy as np

from . import retrieval_stats
from .live_quality import _policy, check_grid, policy_names

__all__ = ["check", "check_study", "params_of", "arms_of", "expected_trials", "REFERENCE", "DEFAULTS"]

REFERENCE = "dynamic_cache"
# the run side's schema defaults, the audit's own statement of them (a frozen copy is as written)
DEFAULTS = {"trials": 8, "seed": 0, "needles": 4, "peers": [], "window": 128, "group": 32, "sink": 4,
            "evict_window": 256, "batch": 4}
PEER_GROUP = 64
VOCAB = 49152  # SmolLM2's vocabulary (the only model of the study)
LOGPROB_CEILING = 1e-5  # a log-probability above this is not one (float32 log_softmax rounding allowed)


def params_of(ctx, study) -> dict:
    proto = ctx.protocol_copies.get(study)
    if not isinstance(proto, dict) or proto.get("kind") != "retrieval" or not isinstance(proto.get("retrieval"), dict):
        raise ValueError(f"study {study!r} has no frozen retrieval protocol copy")
    return {**DEFAULTS, **proto["retrieval"]}


def arms_of(p: dict) -> list[str]:
    return [REFERENCE] + policy_names(p) + [f"quanto_int{x['bits']}" for x in p.get("peers", [])]


def expected_trials(p: dict) -> list[dict]:
    """The grid in the run's order: ``{"case", "task", "length", "depth", "trial"}``."""
    out = []
    for task in p["tasks"]:
        for length in p["lengths"]:
            for depth in p["depths"]:
                for t in range(p["trials"]):
                    out.append({"case": f"t{len(out):04d}", "task": task, "length": int(length),
                                "depth": float(depth), "trial": t})
    return out


def _trial(ctx, study: str, cid: str) -> dict:
    """The trial's stored ids, checked once (problems are FAIL lines naming the case)."""
    def build():
        where = f"results.json cases.{study}.{cid}"
        rec = ctx.case_record(study, cid)
        meta = rec.get("meta") if isinstance(rec.get("meta"), dict) else {}
        ids = ctx.load(rec["arrays"].get("token_ids"))
        needle = ctx.load(rec["arrays"].get("needle_ids"))
        P, nq, na = meta.get("length"), meta.get("question_tokens"), meta.get("answer_tokens")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (P, nq, na)):
            raise ValueError(f"{where}: meta length, question_tokens, answer_tokens must be positive integers")
        if ids.ndim != 1 or ids.dtype != np.int32 or ids.size != P + nq + na:
            ctx.fail(where, f"token_ids must be int32 [{P + nq + na}] (prefill, question, answer), "
                            f"got {ids.dtype} {list(ids.shape)}")
        trial = {"prefill_ids": ids[:P], "needle_ids": needle, "needle_start": meta.get("needle_start"),
                 "needle_end": meta.get("needle_end"), "question_ids": ids[P:P + nq], "answer_ids": ids[P + nq:],
                 "meta": {"length": P}}
        ctx.numbers += 1
        for problem in retrieval_stats.trial_problems(trial):
            ctx.fail(where, problem)
        return {"meta": meta, "answer": ids[P + nq:].astype(np.int64), "answer_tokens": na}
    return ctx.cached(("retrieval_trial", study, cid), build)


def check_study(ctx, study: str, p: dict) -> bool:
    """Once per study: the grid's trials and exactly one row per (trial, arm)."""
    where = f"results.json {study}"
    want = expected_trials(p)
    cases = ctx.results.get("cases", {}).get(study, {})
    if not isinstance(cases, dict):
        ctx.fail(where, "cases must be an object")
        return True
    names = [w["case"] for w in want]
    for cid in sorted(set(names) - set(cases)):
        ctx.fail(f"{where} {cid}", "missing: the protocol's grid has this trial")
    for cid in sorted(set(cases) - set(names)):
        ctx.fail(f"{where} {cid}", "not a trial of the protocol's grid")
    seeds, answers = {}, {}
    for w in want:
        rec = cases.get(w["case"])
        if not isinstance(rec, dict):
            continue
        meta = rec.get("meta") if isinstance(rec.get("meta"), dict) else {}
        for key in ("task", "length", "depth", "trial"):
            ctx.numbers += 1
            if meta.get(key) != w[key] or type(meta.get(key)) is not type(w[key]):
                ctx.fail(f"{where} {w['case']}", f"meta.{key}: case says {meta.get(key)!r}, the grid gives {w[key]!r}")
        for name, seen, value in (("seed", seeds, meta.get("seed")), ("answer", answers, meta.get("answer"))):
            if value in seen:
                ctx.fail(f"{where} {w['case']}", f"{name} {value!r} repeats trial {seen[value]}'s: trials must be independent")
            seen[value] = w["case"]
    arms = arms_of(p)
    check_grid(ctx, study, where, names, arms, "trial")
    return True


def _ids(ctx, row, arrays, name, n):
    x = ctx.load(arrays.get(name))
    if x.ndim != 1 or x.size != n or x.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integer [{n}], got {x.dtype} {list(x.shape)}")
    return x.astype(np.int64)


def _cross_checks(row, ctx, lp, argmax, generated, answer) -> None:
    """What the three stored arrays imply about each other (each is a model output the audit
    cannot recompute, but they are not independent):

    - a token whose log-probability exceeds ln(1/2) has probability above one half, so it is the
      argmax: ``logprob[i] > ln 1/2`` implies ``argmax[i] == answer[i]``;
    - the argmax token has probability at least 1/V (V the vocabulary), so
      ``argmax[i] == answer[i]`` implies ``logprob[i] >= -ln V``;
    - greedy decoding and teacher forcing read the same tokens (the question, then the answer's
      tokens) up to the first position where the argmax is not the answer's token, so there the
      generated token is the argmax: ``generated[i] == argmax[i]`` for every ``i`` up to and
      including the first miss (up to a near-tie flipped by the different chunking of the two
      passes, which would be a FAIL worth reading).
    """
    ctx.numbers += 3 * lp.size
    half, floor = math.log(0.5), -math.log(VOCAB)
    for i in range(lp.size):
        if float(lp[i]) > half + 1e-6 and argmax[i] != answer[i]:
            ctx.fail(row, f"argmax[{i}] = {int(argmax[i])}, but the answer's token {int(answer[i])} has log-prob "
                          f"{float(lp[i]):.6g} > ln 1/2, so it is the argmax")
        if argmax[i] == answer[i] and float(lp[i]) < floor - 1e-4:
            ctx.fail(row, f"argmax[{i}] is the answer's token, yet its log-prob {float(lp[i]):.6g} is below -ln V")
    miss = np.flatnonzero(argmax != answer)
    upto = int(miss[0]) + 1 if miss.size else argmax.size
    diff = np.flatnonzero(generated[:upto] != argmax[:upto])
    if diff.size:
        i = int(diff[0])
        ctx.fail(row, f"generated[{i}] = {int(generated[i])}, argmax[{i}] = {int(argmax[i])}: greedy decoding read the "
                      "same tokens as teacher forcing up to there, so the two must agree")


def check(row: dict, ctx) -> None:
    study = row.get("study")
    p = params_of(ctx, study)
    ctx.cached(("retrieval_study", study), lambda: check_study(ctx, study, p))
    arm, kind = row.get("arm"), row.get("kind")
    policies = set(policy_names(p))
    peers = {f"quanto_int{x['bits']}": x for x in p.get("peers", [])}
    want_kind = "reference" if arm == REFERENCE else "policy" if arm in policies else "peer" if arm in peers else None
    if want_kind is None or kind != want_kind:
        raise ValueError(f"arm {arm!r} (kind {kind!r}) is not an arm of the protocol")
    trial = _trial(ctx, study, row.get("case"))
    meta = trial["meta"]
    for key in ("task", "length", "depth", "trial", "seed"):
        ctx.equal(row, key, row.get(key), meta.get(key))
    answer, n = trial["answer"], trial["answer_tokens"]
    arrays = row.get("arrays") if isinstance(row.get("arrays"), dict) else {}
    if set(arrays) != {"logprob", "argmax", "generated"}:
        raise ValueError(f"arrays {sorted(arrays)}: a row stores exactly logprob, argmax and generated")
    lp = ctx.load(arrays.get("logprob"))
    if lp.ndim != 1 or lp.size != n or lp.dtype != np.float32:
        raise ValueError(f"logprob must be float32 [{n}], got {lp.dtype} {list(lp.shape)}")
    if not np.all(np.isfinite(lp)) or float(lp.max()) > LOGPROB_CEILING:
        ctx.fail(row, f"logprob: log-probabilities must be finite and <= 0, got max {float(lp.max())!r}")
    argmax = _ids(ctx, row, arrays, "argmax", n)
    generated = _ids(ctx, row, arrays, "generated", n)
    ctx.equal(row, "answer_tokens", row.get("answer_tokens"), n)
    ctx.close(row, "answer_logprob", row.get("answer_logprob"), math.fsum(float(x) for x in lp))
    tf_hits, greedy_hits = int((argmax == answer).sum()), int((generated == answer).sum())
    ctx.equal(row, "tf_tokens_correct", row.get("tf_tokens_correct"), tf_hits)
    ctx.equal(row, "tf_em", row.get("tf_em"), int(tf_hits == n))
    ctx.equal(row, "greedy_tokens_correct", row.get("greedy_tokens_correct"), greedy_hits)
    ctx.equal(row, "greedy_em", row.get("greedy_em"), int(greedy_hits == n))
    _cross_checks(row, ctx, lp, argmax, generated, answer)
    if kind == "policy":
        got = row.get("policy") if isinstance(row.get("policy"), dict) else {}
        for key, val in _policy(arm, p).items():
            ctx.equal(row, f"policy.{key}", got.get(key), val)
        ctx.equal(row, "policy.name", got.get("name"), arm)
    elif kind == "peer":
        got = row.get("peer") if isinstance(row.get("peer"), dict) else {}
        want = {"backend": "quanto", "bits": peers[arm]["bits"], "q_group_size": PEER_GROUP,
                "residual_length": p["window"]}
        for key, val in want.items():
            ctx.equal(row, f"peer.{key}", got.get(key), val)
    elif "policy" in row or "peer" in row:
        raise ValueError("the reference row carries a policy or peer config")
