"""Causal attention over a cache's keys, in blocks of queries: the one definition that the cache's
attention-based decisions (a sink chosen by mass, heavy hitters, per-head concentration) and the
attention-based token scorers (:mod:`testbed.policies.scorers`) read.

``query [B, H_q, t, D]`` are the last t of the ``key [B, H_kv, n, D]`` positions (the keys in order,
a cache's history first); the query heads are grouped by KV head (g = H_q / H_kv per head).
"""

from __future__ import annotations

import math

import torch

__all__ = ["accumulated_attention", "last_queries_attention", "causal_softmax_blocks", "causal_softmax_rows"]

# A slice of causal_softmax_rows holds at most this many bytes of scores (its probabilities as many, the
# concentration's float64 copy twice as many), in buffers allocated once per pass and reused slice after slice:
# fresh large temporaries per block were mapped anew and their pages zeroed by the kernel every time (at 8k
# tokens that page-zeroing was two thirds of a concentration pass).
ROWS_BYTES = 8 << 20


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


def causal_softmax_rows(query: torch.Tensor, key: torch.Tensor, scale: float, dtype: torch.dtype,
                        row_bytes: int = ROWS_BYTES):
    """Yield ``(P [B, H_kv, g, z - a, m], a, z)`` per slice of queries ``a:z`` of one causal pass, over
    the ``m = n - t + z`` keys those queries can see (the rest of each row is 0 in
    :func:`causal_softmax_blocks`, and is left out here): the same rows up to the float32 rounding
    of the scores' products (a matrix product's kernel may depend on its shape), in about half the
    arithmetic. A slice's scores hold at most ``row_bytes`` (at least one query), and every slice
    is written into the same two buffers, so no slice maps fresh memory: ``P`` is valid until the
    next slice is asked for."""
    b, hq, t, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    g = hq // hkv
    q = query.to(dtype).reshape(b, hkv, g, t, d)
    kt = key.to(dtype).transpose(-1, -2)
    per_key = b * hq * torch.empty((), dtype=dtype).element_size()
    room = max(1, row_bytes // per_key)  # query-key cells of one KV head group per slice
    scores = torch.empty(max(room, n) * b * hq, dtype=dtype, device=query.device)
    probs = torch.empty_like(scores)
    kpos = torch.arange(n, device=query.device)
    a = 0
    while a < t:
        w0 = n - t + a  # the keys before query a; r queries see at most w0 + r keys
        r = max(1, (math.isqrt(w0 * w0 + 4 * room) - w0) // 2)
        z = min(t, a + r)
        r, m = z - a, n - t + z
        s = scores[:b * hq * r * m].view(b, hkv, g * r, m)
        torch.matmul(q[:, :, :, a:z].reshape(b, hkv, g * r, d), kt[..., :m], out=s)
        s = s.mul_(scale).view(b, hkv, g, r, m)
        s.masked_fill_(kpos[:m][None, :] > kpos[n - t + a:m, None], float("-inf"))
        yield torch.softmax(s, dim=-1, out=probs[:s.numel()].view(s.shape)), a, z
        a = z


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
