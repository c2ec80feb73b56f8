"""Residual window: byte accounting written out by hand, window kept bit-exact, edge cases of R."""

import pytest
import torch

from testbed.quant import Int4Grouped, ResidualWindow


def expected_payload(n: int, d: int, g: int, r: int, bits: int = 4) -> int:
    """The byte accounting, written out: K per channel over token groups padded to G, V per
    token over feature groups; 4-bit codes two per byte; float16 scale + zero per group; the last
    R tokens of K and V at float32; one 16-byte (N, D) header."""
    m = max(n - r, 0)
    kept = n - m
    m_pad = -(-m // g) * g
    k_codes = m_pad * d * bits // 8
    k_groups = (m_pad // g) * d
    v_codes = m * (-(-d // g) * g) * bits // 8
    v_groups = m * (-(-d // g))
    return k_codes + 4 * k_groups + v_codes + 4 * v_groups + 2 * kept * d * 4 + 16


def rw(r, s=0):
    return ResidualWindow(Int4Grouped(32, "channel"), Int4Grouped(32, "token"), recent=r, sink=s)


@pytest.mark.parametrize("r,expected", [(0, 5136), (16, 8912), (64, 18960)])
def test_payload_matches_formula_and_seed_table(r, expected):
    k, v = torch.randn(1, 128, 32), torch.randn(1, 128, 32)
    p = rw(r).pack(k, v)
    assert p.nbytes == expected_payload(128, 32, 32, r) == expected
    assert p.nbytes == sum(a.nbytes for a in p.arrays.values())


@pytest.mark.parametrize("n,r", [(100, 0), (100, 7), (512, 16), (33, 1), (40, 40), (40, 1000)])
def test_payload_formula_with_partial_groups(n, r):
    k, v = torch.randn(2, n, 32), torch.randn(2, n, 32)
    p = rw(r).pack(k, v)
    per_head = expected_payload(n, 32, 32, r) - 16
    assert p.nbytes == 2 * per_head + 16


def test_r_zero_keeps_nothing_float32():
    k, v = torch.randn(1, 64, 32), torch.randn(1, 64, 32)
    p = rw(0).pack(k, v)
    assert not any(name.startswith("recent") for name in p.arrays)
    k_hat, _ = rw(0).unpack(p)
    assert not torch.equal(k_hat[:, -1], k[:, -1])


def test_window_is_bit_exact_and_rest_quantized():
    k, v = torch.randn(3, 100, 32), torch.randn(3, 100, 32)
    k_hat, v_hat = rw(16).unpack(rw(16).pack(k, v))
    assert torch.equal(k_hat[:, 84:], k[:, 84:]) and torch.equal(v_hat[:, 84:], v[:, 84:])
    assert not torch.equal(k_hat[:, :84], k[:, :84])


def test_r_at_least_n_keeps_everything():
    k, v = torch.randn(1, 40, 32), torch.randn(1, 40, 32)
    for r in (40, 41, 10_000):
        k_hat, v_hat = rw(r).unpack(rw(r).pack(k, v))
        assert torch.equal(k_hat, k) and torch.equal(v_hat, v)


def test_sink_window_keeps_first_tokens():
    k, v = torch.randn(1, 128, 32), torch.randn(1, 128, 32)
    packer = rw(0, s=16)
    p = packer.pack(k, v)
    k_hat, v_hat = packer.unpack(p)
    assert torch.equal(k_hat[:, :16], k[:, :16]) and torch.equal(v_hat[:, :16], v[:, :16])
    assert p.nbytes == expected_payload(128, 32, 32, 16)  # same bytes as a recent window of 16


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_window_refused(bad):
    with pytest.raises(ValueError):
        rw(bad)


def test_mismatched_kv_refused():
    with pytest.raises(ValueError, match="same shape"):
        rw(0).pack(torch.randn(1, 64, 32), torch.randn(1, 63, 32))


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_unpack_equals_decoding_each_part_separately(lead, monkeypatch):
    """unpack decodes straight into the output cache; it must equal the parts decoded on their own
    and concatenated, with the fused kernels on (forced for small tensors) and off."""
    from testbed.quant import kernels

    k, v = torch.randn(*lead, 100, 32), torch.randn(*lead, 100, 32)
    for threshold in (0, 1 << 40):
        monkeypatch.setattr(kernels, "MIN_FAST_ELEMENTS", threshold)
        packer = rw(16, s=4)
        k_hat, v_hat = packer.unpack(packer.pack(k, v))
        kq, vq = Int4Grouped(32, "channel"), Int4Grouped(32, "token")
        mid_k = kq.dequantize(kq.quantize(k[..., 4:84, :]))
        mid_v = vq.dequantize(vq.quantize(v[..., 4:84, :]))
        assert torch.equal(k_hat, torch.cat([k[..., :4, :], mid_k, k[..., 84:, :]], dim=-2))
        assert torch.equal(v_hat, torch.cat([v[..., :4, :], mid_v, v[..., 84:, :]], dim=-2))


def test_non_finite_in_window_or_span_named_by_full_index():
    for pos in (2, 50, 99):
        k = torch.randn(2, 100, 32)
        k[1, pos, 3] = float("nan")
        with pytest.raises(ValueError, match=rf"k: non-finite value nan at index \(1, {pos}, 3\)"):
            rw(16, s=4).pack(k, torch.randn(2, 100, 32))
