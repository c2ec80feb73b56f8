"""The fused numba kernels must reproduce the torch reference implementations bit for bit."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.quant import IntGrouped, kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba is not installed: the fast path is off")


@pytest.fixture(autouse=True)
def force_fast(monkeypatch):
    monkeypatch.setattr(kernels, "MIN_FAST_ELEMENTS", 0)
    monkeypatch.setenv("TESTBED_FAST", "1")


def test_float16_rounding_matches_ieee_conversion():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    special = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, 6.1035156e-05, 6.1e-05, 5.96e-08, 2.98e-08,
                        2.9802322e-08, 8.940697e-08, 1.0009765625, 1.00146484375, 2049.0, 2051.0], dtype=np.float32)
    x = np.concatenate([x, special, -special, rng.standard_normal(50_000).astype(np.float32) * 1e-5])
    with np.errstate(over="ignore"):
        half = x.astype(np.float16)
    ieee, ieee_bits = half.astype(np.float32), half.view(np.uint16)
    # the routine the kernels use on this CPU (hardware conversion or software), and the software
    # routine that serves CPUs without one: values and stored bit patterns (signed zeros included)
    assert np.array_equal(kernels.float16_round(x), ieee, equal_nan=True)
    assert np.array_equal(kernels.float16_bits(x), ieee_bits)
    soft, soft_bits = kernels.float16_round_soft(x)
    assert np.array_equal(soft, ieee, equal_nan=True)
    assert np.array_equal(soft_bits, ieee_bits)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]), g=st.sampled_from([2, 4, 8, 16, 32, 64, 128]),
       axis=st.sampled_from(["channel", "token"]), lead=st.integers(1, 3), n=st.integers(1, 70),
       d=st.integers(1, 70), seed=st.integers(0, 2**31 - 1), log_scale=st.floats(-20, 10),
       offset=st.floats(-100, 100), constant_rows=st.booleans())
def test_fast_quantize_and_dequantize_equal_reference(bits, g, axis, lead, n, d, seed, log_scale, offset, constant_rows):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(lead, n, d, generator=gen) * (2.0 ** log_scale) + offset
    if constant_rows:
        x[:, : n // 2] = offset
    q = IntGrouped(bits, g, axis)
    fast = q.quantize(x)
    ref = q.quantize_reference(x)
    for name in ref.tensors:
        assert _bits(fast.tensors[name]).equal(_bits(ref.tensors[name])), name
    assert _bits(q.dequantize(fast)).equal(_bits(q.dequantize_reference(ref)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The stored bytes, so -0.0 and +0.0 (equal as values) differ."""
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_zero_groups_store_positive_zero_whatever_the_signs(axis):
    # groups of signed zeros: the minimum and the range are stored as +0 on both paths
    x = torch.zeros(2, 64, 64)
    x[:, ::3] = -0.0
    x[1, 40:] = torch.randn(24, 64)
    q = IntGrouped(4, 32, axis)
    for p in (q.quantize(x), q.quantize_reference(x)):
        for name in ("scale", "zero"):
            vals = p.tensors[name][p.tensors[name] == 0]
            assert vals.numel() and not torch.signbit(vals).any(), name


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fast_path_reports_first_bad_index(axis, bad):
    x = torch.randn(2, 64, 32)
    x[1, 40, 5] = bad
    x[1, 50, 7] = bad
    with pytest.raises(ValueError, match=r"k: non-finite value .* at index \(1, 40, 5\)"):
        IntGrouped(4, 32, axis).quantize(x, name="k")


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_fast_path_reads_strided_views_like_contiguous_copies(axis):
    x = torch.randn(3, 100, 48)
    view = x[:, 7:91, :]  # the quantized span of a residual window: not contiguous
    q = IntGrouped(4, 32, axis)
    a, b = q.quantize(view), q.quantize_reference(view.contiguous())
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in b.tensors)


@settings(max_examples=60, deadline=None)
@given(element=st.sampled_from(["e4m3", "e5m2", "e2m1"]), block=st.sampled_from([2, 8, 32, 64]),
       rotation=st.sampled_from([None, "signed_hadamard"]), rows=st.integers(1, 40), d=st.sampled_from([8, 32, 64, 50, 96]),
       seed=st.integers(0, 2**31 - 1), log_scale=st.integers(-140, 120), spread=st.integers(0, 40))
def test_fast_mx_equals_reference(element, block, rotation, rows, d, seed, log_scale, spread):
    from testbed.quant import MX

    if rotation and d not in (8, 32, 64):
        d = 64
    gen = torch.Generator().manual_seed(seed)
    # elements spread over 2^spread binades around 2^log_scale, with exact zeros and negative zeros
    mant = torch.rand(2, rows, d, generator=gen) + 0.5
    expo = torch.randint(-spread, 1, (2, rows, d), generator=gen).double() + log_scale
    x = (torch.where(torch.rand(2, rows, d, generator=gen) < 0.5, -1.0, 1.0).double() * mant * torch.exp2(expo)).float()
    x[torch.rand(2, rows, d, generator=gen) < 0.05] = 0.0
    x[torch.rand(2, rows, d, generator=gen) < 0.05] = -0.0
    q = MX(element, block, rotation)
    if rotation:
        x = x.clamp(-1e30, 1e30)
    fast, ref = q.quantize(x), q.quantize_reference(x)
    for name in ref.tensors:
        assert torch.equal(fast.tensors[name], ref.tensors[name]), name
    assert torch.equal(q.decode_rotated(fast), q.decode_rotated_reference(ref))


def test_fast_mx_reports_first_bad_index():
    from testbed.quant import MXFP8

    x = torch.randn(2, 64, 32)
    x[1, 40, 5] = float("nan")
    with pytest.raises(ValueError, match=r"q: non-finite value nan at index \(1, 40, 5\)"):
        MXFP8().quantize(x, name="q")


_SOFT_F16_SCRIPT = r"""
import torch
from testbed.quant import IntGrouped, kernels
assert not kernels._NATIVE_F16
kernels.MIN_FAST_ELEMENTS = 0
gen = torch.Generator().manual_seed(5)
checked = 0
for bits in (2, 3, 4, 8):
    for axis in ("channel", "token"):
        for scale in (1e-6, 1.0, 3e3):
            x = torch.randn(2, 67, 45, generator=gen) * scale
            x[0, :20] = 0.0
            x[1, :5] = -0.0
            q = IntGrouped(bits, 16, axis)
            fast, ref = q.quantize(x), q.quantize_reference(x)
            for name in ref.tensors:
                a, b = fast.tensors[name].contiguous().view(torch.uint8), ref.tensors[name].contiguous().view(torch.uint8)
                assert torch.equal(a, b), (bits, axis, scale, name)
            assert torch.equal(q.dequantize(fast), q.dequantize_reference(ref))
            checked += 1
print("checked", checked)
"""


def test_software_float16_kernels_equal_reference(tmp_path):
    """The kernels as compiled for CPUs without a float16 conversion instruction (software
    rounding and bit patterns) store the same bytes as the reference."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TESTBED_F16": "soft", "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    out = subprocess.run([sys.executable, "-c", _SOFT_F16_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "checked 24" in out.stdout


def test_a_fast_kernel_leaves_torch_thread_count_as_pinned():
    """numba's first parallel launch starts its threading layer, which reset torch's intra-op
    thread count (OpenMP) from the run's pinned 1 to the machine's cores: every reduction after it
    then depended on the core count. Checked in a fresh process, where that first launch happens."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from testbed.quant import kernels\n"
            "assert kernels.available()\n"
            "torch.set_num_threads(1)\n"
            "a = torch.randn(256, 256)\n"
            "(a @ a).sum()\n"
            "kernels.set_threads(torch.get_num_threads())\n"
            "x = torch.randn(4, 512, 64).numpy()\n"
            "kernels.int_quantize_channel(x, 4, 32)\n"
            "kernels.mx_quantize(x.reshape(-1, 32), 32, 4, 3, 7, 448.0, 8)\n"
            "print(torch.get_num_threads())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "1"
