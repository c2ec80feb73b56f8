"""Reference attention against torch's own SDPA (an outside implementation), GQA and causal."""

import torch
import torch.nn.functional as F

from testbed.attention import attention


def test_matches_sdpa_with_gqa_and_causal_mask():
    g = torch.Generator().manual_seed(0)
    h, hkv, tk, tq, d = 6, 2, 50, 10, 16
    q = torch.randn(h, tq, d, generator=g, dtype=torch.float64)
    k = torch.randn(hkv, tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(hkv, tk, d, generator=g, dtype=torch.float64)
    pos = torch.arange(tk - tq, tk)
    out = attention(q, k, v, pos, causal=True, chunk=3)
    ke, ve = k.repeat_interleave(3, 0), v.repeat_interleave(3, 0)
    mask = torch.arange(tk)[None, :] <= pos[:, None]
    ref = F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_chunking_changes_the_result_only_at_rounding_level():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 33, 8, generator=g), torch.randn(1, 40, 8, generator=g), torch.randn(1, 40, 8, generator=g)
    pos = torch.arange(7, 40)
    a = attention(q, k, v, pos, causal=True, chunk=None)
    b = attention(q, k, v, pos, causal=True, chunk=5)
    assert torch.allclose(a, b, rtol=1e-13, atol=1e-15)  # matmul blocking may reorder sums
