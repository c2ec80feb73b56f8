"""The seed's selective rule as a live policy (selection ``heads: "selective"``; issue 45, step 2).

- the policy: the selective fields in a row's config only for a selective arm; bad input is one
  ``ValueError`` naming it; a budget's share of sparse pairs (the fewest that fit, the slack given back
  to the sparse pairs' keep) against the formula stated here, within 1 % below the budget, and the
  audit's own derivation the same;
- inside a tiny random Llama: share 0 is the reference (DynamicCache) to 1e-5; sparse pairs hold
  exactly the prefill's top ``keep`` of the scorer (knorm's, stated here) and every later token, dense
  pairs every token; the concentrated rule's sparse pairs are the least concentrated ones by the
  stored scores, and the reversed control's exactly the complement at share 1/2; the random control is
  the same pairs whatever the input (SHA-256 of "layer:head", stated here); the oracle's class comes
  from the scores handed in (the whole segment's), not from the prefill; bytes at every step against
  the closed form written here; a decode chunk equals one token per forward;
- end to end on SmolLM2 (slow): the rule, its controls and its oracle run and pass the audit at equal
  bytes; a forged class (one pair flipped, or two swapped with their counts) and a forged kept set
  each fail it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from testbed.policies.budget import selective_budget
from testbed.policies.compose import declared
from testbed.policies.policy import Policy
from testbed.policies.presets import PRESETS, preset
from tests import _arrays
from tests._helpers import tiny_llama, audited_rows, rows_by_arm, tiny_live_run

REPO = Path(__file__).resolve().parent.parent
SMOL = dict(layers=30, kv_heads=3, head_dim=64)
KW = dict(window=16, group=16, evict_window=16)
SELECT = ("sparse_share", "alloc", "alloc_from")


def _sel(keep=6, alloc="concentrated", share=0.5, scorer="knorm", **kw):
    return Policy("sel", "drop", scorer=scorer, scorer_mode="prefill", keep=keep, heads="selective", alloc=alloc,
                  sparse_share=share, **kw)


# -- the policy --------------------------------------------------------------------------------------


def test_selective_fields_only_for_selective_arms():
    for name in PRESETS:  # a mixed preset's alloc and alloc_from are its bits' rule
        pol = preset(name)
        assert "sparse_share" not in pol.config() and (pol.mixed or not set(SELECT) & set(pol.config())), name
    proto = json.loads((REPO / "protocols" / "frontier.json").read_text())["live"]
    budget = dict(prefill=proto["prefill"], steps=proto["steps"], **SMOL, tolerance=0.01)
    kw = dict(window=proto["window"], group=proto["group"], evict_window=proto["evict_window"], budget=budget)
    for entry in proto["policies"]:
        if isinstance(entry, dict):
            cfg = declared(entry, **kw).config()
            assert not set(SELECT) & set(cfg) and "sparse_share" not in cfg, entry["name"]
    cfg = _sel().config()
    assert cfg["heads"] == "selective" and cfg["sparse_share"] == 0.5 and cfg["alloc"] == "concentrated"
    assert cfg["alloc_from"] == "prefill" and "alpha" not in cfg and "low" not in cfg


def test_bad_selective_declarations_are_refused():
    kw = dict(KW, budget=dict(prefill=320, steps=8, **SMOL, tolerance=0.05))
    sel = {"kind": "knorm", "mode": "prefill", "keep": 40, "heads": "selective", "alloc": "concentrated"}
    with pytest.raises(ValueError, match="mode 'prefill'"):
        declared({"name": "x", "selection": {**sel, "mode": "online"}}, **kw)
    with pytest.raises(ValueError, match="alloc .* must be one of"):
        declared({"name": "x", "selection": {**sel, "alloc": "loud"}}, **kw)
    with pytest.raises(ValueError, match="oracle class needs a rule that reads attention"):
        declared({"name": "x", "selection": {**sel, "alloc": "random", "alloc_from": "oracle"}}, **kw)
    with pytest.raises(ValueError, match="sparse_share .* must be a float in \\[0, 1\\]"):
        declared({"name": "x", "selection": {**sel, "sparse_share": 1.5}}, **kw)
    with pytest.raises(ValueError, match="belong to the selective rule"):
        declared({"name": "x", "selection": {"kind": "knorm", "mode": "prefill", "keep": 40, "alloc": "random"}}, **kw)
    with pytest.raises(ValueError, match="belong to the selective rule"):
        declared({"name": "x", "selection": {"kind": "knorm", "mode": "prefill", "keep": 40, "heads": "adaptive",
                                             "sparse_share": 0.5}}, **kw)
    with pytest.raises(ValueError, match="belongs to a scored selection"):
        declared({"name": "x", "selection": {"kind": "sink_window", "sink": 4, "window": 8, "heads": "selective"}}, **kw)
    with pytest.raises(ValueError, match="give keep, not sparse_share"):
        declared({"name": "x", "selection": {**sel, "sparse_share": 0.5}, "budget": {"fp16_fraction": 1.0}}, **kw)
    with pytest.raises(ValueError, match="alpha belongs to Ada-KV"):
        _sel(alpha=0.5)
    with pytest.raises(ValueError, match="no store or rest"):  # a stored dense class is storage middle instead
        declared({"name": "x", "selection": sel, "storage": {"rest": "int2"}}, **kw)
    with pytest.raises(ValueError, match="out of reach"):  # above a dense cache: no pair need be sparse
        declared({"name": "x", "selection": sel, "budget": {"fp16_fraction": 2.5}}, **kw)


def _own_bytes(m: int, keep: int, P: int, T: int, layers=30, h=3, d=64) -> int:
    """The selective rule's bytes stated here: a 16-byte header per layer, a class byte per pair, every
    token of a dense pair at 8 d bytes, a sparse pair's top keep and the T later tokens at 8 d + 8."""
    pairs = layers * h
    return layers * 16 + pairs + m * (keep + T) * (8 * d + 8) + (pairs - m) * (P + T) * 8 * d


def test_a_budget_below_every_pair_sparse_is_refused():
    # a quarter of float16's is an eighth of float32's: the 256 decode tokens every pair keeps are that already
    with pytest.raises(ValueError, match="out of reach of the selective rule"):
        selective_budget({"fp16_fraction": 0.25}, 64, prefill=1792, steps=256, **SMOL)


@pytest.mark.parametrize("fraction", [0.5, 0.45])
@pytest.mark.parametrize("keep", [80, 128, 160])
def test_the_budget_sets_the_share_of_sparse_pairs(fraction, keep):
    P, T, pairs = 1792, 256, 90
    n = P + T
    target = fraction * n * 30 * 2 * 3 * 64 * 2  # bytes of a float16 cache at the segment's end, times f
    share, k = selective_budget({"fp16_fraction": fraction}, keep, prefill=P, steps=T, **SMOL)
    m = round(share * pairs)
    assert m / pairs == share and k >= keep
    got = _own_bytes(m, k, P, T)
    assert got <= target and (target - got) / target <= 0.01  # within 1 % below the budget
    assert _own_bytes(m - 1, keep, P, T) > target  # the fewest sparse pairs that fit at the given keep
    assert _own_bytes(m, k + 1, P, T) > target or k == P  # the slack given back to the sparse keep
    # in tokens alone: f of a float32 cache is float16's 2f; s = (1 - f32) / (1 - rho), up to one pair and
    # the index, score and class bytes
    f32, rho = fraction / 2, (keep + T) / n
    assert abs(share - (1 - f32) / (1 - rho)) < 0.08
    # the audit's own statement derives the same share and keep, and the declared policy carries them
    from testbed.audit_checks.live_policies import declared_policy, policy_bytes

    live = {"model": "SmolLM2-135M-Instruct.Q4_1", "prefill": P, "steps": T, "window": 128, "group": 32,
            "evict_window": 256}
    entry = {"name": "sel", "selection": {"kind": "snapkv", "mode": "prefill", "keep": keep, "heads": "selective",
                                          "alloc": "concentrated"}, "budget": {"fp16_fraction": fraction}}
    pol = declared(entry, window=128, group=32, evict_window=256,
                   budget=dict(prefill=P, steps=T, **SMOL, tolerance=0.01))
    mine = declared_policy(entry, live)
    assert (pol.sparse_share, pol.keep) == (mine["sparse_share"], mine["keep"]) == (share, k)
    assert {k: v for k, v in mine.items() if not k.startswith("_")} == \
        {k: v for k, v in pol.config().items() if k not in ("name", "description")}
    assert pol.cache_bytes(n, 30, 3, 64, P) == policy_bytes(mine, n, {"layers": 30, "kv_heads": 3, "head_dim": 64}) \
        == got


def test_the_frontier_selective_protocol_validates_at_equal_bytes():
    from testbed.live.spec import policies_of
    from testbed.protocol import validate_protocol

    raw = json.loads((REPO / "protocols" / "frontier_selective.json").read_text())
    proto = validate_protocol(raw, "frontier_selective")
    assert proto["default"] is False and proto["live"]["segments"] == 8 and proto["live"]["prefill"] == 1792
    pols = {pol.name: pol for pol in policies_of(proto["live"])}
    rules = [pol for pol in pols.values() if pol.selective]
    assert sorted((pol.alloc, pol.alloc_from) for pol in rules) == \
        [("concentrated", "oracle"), ("concentrated", "prefill"), ("diffuse", "prefill"), ("random", "prefill")]
    n, target = 2048, 0.5 * 2048 * 30 * 2 * 3 * 64 * 2
    for pol in pols.values():  # every arm within 1 % below the budget; the rule and its controls at one byte count
        got = pol.cache_bytes(n, 30, 3, 64, 1792)
        assert got <= target and (target - got) / target <= 0.01, pol.name
    assert len({(pol.keep, pol.sparse_share, pol.cache_bytes(n, 30, 3, 64, 1792)) for pol in rules}) == 1


def test_the_retrieval_study_takes_the_rule_but_not_its_oracle_and_sliding_models_refuse_it():
    import transformers as tf

    from testbed.schema import ProtocolError
    from testbed.policies.cache import PolicyCache
    from testbed.protocol import validate_protocol

    sel = {"kind": "knorm", "mode": "prefill", "keep": 40, "heads": "selective", "alloc": "concentrated"}

    def raw(entry):
        return {"name": "r", "kind": "retrieval", "default": False,
                "retrieval": {"tasks": ["kv_needle"], "lengths": [512], "depths": [0.5], "trials": 1,
                              "policies": [entry]}}

    # the rule decides at the prefill's end from the prefill alone: a retrieval trial has one
    assert validate_protocol(raw({"name": "s", "selection": {**sel, "sparse_share": 0.5}}), "r")
    assert validate_protocol(raw({"name": "s", "selection": sel, "budget": {"fp16_fraction": 0.5}}), "r")
    with pytest.raises(ProtocolError, match="live study only"):  # the oracle reads a whole perplexity segment
        validate_protocol(raw({"name": "s", "selection": {**sel, "alloc_from": "oracle", "sparse_share": 0.5}}), "r")
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                         num_hidden_layers=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="not served by a mixed or selective policy"):
        PolicyCache.for_model(_sel(), cfg)


# -- inside a tiny random Llama ------------------------------------------------------------------------


def _llama(layers=4, heads=4, kv=2, d=16, seed=1):
    return tiny_llama(layers, heads, kv, d, seed)


def _run(model, pol, ids, prefill, step=False, scores=None, record=None):
    """Log-probs of the prefill's last token and every later one through ``pol``'s cache, and the cache
    and its stored bytes after the prefill and after each later forward."""
    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention

    cache = PolicyCache.for_model(pol, model.config, scores=scores, record_layer=record)
    out, nbytes = [], []
    with torch.no_grad(), policy_attention(model):
        out.append(model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits[:, -1:])
        cache.finish_prefill()
        nbytes.append(cache.stored_bytes())
        chunks = [ids[:, i:i + 1] for i in range(prefill, ids.shape[1])] if step else [ids[:, prefill:]]
        for c in chunks:
            out.append(model(input_ids=c, cache=cache, use_cache=True).logits)
            nbytes.append(cache.stored_bytes())
    return torch.log_softmax(torch.cat(out, 1), -1), cache, nbytes


def _reference(model, ids, prefill):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        a = model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True).logits[:, -1:]
        b = model(input_ids=ids[:, prefill:], past_key_values=cache, use_cache=True).logits
    return torch.log_softmax(torch.cat([a, b], 1), -1)


def _ids(seed, P, T, b=2):
    return torch.randint(0, 256, (b, P + T), generator=torch.Generator().manual_seed(seed))


def test_share_zero_is_the_reference():
    model = _llama()
    P, T = 48, 6
    ids = _ids(2, P, T)
    lp, cache, _ = _run(model, _sel(share=0.0), ids, P)
    assert not bool(cache.sel_sparse.any())
    assert torch.allclose(lp, _reference(model, ids, P), atol=1e-5, rtol=0)
    # every pair sparse is not: the rule does cut
    cut, _, _ = _run(model, _sel(share=1.0), ids, P)
    assert not torch.allclose(cut, lp, atol=1e-3, rtol=0)


def test_sparse_pairs_hold_the_scorers_top_keep_and_dense_pairs_every_token():
    model = _llama()
    P, T, keep = 48, 5, 7
    ids = _ids(3, P, T)
    _, cache, nbytes = _run(model, _sel(keep=keep, share=0.5), ids, P, record=1)
    sparse = cache.sel_sparse  # [B, L, H]
    assert sparse.sum((1, 2)).tolist() == [4, 4]  # round(1/2 x 8 pairs)
    counts = cache.held_counts()
    assert torch.equal(counts, torch.where(sparse, keep + T, P + T))
    layer = cache.layers[1]
    k_in = torch.cat(layer.recorded_k, dim=1)  # batch row 0's K of every token [H, n, D]
    own = -k_in[:, :P].double().norm(dim=-1)  # knorm stated here: the keys of smallest L2 norm
    for hh in range(2):
        held = layer.kept_index[0, hh][layer.kept_valid[0, hh]]
        if bool(sparse[0, 1, hh]):
            top = set(torch.sort(-own[hh], stable=True).indices[:keep].tolist())
            assert set(held[:keep].tolist()) == top
            assert held[keep:].tolist() == list(range(P, P + T))
        else:
            assert held.tolist() == list(range(P + T))
    # bytes after the prefill and after the chunk: the closed form stated here
    for got, n in zip(nbytes, (P, P + T)):
        held_all = torch.where(sparse[0], keep + n - P, n)
        assert got == 4 * 16 + 8 + int(held_all.sum()) * 8 * 16 + int(held_all[sparse[0]].sum()) * 8


def test_the_reversed_control_spares_the_complement():
    model = _llama()
    P, T = 48, 4
    ids = _ids(4, P, T)
    _, conc, _ = _run(model, _sel(alloc="concentrated"), ids, P)
    _, diff, _ = _run(model, _sel(alloc="diffuse"), ids, P)
    assert torch.equal(conc.sel_score, diff.sel_score)  # one measurement of the prefill
    assert torch.equal(conc.sel_sparse, ~diff.sel_sparse)  # at share 1/2 the reversed rule's sparse pairs are the rest
    for b in range(2):  # the concentrated rule's sparse pairs are the most concentrated (smallest support)
        s, sp = conc.sel_score[b], conc.sel_sparse[b]
        assert float(s[sp].max()) <= float(s[~sp].min())
        assert bool(((s > 0) & (s <= 1)).all())


def test_the_random_control_is_content_blind():
    model = _llama()
    P, T = 48, 3
    got = [_run(model, _sel(alloc="random", share=0.25), _ids(seed, P, T), P)[1].sel_sparse for seed in (5, 6)]
    assert torch.equal(got[0], got[1]) and torch.equal(got[0][0], got[0][1])
    # the pairs of the two smallest SHA-256 keys of "layer:head"
    keys = {(li, hi): hashlib.sha256(f"{li}:{hi}".encode()).digest()[:8] for li in range(4) for hi in range(2)}
    want = set(sorted(keys, key=keys.get)[:2])
    assert {(int(a), int(b)) for a, b in zip(*torch.nonzero(got[0][0], as_tuple=True))} == want


def test_the_oracle_reads_the_scores_handed_in():
    """The oracle's class is read from the scores the whole segment's float32 pass measured (handed to
    the cache), not from the prefill: two different score tables give their own classes."""
    from transformers import DynamicCache

    from testbed.policies.hook import policy_attention
    from testbed.policies.selection import observe_concentration

    model = _llama()
    P, T = 48, 6
    ids = _ids(7, P, T)
    with torch.no_grad(), policy_attention(model), observe_concentration(model) as seen:
        model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    whole = seen.scores(4)  # [B, L, H]: every query of the segment
    pol = _sel(alloc_from="oracle")
    _, cache, _ = _run(model, pol, ids, P, scores=whole)
    assert torch.equal(cache.sel_score, whole.double())
    for b in range(2):
        order = torch.sort(whole[b].flatten(), stable=True).indices[:4]
        assert set(order.tolist()) == set(torch.nonzero(cache.sel_sparse[b].flatten()).flatten().tolist())
    _, flipped, _ = _run(model, pol, ids, P, scores=-whole)
    assert torch.equal(flipped.sel_sparse, ~cache.sel_sparse)
    with pytest.raises(ValueError, match="oracle allocation needs its scores"):
        _run(model, pol, ids, P)


def test_a_chunk_equals_one_token_per_forward():
    model = _llama()
    P, T = 48, 6
    ids = _ids(8, P, T)
    chunk, _, _ = _run(model, _sel(scorer="tova"), ids, P)
    stepped, _, _ = _run(model, _sel(scorer="tova"), ids, P, step=True)
    assert torch.allclose(chunk, stepped, atol=1e-5, rtol=0)


def test_a_later_token_before_the_classes_is_refused():
    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention

    model = _llama()
    ids = _ids(9, 48, 2)
    cache = PolicyCache.for_model(_sel(), model.config)
    with torch.no_grad(), policy_attention(model):
        model(input_ids=ids[:, :48], cache=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="waits for its classes"):
            model(input_ids=ids[:, 48:], cache=cache, use_cache=True)


# -- end to end ----------------------------------------------------------------------------------------


def _arm(name, alloc, frm="prefill", kind="snapkv"):
    return {"name": name, "selection": {"kind": kind, "mode": "prefill", "keep": 80, "heads": "selective",
                                        "alloc": alloc, "alloc_from": frm}, "budget": {"fp16_fraction": 1.2}}


ARMS = [_arm("sel_conc", "concentrated"), _arm("sel_rand", "random"), _arm("sel_diff", "diffuse"),
        _arm("sel_oracle", "concentrated", "oracle"), _arm("sel_knorm", "concentrated", kind="knorm")]


@pytest.fixture(scope="module")
def sel_run(tmp_path_factory):
    return tiny_live_run(tmp_path_factory, "selective_tiny", ARMS, prefill=160, steps=16, budget_tolerance=0.1)


@pytest.mark.slow
def test_the_rule_its_controls_and_oracle_pass_the_audit(sel_run):
    rows = audited_rows(sel_run)
    arms = [a["name"] for a in ARMS]
    assert len({rows[a]["bytes_final"] for a in arms}) == 1  # one budget: the same bytes
    conc, diff = (_arrays.load(sel_run, rows[a]["arrays"]["select_sparse"]) for a in ("sel_conc", "sel_diff"))
    m = int(conc.sum())
    assert m == round(rows["sel_conc"]["policy"]["sparse_share"] * 90) == int(diff.sum()) and 45 < m < 90
    score = _arrays.load(sel_run, rows["sel_conc"]["arrays"]["select_score"])
    assert np.array_equal(score, _arrays.load(sel_run, rows["sel_diff"]["arrays"]["select_score"]))
    assert score[conc == 1].max() <= score[conc == 0].min() and score[diff == 1].min() >= score[diff == 0].max()
    oracle = _arrays.load(sel_run, rows["sel_oracle"]["arrays"]["select_score"])
    assert not np.array_equal(oracle, score)  # the whole segment's attention, not the prefill's
    from testbed.report_html import policy_family

    # families of their own on the frontier figure (the audit re-derives the figure's data: passed above)
    assert [policy_family(rows[a]) for a in ("sel_conc", "sel_rand", "sel_oracle")] == \
        ["snapkv (prefill, selective concentrated)", "snapkv (prefill, selective random)",
         "snapkv (prefill, selective concentrated oracle)"]


def _rewrite(run: Path, rel: str, x) -> None:
    _arrays.save(run, rel, x)
    m = json.loads((run / "manifest.json").read_text())
    x = np.asarray(x)
    m["arrays"][rel].update(sha256=_arrays.sha(run, rel), shape=list(x.shape), nbytes=int(x.nbytes), dtype=x.dtype.str)
    (run / "manifest.json").write_text(json.dumps(m, indent=1))


@pytest.mark.slow
@pytest.mark.parametrize("forgery", ["flip", "swap"])
def test_a_forged_class_fails_the_audit(sel_run, tmp_path, forgery):
    """``flip``: one dense pair (outside the evidence layer) made sparse; ``swap``: the most concentrated
    sparse pair and the least concentrated dense pair exchange classes, their counts with them (the
    number of sparse pairs and the bytes unchanged). The audit fails the arm both times."""
    from testbed.audit import audit

    run = tmp_path / "copy"
    shutil.copytree(sel_run, run)
    row = rows_by_arm(run)["sel_conc"]
    a = row["arrays"]
    sparse, score, count = (_arrays.load(run, a[k]).copy() for k in ("select_sparse", "select_score", "select_count"))
    other = np.arange(sparse.shape[0]) != 7  # not the evidence layer
    dense = np.argwhere((sparse == 0) & other[:, None])
    chosen = np.argwhere((sparse == 1) & other[:, None])
    d = tuple(dense[np.argmin(score[tuple(dense.T)])])
    c = tuple(chosen[np.argmax(score[tuple(chosen.T)])]) if forgery == "swap" else None
    sparse[d], count[d] = 1, count[tuple(chosen[0])]
    if c is not None:
        sparse[c], count[c] = 0, 160 + 16
    _rewrite(run, a["select_sparse"], sparse)
    _rewrite(run, a["select_count"], count)
    ok, failures, _ = audit(run)
    assert not ok
    text = " ".join(failures)
    assert "sel_conc" in text and "select_sparse is not the concentrated rule's choice" in text


@pytest.mark.slow
def test_a_forged_kept_set_fails_the_audit(sel_run, tmp_path):
    """knorm's sparse head at the evidence layer: its best kept prefill token swapped for its worst dropped
    one, K/V, index and score rewritten from the recorded inputs (counts unchanged). The audit fails it."""
    from testbed.audit import audit

    run = tmp_path / "copy"
    shutil.copytree(sel_run, run)
    ev = rows_by_arm(run)["sel_knorm"]["evidence"]["arrays"]
    a = {k: _arrays.load(run, v).copy() for k, v in ev.items()}
    hh = int(np.flatnonzero(a["kept.sparse"] == 1)[0])
    keep = 80
    idx = a["kept.index"][hh, :keep]
    own = -np.sqrt((a["input.k"][hh, :160].astype(np.float64) ** 2).sum(-1))
    dropped = np.setdiff1d(np.arange(160), idx)
    worst = int(dropped[np.argmin(own[dropped])])
    slot = int(np.argmax(own[idx]))
    new = np.sort(np.concatenate([np.delete(idx, slot), [worst]]))
    a["kept.index"][hh, :keep] = new
    a["kept.score"][hh, :keep] = own[new].astype(np.float32)
    a["float.k"][hh, :keep] = a["input.k"][hh, new]
    a["float.v"][hh, :keep] = a["input.v"][hh, new]
    for name in ("kept.index", "kept.score", "float.k", "float.v"):
        _rewrite(run, ev[name], a[name])
    ok, failures, _ = audit(run)
    assert not ok
    assert any("sel_knorm" in f and "kept set" in f for f in failures), failures[:4]


@pytest.mark.slow
@pytest.mark.parametrize("layer", [
    pytest.param(3, marks=pytest.mark.xfail(strict=True, reason=(
        "known gap: the prefill concentration of a layer other than the evidence layer is stored, not re-derived "
        "(its queries are not stored), and the arms that read one prefill store one content-addressed select_score "
        "array, so a forger who keeps the pairs' order (every class and count) goes unseen"))),
    7])
def test_a_forged_class_score_fails_the_audit(sel_run, tmp_path, layer):
    """One pair's stored concentration moved halfway to the next larger one (the order of the pairs, hence
    every class and count, unchanged), the evidence layer's copy with it: at the evidence layer (7) the
    audit's own concentration of the recorded queries and keys differs; at another layer nothing can
    (the strict xfail says why)."""
    from testbed.audit import audit

    run = tmp_path / "copy"
    shutil.copytree(sel_run, run)
    a = rows_by_arm(run)["sel_conc"]["arrays"]
    score = _arrays.load(run, a["select_score"]).copy()
    flat = np.sort(score.flatten())
    hh = int(np.argmin(score[layer]))
    above = flat[flat > score[layer, hh]][0]
    score[layer, hh] = (score[layer, hh] + above) / 2
    _rewrite(run, a["select_score"], score)
    for arm in ("sel_conc", "sel_diff", "sel_knorm"):  # each evidence layer's copy, consistently
        ev = rows_by_arm(run)[arm]["evidence"]["arrays"]
        _rewrite(run, ev["select.score"], score[7])
    ok, failures, _ = audit(run)
    assert not ok
    assert "sel_conc" in " ".join(failures) and "the audit's float64 concentration" in " ".join(failures)
