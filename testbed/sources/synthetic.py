"""Synthetic attention with controlled structure.

From one seeded base array per (seed, N) -- ``q [H, Tq, D]``, ``k, v [H_kv, N, D]``, standard
normal float32 -- three distributions that differ only in the first channel of Q and K:

- ``clean``: the base array untouched;
- ``early_focus``: channel 0 of every query is set to ``a`` and channel 0 of the earliest
  ``focus_tokens`` keys to ``a``, with ``a = sqrt(focus_logit * sqrt(D))``, so those keys gain
  ``focus_logit`` in their scaled logit;
- ``recent_focus``: the same for the most recent ``focus_tokens`` keys.

The other channels keep their random differences, so the attention is focused, not one-hot.
This mirrors the early-/recent-focus design of the residual-window study (docs/studies.md). The
queries are decode-style: every query sees the whole cache (``causal=False``, position N-1).
The layout is ``sink (first focus_tokens) | middle | recent (last focus_tokens)``.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from ..case import Case, Region
from ..resources import synthetic_estimate_bytes as estimate_bytes  # noqa: F401 (the source's memory hook)
from ..schema import Key, Spec

__all__ = ["DISTRIBUTIONS", "base_arrays", "make_case", "validate", "cases", "SPEC"]

DISTRIBUTIONS = ("clean", "early_focus", "recent_focus")


def base_arrays(seed: int, n: int, head_dim: int, queries: int, heads: int = 1, kv_heads: int = 1):
    """The seeded base ``(q, k, v)``; identical for every distribution of the same (seed, n)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + n)
    q = torch.randn(heads, queries, head_dim, generator=g, dtype=torch.float32)
    k = torch.randn(kv_heads, n, head_dim, generator=g, dtype=torch.float32)
    v = torch.randn(kv_heads, n, head_dim, generator=g, dtype=torch.float32)
    return q, k, v


def make_case(distribution: str, seed: int, n: int, head_dim: int = 32, queries: int = 8, heads: int = 1,
              kv_heads: int = 1, focus_tokens: int = 16, focus_logit: float = 4.0) -> Case:
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    if not 0 < 2 * focus_tokens <= n:
        raise ValueError(f"focus_tokens={focus_tokens} needs 2*focus_tokens <= n={n}")
    q, k, v = base_arrays(seed, n, head_dim, queries, heads, kv_heads)
    a = math.sqrt(focus_logit * math.sqrt(head_dim))
    focus = None
    if distribution == "early_focus":
        focus = (0, focus_tokens)
    elif distribution == "recent_focus":
        focus = (n - focus_tokens, n)
    if focus is not None:
        q[..., 0] = a
        k[:, focus[0]:focus[1], 0] = a
    layout = (Region("sink", 0, focus_tokens), Region("middle", focus_tokens, n - focus_tokens),
              Region("recent", n - focus_tokens, n))
    return Case(
        id=f"{distribution}-s{seed}-n{n}",
        q=q, k=k, v=v,
        query_positions=torch.full((queries,), n - 1, dtype=torch.int64),
        causal=False,
        layout=layout,
        meta={"source": "synthetic", "distribution": distribution, "seed": seed, "n": n, "head_dim": head_dim,
              "focus_tokens": focus_tokens, "focus_logit": focus_logit,
              "focus_span": list(focus) if focus else None},
    )


SPEC = Spec("source: synthetic", "Seeded standard-normal Q, K, V with controlled focus (testbed/sources/synthetic.py); "
            "one Case per seed x length x distribution, decode-style queries that see the whole cache.", {
    "kind": Key(("choice", ("synthetic",)), "the source kind"),
    "seeds": Key(("list", ("range", int, 0, (1 << 31) - 1), 1), "generator seeds (one base array per seed and length)"),
    "lengths": Key(("list", ("range", int, 2, 1 << 20), 1), "cache lengths N (keys per Case)"),
    "distributions": Key(("list", ("choice", DISTRIBUTIONS), 1),
                         "clean: the base array; early_focus / recent_focus: the first / last focus_tokens keys "
                         "gain focus_logit in every query's scaled logit"),
    "head_dim": Key(("range", int, 1, 4096), "head dimension D", 32),
    "queries": Key(("range", int, 1, 1 << 16), "queries per head (all at position N - 1)", 8),
    "heads": Key(("range", int, 1, 256), "query heads H", 1),
    "kv_heads": Key(("range", int, 1, 256), "KV heads H_kv (consecutive query heads share one)", 1),
    "focus_tokens": Key(("range", int, 1, 1 << 16), "size of the focused span, and of the sink and recent regions "
                                                    "of the layout", 16),
    "focus_logit": Key(("range", float, 0.0, 100.0), "logit added to the focused keys", 4.0),
}, rules=("2 * focus_tokens <= every length (checked when the Case is built)",))


def validate(params: dict, where: str) -> dict:
    return SPEC.check(params, where)


UNIT = "case"  # what one unit of this source is, in progress lines


def units(params: dict) -> list[dict]:
    """One unit per case, in the order `cases` makes them: the parameters with one seed, length and
    distribution each (what a Ray task runs)."""
    return [{**params, "seeds": [seed], "lengths": [n], "distributions": [dist]}
            for seed in params["seeds"] for n in params["lengths"] for dist in params["distributions"]]


def cases(params: dict, ctx=None) -> Iterator[Case]:
    for seed in params["seeds"]:
        for n in params["lengths"]:
            for dist in params["distributions"]:
                yield make_case(dist, seed, n, params["head_dim"], params["queries"], params["heads"],
                                params["kv_heads"], params["focus_tokens"], params["focus_logit"])
