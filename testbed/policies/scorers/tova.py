"""``tova``: keep the tokens the newest query attends (Oren et al., 2024, "Transformers are Multi-State
RNNs": Token Omission Via Attention).

The score of every held token: the newest query's attention to it (a causal softmax, float32),
averaged over every query head of the layer, the same for each KV head (kvpress's ``TOVAPress``);
the newest token itself scores above all (the head's largest score plus one; kvpress keeps it the
same way). At the
prefill the newest query is the prefill's last; online, each new token's, and the lowest-scored held
token is dropped once more than ``keep`` are held.
"""

from __future__ import annotations

import torch

from ..causal import last_queries_attention
from .base import Scorer, register


@register
class TOVA(Scorer):
    NAME = "tova"
    ATTENTION = True
    QUERIES = 1
    KEPT_FIRST = (0, 1)  # the newest token

    def attention_score(self, query, keys, scale, previous, received):
        b, h, n, _ = keys.shape
        p = last_queries_attention(query[:, :, -1:], keys, scale)[:, :, :, 0, : n - 1]  # [B, H, g, n - 1]
        s = p.mean(dim=(1, 2))[:, None].expand(b, h, n - 1)  # every query head of the layer
        top = s.amax(dim=-1, keepdim=True) + 1  # per head: above every other token of that head
        return torch.cat([s, top], dim=-1).to(torch.float32)
