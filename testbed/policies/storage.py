"""The stored buffers of a policy layer's packed middle.

:class:`GrowBuffer` (one stored array, grown by appended parts), :class:`PackedSpan` (the quantized
middle of K or V: one buffer per stored array, appended group by group; a codec middle's one payload
per group, :mod:`testbed.policies.codec`) and :class:`MixedMiddle` (a mixed policy's middle: two
packed spans per tensor, one per bit width).
"""

from __future__ import annotations

import torch

from ..quant import Packed
from ..quant.base import make_header
from .codec import grouped, ungrouped
from .policy import Policy

__all__ = ["GrowBuffer", "PackedSpan", "MixedMiddle"]


class GrowBuffer:
    """A stored array that grows along dim -2 by appended parts (one per flush), held as one tensor.

    An append copies what is held and the new part into one tensor (the old one is freed), so the
    object holds exactly the accounted bytes (no spare capacity) and a read is the tensor itself:
    a decode step reads its packed history without copying it; the copy is paid once per flush
    (every G tokens), not on every read (before: one concatenation per read and layer)."""

    def __init__(self, dim: int = -2):
        self.data: torch.Tensor | None = None
        self.dim = dim  # the axis parts are appended along

    @property
    def rows(self) -> int:
        return 0 if self.data is None else self.data.shape[self.dim]

    def append(self, x: torch.Tensor) -> None:
        x = x.contiguous()
        self.data = x if self.data is None else torch.cat([self.data, x], dim=self.dim)

    def view(self) -> torch.Tensor | None:
        return self.data

    def used_bytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()


class PackedSpan:
    """The quantized middle of K or V: one buffer per stored array, appended group by group.

    ``group`` set (a codec middle): each group of that many tokens is its own payload
    (``[..., m, D]`` quantized as ``[..., m / G, G, D]``) and every array grows along the groups'
    axis, the one after the leading ``[B, H]``; else the payload spans the appended tokens and its
    arrays grow along dim -2 (the built-in layouts, whose groups are whole within any flush)."""

    def __init__(self, quantizer, label: str, group: int | None = None):
        self.q = quantizer
        self.label = label
        self.group = group
        self.buffers: dict[str, GrowBuffer] = {}
        self.tokens = 0
        self.shape_lead: tuple = ()
        self.dim = 0
        self.dtype = torch.float32

    def append(self, x: torch.Tensor) -> None:
        x = x.contiguous()
        lead = x.shape[:-2]
        p = self.q.quantize(grouped(x, self.group) if self.group else x, name=self.label)
        self.shape_lead, self.dim, self.dtype = tuple(lead), x.shape[-1], x.dtype
        axis = len(lead) if self.group else -2
        for name, t in p.tensors.items():
            if name == "header":
                continue
            self.buffers.setdefault(name, GrowBuffer(axis)).append(t)
        self.tokens += x.shape[-2]

    def packed(self, tokens: int | None = None) -> Packed:
        """The stored arrays as a `Packed` (of the first ``tokens`` packed tokens: buffers only grow);
        a codec middle's of shape ``[..., tokens / G, G, D]``."""
        n = self.tokens if tokens is None else tokens
        if self.group:
            if n % self.group:
                raise ValueError(f"a codec middle holds whole groups of {self.group} tokens, not {n}")
            axis = len(self.shape_lead)
            tensors = {name: buf.view().narrow(axis, 0, n // self.group).contiguous() for name, buf in self.buffers.items()}
            tensors["header"] = make_header(self.group, self.dim, next(iter(tensors.values())).device)
            return Packed(self.q.name, (*self.shape_lead, n // self.group, self.group, self.dim), self.dtype, tensors,
                          self.q.config())
        tensors = {name: buf.view()[..., :buf.rows * n // self.tokens, :].contiguous()
                   for name, buf in self.buffers.items()}
        tensors["header"] = make_header(n, self.dim, next(iter(tensors.values())).device)
        return Packed(self.q.name, (*self.shape_lead, n, self.dim), self.dtype, tensors, self.q.config())

    def arrays(self) -> dict[str, torch.Tensor]:
        """The stored arrays themselves (every packed token; no copy), for readers that take a
        token count (:func:`testbed.policies.packed_attention.packed_part`)."""
        return {name: buf.view() for name, buf in self.buffers.items()}

    def decode(self) -> torch.Tensor:
        y = self.q.dequantize(self.packed())
        return ungrouped(y) if self.group else y

    def used_bytes(self) -> int:
        return sum(b.used_bytes() for b in self.buffers.values())


class MixedMiddle:
    """A mixed policy's middle of K and V in one layer: two packed spans per tensor, one per bit
    width, over the flattened (sequence, KV head) rows that have it (``low [B, H]`` bool)."""

    def __init__(self, policy: Policy, low: torch.Tensor):
        self.low = low
        self.bits = torch.where(low, int(policy.low[3:]), int(policy.middle[3:])).to(torch.uint8)
        hq, lq = policy.quantizers(), policy.low_quantizers()
        self.spans = {"high": (PackedSpan(hq[0], "k"), PackedSpan(hq[1], "v")),
                      "low": (PackedSpan(lq[0], "k"), PackedSpan(lq[1], "v"))}
        self.masks = {"high": ~low, "low": low}
        self.tokens = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        for which, (sk, sv) in self.spans.items():
            m = self.masks[which]
            if m.any():
                sk.append(k[m])
                sv.append(v[m])
        self.tokens += k.shape[-2]

    def decode(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, H, tokens, D]`` decoded from both spans (``like``: dtype and device)."""
        b, h, _, d = like.shape
        out_k = torch.empty(b, h, self.tokens, d, dtype=torch.float32, device=like.device)
        out_v = torch.empty_like(out_k)
        for which, (sk, sv) in self.spans.items():
            m = self.masks[which]
            if m.any():
                out_k[m] = sk.decode()
                out_v[m] = sv.decode()
        return out_k, out_v

    def used_bytes(self) -> int:
        """The packed spans' bytes and one byte of bits per (sequence, KV head) row."""
        return (sum(sk.used_bytes() + sv.used_bytes() for sk, sv in self.spans.values())
                + self.bits.numel() * self.bits.element_size())

    def evidence(self) -> dict[str, torch.Tensor]:
        """Batch row 0's stored arrays, ``{scheme}.key.*`` / ``{scheme}.value.*`` over its heads of
        that bit width (in head order), and ``alloc.bits [H]``."""
        out = {"alloc.bits": self.bits[0]}
        for which, (sk, sv) in self.spans.items():
            m = self.masks[which]
            n0 = int(m[0].sum())
            if not n0 or not sk.tokens:
                continue
            scheme = f"int{sk.q.bits}"
            for label, span in (("key", sk), ("value", sv)):
                for name, buf in span.buffers.items():
                    out[f"{scheme}.{label}.{name}"] = buf.view()[:n0]
        return out
