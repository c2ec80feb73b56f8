"""Needle retrieval trials (RULER-style, issue #32): the building blocks of the study in retrieval_study.py.

Does a compressed cache still let the model find one fact it read long ago? Each trial is a
haystack of exactly ``length`` tokens with a needle sentence inserted at a line or sentence
boundary nearest ``depth`` of the haystack, then a question, then the answer's token ids. Nothing
is downloaded: the haystacks are a fixed filler or Python's own ``pydoc_data.topics``.

A needle goes between two units, at the boundary nearest ``depth`` of the haystack's tokens (the
haystack's start is one): between two filler sentences, or between two lines of the help text --
where a sentence wraps across lines, the needle line interrupts it. (Sentence or paragraph ends
only were tried: the help text's code blocks and tables leave them too sparse, up to hundreds of
tokens apart, for the depth to mean anything below ~2k tokens.)

Tasks (``TASKS``):

- ``"passkey"``: a 5-digit number in repeated filler ("The grass is green. The sky is blue. ...");
  question "What is the pass key?". It tests recall of one salient span in text that is otherwise
  perfectly predictable, not reading of real text.
- ``"kv_needle"``: "The special magic number for <key> is <7-digit value>." inserted as a line of
  real technical English (the help topics of ``pydoc_data.topics``, joined in name order with
  blank lines, as the live study's corpus); the question names the key. The value never occurs in
  the corpus (every 7-digit substring of its digits is excluded), so only the needle can answer.
- ``"multi_kv"``: ``needles`` such sentences with distinct keys and values at distinct
  boundaries (while the haystack has enough); one, at ``depth``, is asked for, the others are
  distractors placed by the seed. It tests that the right needle is retrieved, not merely a number
  that looks like one.
- ``"multi_query"`` (issue #45 step 6, SCBench / KVzip's multi-query setting): the haystack and
  needles of ``multi_kv`` (the first at ``depth``, the others placed by the seed), but every needle
  is asked for, one question after the other about ONE prefill compressed once: the token ids after
  the prefill are question 1, answer 1, question 2, answer 2, ... in the needles' order (the
  trial's ``queries``). A policy that kept what the first question needed may have dropped what a
  later one needs: the study scores each answer separately, by question order.

A trial is a function of (tokenizer, task, length, depth, seed): for one seed the haystack is the
same at every depth, only the needle moves. :func:`grid` gives every trial of a study its own seed
(and its own answer), so trials, the statistical units, are independent.

What the trials do not test: reasoning, aggregation or multi-hop recall (RULER's other tasks),
natural questions, or instruction-following (no chat template is applied; the question ends with
the start of its own answer, "... The pass key is", so the answer is a plain continuation).

Token positions are exact because nothing is re-tokenized as a whole: the haystack is split into
units that each begin with their whitespace (a maximal whitespace run holding a newline, or the
space before a filler sentence) and end on a non-space character, every unit, the needle, the
question and the answer are encoded separately (``add_special_tokens=False``) and their ids
concatenated. For a byte-level BPE such as SmolLM2's (whose pre-tokenizer splits before a
whitespace run) this is the same as encoding the joined text; the last haystack unit is cut at a
token to make the length exact. A study feeds these ids (prefill, then question, then answer),
never their text.

Run-side statistics: :func:`wilson` (the score interval of a success rate) and
:func:`mcnemar` (the exact two-sided test of paired binary outcomes: an arm against the
reference on the same trials). The audit has its own re-derivations in
:mod:`testbed.audit_checks.retrieval_stats`.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import statistics
import sys
from typing import Any, Sequence

from .policies import PRESETS, preset
from .policies.compose import check_scored_prefill, policies_from
from .schema import Key, ProtocolError, Spec, check_value
from .sources.models import MODEL_ID, MODELS

__all__ = ["TASKS", "QUESTIONS", "SPEC", "PEER", "validate", "make_trial", "grid", "needles_of", "wilson", "mcnemar",
           "mcnemar_exact_p", "MAX_LENGTH", "budget_context", "trial_policies", "MULTI", "tail_of", "interleaved"]

TASKS = ("passkey", "kv_needle", "multi_kv", "multi_query")
MULTI = ("multi_kv", "multi_query")  # the tasks of several needles
# where the question goes: after the compressed prefill, through the arm's cache (kvpress's protocol),
# or inside the prefill that is compressed (SnapKV's favourable case)
QUESTIONS = ("after", "inside")
MAX_LENGTH = 8064  # the model's 8,192 positions less room for the question and the answer

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
PASSKEY_NEEDLE = "The pass key is {value}. Remember it. {value} is the pass key."
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
KV_NEEDLE = "The special magic number for {key} is {value}."
KV_QUESTION = ("\nWhat is the special magic number for {key} mentioned in the provided text? The special magic number "
               "for {key} mentioned in the provided text is")
FED_AS = "token ids: prefill_ids, then question_ids, then answer_ids (each piece encoded separately); never re-tokenized text"

# keys of the kv needles: "<adjective>-<noun>", 48 x 48 = 2,304 of them
_ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lively",
               "mellow", "narrow", "olive", "proud", "quiet", "rapid", "silent", "tidy", "upper", "vivid", "wary",
               "young", "zesty", "bitter", "crisp", "distant", "early", "fierce", "golden", "humble", "idle", "lucky",
               "modest", "noble", "odd", "pale", "rough", "sharp", "tender", "usual", "vast", "wild", "woolen", "bold",
               "clever", "damp")
_NOUNS = ("harbor", "meadow", "lantern", "pebble", "canyon", "violin", "falcon", "orchard", "glacier", "compass", "ribbon",
          "thimble", "anchor", "bramble", "cobble", "dagger", "ember", "fjord", "garnet", "hammock", "island", "juniper",
          "kettle", "ladder", "marble", "nectar", "oyster", "parcel", "quarry", "raven", "saddle", "tunnel", "umbrella",
          "velvet", "walnut", "yarrow", "zephyr", "basket", "candle", "donkey", "engine", "feather", "gravel", "helmet",
          "insect", "jigsaw", "kernel", "locket")

# -- the protocol block -----------------------------------------------------------------------------

# The same table as live.PEER: this module must not import testbed.live (the live study will import
# it), so tests/test_retrieval.py checks that the two tables agree.
PEER = Spec("retrieval peer", "A cache users know, run as one more arm: transformers' QuantizedCache.", {
    "backend": Key(("choice", ("quanto",)), "the QuantizedCache backend (optimum-quanto)"),
    "bits": Key(("choice", (2, 4)), "bits per element"),
})
# the presets a retrieval study runs (the per-head precision and oracle ones decide from a perplexity segment)
RETRIEVAL_PRESETS = tuple(n for n in PRESETS if not (preset(n).mixed or preset(n).oracle))
SPEC = Spec("retrieval", "Needle retrieval (RULER-style passkey and key-value needles) through the cache policies: "
            "does the model still answer from a needle it read at a given depth? Protocol key \"retrieval\".", {
    "tasks": Key(("list", ("choice", TASKS), 1), "passkey, kv_needle, multi_kv, multi_query (see testbed.retrieval)"),
    "lengths": Key(("list", ("range", int, 64, MAX_LENGTH), 1), "prefill lengths in tokens (haystack and needles)"),
    "depths": Key(("list", ("range", float, 0.0, 1.0), 1), "where the asked needle sits: the fraction of the haystack "
                                                           "before it (0 first, 1 last)"),
    "trials": Key(("range", int, 1, 10_000), "trials per (task, length, depth) cell, each its own needle", 8),
    "seed": Key(("range", int, 0, 2**32 - 1), "the study seed; each trial's seed is derived from it", 0),
    "needles": Key(("range", int, 2, 16), "needles of a multi_kv trial (one asked, the rest distractors) and of a "
                                          "multi_query trial (each asked in turn)", 4),
    "policies": Key(("list", (str, dict), 1),
                    "cache policies, one arm each: a preset's name (one of "
                    f"{', '.join(RETRIEVAL_PRESETS)}) or a policy declared by its fields, as in the live study (the "
                    "per-head precision and oracle policies run in the live study only: they decide from a perplexity "
                    "segment)"),
    "peers": Key(("list", dict, 0), "QuantizedCache arms", [], see=PEER),
    "window": Key(("range", int, 0, 8192), "float32 recent window R of the policies (and quanto's residual length)",
                  128),
    "group": Key(("choice", (2, 4, 8, 16, 32, 64, 128, 256)), "quantization group size G of the policies", 32),
    "sink": Key(("range", int, 0, 1024), "float32 sink tokens of the policies that keep a sink", 4),
    "evict_window": Key(("range", int, 1, 8192), "newest tokens kept by the evicting policies", 256),
    "batch": Key(("range", int, 1, 256), "trials run together", 4),
    "question": Key(("list", ("choice", QUESTIONS), 1),
                    "where the question goes: \"after\" the compressed prefill, through the arm's cache (kvpress's "
                    "protocol), or \"inside\" the prefill that is compressed (the haystack and the question read in "
                    "float32, then handed to the arm's cache; the first answer token is predicted from the prefill's last "
                    "position, which every arm shares); one set of rows per placement", ["after"]),
    "budget_tolerance": Key(("range", float, 0.0, 0.5), "how far below its budget a declared policy's derived kept "
                                                        "count may land at the end of a trial", 0.01),
}, rules=("with multi_kv or multi_query, every length is at least 64 tokens per needle",
          "multi_query asks its questions after the compressed prefill: its study's question is [\"after\"]",
          "every policy can be built with window, group, sink and evict_window",
          "a declared policy's budget is derived per trial at its end (prefill + question + answer tokens), the "
          "prefill being the haystack (question after) or the haystack and the question (inside); a budget no "
          "trial's tokens can reach within budget_tolerance is an error naming the arm"))


def budget_context(p: dict, length: int, question_tokens: int, answer_tokens: int, question: str) -> dict:
    """What a declared policy's budget is derived from for one trial (:func:`testbed.policies.budget.budget_keep`):
    the trial ends at ``length + question_tokens + answer_tokens`` tokens; the compressed prefill is the
    haystack (question ``"after"``: the question and the answer are the steps after it) or the haystack
    and the question (``"inside"``: the answer is the steps). SmolLM2's dimensions, the study's tolerance."""
    if question not in QUESTIONS:
        raise ValueError(f"question must be one of {list(QUESTIONS)}, got {question!r}")
    inside = question_tokens if question == "inside" else 0
    dims = MODELS[MODEL_ID]
    return {"prefill": int(length) + inside, "steps": int(question_tokens) + int(answer_tokens) - inside,
            "layers": dims["layers"], "kv_heads": dims["kv_heads"], "head_dim": dims["head_dim"],
            "tolerance": p.get("budget_tolerance", 0.01)}


def trial_policies(p: dict, length: int, question_tokens: int, answer_tokens: int, question: str,
                   where: str = "policies") -> list:
    """The study's policies for trials of these token counts and this question placement: presets at
    the protocol's R, G, W and S, declared policies with their budget's kept count derived at the
    trial's end (:func:`budget_context`). ``ValueError`` naming the arm when a budget is out of reach."""
    return policies_from(p["policies"], window=p["window"], group=p["group"], evict_window=p["evict_window"],
                         sink=p["sink"], where=where,
                         budget=budget_context(p, length, question_tokens, answer_tokens, question))


def validate(params: Any, where: str) -> dict:
    """A checked copy of a ``retrieval`` block; a :class:`ProtocolError` names the offending key."""
    p = SPEC.check(params, where)
    p["depths"] = [float(d) for d in p["depths"]]
    check_value(p["depths"], ("list", float, 1), f"{where}.depths")  # 1 and 1.0 are one depth, listed twice
    for i, peer in enumerate(p["peers"]):
        PEER.check(peer, f"{where}.peers[{i}]")
    multi = [t for t in MULTI if t in p["tasks"]]
    if multi:
        need = 64 * p["needles"]
        for i, n in enumerate(p["lengths"]):
            if n < need:
                raise ProtocolError(f"{where}.lengths[{i}]: {n} tokens cannot hold {multi[0]}'s {p['needles']} needles "
                                    f"and a haystack (at least 64 tokens per needle: {need})")
    if "multi_query" in p["tasks"] and p["question"] != ["after"]:
        raise ProtocolError(f"{where}.question: {p['question']}: multi_query asks its questions one after the other "
                            "after the compressed prefill, so its study's question must be [\"after\"] (run the "
                            "question inside in a study without multi_query)")
    if len(set(p["question"])) != len(p["question"]):
        raise ProtocolError(f"{where}.question: a placement is listed twice: {p['question']}")
    for i, name in enumerate(p["policies"]):
        if isinstance(name, str) and name not in RETRIEVAL_PRESETS:
            raise ProtocolError(f"{where}.policies[{i}]: {name!r} is not one of {list(RETRIEVAL_PRESETS)}")
    for n in p["lengths"]:  # each length is a prefill
        try:
            # the fields, checked at a nominal trial of one answer token and no tolerance: the exact kept
            # counts and the tolerance need the trials' token counts (the tokenizer's), checked at plan
            pols = trial_policies({**p, "budget_tolerance": 1.0}, n, 0, 1, "after", where=f"{where}.policies")
            check_scored_prefill(pols, n, f"{where}.policies")
        except ValueError as e:
            raise ProtocolError(str(e)) from None
    live_only = [q.name for q in pols if q.mixed or q.oracle or q.calibrated]
    if live_only:
        raise ProtocolError(f"{where}.policies: {', '.join(live_only)} run in the live study only (per-head "
                            "precision, oracles and calibrated codebooks decide from a perplexity segment or its "
                            "corpus)")
    return p


# -- deterministic draws ----------------------------------------------------------------------------

class _Draws:
    """Integers from SHA-256 of ``label/counter``: stable across Python versions and platforms
    (``random``'s methods other than ``random()`` may change between versions)."""

    def __init__(self, label: str):
        self.label, self.n = label, 0

    def below(self, n: int) -> int:
        self.n += 1
        digest = hashlib.sha256(f"{self.label}/{self.n}".encode()).digest()
        return int.from_bytes(digest, "big") % n  # bias below 2**-200 for any n used here


def _derive_seed(*parts: Any) -> int:
    text = "/".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1  # 63 bits


# -- the corpus -------------------------------------------------------------------------------------

_BREAK = re.compile(r"[ \t\r\f\v]*\n\s*")  # a maximal whitespace run holding a newline


@functools.lru_cache(maxsize=1)
def _pydoc() -> tuple[tuple[str, ...], frozenset, dict]:
    """The help topics split into units (each a line with the whitespace before it), the 7-digit
    strings occurring in it, and what the corpus is."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    lined = "\n\n" + text  # so that every unit, the first too, begins with its line break
    starts = [m.start() for m in _BREAK.finditer(lined)]
    units = tuple(u for u in (lined[a:b] for a, b in zip(starts, starts[1:] + [len(lined)])) if u.strip())
    sevens = frozenset(run[i:i + 7] for run in re.findall(r"\d{7,}", text) for i in range(len(run) - 6))
    info = {"corpus": f"pydoc_data.topics of Python {sys.version.split()[0]} ({len(topics.topics)} topics in name order)",
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "units": len(units)}
    return units, sevens, info


def needles_of(task: str, seed: int, needles: int = 4) -> list[dict]:
    """The needle facts of a trial, drawn from its seed alone (no tokenizer): a list of
    ``{"key", "value", "text"}``, the asked one first. One for passkey and kv_needle."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    draws = _Draws(f"needles/{task}/{seed}")
    if task == "passkey":
        value = str(10_000 + draws.below(90_000))
        return [{"key": None, "value": value, "text": PASSKEY_NEEDLE.format(value=value)}]
    count = 1 if task == "kv_needle" else needles  # multi_kv, multi_query
    if count < 1 or count > len(_ADJECTIVES) * len(_NOUNS):
        raise ValueError(f"needles must be positive, got {count}")
    _, sevens, _ = _pydoc()
    keys: list[str] = []
    values: list[str] = []
    while len(keys) < count:
        key = f"{_ADJECTIVES[draws.below(len(_ADJECTIVES))]}-{_NOUNS[draws.below(len(_NOUNS))]}"
        if key not in keys:
            keys.append(key)
    while len(values) < count:
        value = str(1_000_000 + draws.below(9_000_000))
        if value not in values and value not in sevens:
            values.append(value)
    return [{"key": k, "value": v, "text": KV_NEEDLE.format(key=k, value=v)} for k, v in zip(keys, values)]


# -- one trial --------------------------------------------------------------------------------------

def _encoder(tokenizer):
    cache: dict[str, list[int]] = {}

    def encode(text: str) -> list[int]:
        if text not in cache:
            cache[text] = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
        return cache[text]
    return encode


def _special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text by default (a BOS token; none for SmolLM2)."""
    plain = [int(i) for i in tokenizer.encode("a", add_special_tokens=False)]
    full = [int(i) for i in tokenizer.encode("a", add_special_tokens=True)]
    for cut in range(len(full) + 1):
        if full[cut:cut + len(plain)] == plain:
            return full[:cut]
    return []


def _haystack_units(task: str, seed: int):
    """An endless iterator of haystack units and what the haystack is."""
    if task == "passkey":
        def filler():
            i = 0
            while True:
                yield " " + FILLER[i % len(FILLER)]
                i += 1
        return filler(), {"haystack": "filler: " + " ".join(FILLER) + " (repeated)"}
    units, _, info = _pydoc()
    first = _Draws(f"haystack/{task}/{seed}").below(len(units))

    def text():
        i = first
        while True:
            yield units[i % len(units)]
            i += 1
    return text(), {"haystack": info["corpus"], "corpus_sha256": info["sha256"], "first_unit": first}


def make_trial(tokenizer, task: str, length: int, depth: float, seed: int, *, needles: int = 4) -> dict:
    """One retrieval trial as plain JSON-able data (see the module docstring).

    ``tokenizer`` needs only ``encode(text, add_special_tokens=...)``. Returns ``prefill_ids``
    (exactly ``length`` ids: the tokenizer's default prefix, if any, the haystack and the needles),
    ``needle_ids`` (the asked needle) with ``needle_start`` / ``needle_end`` such that
    ``prefill_ids[needle_start:needle_end] == needle_ids``, ``question_ids``, ``answer_ids`` and
    ``meta`` (and, for multi_query, ``queries``: each needle's ``question_ids`` and ``answer_ids``
    in asking order, the first the ones above; ``meta["queries"]`` their keys, values, needle spans
    and token counts). ``needles`` counts multi_kv's and multi_query's needles; its distractors go to distinct boundaries other
    than the asked one's, drawn by the seed, while there are enough (then needles share boundaries,
    each its own line, the asked one first). Raises ``ValueError`` when ``length`` cannot hold the needles
    and a haystack of at least one token per needle.
    """
    if not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    facts = needles_of(task, seed, needles)
    encode = _encoder(tokenizer)
    prefix = _special_prefix(tokenizer)
    lead = " " if task == "passkey" else "\n"  # a needle is a sentence of the filler or a line of the text
    needle_ids = [encode(lead + f["text"]) for f in facts]
    room = length - len(prefix) - sum(len(n) for n in needle_ids)
    if room < len(facts):
        raise ValueError(f"{task}: {length} tokens cannot hold {len(facts)} needle(s) of "
                         f"{[len(n) for n in needle_ids]} tokens and a haystack")
    units, about = _haystack_units(task, seed)
    hay: list[int] = []
    bounds = [0]  # token offsets in the haystack where a unit (a filler sentence, a line) ends
    while len(hay) < room:
        hay.extend(encode(next(units)))
        if len(hay) <= room:
            bounds.append(len(hay))
    del hay[room:]
    target = float(depth) * room
    asked = min(bounds, key=lambda b: (abs(b - target), b))
    # distractors: the first boundaries of a seeded shuffle other than the asked one's (so at every
    # depth of one seed they are the same, but for the one the asked needle may take); where there
    # are fewer boundaries than needles (a short haystack of long lines) needles share them
    draws, order = _Draws(f"distractors/{task}/{seed}"), list(bounds)
    for i in range(len(order) - 1, 0, -1):
        j = draws.below(i + 1)
        order[i], order[j] = order[j], order[i]
    others = [b for b in order if b != asked] or [asked]
    places = [asked] + [others[i % len(others)] for i in range(len(facts) - 1)]
    prefill = list(prefix)
    cursor, positions = 0, [0] * len(facts)
    for b, i in sorted((b, i) for i, b in enumerate(places)):
        prefill.extend(hay[cursor:b])
        cursor = b
        positions[i] = len(prefill)
        prefill.extend(needle_ids[i])
    prefill.extend(hay[cursor:])
    start = positions[0]
    asked_fact = facts[0]
    question = (PASSKEY_QUESTION if task == "passkey" else KV_QUESTION.format(key=asked_fact["key"]))
    answer = " " + asked_fact["value"]
    assert len(prefill) == length and prefill[start:start + len(needle_ids[0])] == needle_ids[0]
    meta = {"task": task, "seed": int(seed), "length": int(length), "depth": float(depth),
            "depth_actual": asked / room, "needle_text": lead + asked_fact["text"], "answer_text": answer,
            "answer": asked_fact["value"], "key": asked_fact["key"], "question_text": question,
            "special_prefix": prefix, "haystack_tokens": room, "fed_as": FED_AS, **about}
    if task == "multi_kv":
        meta["distractors"] = [{"key": f["key"], "value": f["value"], "start": positions[i],
                                "end": positions[i] + len(needle_ids[i])} for i, f in enumerate(facts) if i]
    out = {"prefill_ids": prefill, "needle_ids": list(needle_ids[0]), "needle_start": start,
           "needle_end": start + len(needle_ids[0]), "question_ids": list(encode(question)),
           "answer_ids": list(encode(answer)), "meta": meta}
    if task == "multi_query":  # every needle asked, in the needles' order, the first being the one above
        out["queries"] = [{"question_ids": list(encode(KV_QUESTION.format(key=f["key"]))),
                           "answer_ids": list(encode(" " + f["value"]))} for f in facts]
        meta["queries"] = [{"key": f["key"], "value": f["value"], "start": positions[i],
                            "end": positions[i] + len(needle_ids[i]),
                            "question_tokens": len(out["queries"][i]["question_ids"]),
                            "answer_tokens": len(out["queries"][i]["answer_ids"])} for i, f in enumerate(facts)]
    return out


def tail_of(trial: dict) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """What follows a trial's prefill: (every question's ids, every answer's ids, the layout): one
    question and its answer, or multi_query's questions and answers, question k + answer k fed after
    answer k - 1. The layout is each query's (question tokens, answer tokens) in that order."""
    queries = trial.get("queries") or [{"question_ids": trial["question_ids"], "answer_ids": trial["answer_ids"]}]
    qs = [i for q in queries for i in q["question_ids"]]
    ans = [i for q in queries for i in q["answer_ids"]]
    return qs, ans, [(len(q["question_ids"]), len(q["answer_ids"])) for q in queries]


def interleaved(trial: dict) -> list[int]:
    """The ids after the prefill in the order they are fed: question 1, answer 1, question 2, ..."""
    queries = trial.get("queries") or [{"question_ids": trial["question_ids"], "answer_ids": trial["answer_ids"]}]
    return [i for q in queries for i in q["question_ids"] + q["answer_ids"]]


def grid(tasks: Sequence[str], lengths: Sequence[int], depths: Sequence[float], trials: int, seed: int, *,
         needles: int = 4) -> list[dict]:
    """Every trial of a study, in a fixed order (task, length, depth, trial): ``{"index", "task",
    "length", "depth", "trial", "seed"}``. Each seed comes from SHA-256 of the study seed and the
    trial's coordinates; a seed whose asked value an earlier trial already has is re-derived (with
    an attempt counter), so every trial's answer is distinct."""
    out, used = [], set()
    for task in tasks:
        for length in lengths:
            for depth in depths:
                for t in range(trials):
                    for attempt in range(1000):
                        s = _derive_seed("retrieval", seed, task, int(length), repr(float(depth)), t, attempt)
                        value = needles_of(task, s, needles)[0]["value"]
                        if value not in used:
                            break
                    else:
                        raise ValueError(f"no distinct needle value for {task} trial {t} after 1000 attempts")
                    used.add(value)
                    out.append({"index": len(out), "task": task, "length": int(length), "depth": float(depth),
                                "trial": t, "seed": s})
    return out


# -- statistics (units: trials) --------------------------------------------------------------------

def wilson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for ``k`` successes in ``n`` trials:
    ``(p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)``, ``z`` the normal quantile."""
    if isinstance(k, bool) or isinstance(n, bool) or n < 1 or not 0 <= k <= n:
        raise ValueError(f"need integers 0 <= k <= n and n >= 1, got k={k!r}, n={n!r}")
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p for ``b`` and ``c`` discordant pairs: twice the lower tail of
    Binomial(b + c, 1/2) at min(b, c), capped at 1; 1 when there is no discordant pair."""
    if isinstance(b, bool) or isinstance(c, bool) or b < 0 or c < 0:
        raise ValueError(f"discordant counts must be non-negative integers, got b={b!r}, c={c!r}")
    n = b + c
    if n == 0:
        return 1.0
    log_half = n * math.log(0.5)
    tail = sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + log_half)
               for i in range(min(b, c) + 1))
    return min(1.0, 2.0 * tail)


def mcnemar(arm: Sequence[bool], reference: Sequence[bool]) -> dict:
    """Paired outcomes of one arm and the reference over the same trials: ``b`` (reference right,
    arm wrong), ``c`` (arm right, reference wrong) and the exact two-sided p."""
    if len(arm) != len(reference):
        raise ValueError(f"paired outcomes need equal lengths, got {len(arm)} and {len(reference)}")
    b = sum(1 for a, r in zip(arm, reference) if r and not a)
    c = sum(1 for a, r in zip(arm, reference) if a and not r)
    return {"n": len(arm), "b": b, "c": c, "p": mcnemar_exact_p(b, c)}
