"""MX-specific laws (OCP MX v1.0, FLOOR and RCEIL scales) and the signed Hadamard rotation.

Cross-checks: torchao's ``to_mx`` (bit for bit), the audit's independent numpy encoder (bit for
bit), and the float64 reference encoder against the native float8 casts (bit for bit).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from testbed import quant
from testbed.audit_checks import mx_paths as audit_mx
from testbed.audit_checks.schemes import MX_ELEMENTS, decode_mx
from testbed.quant.mx import (ELEMENTS, MX, MXFP4, MXFP8, element_values, encode_elements,
                              encode_elements_reference, saturated_blocks)
from testbed.quant.packing import pack_codes, unpack_codes
from testbed.quant.rotation import SignedHadamard, random_signs, rotation_block, sylvester

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FORMATS = ["e4m3", "e5m2", "e2m1"]
# (mantissa bits, exponent of smallest normal, FLOOR emax, max) written from the spec tables
SPEC = {"e4m3": (3, -6, 8, 448.0), "e5m2": (2, -14, 15, 57344.0), "e2m1": (1, 0, 2, 6.0)}


def _codes(x: torch.Tensor, element: str, rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """Unpacked element codes and scale codes of the 32-block scheme with scale rule ``rule``."""
    q = MX(element, 32, scale_rule=rule)
    p = q.quantize(x)
    bits = 4 if element == "e2m1" else 8
    d_pad = p.tensors["scales"].shape[-1] * 32
    codes = unpack_codes(p.tensors["codes"], bits, d_pad) if bits == 4 else p.tensors["codes"]
    return codes, p.tensors["scales"]


def _wide_blocks(seed: int = 0, nb: int = 3000) -> torch.Tensor:
    """Blocks of 32 spanning magnitudes 2**-120 .. 2**120, plus the edge cases of the issue."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-120, 121, (nb, 1), generator=g).to(torch.float32)
    x = torch.randn(nb, 32, generator=g) * torch.exp2(e)
    x[0::40] = 0.0                                                   # all-zero blocks
    x[1::40, 5] = -0.0                                               # negative zeros
    x[2::40, 7] = torch.exp2((e[2::40, 0] + 12).clamp(max=126)) * 1.7  # one huge value (2**12 above the rest)
    x[3::40, :8] = 1e-3 * torch.exp2(e[3::40])                       # tiny elements beside normal ones
    k = torch.exp2(torch.randint(-100, 100, (nb,), generator=g).to(torch.float32))
    around_448 = torch.tensor([511.9, 448.0, 449.0, 464.0, 465.0, 479.0, 480.0, 500.0, 440.0, 432.0, 424.0,
                               416.0, 272.0, 304.0, 256.0, 255.9, -511.9, -432.0, -464.0, 0.5, 2 ** -9,
                               2 ** -10, 3 * 2 ** -10, 1.5 * 2 ** -9, -(2 ** -10), 7.0, 6.5, 5.0, 3.5, 2.5, 0.25, 0.75])
    x[4::40] = around_448 * k[4::40, None]                           # values around 448 * scale
    x[5::40] = torch.exp2(torch.randint(-134, -119, (x[5::40].shape[0], 1), generator=g).float()) * torch.randn(
        x[5::40].shape[0], 32, generator=g)                         # blocks that clamp to scale code 0
    return x.contiguous()


# --------------------------------------------------------------------------------------------- torchao
TORCHAO_DTYPES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "e2m1": "float4_e2m1fn_x2"}


@pytest.mark.parametrize("element", FORMATS)
def test_codes_equal_torchao_to_mx_floor_bit_for_bit(element):
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor",
                                    reason="torchao is not installed: the MX cross-check needs torchao's to_mx")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    x = _wide_blocks()
    scale_t, data_t = mx_tensor.to_mx(x, getattr(torch, TORCHAO_DTYPES[element]), 32, ScaleCalculationMode.FLOOR)
    scale_t = scale_t.view(torch.uint8).reshape(-1)
    data_t = data_t.view(torch.uint8)
    codes, scales = _codes(x, element)
    if element == "e2m1":
        codes = pack_codes(codes, 4)
    scales = scales.reshape(-1)
    assert torch.equal(scales, scale_t), "E8M0 scale codes differ from torchao"
    exact = scales != 0
    assert torch.equal(codes[exact], data_t[exact]), "element codes differ from torchao on blocks with scale code > 0"
    # Scale code 0 (amax < 2**(emax - 126)): the spec's scale is 2**-127; torchao divides by
    # float32's smallest normal 2**-126 there (and decodes code 0 as 2**-127). Both sides are
    # checked against the literal rule so that a change on either side shows up here.
    zero_scale = ~exact & (x.abs().amax(-1) > 0)
    assert int(zero_scale.sum()) > 20
    xs = x[zero_scale].to(torch.float64)
    ref_codes_127 = encode_elements_reference(xs * 2.0 ** 127, ELEMENTS[element])
    ref_codes_126 = encode_elements_reference(xs * 2.0 ** 126, ELEMENTS[element])
    mine = codes[zero_scale] if element != "e2m1" else unpack_codes(codes[zero_scale], 4, 32)
    theirs = data_t[zero_scale] if element != "e2m1" else unpack_codes(data_t[zero_scale], 4, 32)
    assert torch.equal(mine, ref_codes_127)
    assert torch.equal(theirs, ref_codes_126)


@pytest.mark.parametrize("element", FORMATS)
def test_codes_equal_torchao_to_mx_rceil(element):
    """RCEIL scales are ceil(log2(fl32(amax / max))). torchao's CPU path takes the ceil of its
    float32 ``log2``, which rounds to the integer below when the quotient is a hair above a power
    of two; every block where the two differ must be such a block (ours one higher), and every
    other block must match bit for bit, its element codes included (scale code 0 aside, where
    torchao multiplies by 1.0 instead of 2**127)."""
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor",
                                    reason="torchao is not installed: the MX cross-check needs torchao's to_mx")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    x = _wide_blocks(seed=1)
    fmt = ELEMENTS[element]
    # quotients a hair above a power of two: where float32 log2 rounds down
    x[6::40, 0] = (fmt.max * torch.exp2(torch.randint(-60, 60, (x[6::40].shape[0],)).float())
                   * (1 + 2.0 ** -22)).clamp(max=2.0 ** 127)
    x[6::40, 1:] = 0.5 * x[6::40, :1]
    scale_t, data_t = mx_tensor.to_mx(x, getattr(torch, TORCHAO_DTYPES[element]), 32, ScaleCalculationMode.RCEIL)
    scale_t = scale_t.view(torch.uint8).reshape(-1)
    data_t = data_t.view(torch.uint8)
    codes, scales = _codes(x, element, "rceil")
    if element == "e2m1":
        codes = pack_codes(codes, 4)
    scales = scales.reshape(-1)
    d = x.abs().amax(-1) / torch.tensor(fmt.max, dtype=torch.float32)
    log2_rounded = (torch.log2(d) == torch.floor(torch.log2(d))) & (torch.frexp(d.double())[0] != 0.5)
    differ = scales != scale_t
    assert int(differ.sum()) > 0 and int(log2_rounded.sum()) > 0   # the edge is exercised
    assert torch.equal(differ, log2_rounded & (scales > 0) & (scales < 254)), "a scale differs for another reason"
    assert torch.equal(scales[differ].int(), scale_t[differ].int() + 1)
    same = ~differ & (scales != 0)
    assert torch.equal(codes[same], data_t[same]), "element codes differ from torchao where the scales agree"


@pytest.mark.parametrize("element", FORMATS)
def test_rceil_scale_is_floors_or_one_above_and_never_saturates(element):
    """FLOOR lets the block maximum land in [2**emax, 2**(emax+1)) and clamps what exceeds the
    element maximum (a random Gaussian block often does); RCEIL takes the smallest scale that does
    not clamp, so it is FLOOR's scale or one above, and no block saturates (but for a quotient
    rounded down onto a power of two, which random data does not produce)."""
    x = torch.randn(4000, 32, generator=torch.Generator().manual_seed(7)) * 3.0
    fmt = ELEMENTS[element]
    _, s_floor = _codes(x, element, "floor")
    _, s_rceil = _codes(x, element, "rceil")
    step = s_rceil.int() - s_floor.int()
    assert set(step.unique().tolist()) <= {0, 1} and int((step == 1).sum()) > 0
    sat_floor = saturated_blocks(x, s_floor, fmt, 32).double().mean().item()
    sat_rceil = saturated_blocks(x, s_rceil, fmt, 32).double().mean().item()
    assert sat_rceil == 0.0
    assert sat_floor > 0.05   # FLOOR's known cost, on Gaussian blocks
    # one scale lower than RCEIL's would clamp: the scale is minimal
    lower = (s_rceil.int() - 1).clamp(min=0).to(torch.uint8)
    assert bool(saturated_blocks(x, lower, fmt, 32)[s_rceil > 0].all())


@pytest.mark.parametrize("element", FORMATS)
def test_rceil_scale_of_a_block_whose_quotient_underflows_is_the_smallest(element):
    """amax / max below float32's smallest subnormal rounds to 0: the smallest scale (code 0), as
    for every amax just above it, never scale 1 (code 127); fast path, reference and audit agree."""
    x = torch.zeros(4, 32)
    x[0, 3] = 2.0 ** -149                       # the smallest float32: amax / max underflows
    x[1, 3] = 2.0 ** -140
    x[2, 3] = 2.0 ** -145
    x[3, :] = 2.0 ** -130 * torch.arange(1, 33)
    q = MX(element, 32, scale_rule="rceil")
    ref = q.quantize_reference(x).tensors["scales"].reshape(-1)
    assert ref[:3].tolist() == [0, 0, 0]
    big = x.repeat(3000, 1)                      # above the fast-path threshold
    assert torch.equal(q.quantize(big).tensors["scales"].reshape(-1, 4 // 4)[:4].reshape(-1), ref)
    _, a_scales = audit_mx.encode_mx(x.numpy(), element, 32, "rceil")
    assert a_scales.reshape(-1).tolist() == ref.tolist()


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("element", FORMATS)
def test_fast_path_equals_reference_for_both_rules(element, rule):
    x = _wide_blocks(seed=4, nb=3000)                            # 96k elements: above the fast-path threshold
    q = MX(element, 32, scale_rule=rule)
    fast, ref = q.quantize(x), q.quantize_reference(x)
    for name in ("codes", "scales", "header"):
        assert torch.equal(fast.tensors[name], ref.tensors[name]), name


# --------------------------------------------------------------------- independent encoders agree
@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_reference_encoder_equals_native_float8_cast(element):
    fmt = ELEMENTS[element]
    vals = element_values(fmt)
    grid = vals[torch.isfinite(vals)].unique()
    mids = (grid[1:] + grid[:-1]) / 2                       # every tie, both signs
    g = torch.Generator().manual_seed(1)
    rnd = (torch.randn(20000, generator=g, dtype=torch.float64)
           * torch.exp2(torch.randint(-30, 30, (20000,), generator=g).double()))
    y = torch.cat([grid, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20), rnd, torch.tensor([fmt.max * 1.1, -1e9, -0.0])])
    y = y.to(torch.float32).to(torch.float64)               # inputs the quantizer can see: float32 values
    assert torch.equal(encode_elements(y, fmt), encode_elements_reference(y, fmt))


@pytest.mark.parametrize("element", FORMATS)
def test_every_code_round_trips(element):
    fmt = ELEMENTS[element]
    vals = element_values(fmt)
    codes = torch.arange(1 << fmt.bits)
    finite = torch.isfinite(vals)
    assert torch.equal(encode_elements_reference(vals[finite], fmt), codes[finite].to(torch.uint8))
    # the audit's table is built on its own and must agree value for value (NaN where NaN)
    table = MX_ELEMENTS[element][1]
    assert np.array_equal(vals.numpy(), table, equal_nan=True)


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("element", FORMATS)
def test_audit_encoder_equals_quantizer(element, rule):
    x = _wide_blocks(seed=3, nb=800)[:, :29]                 # a ragged last axis: zero-padded blocks
    codes, scales = _codes(x, element, rule)
    a_codes, a_scales = audit_mx.encode_mx(x.numpy(), element, 32, rule)
    assert np.array_equal(scales.numpy(), a_scales)
    assert np.array_equal(codes.numpy(), a_codes)


# ------------------------------------------------------------------------------ MX laws (hypothesis)
@st.composite
def blocks(draw, max_rows=6):
    rows = draw(st.integers(1, max_rows))
    nblocks = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-20, 21, (rows, nblocks, 1), generator=g).float()
    x = torch.randn(rows, nblocks, 32, generator=g) * torch.exp2(e)
    if draw(st.booleans()):
        x[..., draw(st.integers(0, 31))] *= 2.0 ** draw(st.integers(0, 12))   # an outlier per block
    if draw(st.booleans()):
        x[0, 0] = 0.0
    return x.reshape(rows, nblocks * 32)


@pytest.mark.parametrize("element", FORMATS)
@SETTINGS
@given(x=blocks(), k=st.integers(-60, 60))
def test_power_of_two_scaling_moves_only_the_scale(element, x, k):
    codes, scales = _codes(x, element)
    live = scales != 0
    assume(bool((((scales.int() + k >= 1) & (scales.int() + k <= 254)) | ~live).all()))
    codes2, scales2 = _codes(x * 2.0 ** k, element)
    assert torch.equal(codes2, codes)
    assert torch.equal(scales2.int()[live], scales.int()[live] + k)
    assert torch.equal(scales2[~live], scales[~live])


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@pytest.mark.parametrize("element", FORMATS)
@SETTINGS
@given(vals=st.lists(finite32, min_size=1, max_size=96))
def test_no_nan_or_inf_for_any_finite_input(element, vals):
    x = torch.tensor(vals, dtype=torch.float32).reshape(1, -1)
    q = MX(element, 32)
    x_hat = q.dequantize(q.quantize(x))
    assert bool(torch.isfinite(x_hat).all())
    codes, _ = _codes(x, element)
    nan_codes = torch.nonzero(torch.isnan(element_values(ELEMENTS[element]))).reshape(-1)
    assert not bool(torch.isin(codes.long(), nan_codes).any())


@pytest.mark.parametrize("element", FORMATS)
@SETTINGS
@given(x=blocks())
def test_relative_error_in_the_normal_range_of_the_block(element, x):
    mbits, emin, emax, vmax = SPEC[element]
    q = MX(element, 32)
    x_hat = q.dequantize(q.quantize(x)).double()
    xb = x.double().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    scale = torch.exp2((torch.floor(torch.log2(amax.clamp(min=1e-300))) - emax).clamp(-127, 127))
    normal = (xb.abs() >= 2.0 ** emin * scale) & (xb.abs() <= vmax * scale)
    rel = (x_hat.reshape(xb.shape) - xb).abs() / xb.abs().clamp(min=1e-300)
    assert bool((rel[normal] <= 2.0 ** -(mbits + 1)).all())
    if element == "e4m3":
        assert 2.0 ** -(mbits + 1) == 2 ** -4


def test_saturation_all_zero_and_negative_zero():
    x = torch.zeros(3, 32)
    x[0, 0] = 500.0                       # amax 500 -> scale 2**(8-8) = 1, 500 > 448 saturates
    x[0, 1] = -500.0
    x[0, 2] = -0.0
    x[2, 3] = -0.0                        # a block of zeros, one of them negative
    codes, scales = _codes(x, "e4m3")
    assert scales.tolist() == [[127], [0], [0]]
    assert codes[0, :3].tolist() == [0x7E, 0xFE, 0x80]        # ±448, never the NaN code 0x7F
    assert codes[1].tolist() == [0] * 32
    assert codes[2, 3].item() == 0x80
    f4, s4 = _codes(x, "e2m1")
    assert s4.tolist() == [[127 + 8 - 2], [0], [0]]           # 500 -> floor(log2) 8 - emax 2
    assert f4[0, :3].tolist() == [0x7, 0xF, 0x8]                # 500 / 64 saturates to 6, sign kept
    x_hat = MX("e4m3").dequantize(MX("e4m3").quantize(x))
    assert x_hat[0, :2].tolist() == [448.0, -448.0]
    assert torch.signbit(x_hat[0, 2]) and torch.signbit(x_hat[2, 3])


def test_fp4_saturates_and_rounds_to_even():
    # amax 6 -> scale 2**(2-2) = 1; 5.0 ties between 4 and 6 -> 4 (even code 0x6); 2.5 -> 2, 7 -> 6
    x = torch.tensor([[6.0, 5.0, 2.5, 3.5, 0.25, 0.75, -5.0, 7.0] + [0.0] * 24])
    x_hat = MXFP4().dequantize(MXFP4().quantize(x))
    assert x_hat[0, :8].tolist() == [6.0, 4.0, 2.0, 4.0, 0.0, 1.0, -4.0, 6.0]


@pytest.mark.parametrize("element,bits", [("e4m3", 8.25), ("e5m2", 8.25), ("e2m1", 4.25)])
def test_nbytes_bits_per_element_plus_header(element, bits):
    x = torch.randn(3, 40, 64)
    p = MX(element).quantize(x)
    assert p.nbytes == 3 * 40 * 64 * bits / 8 + 16
    assert p.tensors["header"].dtype == torch.int64 and p.tensors["header"].tolist() == [40, 64]
    assert {a.dtype for n, a in p.arrays.items() if n != "header"} == {np.dtype(np.uint8)}


def test_ragged_last_axis_is_zero_padded_and_counted():
    x = torch.randn(2, 5, 100)                            # 100 keys -> 4 blocks, 28 padding codes
    q = MXFP8()
    p = q.quantize(x)
    assert p.tensors["codes"].shape == (2, 5, 128) and p.tensors["scales"].shape == (2, 5, 4)
    assert p.nbytes == 2 * 5 * (128 + 4) + 16
    assert bool((p.tensors["codes"][..., 100:] == 0).all())
    ref, _ = _codes(torch.nn.functional.pad(x, (0, 28)), "e4m3")
    assert torch.equal(p.tensors["codes"], ref)
    assert q.dequantize(p).shape == x.shape


def test_configs_names_and_bad_parameters():
    for name in ("mxfp8_e4m3_b32", "mxfp8_e5m2_b32", "mxfp4_e2m1_b32"):
        q = quant.get(name)
        assert q.name == name and quant.from_config(q.config()).config() == q.config()
    q = MXFP8(rotation="signed_hadamard", seed=5)
    assert q.name == "mxfp8_e4m3_b32_hadamard"
    assert quant.from_config(q.config()).config() == q.config()
    q = MXFP8(rotation="signed_hadamard", seed=5)
    r = MX("e4m3", 32, scale_rule="rceil")
    assert r.name == "mxfp8_e4m3_b32_rceil" and r.config()["scale_rule"] == "rceil"
    assert quant.from_config(r.config()).config() == r.config()
    for kwargs in ({"element": "e3m4"}, {"block_size": 24}, {"rotation": "hadamard"}, {"seed": 1.5},
                   {"scale_rule": "ceil"}):
        with pytest.raises(ValueError):
            MX(**kwargs)
    with pytest.raises(ValueError, match="e4m3 or e5m2"):
        MXFP8(element="e2m1")


def test_non_finite_refused_with_name_and_index_for_the_rotated_scheme():
    x = torch.randn(2, 3, 64)
    x[1, 2, 63] = float("inf")
    with pytest.raises(ValueError, match=r"case\.k: non-finite value inf at index \(1, 2, 63\)"):
        MXFP8(rotation="signed_hadamard").quantize(x, name="case.k")


def test_audit_decoder_refuses_rotated_payload_without_signs():
    q = MXFP8(rotation="signed_hadamard")
    p = q.quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match="rotation signs"):
        decode_mx(p.arrays, q.config(), (4, 64))
    plain = MXFP8()
    pp = plain.quantize(torch.randn(4, 40))
    assert np.array_equal(decode_mx(pp.arrays, plain.config(), (4, 40)).astype(np.float32),
                          plain.dequantize(pp).numpy())


# ------------------------------------------------------------------------------------- rotation
@pytest.mark.parametrize("n", [1, 2, 8, 64, 128])
def test_sylvester_is_a_hadamard_matrix(n):
    h = sylvester(n)
    assert bool((h.abs() == 1).all())
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    assert torch.equal(h, h.T)


@pytest.mark.parametrize("d", [16, 64, 128, 256, 384])
def test_rotation_is_orthogonal_and_keeps_qk(d):
    rot = SignedHadamard(d, seed=11)
    r = rot.matrix()
    assert torch.allclose(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert rot.block == min(d, 128)
    if d > 128:   # block diagonal per 128 channels
        assert bool((r[:128, 128:] == 0).all()) and bool((r[128:, :128] == 0).all())
    g = torch.Generator().manual_seed(d)
    q = torch.randn(3, 7, d, generator=g)
    k = torch.randn(3, 50, d, generator=g)
    qr, kr = rot.apply(q), rot.apply(k)
    assert qr.dtype == torch.float32
    ref = q.double() @ k.double().transpose(-1, -2)
    rotated = qr.double() @ kr.double().transpose(-1, -2)
    assert torch.allclose(rotated, ref, rtol=0, atol=1e-5 * math.sqrt(d))   # float32 rounding of Q R, K R only
    assert torch.allclose(rot.apply(q.double()), q.double() @ r, atol=1e-12)
    assert torch.allclose(rot.invert(rot.apply(q.double())), q.double(), atol=1e-12)


@pytest.mark.parametrize("d", [3, 72, 96, 192, 200])
def test_rotation_refuses_head_dims_it_cannot_rotate(d):
    with pytest.raises(ValueError, match=rf"signed_hadamard rotation needs .* got {d}"):
        rotation_block(d)
    with pytest.raises(ValueError, match="signed_hadamard"):
        MXFP8(rotation="signed_hadamard").quantize(torch.randn(4, d))


def test_signs_are_seeded():
    a, b = random_signs(128, 0), random_signs(128, 0)
    assert torch.equal(a, b) and a.dtype == torch.int8
    assert set(a.tolist()) == {-1, 1}
    assert not torch.equal(a, random_signs(128, 1))
    assert torch.equal(SignedHadamard(128, 3).signs, random_signs(128, 3))


def test_rotated_scheme_quantizes_the_rotated_tensor_and_rotates_back():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, 64, generator=g)
    x[..., 5] *= 40.0                                                      # an outlier channel
    qr = MXFP8(rotation="signed_hadamard", seed=4)
    p = qr.quantize(x)
    rot = SignedHadamard(64, 4)
    plain = MXFP8().quantize(rot.apply(x))
    assert torch.equal(p.tensors["codes"], plain.tensors["codes"])
    assert torch.equal(p.tensors["scales"], plain.tensors["scales"])
    assert p.nbytes == plain.nbytes                                        # the signs are config, not payload
    x_hat = qr.dequantize(p)
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    assert torch.allclose(x_hat, rot.invert(qr.decode_rotated(p)))
    rel = torch.linalg.vector_norm(x_hat - x) / torch.linalg.vector_norm(x)
    assert rel < 2 ** -4
