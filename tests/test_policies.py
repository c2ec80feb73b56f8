"""Cache policies and the live cache layer, without a model: the schedule, what attention sees,
what is stored, and its bytes against a closed form written out here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.policies import HEADER_BYTES, PRESETS, Policy, handoff, preset
from testbed.policies.presets import HEAVY_PRESETS
from testbed.policies.selection import choose_sink, sink_scores
from testbed.policies.storage import PackedSpan
from testbed.quant import MX, IntGrouped

PolicyLayer = pytest.importorskip("testbed.policies.layers",
                                  reason="the live cache needs transformers: pip install -e '.[capture]'").PolicyLayer

H, D = 3, 64


@pytest.fixture(autouse=True)
def attention_block():
    """These tests drive PolicyLayer.update by hand and play the attention call themselves: they
    stand inside a policy_attention block (the flag it sets), and leave no mask behind."""
    handoff.ACTIVE[0] += 1
    yield
    handoff.ACTIVE[0] -= 1
    handoff.PENDING.clear()
    handoff.DIRECT.clear()
    handoff.SELECT.clear()


def _update(layer, k, v, seed=1):
    """``layer.update`` as a model's attention layer makes it: a prefill whose sink is chosen from
    attention gets the attention call's queries (random, 3 query heads per KV head) right after."""
    keys, values = layer.update(k, v)
    if handoff.SELECT.pop(layer.layer_idx, None) is not None:
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(k.shape[0], 3 * k.shape[1], k.shape[2], k.shape[3], generator=g)
        layer.observe_prefill(q, keys, k.shape[-1] ** -0.5)
    return keys, values


def test_a_mask_or_direct_read_outside_policy_attention_is_refused_at_once():
    handoff.ACTIVE[0] -= 1
    try:
        k, v = _kv(100)
        layer = PolicyLayer(preset("streaming", sink=4, evict_window=16), layer_idx=0)
        layer.update(k[..., :60, :], v[..., :60, :])  # the prefill needs no mask
        with pytest.raises(RuntimeError, match="policy_attention"):
            layer.update(k[..., 60:70, :], v[..., 60:70, :])
        direct = PolicyLayer(preset("int4", window=16, group=16), layer_idx=1, direct=True)
        direct.update(k[..., :60, :], v[..., :60, :])
        with pytest.raises(RuntimeError, match="policy_attention"):
            direct.update(k[..., 60:61, :], v[..., 60:61, :])
    finally:
        handoff.ACTIVE[0] += 1


def _kv(n, seed=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, H, n, D, generator=g) * 2.0
    v = torch.randn(batch, H, n, D, generator=g)
    k[..., 5] += 8.0  # an outlier channel, as real keys have
    return k, v


def _bytes_formula(pol: Policy, n: int) -> int:
    """The byte accounting written out independently of Policy.layer_bytes: float32 K+V of the sink
    and of the float tokens behind it, the packed groups, one 16-byte header (one layer, one sequence)."""
    s = min(pol.sink, n)
    if pol.middle == "drop":
        floats, packed = s + min(n - s, pol.window), 0
    elif pol.middle == "float32":
        floats, packed = n, 0
    else:
        aged = max(0, n - s - pol.window)
        packed = (aged // pol.group) * pol.group
        floats = n - packed
    total = 16 + floats * 2 * H * D * 4
    if packed:
        if pol.middle == "mxfp8":
            total += 2 * H * packed * (64 + 2)  # 64 E4M3 bytes + 2 E8M0 scales per token and head
        elif pol.middle == "mxfp4":
            total += 2 * H * packed * (32 + 2)
        else:
            bits = int(pol.middle[3:])
            v = H * packed * (64 * bits // 8 + 2 * 2 * (64 // 32))      # codes + fp16 scale/zero per 32 features
            if pol.key_axis == "channel":
                k = H * (packed * 64 * bits // 8 + 2 * 2 * 64 * (packed // pol.group))  # per channel per group
            else:
                k = v
            total += k + v
    if pol.heavy:  # per head: each held heavy hitter's float32 K and V, int32 index and float32 score; a
        total += H * (min(pol.heavy, packed) * (2 * D * 4 + 4 + 4) + floats * 4)  # score per float token
    return total


# a heavy-hitter preset pays for its heavy hitters with one group of its window: R = 2 G there
POLICIES = [p for p in (preset(name, window=32 if name in HEAVY_PRESETS else 16, group=16, evict_window=24, sink=4)
                        for name in PRESETS)
            if not p.mixed]  # per-head precision: tests/test_mixed_precision.py


@pytest.mark.parametrize("pol", POLICIES, ids=lambda p: p.name)
def test_stored_bytes_match_the_closed_form_at_every_step(pol):
    layer = PolicyLayer(pol, layer_idx=0)
    k, v = _kv(120)
    if pol.heavy_oracle:  # the whole segment's scores, given in advance (here any: bytes do not read them)
        layer.oracle_received = torch.rand(k.shape[:3], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    n = 0
    for c in (7, 1, 1, 16, 3, 30, 1, 1, 1, 59):
        _update(layer, k[..., n:n + c, :], v[..., n:n + c, :])
        handoff.PENDING.clear()  # no attention call here to consume an eviction mask
        n += c
        assert layer.stored_bytes() == _bytes_formula(pol, n) == pol.layer_bytes(n, H, D), (pol.name, n)


def test_the_audits_policy_table_states_every_preset():
    """The audit's own statement of the presets (``live_policies.POLICY_TABLE``, written there, not
    imported) gives each preset's parameters, closed-form bytes and chunk schedule: a preset added
    without its row, or with a row that says something else, fails here, not first in a live audit."""
    from testbed.audit_checks import live_policies as lq

    assert set(lq.POLICY_TABLE) == set(PRESETS)
    live = {"window": 16, "group": 16, "evict_window": 24, "sink": 4}
    dims = {"layers": 1, "kv_heads": H, "head_dim": D, "sliding_window": None, "full_layers": None}
    for pol in POLICIES:
        mine = lq.policy_of(pol.name, {**live, "window": pol.window + pol.group} if pol.heavy else live)
        assert mine == {k: pol.config()[k] for k in mine}, pol.name
        for n in range(120):
            assert lq.policy_bytes(mine, n, dims) == pol.layer_bytes(n, H, D), (pol.name, n)
            assert lq.next_change(mine, n) == pol.next_change(n, masked=True), (pol.name, n)


@pytest.mark.parametrize("name", ["int4", "int2_sink4", "int2_ktoken", "mxfp8", "mxfp4"])
def test_attention_sees_the_decoded_stored_bytes_and_the_float_tokens(name):
    pol = preset(name, window=16, group=16, sink=4)
    kq, vq = pol.quantizers()
    layer = PolicyLayer(pol)
    k, v = _kv(101)
    layer.update(k[..., :70, :], v[..., :70, :])
    for i in range(70, 100):
        layer.update(k[..., i:i + 1, :], v[..., i:i + 1, :])
    keys, values = layer.update(k[..., 100:, :], v[..., 100:, :])  # what token 100 attends
    s, (a, b) = min(pol.sink, 100), pol.kept_spans(100)["packed"]
    assert b - a == pol.packed_tokens(100) > 48
    assert torch.equal(keys[..., :s, :], k[..., :s, :])               # sink float32, bit for bit
    assert torch.equal(keys[..., b:, :], k[..., b:101, :])            # window + new token float32
    # the middle is what quantizing the whole span at once decodes to: groups are independent,
    # and nothing stored was quantized twice
    assert torch.equal(keys[..., a:b, :], kq.dequantize(kq.quantize(k[..., a:b, :])))
    assert torch.equal(values[..., a:b, :], vq.dequantize(vq.quantize(v[..., a:b, :])))
    assert not torch.equal(keys[..., a:b, :], k[..., a:b, :])


def test_an_append_never_rewrites_what_is_packed():
    pol = preset("int4", window=16, group=16)
    layer = PolicyLayer(pol)
    k, v = _kv(200)
    layer.update(k[..., :64, :], v[..., :64, :])
    before = {name: buf.view().clone() for name, buf in layer.mid_k.buffers.items()}
    assert before["codes"].shape[-2] == 48
    for i in range(64, 200):
        layer.update(k[..., i:i + 1, :], v[..., i:i + 1, :])
    for name, old in before.items():
        now = layer.mid_k.buffers[name].view()
        assert now.shape[-2] > old.shape[-2]
        assert torch.equal(now[..., :old.shape[-2], :], old), name


def test_an_eviction_mask_gives_each_chunk_token_what_one_token_per_forward_sees():
    pol = preset("streaming", sink=4, evict_window=24)
    k, v = _kv(140, seed=5)
    chunked, step = PolicyLayer(pol, layer_idx=0), PolicyLayer(pol, layer_idx=1)
    chunked.update(k[..., :60, :], v[..., :60, :])
    handoff.PENDING.clear()
    step.update(k[..., :60, :], v[..., :60, :])
    handoff.PENDING.clear()
    for a, b in ((60, 61), (61, 100), (100, 140)):  # chunks longer than the window too
        keys, _ = chunked.update(k[..., a:b, :], v[..., a:b, :])
        mask = handoff.PENDING.pop(0, (None, None))[1]
        assert (mask is None) == (b - a == 1)
        for i in range(a, b):
            want, _ = step.update(k[..., i:i + 1, :], v[..., i:i + 1, :])
            got = keys if mask is None else keys[..., mask[i - a], :]
            assert torch.equal(got, want), (a, b, i)
    with pytest.raises(RuntimeError, match="never applied"):
        chunked.update(k[..., :2, :], v[..., :2, :])
        chunked.update(k[..., :2, :], v[..., :2, :])
    step.layer_idx = 0
    step.update(k[..., :2, :], v[..., :2, :])  # a mask another layer object left is not this one's
    handoff.PENDING.clear()
    assert pol.next_change(100, masked=True) == math.inf


def test_eviction_keeps_the_sink_and_the_newest_window():
    pol = preset("streaming", sink=4, evict_window=24)
    layer = PolicyLayer(pol)
    k, v = _kv(80)
    for i in range(79):
        layer.update(k[..., i:i + 1, :], v[..., i:i + 1, :])
    keys, _ = layer.update(k[..., 79:, :], v[..., 79:, :])
    want = torch.cat([k[..., :4, :], k[..., 79 - 24:80, :]], dim=-2)
    assert torch.equal(keys, want)
    assert layer.get_seq_length() == 80 and layer.held_tokens() == 28
    assert layer.get_mask_sizes(1) == (29, 0)


def _status(pol: Policy, m: int) -> list[str]:
    """Per token of a cache holding m: 'f' float32 (sink or window), 'q' packed, 'x' dropped."""
    sp = pol.kept_spans(m)
    out = ["x"] * m
    for key, mark in (("sink", "f"), ("packed", "q"), ("float", "f")):
        a, b = sp[key]
        out[a:b] = [mark] * (b - a)
    return out


def _exact(pol: Policy, n: int, c: int) -> bool:
    """Tokens n .. n+c-1 in one forward each attend the stored state after n tokens plus float32 new
    tokens; one token per forward, token n+i attends the state after n+i. Equal iff every token the
    state after n + i holds has the status it has after n, and the new ones are float32."""
    before = _status(pol, n)
    for i in range(1, c):
        after = _status(pol, n + i)
        if after[:n] != before or any(x != "f" for x in after[n:]):
            return False
    return True


@settings(max_examples=200, deadline=None)
@given(sink=st.integers(0, 8), window=st.integers(0, 40), group=st.sampled_from([2, 4, 8, 16, 32]),
       n=st.integers(0, 300), middle=st.sampled_from(["int4", "mxfp8", "drop", "float32"]))
def test_next_change_is_the_longest_exact_chunk(sink, window, group, n, middle):
    if middle == "drop" and window == 0:
        window = 1
    pol = Policy("p", middle, sink, window, group)
    c = pol.next_change(n)
    if middle == "float32":
        assert c == math.inf and _exact(pol, n, 64)
        return
    assert c >= 1 and _exact(pol, n, c)
    assert not _exact(pol, n, c + 1)  # the longest such chunk


def test_chunked_appends_store_the_same_state_as_one_token_at_a_time():
    """Issue #21's state test at the layer: after each chunk of a next_change schedule, the stored
    arrays equal those of one-token updates after the same token, byte for byte."""
    for name in ("int4", "int2_sink4", "mxfp4", "streaming"):
        pol = preset(name, window=16, group=8, evict_window=16, sink=4)
        k, v = _kv(150, seed=3)
        a, b = PolicyLayer(pol, layer_idx=0), PolicyLayer(pol, layer_idx=1)
        a.update(k[..., :40, :], v[..., :40, :])
        b.update(k[..., :40, :], v[..., :40, :])
        n = 40
        while n < 150:
            c = int(min(pol.next_change(n), 150 - n))
            a.update(k[..., n:n + c, :], v[..., n:n + c, :])
            handoff.PENDING.clear()  # no attention call here to consume an eviction mask
            for i in range(n, n + c):
                b.update(k[..., i:i + 1, :], v[..., i:i + 1, :])
            n += c
            ea, eb = a.evidence(), b.evidence()
            assert ea.keys() == eb.keys()
            for key in ea:
                assert torch.equal(ea[key], eb[key]), (name, n, key)


def test_bad_policies_are_refused_with_their_name():
    with pytest.raises(ValueError, match="policy p: middle 'int5'"):
        Policy("p", "int5")
    with pytest.raises(ValueError, match="group must be a power of two"):
        Policy("p", "int4", 0, 16, 24)
    with pytest.raises(ValueError, match="needs a window"):
        Policy("p", "drop", 4, 0)
    with pytest.raises(ValueError, match="unknown policy 'int5'"):
        preset("int5")


def test_quantizers_follow_kivi_axes():
    kq, vq = preset("int2").quantizers()
    assert isinstance(kq, IntGrouped) and (kq.bits, kq.axis, kq.group_size) == (2, "channel", 32)
    assert (vq.axis, vq.group_size) == ("token", 32)
    kq, _ = preset("int2_ktoken").quantizers()
    assert kq.axis == "token"
    kq, vq = preset("mxfp4").quantizers()
    assert isinstance(kq, MX) and kq.element == "e2m1" and kq is vq
    assert preset("float32").quantizers() is None and preset("streaming").quantizers() is None


def test_reference_quantizer_agrees_with_the_audit_encoder():
    """The audit's numpy integer encoder and testbed.quant store the same bytes (both directions of the
    live evidence check)."""
    from testbed.audit_checks.schemes import encode_int_grouped

    k, _ = _kv(64, batch=1)
    for bits, axis, g in ((4, "channel", 32), (2, "channel", 16), (2, "token", 32), (8, "token", 32)):
        q = IntGrouped(bits, g, axis)
        p = q.quantize(k[0])
        want = encode_int_grouped(k[0].numpy(), q.config())
        for name in ("codes", "scale", "zero"):
            assert p.arrays[name].tobytes() == want[name].tobytes(), (bits, axis, name)


@pytest.mark.parametrize("name", ["int4", "int2_sink4"])
@pytest.mark.parametrize("new", [1, 5])
def test_direct_attention_over_codes_equals_decode_then_attend(name, new):
    """The packed history's scores and values read from the codes (scales folded into q and P)
    equal attention over the decoded history, within float32 rounding; the float32 part (sink,
    window, new tokens, causal among the new) merges exactly."""
    from testbed.policies import packed_attention as pa

    pol = preset(name, window=16, group=16, sink=4)
    layer = PolicyLayer(pol, layer_idx=0)
    k, v = _kv(160, seed=7, batch=2)
    layer.update(k[..., :150, :], v[..., :150, :])
    tokens, s = layer.mid_k.tokens, min(pol.sink, 150)
    assert tokens >= 96
    q = torch.randn(2, 9, new, D, generator=torch.Generator().manual_seed(new))
    keys, values = layer.update(k[..., 150:150 + new, :], v[..., 150:150 + new, :])  # decode-then-attend
    scale = D ** -0.5
    n = keys.shape[-2]
    causal = torch.ones(new, n, dtype=torch.bool).tril(n - new)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, keys.repeat_interleave(3, 1), values.repeat_interleave(3, 1), attn_mask=causal, scale=scale)
    # what a direct update returns instead: the float32 keys only (sink, window, new tokens)
    fk = torch.cat([keys[..., :s, :], keys[..., s + tokens:, :]], dim=-2)
    fv = torch.cat([values[..., :s, :], values[..., s + tokens:, :]], dim=-2)
    floats = pa.float_part(q, fk, fv, scale, new)
    ref = pa.merge(pa.packed_part_reference(q, layer, scale, tokens), floats)
    got = pa.merge(pa.packed_part(q, layer, scale, tokens, kernel=True), floats)
    assert torch.allclose(ref, want, rtol=1e-5, atol=1e-6), (ref - want).abs().max()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
    assert not torch.allclose(got, pa.merge(floats), rtol=1e-3)  # the packed part matters


def _packed_layer(batch, hkv, n, d, bits, group, fgroup, seed):
    """A stand-in layer whose packed middle holds ``n`` tokens (the last K group may be partial,
    D need not fill V's last feature group): what packed_part reads of a PolicyLayer."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, hkv, n, d, generator=g) * 2.0
    k[..., 1] += 6.0  # an outlier channel: its zero-point dominates the score
    v = torch.randn(batch, hkv, n, d, generator=g) + torch.linspace(-2, 2, d)
    mk = PackedSpan(IntGrouped(bits, group, "channel"), "k")
    mv = PackedSpan(IntGrouped(bits, fgroup, "token"), "v")
    mk.append(k)
    mv.append(v)
    return SimpleNamespace(mid_k=mk, mid_v=mv)


def _direct_against_definition(layer, hq, tq, d, read, span, seed):
    """Outputs of attention over the packed middle's first ``read`` tokens plus ``8 + tq`` float32
    keys whose last ``tq`` are the queries themselves (causal among them): (the kernel's packed
    part merged with torch's float part, the kernel over both, the definition)."""
    from testbed.policies import packed_attention as pa

    batch, hkv = layer.mid_k.shape_lead
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(batch, hq, tq, d, generator=g)
    fk = torch.randn(batch, hkv, 8 + tq, d, generator=g)
    fv = torch.randn(batch, hkv, 8 + tq, d, generator=g)
    scale = d ** -0.5
    floats = pa.float_part(q, fk, fv, scale, tq)
    got = pa.merge(pa.packed_part(q, layer, scale, read, kernel=True, span=span), floats)
    fused = pa.attend(q, layer, fk, fv, scale, read, tq, kernel=True, span=span)  # the float keys inside the kernel
    # the definition written out: decode the history, concatenate, one causal softmax (SDPA)
    k = layer.mid_k.q.dequantize(layer.mid_k.packed())[..., :read, :]
    v = layer.mid_v.q.dequantize(layer.mid_v.packed())[..., :read, :]
    keys = torch.cat([k, fk], dim=-2).repeat_interleave(hq // hkv, 1)
    values = torch.cat([v, fv], dim=-2).repeat_interleave(hq // hkv, 1)
    causal = torch.ones(tq, keys.shape[-2], dtype=torch.bool).tril(keys.shape[-2] - tq)
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=causal, scale=scale)
    return got, fused, want


def _close(got, want) -> bool:
    return bool(((got - want).abs() <= 1e-4 * want.abs().max()).all())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(1, 3), hkv=st.integers(1, 3), ratio=st.sampled_from([1, 2, 3, 5]), tq=st.sampled_from([1, 2, 7]),
       bits=st.sampled_from([2, 4, 8]), group=st.sampled_from([4, 16, 32]), fgroup=st.sampled_from([4, 8, 32]),
       d=st.sampled_from([12, 20, 64]), n=st.integers(1, 300), prefix=st.booleans(),
       span=st.sampled_from([1, 64, 256]), seed=st.integers(0, 2 ** 16))
def test_the_direct_kernel_equals_decode_then_attend_over_shapes(batch, hkv, ratio, tq, bits, group, fgroup, d, n,
                                                                 prefix, span, seed):
    """The kernel over any batch, GQA ratio, query chunk (causal among the new tokens), bit width,
    K group (the last one partial), V feature group (D not filling the last), read prefix and block
    span: within relative 1e-4 of decoding the history and attending it (SDPA)."""
    layer = _packed_layer(batch, hkv, n, d, bits, group, fgroup, seed)
    read = group * (n // group) if prefix and n >= group else n  # a flush's prefix: whole groups
    got, fused, want = _direct_against_definition(layer, hkv * ratio, tq, d, read, span, seed)
    assert _close(got, want), (got - want).abs().max()
    assert _close(fused, want), (fused - want).abs().max()


@pytest.mark.parametrize("bits", [2, 4])
def test_a_wrong_fold_or_index_in_the_direct_kernel_is_caught(bits):
    """The comparison above fails for each of these kernel inputs made wrong on purpose: K's
    zero-points or scales of the next group (a misplaced fold), V's zero-points or scales of the
    next token, a K channel's codes swapped with its neighbour's (a nibble-order slip), and one
    token too few read."""
    layer = _packed_layer(2, 3, 70, 64, bits, 16, 32, seed=3)
    got, fused, want = _direct_against_definition(layer, 9, 2, 64, 70, 64, seed=3)
    assert _close(got, want) and _close(fused, want)

    def wrong(span, name, fn):
        buf = span.buffers[name]
        right = buf.data
        buf.data = fn(right).contiguous()
        try:
            return _direct_against_definition(layer, 9, 2, 64, 70, 64, seed=3)[:2]  # kernel + torch, fused
        finally:
            buf.data = right

    per = 8 // bits
    mask = (1 << bits) - 1

    def swap(c):
        return ((c & mask) << bits) | ((c >> bits) & mask) | (c & ~((1 << 2 * bits) - 1) & 0xFF)

    broken = {
        "K zero of the next group": wrong(layer.mid_k, "zero", lambda z: z.roll(-1, dims=-2)),
        "K scale of the next group": wrong(layer.mid_k, "scale", lambda s: s.roll(-1, dims=-2)),
        "V zero of the next token": wrong(layer.mid_v, "zero", lambda z: z.roll(-1, dims=-2)),
        "V scale of the next token": wrong(layer.mid_v, "scale", lambda s: s.roll(-1, dims=-2)),
        "K channels 0 and 1 swapped in their byte": wrong(layer.mid_k, "codes", swap),
    }
    from testbed.policies import packed_attention as pa
    assert per >= 2
    q = torch.randn(2, 9, 2, 64, generator=torch.Generator().manual_seed(4))
    short = pa.packed_part(q, layer, 0.125, 69, kernel=True)
    full = pa.packed_part_reference(q, layer, 0.125)
    for what, outs in broken.items():
        assert not any(_close(out, want) for out in outs), what
    assert not _close(short[0] / short[2][..., None], full[0] / full[2][..., None]), "one token too few"


# -- a sink chosen from attention (sink_select "mass") ---------------------------------------------

def _explicit_shares(q: np.ndarray, k: np.ndarray, c: int) -> np.ndarray:
    """Each of the first c keys' mean attention share over the causal queries that see it and the KV
    head's query heads, one query at a time (q [B, Hq, t, D], k [B, Hkv, t, D])."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    out = np.zeros((b, hkv, c))
    for bi in range(b):
        for h in range(hq):
            kv = h // (hq // hkv)
            for i in range(t):
                s = np.array([q[bi, h, i] @ k[bi, kv, j] for j in range(i + 1)], dtype=np.float64) / math.sqrt(d)
                w = np.exp(s - s.max())
                w /= w.sum()
                for j in range(min(c, i + 1)):
                    out[bi, kv, j] += w[j] / ((t - j) * (hq // hkv))
    return out


def test_sink_scores_equal_an_explicit_loop_and_the_audit():
    from testbed.audit_checks.live_evidence import sink_scores as audit_scores

    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 6, 21, 8, generator=g) * 2, torch.randn(2, 2, 21, 8, generator=g)
    want = _explicit_shares(q.double().numpy(), k.double().numpy(), 13)
    got = sink_scores(q, k, 8 ** -0.5, 13, block=5)  # blocks of queries that do not divide t
    assert np.allclose(got.numpy(), want, rtol=1e-5, atol=1e-7)
    for bi in range(2):
        assert np.allclose(audit_scores(q[bi].numpy(), k[bi].numpy())[:, :13], want[bi], rtol=1e-10, atol=1e-12)


def test_choose_sink_takes_the_largest_ties_to_the_lower_index_in_order():
    scores = torch.tensor([[[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]], [[5.0, 0.0, 0.0, 0.0, 0.0, 6.0]]])
    assert choose_sink(scores, 2).tolist() == [[[1, 2]], [[0, 5]]]
    assert choose_sink(scores, 4).tolist() == [[[1, 2, 4, 5]], [[0, 1, 2, 5]]]


def test_a_chosen_sink_holds_the_most_attended_tokens_at_the_first_sinks_bytes():
    """A prefill whose queries all look at token 9 in KV head 0 and at token 3 in KV head 2: the
    chosen sink holds those tokens' K/V bit for bit, every other token follows in order through
    window and middle, and the bytes equal the first-S sink's at every step."""
    pol = preset("int2_sinkmass4", window=16, group=16, sink=4)
    first = PolicyLayer(preset("int2_sink4", window=16, group=16, sink=4), layer_idx=1)
    layer = PolicyLayer(pol, layer_idx=0)
    k, v = _kv(100, batch=1)
    q = torch.zeros(1, 9, 64, D)
    q[0, 0:3, :, :] = 0.5 * k[0, 0, 9]   # query heads 0-2 serve KV head 0
    q[0, 6:9, :, :] = 0.5 * k[0, 2, 3]   # 6-8 serve KV head 2
    keys, _ = layer.update(k[..., :64, :], v[..., :64, :])
    assert handoff.SELECT.pop(0) is layer and layer.stored_bytes() == HEADER_BYTES  # nothing committed yet
    layer.observe_prefill(q, keys, D ** -0.5)
    first.update(k[..., :64, :], v[..., :64, :])
    idx = layer.sink_index[0]
    assert 9 in idx[0].tolist() and 3 in idx[2].tolist() and idx.shape == (3, 4)
    assert all(i < 48 for i in idx.flatten().tolist())  # only tokens that leave the window are candidates
    for h in range(3):
        assert torch.equal(layer.sink_k[0, h], k[0, h, idx[h]]) and torch.equal(layer.sink_v[0, h], v[0, h, idx[h]])
        rest = [i for i in range(64) if i not in idx[h].tolist()]
        assert torch.equal(layer.tail_k[0, h], k[0, h, rest[-layer.tail_k.shape[-2]:]])
        kq = pol.quantizers()[0]
        packed = layer.mid_k.packed()
        want = kq.quantize(k[:, h:h + 1, rest[:packed.shape[-2]]].contiguous())
        assert torch.equal(packed.tensors["codes"][:, h:h + 1], want.tensors["codes"])
    for i in range(64, 100):
        layer.update(k[..., i:i + 1, :], v[..., i:i + 1, :])
        first.update(k[..., i:i + 1, :], v[..., i:i + 1, :])
        assert layer.stored_bytes() == first.stored_bytes() == pol.layer_bytes(i + 1, H, D)


def test_a_prefill_whose_sink_was_never_chosen_is_an_error_at_the_next_update():
    layer = PolicyLayer(preset("int4_sinkmass4", window=16, group=16, sink=4), layer_idx=0)
    k, v = _kv(70)
    layer.update(k[..., :64, :], v[..., :64, :])
    handoff.SELECT.clear()  # the attention call never came
    with pytest.raises(RuntimeError, match="sink was never chosen"):
        layer.update(k[..., 64:65, :], v[..., 64:65, :])


def test_a_chosen_sink_needs_a_sink_and_a_quantized_middle():
    for kw in ({"middle": "int2", "sink": 0, "window": 16}, {"middle": "drop", "sink": 4, "window": 16},
               {"middle": "float32", "sink": 4}):
        with pytest.raises(ValueError, match="sink_select"):
            Policy("x", sink_select="mass", **kw)
