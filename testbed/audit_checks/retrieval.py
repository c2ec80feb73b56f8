"""Audit of the needle retrieval study's rows (numpy and stdlib only; no model, no tokenizer).

For every (trial, arm) row, from the stored arrays and the frozen protocol:

- the trial: its stored ``token_ids`` are the prefill (exactly ``length`` tokens), the question
  and the answer (the case's recorded counts), and the stored ``needle_ids`` sit at
  ``[needle_start, needle_end)`` of the prefill (:func:`trial_problems`); the
  answer ids a row is scored against are the last ``answer_tokens`` of ``token_ids``;
- the row's numbers: ``answer_tokens``, ``answer_logprob`` (the float64 sum of the stored per-token
  log-probabilities), ``tf_tokens_correct`` and ``tf_em`` (stored argmax against the answer ids),
  ``greedy_tokens_correct`` and ``greedy_em`` (stored generated tokens against the answer ids);
  the row's task, length, depth, trial and seed against its case; a policy's config against the
  audit's own table of the presets (``live_policies.POLICY_TABLE``) or the protocol's declaration,
  a declared budget's kept count derived again per trial (:func:`trial_view`: the trial ends at
  prefill + question + answer tokens, the compressed prefill being the haystack, or the haystack
  and the question when the question is inside) and its whole-cache bytes at the trial's end
  within ``budget_tolerance`` below the budget; a peer's parameters;
- the question placement: a study that runs ``"inside"`` marks every row with its ``question``
  (one of the protocol's), an after-only study none; each placement has its own rows;
- between the arrays: a log-prob above ln 1/2 must be the argmax's, the argmax's log-prob is at
  least -ln V, and the greedy tokens equal the teacher-forced argmaxes up to the first miss
  (:func:`_cross_checks`);
- once per study: exactly the trials of the grid (task x length x depth x trial, in that order,
  ``t0000`` on), each with its coordinates, distinct seeds and distinct answers, and exactly one row
  per (trial, question placement, arm) of the protocol's arms.

- each trial bound to its grid slot, without a tokenizer (:func:`_binding`): its seed is the one the
  study seed and its coordinates derive (SHA-256 of ``retrieval/<seed>/<task>/<length>/<depth>/<trial>/
  <attempt>``, the attempt counted up past an answer an earlier trial has); its needle facts (key,
  value, text) and answer are the ones that seed draws (:func:`needles_of`, written here from the
  definition in ``testbed/retrieval.py``); the answer's ids occur in the needle's ids; where every
  answer of the study is one id per character, a character is the same id in every trial; and
  the asked needle sits where the depth puts it: its haystack offset (``needle_start`` less the
  tokenizer's prefix and the needles before it) is within one haystack unit of ``depth x
  haystack tokens`` (the run puts it at the unit boundary nearest that point, and the last unit is
  cut to the length), a unit's tokens bounded by its UTF-8 bytes (a token covers at least one
  byte); the units are the filler sentences (passkey) or the lines of ``pydoc_data.topics`` from
  the seed's first unit on (kv tasks);
- a multi_query trial (:func:`_bind_queries`): each query's key and value (``meta.queries``) are the
  ones its seed draws in the needles' order, query 1's needle is the stored ``needle_ids``, each
  query's answer ids (cut from the ids after the prefill, question 1, answer 1, question 2, ..., by
  the recorded counts, which add up to the case's) occur in its own needle's span of the prefill,
  the spans sit where the depth and the other needles put them; its rows are one per (trial, query
  1..needles, arm), each scored against its own answer, the greedy cross-check applied to a query
  whose earlier generated answers are all exact (the greedy pass keeps the model's own answers);
- the study's ``retrieval_manifest.json`` (:func:`_check_manifest`): the model's name, GGUF file
  name and SHA-256 against the audit's own table (``capture.MODELS``), the software against the
  run's environment, the arms and the trial count against the frozen protocol and the rows.

What it cannot re-derive: the log-probabilities, argmaxes and generated tokens rest on model
forward passes (checked for shape, dtype, finiteness and sign only), and the token ids rest on the
tokenizer: that the needle, question and haystack ids encode the recorded texts is not checked (the
audit has no tokenizer); the binding above makes a trial's ids its own grid slot's only as far as
the answer's ids, the needle's place and the per-character ids go.
The report's accuracies, Wilson intervals and McNemar p-values (and multi_query's exact match by
question order, with McNemar of the last question against the first) are re-derived from these
rows in ``report_tables`` below with :mod:`stats`.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re

import numpy as np

from . import report_format as fmt
from .capture import MODELS, check_software, compare_fields, read_json
from .common import HEADER_BYTES
from .live_policies import SCORED_EXTRA, as_bytes, policy_bytes, policy_names, policy_of, scored_held
from .live_quality import check_grid, check_selective
from .stats import mcnemar_p, wilson_bounds

__all__ = ["check", "check_study", "params_of", "arms_of", "expected_trials", "needles_of", "trial_seed", "REFERENCE",
           "DEFAULTS", "MODEL", "trial_problems", "report_tables", "trial_view", "budget_problem"]

REFERENCE = "dynamic_cache"
# the run side's schema defaults, the audit's own statement of them (a frozen copy is as written)
DEFAULTS = {"trials": 8, "seed": 0, "needles": 4, "peers": [], "window": 128, "group": 32, "sink": 4,
            "evict_window": 256, "batch": 4, "question": ["after"], "budget_tolerance": 0.01}
PEER_GROUP = 64
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the only model of the study (a key of capture.MODELS)
VOCAB = 49152  # SmolLM2's vocabulary
PREFIX_MAX = 8  # tokens a tokenizer may put before any text by default (a BOS token; none for SmolLM2)
LOGPROB_CEILING = 1e-5  # a log-probability above this is not one (float32 log_softmax rounding allowed)


# -- the trials' construction, stated again from testbed/retrieval.py's definition (not imported) --

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
PASSKEY_NEEDLE = "The pass key is {value}. Remember it. {value} is the pass key."
KV_NEEDLE = "The special magic number for {key} is {value}."
ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lively",
              "mellow", "narrow", "olive", "proud", "quiet", "rapid", "silent", "tidy", "upper", "vivid", "wary",
              "young", "zesty", "bitter", "crisp", "distant", "early", "fierce", "golden", "humble", "idle", "lucky",
              "modest", "noble", "odd", "pale", "rough", "sharp", "tender", "usual", "vast", "wild", "woolen", "bold",
              "clever", "damp")
NOUNS = ("harbor", "meadow", "lantern", "pebble", "canyon", "violin", "falcon", "orchard", "glacier", "compass", "ribbon",
         "thimble", "anchor", "bramble", "cobble", "dagger", "ember", "fjord", "garnet", "hammock", "island", "juniper",
         "kettle", "ladder", "marble", "nectar", "oyster", "parcel", "quarry", "raven", "saddle", "tunnel", "umbrella",
         "velvet", "walnut", "yarrow", "zephyr", "basket", "candle", "donkey", "engine", "feather", "gravel", "helmet",
         "insect", "jigsaw", "kernel", "locket")


def _draw(label: str):
    """The n-th draw below ``m`` is SHA-256 of ``label/n`` (n from 1) as a big-endian integer, mod m."""
    n = 0

    def below(m: int) -> int:
        nonlocal n
        n += 1
        return int.from_bytes(hashlib.sha256(f"{label}/{n}".encode()).digest(), "big") % m
    return below


def trial_seed(study_seed: int, task: str, length: int, depth: float, trial: int, attempt: int) -> int:
    """A trial's seed: the first 8 bytes of SHA-256 of the '/'-joined coordinates, big-endian, halved."""
    text = "/".join(str(x) for x in ("retrieval", study_seed, task, int(length), repr(float(depth)), trial, attempt))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[tuple[str, ...], frozenset, str]:
    """The kv tasks' haystack: the help topics of ``pydoc_data.topics`` in name order joined with
    blank lines, split into units (a maximal whitespace run holding a newline and the line after
    it), the 7-digit strings in it, and its SHA-256."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    lined = "\n\n" + text
    starts = [m.start() for m in re.finditer(r"[ \t\r\f\v]*\n\s*", lined)]
    units = tuple(u for u in (lined[a:b] for a, b in zip(starts, starts[1:] + [len(lined)])) if u.strip())
    sevens = frozenset(run[i:i + 7] for run in re.findall(r"\d{7,}", text) for i in range(len(run) - 6))
    return units, sevens, hashlib.sha256(text.encode("utf-8")).hexdigest()


def needles_of(task: str, seed: int, needles: int) -> list[dict]:
    """A trial's needle facts from its seed (``{"key", "value", "text"}``, the asked one first):
    passkey, one 5-digit value; kv_needle one and multi_kv ``needles`` distinct keys
    (adjective-noun) drawn first, then as many distinct 7-digit values not in the corpus."""
    below = _draw(f"needles/{task}/{seed}")
    if task == "passkey":
        value = str(10_000 + below(90_000))
        return [{"key": None, "value": value, "text": PASSKEY_NEEDLE.format(value=value)}]
    if task not in ("kv_needle", "multi_kv", "multi_query"):
        raise ValueError(f"unknown task {task!r}")
    count = 1 if task == "kv_needle" else needles
    sevens = corpus()[1]
    keys, values = [], []
    while len(keys) < count:
        key = f"{ADJECTIVES[below(len(ADJECTIVES))]}-{NOUNS[below(len(NOUNS))]}"
        if key not in keys:
            keys.append(key)
    while len(values) < count:
        value = str(1_000_000 + below(9_000_000))
        if value not in values and value not in sevens:
            values.append(value)
    return [{"key": k, "value": v, "text": KV_NEEDLE.format(key=k, value=v)} for k, v in zip(keys, values)]


def _unit_bytes(task: str, seed: int, room: int) -> int:
    """At least the tokens of the longest haystack unit a trial can use (its UTF-8 bytes): a filler
    sentence with its space, or a help-text line of the ``room`` units from the seed's first one."""
    if task == "passkey":
        return max(len((" " + f).encode("utf-8")) for f in FILLER)
    units = corpus()[0]
    first = _draw(f"haystack/{task}/{seed}")(len(units))
    return max(len(units[(first + i) % len(units)].encode("utf-8")) for i in range(min(room + 1, len(units))))


def params_of(ctx, study) -> dict:
    proto = ctx.protocol_copies.get(study)
    if not isinstance(proto, dict) or proto.get("kind") != "retrieval" or not isinstance(proto.get("retrieval"), dict):
        raise ValueError(f"study {study!r} has no frozen retrieval protocol copy")
    return {**DEFAULTS, **proto["retrieval"]}


def arms_of(p: dict) -> list[str]:
    return [REFERENCE] + policy_names(p) + [f"quanto_int{x['bits']}" for x in p.get("peers", [])]


def expected_trials(p: dict) -> list[dict]:
    """The grid in the run's order: ``{"case", "task", "length", "depth", "trial", "seed", "facts"}``;
    a seed whose asked value an earlier trial drew is derived again with the next attempt."""
    out, used = [], set()
    for task in p["tasks"]:
        for length in p["lengths"]:
            for depth in p["depths"]:
                for t in range(p["trials"]):
                    for attempt in range(1000):
                        seed = trial_seed(p["seed"], task, length, depth, t, attempt)
                        facts = needles_of(task, seed, p["needles"])
                        if facts[0]["value"] not in used:
                            break
                    used.add(facts[0]["value"])
                    out.append({"case": f"t{len(out):04d}", "task": task, "length": int(length),
                                "depth": float(depth), "trial": t, "seed": seed, "facts": facts})
    return out


def trial_view(p: dict, length: int, question_tokens: int, answer_tokens: int, question: str) -> dict:
    """The study's parameters as the live audit's policy table reads them for one trial: a budget's
    segment ends at prefill + question + answer tokens; the compressed prefill is the haystack
    (question after; the question and answer are the steps) or the haystack and the question
    (inside; the answer is the steps)."""
    inside = question_tokens if question == "inside" else 0
    return {**p, "model": MODEL, "prefill": length + inside, "steps": question_tokens + answer_tokens - inside}


def budget_problem(entry: dict, pol: dict, view: dict) -> str | None:
    """What is wrong with a declared budget's kept count at the trial's end (None when nothing): the
    whole cache's bytes (per layer the header and, per KV head and held token, float32 K and V and,
    for a scored selection, an int32 index and a float32 score) above the budget, or more than the
    study's ``budget_tolerance`` below it."""
    (kind, value), = as_bytes(entry["budget"], view).items()  # {"as": preset}: that preset's bytes per token
    if kind == "tokens":
        return None
    dims = MODELS[MODEL]
    layers, h, d = dims["layers"], dims["kv_heads"], dims["head_dim"]
    n = view["prefill"] + view["steps"]
    target = value * n if kind == "bytes_per_token" else value * n * layers * 4 * h * d
    if pol.get("scorer"):
        held, extra = scored_held(pol, n), SCORED_EXTRA
    else:  # a sink_window selection: the first S and the newest W, float32 K and V only
        held, extra = min(n, pol["sink"] + pol["window"]), 0
    got = layers * (HEADER_BYTES + h * held * (8 * d + extra))
    if pol.get("store") or pol.get("rest") or pol.get("heads") == "selective":  # quantized, or dense pairs
        got = policy_bytes(pol, n, dims)
    if got > target:
        return f"{got:,} bytes at the trial's end ({n} tokens) exceed the budget's {target:,.1f}"
    if (target - got) / target > view.get("budget_tolerance", 0.01):
        return (f"{got:,} bytes at the trial's end ({n} tokens) are {(target - got) / target:.2%} below the budget's "
                f"{target:,.1f}, more than the tolerance {view.get('budget_tolerance', 0.01):.2%}")
    return None


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
        for problem in trial_problems(trial):
            ctx.fail(where, problem)
        out = {"meta": meta, "answer": ids[P + nq:].astype(np.int64), "answer_tokens": na, "question_tokens": nq}
        if meta.get("task") == "multi_query":
            out["answers"] = _query_answers(ctx, where, meta, ids[P:].astype(np.int64), nq, na)
        return out
    return ctx.cached(("retrieval_trial", study, cid), build)


def _query_answers(ctx, where: str, meta: dict, tail: np.ndarray, nq: int, na: int) -> list[np.ndarray]:
    """A multi_query trial's answers in asking order, cut from the ids after its prefill (question
    1, answer 1, question 2, ...) by ``meta.queries``' token counts, which must add up to the case's
    question and answer tokens."""
    qs = meta.get("queries")
    counts = [(q.get("question_tokens"), q.get("answer_tokens")) for q in qs if isinstance(q, dict)] \
        if isinstance(qs, list) else []
    ctx.numbers += 1
    if (not counts or len(counts) != len(qs)
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for c in counts for x in c)
            or sum(q for q, _ in counts) != nq or sum(a for _, a in counts) != na):
        raise ValueError(f"{where}: meta.queries must give each query's positive question_tokens and answer_tokens, "
                         f"adding up to question_tokens {nq} and answer_tokens {na}")
    out, pos = [], 0
    for q, a in counts:
        out.append(tail[pos + q:pos + q + a])
        pos += q + a
    return out


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
    seeds, answers, spelled = {}, {}, []
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
        try:
            answer = _binding(ctx, f"{where} {w['case']}", w, rec, meta, p)
        except Exception as e:  # noqa: BLE001 - a forged trial must give a FAIL line, never a crash
            ctx.fail(f"{where} {w['case']}", f"cannot be bound to its grid slot ({type(e).__name__}: {str(e)[:200]})")
            continue
        if answer is not None:
            spelled += [(w["case"], *a) for a in answer]
    _check_spelling(ctx, where, spelled)
    arms = arms_of(p)
    if "multi_query" in p["tasks"]:
        _check_query_grid(ctx, study, where, want, arms, p["needles"])
    elif p["question"] == ["after"]:
        check_grid(ctx, study, where, names, arms, "trial")
    else:
        _check_placed_grid(ctx, study, where, names, arms, p["question"])
    try:
        _check_manifest(ctx, study, p, len(want))
    except Exception as e:  # noqa: BLE001 - a forged manifest must give a FAIL line, never a crash
        ctx.fail(f"{study}/retrieval_manifest.json", f"cannot be checked ({type(e).__name__}: {str(e)[:200]})")
    return True


def _check_query_grid(ctx, study: str, where: str, trials: list[dict], arms, needles: int) -> None:
    """Exactly one row per (trial, query, arm) of a study with multi_query (its question after the
    prefill only): a multi_query trial one per question index 1 to ``needles``, another trial one
    without a query."""
    seen: dict[tuple, int] = {}
    for r in ctx.results.get("rows", []):
        if isinstance(r, dict) and r.get("study") == study:
            key = (r.get("case"), r.get("query"), r.get("arm"))
            seen[key] = seen.get(key, 0) + 1
    want = {(t["case"], q, a) for t in trials for a in arms
            for q in (range(1, needles + 1) if t["task"] == "multi_query" else [None])}
    for key in sorted(want - set(seen), key=repr):
        ctx.fail(where, f"row for trial {key[0]}{'' if key[1] is None else f' query {key[1]}'} arm {key[2]} is missing")
    for key in sorted(set(seen) - want, key=repr):
        ctx.fail(where, f"row for trial {key[0]} query {key[1]!r} arm {key[2]} is not one the protocol implies")
    for key, count in sorted(seen.items(), key=repr):
        if count > 1:
            ctx.fail(where, f"trial {key[0]} query {key[1]!r} arm {key[2]} has {count} rows")


def _check_placed_grid(ctx, study: str, where: str, cases, arms, placements) -> None:
    """Exactly one row per (trial, question placement, arm) of a study that runs the question inside."""
    seen: dict[tuple, int] = {}
    for r in ctx.results.get("rows", []):
        if isinstance(r, dict) and r.get("study") == study:
            key = (r.get("case"), r.get("question"), r.get("arm"))
            seen[key] = seen.get(key, 0) + 1
    want = {(c, q, a) for c in cases for q in placements for a in arms}
    for key in sorted(want - set(seen), key=repr):
        ctx.fail(where, f"row for trial {key[0]} question {key[1]} arm {key[2]} is missing")
    for key in sorted(set(seen) - want, key=repr):
        ctx.fail(where, f"row for trial {key[0]} question {key[1]} arm {key[2]} is not one the protocol implies")
    for key, count in sorted(seen.items(), key=repr):
        if count > 1:
            ctx.fail(where, f"trial {key[0]} question {key[1]} arm {key[2]} has {count} rows")


def _binding(ctx, where: str, w: dict, rec: dict, meta: dict, p: dict):
    """One trial against its grid slot (the module docstring): FAIL lines under ``where``; returns
    (answer text, answer ids) for the per-character check, or None when the ids cannot be read."""
    facts, task = w["facts"], w["task"]
    kv = task != "passkey"
    drift = ""
    if kv and meta.get("corpus_sha256") != corpus()[2]:
        drift = (f" (this Python's pydoc_data.topics, sha256 {corpus()[2][:12]}.., is not the run's "
                 f"{str(meta.get('corpus_sha256'))[:12]}..: re-derived on this one)")
    ctx.numbers += 1
    if meta.get("seed") != w["seed"]:
        ctx.fail(where, f"meta.seed: case says {meta.get('seed')!r}, the study seed {p['seed']} and the trial's "
                        f"coordinates ({task}, {w['length']}, {w['depth']!r}, trial {w['trial']}) give {w['seed']}")
    lead = "\n" if kv else " "
    want = {"answer": facts[0]["value"], "key": facts[0]["key"], "needle_text": lead + facts[0]["text"],
            "answer_text": " " + facts[0]["value"]}
    for key, val in want.items():
        ctx.numbers += 1
        if meta.get(key) != val:
            ctx.fail(where, f"meta.{key}: case says {meta.get(key)!r}, the grid slot's seed draws {val!r}{drift}")
    arrays = rec.get("arrays") if isinstance(rec.get("arrays"), dict) else {}
    ids, needle = ctx.load(arrays.get("token_ids")), ctx.load(arrays.get("needle_ids"))
    n_a, length = meta.get("answer_tokens"), w["length"]
    if not (isinstance(n_a, int) and 0 < n_a < ids.size and ids.ndim == 1 and needle.ndim == 1 and ids.size > length):
        return None  # the trial's own check (_trial) has the FAIL line
    prefill, answer = ids[:length].astype(np.int64), ids[-n_a:].astype(np.int64)
    needle = needle.astype(np.int64)
    if task == "multi_query":
        return _bind_queries(ctx, where, w, meta, ids.astype(np.int64), needle, p, drift)
    ctx.numbers += 1
    if not any(np.array_equal(needle[i:i + n_a], answer) for i in range(needle.size - n_a + 1)):
        ctx.fail(where, f"answer ids {answer.tolist()} do not occur in the needle's ids: the needle states the answer "
                        f"({want['needle_text']!r} holds {want['answer_text']!r})")
    for problem in _placement(meta, w, prefill, int(needle.size), p, drift):
        ctx.fail(where, problem)
    return [(want["answer_text"], answer)]


def _bind_queries(ctx, where: str, w: dict, meta: dict, ids: np.ndarray, needle: np.ndarray, p: dict, drift: str):
    """A multi_query trial against its grid slot: each query's key and value are the ones its seed
    draws, in the needles' order; query 1's needle is the stored ``needle_ids`` at
    ``[needle_start, needle_end)``; each query's answer ids (cut from the ids after the prefill by
    its recorded counts) occur in its own needle's span of the prefill; the spans are where the
    depth and the other needles put them (:func:`_placement`). Returns each answer's (text, ids)."""
    facts, length = w["facts"], w["length"]
    qs = meta.get("queries")
    if not isinstance(qs, list) or len(qs) != len(facts) or not all(isinstance(q, dict) for q in qs):
        ctx.fail(where, f"meta.queries: {len(facts)} expected (one per needle of the protocol)")
        return None
    try:
        answers = _query_answers(ctx, where, meta, ids[length:], meta.get("question_tokens"), meta.get("answer_tokens"))
    except ValueError as e:
        ctx.fail(where, str(e).removeprefix(f"{where}: "))
        return None
    prefill = ids[:length]
    out = []
    for k, (q, f, answer) in enumerate(zip(qs, facts, answers)):
        ctx.numbers += 1
        if (q.get("key"), q.get("value")) != (f["key"], f["value"]):
            ctx.fail(where, f"meta.queries[{k}]: {q.get('key')!r} = {q.get('value')!r}, the seed draws "
                            f"{f['key']!r} = {f['value']!r} for question {k + 1}{drift}")
        s, e = q.get("start"), q.get("end")
        if not (isinstance(s, int) and isinstance(e, int) and 0 <= s < e <= prefill.size):
            ctx.fail(where, f"meta.queries[{k}]: span [{s!r}, {e!r}) is not inside the prefill")
            return None
        if k == 0 and (s, e) != (meta.get("needle_start"), meta.get("needle_end")):
            ctx.fail(where, f"meta.queries[0]: span [{s}, {e}) is not the asked needle's [{meta.get('needle_start')!r}, "
                            f"{meta.get('needle_end')!r})")
        span = prefill[s:e]
        if not any(np.array_equal(span[i:i + answer.size], answer) for i in range(span.size - answer.size + 1)):
            ctx.fail(where, f"query {k + 1}: answer ids {answer.tolist()} do not occur in its needle's ids "
                            f"(prefill [{s}, {e})): the needle states the answer {' ' + f['value']!r}")
        out.append((" " + f["value"], answer))
    for problem in _placement(meta, w, prefill, int(needle.size), p, drift):
        ctx.fail(where, problem)
    return out


def _placement(meta: dict, w: dict, prefill, needle_size: int, p: dict, drift: str) -> list[str]:
    """Where the asked needle sits against the trial's depth (the module docstring)."""
    out = []
    prefix = meta.get("special_prefix")
    if (not isinstance(prefix, list) or len(prefix) > PREFIX_MAX
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in prefix)
            or prefill[:len(prefix)].tolist() != prefix):
        return [f"meta.special_prefix {str(prefix)[:80]}: must be the prefill's first ids, at most {PREFIX_MAX} of them "
                "(the tokenizer's default prefix)"]
    start = meta.get("needle_start")
    if not isinstance(start, int) or isinstance(start, bool):
        return []  # the trial's own check has the FAIL line
    spans = []  # the distractors' [start, end), or the other asked needles' of multi_query
    if w["task"] == "multi_query":
        spans = [(q["start"], q["end"]) for q in meta["queries"][1:]]  # checked inside the prefill by _bind_queries
    if w["task"] == "multi_kv":
        dis = meta.get("distractors")
        if not isinstance(dis, list) or len(dis) != len(w["facts"]) - 1:
            return [f"meta.distractors: {len(w['facts']) - 1} expected (the protocol's needles less the asked one)"]
        for i, (d, f) in enumerate(zip(dis, w["facts"][1:])):
            d = d if isinstance(d, dict) else {}
            if (d.get("key"), d.get("value")) != (f["key"], f["value"]):
                out.append(f"meta.distractors[{i}]: {d.get('key')!r} = {d.get('value')!r}, the seed draws "
                           f"{f['key']!r} = {f['value']!r}{drift}")
            s, e = d.get("start"), d.get("end")
            if not (isinstance(s, int) and isinstance(e, int) and 0 <= s < e <= prefill.size):
                out.append(f"meta.distractors[{i}]: span [{s!r}, {e!r}) is not inside the prefill")
                return out
            spans.append((s, e))
    k = len(prefix)
    room = w["length"] - k - needle_size - sum(e - s for s, e in spans)
    offset = start - k - sum(e - s for s, e in spans if s < start)
    if room < 1:
        return out + [f"the needles leave {room} haystack tokens of {w['length']}"]
    target = w["depth"] * room
    tol = _unit_bytes(w["task"], w["seed"], room)
    if abs(offset - target) > tol:
        out.append(f"needle at token {start} (haystack offset {offset} of {room}), but depth {w['depth']!r} puts it at "
                   f"{target:.1f} \u00b1 one haystack unit (at most {tol} tokens){drift}")
    if meta.get("depth_actual") != offset / room or meta.get("haystack_tokens") != room:
        out.append(f"meta.depth_actual {meta.get('depth_actual')!r}, haystack_tokens {meta.get('haystack_tokens')!r}: "
                   f"the needle's place gives {offset / room!r} of {room} tokens")
    return out


def _check_spelling(ctx, where: str, spelled: list) -> None:
    """Where every answer of the study is one id per character (SmolLM2 splits digits), one
    character is one id in every trial: answer ids taken from another trial spell another value."""
    if not spelled or any(len(text) != ids.size for _, text, ids in spelled):
        return
    seen: dict[str, tuple] = {}
    for case, text, ids in spelled:
        for ch, i in zip(text, ids.tolist()):
            ctx.numbers += 1
            if ch in seen and seen[ch][0] != i:
                ctx.fail(f"{where} {case}", f"answer ids {ids.tolist()} do not spell {text!r}: {ch!r} is id {i} here, "
                                            f"{seen[ch][0]} in trial {seen[ch][1]}'s answer")
                break
            seen.setdefault(ch, (i, case))


def _check_manifest(ctx, study: str, p: dict, trials: int) -> None:
    """The study's retrieval_manifest.json as the live study's manifest is checked: the model
    (name, GGUF file, SHA-256) against the audit's table, the software against the run's
    environment, the arms and trials against the frozen protocol and the rows."""
    rel = f"{study}/retrieval_manifest.json"
    m = read_json(ctx, rel)
    if not isinstance(m, dict):
        raise ValueError("not a JSON object")
    model = m.get("model") if isinstance(m.get("model"), dict) else {}
    known = MODELS[MODEL]
    rows = [r for r in ctx.results.get("rows", []) if isinstance(r, dict) and r.get("study") == study]
    compare_fields(ctx, rel, {"schema_version": (m.get("schema_version"), 1), "model.model": (model.get("model"), MODEL),
                        "model.gguf": (model.get("gguf"), known["gguf"]),
                        "model.gguf_sha256": (model.get("gguf_sha256"), known["gguf_sha256"]),
                        "arms": (m.get("arms"), arms_of(p)), "trials": (m.get("trials"), trials)})
    if len({r.get("case") for r in rows}) != m.get("trials") or sorted({r.get("arm") for r in rows}) != sorted(
            m.get("arms") or []):
        ctx.fail(rel, f"trials {m.get('trials')!r} and arms {m.get('arms')!r} are not the rows': "
                      f"{len({r.get('case') for r in rows})} trials, arms {sorted({str(r.get('arm')) for r in rows})}")
    check_software(ctx, rel, m.get("software"))


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
    ctx.equal(row, "model", row.get("model"), MODEL)
    for key in ("task", "length", "depth", "trial", "seed"):
        ctx.equal(row, key, row.get(key), meta.get(key))
    answer, n = trial["answer"], trial["answer_tokens"]
    query = row.get("query")
    if "answers" in trial:  # multi_query: the row scores one of the trial's answers (query 1 on, asking order)
        if not (isinstance(query, int) and not isinstance(query, bool) and 1 <= query <= len(trial["answers"])):
            raise ValueError(f"query {query!r}: a multi_query row names its question, 1 to {len(trial['answers'])}")
        answer = trial["answers"][query - 1]
        n = int(answer.size)
    elif "query" in row:
        raise ValueError(f"query {query!r}: only a multi_query row names a question index")
    arrays = row.get("arrays") if isinstance(row.get("arrays"), dict) else {}
    selective = kind == "policy" and (row.get("policy") or {}).get("heads") == "selective"
    want_arrays = {"logprob", "argmax", "generated"} | (set(SELECT_ARRAYS) if selective else set())
    if set(arrays) != want_arrays:
        raise ValueError(f"arrays {sorted(arrays)}: a row stores exactly {', '.join(sorted(want_arrays))}")
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
    if query is None or _earlier_answered(ctx, row, trial, query):
        _cross_checks(row, ctx, lp, argmax, generated, answer)
    question = row.get("question", "after")
    if p["question"] == ["after"]:
        if "question" in row:
            ctx.fail(row, f"question {row.get('question')!r}: a study of the question after the prefill only marks no "
                          "row with its placement")
    elif row.get("question") not in p["question"]:
        ctx.fail(row, f"question {row.get('question')!r} is not one of the protocol's placements {p['question']}")
    if kind == "policy":
        got = row.get("policy") if isinstance(row.get("policy"), dict) else {}
        view = trial_view(p, meta["length"], trial["question_tokens"], trial["answer_tokens"], question)
        want = policy_of(arm, view)
        for key, val in want.items():
            if key.startswith("_"):  # the audit's own working values (a live segment's prefill), not a field
                continue
            ctx.equal(row, f"policy.{key}", got.get(key), val)
        ctx.equal(row, "policy.name", got.get("name"), arm)
        if want.get("heads") == "selective":  # the classes from the stored concentration, the counts and bytes
            _check_classes(row, ctx, want, view)
        entry = next((e for e in p.get("policies", []) if isinstance(e, dict) and e.get("name") == arm), None)
        if entry is not None and "budget" in entry:
            ctx.numbers += 1
            problem = budget_problem(entry, want, view)
            if problem:
                ctx.fail(row, f"policy budget {entry['budget']}: {problem}")
    elif kind == "peer":
        got = row.get("peer") if isinstance(row.get("peer"), dict) else {}
        want = {"backend": "quanto", "bits": peers[arm]["bits"], "q_group_size": PEER_GROUP,
                "residual_length": p["window"]}
        for key, val in want.items():
            ctx.equal(row, f"peer.{key}", got.get(key), val)
    elif "policy" in row or "peer" in row:
        raise ValueError("the reference row carries a policy or peer config")


SELECT_ARRAYS = ("select_sparse", "select_score", "select_count")


def _check_classes(row, ctx, pol: dict, view: dict) -> None:
    """A selective row (the seed's rule at the prefill's end): its pairs' classes are the rule's choice from
    the stored concentration, each pair holds what its class keeps after the tokens teacher forcing fed (the
    trial's tokens but the last answer token), and those counts give the closed-form bytes at that length
    (the live study's check, :func:`live_quality.check_selective`)."""
    fed = {**view, "steps": view["steps"] - 1}
    m, last = check_selective(row, ctx, pol, MODELS[MODEL], fed)
    ctx.equal(row, "the bytes of the held counts", last, policy_bytes(pol, fed["prefill"] + fed["steps"], MODELS[MODEL],
                                                                     sparse=m))


def _earlier_answered(ctx, row: dict, trial: dict, query: int) -> bool:
    """Whether the greedy pass read what teacher forcing read before multi_query's ``query``: every
    earlier query's generated tokens are its answer (the greedy pass keeps the model's own answers
    in the cache), so the cross-check of generated against argmax holds for this one."""
    for r in ctx.results.get("rows", []):
        if (isinstance(r, dict) and r.get("study") == row.get("study") and r.get("case") == row.get("case")
                and r.get("arm") == row.get("arm") and isinstance(r.get("query"), int) and r["query"] < query):
            k = r["query"]
            if k < 1:
                return False
            gen = ctx.load((r.get("arrays") or {}).get("generated"))
            if gen.shape != trial["answers"][k - 1].shape or not np.array_equal(gen, trial["answers"][k - 1]):
                return False
    return True


def _trial_ids(value, name: str, problems: list[str]) -> np.ndarray | None:
    arr = np.asarray(value)
    if arr.dtype == object or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        problems.append(f"{name}: expected a 1-D list of integer token ids, got dtype {arr.dtype}, shape {arr.shape}")
        return None
    if arr.size and arr.min() < 0:
        problems.append(f"{name}: negative token id {int(arr.min())}")
        return None
    return arr.astype(np.int64)


def trial_problems(trial: dict) -> list[str]:
    """What is wrong with one stored trial (an empty list when nothing is): ``prefill_ids``,
    ``needle_ids``, ``needle_start``, ``needle_end``, ``question_ids``, ``answer_ids`` and, when
    ``meta.length`` is given, the prefill's length."""
    problems: list[str] = []
    arrays = {name: _trial_ids(trial.get(name, []), name, problems)
              for name in ("prefill_ids", "needle_ids", "question_ids", "answer_ids")}
    for name in ("needle_ids", "question_ids", "answer_ids"):
        if arrays[name] is not None and arrays[name].size == 0:
            problems.append(f"{name}: empty")
    start, end = trial.get("needle_start"), trial.get("needle_end")
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in (start, end)):
        problems.append(f"needle_start, needle_end: expected integers, got {start!r}, {end!r}")
        return problems
    prefill, needle = arrays["prefill_ids"], arrays["needle_ids"]
    if prefill is None or needle is None:
        return problems
    if not 0 <= start < end <= prefill.size:
        problems.append(f"needle span [{start}, {end}) is not inside the prefill of {prefill.size} tokens")
    elif end - start != needle.size:
        problems.append(f"needle span [{start}, {end}) holds {end - start} tokens, the stored needle {needle.size}")
    elif not np.array_equal(prefill[start:end], needle):
        first = int(np.flatnonzero(prefill[start:end] != needle)[0])
        problems.append(f"prefill_ids[{start + first}] = {int(prefill[start + first])}, the needle's token {first} "
                        f"is {int(needle[first])}")
    length = (trial.get("meta") or {}).get("length")
    if length is not None and prefill.size != length:
        problems.append(f"prefill_ids: {prefill.size} tokens, meta.length {length}")
    return problems

# ---------------------------------------------------------------------------------------------
# report.md: the expected blocks of this analysis's section (audit_checks/report_md.py compares them)
# ---------------------------------------------------------------------------------------------

RETRIEVAL_HEADERS = ["arm", "length", "trials", "TF exact match", "Wilson 95 %", "greedy exact match",
                     "mean answer log-prob", "McNemar p vs reference (b/c)"]


def _order_tables(rows, p: dict) -> list:
    """multi_query's blocks: a table of (arm, length) over trials, the teacher-forced exact match of
    each question index (the asking order), of every question, the mean answer log-prob over trials
    and questions, and the exact McNemar p of the last question's exact matches against the first's
    on the same trials; then the paragraph that says what the task is."""
    one = lambda v: f"{100 * v:.1f}"  # noqa: E731
    n = p["needles"]
    trs = []
    for length in sorted({r["length"] for r in rows}):
        for arm in arms_of(p):
            cell: dict = {}
            for r in rows:
                if r["arm"] == arm and r["length"] == length:
                    cell.setdefault(r["case"], {})[r["query"]] = r
            if not cell:
                continue
            t = len(cell)
            hit = {c: [q in qs and qs[q]["tf_em"] == 1 for q in range(1, n + 1)] for c, qs in cell.items()}
            per_q = [sum(h[k] for h in hit.values()) for k in range(n)]
            every = sum(all(h) for h in hit.values())
            b = sum(1 for h in hit.values() if h[0] and not h[-1])
            c_ = sum(1 for h in hit.values() if h[-1] and not h[0])
            lps = [r["answer_logprob"] for qs in cell.values() for r in qs.values()]
            trs.append([fmt.text(arm), fmt.text(length), fmt.text(t)]
                       + [(fmt.Num(k / t, one, exact=True), " %") for k in per_q]
                       + [(fmt.Num(every / t, one, exact=True), " %"), fmt.fixed(math.fsum(lps) / len(lps), 3),
                          (fmt.Num(mcnemar_p(b, c_), fmt.p_text), f" ({b}/{c_})")])
    headers = (["arm", "length", "trials"] + [f"question {k}" for k in range(1, n + 1)]
               + [f"all {n}", "mean answer log-prob", f"McNemar p question {n} vs 1 (b/c)"])
    return [fmt.P("task multi_query", "Task multi_query, teacher-forced exact match by question order:"),
            fmt.T("retrieval multi_query by question order", headers, 2, trs),
            fmt.P("multi_query note", f"multi_query: one prefill holds {n} needles and is compressed once")]


def report_tables(rows, p: dict) -> list:
    """Per task (and question placement, where the study runs the question inside: one table each,
    headed "Task T, question Q the compressed prefill:") a table of (arm, length) over trials:
    teacher-forced EM with its Wilson interval, greedy EM, the mean answer log-prob and the exact
    McNemar p of the arm against the reference of the same placement on the same trials; then the
    notes' trial counts."""
    if not rows:
        return [fmt.P("no rows", "(no rows: the retrieval study was excluded")]
    one = lambda v: f"{100 * v:.1f}"  # noqa: E731
    out = []
    marked = p.get("question", ["after"]) != ["after"]
    placements = fmt.ordered(r.get("question", "after") for r in rows)
    for task, question in ((t, q) for t in fmt.ordered(r["task"] for r in rows) for q in placements):
        if task == "multi_query":
            out += _order_tables([r for r in rows if r["task"] == task], p)
            continue
        trs = []
        sel = [r for r in rows if r["task"] == task and r.get("question", "after") == question]
        for arm in arms_of(p):
            for length in sorted({r["length"] for r in sel if r["arm"] == arm}):
                cell = {r["case"]: r for r in sel if r["arm"] == arm and r["length"] == length}
                ref = {r["case"]: r for r in sel if r["arm"] == REFERENCE and r["length"] == length}
                n = len(cell)
                k = sum(1 for r in cell.values() if r["tf_em"] == 1)
                g = sum(1 for r in cell.values() if r["greedy_em"] == 1)
                lo, hi = wilson_bounds(k, n)
                if arm == REFERENCE or not set(cell) <= set(ref):
                    test = ("—",)
                else:
                    b = sum(1 for c, r in cell.items() if ref[c]["tf_em"] == 1 and r["tf_em"] != 1)
                    c_ = sum(1 for c, r in cell.items() if ref[c]["tf_em"] != 1 and r["tf_em"] == 1)
                    test = (fmt.Num(mcnemar_p(b, c_), fmt.p_text), f" ({b}/{c_})")
                trs.append([fmt.text(arm), fmt.text(length), fmt.text(n), (fmt.Num(k / n, one, exact=True), " %"),
                            ("[", fmt.Num(lo, one), ", ", fmt.Num(hi, one), "] %"),
                            (fmt.Num(g / n, one, exact=True), " %"),
                            fmt.fixed(math.fsum(r["answer_logprob"] for r in cell.values()) / n, 3), test])
        if marked:
            out += [fmt.P(f"task {task} question {question}", f"Task {task}, question {question} the compressed prefill:"),
                    fmt.T(f"retrieval {task} question {question}", RETRIEVAL_HEADERS, 2, trs)]
        else:
            out += [fmt.P(f"task {task}", f"Task {task}:"), fmt.T(f"retrieval {task}", RETRIEVAL_HEADERS, 2, trs)]
    depths = [float(d) for d in p["depths"]]
    out.append(fmt.P("notes", "", [("trials", r"^(\S+) trials \(", fmt.text(len({r["case"] for r in rows}))),
                                   ("trials per cell", r"\((\S+) per task, length and depth", fmt.text(p["trials"])),
                                   ("depths", r"; (\S+) depths from", fmt.text(len(depths))),
                                   ("first depth", r"depths from (\S+) to", fmt.text(min(depths))),
                                   ("last depth", r" to (\S+)\), each its own", fmt.text(max(depths)))]))
    return out
