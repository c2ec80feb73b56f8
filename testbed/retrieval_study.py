"""The needle retrieval study (issue #32): RULER-style trials through every cache arm.

Per trial (:func:`testbed.retrieval.make_trial`) the model reads the haystack once, in float32,
through a ``DynamicCache`` (:func:`testbed.live.shared_prefill`); every arm's cache then takes
that prefill (:meth:`~testbed.live.SharedPrefill.load_into`: a policy applies to what it stores
after the prefill, exactly as if it had run the prefill itself). Where the question goes is the
protocol's ``question`` (each placement its own set of rows, ``question`` in the rows when the study
runs ``"inside"``):

- ``"after"`` (the default): the question is not compressed with the context: it goes through the
  arm's cache after the prefill, as kvpress feeds it;
- ``"inside"``: the question is part of the prefill that is compressed (SnapKV's favourable case):
  the haystack and the question are read once in float32 and handed to the arm's cache, then the
  answer goes through it. The first answer token is predicted from the prefill's last position,
  which every arm shares (the prefill is read in float32 before any compression): its log-prob and
  argmax are the reference's in every arm; the arms differ from the second answer token on.

A declared policy's ``budget`` is derived per trial (:func:`testbed.retrieval.budget_context`): at
the trial's end, prefill + question + answer tokens, the compressed prefill being the haystack
(after) or the haystack and the question (inside); trials of one batch share their token counts,
so each unit derives its arms' kept counts once (:func:`unit_arms`) and the rows record them in
their policy config. :func:`plan` derives every unit's before any runs: a budget out of reach is a
:class:`~testbed.schema.ProtocolError` naming the arm, and nothing is written.

Per (trial, question placement, arm):

- **teacher forced**: the question (after only), then the answer but its last token, are fed through the arm's
  cache (a policy in chunks up to its next change of stored state, :func:`testbed.live.chunk_schedule`,
  inside :func:`testbed.policies.hook.policy_attention`; quanto one token per forward; the
  reference in chunks of ``CHUNK``). Scored: the log-probability of every answer token (their sum
  is the answer's log-probability) and the argmax at each answer position; teacher-forced exact
  match (``tf_em``) = every answer token is the argmax.
- **greedy**: a second copy of the arm's cache takes the same shared prefill, reads the question
  (after only), then generates ``len(answer)`` tokens, each argmax fed back; ``greedy_em`` = the generated
  tokens are the answer. (With deterministic argmaxes greedy EM equals teacher-forced EM; both are
  measured, and the generated tokens stored.)

Arms: ``dynamic_cache`` (the float32 reference, which continues the shared prefill's own cache),
the protocol's policies and its quanto peers (transformers' ``QuantizedCache``). Trials are the
statistical units: accuracy per (task, length, arm) with a Wilson 95 % interval, and the exact
McNemar test of each arm against the reference over the same trials.

multi_query (:mod:`testbed.retrieval`): the prefill holds several needles and is compressed once;
then question 1, answer 1, question 2, answer 2, ... go through the arm's cache in one
teacher-forced pass, each answer scored separately (a row per question, its ``query`` 1 on); the
greedy pass is one conversation, the model's own answer to question k staying in the cache before
question k + 1. report.md gives the exact match by question order.

Units: one per (batch of trials, question placement, arm), the reference of each first. Trials are
batched only where their prefill, question and answer token counts are equal (no padding anywhere).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

import numpy as np
import torch

from . import retrieval
from .live import (REFERENCE, forward, mass_candidates, peer_name, warm_quanto, batch_note, chunk_schedule,
                   cost_kind, measures_concentration, scored_needs, shared_prefill)
from .policies import Policy
from .policies.compose import policy_name
from .schema import ProtocolError
from .sources.capture import (INSTALL_HINT, MODEL_ID, MODELS, CaptureUnavailable, forward_kwargs, hardware_info,
                              load_model, software_info)

__all__ = ["estimate_bytes", "plan", "batch_units", "run_unit", "report", "summarize", "by_order", "arms_of", "arm_names",
           "unit_arms", "check_units", "arm_schedule", "CHUNK", "REFERENCE", "ANALYSIS"]

ANALYSIS = "retrieval"
CHUNK = 256  # tokens per forward of the reference (exact in any chunking)


def arm_names(p: dict) -> list[str]:
    """The arm names, the reference first (no budget derived)."""
    return [REFERENCE] + [policy_name(e) for e in p["policies"]] + [peer_name(x) for x in p["peers"]]


def arms_of(p: dict, length: int, question_tokens: int, answer_tokens: int, question: str = "after",
            where: str = "policies") -> list[tuple[str, object]]:
    """(name, what) of every arm for trials of these token counts and question placement, the
    reference first: what is None, a Policy (a budget's kept count derived at the trial's end,
    :func:`testbed.retrieval.trial_policies`) or a peer's dict."""
    pols = retrieval.trial_policies(p, length, question_tokens, answer_tokens, question, where=where)
    return [(REFERENCE, None)] + [(pol.name, pol) for pol in pols] + [(peer_name(x), x) for x in p["peers"]]


def unit_arms(p: dict, unit: dict) -> list[tuple[str, object]]:
    """The arms of a unit's batch of trials and question placement (:func:`arms_of`)."""
    t = unit["trials"][0]
    return arms_of(p, t["length"], len(t["question_ids"]), len(t["answer_ids"]), unit.get("question", "after"))


def _view(p: dict, unit: dict) -> dict:
    """The study's parameters as the live study's helpers read them for one unit: the compressed
    prefill, the steps after it and the model (so that a budget derives)."""
    t = unit["trials"][0]
    ctx = retrieval.budget_context(p, t["length"], len(t["question_ids"]), len(t["answer_ids"]),
                                   unit.get("question", "after"))
    return {**p, "prefill": ctx["prefill"], "steps": ctx["steps"], "model": MODEL_ID,
            "budget_tolerance": ctx["tolerance"]}


def check_units(p: dict, units: list[dict], where: str) -> None:
    """Every unit's arms derive (a budget within reach at every trial's end), else a
    :class:`~testbed.schema.ProtocolError` naming the arm and the trials' token counts."""
    seen = set()
    for u in units:
        t = u["trials"][0]
        key = (t["length"], len(t["question_ids"]), len(t["answer_ids"]), u.get("question", "after"))
        if key in seen:
            continue
        seen.add(key)
        try:
            arms_of(p, *key, where=f"{where}.policies")
        except ValueError as e:
            raise ProtocolError(f"{e} (trials of {key[0]} haystack, {key[1]} question and {key[2]} answer tokens, "
                                f"question {key[3]})") from None


def estimate_bytes(p: dict) -> int:
    """Peak bytes: the float32 model, the prefill's activations, the shared prefill's K/V held
    beside two caches of the batch (the arm's and its greedy copy, each at most float32 K/V), and
    the log-probabilities of the answer positions (a multi_query trial's questions and answers
    counted at up to 64 tokens per needle)."""
    dims = MODELS[MODEL_ID]
    tail = 64 * p["needles"] if "multi_query" in p["tasks"] else 64
    b, n = p["batch"], max(p["lengths"]) + tail
    activations = b * max(p["lengths"]) * dims.get("intermediate", 4 * 576) * 4 * 4 + (256 << 20)
    cache = 3 * 2 * dims["layers"] * dims["kv_heads"] * n * dims["head_dim"] * 4 * b
    logits = b * max(CHUNK, tail) * dims["vocab"] * 4 * 2
    return dims["parameters"] * 4 + activations + cache + logits


def _batches(trials: list[dict], size: int) -> list[list[dict]]:
    """Trials grouped by (task, length, question tokens, answer tokens and, for multi_query, each
    query's) in grid order, then cut into batches of at most ``size``."""
    groups: dict[tuple, list] = {}
    for t in trials:
        key = (t["task"], t["length"], len(t["question_ids"]), len(t["answer_ids"]), tuple(map(tuple, t.get("layout", ()))))
        groups.setdefault(key, []).append(t)
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
        questions, answers, layout = retrieval.tail_of(tr)  # multi_query: every question and answer
        ids = np.asarray(tr["prefill_ids"] + retrieval.interleaved(tr), dtype=np.int32)
        arrays = {"token_ids": store.save(f"{study}/{cid}/token_ids", ids),
                  "needle_ids": store.save(f"{study}/{cid}/needle_ids", np.asarray(tr["needle_ids"], dtype=np.int32))}
        meta = {"source": "retrieval", "model": MODEL_ID, "task": c["task"], "length": c["length"], "depth": c["depth"],
                "trial": c["trial"], "seed": c["seed"], "needle_start": tr["needle_start"], "needle_end": tr["needle_end"],
                "question_tokens": len(questions), "answer_tokens": len(answers),
                **{k: v for k, v in tr["meta"].items() if k not in ("task", "seed", "length", "depth")}}
        cases[cid] = {"id": cid, "causal": True, "layout": [], "tokens_per_frame": None, "head_map": None, "meta": meta,
                      "arrays": arrays}
        trials.append({"case": cid, "task": c["task"], "length": c["length"], "depth": c["depth"], "trial": c["trial"],
                       "seed": c["seed"], "question_ids": questions, "answer_ids": answers,
                       "ids": ids.tolist(), **({"layout": layout} if "queries" in tr else {})})
    ctx.progress(f"[{study}] {len(trials)} trials built ({time.perf_counter() - t0:.1f} s)")
    arms = arm_names(p)
    ctx.extra_files[f"{study}/retrieval_manifest.json"] = (json.dumps({
        "schema_version": 1,
        "experiment": f"{study}: needle retrieval through cache policies inside {MODEL_ID} (float32)",
        "model": {k: v for k, v in info.items() if k not in ("load_seconds", "loaded_from")},
        "fed_as": retrieval.FED_AS, "arms": arms, "trials": len(trials),
        "software": software_info(), "hardware": hardware_info(),
    }, indent=1) + "\n").encode("utf-8")
    units = batch_units(p, trials)
    check_units(p, units, f"{study}.retrieval")
    return cases, units


def batch_units(p: dict, trials: list[dict]) -> list[dict]:
    """The units of a retrieval study, one per (batch of trials, question placement, arm), the
    reference of each first (:func:`plan`; :mod:`testbed.replay` rebuilds the same units from a
    finished run's arrays). A unit of the question ``"inside"`` carries ``"question": "inside"``."""
    names = arm_names(p)
    kinds = [None] + [Policy] * len(p["policies"]) + [dict] * len(p["peers"])
    batches = _batches(trials, p["batch"])
    units = []
    for bi, batch in enumerate(batches):
        n_q, n_a = len(batch[0]["question_ids"]), len(batch[0]["answer_ids"])
        for question in p.get("question", ["after"]):
            ref = len(units)
            fed = n_q + n_a - 1 if question == "after" else n_a - 1  # through the arm's cache
            for j, (arm, kind) in enumerate(zip(names, kinds)):
                step = kind is dict
                forwards = 1 + (2 * fed if step else 2 * n_a + 2)
                what = None if kind is None else {} if kind is dict else Policy
                unit = {"label": f"batch {bi + 1}/{len(batches)} {arm}" + ("" if question == "after" else " (inside)"),
                        "batch": bi, "batches": len(batches), "cost": _cost(what), "trials": batch, "arm": j,
                        "needs": None if j == 0 else ref, "forwards": forwards}
                if question != "after":
                    unit["question"] = question
                units.append(unit)
    return units


def _cost(what) -> str:
    """The unit's cost class (:func:`testbed.live.cost_kind`) from the arm's kind alone."""
    return "testbed" if what is Policy else cost_kind(what)


def _logp_rows(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def _teacher_forced(model, kw, cache, fed: torch.Tensor, schedule: list[int], n_q: int):
    """Feed ``fed`` (the question unless it was inside the prefill, then the answer but its last
    token) in ``schedule`` chunks; the log-probs [B, n, V] of the positions that predict the answer
    (from the question's last token on; ``n_q`` = 0: every fed position), None when nothing is fed."""
    out, pos = [], 0
    for c in schedule:
        logits = forward(model, fed[:, pos:pos + c], cache, kw)
        keep = max(0, n_q - 1 - pos)
        if keep < c:
            out.append(_logp_rows(logits[:, keep:]))
        pos += c
    return torch.cat(out, 1) if out else None


def _greedy(model, kw, cache, question: torch.Tensor, schedule: list[int], n_a: int,
            last: torch.Tensor | None = None) -> torch.Tensor:
    """Read the question in ``schedule`` chunks (none when it was inside the prefill: then ``last``,
    the prefill's last logits [B, V], predicts the first token), then generate ``n_a`` tokens
    greedily: [B, n_a]."""
    pos, logits = 0, None if last is None else last[:, None]
    for c in schedule:
        logits = forward(model, question[:, pos:pos + c], cache, kw)
        pos += c
    gen = [logits[:, -1].argmax(-1)]
    for _ in range(n_a - 1):
        logits = forward(model, gen[-1][:, None], cache, kw)
        gen.append(logits[:, -1].argmax(-1))
    return torch.stack(gen, 1)


def _answer_starts(layout: list[tuple[int, int]]) -> list[int]:
    """Where each answer starts among the ids after the prefill (question 1, answer 1, question 2, ...)."""
    out, pos = [], 0
    for n_q, n_a in layout:
        out.append(pos + n_q)
        pos += n_q + n_a
    return out


def _greedy_queries(model, kw, cache, what, tail: torch.Tensor, start: int,
                    layout: list[tuple[int, int]]) -> tuple[torch.Tensor, int]:
    """multi_query's greedy pass, one conversation: question 1 read (in the arm's schedule from
    position ``start``), its answer generated greedily, then question 2 read after the generated
    answer (its last token fed with the question), and so on: the model's own answers stay in the
    cache, as in a conversation. Returns every generated token in asking order [B, answers] and the
    forwards run."""
    gens, forwards, pos, last = [], 0, start, None
    for s, (n_q, n_a) in zip(_answer_starts(layout), layout):
        question = tail[:, s - n_q:s]
        if last is not None:  # the previous generated answer's last token, not yet fed
            question = torch.cat([last[:, -1:], question], 1)
        schedule = arm_schedule(what, pos, question.shape[1])
        gen = _greedy(model, kw, cache, question, schedule, n_a)
        forwards += len(schedule) + n_a - 1
        pos += question.shape[1] + n_a - 1
        gens.append(gen)
        last = gen
    return torch.cat(gens, 1), forwards


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


def _classes(what, cache) -> dict | None:
    """A selective selection's per-pair arrays after teacher forcing, ``[B, L, H]`` each (as the live study
    stores them): ``select_sparse`` (uint8, 1 sparse), ``select_score`` (float64, the prefill's
    concentration), ``select_count`` (int32, what each pair holds); None for any other arm."""
    if not (isinstance(what, Policy) and what.selective):
        return None
    return {"select_sparse": cache.sel_sparse.numpy().astype(np.uint8),
            "select_score": cache.sel_score.numpy().astype(np.float64),
            "select_count": cache.held_counts().numpy().astype(np.int32)}


def arm_schedule(what, start: int, n: int) -> list[int]:
    """Tokens per forward: a peer one at a time; the reference and a policy in exact chunks."""
    return chunk_schedule(what, start, n, "chunked", CHUNK) if what is None or isinstance(what, Policy) else [1] * n


def run_unit(proto: dict, unit: dict, ctx, ref=None) -> tuple[list, object, str]:
    """One arm on one batch of trials at one question placement: its rows (arrays into ``ctx.store``);
    the reference also returns the batch's :class:`~testbed.live.SharedPrefill` that the other arms
    of the batch and placement load."""
    p = proto["retrieval"]
    study, store = ctx.study, ctx.store
    model, _, _ = load_model()
    kw = forward_kwargs(model)
    arms = unit_arms(p, unit)
    arm, what = arms[unit["arm"]]
    question_at = unit.get("question", "after")
    inside = question_at == "inside"
    batch = unit["trials"]
    bi = unit["batch"]
    ids = torch.tensor([t["ids"] for t in batch], dtype=torch.int64)
    P = batch[0]["length"]
    n_q, n_a = len(batch[0]["question_ids"]), len(batch[0]["answer_ids"])
    layout = [tuple(x) for x in batch[0].get("layout", ())]  # multi_query: each query's (question, answer) tokens
    if layout:  # every answer token, in asking order, from the interleaved ids after the prefill
        answer = ids[:, [P + s + i for s, (_, a) in zip(_answer_starts(layout), layout) for i in range(a)]]
    else:
        answer = ids[:, P + n_q:]
    # what the prefill holds, and what goes through the arm's cache after it
    pre = P + n_q if inside else P
    question = ids[:, pre:pre] if inside else ids[:, P:P + n_q]  # what is read after the prefill
    fed = ids[:, pre:P + n_q + n_a - 1]
    if what is not None and not isinstance(what, Policy):
        ctx.one_off += warm_quanto(model, kw, model.config, ctx.progress)  # before the arm's clock starts
    shared = None if ref is None else ref[0]  # the reference's output: (SharedPrefill,), a tuple as every unit's
    view = _view(p, unit)
    case = f"batch{bi}" + ("" if question_at == "after" else f"-{question_at}")
    t0 = time.perf_counter()
    with torch.no_grad():
        if arm == REFERENCE:
            tail, received = scored_needs(view)  # what the scored selections read of the prefill
            shared, cache = shared_prefill(model, kw, ids[:, :pre], mass_candidates(view), None,
                                           concentration=measures_concentration(view),
                                           heavy=any(isinstance(w, Policy) and w.heavy > 0 for _, w in arms)
                                           or received, query_tail=tail, last=inside,
                                           rope=any(isinstance(w, Policy) and w.key_rope == "pre" for _, w in arms))
            ctx.timings.append({"study": study, "case": case, "arm": None, "op": "prefill", "repeat": 0,
                                "seconds": shared.seconds, "trials": len(batch), "tokens": len(batch) * pre,
                                "forwards": 1})
            t0 = time.perf_counter()
        else:
            cache = _new_cache(model, what, p)
            shared.load_into(cache)
        from .policies.hook import policy_attention  # transformers: needed only once a model runs

        tf_schedule = arm_schedule(what, pre, fed.shape[1])
        q_schedule = arm_schedule(what, pre, question.shape[1])
        with policy_attention(model) if isinstance(what, Policy) else contextlib.nullcontext():
            if layout:  # multi_query: one teacher-forced pass over every question and answer, then greedy
                logp = _teacher_forced(model, kw, cache, fed, tf_schedule, 1)
                classes = _classes(what, cache)
                del cache
                cache2 = _new_cache(model, what, p)
                shared.load_into(cache2)
                generated, q_forwards = _greedy_queries(model, kw, cache2, what, ids[:, P:], P, layout)
                del cache2
            else:
                logp = _teacher_forced(model, kw, cache, fed, tf_schedule, question.shape[1])
                classes = _classes(what, cache)
                if inside:  # the first answer token from the shared prefill's last position
                    first = _logp_rows(shared.last[:, None])
                    logp = first if logp is None else torch.cat([first, logp], 1)
                del cache
                cache2 = _new_cache(model, what, p)
                shared.load_into(cache2)
                generated = _greedy(model, kw, cache2, question, q_schedule, n_a, shared.last if inside else None)
                del cache2
    seconds = time.perf_counter() - t0
    if layout:  # the fed position before each answer token predicts it: row j of logp predicts tail token j + 1
        rows_at = torch.tensor([s + i - 1 for s, (_, a) in zip(_answer_starts(layout), layout) for i in range(a)])
        logp = logp[:, rows_at]
        forwards = len(tf_schedule) + q_forwards
    else:
        forwards = len(tf_schedule) + len(q_schedule) + n_a - 1
    lp = logp.gather(-1, answer.unsqueeze(-1)).squeeze(-1)
    am = logp.argmax(-1)
    ctx.timings.append({"study": study, "case": case, "arm": arm, "op": "decode", "repeat": 0,
                        "seconds": seconds, "trials": len(batch), "forwards": forwards})
    kind = "reference" if what is None else "policy" if isinstance(what, Policy) else "peer"
    marked = p.get("question", ["after"]) != ["after"]  # rows name their placement where the study has several
    rows = []
    # the answers a row scores: the one answer, or each multi_query answer (its row's "query", 1 on)
    spans = [(None, 0, n_a)] if not layout else [(k + 1, sum(a for _, a in layout[:k]), layout[k][1])
                                                 for k in range(len(layout))]
    for j, t in enumerate(batch):
        for query, a0, na in spans:
            prefix = (f"{study}/{t['case']}/{arm}" + ("+inside" if inside else "")
                      + ("" if query is None else f"+q{query}"))
            lpj = lp[j, a0:a0 + na].numpy().astype(np.float32)
            amj = am[j, a0:a0 + na].numpy().astype(np.int32)
            genj = generated[j, a0:a0 + na].numpy().astype(np.int32)
            ans = answer[j, a0:a0 + na].numpy().astype(np.int32)
            row = {"study": study, "analysis": ANALYSIS, "case": t["case"], "source": "retrieval", "model": MODEL_ID,
                   "task": t["task"], "length": t["length"], "depth": t["depth"], "trial": t["trial"],
                   "seed": t["seed"], "arm": arm, "kind": kind, **({} if query is None else {"query": query}),
                   "answer_tokens": int(na), "answer_logprob": float(np.sum(lpj.astype(np.float64))),
                   "tf_tokens_correct": int((amj == ans).sum()), "tf_em": int(bool((amj == ans).all())),
                   "greedy_tokens_correct": int((genj == ans).sum()), "greedy_em": int(bool((genj == ans).all())),
                   "arrays": {"logprob": store.save(f"{prefix}/logprob", lpj),
                              "argmax": store.save(f"{prefix}/argmax", amj),
                              "generated": store.save(f"{prefix}/generated", genj)}}
            if marked:
                row["question"] = question_at
            if classes is not None:  # the selective rule: each pair's class, what it was read from, what it holds
                row["arrays"].update({name: store.save(f"{prefix}/{name}", a[j]) for name, a in classes.items()})
            if isinstance(what, Policy):
                row["policy"] = what.config()
            elif kind == "peer":
                row["peer"] = {"backend": "quanto", "bits": what["bits"], "q_group_size": PEER_GROUP,
                               "residual_length": p["window"]}
            rows.append(row)
    em = sum(r["tf_em"] for r in rows)
    note = (f"{arm}{' (question inside)' if inside else ''}, {batch_note(unit, len(batch), 'trials')}: {em}/{len(rows)} "
            f"exact, {forwards} forwards, {seconds:.1f} s")
    return rows, ((shared,) if arm == REFERENCE else None), note


_INSIDE = (" With the question inside, the haystack and the question are the prefill read in float32, handed to the "
           "arm's cache and compressed there; the answer then goes through the arm's cache. The first answer token is "
           "predicted from the prefill's last position, which every arm shares (the prefill is read before any "
           "compression), so its log-prob and argmax are the reference's in every arm; the arms differ from the second "
           "answer token on.")


# -- the report -------------------------------------------------------------------------------------

HEADERS = ["arm", "length", "trials", "TF exact match", "Wilson 95 %", "greedy exact match", "mean answer log-prob",
           "McNemar p vs reference (b/c)"]


def summarize(rows: list[dict]) -> list[dict]:
    """Per (task, length, question placement, arm), over trials: accuracies, the Wilson interval of
    the teacher-forced one, the mean answer log-prob, and McNemar against the reference of the same
    placement on the same trials (a row without ``question`` is one of the question after)."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["task"], r["length"], r.get("question", "after"), r["arm"]), {})[r["case"]] = r
    out = []
    for (task, length, question, arm), trials in cells.items():
        ids = sorted(trials)
        tf = [bool(trials[c]["tf_em"]) for c in ids]
        ref = cells.get((task, length, question, REFERENCE), {})
        e = {"task": task, "length": length, "question": question, "arm": arm, "trials": len(ids), "tf_correct": sum(tf),
             "greedy_correct": sum(bool(trials[c]["greedy_em"]) for c in ids),
             "wilson": retrieval.wilson(sum(tf), len(ids)),
             "mean_logprob": float(np.mean([trials[c]["answer_logprob"] for c in ids]))}
        if arm != REFERENCE and all(c in ref for c in ids):
            e["mcnemar"] = retrieval.mcnemar(tf, [bool(ref[c]["tf_em"]) for c in ids])
        out.append(e)
    return out


def by_order(rows: list[dict]) -> list[dict]:
    """multi_query's rows per (arm, length) over trials: for each question index (1 on, the asking
    order) the trials whose answer is teacher-forced exact, the trials with every answer exact, the
    mean answer log-prob over trials and questions, and McNemar of the last question's exact matches
    against the first's on the same trials (b: the first right and the last wrong; c: the reverse)."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["arm"], r["length"]), {}).setdefault(r["case"], {})[r["query"]] = r
    out = []
    for (arm, length), trials in cells.items():
        n = max(q for t in trials.values() for q in t)
        hits = {c: [bool(t[q]["tf_em"]) if q in t else False for q in range(1, n + 1)] for c, t in trials.items()}
        out.append({"arm": arm, "length": length, "trials": len(trials), "questions": n,
                    "correct": [sum(h[k] for h in hits.values()) for k in range(n)],
                    "all": sum(all(h) for h in hits.values()),
                    "mean_logprob": float(np.mean([r["answer_logprob"] for t in trials.values() for r in t.values()])),
                    "mcnemar": retrieval.mcnemar([h[-1] for h in hits.values()], [h[0] for h in hits.values()])})
    return out


def _by_order(rows: list[dict], params: dict) -> list[str]:
    from tabulate import tabulate

    summary = by_order(rows)
    n = max(e["questions"] for e in summary)
    table = []
    for e in sorted(summary, key=lambda e: e["length"]):  # stable: arms in row order within a length
        m = e["mcnemar"]
        table.append([e["arm"], str(e["length"]), str(e["trials"])]
                     + [f"{100 * k / e['trials']:.1f} %" for k in e["correct"]]
                     + [f"{100 * e['all'] / e['trials']:.1f} %", f"{e['mean_logprob']:.3f}",
                        f"{_p_text(m['p'])} ({m['b']}/{m['c']})"])
    headers = (["arm", "length", "trials"] + [f"question {k}" for k in range(1, n + 1)]
               + [f"all {n}", "mean answer log-prob", f"McNemar p question {n} vs 1 (b/c)"])
    return ["Task multi_query, teacher-forced exact match by question order:",
            tabulate(table, headers=headers, tablefmt="github", disable_numparse=True),
            f"multi_query: one prefill holds {params['needles']} needles and is compressed once (a policy applies to "
            "it as to any prefill); then question 1 and its answer are fed through the arm's cache, then question 2 "
            "and its answer after them, and so on, each answer scored on its own (question k asks for the k-th "
            "needle, the first at the trial's depth, the others where the seed put them). A cache that kept what the "
            "first question needed may have dropped what a later one needs. The greedy pass is one conversation: the "
            "model's own answers stay in the cache. McNemar compares the last question's teacher-forced exact matches "
            "with the first's on the same trials (b: the first right and the last wrong; c: the reverse)."]


def _p_text(v: float) -> str:
    return f"{v:.4f}" if v >= 1e-4 else f"{v:.1e}"


def report(rows: list[dict], params: dict) -> str:
    from tabulate import tabulate

    if not rows:
        return "(no rows: the retrieval study was excluded; see the manifest's excluded entries)"
    parts = []
    summary = summarize([r for r in rows if "query" not in r])
    placements = list(dict.fromkeys(r.get("question", "after") for r in rows))
    marked = any("question" in r for r in rows)
    for task, question in ((t, q) for t in dict.fromkeys(r["task"] for r in rows) for q in placements):
        if task == "multi_query":
            parts += _by_order([r for r in rows if r["task"] == task], params)
            continue
        table = []
        arms = list(dict.fromkeys(r["arm"] for r in rows if r["task"] == task))
        for arm in arms:
            for e in sorted((e for e in summary if e["task"] == task and e["arm"] == arm and e["question"] == question),
                            key=lambda e: e["length"]):
                lo, hi = e["wilson"]
                m = e.get("mcnemar")
                table.append([arm, str(e["length"]), str(e["trials"]), f"{100 * e['tf_correct'] / e['trials']:.1f} %",
                              f"[{100 * lo:.1f}, {100 * hi:.1f}] %", f"{100 * e['greedy_correct'] / e['trials']:.1f} %",
                              f"{e['mean_logprob']:.3f}",
                              "—" if m is None else f"{_p_text(m['p'])} ({m['b']}/{m['c']})"])
        parts.append(f"Task {task}, question {question} the compressed prefill:" if marked else f"Task {task}:")
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
        "arm's cache." + (_INSIDE if marked else "") + " What this does not show: one small model "
        "(SmolLM2-135M-Instruct, float32 weights dequantized from "
        "Q4_1), synthetic tasks (a passkey in filler text, key-value needles in Python's help text), no reasoning, "
        "aggregation or natural questions, and no chat template; with few trials per cell the intervals are wide.")
    return "\n\n".join(parts)
