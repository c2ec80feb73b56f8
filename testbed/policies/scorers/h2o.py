"""``h2o``: keep the heavy hitters, the tokens with the most accumulated attention (Zhang et al., 2023,
"H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models").

The score of every held token: the attention it has received, summed over every query so far (the
prefill's and each decode token's, causal) and over the KV head's query heads, in float64 and kept
as float32. Pure eviction: a dropped token's score is gone with it. Online it decides at every
token; at the prefill it cuts the prefill once by the prefill's accumulated attention.
"""

from __future__ import annotations

import torch

from .base import Scorer, register


@register
class H2O(Scorer):
    NAME = "h2o"
    ATTENTION = True
    QUERIES = 0

    def attention_score(self, query, keys, scale, previous, received):
        return (previous.to(torch.float64) + received).to(torch.float32)
