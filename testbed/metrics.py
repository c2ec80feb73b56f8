"""Metrics of attention outputs and attention probabilities.

Output error (relative L2, cosine, max-abs) follows the convention of the seed studies: one
number per input over the flattened output, ``||O' - O|| / ||O||``. Probability metrics are per
query row: total variation ``TV(P, P') = 1/2 sum |P - P'|``, argmax agreement, region mass (the
probability a row puts on a span of keys) and the numerical-zero rate (keys with ``p > 0`` in
the reference that are exactly 0 after quantization).
"""

from __future__ import annotations

import torch

__all__ = ["rel_l2", "cosine", "max_abs", "total_variation", "argmax_agreement", "region_mass", "numerical_zero_rate"]


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float64)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref||_2 / ||ref||_2`` over all elements (0 when both are zero)."""
    x, ref = _f64(x), _f64(ref)
    den = torch.linalg.vector_norm(ref)
    num = torch.linalg.vector_norm(x - ref)
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / den)


def cosine(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors (1 when both are zero)."""
    x, ref = _f64(x).flatten(), _f64(ref).flatten()
    den = torch.linalg.vector_norm(x) * torch.linalg.vector_norm(ref)
    if den == 0:
        return 1.0 if torch.equal(x, ref) else 0.0
    return float(torch.dot(x, ref) / den)


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((_f64(x) - _f64(ref)).abs().max())


def total_variation(p: torch.Tensor, p_ref: torch.Tensor) -> torch.Tensor:
    """Per-row TV over the last axis."""
    return 0.5 * (_f64(p) - _f64(p_ref)).abs().sum(dim=-1)


def argmax_agreement(p: torch.Tensor, p_ref: torch.Tensor) -> torch.Tensor:
    """Per-row boolean: the largest key is the same (first index on ties)."""
    return p.argmax(dim=-1) == p_ref.argmax(dim=-1)


def region_mass(p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Per-row probability mass on keys ``[start, stop)``."""
    return _f64(p)[..., start:stop].sum(dim=-1)


def numerical_zero_rate(p_hat: torch.Tensor, p_ref: torch.Tensor) -> torch.Tensor:
    """Per-row share of reference-positive keys that are exactly zero after quantization."""
    pos = p_ref > 0
    zeros = pos & (p_hat == 0)
    return zeros.sum(dim=-1).to(torch.float64) / pos.sum(dim=-1).clamp(min=1).to(torch.float64)
