"""The needle retrieval study (issue #32): RULER-style trials through every cache arm.

Per trial (:func:`testbed.retrieval.make_trial`) the model reads the haystack once, in float32,
through a ``DynamicCache`` (:func:`testbed.live.shared_prefill`); every arm's cache then takes
that prefill (:meth:`~testbed.live.SharedPrefill.load_into`: a policy applies to what it stores
after the prefill, exactly as if it had run the prefill itself). The question is not compressed
with the context: it goes through the arm's cache after the prefill, as kvpress feeds it.

Per (trial, arm):

- **teacher forced**: the question, then the answer but its last token, are fed through the arm's
  cache (a policy in chunks up to its next change of stored state, :func:`testbed.live.chunk_schedule`,
  inside :func:`testbed.policies.cache.policy_attention`; quanto one token per forward; the
  reference in chunks of ``CHUNK``). Scored: the log-probability of every answer token (their sum
  is the answer's log-probability) and the argmax at each answer position; teacher-forced exact
  match (``tf_em``) = every answer token is the argmax.
- **greedy**: a second copy of the arm's cache takes the same shared prefill, reads the question,
  then generates ``len(answer)`` tokens, each argmax fed back; ``greedy_em`` = the generated
  tokens are the answer. (With deterministic argmaxes greedy EM equals teacher-forced EM; both are
  measured, and the generated tokens stored.)

Arms: ``dynamic_cache`` (the float32 reference, which continues the shared prefill's own cache),
the protocol's policies and its quanto peers (transformers' ``QuantizedCache``). Trials are the
statistical units: accuracy per (task, length, arm) with a Wilson 95 % interval, and the exact
McNemar test of each arm against the reference over the same trials.

Units: one per (batch of trials, arm), the reference of each batch first. Trials are batched only
where their prefill, question and answer token counts are equal (no padding anywhere).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

import numpy as np
import torch

from . import retrieval
from .live import (REFERENCE, _arms, _forward, _mass_candidates, _warm_quanto, batch_note, chunk_schedule, cost_kind,
                   scored_needs, shared_prefill)
from .policies import Policy
from .sources.capture import INSTALL_HINT, MODEL_ID, MODELS, CaptureUnavailable, _forward_kwargs, _hardware, _software, load_model

__all__ = ["estimate_bytes", "plan", "batch_units", "run_unit", "report", "summarize", "arms_of", "CHUNK", "REFERENCE",
           "ANALYSIS"]

ANALYSIS = "retrieval"
CHUNK = 256  # tokens per forward of the reference (exact in any chunking)


def arms_of(p: dict) -> list[tuple[str, object]]:
    """(name, what) of every arm, the reference first: the live study's arms (what is None, a Policy
    or a peer's dict)."""
    return _arms(p)


def estimate_bytes(p: dict) -> int:
    """Peak bytes: the float32 model, the prefill's activations, the shared prefill's K/V held
    beside two caches of the batch (the arm's and its greedy copy, each at most float32 K/V), and
    the log-probabilities of the answer positions."""
    dims = MODELS[MODEL_ID]
    b, n = p["batch"], max(p["lengths"]) + 64
    activations = b * max(p["lengths"]) * dims.get("intermediate", 4 * 576) * 4 * 4 + (256 << 20)
    cache = 3 * 2 * dims["layers"] * dims["kv_heads"] * n * dims["head_dim"] * 4 * b
    logits = b * CHUNK * dims["vocab"] * 4 * 2
    return dims["parameters"] * 4 + activations + cache + logits


def _batches(trials: list[dict], size: int) -> list[list[dict]]:
    """Trials grouped by (task, length, question tokens, answer tokens) in grid order, then cut
    into batches of at most ``size``."""
    groups: dict[tuple, list] = {}
    for t in trials:
        groups.setdefault((t["task"], t["length"], len(t["question_ids"]), len(t["answer_ids"])), []).append(t)
    return [ts[i:i + size] for ts in groups.values() for i in range(0, len(ts), size)]


def case_id(index: int) -> str:
    return f"t{index:04d}"


def plan(proto: dict, ctx, protocol_path=None) -> tuple[dict, list[dict]]:
    """The model, the grid of trials (their token ids stored as the cases' arrays) and the units,
    one per (batch of trials, arm), the reference of each batch first."""
    p = proto["retrieval"]
    study, store = ctx.study, ctx.store
    try:
        model, tokenizer, info = load_model(progress=ctx.progress)
    except CaptureUnavailable as e:
        ctx.excluded.append({"id": f"{study}/{MODEL_ID}", "stage": e.stage, "error": f"{e}; install with: {INSTALL_HINT}"})
        print(f"[{study}] retrieval study skipped: {e}; install with: {INSTALL_HINT}", file=sys.stderr, flush=True)
        return {}, []
    t0 = time.perf_counter()
    cells = retrieval.grid(p["tasks"], p["lengths"], p["depths"], p["trials"], p["seed"], needles=p["needles"])
    trials, cases = [], {}
    for c in cells:
        tr = retrieval.make_trial(tokenizer, c["task"], c["length"], c["depth"], c["seed"], needles=p["needles"])
        cid = case_id(c["index"])
        ids = np.asarray(tr["prefill_ids"] + tr["question_ids"] + tr["answer_ids"], dtype=np.int32)
        arrays = {"token_ids": store.save(f"{study}/{cid}/token_ids", ids),
                  "needle_ids": store.save(f"{study}/{cid}/needle_ids", np.asarray(tr["needle_ids"], dtype=np.int32))}
        meta = {"source": "retrieval", "model": MODEL_ID, "task": c["task"], "length": c["length"], "depth": c["depth"],
                "trial": c["trial"], "seed": c["seed"], "needle_start": tr["needle_start"], "needle_end": tr["needle_end"],
                "question_tokens": len(tr["question_ids"]), "answer_tokens": len(tr["answer_ids"]),
                **{k: v for k, v in tr["meta"].items() if k not in ("task", "seed", "length", "depth")}}
        cases[cid] = {"id": cid, "causal": True, "layout": [], "tokens_per_frame": None, "head_map": None, "meta": meta,
                      "arrays": arrays}
        trials.append({"case": cid, "task": c["task"], "length": c["length"], "depth": c["depth"], "trial": c["trial"],
                       "seed": c["seed"], "question_ids": tr["question_ids"], "answer_ids": tr["answer_ids"],
                       "ids": ids.tolist()})
    ctx.progress(f"[{study}] {len(trials)} trials built ({time.perf_counter() - t0:.1f} s)")
    arms = arms_of(p)
    ctx.extra_files[f"{study}/retrieval_manifest.json"] = (json.dumps({
        "schema_version": 1,
        "experiment": f"{study}: needle retrieval through cache policies inside {MODEL_ID} (float32)",
        "model": {k: v for k, v in info.items() if k not in ("load_seconds", "loaded_from")},
        "fed_as": retrieval.FED_AS, "arms": [a for a, _ in arms], "trials": len(trials),
        "software": _software(), "hardware": _hardware(),
    }, indent=1) + "\n").encode("utf-8")
    return cases, batch_units(p, trials)


def batch_units(p: dict, trials: list[dict]) -> list[dict]:
    """The units of a retrieval study, one per (batch of trials, arm), the reference of each batch
    first (:func:`plan`; :mod:`testbed.replay` rebuilds the same units from a finished run's arrays)."""
    arms = arms_of(p)
    batches = _batches(trials, p["batch"])
    units = []
    for bi, batch in enumerate(batches):
        ref = len(units)
        n_q, n_a = len(batch[0]["question_ids"]), len(batch[0]["answer_ids"])
        for j, (arm, what) in enumerate(arms):
            step = what is not None and not isinstance(what, Policy)
            forwards = 1 + (n_q + n_a - 1 + n_q + n_a - 1 if step else 2 * n_a + 2)
            units.append({"label": f"batch {bi + 1}/{len(batches)} {arm}", "batch": bi, "batches": len(batches),
                          "cost": cost_kind(what), "trials": batch, "arm": j,
                          "needs": None if j == 0 else ref, "forwards": forwards})
    return units


def _logp_rows(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def _teacher_forced(model, kw, cache, fed: torch.Tensor, schedule: list[int], n_q: int):
    """Feed ``fed`` (question + answer but its last token) in ``schedule`` chunks; the log-probs
    [B, n_a, V] of the positions that predict the answer (from the question's last token on)."""
    out, pos = [], 0
    for c in schedule:
        logits = _forward(model, fed[:, pos:pos + c], cache, kw)
        keep = max(0, n_q - 1 - pos)
        if keep < c:
            out.append(_logp_rows(logits[:, keep:]))
        pos += c
    return torch.cat(out, 1)


def _greedy(model, kw, cache, question: torch.Tensor, schedule: list[int], n_a: int) -> torch.Tensor:
    """Read the question in ``schedule`` chunks, then generate ``n_a`` tokens greedily: [B, n_a]."""
    pos, logits = 0, None
    for c in schedule:
        logits = _forward(model, question[:, pos:pos + c], cache, kw)
        pos += c
    gen = [logits[:, -1].argmax(-1)]
    for _ in range(n_a - 1):
        logits = _forward(model, gen[-1][:, None], cache, kw)
        gen.append(logits[:, -1].argmax(-1))
    return torch.stack(gen, 1)


def _new_cache(model, what, p: dict):
    cfg = model.config
    if what is None:
        from transformers import DynamicCache

        return DynamicCache(config=cfg)
    if isinstance(what, Policy):
        from .policies.cache import PolicyCache

        return PolicyCache.for_model(what, cfg)
    from transformers import QuantizedCache

    return QuantizedCache("quanto", cfg, nbits=what["bits"], q_group_size=PEER_GROUP, residual_length=p["window"])


PEER_GROUP = 64  # quanto's q_group_size (the live study's default)


def _schedule(what, start: int, n: int) -> list[int]:
    """Tokens per forward: a peer one at a time; the reference and a policy in exact chunks."""
    return chunk_schedule(what, start, n, "chunked", CHUNK) if what is None or isinstance(what, Policy) else [1] * n


def run_unit(proto: dict, unit: dict, ctx, ref=None) -> tuple[list, object, str]:
    """One arm on one batch of trials: its rows (arrays into ``ctx.store``); the reference also
    returns the batch's :class:`~testbed.live.SharedPrefill` that the batch's other arms load."""
    p = proto["retrieval"]
    study, store = ctx.study, ctx.store
    model, _, _ = load_model()
    kw = _forward_kwargs(model)
    arm, what = arms_of(p)[unit["arm"]]
    batch = unit["trials"]
    bi = unit["batch"]
    ids = torch.tensor([t["ids"] for t in batch], dtype=torch.int64)
    P = batch[0]["length"]
    n_q, n_a = len(batch[0]["question_ids"]), len(batch[0]["answer_ids"])
    question, fed = ids[:, P:P + n_q], ids[:, P:P + n_q + n_a - 1]
    answer = ids[:, P + n_q:]
    if what is not None and not isinstance(what, Policy):
        ctx.one_off += _warm_quanto(model, kw, model.config, ctx.progress)  # before the arm's clock starts
    shared = None if ref is None else ref[0]  # the reference's output: (SharedPrefill,), a tuple as every unit's
    t0 = time.perf_counter()
    with torch.no_grad():
        if arm == REFERENCE:
            tail, received = scored_needs(p)  # what the scored selections read of the prefill
            shared, cache = shared_prefill(model, kw, ids[:, :P], _mass_candidates({**p, "prefill": P}), None,
                                           heavy=any(isinstance(w, Policy) and w.heavy > 0 for _, w in _arms(p))
                                           or received, query_tail=tail)
            ctx.timings.append({"study": study, "case": f"batch{bi}", "arm": None, "op": "prefill", "repeat": 0,
                                "seconds": shared.seconds, "trials": len(batch), "tokens": len(batch) * P,
                                "forwards": 1})
            t0 = time.perf_counter()
        else:
            cache = _new_cache(model, what, p)
            shared.load_into(cache)
        from .policies.cache import policy_attention  # transformers: needed only once a model runs

        tf_schedule = _schedule(what, P, n_q + n_a - 1)
        q_schedule = _schedule(what, P, n_q)
        with policy_attention(model) if isinstance(what, Policy) else contextlib.nullcontext():
            logp = _teacher_forced(model, kw, cache, fed, tf_schedule, n_q)
            del cache
            cache2 = _new_cache(model, what, p)
            shared.load_into(cache2)
            generated = _greedy(model, kw, cache2, question, q_schedule, n_a)
            del cache2
    seconds = time.perf_counter() - t0
    lp = logp.gather(-1, answer.unsqueeze(-1)).squeeze(-1)
    am = logp.argmax(-1)
    forwards = len(tf_schedule) + len(q_schedule) + n_a - 1
    ctx.timings.append({"study": study, "case": f"batch{bi}", "arm": arm, "op": "decode", "repeat": 0,
                        "seconds": seconds, "trials": len(batch), "forwards": forwards})
    kind = "reference" if what is None else "policy" if isinstance(what, Policy) else "peer"
    rows = []
    for j, t in enumerate(batch):
        prefix = f"{study}/{t['case']}/{arm}"
        lpj = lp[j].numpy().astype(np.float32)
        amj = am[j].numpy().astype(np.int32)
        genj = generated[j].numpy().astype(np.int32)
        ans = answer[j].numpy().astype(np.int32)
        row = {"study": study, "analysis": ANALYSIS, "case": t["case"], "source": "retrieval", "model": MODEL_ID,
               "task": t["task"], "length": t["length"], "depth": t["depth"], "trial": t["trial"], "seed": t["seed"],
               "arm": arm, "kind": kind, "answer_tokens": int(n_a),
               "answer_logprob": float(np.sum(lpj.astype(np.float64))),
               "tf_tokens_correct": int((amj == ans).sum()), "tf_em": int(bool((amj == ans).all())),
               "greedy_tokens_correct": int((genj == ans).sum()), "greedy_em": int(bool((genj == ans).all())),
               "arrays": {"logprob": store.save(f"{prefix}/logprob", lpj), "argmax": store.save(f"{prefix}/argmax", amj),
                          "generated": store.save(f"{prefix}/generated", genj)}}
        if isinstance(what, Policy):
            row["policy"] = what.config()
        elif kind == "peer":
            row["peer"] = {"backend": "quanto", "bits": what["bits"], "q_group_size": PEER_GROUP,
                           "residual_length": p["window"]}
        rows.append(row)
    em = sum(r["tf_em"] for r in rows)
    note = f"{arm}, {batch_note(unit, len(batch), 'trials')}: {em}/{len(rows)} exact, {forwards} forwards, {seconds:.1f} s"
    return rows, ((shared,) if arm == REFERENCE else None), note


# -- the report -------------------------------------------------------------------------------------

HEADERS = ["arm", "length", "trials", "TF exact match", "Wilson 95 %", "greedy exact match", "mean answer log-prob",
           "McNemar p vs reference (b/c)"]


def summarize(rows: list[dict]) -> list[dict]:
    """Per (task, length, arm), over trials: accuracies, the Wilson interval of the teacher-forced
    one, the mean answer log-prob, and McNemar against the reference on the same trials."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["task"], r["length"], r["arm"]), {})[r["case"]] = r
    out = []
    for (task, length, arm), trials in cells.items():
        ids = sorted(trials)
        tf = [bool(trials[c]["tf_em"]) for c in ids]
        ref = cells.get((task, length, REFERENCE), {})
        e = {"task": task, "length": length, "arm": arm, "trials": len(ids), "tf_correct": sum(tf),
             "greedy_correct": sum(bool(trials[c]["greedy_em"]) for c in ids),
             "wilson": retrieval.wilson(sum(tf), len(ids)),
             "mean_logprob": float(np.mean([trials[c]["answer_logprob"] for c in ids]))}
        if arm != REFERENCE and all(c in ref for c in ids):
            e["mcnemar"] = retrieval.mcnemar(tf, [bool(ref[c]["tf_em"]) for c in ids])
        out.append(e)
    return out


def _p_text(v: float) -> str:
    return f"{v:.4f}" if v >= 1e-4 else f"{v:.1e}"


def report(rows: list[dict], params: dict) -> str:
    from tabulate import tabulate

    if not rows:
        return "(no rows: the retrieval study was excluded; see the manifest's excluded entries)"
    parts = []
    summary = summarize(rows)
    for task in dict.fromkeys(r["task"] for r in rows):
        table = []
        arms = list(dict.fromkeys(r["arm"] for r in rows if r["task"] == task))
        for arm in arms:
            for e in sorted((e for e in summary if e["task"] == task and e["arm"] == arm), key=lambda e: e["length"]):
                lo, hi = e["wilson"]
                m = e.get("mcnemar")
                table.append([arm, str(e["length"]), str(e["trials"]), f"{100 * e['tf_correct'] / e['trials']:.1f} %",
                              f"[{100 * lo:.1f}, {100 * hi:.1f}] %", f"{100 * e['greedy_correct'] / e['trials']:.1f} %",
                              f"{e['mean_logprob']:.3f}",
                              "—" if m is None else f"{_p_text(m['p'])} ({m['b']}/{m['c']})"])
        parts.append(f"Task {task}:")
        parts.append(tabulate(table, headers=HEADERS, tablefmt="github", disable_numparse=True))
    n = len({r["case"] for r in rows})
    depths = len(params["depths"])
    parts.append(
        f"{n} trials ({params['trials']} per task, length and depth; {depths} depths from "
        f"{min(params['depths'])} to {max(params['depths'])}), each its own needle and seed; the trials are the units. "
        "Exact match (EM): teacher forced, every answer token is the model's argmax after the question and the answer "
        "tokens before it; greedy, the tokens generated greedily after the question are the answer. The Wilson interval "
        "is that of the teacher-forced EM; McNemar is the exact two-sided test of the arm's teacher-forced EM against "
        "the DynamicCache reference on the same trials (b: the reference right and the arm wrong; c: the reverse). The "
        "haystack is read once in float32 and handed to every arm's cache; the question and answer then go through the "
        "arm's cache. What this does not show: one small model (SmolLM2-135M-Instruct, float32 weights dequantized from "
        "Q4_1), synthetic tasks (a passkey in filler text, key-value needles in Python's help text), no reasoning, "
        "aggregation or natural questions, and no chat template; with few trials per cell the intervals are wide.")
    return "\n\n".join(parts)
