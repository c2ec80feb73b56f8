"""Scheme-specific laws of grouped integer quantization (KIVI layout)."""

import numpy as np
import pytest
import torch

from testbed.quant import Int4Grouped, IntGrouped
from testbed.quant.packing import pack_codes, unpack_codes


def test_low_nibble_first():
    codes = torch.tensor([[0x1, 0xA, 0xF, 0x0, 0x7]], dtype=torch.uint8)
    packed = pack_codes(codes, 4)
    assert packed.tolist() == [[0xA1, 0x0F, 0x07]]
    assert torch.equal(unpack_codes(packed, 4, 5), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_bijection(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 7, 37), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape[-1] == -(-37 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits, 37), codes)


def test_degenerate_group_no_division_and_decodes_to_float16_value():
    x = torch.full((1, 64, 32), 0.3)
    x[:, 32:, :] = torch.randn(32, 32)
    q = Int4Grouped(32, "channel")
    p = q.quantize(x)
    scale = p.arrays["scale"]
    assert np.all(scale[0, 0] == 0)  # first token group is constant in every channel
    x_hat = q.dequantize(p)
    expected = torch.tensor(0.3, dtype=torch.float16).float()
    assert torch.all(x_hat[:, :32, :] == expected)


def test_exact_on_float16_grid_values():
    # values z + c*s with float16 z and s are represented exactly
    z, s = 0.5, 0.125
    codes = torch.randint(0, 16, (2, 64, 32), generator=torch.Generator().manual_seed(1)).float()
    codes[..., 0, :] = 0
    codes[..., 1, :] = 15
    codes[..., 32, :] = 0
    codes[..., 33, :] = 15
    x = z + codes * s
    q = Int4Grouped(32, "channel")
    assert torch.equal(q.dequantize(q.quantize(x)), x)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_padding_repeats_edge_and_does_not_widen_range(axis):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 40, 48, generator=g)  # 40 tokens, 48 features: both pad to 64 with G=32
    q = Int4Grouped(32, axis)
    p = q.quantize(x)
    if axis == "channel":
        last = x[0, 32:40, :]
        scale = torch.from_numpy(p.arrays["scale"][0, 1].astype(np.float32))
    else:
        last = x[0, :, 32:48]
        scale = torch.from_numpy(p.arrays["scale"][0, :, 1].astype(np.float32))
    rng = (last.amax(dim=0 if axis == "channel" else 1) - last.amin(dim=0 if axis == "channel" else 1)) / 15
    assert torch.allclose(scale, rng, rtol=2 ** -10, atol=0)


def test_token_axis_groups_features_channel_axis_groups_tokens():
    x = torch.zeros(1, 32, 32)
    x[0, :, 0] = torch.linspace(0, 15, 32)  # one channel varies across tokens
    pk = Int4Grouped(32, "channel").quantize(x)
    pv = Int4Grouped(32, "token").quantize(x)
    assert pk.arrays["scale"].shape == (1, 1, 32) and pv.arrays["scale"].shape == (1, 32, 1)
    assert np.count_nonzero(pk.arrays["scale"]) == 1  # only channel 0 has a range
    assert np.count_nonzero(pv.arrays["scale"]) == 31  # every token but the first (all-zero) has a range


@pytest.mark.parametrize("kwargs", [dict(group_size=3), dict(group_size=1), dict(group_size=0), dict(bits=5),
                                    dict(axis="head"), dict(group_size=48), dict(bits=4.0), dict(bits=True),
                                    dict(group_size=32.0)])
def test_bad_parameters_refused(kwargs):
    with pytest.raises(ValueError):
        IntGrouped(**kwargs)


def test_float16_overflow_refused():
    x = torch.zeros(1, 32, 32)
    x[0, 0, 0] = 1e6
    with pytest.raises(ValueError, match="float16"):
        Int4Grouped(32, "token").quantize(x, name="k")


@pytest.mark.parametrize("value", [1e-5, -4e-6, 3e-7, 2.9e-26])
def test_constant_groups_in_float16_subnormal_range_round_by_at_most_half_a_quantum(value):
    x = torch.full((1, 8, 8), value)
    for axis in ("channel", "token"):
        q = Int4Grouped(32, axis)
        err = (q.dequantize(q.quantize(x)).double() - x.double()).abs().max()
        assert err <= 2.0 ** -25  # float16 subnormal quantum is 2^-24
