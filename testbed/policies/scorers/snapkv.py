"""``snapkv``: keep the tokens the prefill's last queries attend (Li et al., 2024, "SnapKV: LLM Knows
What You Are Looking for Before Generation").

The score of each prefill token before the observation window: the attention the window's ``WINDOW``
(64) last queries pay it (a causal softmax over every prefill key, float32), averaged over the window,
smoothed by an average pool of ``KERNEL`` (5) neighbours (zero-padded at the ends, the pad counted),
and averaged over the KV head's query heads. The window's own tokens score above every other token
(the head's largest score plus one; kvpress adds one to the largest of the whole tensor, which
ranks every head's tokens the same way), so they are kept first. kvpress's ``SnapKVPress`` defaults (window 64,
kernel 5). The score reads queries, so it decides at the prefill only (a prefill shorter than the
window plus one token is refused).

PyramidKV (Cai et al., 2024; kvpress's ``PyramidKVPress``) is this scorer with per-layer budgets:
the selection field ``"layers": "pyramid"`` (with ``"beta"``), which any prefill-mode scorer takes
(:func:`testbed.policies.policy.pyramid_keep`; docs/live.md, "Per-layer budgets"). It is a field,
not a scorer name of its own, so the schedule and the score stay separate choices; the pyramid's
arithmetic reads this scorer's ``WINDOW`` as kvpress reads its ``window_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..causal import last_queries_attention
from .base import Scorer, register


@register
class SnapKV(Scorer):
    NAME = "snapkv"
    MODES = ("prefill",)
    ATTENTION = True
    WINDOW = 64
    KERNEL = 5
    QUERIES = WINDOW
    KEPT_FIRST = (0, WINDOW)  # the observation window

    def attention_score(self, query, keys, scale, previous, received):
        b, h, n, _ = keys.shape
        w = self.WINDOW
        if n <= w or query.shape[2] < w:
            raise ValueError(f"snapkv observes the last {w} queries of a prefill longer than {w} tokens; got {n} "
                             f"keys and {query.shape[2]} queries")
        p = last_queries_attention(query[:, :, -w:], keys, scale)[..., : n - w]  # [B, H, g, w, n - w]
        s = p.mean(dim=3)  # over the window's queries
        g = s.shape[2]
        s = F.avg_pool1d(s.reshape(b * h * g, 1, n - w), self.KERNEL, stride=1, padding=self.KERNEL // 2)
        s = s.reshape(b, h, g, n - w).mean(dim=2)  # over the KV head's query heads
        top = s.amax(dim=-1, keepdim=True) + 1  # per head: above every other token of that head
        return torch.cat([s, top.expand(b, h, w)], dim=-1).to(torch.float32)
