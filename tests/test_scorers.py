"""Scored selections (testbed.policies.scorers, testbed.policies.scored): each (layer, KV head) keeps
the top-``keep`` tokens of a scorer, at the prefill only or as tokens arrive.

- ``keep_top`` keeps the largest scores, ties to the earlier token, in arrival order (hypothesis);
- ``knorm`` is the negative key norm; ``random`` depends on (seed, layer, head, position) only, so a
  token scored alone or in a chunk gets the same score;
- inside a tiny random model: the chunked schedule gives the log-probabilities of one token per
  forward, the bytes are the closed form at every step, and the online kept set of a static score
  is the top ``keep`` of every token seen (the prefill mode's: the prefill's top ``keep`` and every
  later token);
- budgets: a derived kept count lands at most the tolerance below its budget, never above; a budget
  out of reach is refused naming the arm;
- end to end on SmolLM2: scored arms (built-in, budgeted, a user's own scorer file) run and pass the
  audit; a consistently forged kept set fails it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.policies import scorers
from testbed.policies.budget import budget_keep, scored_bytes
from testbed.policies.compose import declared
from testbed.policies.policy import Policy
from testbed.protocol import ProtocolError
from tests import _arrays

REPO = Path(__file__).resolve().parent.parent


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=30), st.integers(1, 35))
def test_keep_top_keeps_the_largest_scores_ties_to_the_earlier(values, keep):
    score = torch.tensor(values, dtype=torch.float32)[None, None]
    got = scorers.keep_top(score, keep)[0, 0].tolist()
    n = len(values)
    # the definition, written out: rank by (score descending, position ascending), take the first keep
    want = sorted(sorted(range(n), key=lambda i: (-values[i], i))[:keep])
    assert got == want


def test_knorm_is_the_negative_key_norm():
    k = torch.randn(2, 3, 7, 16)
    s = scorers.get("knorm").score(k, torch.arange(7), 0)
    assert s.dtype == torch.float32
    assert torch.allclose(s, -k.norm(dim=-1), rtol=1e-6)


def test_random_scores_depend_on_the_token_not_on_the_call():
    k = torch.randn(2, 3, 12, 8)
    r = scorers.get("random", seed=5)
    whole = r.score(k, torch.arange(12), 3)
    parts = torch.cat([r.score(k[..., :5, :], torch.arange(5), 3), r.score(k[..., 5:, :], torch.arange(5, 12), 3)], -1)
    assert torch.equal(whole, parts)
    assert torch.equal(whole[0], whole[1])  # the same in every batch row, whatever the keys
    assert not torch.equal(whole, scorers.get("random", seed=6).score(k, torch.arange(12), 3))
    assert not torch.equal(whole, r.score(k, torch.arange(12), 4))
    assert ((whole >= 0) & (whole < 1)).all()


def test_unknown_and_missing_scorers_are_named(tmp_path):
    with pytest.raises(ValueError, match="'snap' is neither a built-in"):
        scorers.get("snap")
    with pytest.raises(ValueError, match="no file"):
        scorers.get("nowhere.py:Mine", base=tmp_path)
    (tmp_path / "mine.py").write_text("class Other:\n    pass\n")
    with pytest.raises(ValueError, match="has no class Mine"):
        scorers.get("mine.py:Mine", base=tmp_path)


# -- inside a tiny random model ----------------------------------------------------------------------

PREFILL, STEPS, KEEP = 24, 20, 16


def _tiny():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=32, num_hidden_layers=2, max_position_embeddings=256,
                         attn_implementation="sdpa")
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _run(model, pol, ids, chunks):
    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention

    cache = PolicyCache.for_model(pol, model.config, record_layer=1)
    out, bytes_, n = [], [], 0
    with torch.no_grad(), policy_attention(model):
        for c in chunks:
            logits = model(input_ids=ids[:, n:n + c], cache=cache, use_cache=True).logits
            out.append(torch.log_softmax(logits.float(), -1))
            n += c
            bytes_.append((n, cache.stored_bytes()))
    return torch.cat(out, 1), bytes_, cache


@pytest.mark.slow
@pytest.mark.parametrize("scorer", ["knorm", "random"])
@pytest.mark.parametrize("mode", ["online", "prefill"])
def test_a_scored_cache_chunked_equals_one_token_per_forward(scorer, mode):
    from testbed.live import chunk_schedule

    model = _tiny()
    pol = Policy("s", "drop", scorer=scorer, scorer_mode=mode, keep=KEEP, seed=1)
    ids = torch.randint(0, 256, (2, PREFILL + STEPS), generator=torch.Generator().manual_seed(3))
    chunked = chunk_schedule(pol, PREFILL, STEPS, "chunked", 256)
    assert (mode == "prefill") == (len(chunked) == 1)  # nothing changes after a prefill-only decision
    a, bytes_a, cache = _run(model, pol, ids, [PREFILL] + chunked)
    b, bytes_b, _ = _run(model, pol, ids, [PREFILL] + [1] * STEPS)
    # the log-probs of every scored position (the prefill's last onward) agree
    assert torch.allclose(a[:, PREFILL - 1:], b[:, PREFILL - 1:], atol=1e-5, rtol=0)
    heads, d = 2, 32
    for n, got in bytes_b:  # the closed form: per layer a header and, per held token and head, K, V, index, score
        held = min(n, KEEP) if mode == "online" else min(PREFILL, KEEP) + n - PREFILL
        assert got == 2 * (16 + heads * held * (2 * d * 4 + 8)) == pol.layer_bytes(n, heads, d, PREFILL) * 2
    ev = cache.layers[1].evidence()
    k = ev["input.k"]
    own = scorers.get(scorer, seed=1).score(k[None], torch.arange(k.shape[1]), 1)[0]
    if mode == "online":  # a static score: the kept set is the top KEEP of all tokens seen
        want = scorers.keep_top(own, KEEP)
    else:  # the prefill's top KEEP, then every token after it
        want = torch.cat([scorers.keep_top(own[:, :PREFILL], KEEP),
                          torch.arange(PREFILL, PREFILL + STEPS).expand(heads, STEPS)], -1)
    assert torch.equal(ev["kept.index"].long(), want)
    assert torch.equal(ev["float.k"], torch.gather(k, 1, want[..., None].expand(-1, -1, d)))


ATTN_CASES = [("snapkv", "prefill", 80, 70), ("tova", "prefill", 80, 70), ("tova", "online", 80, 70),
              ("h2o", "online", 80, 70), ("h2o", "prefill", 80, 70),
              ("expected_attention", "prefill", 80, 70),
              # a prefill shorter than keep: the first decode chunk runs up to the first eviction
              ("tova", "online", 8, 20), ("h2o", "online", 8, 20), ("knorm", "online", 8, 20)]


@pytest.mark.slow
@pytest.mark.parametrize("scorer, mode, prefill, keep", ATTN_CASES)
def test_a_scorer_of_attention_chunked_equals_one_token_per_forward(scorer, mode, prefill, keep):
    """The prefill (80 tokens: more than snapkv's 64-query window) decides from its own attention; then
    the decode steps, chunked as the policy's schedule allows, give one token per forward's log-probs."""
    from testbed.live import chunk_schedule

    model = _tiny()
    steps = 20
    pol = Policy("s", "drop", scorer=scorer, scorer_mode=mode, keep=keep)
    ids = torch.randint(0, 256, (2, prefill + steps), generator=torch.Generator().manual_seed(4))
    chunked = chunk_schedule(pol, prefill, steps, "chunked", 256)
    if prefill < keep:  # online: one chunk up to the token that first exceeds keep, then one at a time
        assert chunked[0] == keep + 1 - prefill and set(chunked[1:]) == {1}
    a, _, cache = _run(model, pol, ids, [prefill] + chunked)
    b, bytes_b, _ = _run(model, pol, ids, [prefill] + [1] * steps)
    assert torch.allclose(a[:, prefill - 1:], b[:, prefill - 1:], atol=1e-5, rtol=0)
    for n, got in bytes_b:
        held = min(n, keep) if mode == "online" else min(prefill, keep) + n - prefill
        assert got == 2 * (16 + 2 * held * (2 * 32 * 4 + 8))
    ev = cache.layers[1].evidence()
    if scorer == "snapkv":  # the observation window (the prefill's last 64 tokens) is always kept
        assert set(range(prefill - 64, prefill)) <= set(ev["kept.index"][0].tolist())
    if scorer == "tova":  # the newest token is always kept
        assert prefill + steps - 1 in ev["kept.index"][0].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("scorer, mode", [c[:2] for c in ATTN_CASES[:6]] + [("knorm", "online")])
def test_a_shared_prefill_keeps_what_the_arms_own_prefill_keeps(scorer, mode):
    """The live study's shared float32 prefill (K/V, last queries, accumulated attention handed to the
    cache) leaves the cache the model's own prefill through it leaves: same kept sets, same log-probs."""
    from testbed.live import scored_needs, shared_prefill
    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention
    from testbed.sources.models import forward_kwargs

    model = _tiny()
    prefill, keep = 80, 70
    pol = Policy("s", "drop", scorer=scorer, scorer_mode=mode, keep=keep)
    ids = torch.randint(0, 256, (2, prefill + 4), generator=torch.Generator().manual_seed(5))
    tail, received = scored_needs({"policies": [{"name": "s", "selection": {"kind": scorer, "mode": mode,
                                                                             "keep": keep}}],
                                   "prefill": prefill, "steps": 4, "model": "x", "window": 16, "group": 16,
                                   "evict_window": 16, "sink": 4})
    shared, _ = shared_prefill(model, forward_kwargs(model), ids[:, :prefill], heavy=received, query_tail=tail)
    outs = []
    for own in (True, False):
        cache = PolicyCache.for_model(pol, model.config)
        with torch.no_grad(), policy_attention(model):
            if own:
                model(input_ids=ids[:, :prefill], cache=cache, use_cache=True)
            else:
                shared.load_into(cache)
            # an online cache takes one token per forward once full; a prefill-mode one, the rest at once
            chunks = [1] * 4 if mode == "online" else [4]
            logits = torch.cat([model(input_ids=ids[:, prefill + i:prefill + i + c], cache=cache, use_cache=True).logits
                                for i, c in zip(range(0, 4, chunks[0]), chunks)], 1)
        outs.append((torch.log_softmax(logits, -1), [layer.kept_index.clone() for layer in cache.layers]))
    assert all(torch.equal(x, y) for x, y in zip(outs[0][1], outs[1][1]))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-5, rtol=0)


def test_snapkv_refuses_an_online_mode_a_short_keep_and_a_short_prefill(tmp_path):
    with pytest.raises(ValueError, match="snapkv decides prefill, not 'online'"):
        declared({"name": "x", "selection": {"kind": "snapkv", "keep": 80}}, window=16, group=16, evict_window=16)
    with pytest.raises(ValueError, match="keep must exceed 64, got 40"):
        declared({"name": "x", "selection": {"kind": "snapkv", "mode": "prefill", "keep": 40}}, window=16, group=16,
                 evict_window=16)
    from testbed.protocol import load_protocol

    path = _protocol(tmp_path, [{"name": "snap", "selection": {"kind": "snapkv", "mode": "prefill", "keep": 70}}])
    proto = json.loads(path.read_text())
    proto["live"]["prefill"] = 48
    path.write_text(json.dumps(proto))
    with pytest.raises(ProtocolError, match="snap: snapkv observes the prefill's last 64 queries; a prefill of 48"):
        load_protocol(path)


# -- budgets -----------------------------------------------------------------------------------------

SMOL = dict(layers=30, kv_heads=3, head_dim=64)


@pytest.mark.parametrize("mode", ["online", "prefill"])
@pytest.mark.parametrize("budget", [{"fp16_fraction": 0.5}, {"fp16_fraction": 0.25}, {"bytes_per_token": 8000.0}])
def test_a_budget_lands_within_its_tolerance_below_it(mode, budget):
    prefill, steps = 2048, 256
    keep = budget_keep(budget, mode=mode, prefill=prefill, steps=steps, **SMOL, tolerance=0.01)
    n = prefill + steps
    fp16 = 30 * 2 * 3 * 64 * 2  # float16 K and V bytes per token, every layer
    target = budget.get("bytes_per_token", budget.get("fp16_fraction", 0) * fp16) * n
    got = scored_bytes(keep, mode, prefill, steps, **SMOL)
    assert 0 <= target - got <= 0.01 * target
    assert scored_bytes(keep + 1, mode, prefill, steps, **SMOL) > target  # the largest count within the budget


def test_a_budget_out_of_reach_is_refused():
    with pytest.raises(ValueError, match="out of reach of a prefill scored selection"):
        budget_keep({"fp16_fraction": 0.125}, mode="prefill", prefill=2048, steps=256, **SMOL)
    with pytest.raises(ValueError, match="more than the tolerance"):  # 56 tokens: one token is ~7 % of the budget
        budget_keep({"fp16_fraction": 0.3}, mode="online", prefill=32, steps=24, **SMOL, tolerance=0.01)
    with pytest.raises(ValueError, match="selection kind 'all' keeps every token"):
        declared({"name": "x", "storage": {"middle": "int4"}, "budget": {"tokens": 8}}, window=16, group=16,
                 evict_window=16, budget={})


# -- end to end ----------------------------------------------------------------------------------------

USER_SCORER = '''\
import torch


class LowNorm:
    """knorm written again by a user: the negative L2 norm of each key."""

    def __init__(self, seed=0):
        self.seed = seed

    def score(self, keys, positions, layer):
        return (-torch.linalg.vector_norm(keys.to(torch.float64), dim=-1)).to(torch.float32)
'''

ARMS = [{"name": "knorm_k24", "selection": {"kind": "knorm", "keep": 24}},
        {"name": "knorm_half", "selection": {"kind": "knorm"}, "budget": {"fp16_fraction": 0.5}},
        {"name": "random_pre", "selection": {"kind": "random", "mode": "prefill", "keep": 20, "seed": 2}},
        {"name": "mine_k24", "selection": {"kind": "my_scorers.py:LowNorm", "keep": 24}},
        {"name": "snapkv_k70", "selection": {"kind": "snapkv", "mode": "prefill", "keep": 70}},
        {"name": "tova_pre", "selection": {"kind": "tova", "mode": "prefill", "keep": 40}},
        {"name": "ea_pre", "selection": {"kind": "expected_attention", "mode": "prefill", "keep": 40}},
        {"name": "tova_k60", "selection": {"kind": "tova", "keep": 60}},
        {"name": "h2o_k60", "selection": {"kind": "h2o", "keep": 60}},
        {"name": "knorm_w16", "selection": {"kind": "knorm", "keep": 40, "window": 16}},
        {"name": "h2o_w16", "selection": {"kind": "h2o", "keep": 40, "window": 16}}]


def _protocol(base: Path, policies) -> Path:
    proto = json.loads((REPO / "protocols" / "smollm2_quality.json").read_text())
    proto.update(name="scored_tiny", default=False)
    proto["live"].update({"evidence_layer": 0, "segments": 1, "prefill": 80, "steps": 24, "batch": 1, "window": 16,
                          "group": 16, "evict_window": 16, "policies": policies, "peers": [],
                          "budget_tolerance": 0.1})
    path = base / "scored_tiny.json"
    path.write_text(json.dumps(proto))
    return path


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory):
    from testbed.run import main as run_main
    from testbed.sources import models

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}")
    base = tmp_path_factory.mktemp("scored")
    (base / "my_scorers.py").write_text(USER_SCORER)
    out = base / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(_protocol(base, ["streaming", *ARMS]))]) == 0
    return out


def _rows(run: Path) -> dict:
    return {r["arm"]: r for r in json.loads((run / "results.json").read_text())["rows"]}


@pytest.mark.slow
def test_scored_arms_run_and_pass_the_audit(scored_run):
    from testbed.audit import audit

    ok, failures, summary = audit(scored_run)
    assert ok, failures[:5]
    # the audit says which choices it could not re-derive: the user's scorer and the online ones of attention
    assert "my_scorers.py:LowNorm" in summary and "h2o (online)" in summary and "tova (online)" in summary
    assert "self-consistently" in summary and "snapkv" not in summary and "knorm" not in summary
    assert "expected_attention" not in summary  # re-derived from the recorded queries, keys, values and RoPE
    # report.html draws the frontier: one curve per family, each point an arm of this run
    html = (scored_run / "report.html").read_text()
    assert 'data-key="frontier/scored_tiny"' in html
    block = html.split('data-key="frontier/scored_tiny"')[1].split('type="application/json"')[1]
    data = json.loads(block[block.index(">") + 1:block.index("</script>")])
    fams = {f["family"]: [p["arm"] for p in f["points"]] for f in data["contexts"][0]["families"]}
    assert fams["streaming"] == ["streaming"] and fams["snapkv (prefill)"] == ["snapkv_k70"]
    assert set(fams["knorm"]) == {"knorm_k24", "knorm_half", "knorm_w16"} and "my_scorers.py:LowNorm" in fams
    rows = _rows(scored_run)
    n = 104
    assert rows["knorm_k24"]["bytes_final"] == 30 * (16 + 3 * 24 * (2 * 64 * 4 + 8))
    # half of float16's bytes at 104 tokens: 52 float32 tokens' worth less the index and score, per layer and head
    half = 0.5 * n * 30 * 2 * 3 * 64 * 2
    assert 0.9 * half <= rows["knorm_half"]["bytes_final"] <= half
    # prefill mode keeps 20 of the prefill and all 24 decode tokens
    assert rows["random_pre"]["bytes_final"] == 30 * (16 + 3 * 44 * (2 * 64 * 4 + 8))
    # a protected window: the newest 16 of the 104 tokens are kept in every head, beside 24 by score
    for arm in ("knorm_w16", "h2o_w16"):
        kept = _arrays.load(scored_run, rows[arm]["evidence"]["arrays"]["kept.index"])
        assert kept.shape == (3, 40) and all(set(range(n - 16, n)) <= set(h.tolist()) for h in kept)
    # the user's own knorm keeps what the built-in one keeps: the same log-probs, bytes and kept set
    mine, kn = rows["mine_k24"], rows["knorm_k24"]
    assert mine["bytes_final"] == kn["bytes_final"]
    assert _arrays.load(scored_run, mine["arrays"]["logprob"]).tobytes() == \
        _arrays.load(scored_run, kn["arrays"]["logprob"]).tobytes()
    assert _arrays.load(scored_run, mine["evidence"]["arrays"]["kept.index"]).tobytes() == \
        _arrays.load(scored_run, kn["evidence"]["arrays"]["kept.index"]).tobytes()


def _forge(run: Path, rel: str, edit) -> None:
    x = _arrays.load(run, rel)
    edit(x)
    _arrays.save(run, rel, x)
    m = json.loads((run / "manifest.json").read_text())
    m["arrays"][rel]["sha256"] = _arrays.sha(run, rel)
    (run / "manifest.json").write_text(json.dumps(m, indent=1))


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["knorm_k24", "random_pre", "snapkv_k70", "tova_pre", "knorm_w16", "ea_pre"])
def test_a_consistently_forged_kept_set_fails(scored_run, tmp_path, arm):
    """Swap one kept token for the best-scored dropped one of head 0, with its K, V and score, all
    re-hashed: indices, K/V and bytes stay consistent, but the kept set is no longer the top keep."""
    from testbed.audit import audit

    run = tmp_path / "copy"
    shutil.copytree(scored_run, run)
    ev = _rows(run)[arm]["evidence"]["arrays"]
    idx = _arrays.load(run, ev["kept.index"])
    k, v = _arrays.load(run, ev["input.k"]), _arrays.load(run, ev["input.v"])
    if arm in ("snapkv_k70", "tova_pre"):  # from the recorded last queries over the prefill's keys
        q = torch.from_numpy(_arrays.load(run, ev["prefill.q"]))[None]
        kp = torch.from_numpy(k[:, :80])[None]
        own = scorers.get(arm.split("_")[0]).attention_score(q, kp, 64 ** -0.5, torch.zeros(kp.shape[:3]), None)[0]
        own = own.numpy()
    elif arm == "ea_pre":  # every prefill query, rotated back with the recorded RoPE frequencies
        from testbed.policies.rope import Rotary

        sc = scorers.get("expected_attention")
        sc.bind_rope(Rotary(torch.from_numpy(_arrays.load(run, ev["rope.inv_freq"])), 1.0))
        q = torch.from_numpy(_arrays.load(run, ev["prefill.q"]))[None]
        kp, vp = torch.from_numpy(k[:, :80])[None], torch.from_numpy(v[:, :80])[None]
        own = sc.attention_score(q, kp, 64 ** -0.5, torch.zeros(kp.shape[:3]), None, values=vp)[0].numpy()
    else:
        pol = {"knorm_k24": ("knorm", 0), "random_pre": ("random", 2), "knorm_w16": ("knorm", 0)}[arm]
        own = scorers.get(pol[0], seed=pol[1]).score(torch.from_numpy(k)[None], torch.arange(k.shape[1]), 0)[0]
        own = own.numpy()
    kept = set(idx[0].tolist())
    eligible = range(80) if arm.endswith("_pre") or arm.startswith("snapkv") else range(k.shape[1])
    if arm == "ea_pre":
        eligible = range(4, 80)  # its sink is kept first
    worst = max((t for t in eligible if t not in kept), key=lambda t: -own[0, t])  # the lowest-scored dropped
    out = int(idx[0, -1] if arm == "knorm_k24" else idx[0, 4] if arm == "ea_pre" else idx[0, 0])
    # knorm_w16: its oldest kept, outside the window; ea_pre: its first kept after the sink
    new = sorted((kept - {out}) | {worst})
    assert len(new) == idx.shape[1]
    _forge(run, ev["kept.index"], lambda x: x.__setitem__(0, np.array(new, dtype=np.int32)))
    _forge(run, ev["kept.score"], lambda x: x.__setitem__(0, np.where(np.array(new) < own.shape[1],
                                                                          own[0, np.minimum(new, own.shape[1] - 1)],
                                                                          x[0])))
    _forge(run, ev["float.k"], lambda x: x.__setitem__(0, k[0, new]))
    _forge(run, ev["float.v"], lambda x: x.__setitem__(0, v[0, new]))
    ok, failures, _ = audit(run)
    assert not ok
    assert any(arm in f and "kept set" in f for f in failures), failures[:5]


def test_a_budget_out_of_reach_is_one_error_naming_the_arm(tmp_path):
    from testbed.protocol import load_protocol

    path = _protocol(tmp_path, [{"name": "knorm_tiny", "selection": {"kind": "knorm", "mode": "prefill"},
                                 "budget": {"fp16_fraction": 0.125}}])
    with pytest.raises(ProtocolError, match=r"live\.policies\[0\] \(knorm_tiny\)\.budget.*out of reach"):
        load_protocol(path)


@pytest.mark.parametrize("entry", [
    {"name": "stream_q", "selection": {"kind": "sink_window", "sink": 4}, "budget": {"fp16_fraction": 0.25}},
    {"name": "knorm_q", "selection": {"kind": "knorm"}, "budget": {"fp16_fraction": 0.25}},
    {"name": "snap_h", "selection": {"kind": "snapkv", "mode": "prefill"}, "budget": {"bytes_per_token": 9000}},
    {"name": "tova_t", "selection": {"kind": "tova"}, "budget": {"tokens": 300}},
], ids=lambda e: e["name"])
def test_the_audits_budget_is_the_runs(entry):
    """The audit derives a budget's kept count (or a StreamingLLM's window) on its own: the same fields
    as the run's at SmolLM2's dimensions and a 2,048 + 256 token segment."""
    from testbed.audit_checks.live_policies import declared_policy

    live = {"model": "SmolLM2-135M-Instruct.Q4_1", "prefill": 2048, "steps": 256, "window": 128, "group": 32,
            "evict_window": 256, "policies": [entry]}
    pol = declared(entry, window=128, group=32, evict_window=256,
                   budget=dict(prefill=2048, steps=256, **SMOL, tolerance=0.01))
    cfg = {k: v for k, v in pol.config().items() if k not in ("name", "description")}
    got = {k: v for k, v in declared_policy(entry, live).items() if not k.startswith("_")}
    assert got == cfg
    if entry["name"] == "stream_q":  # 4 + W float32 tokens: within 1 % below a quarter of float16's bytes
        target = 0.25 * 2304 * 30 * 2 * 3 * 64 * 2
        got_bytes = 30 * (16 + 3 * (4 + pol.window) * 2 * 64 * 4)
        assert 0 <= target - got_bytes <= 0.01 * target


@pytest.mark.slow
def test_scored_selections_in_the_retrieval_study(tmp_path):
    """Retrieval with the question after compression (kvpress's protocol): scored arms with a kept
    count given as tokens run through the shared prefill, the question and answer fed after it, and
    pass the audit (budgets derived per trial are tests/test_retrieval_budget.py's)."""
    from testbed.audit import audit
    from testbed.run import main as run_main
    from testbed.sources import models

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}")
    proto = json.loads((REPO / "protocols" / "retrieval_small.json").read_text())
    proto.update(name="retrieval_scored", default=False)
    arms = [{"name": "knorm_k96", "selection": {"kind": "knorm", "keep": 96}},
            {"name": "snapkv_k96", "selection": {"kind": "snapkv", "mode": "prefill", "keep": 96}},
            {"name": "tova_k96", "selection": {"kind": "tova", "keep": 96}}]
    proto["retrieval"].update({"tasks": ["passkey"], "lengths": [160], "depths": [0.0, 1.0], "trials": 1, "batch": 2,
                               "policies": ["int4", *arms], "peers": []})
    path = tmp_path / "retrieval_scored.json"
    path.write_text(json.dumps(proto))
    out = tmp_path / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(path)]) == 0
    ok, failures, _ = audit(out)
    assert ok, failures[:5]
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["arm"] for r in rows} >= {"knorm_k96", "snapkv_k96", "tova_k96"}
    assert all(r["policy"]["keep"] == 96 for r in rows if r["arm"].endswith("_k96"))


@pytest.mark.slow
def test_a_forged_prefill_query_fails(scored_run, tmp_path):
    """The queries a prefill decision read (prefill.q) zeroed, so every attention score ties and any kept
    set would pass the re-derivation: they must still equal the other arms' recording of the same prefill."""
    from testbed.audit import audit

    run = tmp_path / "copy"
    shutil.copytree(scored_run, run)
    ev = _rows(run)["tova_pre"]["evidence"]["arrays"]
    _forge(run, ev["prefill.q"], lambda x: x.__setitem__(slice(None), 0.0))
    ok, failures, _ = audit(run)
    assert not ok
    assert any("prefill queries, last 1 differs" in f and "tova_pre" in f for f in failures), failures[:5]


@pytest.mark.slow
@pytest.mark.parametrize("forgery", ["shuffled", "theta"])
def test_a_forged_rotary_schedule_fails(scored_run, tmp_path, forgery):
    """expected_attention's recorded RoPE frequencies: shuffled, they are no rotary schedule; another
    base (theta 10,000 instead of the model's), the stored scores are no longer the audit's."""
    from testbed.audit import audit

    run = tmp_path / "copy"
    shutil.copytree(scored_run, run)
    ev = _rows(run)["ea_pre"]["evidence"]["arrays"]
    if forgery == "shuffled":
        _forge(run, ev["rope.inv_freq"], lambda x: x.__setitem__(slice(None), x[::-1].copy()))
    else:
        d = 64
        _forge(run, ev["rope.inv_freq"], lambda x: x.__setitem__(
            slice(None), (1.0 / 10000.0 ** (np.arange(0, d, 2) / d)).astype(np.float32)))
    ok, failures, _ = audit(run)
    assert not ok
    want = "not a rotary schedule" if forgery == "shuffled" else "kept.score: not the expected_attention scores"
    assert any("ea_pre" in f and want in f for f in failures), failures[:5]


@pytest.mark.slow
def test_the_user_scorer_file_is_recorded_by_its_sha256(scored_run, tmp_path):
    """The run records the user's scorer file by SHA-256 in the live manifest (the audit cannot run it,
    but the run says which code chose the tokens); a manifest that drops the record FAILs."""
    import hashlib

    from testbed.audit import audit

    rel = "scored_tiny/live_manifest.json"
    m = json.loads((scored_run / rel).read_text())
    assert m["scorer_files"] == {"my_scorers.py:LowNorm": {
        "file": "my_scorers.py", "sha256": hashlib.sha256(USER_SCORER.encode()).hexdigest()}}
    run = tmp_path / "copy"
    shutil.copytree(scored_run, run)
    m["scorer_files"] = {}
    (run / rel).write_text(json.dumps(m, indent=1) + "\n")
    man = json.loads((run / "manifest.json").read_text())
    man["files"][rel] = hashlib.sha256((run / rel).read_bytes()).hexdigest()
    (run / "manifest.json").write_text(json.dumps(man, indent=1))
    ok, failures, _ = audit(run)
    assert not ok
    assert any("scorer_files" in f and "my_scorers.py:LowNorm" in f for f in failures), failures[:5]
