"""The concentration pass's rows (:func:`causal_softmax_rows`): the same softmax rows as the
block definition (:func:`causal_softmax_blocks`) up to float32 rounding, over only the keys each
slice can see, each slice within its byte bound, and the concentration read from them equal to the
block definition's. (At 8,064 tokens of one layer's shape, 9 query and 3 KV heads, both gave the
same bits in a measurement; the test does not ask for that, since a product's kernel may depend on
its shape.)"""

import pytest
import torch

from testbed.metrics import effective_support
from testbed.policies.causal import causal_softmax_blocks, causal_softmax_rows
from testbed.policies.selection import concentration


def _qk(t, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 6, t, 16, generator=g), torch.randn(2, 3, n, 16, generator=g) * 2


@pytest.mark.parametrize("t,n,row_bytes", [(50, 50, 6000), (37, 90, 9000), (40, 40, 1)])
def test_rows_are_the_block_rows_cut_to_the_visible_keys(t, n, row_bytes):
    q, k = _qk(t, n)
    full = torch.cat([p for p, _ in causal_softmax_blocks(q, k, 0.25, 7, torch.float32)], dim=3)
    covered = []
    per_key = 2 * 6 * 4  # B * H_q * float32 bytes
    for p, a, z in causal_softmax_rows(q, k, 0.25, torch.float32, row_bytes=row_bytes):
        m = n - t + z
        assert p.shape == (2, 3, 2, z - a, m)
        assert z - a == 1 or per_key * (z - a) * m <= row_bytes, "a slice of several queries beyond its byte bound"
        torch.testing.assert_close(p, full[:, :, :, a:z, :m], rtol=1e-5, atol=1e-6)
        assert not full[:, :, :, a:z, m:].any(), "a key left out was visible"
        covered.extend(range(a, z))
    assert covered == list(range(t)), "the slices do not cover every query once, in order"


def test_concentration_equals_the_block_definition():
    q, k = _qk(300, 330, seed=3)  # a history of 30 keys, then 300 queries
    block = 64
    want = torch.zeros(2, 3, dtype=torch.float64)
    for p, qpos in causal_softmax_blocks(q, k, 0.25, block, torch.float32):
        want += effective_support(p, qpos + 1).sum(dim=(2, 3))
    got = concentration(q, k, 0.25, block=block, total=True)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=0)
    assert not torch.equal(concentration(q, k, 0.5, block=block, total=True), got), "the scale is not read"
