"""What decides which tokens and heads a live policy keeps, from the attention the model computes.

A sink chosen from attention (``Policy.sink_select == "mass"``): each prefill key's mean share of
attention (:func:`sink_scores`), the ``sink`` largest per sequence and KV head (:func:`choose_sink`).
A mixed policy (``Policy.low``: per-head bits): each KV head's prefill concentration
(:func:`concentration`), the pairs that get the low bits (:func:`allocation_keys`, :func:`allocate`).
Heavy hitters: the candidates of largest accumulated attention (:func:`choose_heavy`). An oracle's
float32 pass over a whole segment: :func:`observe_concentration` (inside
:func:`testbed.policies.hook.policy_attention`) sums every attention call into an :class:`Observed`.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .causal import accumulated_attention, causal_softmax_blocks, causal_softmax_rows
from .handoff import OBSERVE_SECONDS, OBSERVER
from .policy import Policy

__all__ = ["sink_scores", "concentration", "choose_heavy", "allocation_keys", "allocate", "Observed",
           "observe_concentration", "choose_sink"]


def sink_scores(query: torch.Tensor, key: torch.Tensor, scale: float, candidates: int, block: int = 256) -> torch.Tensor:
    """``[B, H_kv, candidates]``: for each of the first ``candidates`` keys of a causal prefill, the
    mean share of attention it receives over the queries that see it (query positions >= its own)
    and the KV head's query heads. ``query [B, H_q, t, D]``, ``key [B, H_kv, t, D]`` (the prefill's
    own keys, in order); float32, queries in blocks of ``block`` (memory ``B H_q block t``)."""
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    total = torch.zeros(b, hkv, candidates, dtype=torch.float32, device=query.device)
    for p, _ in causal_softmax_blocks(query, key, scale, block, torch.float32):
        total += p[..., :candidates].sum(dim=(2, 3))
    seen_by = (t - torch.arange(candidates, device=query.device)).to(torch.float32) * g
    return total / seen_by


def concentration(query: torch.Tensor, key: torch.Tensor, scale: float, block: int = 256,
                  total: bool = False) -> torch.Tensor:
    """``[B, H_kv]`` float64: the mean effective support (exp(entropy) / visible keys, the
    observation metrics' definition) of a causal pass's attention rows, over its queries and the
    KV head's query heads; low is concentrated, 1 is uniform (``total``: the sum instead of the
    mean). ``query [B, H_q, t, D]`` are the last t of the ``key [B, H_kv, n, D]`` positions (the
    pass's keys in order, a cache's history first); float32 scores over the keys each query sees
    (:func:`~testbed.policies.causal.causal_softmax_rows`), the float64 supports summed per ``block``
    of queries."""
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    support = torch.empty(b, hkv, hq // hkv, t, dtype=torch.float64, device=query.device)
    work = (torch.empty(0, dtype=torch.float64, device=query.device), torch.empty(0, dtype=torch.bool, device=query.device))
    for p, a, z in causal_softmax_rows(query, key, scale, torch.float32):
        if work[0].numel() < p.numel():  # float64 and mask buffers as large as the largest slice, reused
            work = (torch.empty(p.numel(), dtype=torch.float64, device=query.device),
                    torch.empty(p.numel(), dtype=torch.bool, device=query.device))
        support[..., a:z] = _effective_support(p, torch.arange(key.shape[2] - t + a, key.shape[2] - t + z,
                                                                 device=query.device) + 1, work)
    acc = torch.zeros(b, hkv, dtype=torch.float64, device=query.device)
    for a in range(0, t, block):  # summed per block of queries, as the rows came before
        acc += support[..., a:a + block].contiguous().sum(dim=(2, 3))
    return acc if total else acc / (hq // hkv * t)


def _effective_support(p: torch.Tensor, visible_keys: torch.Tensor, work: tuple) -> torch.Tensor:
    """:func:`testbed.metrics.effective_support` of ``p``'s rows (each row's entropy summed over the
    keys it sees, so equal to it up to float64 rounding), its entropy's float64 temporaries written
    into ``work`` (a float64 and a bool buffer of at least ``p.numel()``)."""
    plogp = work[0][:p.numel()].view(p.shape).copy_(p)
    zero = work[1][:p.numel()].view(p.shape)
    torch.gt(plogp, 0, out=zero).logical_not_()
    plogp.masked_fill_(zero, 1.0).log_().masked_fill_(zero, 0.0).mul_(p)
    return torch.exp(-plogp.sum(dim=-1)) / visible_keys.to(torch.float64)


def choose_heavy(index: torch.Tensor, score: torch.Tensor, count: int) -> torch.Tensor:
    """``[B, H, min(count, m)]`` positions into the last axis of ``index`` / ``score [B, H, m]`` (the
    candidates, ``index`` ascending): the ``count`` largest scores, ties to the lower token index,
    returned in ascending token order."""
    order = torch.sort(-score.to(torch.float64), dim=-1, stable=True).indices[..., :count]
    return order.sort(dim=-1).values


def allocation_keys(policy: Policy, scores: torch.Tensor) -> torch.Tensor:
    """``[B, L, H]`` float64 sort keys of a mixed policy's rule: the pairs with the smallest keys
    get the low bits. ``scores [B, L, H]``: the measured concentration (concentrated: the score;
    diffuse: minus it); ``late``: minus the layer index; ``random``: SHA-256 of ``"layer:head"``
    (its first 8 bytes, big-endian, ÷ 2^64) -- content-blind, the same for every sequence."""
    b, n_layers, h = scores.shape
    if policy.alloc == "concentrated":
        return scores.to(torch.float64)
    if policy.alloc == "diffuse":
        return -scores.to(torch.float64)
    if policy.alloc == "late":
        return -torch.arange(n_layers, dtype=torch.float64)[None, :, None].expand(b, n_layers, h).clone()
    import hashlib

    keys = [[int.from_bytes(hashlib.sha256(f"{li}:{hi}".encode()).digest()[:8], "big") / 2.0 ** 64 for hi in range(h)]
            for li in range(n_layers)]
    return torch.tensor(keys, dtype=torch.float64)[None].expand(b, n_layers, h).clone()


def allocate(policy: Policy, scores: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """``[B, L, H]`` bool, True where the pair gets the low bits (a selective selection: is sparse): per
    sequence, the ``count`` (default ``policy.low_count(L·H)``) pairs with the smallest
    :func:`allocation_keys` (ties to the lower flat index ``layer·H + head``)."""
    keys = allocation_keys(policy, scores)
    b, n_layers, h = keys.shape
    count = policy.low_count(n_layers * h) if count is None else count
    order = torch.sort(keys.reshape(b, -1), dim=-1, stable=True).indices[:, :count]
    low = torch.zeros(b, n_layers * h, dtype=torch.bool)
    low.scatter_(1, order, True)
    return low.reshape(b, n_layers, h)


class Observed:
    """What :func:`observe_concentration` saw: per layer the summed effective support and the rows
    it is summed over (one pass over a sequence may come in several forward calls: a prefill, then
    chunks through a cache), and ``record_layer``'s queries (per call) and keys (the last call's:
    every key) of batch row 0."""

    def __init__(self):
        self.sums: dict = {}
        self.rows: dict = {}
        self.received: dict = {}  # per layer [B, H_kv, n] float64: each key's accumulated attention
        self.q: list = []
        self.k = None

    def scores(self, n_layers: int) -> torch.Tensor:
        """``[B, n_layers, H_kv]`` float64: each layer's mean effective support over everything seen."""
        missing = [i for i in range(n_layers) if i not in self.sums]
        if missing:
            raise RuntimeError(f"layers {missing[:4]}: no attention call was observed")
        return torch.stack([self.sums[i].cpu() / self.rows[i] for i in range(n_layers)], dim=1)

    def accumulated(self, n_layers: int) -> list[torch.Tensor]:
        """Per layer ``[B, H_kv, n]`` float64: the attention each key received over everything seen
        (:func:`accumulated_attention` summed over the pass's calls), when observed with ``received``."""
        missing = [i for i in range(n_layers) if i not in self.received]
        if missing:
            raise RuntimeError(f"layers {missing[:4]}: no accumulated attention was observed")
        return [self.received[i].cpu() for i in range(n_layers)]


@contextlib.contextmanager
def observe_concentration(model, record_layer: int | None = None, *, concentration_too: bool = True,
                          received: bool = False):
    """Inside :func:`policy_attention`: every attention call's :func:`concentration` is summed
    into the yielded :class:`Observed` (unless ``concentration_too`` is False) and, with ``received``,
    its :func:`accumulated_attention` (the heavy-hitter oracle's whole-segment score)."""
    seen = Observed()

    def observe(layer_idx, query, key, scale):
        t0 = time.perf_counter()
        if concentration_too:
            total = concentration(query, key, scale, total=True)
            seen.sums[layer_idx] = seen.sums.get(layer_idx, 0) + total
            seen.rows[layer_idx] = seen.rows.get(layer_idx, 0) + query.shape[1] * query.shape[2] // key.shape[1]
        if received:
            got = accumulated_attention(query, key, scale)
            old = seen.received.get(layer_idx)
            if old is not None and old.shape[-1] > got.shape[-1]:
                raise RuntimeError(f"layer {layer_idx}: attention over {got.shape[-1]} keys after {old.shape[-1]}: "
                                   "the whole segment's accumulated attention needs every key kept (no sliding window)")
            if old is not None:  # the keys of earlier calls are the first ones of this call's
                got[..., :old.shape[-1]] += old
            seen.received[layer_idx] = got
        if layer_idx == record_layer:
            seen.q.append(query[0].detach().float().clone())
            seen.k = key[0].detach().float().clone()
        OBSERVE_SECONDS[0] += time.perf_counter() - t0

    if OBSERVER[0] is not None:
        raise RuntimeError("observe_concentration blocks do not nest")
    OBSERVER[0] = observe
    try:
        yield seen
    finally:
        OBSERVER[0] = None


def choose_sink(scores: torch.Tensor, sink: int) -> torch.Tensor:
    """``[..., min(sink, C)]`` int64: the indices of the ``sink`` largest scores along the last axis,
    ties to the lower index, in ascending order."""
    order = torch.sort(-scores, dim=-1, stable=True).indices[..., :sink]
    return order.sort(dim=-1).values
