"""``random``: a seeded, content-blind control for the scorers.

Each token's score is a hash of (seed, layer, KV head, position): SplitMix64 (Steele et al., 2014)
over ``seed * 2**40 + layer * 2**32 + head * 2**24 + position`` (all below 2**24, the seed below
2**24), its top 24 bits as a float32 in [0, 1). The same token gets the same score in every
sequence, batch row and call, so a prefill-time and an online decision agree, and the audit
re-derives every score from the positions alone.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import Scorer, register

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 ``x`` (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return z ^ (z >> np.uint64(31))


@register
class RandomScore(Scorer):
    NAME = "random"

    def score(self, keys: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
        b, h, t, _ = keys.shape
        pos = positions.cpu().numpy().astype(np.uint64)
        heads = np.arange(h, dtype=np.uint64)[:, None]
        x = (np.uint64(self.seed) << np.uint64(40)) + (np.uint64(layer) << np.uint64(32)) \
            + (heads << np.uint64(24)) + pos[None, :]
        u = (splitmix64(x) >> np.uint64(40)).astype(np.float32) / np.float32(2 ** 24)
        return torch.from_numpy(u).to(keys.device).expand(b, h, t).contiguous()
