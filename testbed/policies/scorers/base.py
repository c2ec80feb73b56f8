"""The interface every token scorer implements, its registry and the kept-set rule
(:func:`keep_top`): the leaf that the scorer modules and :mod:`testbed.policies.scorers` import."""

from __future__ import annotations

import re
from typing import ClassVar

import torch

__all__ = ["Scorer", "SCORERS", "register", "keep_top", "keep_blocks", "keep_adaptive", "MODES", "USER_SCORER"]

# when a scorer decides: once, on the prefill (kvpress's compression), or at every token as it arrives
MODES = ("prefill", "online")
SCORERS: dict[str, type] = {}
USER_SCORER = re.compile(r"^[^:]+\.py:[A-Za-z_][A-Za-z0-9_]*$")


class Scorer:
    """The interface of a token scorer. ``MODES``: the modes of :data:`MODES` it supports.

    A scorer of the token alone (``ATTENTION = False``): ``score(keys, positions, layer)``: ``keys
    [B, H, T, D]`` float32 post-RoPE keys of ``T`` tokens at ``positions [T]`` (int64, their index in
    the sequence), of layer ``layer``; returns ``[B, H, T]`` float32, larger kept first.

    A scorer of attention (``ATTENTION = True``): ``attention_score(query, keys, scale, previous,
    received)`` after each attention call it decides on: ``query [B, H_q, q, D]`` the call's last
    ``QUERIES`` queries (all of them when ``QUERIES`` is 0), ``keys [B, H, n, D]`` every key they
    attended (held ones first, the call's own last), ``previous [B, H, n]`` float32 the held keys'
    stored scores (0 for the call's own), ``received [B, H, n]`` float64 the attention each key
    received over all of the call's queries and the KV head's query heads (``RECEIVED = False``: not
    read, None); with ``VALUES = True`` also ``values=`` ``[B, H, n, D]`` the keys' values; returns
    ``[B, H, n]`` float32. ``ROPE = True``: the scorer reads the layer's rotary embedding, handed by
    :meth:`bind_rope` (a :class:`~testbed.policies.rope.Rotary`) when the cache is built for a model.

    ``KEPT_FIRST = (first, last)``: the prefill's first and last tokens the scorer always keeps (it
    scores them above every other token of their head: snapkv's observation window, tova's newest
    token, expected_attention's sink). kvpress scores them above every token of the layer, so an
    adaptive selection (Ada-KV), whose heads compete, ranks them above every score as kvpress does."""

    NAME: ClassVar[str] = ""
    MODES: ClassVar[tuple[str, ...]] = MODES
    ATTENTION: ClassVar[bool] = False
    QUERIES: ClassVar[int] = 0
    RECEIVED: ClassVar[bool] = True
    VALUES: ClassVar[bool] = False
    ROPE: ClassVar[bool] = False
    KEPT_FIRST: ClassVar[tuple[int, int]] = (0, 0)

    def __init__(self, seed: int = 0):
        self.seed = seed

    def score(self, keys: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


def register(cls: type) -> type:
    """Register a built-in scorer class under its ``NAME``."""
    if not cls.NAME or cls.NAME in SCORERS:
        raise ValueError(f"scorer {cls.__name__}: NAME {cls.NAME!r} is empty or taken")
    SCORERS[cls.NAME] = cls
    return cls


def keep_top(score: torch.Tensor, keep: int) -> torch.Tensor:
    """Positions along the last axis of the ``keep`` largest scores, ties to the earlier position,
    in ascending order (the tokens must lie along that axis in the order they arrived)."""
    if score.shape[-1] <= keep:
        return torch.arange(score.shape[-1], device=score.device).expand(score.shape)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :keep]
    return torch.sort(order, dim=-1).values  # ascending position = ascending index


def keep_blocks(score: torch.Tensor, keep: int, block: int) -> torch.Tensor:
    """Positions along the last axis of the ``keep / block`` blocks of ``block`` consecutive tokens
    (from position 0) of largest summed score (summed in float64; ties to the earlier block), in
    ascending order; every position when there are ``keep`` or fewer. The axis must hold whole blocks."""
    *lead, n = score.shape
    if n % block:
        raise ValueError(f"a block selection cuts whole blocks of {block} tokens; the prefill has {n}")
    if n <= keep:
        return torch.arange(n, device=score.device).expand(score.shape)
    sums = score.to(torch.float64).reshape(*lead, n // block, block).sum(dim=-1)
    top = keep_top(sums, keep // block)
    return (top[..., None] * block + torch.arange(block, device=score.device)).flatten(-2)


def keep_adaptive(rank: torch.Tensor, keep: int, safeguard: int) -> torch.Tensor:
    """Ada-KV's kept set of one layer (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by
    Adaptive Budget Allocation"; kvpress 0.5.5's ``AdaKVPress``): ``rank [B, H, n]`` the tokens'
    scores per KV head (``+inf`` for a token always kept); returns ``[B, H, n]`` bool, ``keep x H``
    tokens per sequence: each head's own top ``safeguard`` (ties to the older token), then the
    layer's top scores over every head's remaining tokens (ties to the older token, then to the
    lower head), so a head whose scores are concentrated leaves tokens to a diffuse one. Every
    token when a head holds ``keep`` or fewer."""
    b, h, n = rank.shape
    if n <= keep:
        return torch.ones(b, h, n, dtype=torch.bool, device=rank.device)
    kept = torch.zeros(b, h, n, dtype=torch.bool, device=rank.device)
    if safeguard:
        kept.scatter_(-1, keep_top(rank, safeguard), True)
    rest = rank.masked_fill(kept, float("-inf"))  # the safeguard is kept already; no score is -inf (finite)
    flat = rest.transpose(1, 2).reshape(b, n * h)  # token-major: a tie goes to the older token, then the lower head
    top = torch.sort(flat, dim=-1, descending=True, stable=True).indices[:, : h * (keep - safeguard)]
    chosen = torch.zeros(b, n * h, dtype=torch.bool, device=rank.device)
    chosen.scatter_(-1, top, True)
    return kept | chosen.reshape(b, n, h).transpose(1, 2)
