"""Causal attention over a cache's keys, in blocks of queries: the one definition that the cache's
attention-based decisions (a sink chosen by mass, heavy hitters, per-head concentration) and the
attention-based token scorers (:mod:`testbed.policies.scorers`) read.

``query [B, H_q, t, D]`` are the last t of the ``key [B, H_kv, n, D]`` positions (the keys in order,
a cache's history first); the query heads are grouped by KV head (g = H_q / H_kv per head).
"""

from __future__ import annotations

import torch

__all__ = ["accumulated_attention", "last_queries_attention", "causal_softmax_blocks"]


def causal_softmax_blocks(query: torch.Tensor, key: torch.Tensor, scale: float, block: int, dtype: torch.dtype):
    """Yield ``(P [B, H_kv, g, z - a, n], qpos)`` per block of queries ``a:z`` of one causal pass:
    ``query [B, H_q, t, D]`` are the last t of the ``key [B, H_kv, n, D]`` positions (the pass's
    keys in order, a cache's history first), scores and softmax in ``dtype``, the query heads
    grouped by KV head (g per head); memory ``B H_q block n``."""
    b, hq, t, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    q = query.to(dtype).reshape(b, hkv, hq // hkv, t, d)
    k = key.to(dtype)
    kpos = torch.arange(n, device=query.device)
    for a in range(0, t, block):
        z = min(t, a + block)
        qpos = torch.arange(n - t + a, n - t + z, device=query.device)
        s = torch.einsum("bhgqd,bhkd->bhgqk", q[:, :, :, a:z], k) * scale
        s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
        yield torch.softmax(s, dim=-1), qpos


def accumulated_attention(query: torch.Tensor, key: torch.Tensor, scale: float, block: int = 256) -> torch.Tensor:
    """``[B, H_kv, n]`` float64: the attention each of the ``n`` keys received in one causal pass,
    summed over the pass's queries and the KV head's query heads (H2O's accumulated score).
    ``query [B, H_q, t, D]`` are the last t of the ``key [B, H_kv, n, D]`` positions; float64
    scores (so a pass cut into chunks sums to the same up to float64 rounding), queries in blocks."""
    b, hkv, n = query.shape[0], key.shape[1], key.shape[2]
    acc = torch.zeros(b, hkv, n, dtype=torch.float64, device=query.device)
    for p, _ in causal_softmax_blocks(query, key, scale, block, torch.float64):
        acc += p.sum(dim=(2, 3))
    return acc


def last_queries_attention(query: torch.Tensor, key: torch.Tensor, scale: float, dtype=torch.float32) -> torch.Tensor:
    """``[B, H_kv, g, t, n]``: the causal softmax of the ``t`` queries (the last t of the n positions)
    over the keys, in ``dtype``; for a few queries (an observation window, the newest token)."""
    return next(causal_softmax_blocks(query, key, scale, query.shape[2], dtype))[0]
