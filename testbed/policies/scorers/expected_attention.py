"""``expected_attention``: keep the tokens future queries are expected to attend (Devoto et al.,
2025, "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution"; kvpress's ``ExpectedAttentionPress``).

At the prefill, the queries of each query head before RoPE (positions ``SINK`` onwards; the first
``SINK`` (4) are left out as outliers) are summarized by their mean ``mu`` and covariance ``S``
(divided by their count). Future queries are modelled at the next ``FUTURE`` (512) positions by
the mean RoPE rotation ``R`` over them: mean ``R mu``, covariance ``R S R^T``. For a Gaussian
query, the expected un-normalized attention to a key ``k`` is ``exp(s k.(R mu) + s^2/2 k^T R S R^T
k)`` (``s`` the model's attention scale; kvpress writes 1/sqrt(D), the same for Llama-style
layers). That logit is softmaxed over the keys after the sink, averaged over the KV head's query
heads and multiplied by each token's value norm. The sink tokens score above every other token
(the head's largest score plus one; kvpress adds one to the largest of the whole tensor, which
ranks every head's tokens the same way). kvpress's defaults: ``n_sink`` 4, ``n_future_positions``
512, covariance and value norms used, ``epsilon`` 0.

The queries the attention call reports are post-RoPE; they are rotated back with the layer's own
RoPE (:mod:`testbed.policies.rope`, read from the model's config by
:meth:`~testbed.policies.cache.PolicyCache.for_model`), which is exact up to float32 rounding since
each rotation is orthogonal. The score reads every prefill query and the values, so it decides at
the prefill only (a prefill of ``SINK`` tokens or fewer is refused).
"""

from __future__ import annotations

import torch

from .base import Scorer, register


@register
class ExpectedAttention(Scorer):
    NAME = "expected_attention"
    MODES = ("prefill",)
    ATTENTION = True
    QUERIES = 0  # every prefill query
    RECEIVED = False  # reads the queries themselves, not the accumulated attention
    VALUES = True
    ROPE = True
    SINK = 4
    KEPT_FIRST = (SINK, 0)  # the sink, left out of the query statistics
    FUTURE = 512

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.rope = None

    def bind_rope(self, rope) -> None:
        """The layer's :class:`~testbed.policies.rope.Rotary`."""
        self.rope = rope

    def attention_score(self, query, keys, scale, previous, received, values=None):
        if self.rope is None:
            raise ValueError("expected_attention rotates the queries back with the layer's RoPE: build the cache "
                             "with PolicyCache.for_model(policy, model.config)")
        if values is None:
            raise ValueError("expected_attention weighs each token by its value norm: the values are needed")
        b, hq, t, d = query.shape
        _, h, n, _ = keys.shape
        if n != t or n <= self.SINK:
            raise ValueError(f"expected_attention decides on a whole prefill of more than {self.SINK} tokens: got "
                             f"{t} queries over {n} keys")
        if d != self.rope.head_dim:
            raise ValueError(f"expected_attention: head dim {d}, the rotary embedding's {self.rope.head_dim}")
        g = hq // h
        pre = self.rope.unrotate(query, torch.arange(n))[:, :, self.SINK:]  # [B, H_q, t - SINK, D] float64
        mu = pre.mean(dim=2)
        centred = pre - mu[:, :, None]
        cov = torch.einsum("bhti,bhtj->bhij", centred, centred) / pre.shape[2]
        rot = self.rope.mean_rotation(torch.arange(n, n + self.FUTURE))
        mu = mu @ rot.T
        cov = rot @ cov @ rot.T
        k = keys[:, :, self.SINK:].to(torch.float64).repeat_interleave(g, dim=1)  # [B, H_q, n - SINK, D]
        logit = scale * torch.einsum("bhkd,bhd->bhk", k, mu)
        logit = logit + 0.5 * scale * scale * torch.einsum("bhkd,bhde,bhke->bhk", k, cov, k)
        p = torch.softmax(logit, dim=-1).reshape(b, h, g, n - self.SINK).mean(dim=2)
        s = p * values[:, :, self.SINK:].to(torch.float64).norm(dim=-1)
        top = s.amax(dim=-1, keepdim=True) + 1
        return torch.cat([top.expand(b, h, self.SINK), s], dim=-1).to(torch.float32)
