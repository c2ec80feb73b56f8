"""``knorm``: keep the keys of smallest L2 norm (score: the negative norm).

Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression":
keys of low norm draw high attention, so dropping the largest-norm keys loses little. The score
ignores queries, so it decides at the prefill (kvpress's ``KnormPress``) or as each token arrives.
The norm is taken in float64 over the post-RoPE key and rounded to float32 (the audit does the same).
"""

from __future__ import annotations

import torch

from .base import Scorer, register


@register
class KNorm(Scorer):
    NAME = "knorm"

    def score(self, keys: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
        return (-torch.linalg.vector_norm(keys.to(torch.float64), dim=-1)).to(torch.float32)
