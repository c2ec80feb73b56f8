"""Per-head precision (mixed policies) without a model: the allocation rules, the concentration
they read, what attention sees per head, and the bytes against a closed form written out here."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from testbed.policies import Policy, handoff, preset
from testbed.policies.selection import allocate, concentration

cache_mod = pytest.importorskip("testbed.policies.cache", reason="the live cache needs transformers: pip install -e '.[capture]'")

L, H, D, HQ = 4, 3, 64, 9  # a small model: 4 layers, 3 KV heads (3 query heads each)


pytestmark = pytest.mark.usefixtures("attention_block")  # tests/conftest.py


def _kv(n, seed=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, batch, H, n, D, generator=g) * 2.0
    v = torch.randn(L, batch, H, n, D, generator=g)
    return k, v


def _queries(batch, n, seed):
    """Per layer and KV head a different sharpness: query = c · (key of token 0), so some heads
    look hard at token 0 (concentrated) and others nearly uniformly (diffuse)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, batch, HQ, n, D, generator=g) * torch.rand(L, batch, HQ, 1, 1, generator=g) * 0.6


def _drive(pol, n_prefill, steps, seed=0, batch=2, record=None):
    """Prefill through every layer (each followed by its attention call), finish_prefill, then one
    token per update; returns the cache, the inputs and the prefill queries."""
    cache = cache_mod.PolicyCache(pol, L, record_layer=record)
    k, v = _kv(n_prefill + steps, seed, batch)
    q = _queries(batch, n_prefill, seed + 1)
    for i, layer in enumerate(cache.layers):
        keys, _ = layer.update(k[i, ..., :n_prefill, :], v[i, ..., :n_prefill, :])
        if handoff.SELECT.pop(i, None) is not None:
            layer.observe_prefill(q[i], keys, D ** -0.5)
    cache.finish_prefill()
    return cache, k, v, q


def _np_concentration(q, k):
    """float64 mean effective support of a causal pass: ``q [HQ, t, D]``, ``k [H, t, D]`` -> ``[H]``."""
    hq, t, d = q.shape
    g = hq // k.shape[0]
    s = np.einsum("hgqd,hkd->hgqk", q.astype(np.float64).reshape(k.shape[0], g, t, d), k.astype(np.float64)) / math.sqrt(d)
    s = np.where(np.arange(t)[None, :] > np.arange(t)[:, None], -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(p), 0.0).sum(-1)
    return (np.exp(ent) / (np.arange(t) + 1)).mean(axis=(1, 2))


def test_concentration_is_the_mean_effective_support_of_the_causal_rows():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, HQ, 40, D, generator=g), torch.randn(2, H, 40, D, generator=g) * 3
    got = concentration(q, k, D ** -0.5, block=16)  # blocks that do not divide t
    for b in range(2):
        np.testing.assert_allclose(got[b].numpy(), _np_concentration(q[b].numpy(), k[b].numpy()), rtol=1e-5)
    uniform = concentration(torch.zeros(1, HQ, 40, D), k[:1], D ** -0.5)
    np.testing.assert_allclose(uniform.numpy(), 1.0, rtol=1e-6)  # every row uniform over what it sees
    sharp_q = k[:1, :, :1].repeat_interleave(3, dim=1).expand(1, HQ, 40, D) * 40.0  # every query at token 0
    sharp = concentration(sharp_q, k[:1], D ** -0.5)
    # one-hot rows: exp(0) / (i + 1) for the query at i, whose mean is the harmonic number over t
    np.testing.assert_allclose(sharp.numpy(), sum(1 / (i + 1) for i in range(40)) / 40, rtol=1e-3)


def test_the_rules_give_the_low_bits_to_the_right_pairs_and_exactly_their_share():
    scores = torch.rand(3, L, H, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for share in (0.5, 2 / 3, 0.25):
        for alloc in ("concentrated", "diffuse", "late", "random"):
            pol = Policy("m", "int8" if share > 0.6 else "int4", window=16, group=16, low="int2", low_share=share,
                         alloc=alloc)
            low = allocate(pol, scores)
            count = round(share * L * H)
            assert low.shape == (3, L, H) and all(int(low[b].sum()) == count for b in range(3))
            for b in range(3):
                s, lo = scores[b].flatten(), low[b].flatten()
                if alloc == "concentrated":   # every low pair is more concentrated than every high one
                    assert s[lo].max() < s[~lo].min()
                elif alloc == "diffuse":
                    assert s[lo].min() > s[~lo].max()
                elif alloc == "late":         # whole layers from the last, then heads in order
                    layers = torch.arange(L)[:, None].expand(L, H).flatten()
                    assert layers[lo].min() >= layers[~lo].max()
            if alloc == "random":  # content-blind: the same pairs for every sequence, whatever the scores
                assert torch.equal(low[0], low[1]) and torch.equal(low[0], low[2])
                keys = [int.from_bytes(hashlib.sha256(f"{i}:{h}".encode()).digest()[:8], "big")
                        for i in range(L) for h in range(H)]
                assert sorted(np.argsort(keys, kind="stable")[:count].tolist()) == np.flatnonzero(low[0].numpy()).tolist()


def _middle_formula(bits: int, packed: int, group: int) -> int:
    """K per channel (codes, fp16 scale + zero per channel and group of tokens) + V per token
    (codes, fp16 scale + zero per 32 features), one KV head of D = 64."""
    k = packed * 64 * bits // 8 + 2 * 2 * 64 * (packed // group)
    v = packed * (64 * bits // 8 + 2 * 2 * 2)
    return k + v


@pytest.mark.parametrize("name", ["mix24_concentrated", "mix28_diffuse", "mix24_late", "mix28_random"])
def test_stored_bytes_match_the_closed_form_and_the_uniform_budget(name):
    pol = preset(name, window=16, group=16)
    cache, k, v, _ = _drive(pol, 40, 45, batch=2)
    high, low, pairs = int(pol.middle[3:]), 2, L * H
    lo = round(pol.low_share * pairs)
    for n in range(40, 86):
        if n > 40:
            for i, layer in enumerate(cache.layers):
                layer.update(k[i, ..., n - 1:n, :], v[i, ..., n - 1:n, :])
        packed = max(0, n - 16) // 16 * 16
        want = (L * (16 + (n - packed) * 2 * H * D * 4) + lo * _middle_formula(low, packed, 16)
                + (pairs - lo) * _middle_formula(high, packed, 16) + pairs)
        assert cache.stored_bytes() == want == pol.cache_bytes(n, L, H, D), (name, n)
    # equal bytes: mix24 is a 3-bit layout's bytes, mix28 int4's, plus one byte of bits per pair
    three = lambda p: L * H * (p * 64 * 3 // 8 + 2 * 2 * 64 * (p // 16) + p * (64 * 3 // 8 + 8))  # noqa: E731
    for n in (64, 200, 1000):
        packed = (n - 16) // 16 * 16
        floats = L * (16 + (n - packed) * 2 * H * D * 4)
        if name.startswith("mix24"):
            assert pol.cache_bytes(n, L, H, D) == floats + three(packed) + L * H
        else:
            assert pol.cache_bytes(n, L, H, D) == preset("int4", window=16, group=16).cache_bytes(n, L, H, D) + L * H


def test_each_head_attends_its_own_bits_and_low_heads_differ_from_high_ones():
    """After the prefill, the middle a head returns is its tokens quantized once at its assigned
    bits (int2 or int4), the window float32 bit for bit; the two widths really differ."""
    pol = preset("mix24_concentrated", window=16, group=16)
    cache, k, v, _ = _drive(pol, 70, 2, batch=2)
    kq2, vq2 = pol.low_quantizers()
    kq4, vq4 = pol.quantizers()
    bits = cache.alloc_bits()
    assert set(bits.unique().tolist()) == {2, 4}
    for i, layer in enumerate(cache.layers):
        keys, values = layer.update(k[i, ..., 70:71, :], v[i, ..., 70:71, :])
        packed = layer.mixed.tokens
        assert packed == 48
        for b in range(2):
            for h in range(H):
                kq, vq = (kq2, vq2) if bits[b, i, h] == 2 else (kq4, vq4)
                x, y = k[i, b:b + 1, h:h + 1, :packed], v[i, b:b + 1, h:h + 1, :packed]
                assert torch.equal(keys[b, h, :packed], kq.dequantize(kq.quantize(x.contiguous()))[0, 0])
                assert torch.equal(values[b, h, :packed], vq.dequantize(vq.quantize(y.contiguous()))[0, 0])
                assert torch.equal(keys[b, h, packed:], k[i, b, h, packed:71])
    x = k[0, :1, :1, :48].contiguous()
    assert not torch.equal(kq2.dequantize(kq2.quantize(x)), kq4.dequantize(kq4.quantize(x)))


def test_the_prefill_rule_reads_the_prefill_and_the_allocation_follows_it():
    pol = preset("mix24_concentrated", window=16, group=16)
    cache, k, _, q = _drive(pol, 40, 0, batch=2)
    for b in range(2):
        mine = np.stack([_np_concentration(q[i, b].numpy(), k[i, b, :, :40].numpy()) for i in range(L)])
        np.testing.assert_allclose(cache.alloc_score[b].numpy(), mine, rtol=1e-5)
        low = cache.alloc_low[b].flatten().numpy()
        assert mine.flatten()[low].max() < mine.flatten()[~low].min()
    diffuse, _, _, _ = _drive(preset("mix24_diffuse", window=16, group=16), 40, 0, batch=2)
    assert torch.equal(diffuse.alloc_low, ~cache.alloc_low)  # half and half: the rules are complements


def test_a_mixed_cache_refuses_tokens_before_its_bits_are_allocated_and_an_oracle_needs_scores():
    pol = preset("mix24_late", window=16, group=16)
    cache = cache_mod.PolicyCache(pol, L)
    k, v = _kv(50)
    for i, layer in enumerate(cache.layers):
        layer.update(k[i, ..., :40, :], v[i, ..., :40, :])
    with pytest.raises(RuntimeError, match="finish_prefill"):
        cache.layers[0].update(k[0, ..., 40:41, :], v[0, ..., 40:41, :])
    with pytest.raises(ValueError, match="oracle allocation needs its scores"):
        cache_mod.PolicyCache(preset("mix24_oracle_concentrated", window=16, group=16), L)
    with pytest.raises(ValueError, match="low of fewer bits"):
        Policy("bad", "int2", window=16, low="int4", low_share=0.5, alloc="late")
    with pytest.raises(ValueError, match="low_share"):
        Policy("bad", "int4", window=16, low="int2", low_share=1.0, alloc="late")
    with pytest.raises(ValueError, match="reads attention"):
        Policy("bad", "int4", window=16, low="int2", low_share=0.5, alloc="random", alloc_from="oracle")
    with pytest.raises(ValueError, match="cache_bytes"):
        pol.layer_bytes(40, H, D)


def _held_bytes(cache) -> int:
    """Every tensor the cache holds, walked here without its accounting: float32 sink and window,
    each packed span's buffers (codes, scales, zero-points) and a mixed layer's bits; per sequence,
    plus one 16-byte header per layer."""
    total, batch = 0, cache.layers[0].sink_k.shape[0]
    for layer in cache.layers:
        held = [layer.sink_k, layer.sink_v, layer.tail_k, layer.tail_v]
        spans = [layer.mid_k, layer.mid_v] if layer.mid_k is not None else []
        if layer.mixed is not None:
            spans += [s for pair in layer.mixed.spans.values() for s in pair]
            held.append(layer.mixed.bits)
        held += [b.view() for s in spans for b in s.buffers.values() if b.view() is not None]
        total += sum(t.numel() * t.element_size() for t in held)
    assert total % batch == 0
    return total // batch + 16 * len(cache.layers)


@pytest.mark.slow
def test_equal_bytes_at_the_end_of_a_segment_measured_against_uniform_int4_and_three_bits():
    """At the end of a segment (prefill 64, 128 steps, R = G = 16), the bytes a mixed cache holds:
    mix28 (a third of the pairs int8, two thirds int2) within 1 % of a uniform int4 cache run on the
    same tokens, mix24 (half int4, half int2) within 1 % of a 3-bit layout written out here; both
    measured from the tensors held, every array counted, and equal to Policy.cache_bytes exactly."""
    n_prefill, steps, batch = 64, 128, 2
    n = n_prefill + steps
    measured = {}
    for name in ("int4", "mix28_concentrated", "mix28_random", "mix24_diffuse", "mix24_late"):
        pol = preset(name, window=16, group=16)
        if pol.mixed:
            cache, k, v, _ = _drive(pol, n_prefill, steps, batch=batch)
        else:
            cache = cache_mod.PolicyCache(pol, L)
            k, v = _kv(n, 0, batch)
            for i, layer in enumerate(cache.layers):
                layer.update(k[i, ..., :n_prefill, :], v[i, ..., :n_prefill, :])
        for t in range(n_prefill, n):
            for i, layer in enumerate(cache.layers):
                layer.update(k[i, ..., t:t + 1, :], v[i, ..., t:t + 1, :])
        got = cache.stored_bytes()
        assert got == _held_bytes(cache) == pol.cache_bytes(n, L, H, D), name
        if pol.mixed:  # the bits really are stored: one byte per (layer, KV head) pair and sequence
            assert sum(layer.mixed.bits.numel() for layer in cache.layers) == batch * L * H
            names = {which: set().union(*(sp.buffers for layer in cache.layers for sp in layer.mixed.spans[which]))
                     for which in ("high", "low")}
            assert names["high"] == names["low"] and {"codes"} <= names["low"], names
        measured[name] = got
    int4 = measured["int4"]
    packed = (n - 16) // 16 * 16
    floats = L * (16 + (n - packed) * 2 * H * D * 4)
    three = floats + L * H * (packed * D * 3 // 8 + 2 * 2 * D * (packed // 16) + packed * (D * 3 // 8 + 2 * 2 * 2))
    for name, got in measured.items():
        if name.startswith("mix28"):
            assert abs(got - int4) <= 0.01 * int4, (name, got, int4)
        elif name.startswith("mix24"):
            assert abs(got - three) <= 0.01 * three, (name, got, three)
    assert measured["mix24_diffuse"] < int4  # the 3-bit budget really is smaller


def test_the_rules_pick_the_pairs_planted_in_a_hand_built_score_array():
    """Scores written by hand: six pairs planted far below the rest (the concentrated ones), six
    far above; the rest equal. Each rule's choice is known from the construction alone."""
    low_pairs = [(0, 1), (1, 0), (1, 2), (2, 1), (3, 0), (3, 2)]
    high_pairs = [(0, 0), (0, 2), (1, 1), (2, 0), (2, 2), (3, 1)]
    scores = torch.full((1, L, H), 0.5, dtype=torch.float64)
    for j, (li, hi) in enumerate(low_pairs):
        scores[0, li, hi] = 0.01 * (j + 1)
    for j, (li, hi) in enumerate(high_pairs):
        scores[0, li, hi] = 0.9 + 0.01 * j

    def chosen(alloc, share):
        pol = Policy("m", "int4", window=16, group=16, low="int2", low_share=share, alloc=alloc)
        return sorted(map(tuple, torch.nonzero(allocate(pol, scores)[0]).tolist()))

    assert chosen("concentrated", 0.5) == sorted(low_pairs)
    assert chosen("diffuse", 0.5) == sorted(high_pairs)
    assert chosen("concentrated", 0.25) == sorted(low_pairs[:3])  # the three lowest of the planted
    assert chosen("diffuse", 0.25) == sorted(high_pairs[3:])      # the three highest
    assert chosen("late", 0.5) == [(2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 2)]  # the last two layers
    flat = torch.full((1, L, H), 0.5, dtype=torch.float64)  # all tied: the lowest flat indices
    pol = Policy("m", "int4", window=16, group=16, low="int2", low_share=0.25, alloc="concentrated")
    assert sorted(map(tuple, torch.nonzero(allocate(pol, flat)[0]).tolist())) == [(0, 0), (0, 1), (0, 2)]
