"""Ada-KV: per-head budgets for a prefill scored selection (selection ``heads: "adaptive"``, ``alpha``).

- the rule (:func:`testbed.policies.scorers.keep_adaptive`): worked by hand on a small example, and
  against a brute-force statement written here (each head's own top safeguard, then the layer's top
  over every head's remaining tokens, ties to the older token then the lower head) on random scores
  with many ties; kvpress's safeguard arithmetic (``int(keep * alpha)``, at least 1);
- the policy: the per-head fields in a row's config only for an adaptive arm; bad input is one
  ``ValueError`` naming it (online mode, unknown schedule, alpha out of range or on a uniform arm, a
  keep below what the scorer always keeps); a budget derives the same ``keep`` as the uniform arm's;
- inside a tiny random Llama: the heads' counts sum to the layer's, the bytes count only held tokens
  (equal to the uniform arm's), empty slots are never attended (garbage written there changes no
  logit), a decode chunk equals the same tokens one per forward, alpha 1 is the uniform arm;
- a concentrated head gives tokens to a diffuse one on a constructed example, down to its safeguard;
- kvpress's ``AdaKVPress(SnapKVPress)`` (its ``compress`` called on the same keys and attention
  matrix, its model hooks left out) keeps the same tokens at every layer, up to near ties;
- end to end on SmolLM2: adaptive arms run and pass the audit; a forged per-head count and a forged
  kept set each fail it;
- the audit's adaptive checks alone (numpy, a stub context, synthetic arrays): an honest split passes
  (also one with a head that holds nothing), each forgery fails.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from testbed.policies import scorers
from testbed.policies.compose import declared
from testbed.policies.policy import HEAD_FIELDS, Policy, pyramid_keep, safeguard_count
from testbed.policies.presets import PRESETS, preset
from tests import _arrays
from tests._helpers import audited_rows, rows_by_arm, tiny_live_run

REPO = Path(__file__).resolve().parent.parent
SMOL = dict(layers=30, kv_heads=3, head_dim=64)
KW = dict(window=16, group=16, evict_window=16)


# -- the rule ----------------------------------------------------------------------------------------


def _brute(score, keep: int, safe: int) -> set:
    """The kept (head, position) pairs of one sequence's ``score [H, n]``, stated without tensors."""
    h, n = len(score), len(score[0])
    if n <= keep:
        return {(hh, i) for hh in range(h) for i in range(n)}
    kept = set()
    for hh in range(h):  # each head's own top safeguard, ties to the older token
        order = sorted(range(n), key=lambda i: (-score[hh][i], i))
        kept |= {(hh, i) for i in order[:safe]}
    rest = sorted(((hh, i) for hh in range(h) for i in range(n) if (hh, i) not in kept),
                  key=lambda p: (-score[p[0]][p[1]], p[1], p[0]))  # ties: the older token, then the lower head
    return kept | set(rest[: h * keep - len(kept)])


def _pairs(mask: torch.Tensor) -> set:
    return {(int(hh), int(i)) for hh, i in zip(*torch.nonzero(mask, as_tuple=True))}


def test_the_rule_worked_by_hand():
    # two heads of 6 tokens, keep 3 each (6 in all), safeguard 1: head 0 concentrated on token 0, head 1 flat
    score = torch.tensor([[[0.9, 0.01, 0.02, 0.01, 0.03, 0.03],
                           [0.2, 0.15, 0.15, 0.1, 0.2, 0.2]]])
    kept = scorers.keep_adaptive(score, 3, 1)
    # head 0's safeguard: token 0; head 1's: token 0 (0.2, the oldest of three). The remaining 4 of the
    # layer: head 1's 0.2 at tokens 4 and 5, then its 0.15 at tokens 1 and 2; head 0's 0.03 lose
    assert _pairs(kept[0]) == {(0, 0), (1, 0), (1, 4), (1, 5), (1, 1), (1, 2)}
    assert kept.sum(-1).tolist() == [[1, 5]]
    # a safeguard of all of keep: each head's own top 3, the uniform rule
    assert _pairs(scorers.keep_adaptive(score, 3, 3)[0]) == {(0, 0), (0, 4), (0, 5), (1, 0), (1, 4), (1, 5)}
    # keep 2: the ties at 0.03 (head 0) and 0.2 (head 1) go to the older token, 4
    assert _pairs(scorers.keep_adaptive(score, 2, 2)[0]) == {(0, 0), (0, 4), (1, 0), (1, 4)}
    # a tie across heads goes to the older token, then the lower head
    flat = torch.zeros(1, 2, 4)
    assert _pairs(scorers.keep_adaptive(flat, 2, 0)[0]) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    assert _pairs(scorers.keep_adaptive(flat, 1, 0)[0]) == {(0, 0), (1, 0)}


@pytest.mark.parametrize("seed", range(6))
def test_the_rule_against_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    b, h, n = 2, 3, 24
    score = torch.randint(0, 6, (b, h, n), generator=g).float()  # few values: ties everywhere
    score[1] = torch.randn(h, n, generator=g)  # and one sequence without ties
    for keep in (1, 5, 11, 23, 24, 30):
        for alpha in (0.0, 0.2, 0.5, 1.0):
            safe = safeguard_count(keep, alpha)
            kept = scorers.keep_adaptive(score, keep, safe)
            for bi in range(b):
                assert _pairs(kept[bi]) == _brute(score[bi].tolist(), keep, safe), (keep, alpha, bi)
                assert int(kept[bi].sum()) == h * min(keep, n)
                assert bool((kept[bi].sum(-1) >= min(safe, n)).all())


def test_the_safeguard_is_kvpress_arithmetic():
    # kvpress 0.5.5 AdaKVPress: n_safe = int(n_kept * alpha_safeguard), max(1, .) when alpha > 0
    assert safeguard_count(140, 0.2) == 28
    assert safeguard_count(4, 0.2) == 1  # int(0.8) = 0, raised to 1
    assert safeguard_count(4, 0.0) == 0
    assert safeguard_count(100, 1.0) == 100
    assert safeguard_count(7, 0.5) == 3


# -- the policy --------------------------------------------------------------------------------------


def test_per_head_fields_only_for_adaptive_arms():
    for name in PRESETS:
        assert not set(HEAD_FIELDS) & set(preset(name).config()), name
    proto = json.loads((REPO / "protocols" / "frontier.json").read_text())["live"]
    budget = dict(prefill=proto["prefill"], steps=proto["steps"], **SMOL, tolerance=proto.get("budget_tolerance", 0.01))
    kw = dict(window=proto["window"], group=proto["group"], evict_window=proto["evict_window"], budget=budget)
    for entry in proto["policies"]:
        if isinstance(entry, dict):
            pol = declared(entry, **kw)
            assert not set(HEAD_FIELDS) & set(pol.config()), entry["name"]
            if pol.scored:  # "heads": "uniform" said out loud is the same policy
                assert declared({**entry, "selection": {**entry["selection"], "heads": "uniform"}}, **kw) == pol
    ada = declared({"name": "snapkv_ada_half", "selection": {"kind": "snapkv", "mode": "prefill", "heads": "adaptive"},
                    "budget": {"fp16_fraction": 0.5}}, **kw)
    uni = declared({"name": "snapkv_pre_half", "selection": {"kind": "snapkv", "mode": "prefill"},
                    "budget": {"fp16_fraction": 0.5}}, **kw)
    cfg = ada.config()
    assert cfg["heads"] == "adaptive" and cfg["alpha"] == 0.2
    # the bytes are the held tokens summed over heads, as the uniform arm's: the same kept count (that an
    # actual cache's held tokens come to those bytes: test_heads_share_the_layers_count_and_bytes)
    assert ada.keep == uni.keep
    # the audit's own mapping of the declaration gives the same fields
    from testbed.audit_checks.live_policies import declared_policy

    live = {"model": "SmolLM2-135M-Instruct.Q4_1", "prefill": proto["prefill"], "steps": proto["steps"],
            "window": proto["window"], "group": proto["group"], "evict_window": proto["evict_window"]}
    entry = {"name": "a", "selection": {"kind": "knorm", "mode": "prefill", "heads": "adaptive", "alpha": 0, "keep": 9}}
    mine = declared(entry, **kw)
    assert mine.alpha == 0.0 and isinstance(mine.alpha, float)
    want = {k: v for k, v in mine.config().items() if k not in ("name", "description")}
    assert {k: v for k, v in declared_policy(entry, live).items() if not k.startswith("_")} == want


def test_bad_per_head_schedules_are_refused():
    kw = dict(KW, budget=dict(prefill=320, steps=8, **SMOL, tolerance=0.05))
    sel = {"kind": "snapkv", "mode": "prefill", "keep": 140}
    with pytest.raises(ValueError, match=r"\(ada_on\).*mode must be 'prefill'"):
        declared({"name": "ada_on", "selection": {"kind": "knorm", "keep": 40, "heads": "adaptive"}}, **kw)
    with pytest.raises(ValueError, match="heads must be one of"):
        declared({"name": "x", "selection": {**sel, "heads": "ragged"}}, **kw)
    with pytest.raises(ValueError, match="alpha"):
        declared({"name": "x", "selection": {**sel, "heads": "adaptive", "alpha": 1.5}}, **kw)
    with pytest.raises(ValueError, match="alpha"):
        declared({"name": "x", "selection": {**sel, "heads": "adaptive", "alpha": "0.2"}}, **kw)
    with pytest.raises(ValueError, match="alpha belongs to a per-head schedule"):
        declared({"name": "x", "selection": {**sel, "alpha": 0.5}}, **kw)
    with pytest.raises(ValueError, match="belongs to a scored selection"):
        declared({"name": "x", "selection": {"kind": "sink_window", "sink": 4, "window": 8, "heads": "adaptive"}}, **kw)
    with pytest.raises(ValueError, match="keep must hold them"):  # the sink of 4 and a window of 6 in a keep of 8
        declared({"name": "x", "selection": {"kind": "expected_attention", "mode": "prefill", "keep": 8, "window": 6,
                                             "heads": "adaptive"}}, **kw)
    with pytest.raises(ValueError, match="scorer_mode must be 'prefill'"):
        Policy("x", "drop", scorer="knorm", keep=10, heads="adaptive")


# -- inside a tiny random Llama ------------------------------------------------------------------------


def _llama(layers=4, heads=4, kv=2, d=16, seed=1):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=heads * d, intermediate_size=96, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=d, num_hidden_layers=layers, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _ada(keep, alpha=0.2, scorer="snapkv", **kw):
    return Policy("ada", "drop", scorer=scorer, scorer_mode="prefill", keep=keep, heads="adaptive", alpha=alpha, **kw)


def _run(model, pol, ids, prefill, step=False, spoil=False):
    """Log-probs of the prefill's last token and every later one through ``pol``'s cache; ``step``:
    the later tokens one per forward; ``spoil``: garbage written into every empty slot first."""
    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention

    cache = PolicyCache.for_model(pol, model.config)
    out = []
    with torch.no_grad(), policy_attention(model):
        out.append(model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits[:, -1:])
        if spoil:
            g = torch.Generator().manual_seed(9)
            for layer in cache.layers:
                assert layer.kept_valid is not None  # the heads hold different counts here
                empty = ~layer.kept_valid[..., None]
                layer.kept_k = torch.where(empty, 50 * torch.randn(layer.kept_k.shape, generator=g), layer.kept_k)
                layer.kept_v = torch.where(empty, 50 * torch.randn(layer.kept_v.shape, generator=g), layer.kept_v)
        chunks = [ids[:, i:i + 1] for i in range(prefill, ids.shape[1])] if step else [ids[:, prefill:]]
        for c in chunks:
            out.append(model(input_ids=c, cache=cache, use_cache=True).logits)
    return torch.log_softmax(torch.cat(out, 1), -1), cache


def _bytes(counts_by_layer, d=16):
    return sum(16 + c * (2 * d * 4 + 8) for c in counts_by_layer)


def test_heads_share_the_layers_count_and_bytes():
    model = _llama()
    P, T = 320, 6
    ids = torch.randint(0, 256, (2, P + T), generator=torch.Generator().manual_seed(2))
    lp, cache = _run(model, _ada(140), ids, P)
    uni_lp, uni = _run(model, Policy("u", "drop", scorer="snapkv", scorer_mode="prefill", keep=140), ids, P)
    uneven = 0
    for layer in cache.layers:
        counts = layer.head_counts()  # [B, H]
        assert counts.sum(-1).tolist() == [2 * (140 + T)] * 2  # the layer's count, every decode token
        assert bool((counts >= safeguard_count(140, 0.2) + T).all())
        uneven += int((counts != 140 + T).sum())
        for bi in range(2):
            for hh in range(2):
                c = int(counts[bi, hh])
                held = layer.kept_index[bi, hh][layer.kept_valid[bi, hh]] if layer.kept_valid is not None \
                    else layer.kept_index[bi, hh]
                assert held.numel() == c and bool((held[-T:] == torch.arange(P, P + T)).all())
    assert uneven  # random heads do differ: tokens moved between them
    # bytes of the held tokens only, per (layer, KV head): the total is the uniform arm's
    assert cache.stored_bytes() == uni.stored_bytes() == _bytes([2 * (140 + T)] * 4)
    # the closed form a budget reads (Policy.cache_bytes) against bytes counted from sequence 0's held tokens
    held = _bytes([int(x.head_counts()[0].sum()) for x in cache.layers])
    assert held == _ada(140).cache_bytes(P + T, 4, 2, 16, P) == cache.stored_bytes()
    assert not torch.equal(lp, uni_lp)


def test_empty_slots_are_never_attended_and_a_chunk_is_exact():
    model = _llama()
    P, T = 320, 7
    ids = torch.randint(0, 256, (2, P + T), generator=torch.Generator().manual_seed(3))
    chunk, _ = _run(model, _ada(140), ids, P)
    spoiled, _ = _run(model, _ada(140), ids, P, spoil=True)
    assert torch.equal(chunk, spoiled)  # garbage in the empty slots: not one logit moves
    stepped, _ = _run(model, _ada(140), ids, P, step=True)
    spoiled_steps, _ = _run(model, _ada(140), ids, P, step=True, spoil=True)
    assert torch.equal(stepped, spoiled_steps)  # one token per forward (q = 1, packed GQA) too
    assert torch.allclose(chunk, stepped, atol=1e-5, rtol=0)  # the chunk's mask: held keys and new ones causal


def test_alpha_one_is_the_uniform_arm():
    model = _llama()
    P = 320
    ids = torch.randint(0, 256, (2, P + 4), generator=torch.Generator().manual_seed(4))
    lp, cache = _run(model, _ada(140, alpha=1.0), ids, P)
    uni_lp, uni = _run(model, Policy("u", "drop", scorer="snapkv", scorer_mode="prefill", keep=140), ids, P)
    assert torch.equal(lp, uni_lp)
    assert all(x.kept_valid is None and torch.equal(x.kept_index, y.kept_index) for x, y in zip(cache.layers, uni.layers))


def test_combines_with_a_pyramid():
    model = _llama()
    P, T = 320, 3
    ids = torch.randint(0, 256, (1, P + T), generator=torch.Generator().manual_seed(6))
    counts = pyramid_keep(140, P, 4, 2, 64)
    pol = Policy("pa", "drop", scorer="snapkv", scorer_mode="prefill", keep=140, layers="pyramid", beta=2,
                 layer_keep=counts, heads="adaptive")
    _, cache = _run(model, pol, ids, P)
    for layer, c in zip(cache.layers, counts):
        assert layer.head_counts().sum().item() == 2 * (c + T)
        assert bool((layer.head_counts() >= safeguard_count(c, 0.2) + T).all())
    assert cache.stored_bytes() == _bytes([2 * (c + T) for c in counts]) == pol.cache_bytes(P + T, 4, 2, 16, P)


def _constructed_layer(alpha):
    """One snapkv layer of two KV heads (one query head each) over a 200-token prefill: head 0's
    window queries point at 5 keys far along one axis (its attention concentrates on them), head 1's
    queries are zero (its attention is spread evenly over every key it sees)."""
    from testbed.policies.scored import ScoredLayer

    g = torch.Generator().manual_seed(0)
    P, D = 200, 8
    keys = 0.1 * torch.randn(1, 2, P, D, generator=g)
    special = torch.arange(40, 45)
    keys[0, 0, special, 0] = 10.0
    query = torch.zeros(1, 2, 64, D)
    query[0, 0, :, 0] = 5.0
    layer = ScoredLayer(_ada(80, alpha=alpha), scorers.get("snapkv"), layer_idx=0)
    layer.load_prefill(keys, torch.randn(1, 2, P, D, generator=g), query, D ** -0.5)
    return layer, special


def test_a_concentrated_head_gives_tokens_to_a_diffuse_one():
    layer, special = _constructed_layer(0.2)
    c0, c1 = layer.head_counts()[0].tolist()
    assert c0 + c1 == 160 and c0 < 80 < c1
    kept0 = set(layer.kept_index[0, 0, :c0].tolist())
    assert set(special.tolist()) <= kept0  # what head 0 attends, it keeps
    assert set(range(136, 200)) <= kept0  # its observation window, always
    # and nothing else: its other tokens draw almost no attention, below head 1's -- but snapkv pools its
    # scores over 5 neighbours, so the two tokens either side of the special ones share their attention
    assert kept0 == set(range(38, 47)) | set(range(136, 200))
    # the safeguard binds: at alpha 0.95 head 0 keeps its own top 76 whatever head 1 scores
    layer, _ = _constructed_layer(0.95)
    assert layer.head_counts()[0].tolist() == [safeguard_count(80, 0.95), 160 - safeguard_count(80, 0.95)]


def test_stored_bytes_refuses_sequences_of_unequal_counts():
    """Per sequence bytes need every sequence to hold the same count: a layer whose two sequences hold
    counts differing by 2 (the batch's total still divisible by 2) is refused, not averaged."""
    from testbed.policies.scored import ScoredLayer

    g = torch.Generator().manual_seed(5)
    layer = ScoredLayer(_ada(20, alpha=0.0, scorer="knorm"), scorers.get("knorm"), layer_idx=0)
    keys = torch.randn(2, 2, 64, 8, generator=g) * torch.tensor([1.0, 3.0])[None, :, None, None]
    layer.update(keys, torch.randn(2, 2, 64, 8, generator=g))
    assert layer.kept_valid is not None and layer.head_counts().sum(-1).tolist() == [40, 40]
    assert layer.stored_bytes() == 16 + 40 * (2 * 8 * 4 + 8)
    layer.kept_valid[0, 0, :2] = False  # sequence 0 drops two held tokens: 38 against 40, 78 in all
    assert layer.batch_bytes() % 2 == 0
    with pytest.raises(RuntimeError, match=r"hold \[38, 40\] tokens"):
        layer.stored_bytes()


USER_TAIL = """
import torch


class Tail:
    MODES = ("prefill",)
    KEPT_FIRST = (2, 6)  # the prefill's first 2 and last 6 tokens: kept by every head

    def score(self, keys, positions, layer):
        return -keys.norm(dim=-1)
"""


def test_a_user_scorers_kept_first_is_honoured_and_checked(tmp_path):
    """A user's scorer's ``KEPT_FIRST`` is read off its loaded class, as a built-in's off its own: the
    layer ranks those tokens above every score (kept by every head, though they score lowest here),
    and a keep that cannot hold them is refused when the cache's layer is made (compose cannot see the
    class: it does not load the protocol's files)."""
    from testbed.policies.scored import ScoredLayer

    (tmp_path / "tail.py").write_text(USER_TAIL)
    entry = {"name": "u", "selection": {"kind": "tail.py:Tail", "mode": "prefill", "heads": "adaptive", "alpha": 0,
                                        "keep": 7}}
    small = declared(entry, **KW)  # accepted: 2 + 6 > 7 shows only once the class is loaded
    with pytest.raises(ValueError, match=r"ranks the 8 tokens each head always keeps .* keep must hold them, got 7"):
        ScoredLayer(small, scorers.get("tail.py:Tail", base=tmp_path), layer_idx=0)
    pol = declared({**entry, "selection": {**entry["selection"], "keep": 12}}, **KW)
    layer = ScoredLayer(pol, scorers.get("tail.py:Tail", base=tmp_path), layer_idx=0)
    g = torch.Generator().manual_seed(8)
    keys = torch.randn(1, 2, 40, 8, generator=g)
    keys[:, :, [0, 1, 34, 35, 36, 37, 38, 39]] *= 100  # the lowest scores of every head
    layer.update(keys, torch.randn(1, 2, 40, 8, generator=g))
    counts = layer.head_counts()[0]
    assert int(counts.sum()) == 24
    for hh in range(2):
        held = set(layer.kept_index[0, hh, : int(counts[hh])].tolist())
        assert {0, 1, 34, 35, 36, 37, 38, 39} <= held
    # the same statement refuses a built-in's: expected_attention's sink of 4 and a window of 6 in a keep of 8
    with pytest.raises(ValueError, match="ranks the 10 tokens each head always keeps"):
        declared({"name": "x", "selection": {"kind": "expected_attention", "mode": "prefill", "keep": 8, "window": 6,
                                             "heads": "adaptive"}}, **KW)


# -- kvpress as the peer -----------------------------------------------------------------------------------


def _full_attention(q, k, scale):
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(g, dim=1)) * scale
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1, dtype=torch.float32)


def _held_pairs(layer, bi: int, prefill: int) -> set:
    """The (head, token) pairs of the prefill a testbed layer holds for sequence ``bi``."""
    valid = layer.kept_valid[bi] if layer.kept_valid is not None else torch.ones_like(layer.kept_index[bi], dtype=bool)
    return {(hh, int(i)) for hh in range(layer.kept_index.shape[1])
            for i in layer.kept_index[bi, hh][valid[hh]].tolist() if i < prefill}


def _against_kvpress(q, k, scale, ours, keep: int, alpha: float) -> dict:
    """kvpress's ``AdaKVPress(SnapKVPress)`` ``compress`` on one layer's prefill keys ``k`` and the
    attention matrix of its queries ``q`` (its pruned tokens read back from ``masked_key_indices``)
    against testbed's layer ``ours``: ``kept`` tokens, ``swaps``, tokens ``moved`` between heads (held
    beyond ``keep`` by a head), the heads' ``counts`` and the layer's ``margin``: the smallest relative
    gap, over sequences, between the lowest token kept beyond its head's safeguard and the highest
    dropped one (how near the heads' competition came to a tie). Asserted here, per sequence: every
    swap a near tie of the scores (1e-5 relative, the audit's tolerance for attention scores), every
    head at least its safeguard, the heads' counts summing to ``H x keep``, the margin not negative."""
    from kvpress import AdaKVPress, SnapKVPress
    from kvpress.utils import compute_n_kept

    b, h, n, d = k.shape
    ratio = 1.0 - (keep + 0.5) / n  # int(n * (1 - ratio)) = keep, whatever the float rounding
    assert compute_n_kept(n, ratio) == keep
    press = AdaKVPress(SnapKVPress(compression_ratio=ratio), alpha_safeguard=alpha)
    module = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa", num_attention_heads=q.shape[1]),
                             head_dim=d)
    press.compress(module, torch.zeros(b, n, 8), k, k, _full_attention(q, k, scale), {})
    kept_by_them = torch.ones(b, h, n, dtype=torch.bool)
    kept_by_them[module.masked_key_indices] = False  # the pruned (batch, head, token) triples
    score = scorers.get("snapkv").attention_score(q, k, scale, torch.zeros(b, h, n), None).double()
    rank = score.clone()
    rank[..., n - scorers.kept_first("snapkv")[1]:] = float("inf")  # the window: above every score
    safe = safeguard_count(keep, alpha)
    out = {"kept": 0, "swaps": 0, "moved": 0, "counts": [], "margin": float("inf")}
    for bi in range(b):
        theirs, mine = _pairs(kept_by_them[bi]), _held_pairs(ours, bi, n)
        assert len(theirs) == len(mine) == h * keep
        counts = [sum(1 for x in mine if x[0] == hh) for hh in range(h)]
        assert sum(counts) == h * keep and min(counts) >= safe
        out["counts"] += counts
        out["moved"] += sum(max(0, c - keep) for c in counts)
        a = sorted(theirs - mine, key=lambda p: score[bi, p[0], p[1]])
        c = sorted(mine - theirs, key=lambda p: score[bi, p[0], p[1]])
        for x, y in zip(a, c):
            out["swaps"] += 1
            sx, sy = score[bi, x[0], x[1]], score[bi, y[0], y[1]]
            assert abs(sx - sy) <= 1e-5 * max(abs(sx), abs(sy)), f"kvpress kept {x}, testbed {y}: not a near tie"
        held = torch.zeros(h, n, dtype=torch.bool)
        for hh, t in mine:
            held[hh, t] = True
        beyond = torch.cat([rank[bi, hh][held[hh]].sort(descending=True).values[safe:] for hh in range(h)])
        beyond = beyond[torch.isfinite(beyond)]
        dropped = rank[bi][~held]
        if beyond.numel() and dropped.numel():
            lo, hi = float(beyond.min()), float(dropped.max())
            out["margin"] = min(out["margin"], (lo - hi) / max(abs(lo), abs(hi)))
        out["kept"] += len(theirs)
    assert out["margin"] >= 0, f"a dropped token scored above one kept beyond its head's safeguard: {out['margin']}"
    return out


def _summed(per_layer: list[dict], keep: int) -> dict:
    """The layers' results together; asserts the facts docs/live.md states of them: the heads' split
    is uneven (tokens moved between heads, a count on either side of ``keep``) and no swap."""
    out = {"kept": sum(x["kept"] for x in per_layer), "swaps": sum(x["swaps"] for x in per_layer),
           "moved": sum(x["moved"] for x in per_layer), "counts": sum((x["counts"] for x in per_layer), []),
           "margin": min(x["margin"] for x in per_layer)}
    assert out["moved"] > 0 and min(out["counts"]) < keep < max(out["counts"]), out  # an uneven split compared
    assert out["swaps"] == 0, f"{out['swaps']} near-tie swaps in {out['kept']} kept tokens"
    return out


@pytest.mark.parametrize("keep,alpha", [(140, 0.2), (100, 0.2), (200, 0.5), (90, 0.0)])
def test_adaptive_snapkv_keeps_what_kvpress_adakvpress_keeps(keep, alpha):
    """kvpress's ``AdaKVPress(SnapKVPress)`` against testbed's cache run through a tiny random Llama
    (4 layers, 2 KV heads, 2 sequences of a 320-token prefill): the same (head, token) pairs at every
    layer, every difference a near tie (counted: none measured)."""
    pytest.importorskip("kvpress", reason="the kvpress peer: bash scripts/install.sh installs it")
    from testbed.live import shared_prefill
    from testbed.sources.models import forward_kwargs

    model = _llama()
    P, L, H = 320, 4, 2
    ids = torch.randint(0, 256, (2, P), generator=torch.Generator().manual_seed(5))
    _, cache = _run(model, _ada(keep, alpha), torch.cat([ids, ids[:, :1]], 1), P)
    shared, _ = shared_prefill(model, forward_kwargs(model), ids, query_tail=P)
    got = _summed([_against_kvpress(shared.tails[layer], shared.keys[layer].float(), shared.scales[layer],
                                    cache.layers[layer], keep, alpha) for layer in range(L)], keep)
    assert got["kept"] == L * 2 * H * keep


@pytest.mark.slow
@pytest.mark.parametrize("keep,alpha", [(96, 0.2), (160, 0.2)])
def test_adaptive_snapkv_keeps_what_kvpress_keeps_on_smollm2(smollm2, keep, alpha):
    """The same on SmolLM2's queries and keys of layers 0, 14 and 29 over 384 tokens of the stdlib
    corpus (3 KV heads), testbed's layer loaded from the live study's shared prefill."""
    pytest.importorskip("kvpress", reason="the kvpress peer: bash scripts/install.sh installs it")
    from pydoc_data.topics import topics

    from testbed.live import shared_prefill
    from testbed.policies.scored import ScoredLayer
    from testbed.sources.models import forward_kwargs

    model, tok, _ = smollm2
    text = " ".join(topics[k] for k in sorted(topics)[20:40])
    ids = tok(text, return_tensors="pt").input_ids[:, :384]
    shared, _ = shared_prefill(model, forward_kwargs(model), ids, query_tail=384)
    per_layer = []
    for layer in (0, 14, 29):
        q, k, scale = shared.tails[layer], shared.keys[layer].float(), shared.scales[layer]
        ours = ScoredLayer(_ada(keep, alpha), scorers.get("snapkv"), layer_idx=layer)
        ours.load_prefill(k, shared.values[layer].float(), q, scale)
        per_layer.append(_against_kvpress(q, k, scale, ours, keep, alpha))
    assert _summed(per_layer, keep)["kept"] == 3 * 3 * keep


# -- end to end ----------------------------------------------------------------------------------------

ARMS = [{"name": "snapkv_ada", "selection": {"kind": "snapkv", "mode": "prefill", "keep": 100, "heads": "adaptive"}},
        {"name": "knorm_ada", "selection": {"kind": "knorm", "mode": "prefill", "keep": 60, "heads": "adaptive",
                                            "alpha": 0.5}},
        {"name": "ea_pyr_ada", "selection": {"kind": "expected_attention", "mode": "prefill", "layers": "pyramid",
                                             "beta": 2, "heads": "adaptive"}, "budget": {"fp16_fraction": 0.6}},
        {"name": "snapkv_pre", "selection": {"kind": "snapkv", "mode": "prefill", "keep": 100}}]


@pytest.fixture(scope="module")
def ada_run(tmp_path_factory):
    return tiny_live_run(tmp_path_factory, "adakv_tiny", ARMS, prefill=160, steps=16, budget_tolerance=0.1)



@pytest.mark.slow
def test_adaptive_arms_run_and_pass_the_audit(ada_run):
    rows = audited_rows(ada_run)
    ada, uni = rows["snapkv_ada"], rows["snapkv_pre"]
    assert ada["policy"]["heads"] == "adaptive" and ada["policy"]["alpha"] == 0.2
    assert not set(HEAD_FIELDS) & set(uni["policy"])
    assert ada["bytes_final"] == uni["bytes_final"] == 30 * (16 + 3 * (100 + 16) * (8 * 64 + 8))
    ev = ada["evidence"]["arrays"]
    count = _arrays.load(ada_run, ev["kept.count"])
    assert count.sum() == 3 * (100 + 16) and len(set(count.tolist())) > 1  # SmolLM2's heads split unevenly
    assert "kept.count" not in uni["evidence"]["arrays"]
    from testbed.report_html import policy_family

    # its own family on the frontier figure (the audit re-derives the figure's data: passed above)
    assert [policy_family(rows[a]) for a in ("snapkv_ada", "snapkv_pre", "ea_pyr_ada")] == \
        ["snapkv (prefill, adaptive)", "snapkv (prefill)", "expected_attention (prefill, pyramid, adaptive)"]
    pyr = rows["ea_pyr_ada"]["policy"]
    assert pyr["layers"] == "pyramid" and pyr["heads"] == "adaptive"
    count = _arrays.load(ada_run, rows["ea_pyr_ada"]["evidence"]["arrays"]["kept.count"])
    assert count.sum() == 3 * (pyr["layer_keep"][7] + 16)


def _forge_array(run: Path, rel: str, x) -> None:
    _arrays.save(run, rel, x)
    m = json.loads((run / "manifest.json").read_text())
    x = np.asarray(x)  # a consistent forger records the new shape too
    m["arrays"][rel].update(sha256=_arrays.sha(run, rel), shape=list(x.shape), nbytes=int(x.nbytes), dtype=x.dtype.str)
    (run / "manifest.json").write_text(json.dumps(m, indent=1))


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["snapkv_ada", "knorm_ada"])
@pytest.mark.parametrize("forgery", ["count_sum", "count_split", "kept_set"])
def test_a_forged_per_head_split_fails(ada_run, tmp_path, arm, forgery):
    """The evidence layer rewritten consistently (indices, scores, K/V and counts, re-hashed):
    ``count_sum``: one head one token short (the counts no longer sum to the layer's); ``count_split``:
    a token moved from the head holding most to the head holding fewest (the sum kept: a kept token
    of the middle of the rich head's ranking dropped, the poor head's best dropped one taken);
    ``kept_set``: in head 0, its best kept token outside the window swapped for its worst dropped one
    (counts unchanged). The audit fails the arm every time."""
    from testbed.audit import audit
    from testbed.audit_checks.live_scored import _attention_scores

    run = tmp_path / "copy"
    shutil.copytree(ada_run, run)
    row = rows_by_arm(run)[arm]
    ev = row["evidence"]["arrays"]
    a = {k: _arrays.load(run, v) for k, v in ev.items()}
    count, idx, P = a["kept.count"], a["kept.index"], 160
    heads = [list(idx[hh, : count[hh]]) for hh in range(len(count))]
    if arm == "knorm_ada":  # the scorer's own score of every token, as the cache stores it
        table = -np.sqrt((a["input.k"].astype(np.float64) ** 2).sum(-1)).astype(np.float32)
    else:
        table = np.zeros(a["input.k"].shape[:2], np.float32)
        table[:, :P] = _attention_scores("snapkv", a["prefill.q"], a["input.k"][:, :P])
    cut = P - 64  # outside snapkv's window (knorm's choice is free over the whole prefill)

    def ranked_kept(hh):  # the head's kept prefill tokens outside the window, best first
        return sorted((i for i in heads[hh] if i < cut), key=lambda i: -table[hh, i])

    def ranked_dropped(hh):
        return sorted((i for i in range(cut) if i not in heads[hh]), key=lambda i: -table[hh, i])

    if forgery == "count_sum":
        heads[0].remove(ranked_kept(0)[-1])
    elif forgery == "count_split":
        rich, poor = int(np.argmax(count)), int(np.argmin(count))
        assert count[rich] > count[poor]
        mine = ranked_kept(rich)
        heads[rich].remove(mine[len(mine) // 2])
        heads[poor].append(ranked_dropped(poor)[0])
    else:
        heads[0].remove(ranked_kept(0)[0])
        heads[0].append(ranked_dropped(0)[-1])
    heads = [sorted(x) for x in heads]
    new_count = np.array([len(x) for x in heads], dtype=np.int32)
    slots, H, D = int(new_count.max()), len(heads), a["input.k"].shape[2]
    new = {"kept.index": -np.ones((H, slots), np.int32), "kept.score": np.zeros((H, slots), np.float32),
           "float.k": np.zeros((H, slots, D), np.float32), "float.v": np.zeros((H, slots, D), np.float32),
           "kept.count": new_count}
    for hh, x in enumerate(heads):
        new["kept.index"][hh, : len(x)] = x
        new["float.k"][hh, : len(x)] = a["input.k"][hh, x]
        new["float.v"][hh, : len(x)] = a["input.v"][hh, x]
        new["kept.score"][hh, : len(x)] = table[hh, x]
    for name, x in new.items():
        _forge_array(run, ev[name], x)
    ok, failures, _ = audit(run)
    assert not ok
    want = "kept.count" if forgery == "count_sum" else "kept set"
    assert any(arm in f and want in f for f in failures), failures[:5]


@pytest.mark.slow
def test_adaptive_arms_in_the_retrieval_study(tmp_path):
    """The retrieval study (the question and answer fed after the compressed prefill, in chunks that
    each get the per-head mask) runs adaptive arms given a kept count, and its audit passes."""
    from testbed.audit import audit
    from testbed.run import main as run_main
    from testbed.sources import models

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}")
    proto = json.loads((REPO / "protocols" / "retrieval_small.json").read_text())
    proto.update(name="retrieval_ada", default=False)
    arms = [{"name": "snapkv_ada_k96", "selection": {"kind": "snapkv", "mode": "prefill", "keep": 96,
                                                     "heads": "adaptive"}},
            {"name": "knorm_ada_k96", "selection": {"kind": "knorm", "mode": "prefill", "keep": 96,
                                                    "heads": "adaptive", "alpha": 0.5}}]
    proto["retrieval"].update({"tasks": ["passkey"], "lengths": [160], "depths": [0.0, 1.0], "trials": 1, "batch": 2,
                               "policies": arms, "peers": []})
    path = tmp_path / "retrieval_ada.json"
    path.write_text(json.dumps(proto))
    out = tmp_path / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(path)]) == 0
    ok, failures, _ = audit(out)
    assert ok, failures[:5]
    rows = [r for r in json.loads((out / "results.json").read_text())["rows"] if r.get("kind") == "policy"]
    assert {r["arm"] for r in rows} == {"snapkv_ada_k96", "knorm_ada_k96"}
    assert all(r["policy"]["heads"] == "adaptive" for r in rows)


# -- the audit's adaptive checks on synthetic arrays (numpy only) ---------------------------------------


class _AuditCtx:
    """The audit context's few members its adaptive checks call (testbed.audit.Audit's)."""

    def __init__(self):
        self.failures: list[str] = []
        self.numbers = 0
        self.user_scorers: dict = {}

    def fail(self, where, reason):
        self.failures.append(reason)

    def close(self, row, name, reported, derived):
        self.numbers += 1
        if reported != derived:
            self.fail(row, f"{name}: reported {reported!r}, audit derives {derived!r}")
        return reported == derived


def _ada_rule(rank: np.ndarray, keep: int, safe: int) -> np.ndarray:
    """[H, P] bool: each head's own top ``safe`` of ``rank`` (inf: always kept), then the layer's top of
    the rest to ``H x keep`` in all; scores distinct here, so no ties to break."""
    h, p = rank.shape
    kept = np.zeros((h, p), dtype=bool)
    order = np.argsort(-rank, axis=1, kind="stable")
    for i in range(h):
        kept[i, order[i, :safe]] = True
    rest = sorted((-rank[i, t], t, i) for i in range(h) for t in range(p) if not kept[i, t])
    for _, t, i in rest[: h * keep - int(kept.sum())]:
        kept[i, t] = True
    return kept


def _pack(kept: np.ndarray, k: np.ndarray, v: np.ndarray, own: np.ndarray) -> dict:
    """The evidence arrays of a kept mask ``[H, n]``: each head's tokens first, its empty slots after."""
    h, n = kept.shape
    count = kept.sum(axis=1).astype(np.int32)
    slots = int(count.max())
    idx = np.full((h, slots), -1, dtype=np.int32)
    score = np.zeros((h, slots), dtype=np.float32)
    fk = np.zeros((h, slots, k.shape[2]), dtype=np.float32)
    fv = np.zeros_like(fk)
    for i in range(h):
        pos = np.flatnonzero(kept[i])
        idx[i, : pos.size], score[i, : pos.size] = pos, own[i, pos]
        fk[i, : pos.size], fv[i, : pos.size] = k[i, pos], v[i, pos]
    return {"float.k": fk, "float.v": fv, "kept.index": idx, "kept.score": score, "kept.count": count,
            "input.k": k, "input.v": v}


def _knorm_case(keep=8, alpha=0.5, window=2, prefill=24, steps=3, scale=(1.0, 1.5, 2.5, 4.0), seed=0):
    """A knorm adaptive layer: keys of head h scaled by ``scale[h]`` (a larger norm, a lower score: the
    later heads give tokens to the first); returns (row, pol, live, kept mask [H, n], K, V, own scores)."""
    rng = np.random.default_rng(seed)
    h, n, d = len(scale), prefill + steps, 8
    k = (rng.standard_normal((h, n, d)) * np.asarray(scale)[:, None, None]).astype(np.float32)
    v = rng.standard_normal((h, n, d)).astype(np.float32)
    own = (-np.sqrt(np.sum(k.astype(np.float64) ** 2, axis=-1))).astype(np.float32)
    rank = own[:, :prefill].astype(np.float64)
    if window:
        rank[:, prefill - window:] = np.inf
    kept = np.ones((h, n), dtype=bool)
    kept[:, :prefill] = _ada_rule(rank, keep, min(safeguard_count(keep, alpha), prefill))
    pol = {"scorer": "knorm", "scorer_mode": "prefill", "keep": keep, "alpha": alpha, "window": window, "seed": 0,
           "_prefill": prefill}
    live = {"model": "stub", "prefill": prefill, "steps": steps}
    row = {"study": "s", "model_dims": {"layers": 1, "kv_heads": h, "head_dim": d}}
    return row, pol, live, kept, k, v, own


def _audit_adaptive(row, pol, live, a) -> _AuditCtx:
    from testbed.audit_checks.live_scored import _adaptive_evidence

    ctx = _AuditCtx()
    _adaptive_evidence(row, ctx, pol, live, a, 0)
    return ctx


def test_the_audit_passes_a_head_that_holds_nothing():
    """alpha 0 and no steps after the prefill: a head of large keys (knorm scores them lowest) holds no
    token; the audit's evidence checks pass it instead of raising on the empty head."""
    row, pol, live, kept, k, v, own = _knorm_case(keep=4, alpha=0.0, window=0, steps=0, scale=(1, 1, 1, 50))
    a = _pack(kept, k, v, own)
    assert a["kept.count"].tolist()[3] == 0 and a["kept.count"].sum() == 4 * 4
    ctx = _audit_adaptive(row, pol, live, a)
    assert ctx.failures == [] and ctx.numbers > 0
    kept[0, np.flatnonzero(kept[0])[0]] = False  # one token fewer: the layer's sum no longer holds
    kept[3, 0] = True
    kept[3, 1] = True
    ctx = _audit_adaptive(row, pol, live, _pack(kept, k, v, own))
    assert any("kept.count" in f for f in ctx.failures), ctx.failures


def _swap(kept: np.ndarray, hh: int, drop: int, take: int) -> np.ndarray:
    out = kept.copy()
    assert out[hh, drop] and not out[hh, take]
    out[hh, drop], out[hh, take] = False, True
    return out


def test_the_audits_adaptive_checks_pass_the_honest_split_and_fail_each_forgery():
    """The audit's adaptive evidence checks (``_adaptive_evidence``, ``_check_adaptive``) on a knorm
    layer built here: the honest split (uneven: the heads of smaller keys take tokens from the others)
    passes; a head moved below its safeguard (count), a head that drops its own top token for a lower
    one (kept set), a filled slot after a head's count and a dropped window token each fail."""
    row, pol, live, kept, k, v, own = _knorm_case()
    P, safe = live["prefill"], safeguard_count(pol["keep"], pol["alpha"])
    counts = kept.sum(axis=1)
    assert counts.sum() == 4 * (8 + 3) and counts[0] > 8 + 3 > counts[3] == safe + 3  # tokens moved; head 3 at its floor
    ctx = _audit_adaptive(row, pol, live, _pack(kept, k, v, own))
    assert ctx.failures == [] and ctx.numbers > 0

    def fails(mask=None, a=None) -> list[str]:
        return _audit_adaptive(row, pol, live, _pack(mask, k, v, own) if a is None else a).failures

    # head 3 gives its 2 non-window prefill tokens to head 0's best dropped ones: the sum holds, head 3 is short
    poor = kept.copy()
    mine = [t for t in np.flatnonzero(kept[3, :P]) if t < P - 2]
    poor[3, mine] = False
    rank0 = np.where(kept[0, :P], -np.inf, own[0, :P])
    poor[0, np.argsort(-rank0, kind="stable")[: len(mine)]] = True
    assert poor.sum() == kept.sum() and poor[3].sum() < safe + 3
    assert any("fewer than its safeguard" in f for f in fails(poor)), fails(poor)
    # head 3 drops its own best-scored (non-window) token for its best dropped one: the count holds
    best = max(mine, key=lambda t: own[3, t])
    take = max(np.flatnonzero(~kept[3, :P]), key=lambda t: own[3, t])
    assert any("below its safeguard" in f for f in fails(_swap(kept, 3, best, take)))
    # a slot after a head's count that is not empty
    a = _pack(kept, k, v, own)
    short = int(np.argmin(a["kept.count"]))
    a["kept.index"][short, a["kept.count"][short]] = 0
    assert any("not empty" in f for f in fails(a=a))
    a = _pack(kept, k, v, own)
    a["float.k"][short, -1, 0] = 1.0
    assert any("not empty" in f for f in fails(a=a))
    # head 0 drops the window's last token for its best dropped one
    take = max(np.flatnonzero(~kept[0, :P]), key=lambda t: own[0, t])
    assert any("newest 2 tokens" in f for f in fails(_swap(kept, 0, P - 1, take)))


def test_the_audits_adaptive_kept_set_holds_a_scorers_kept_first():
    """``_check_adaptive`` with tova's own scores (its last prefill token always kept, scored here
    below every other, so only that rule keeps it): the honest split passes, a head that drops that
    token for its best dropped one fails."""
    from testbed.audit_checks.common import TOLERANCES
    from testbed.audit_checks.live_scored import _check_adaptive

    rng = np.random.default_rng(4)
    h, P, steps, keep, alpha = 3, 20, 2, 6, 0.2
    own = rng.random((h, P + steps)).astype(np.float32) * np.array([[1.0], [2.0], [4.0]], dtype=np.float32)
    own[:, P - 1] = -1.0
    rank = own[:, :P].astype(np.float64)
    rank[:, P - 1] = np.inf
    kept = np.ones((h, P + steps), dtype=bool)
    kept[:, :P] = _ada_rule(rank, keep, safeguard_count(keep, alpha))
    assert len(set(kept.sum(axis=1).tolist())) > 1
    pol = {"scorer": "tova", "scorer_mode": "prefill", "keep": keep, "alpha": alpha, "window": 0}
    live = {"prefill": P, "steps": steps}
    tol = TOLERANCES["score_attention"]

    def fails(mask) -> list[str]:
        a = _pack(mask, np.zeros((h, P + steps, 2), np.float32), np.zeros((h, P + steps, 2), np.float32), own)
        ctx = _AuditCtx()
        _check_adaptive({}, ctx, pol, live, own, a["kept.index"], a["kept.score"], a["kept.count"], tol["rtol"],
                        tol["atol"])
        return ctx.failures

    assert fails(kept) == []
    take = max(np.flatnonzero(~kept[0, :P]), key=lambda t: own[0, t])
    assert any("always keeps" in f for f in fails(_swap(kept, 0, P - 1, take)))
