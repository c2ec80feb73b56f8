"""PyramidKV: per-layer budgets for a prefill scored selection (selection ``layers: "pyramid"``, ``beta``).

- the per-layer counts: worked by hand from the paper's / kvpress's rule (the last layer keeps
  mean / beta, the first 2 mean - mean / beta, capped at prefill - window, the layers between on a
  straight line), falling with depth, summing to layers x mean up to rounding, and kvpress's uniform
  fallback where its bounds fail;
- a budget is the whole cache's: the per-layer counts with every decode token land within the
  tolerance below it, and the next mean would exceed it; the audit derives the same counts;
- the uniform schedule is unchanged: no new field in a preset's or a uniform declared policy's
  config, and a pyramid whose counts are all equal (beta 1) keeps what uniform keeps, byte for byte;
- bad input is one ``ValueError`` naming it (unknown schedule, online mode, beta < 1, no model layers);
- kvpress's ``PyramidKVPress`` keeps the same count and the same tokens at every layer of a tiny
  random Llama (its ``compress`` called on the same tensors, without its model hooks);
- end to end on SmolLM2: pyramid arms run and pass the audit, and a forged per-layer count or kept
  set at the evidence layer fails it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from testbed.policies import scorers
from testbed.policies.budget import budget_keep
from testbed.policies.compose import declared
from testbed.policies.policy import Policy, pyramid_keep
from testbed.policies.presets import PRESETS, preset
from tests import _arrays
from tests._helpers import audited_rows, tiny_live_run

REPO = Path(__file__).resolve().parent.parent
SMOL = dict(layers=30, kv_heads=3, head_dim=64)
LAYER_FIELDS = {"layers", "beta", "layer_keep"}


# -- the per-layer counts --------------------------------------------------------------------------


def test_the_counts_worked_by_hand():
    # mean 140 over 4 layers of a 320-token prefill, beta 2, window 64: last 70, first 210, step 140 / 3
    assert pyramid_keep(140, 320, 4, 2, 64) == (210, 163, 117, 70)
    # mean 200: the first layer would keep 300 > 320 - 64, so 256, and the last 2 x 200 - 256 = 144
    assert pyramid_keep(200, 320, 4, 2, 64) == (256, 219, 181, 144)
    # no window: mean 60 of 160, beta 4: 15 .. 105 in steps of 30
    assert pyramid_keep(60, 160, 4, 4, 0) == (105, 75, 45, 15)
    # kvpress's fallback: mean / beta = 20 below the window of 64: the same count at every layer
    assert pyramid_keep(400, 1000, 4, 20, 64) == (400,) * 4
    # beta 1: the first and the last layer both keep the mean
    assert pyramid_keep(90, 300, 5, 1, 64) == (90,) * 5


@pytest.mark.parametrize("mean,prefill,layers,beta,window", [
    (248, 1792, 30, 3, 64), (500, 1792, 30, 2, 64), (900, 1792, 30, 20, 0), (37, 80, 30, 2, 0), (1500, 1792, 30, 2, 64),
])
def test_counts_fall_with_depth_and_sum_to_the_mean(mean, prefill, layers, beta, window):
    k = pyramid_keep(mean, prefill, layers, beta, window)
    assert len(k) == layers and all(a >= b for a, b in zip(k, k[1:]))
    assert k[0] > k[-1]  # a real pyramid at these sizes, not the fallback
    assert k[0] <= prefill - window and k[-1] >= window
    assert abs(sum(k) - layers * mean) <= layers / 2  # each count within one half of the line


# -- budgets -----------------------------------------------------------------------------------------


def _bytes(counts, steps, kv_heads=3, head_dim=64):
    """Whole-cache bytes, written out: per layer a 16-byte header and, per KV head, every kept prefill
    token and decode token's float32 K and V, int32 index and float32 score."""
    return sum(16 + kv_heads * (c + steps) * (2 * head_dim * 4 + 8) for c in counts)


@pytest.mark.parametrize("budget", [{"fp16_fraction": 0.5}, {"fp16_fraction": 0.7}, {"bytes_per_token": 9000.0}])
@pytest.mark.parametrize("kind,beta", [("snapkv", 3), ("snapkv", 20), ("knorm", 2)])
def test_a_pyramid_budget_is_the_whole_caches_within_one_percent(budget, kind, beta):
    from testbed.audit_checks.live_policies import declared_policy

    prefill, steps = 1792, 256
    n = prefill + steps
    entry = {"name": "pyr", "selection": {"kind": kind, "mode": "prefill", "layers": "pyramid", "beta": beta},
             "budget": budget}
    pol = declared(entry, window=128, group=32, evict_window=256,
                   budget=dict(prefill=prefill, steps=steps, **SMOL, tolerance=0.01))
    fp16 = 30 * 2 * 3 * 64 * 2
    target = budget.get("bytes_per_token", budget.get("fp16_fraction", 0) * fp16) * n
    got = _bytes(pol.layer_keep, steps)
    assert 0 <= target - got <= 0.01 * target
    assert got == pol.cache_bytes(n, 30, 3, 64, prefill)
    w = 64 if kind == "snapkv" else 0
    assert _bytes(pyramid_keep(pol.keep + 1, prefill, 30, beta, w), steps) > target  # the largest mean that fits
    assert list(pol.layer_keep) == sorted(pol.layer_keep, reverse=True)
    # the audit's own derivation: the same mean, counts and fields
    live = {"model": "SmolLM2-135M-Instruct.Q4_1", "prefill": prefill, "steps": steps, "window": 128, "group": 32,
            "evict_window": 256, "policies": [entry]}
    cfg = {k: v for k, v in pol.config().items() if k not in ("name", "description")}
    assert {k: v for k, v in declared_policy(entry, live).items() if not k.startswith("_")} == cfg
    if pol.keep / beta < w:  # kvpress's fallback (its defaults, beta 20 and window 64, at every budget here)
        assert len(set(pol.layer_keep)) == 1
    else:
        assert pol.layer_keep[0] > pol.layer_keep[-1]


def test_the_uniform_schedule_is_unchanged():
    for name in PRESETS:
        assert not LAYER_FIELDS & set(preset(name).config()), name
    proto = json.loads((REPO / "protocols" / "frontier.json").read_text())["live"]
    budget = dict(prefill=proto["prefill"], steps=proto["steps"], **SMOL, tolerance=proto.get("budget_tolerance", 0.01))
    for entry in proto["policies"]:
        if not isinstance(entry, dict) or entry.get("selection", {}).get("layers") == "pyramid":
            continue
        kw = dict(window=proto["window"], group=proto["group"], evict_window=proto["evict_window"], budget=budget)
        pol = declared(entry, **kw)
        assert not LAYER_FIELDS & set(pol.config()), entry["name"]
        if pol.scored:  # "layers": "uniform" said out loud is the same policy
            same = declared({**entry, "selection": {**entry["selection"], "layers": "uniform"}}, **kw)
            assert same == pol and pol.keep_of(7) == pol.keep


def test_bad_schedules_are_refused():
    kw = dict(window=16, group=16, evict_window=16, budget=dict(prefill=320, steps=8, **SMOL, tolerance=0.05))
    sel = {"kind": "snapkv", "mode": "prefill", "keep": 140}
    with pytest.raises(ValueError, match="layers must be one of"):
        declared({"name": "x", "selection": {**sel, "layers": "funnel"}}, **kw)
    with pytest.raises(ValueError, match="mode must be 'prefill'"):
        declared({"name": "x", "selection": {"kind": "knorm", "keep": 40, "layers": "pyramid"}}, **kw)
    with pytest.raises(ValueError, match="beta"):
        declared({"name": "x", "selection": {**sel, "layers": "pyramid", "beta": 0}}, **kw)
    with pytest.raises(ValueError, match="beta"):
        declared({"name": "x", "selection": {**sel, "layers": "pyramid", "beta": 2.5}}, **kw)
    with pytest.raises(ValueError, match="model's layers"):  # a model given by path, or the retrieval study
        declared({"name": "x", "selection": {**sel, "layers": "pyramid"}}, window=16, group=16, evict_window=16,
                 budget=dict(prefill=320, steps=8, layers=None, kv_heads=None, head_dim=None))
    with pytest.raises(ValueError, match="belongs to a scored selection"):
        declared({"name": "x", "selection": {"kind": "sink_window", "sink": 4, "window": 8, "layers": "pyramid"}}, **kw)
    with pytest.raises(ValueError, match="beta"):
        pyramid_keep(100, 320, 4, 0, 64)
    with pytest.raises(ValueError, match="fewer tokens with depth"):
        Policy("x", "drop", scorer="knorm", scorer_mode="prefill", keep=10, layers="pyramid", layer_keep=(5, 10))
    with pytest.raises(ValueError, match="layer_keep"):
        Policy("x", "drop", scorer="knorm", scorer_mode="prefill", keep=10, layers="pyramid")
    with pytest.raises(ValueError, match="out of reach"):
        budget_keep({"fp16_fraction": 0.05}, mode="prefill", prefill=1792, steps=256, **SMOL, pyramid_beta=3,
                    pyramid_window=64)


# -- inside a tiny random Llama; kvpress as the peer ------------------------------------------------------


def _llama(layers=4, heads=4, kv=2, d=16, seed=1):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=heads * d, intermediate_size=96, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=d, num_hidden_layers=layers, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _pyramid(mean, prefill, layers, beta, scorer="snapkv"):
    w = 64 if scorer == "snapkv" else 0
    return Policy("pyr", "drop", scorer=scorer, scorer_mode="prefill", keep=mean, layers="pyramid", beta=beta,
                  layer_keep=pyramid_keep(mean, prefill, layers, beta, w))


def _run(model, pol, ids, prefill):
    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention

    cache = PolicyCache.for_model(pol, model.config)
    with torch.no_grad(), policy_attention(model):
        a = model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits
        b = model(input_ids=ids[:, prefill:], cache=cache, use_cache=True).logits
    return torch.log_softmax(torch.cat([a[:, -1:], b], 1), -1), cache


def test_each_layer_keeps_its_own_count_and_bytes():
    model = _llama()
    P, T = 320, 6
    ids = torch.randint(0, 256, (2, P + T), generator=torch.Generator().manual_seed(2))
    pol = _pyramid(140, P, 4, 2)
    _, cache = _run(model, pol, ids, P)
    assert [layer.kept_index.shape[-1] for layer in cache.layers] == [210 + T, 163 + T, 117 + T, 70 + T]
    assert cache.stored_bytes() == _bytes((210, 163, 117, 70), T, kv_heads=2, head_dim=16)
    # a pyramid whose counts are all equal (beta 1) keeps what the uniform schedule keeps, byte for byte
    flat, c1 = _run(model, _pyramid(140, P, 4, 1), ids, P)
    uni, c2 = _run(model, Policy("u", "drop", scorer="snapkv", scorer_mode="prefill", keep=140), ids, P)
    assert torch.equal(flat, uni) and c1.stored_bytes() == c2.stored_bytes()
    assert all(torch.equal(x.kept_index, y.kept_index) for x, y in zip(c1.layers, c2.layers))
    with pytest.raises(ValueError, match="derived for 4 layers; the model has 2"):
        from testbed.policies.cache import PolicyCache

        PolicyCache.for_model(pol, _llama(layers=2).config)


def _full_attention(q, k, scale):
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(g, dim=1)) * scale
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1, dtype=torch.float32)


@pytest.mark.parametrize("mean,beta", [(140, 2), (200, 2), (160, 20), (100, 20)],
                         ids=["pyramid", "capped", "capped_beta20", "fallback"])
def test_pyramidkv_keeps_what_kvpress_pyramidkvpress_keeps(mean, beta):
    """kvpress's ``PyramidKVPress.compress`` on each layer's prefill keys (its scores from the same
    attention matrix, handed as ``attentions``; values tagged with their positions to read back what
    it kept) against testbed's cache run through the model: the same count at every layer and the
    same tokens, up to near ties (each swap asserted one)."""
    kvpress = pytest.importorskip("kvpress", reason="the kvpress peer: bash scripts/install.sh installs it")
    from testbed.live import shared_prefill
    from testbed.sources.models import forward_kwargs

    model = _llama()
    P, L = 320, 4
    ids = torch.randint(0, 256, (2, P), generator=torch.Generator().manual_seed(5))
    pol = _pyramid(mean, P, L, beta)
    _, cache = _run(model, pol, torch.cat([ids, ids[:, :1]], 1), P)
    shared, _ = shared_prefill(model, forward_kwargs(model), ids, query_tail=P)
    press = kvpress.PyramidKVPress(compression_ratio=1.0 - mean / P, beta=beta)
    snap = scorers.get("snapkv")
    swaps = kept = 0
    counts = []
    for layer in range(L):
        q, k, scale = shared.tails[layer], shared.keys[layer].float(), shared.scales[layer]
        b, h, n, d = k.shape
        tags = torch.arange(n, dtype=k.dtype).view(1, 1, n, 1).expand(b, h, n, d).contiguous()
        attn = model.model.layers[layer].self_attn
        _, v2 = press.compress(attn, torch.zeros(b, n, 8), k, tags, _full_attention(q, k, scale), {})
        theirs = torch.sort(v2[..., 0].round().long(), dim=-1).values
        mine = cache.layers[layer].kept_index[..., :-1]  # the prefill's kept tokens (the decode token after)
        counts.append(theirs.shape[-1])
        assert mine.shape == theirs.shape, f"layer {layer}: testbed keeps {mine.shape[-1]}, kvpress {theirs.shape[-1]}"
        score = snap.attention_score(q, k, scale, torch.zeros(b, h, n), None)
        for bi in range(b):
            for hi in range(h):
                a, c = set(theirs[bi, hi].tolist()), set(mine[bi, hi].tolist())
                for x, y in zip(sorted(a - c), sorted(c - a)):
                    swaps += 1
                    s = score[bi, hi].double()
                    assert abs(s[x] - s[y]) <= 1e-5 * max(abs(s[x]), abs(s[y])), \
                        f"layer {layer} head {hi}: kvpress kept {x}, testbed {y}: not a near tie"
        kept += b * h * theirs.shape[-1]
    assert counts == list(pol.layer_keep)
    # mean 100 / beta 20 is below the window of 64 and its first count (195) is not cut: kvpress's fallback
    assert (len(set(counts)) == 1) == (mean == 100)
    assert swaps == 0, f"{swaps} near-tie swaps in {kept} kept tokens"  # measured: none


# -- end to end ----------------------------------------------------------------------------------------

ARMS = [{"name": "knorm_pyr", "selection": {"kind": "knorm", "mode": "prefill", "keep": 40, "layers": "pyramid",
                                            "beta": 2}},
        {"name": "tova_pyr", "selection": {"kind": "tova", "mode": "prefill", "layers": "pyramid", "beta": 3},
         "budget": {"fp16_fraction": 0.8}},
        {"name": "knorm_pre", "selection": {"kind": "knorm", "mode": "prefill", "keep": 40}}]


@pytest.fixture(scope="module")
def pyramid_run(tmp_path_factory):
    return tiny_live_run(tmp_path_factory, "pyramid_tiny", ARMS, prefill=80, steps=24, budget_tolerance=0.1)



@pytest.mark.slow
def test_pyramid_arms_run_and_pass_the_audit(pyramid_run):
    rows = audited_rows(pyramid_run)
    pyr, uni = rows["knorm_pyr"], rows["knorm_pre"]
    # mean 40 of an 80-token prefill, beta 2, no window: 60 at layer 0 down to 20 at layer 29
    counts = pyr["policy"]["layer_keep"]
    assert counts[0] == 60 and counts[-1] == 20 and counts == sorted(counts, reverse=True) and len(counts) == 30
    assert pyr["bytes_final"] == _bytes(counts, 24)
    assert uni["bytes_final"] == _bytes([40] * 30, 24) and not LAYER_FIELDS & set(uni["policy"])
    kept = _arrays.load(pyramid_run, pyr["evidence"]["arrays"]["kept.index"])
    assert kept.shape == (3, counts[7] + 24)  # the evidence layer's own count
    # 0.8 of float16's bytes at 104 tokens, 24 of them decode tokens that every layer keeps
    budget = 0.8 * 104 * 30 * 2 * 3 * 64 * 2
    assert 0.9 * budget <= rows["tova_pyr"]["bytes_final"] <= budget
    counts = rows["tova_pyr"]["policy"]["layer_keep"]
    assert counts[0] > counts[-1] and rows["tova_pyr"]["bytes_final"] == _bytes(counts, 24)


def _forge_array(run: Path, rel: str, x) -> None:
    _arrays.save(run, rel, x)
    m = json.loads((run / "manifest.json").read_text())
    m["arrays"][rel]["sha256"] = _arrays.sha(run, rel)
    (run / "manifest.json").write_text(json.dumps(m, indent=1))


@pytest.mark.slow
@pytest.mark.parametrize("forgery", ["kept_set", "count"])
def test_a_forged_per_layer_count_fails(pyramid_run, tmp_path, forgery):
    """The evidence layer's kept set one token short in every head (indices, scores, K and V, all
    re-hashed: consistent with each other); for ``count`` also the row's layer_keep, its bytes after
    every forward and its summaries edited to say so, results.json re-hashed. The audit re-derives
    the layer's count from the declaration and fails the arm either way."""
    from testbed.audit import audit
    from tests._helpers import forge_results

    run = tmp_path / "copy"
    shutil.copytree(pyramid_run, run)
    res = json.loads((run / "results.json").read_text())
    row = next(r for r in res["rows"] if r["arm"] == "knorm_pyr")
    ev = row["evidence"]["arrays"]
    idx = _arrays.load(run, ev["kept.index"])
    drop = 0  # the oldest kept prefill token of each head
    _forge_array(run, ev["kept.index"], np.delete(idx, drop, axis=1))
    for name in ("kept.score", "float.k", "float.v"):
        _forge_array(run, ev[name], np.delete(_arrays.load(run, ev[name]), drop, axis=1))
    if forgery == "count":
        row["policy"]["layer_keep"][7] -= 1
        by = _arrays.load(run, row["arrays"]["bytes"]).copy()
        by -= 3 * (2 * 64 * 4 + 8)
        _forge_array(run, row["arrays"]["bytes"], by)
        row["bytes_final"] = int(by[-1])
        row["bytes_per_token"] = float(by[-1]) / row["context_final"]
        forge_results(run, res)
    ok, failures, _ = audit(run)
    assert not ok
    want = "kept.index" if forgery == "kept_set" else "policy.layer_keep"
    assert any("knorm_pyr" in f and want in f for f in failures), failures[:5]
    if forgery == "count":
        assert any("knorm_pyr" in f and "kept.index" in f for f in failures), failures[:5]
