"""Scaled dot-product attention for analysis: float64 reference, GQA, causal mask, query chunks.

``softmax(q k^T / sqrt(D)) v`` per query head, with key/value heads shared by consecutive query
heads (GQA). With ``causal=True`` query ``i`` sees keys ``0 .. query_positions[i]``. The work is
done over chunks of queries so that no more than ``chunk * Tk`` scores per head are alive at
once; a record with thousands of queries and keys stays within memory. `query_tiles` sizes the
tiles of the analyses from a score budget (``max_scores``, default `DEFAULT_MAX_SCORES`) and
`probability_tiles` yields the reference probabilities one tile of queries at a time, so that no
analysis holds ``[H, Tq, Tk]``.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from .case import Case
from .resources import DEFAULT_MAX_SCORES

__all__ = ["expand_kv", "visible_mask", "scores", "probabilities", "attention", "attention_case", "query_chunks",
           "query_tiles", "probability_tiles", "DEFAULT_MAX_SCORES"]

DEFAULT_CHUNK = 256


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[H_kv, T, D]`` -> ``[H, T, D]`` by repeating each KV head for its query-head group."""
    hkv = x.shape[0]
    if heads % hkv:
        raise ValueError(f"{heads} query heads are not a multiple of {hkv} KV heads")
    return x.repeat_interleave(heads // hkv, dim=0) if heads != hkv else x


def visible_mask(query_positions: torch.Tensor, keys: int, causal: bool) -> torch.Tensor | None:
    """``[Tq, Tk]`` boolean mask of visible keys, or None when every key is visible."""
    if not causal:
        return None
    ar = torch.arange(keys, device=query_positions.device)
    return ar.unsqueeze(0) <= query_positions.unsqueeze(1)


def query_chunks(tq: int, chunk: int | None) -> Iterator[slice]:
    step = tq if not chunk else max(1, int(chunk))
    for s in range(0, tq, step):
        yield slice(s, min(tq, s + step))


def query_tiles(heads: int, queries: int, keys: int, max_scores: int = DEFAULT_MAX_SCORES) -> list[slice]:
    """Slices of queries whose tiles ``[H, c, Tk]`` hold at most ``max_scores`` scores (at least one
    query per tile, so never fewer than ``H * Tk``); one slice when the whole Case fits."""
    step = max(1, int(max_scores) // max(1, heads * keys))
    return list(query_chunks(queries, min(step, max(1, queries))))


def probability_tiles(q: torch.Tensor, k: torch.Tensor, query_positions: torch.Tensor, causal: bool,
                      tiles: list[slice], dtype=torch.float64) -> Iterator[tuple[slice, torch.Tensor]]:
    """``(queries, P[H, c, Tk])``: the softmax probabilities of each tile of queries in turn; over
    one tile covering every query it is :func:`probabilities` itself, operation for operation."""
    ke = expand_kv(k, q.shape[0]).to(dtype)  # once, not per tile
    for sl in tiles:
        yield sl, torch.softmax(_scores(q[:, sl], ke, query_positions[sl], causal, dtype), dim=-1)


def _scores(q: torch.Tensor, ke: torch.Tensor, query_positions: torch.Tensor, causal: bool, dtype) -> torch.Tensor:
    """Masked logits of ``q`` against keys already expanded to its heads and cast (``ke [H, Tk, D]``)."""
    s = torch.matmul(q.to(dtype), ke.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = visible_mask(query_positions.to(q.device), ke.shape[1], causal)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def scores(q: torch.Tensor, k: torch.Tensor, query_positions: torch.Tensor, causal: bool, dtype=torch.float64) -> torch.Tensor:
    """Masked logits ``[H, Tq, Tk]`` (masked entries are -inf)."""
    return _scores(q, expand_kv(k, q.shape[0]).to(dtype), query_positions, causal, dtype)


def probabilities(q, k, query_positions, causal, dtype=torch.float64) -> torch.Tensor:
    """Softmax probabilities ``[H, Tq, Tk]`` (all queries at once; use for small records)."""
    return torch.softmax(scores(q, k, query_positions, causal, dtype), dim=-1)


def attention(q, k, v, query_positions, causal, *, dtype=torch.float64, chunk: int | None = DEFAULT_CHUNK) -> torch.Tensor:
    """Attention output ``[H, Tq, D]`` in ``dtype``, computed over chunks of queries."""
    heads = q.shape[0]
    ve = expand_kv(v, heads).to(dtype)
    ke = expand_kv(k, heads).to(dtype)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for sl in query_chunks(q.shape[1], chunk):
        p = torch.softmax(_scores(q[:, sl], ke, query_positions[sl], causal, dtype), dim=-1)
        out[:, sl] = torch.matmul(p, ve)
    return out


def attention_case(case: Case, k: torch.Tensor | None = None, v: torch.Tensor | None = None, *, dtype=torch.float64,
                   chunk=DEFAULT_CHUNK) -> torch.Tensor:
    """Attention of a Case, optionally with replaced (e.g. dequantized) K and V."""
    return attention(case.q, case.k if k is None else k, case.v if v is None else v,
                     case.query_positions, case.causal, dtype=dtype, chunk=chunk)
