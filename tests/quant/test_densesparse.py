"""Dense-and-sparse grouped integers (``int_dense_sparse``): the documented outlier rule, its bytes,
what it buys over plain grouped integers, and the audit's refusal of a malformed sparse part."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from testbed import quant
from testbed.audit_checks import schemes
from testbed.quant.densesparse import DenseSparse


def _planted(n=128, d=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, n, d, generator=g)
    spots = [(0, 5, 3), (0, 77, 40), (1, 0, 0), (1, 127, 63)]
    for i, (h, t, c) in enumerate(spots):
        x[h, t, c] = 60.0 + i  # far above every N(0, 1) value
    return x, spots


def test_the_planted_outliers_are_the_stored_ones_exactly():
    x, spots = _planted()
    q = DenseSparse(bits=3, group_size=32, axis="channel", outliers=0.01)
    p = q.quantize(x)
    # 1 % of 128 x 64 = 81.92 -> 82 per head, at ascending uint16 flat indices
    assert p.tensors["outlier_index"].dtype == torch.uint16 and p.tensors["outlier_index"].shape == (2, 82)
    idx = p.tensors["outlier_index"].to(torch.int64)
    assert bool((idx.diff(dim=-1) > 0).all())
    for h, t, c in spots:
        assert t * 64 + c in idx[h].tolist()
    y = q.dequantize(p)
    for h, t, c in spots:  # 60..63 are exact in float16
        assert y[h, t, c] == x[h, t, c]
    assert p.nbytes == quant.IntGrouped(3, 32, "channel").quantize(x).nbytes + 2 * 82 * (2 + 2)


def test_outliers_keep_their_groups_ranges_ordinary():
    """The groups holding a planted outlier: plain int3 spends its steps on the outlier's range, the
    dense-and-sparse part on the ordinary members; their error shrinks by the range ratio."""
    x, spots = _planted()
    plain = quant.IntGrouped(3, 32, "channel")
    ds = DenseSparse(3, 32, "channel", 0.01)
    e_plain = (plain.dequantize(plain.quantize(x)) - x).abs()
    e_ds = (ds.dequantize(ds.quantize(x)) - x).abs()
    for h, t, c in spots:
        a = (t // 32) * 32
        grp = slice(a, a + 32)
        others = torch.ones(32, dtype=torch.bool)
        others[t - a] = False
        assert float(e_ds[h, grp, c][others].max()) < 0.25 * float(e_plain[h, grp, c][others].max())


def test_spans_above_65536_elements_use_int32_indices():
    x = torch.randn(1, 1100, 64)
    p = DenseSparse(2, 32, "token", 0.005).quantize(x)
    assert p.tensors["outlier_index"].dtype == torch.int32
    assert p.tensors["outlier_index"].shape == (1, round(0.005 * 1100 * 64))


def test_zero_outliers_is_plain_grouped_integers():
    x = torch.randn(3, 70, 40)
    p = DenseSparse(4, 32, "channel", 0.0).quantize(x)
    plain = quant.IntGrouped(4, 32, "channel").quantize(x)
    for k in plain.tensors:
        assert torch.equal(p.tensors[k], plain.tensors[k]), k
    assert p.tensors["outlier_values"].shape == (3, 0)


@pytest.mark.parametrize("bad", [dict(outliers=0.3), dict(outliers=-0.01), dict(outliers=True), dict(bits=5)])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        DenseSparse(**{"bits": 3, "group_size": 32, "axis": "channel", "outliers": 0.01, **bad})


def test_the_audit_refuses_a_malformed_sparse_part():
    x, _ = _planted()
    q = DenseSparse(3, 32, "channel", 0.01)
    arrays = dict(q.quantize(x).arrays)
    cfg = q.config()
    good = schemes.decode_tensor(dict(arrays), cfg, tuple(x.shape))
    np.testing.assert_array_equal(good, q.dequantize(q.quantize(x)).numpy())
    swapped = arrays["outlier_index"].copy()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    with pytest.raises(ValueError, match="ascending"):
        schemes.decode_tensor({**arrays, "outlier_index": swapped}, cfg, tuple(x.shape))
    with pytest.raises(ValueError, match="outlier_values must be float16"):
        schemes.decode_tensor({**arrays, "outlier_values": arrays["outlier_values"][:, :-1]}, cfg, tuple(x.shape))
    # a forged value decodes to what it says (the audit's re-encoding of the input is what catches it)
    forged = arrays["outlier_values"].copy()
    forged[0, 0] = np.float16(1.0)
    want = schemes.encode_tensor(x.numpy(), cfg)
    assert schemes.payload_differences({**arrays, "outlier_values": forged}, want) != []
    assert schemes.payload_differences(arrays, want) == []


def test_the_rotation_spreads_an_outlier_channel_over_per_token_groups():
    """Values quantized per token with one channel 30x the others: a per-token group's range is set by
    that channel, so plain int3 loses the rest; the rotation spreads it over the 64 channels first."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 96, 64, generator=g)
    x[..., 17] *= 30.0
    plain = DenseSparse(3, 32, "token", 0.0)
    rotated = DenseSparse(3, 32, "token", 0.0, "hadamard")

    def rel(q):
        ordinary = torch.ones(64, dtype=torch.bool)
        ordinary[17] = False
        e = (q.dequantize(q.quantize(x)) - x)[..., ordinary]
        return float(e.norm() / x[..., ordinary].norm())

    assert rel(rotated) < 0.5 * rel(plain)
    assert quant.get("int3_ds0_hadamard_channel_g32").quantize(x).nbytes == quant.IntGrouped(3, 32, "channel").quantize(
        x).nbytes  # the seed is the rotation's only metadata: no array


def test_the_rotation_is_orthogonal_and_its_signs_are_the_documented_ones():
    import hashlib

    from testbed.quant.densesparse import block_of, rotate, rotation_signs, unrotate

    for d, n in ((64, 64), (72, 8), (33, 1), (384, 128)):
        assert block_of(d) == n
        bits = hashlib.sha256("testbed.hadamard:9:0".encode()).digest()
        want = [1.0 - 2.0 * ((bits[i // 8] >> (i % 8)) & 1) for i in range(min(d, 256))]
        assert rotation_signs(d, 9)[:256].tolist() == want
        x = torch.randn(3, 10, d)
        y = rotate(x, 9)
        assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)  # norms kept
        assert torch.allclose(unrotate(y, 9), x, atol=1e-5)


@pytest.mark.parametrize("bad", [dict(rotation="signed_hadamard"), dict(seed=-1), dict(seed=1.5)])
def test_bad_rotations_are_refused(bad):
    with pytest.raises(ValueError):
        DenseSparse(**{"bits": 3, "group_size": 32, "axis": "channel", "outliers": 0.0, "rotation": "hadamard", **bad})


def test_a_payload_of_another_seed_is_refused():
    x = torch.randn(2, 40, 64)
    p = DenseSparse(3, 32, "channel", 0.01, "hadamard", seed=1).quantize(x)
    with pytest.raises(ValueError, match="cannot dequantize a payload made with"):
        DenseSparse(3, 32, "channel", 0.01, "hadamard", seed=2).dequantize(p)
