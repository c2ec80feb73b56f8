"""The rotary position embedding (RoPE) of a model's layers, read from its transformers config.

A scorer that models *future* queries (``expected_attention``) needs the queries before RoPE and
the rotation of positions not seen yet. The attention call only sees post-RoPE queries; since each
RoPE rotation is orthogonal (scaled by the rope type's ``attention_scaling``), the pre-RoPE query
is recovered exactly (up to float rounding) by rotating back with the same angles. :func:`rotary`
gives those angles for one layer kind from the config alone, the way the model's own rotary
embedding computes them (``inv_freq`` from ``rope_parameters``: the default schedule, or one of
transformers' rope types), so that no module of the model is needed.

Refused (``ValueError``): a partial rotary embedding (``partial_rotary_factor`` < 1: only part of
each head is rotated, which this module does not model) and a rope type that changes with the
sequence length (``dynamic``), whose angles at a future position are not known at the prefill.

A layer that stores pre-RoPE keys (``Policy.key_rope == "pre"``) un-rotates and rotates them with the
very ``(cos, sin)`` the model called its attention module with: :func:`rope_unrotate`, :func:`rope_rotate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Rotary", "rotary", "rotate_half", "rope_rotate", "rope_unrotate"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split along the last axis: the 90° turn RoPE adds ``sin`` times."""
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def rope_rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``k [B, H, t, D]`` rotated by the rotary embedding ``cos``, ``sin`` ``[B, t, D]`` as
    transformers' ``apply_rotary_pos_emb`` rotates it (``k cos + rotate_half(k) sin``), in float32."""
    c, s = cos.to(torch.float32)[:, None], sin.to(torch.float32)[:, None]
    return k * c + rotate_half(k) * s


def rope_unrotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rope_rotate` with the same ``cos``, ``sin``: each channel pair (i, i + D/2)
    was multiplied by ``[[c, -s], [s, c]]``, whose inverse is ``[[c, s], [-s, c]] / (c² + s²)``
    (c² + s² is 1 for RoPE up to rounding, a rope type's attention scaling squared otherwise), so the
    pre-RoPE key comes back exactly up to float32 rounding."""
    c, s = cos.to(torch.float32)[:, None], sin.to(torch.float32)[:, None]
    return (k * c - rotate_half(k) * s) / (c * c + s * s)



@dataclass(frozen=True)
class Rotary:
    """One layer kind's RoPE: ``inv_freq [D/2]`` float32 and the ``scaling`` its cos and sin carry.
    The angles are float32 products, as the model's rotary embedding forms them, so that
    :meth:`unrotate` undoes the rotation the model applied (not a float64 ideal of it)."""

    inv_freq: torch.Tensor
    scaling: float

    @property
    def head_dim(self) -> int:
        return 2 * int(self.inv_freq.shape[0])

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[T, D]`` of ``positions [T]``, without the scaling, computed as the model's
        rotary embedding computes them (float32 angles, repeated over both halves), returned float64."""
        ang = positions.to(torch.float32)[:, None] * self.inv_freq.to(torch.float32)[None, :]
        ang = torch.cat([ang, ang], dim=-1)
        return ang.cos().to(torch.float64), ang.sin().to(torch.float64)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [..., T, D]`` post-RoPE at ``positions [T]`` back to before RoPE, float64."""
        cos, sin = self.cos_sin(positions)
        x = x.to(torch.float64)
        return (x * cos - rotate_half(x) * sin) / self.scaling

    def mean_rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """``[D, D]`` float64: the mean over ``positions`` of the matrix ``R`` with ``R q`` = RoPE of
        ``q`` at that position (scaling included)."""
        cos, sin = self.cos_sin(positions)
        d = self.head_dim
        turn = torch.zeros(d, d, dtype=torch.float64)  # turn @ x == rotate_half(x)
        turn[: d // 2, d // 2:] = -torch.eye(d // 2, dtype=torch.float64)
        turn[d // 2:, : d // 2] = torch.eye(d // 2, dtype=torch.float64)
        c, s = cos.mean(dim=0), sin.mean(dim=0)
        return self.scaling * (torch.diag(c) + s[:, None] * turn)


def rotary(config, layer_type: str = "full_attention") -> Rotary:
    """The RoPE of ``config``'s layers of kind ``layer_type`` (a per-kind ``rope_parameters`` dict,
    as Gemma-3's, is read at that kind)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(text, "rope_parameters", None)
    if not isinstance(params, dict):
        raise ValueError(f"{type(text).__name__}: no rope_parameters; the model's rotary embedding is not known")
    if layer_type in params and isinstance(params[layer_type], dict):
        params = params[layer_type]
    kind = params.get("rope_type", "default")
    partial = params.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0)) or 1.0
    if float(partial) != 1.0:
        raise ValueError(f"{type(text).__name__}: partial_rotary_factor {partial}: a partial rotary embedding is not served")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if kind == "default":
        theta = float(params["rope_theta"])
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
        return Rotary(inv, 1.0)
    if kind == "dynamic" or kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"{type(text).__name__}: rope type {kind!r}: its angles at future positions are not known "
                         "at the prefill" if kind == "dynamic" else f"rope type {kind!r} is not known to transformers")
    inv, scaling = ROPE_INIT_FUNCTIONS[kind](text, "cpu", layer_type=layer_type if layer_type in
                                             (getattr(text, "layer_types", None) or ()) else None)
    if 2 * inv.shape[0] != head_dim:
        raise ValueError(f"{type(text).__name__}: rope over {2 * inv.shape[0]} of {head_dim} features is not served")
    return Rotary(inv.to(torch.float32), float(scaling))
