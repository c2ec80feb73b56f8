"""The uniform int3 arm (3-bit grouped integers, KIVI layout) end to end.

The 3-bit layout is stated here from its definition, not read back from the code: the codes of a
row form one little-endian bit stream, code ``j`` in stream bits ``[3j, 3j+3)``, stream bit ``i`` in
bit ``i % 8`` of byte ``i // 8``, zero-filled to ``ceil(3L / 8)`` bytes. Then: the torch packing and
the audit's numpy packing both write that stream; the quantizer's large-tensor path equals its
reference; the audit's encoder reproduces the run's stored arrays byte for byte; the error is within
half a step (plus the float16 rounding of scale and zero-point); int3's error lies between int2's
and int4's; the int3 policy's bytes are the mean of int2's and int4's (the mix24_* budget) and a
live cache in a tiny model stores exactly them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.audit_checks import schemes
from testbed.policies import preset
from testbed.policies.policy import scheme_bytes_per_token
from testbed.quant import IntGrouped, kernels
from testbed.quant.packing import pack_codes, packed_length, unpack_codes

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _stream_bytes(row: list[int]) -> bytes:
    """One row of 3-bit codes as the little-endian bit stream of the definition (a Python integer)."""
    word = 0
    for j, c in enumerate(row):
        word |= int(c) << (3 * j)
    return word.to_bytes(-(-3 * len(row) // 8), "little")


# -- packing ------------------------------------------------------------------------------------------

@SETTINGS
@given(n=st.integers(0, 100), rows=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_pack3_writes_the_little_endian_bit_stream_and_round_trips(n, rows, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 8, size=(rows, n), dtype=np.uint8)
    want = np.array([list(_stream_bytes(r)) for r in codes.tolist()], dtype=np.uint8).reshape(rows, -1)
    assert want.shape[-1] == math.ceil(3 * n / 8)
    packed = pack_codes(torch.from_numpy(codes), 3)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, math.ceil(3 * n / 8))
    assert packed_length(n, 3) == math.ceil(3 * n / 8)
    assert np.array_equal(packed.numpy(), want)
    assert torch.equal(unpack_codes(packed, 3, n), torch.from_numpy(codes))
    # the audit's independent numpy packing writes the same bytes and reads them back
    audit = schemes.pack_bits(codes, 3)
    assert np.array_equal(audit, want)
    assert np.array_equal(schemes.unpack_bits(audit, 3, n), codes)


def test_pack3_known_bytes():
    # codes 1..7, 0: word = sum c_j << 3j = 0b000_111_110_101_100_011_010_001 = 0x1F58D1
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8)
    assert pack_codes(codes, 3).tolist() == [0xD1, 0x58, 0x1F]
    # one code 7 alone: the low three bits of one byte; nine codes of 7: 27 ones over 4 bytes
    assert pack_codes(torch.tensor([7], dtype=torch.uint8), 3).tolist() == [0x07]
    assert pack_codes(torch.full((9,), 7, dtype=torch.uint8), 3).tolist() == [0xFF, 0xFF, 0xFF, 0x07]


@SETTINGS
@given(axis=st.sampled_from(["channel", "token"]), g=st.sampled_from([2, 8, 32, 64]), lead=st.integers(1, 3),
       n=st.integers(1, 70), d=st.integers(1, 70), seed=st.integers(0, 2**31 - 1), log_scale=st.floats(-20, 10),
       offset=st.floats(-100, 100))
def test_the_fused_kernels_equal_the_torch_definition_at_three_bits(axis, g, lead, n, d, seed, log_scale, offset):
    """The numba quantize and dequantize kernels called directly (whatever the size), against the
    torch reference: every stored byte, and the decode bit for bit."""
    if not kernels.available():
        pytest.skip("numba is not installed")
    x = _x((lead, n, d), seed, 2.0 ** log_scale, offset)
    q = IntGrouped(3, g, axis)
    ref = q.quantize_reference(x)
    fn = kernels.int_quantize_channel if axis == "channel" else kernels.int_quantize_token
    codes, scale, zero, bad = fn(x.numpy(), 3, g)
    assert not bad
    assert codes.tobytes() == ref.tensors["codes"].numpy().tobytes() and codes.shape == tuple(ref.tensors["codes"].shape)
    assert scale.tobytes() == ref.tensors["scale"].numpy().tobytes()
    assert zero.tobytes() == ref.tensors["zero"].numpy().tobytes()
    dq = kernels.int_dequantize_channel if axis == "channel" else kernels.int_dequantize_token
    out = dq(codes, scale, zero, g, 3, n, d)
    assert out.view(np.uint32).tobytes() == q.dequantize_reference(ref).numpy().view(np.uint32).tobytes()


# -- the quantizer --------------------------------------------------------------------------------------

def _x(shape, seed, scale=1.0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale + offset


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_large_tensors_store_the_reference_bytes(axis, monkeypatch):
    """Where the fused kernels serve (CPU, large), int3 stores and decodes what the torch reference
    does, bit for bit."""
    monkeypatch.setattr(kernels, "MIN_FAST_ELEMENTS", 0)
    q = IntGrouped(3, 32, axis)
    x = _x((3, 130, 70), 7, 3.0, 1.0)
    x[0, :40] = 0.0
    p, ref = q.quantize(x), q.quantize_reference(x)
    for name in ref.tensors:
        assert torch.equal(p.tensors[name].contiguous().view(torch.uint8), ref.tensors[name].contiguous().view(torch.uint8))
    out = torch.empty(x.shape)
    q.dequantize_into(p, out)
    assert torch.equal(q.dequantize(p), q.dequantize_reference(ref)) and torch.equal(out, q.dequantize_reference(ref))


@SETTINGS
@given(axis=st.sampled_from(["channel", "token"]), g=st.sampled_from([2, 4, 8, 16, 32, 64]),
       lead=st.sampled_from([(), (1,), (3,)]), n=st.integers(1, 70), d=st.integers(1, 70),
       seed=st.integers(0, 2**31 - 1), log_scale=st.floats(-8, 8), offset=st.floats(-50, 50))
def test_the_audits_encoder_reproduces_the_stored_bytes(axis, g, lead, n, d, seed, log_scale, offset):
    x = _x((*lead, n, d), seed, 2.0 ** log_scale, offset)
    q = IntGrouped(3, g, axis)
    p = q.quantize(x)
    cfg = {"bits": 3, "group_size": g, "axis": axis}
    mine = schemes.encode_int_grouped(x.numpy(), cfg)
    assert mine.keys() == p.arrays.keys()
    for name in mine:
        a, b = np.ascontiguousarray(mine[name]), np.ascontiguousarray(p.arrays[name])
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), name
    # code bytes per stored row: ceil(3 x padded-row-length / 8)
    row = d if axis == "channel" else -(-d // g) * g
    assert p.arrays["codes"].shape[-1] == math.ceil(3 * row / 8)
    decoded = schemes.decode_int_grouped(p.arrays, cfg, tuple(x.shape))
    assert np.array_equal(decoded.view(np.uint32), q.dequantize(p).numpy().view(np.uint32))


def _groups64(x: torch.Tensor, g: int, axis: str) -> torch.Tensor:
    """Groups (float64) as the last axis, edge-padded."""
    xt = x.double()
    xt = xt.transpose(-1, -2) if axis == "channel" else xt
    pad = (-xt.shape[-1]) % g
    if pad:
        xt = torch.cat([xt, xt[..., -1:].expand(*xt.shape[:-1], pad)], dim=-1)
    return xt.reshape(*xt.shape[:-1], -1, g)


@SETTINGS
@given(axis=st.sampled_from(["channel", "token"]), g=st.sampled_from([4, 16, 32]), n=st.integers(1, 80),
       d=st.integers(1, 70), seed=st.integers(0, 2**31 - 1), log_scale=st.floats(-6, 6), offset=st.floats(-8, 8))
def test_error_within_half_a_step_per_group(axis, g, n, d, seed, log_scale, offset):
    """|x - x_hat| <= scale16 / 2, plus what float16 rounding of the scale (times the 7 steps) and
    of the zero-point can move the grid's ends, plus float32 arithmetic slack; codes are 0..7."""
    x = _x((2, n, d), seed, 2.0 ** log_scale, offset)
    q = IntGrouped(3, g, axis)
    p = q.quantize(x)
    pad = (-n) % g if axis == "channel" else (-d) % g
    rowlen = d if axis == "channel" else d + pad
    codes = unpack_codes(p.tensors["codes"], 3, rowlen)
    assert int(codes.max()) <= 7
    x_hat = q.dequantize(p)
    grp = _groups64(x, g, axis)
    mn, mx = grp.amin(-1, keepdim=True), grp.amax(-1, keepdim=True)
    s16 = ((mx - mn) / 7).float().half().double()
    z16 = mn.float().half().double()
    bound = 0.5 * s16 + 7 * ((mx - mn) / 7 - s16).abs() + (mn - z16).abs() + 1e-6 * (mn.abs() + mx.abs()) + 2.0 ** -24
    err = _groups64(x_hat - x, g, axis).abs()  # edge padding repeats an element's own error
    assert bool((err <= bound).all()), float((err - bound).max())
    # the stored scale is the float16 of the float32 (max - min) / 7 (a group's min and max are exact)
    s32 = ((mx.float() - mn.float()) / 7).half().squeeze(-1)
    want = s32.transpose(-1, -2) if axis == "channel" else s32
    assert torch.equal(p.tensors["scale"], want)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_int3_error_lies_between_int2_and_int4(axis):
    for seed in range(3):
        x = _x((4, 96, 64), seed)
        x[..., 5] += 6.0  # an outlier channel
        err = {b: (IntGrouped(b, 32, axis).dequantize(IntGrouped(b, 32, axis).quantize(x)) - x).abs().mean().item()
               for b in (2, 3, 4)}
        assert err[2] > err[3] > err[4], err
        # each extra bit about halves the step: the mean error of int3 is well away from both
        assert 1.5 < err[2] / err[3] < 3.0 and 1.5 < err[3] / err[4] < 3.0, err


# -- the policy ---------------------------------------------------------------------------------------

def test_preset_int3_is_uniform_three_bit_kivi():
    pol = preset("int3", window=64, group=16)
    assert pol.middle == "int3" and pol.window == 64 and pol.group == 16 and pol.sink == 0 and not pol.mixed
    k, v = pol.quantizers()
    assert (k.bits, k.axis, k.group_size) == (3, "channel", 16)
    assert (v.bits, v.axis, v.group_size) == (3, "token", 32)
    from testbed.policies import packed_attention

    assert not packed_attention.supported(pol)  # the direct kernel unpacks whole codes per byte


@pytest.mark.parametrize("window,group", [(128, 32), (16, 16), (8, 8), (0, 32)])
def test_int3_bytes_are_the_mean_of_int2_and_int4(window, group):
    d = 64
    assert scheme_bytes_per_token("int3", 2, d, group) * 2 == \
        scheme_bytes_per_token("int2", 2, d, group) + scheme_bytes_per_token("int4", 2, d, group)
    # written out: per head and token, K 24 code bytes + a float16 scale and zero per channel per G
    # tokens; V 24 code bytes + a float16 scale and zero per 32 features
    assert scheme_bytes_per_token("int3", 1, d, group) == (24 + 4 * d / group) + (24 + 4 * 2)
    p2, p3, p4 = (preset(m, window=window, group=group) for m in ("int2", "int3", "int4"))
    for n in (0, 1, window, window + group - 1, window + group, 500, 1000):
        b2, b3, b4 = (p.cache_bytes(n, 30, 3, d) for p in (p2, p3, p4))
        assert 2 * b3 == b2 + b4, n
        # the mix24_* budget: half of the (layer, KV head) pairs int2, half int4, plus the one byte of
        # bits per pair that a mixed policy stores
        mix = preset("mix24_random", window=window, group=group)
        assert mix.cache_bytes(n, 30, 3, d) == b3 + 30 * 3, n


def test_a_live_int3_cache_in_a_tiny_model_stores_exactly_its_policy_bytes():
    pytest.importorskip("transformers")
    import transformers as tf

    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention
    from testbed.sources.models import forward_kwargs

    layers, kv, d = 2, 2, 64
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=kv, head_dim=d, num_hidden_layers=layers, max_position_embeddings=256,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    pol = preset("int3", window=8, group=8)
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(1))
    cache = PolicyCache.for_model(pol, model.config)
    kw = forward_kwargs(model)
    prefill = 40
    with policy_attention(model), torch.no_grad():
        model(input_ids=ids[:, :prefill], use_cache=True, **{kw["cache"]: cache})
        for n in range(prefill, 70):
            packed = max(0, (n - 8) // 8 * 8)
            floats = n - packed
            # per layer: header, float32 K and V of the float tokens, 3-bit packed K and V
            per_layer = 16 + floats * 2 * kv * d * 4 + kv * (packed * 24 + 4 * d * packed // 8) + kv * packed * (24 + 8)
            assert cache.stored_bytes() == pol.cache_bytes(n, layers, kv, d) == layers * per_layer, n
            model(input_ids=ids[:, n:n + 1], use_cache=True, **{kw["cache"]: cache})
    # the stored codes are 3-bit: ceil(3 * 64 / 8) = 24 bytes per token row of K and of V
    for layer in cache.layers:
        assert layer.mid_k.q.bits == layer.mid_v.q.bits == 3
        for span in (layer.mid_k, layer.mid_v):
            codes = span.buffers["codes"].view()
            assert codes.dtype == torch.uint8 and codes.shape[-1] == 24 and codes.shape[-2] == span.tokens == 56
