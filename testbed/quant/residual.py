"""Residual window: the most recent R tokens (and optionally the first S) kept in float32.

The middle span ``[S, N - R)`` of K and V is quantized with the given key and value quantizers;
the first ``S`` tokens (``sink``) and the last ``R`` tokens (``recent``) stay float32, as in
KIVI's residual and in attention-sink-aware caches. Spans are cut with explicit indices, never
``x[-R:]`` (which for R = 0 is the whole tensor). ``S + R >= N`` keeps everything float32.

One header for the pair: the payload is the key and value quantizers' arrays (their own headers
dropped), the float32 windows and a single 16-byte (N, D) header, so for N=128, D=32, G=32, 4
bits and R = 0/16/64 the payload is 5,136 / 8,912 / 18,960 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from . import kernels
from .base import Packed, Quantizer, check_input, from_config, make_header

__all__ = ["ResidualWindow"]

# the order of a payload's arrays (as the original implementation wrote them)


@dataclass(frozen=True)
class ResidualWindow:
    """Pack K and V with the first ``sink`` and last ``recent`` tokens float32."""

    KIND: ClassVar[str] = "residual_window"
    name: ClassVar[str] = "residual_window"
    key: Quantizer
    value: Quantizer
    recent: int = 16
    sink: int = 0

    def __post_init__(self):
        for label, val in (("recent", self.recent), ("sink", self.sink)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"{label} must be a non-negative integer, got {val!r}")
        for label, q in (("key", self.key), ("value", self.value)):
            if not isinstance(q, Quantizer):
                raise ValueError(f"{label} must be a quantizer, got {type(q).__name__}")

    def config(self) -> dict:
        """Like a scheme's (`Quantizer.config`), with the two quantizers' configs nested."""
        return {"kind": self.KIND, "key": self.key.config(), "value": self.value.config(), "recent": self.recent,
                "sink": self.sink}

    @classmethod
    def from_config(cls, config: dict) -> "ResidualWindow":
        return cls(from_config(config["key"]), from_config(config["value"]), config["recent"], config["sink"])

    def spans(self, n: int) -> tuple[int, int]:
        """``(start, stop)`` of the quantized span for ``n`` tokens (empty when start >= stop)."""
        start = min(self.sink, n)
        stop = max(start, n - self.recent)
        return start, stop

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> Packed:
        check_input(k, "k", finite=False)
        check_input(v, "v", finite=False)
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        try:
            return self._pack(k, v)
        except ValueError:
            # a non-finite value: name it by its index in the whole tensor, not in a span
            check_input(k, "k")
            check_input(v, "v")
            raise

    def _pack(self, k: torch.Tensor, v: torch.Tensor) -> Packed:
        n, d = k.shape[-2], k.shape[-1]
        start, stop = self.spans(n)
        spans: dict[str, torch.Tensor] = {}
        windows = []
        if start > 0:
            windows += [("sink.k", k[..., :start, :]), ("sink.v", v[..., :start, :])]
        if stop > start:
            pk = self.key.quantize(k[..., start:stop, :], name="k")
            pv = self.value.quantize(v[..., start:stop, :], name="v")
            spans.update({f"key.{a}": t for a, t in pk.tensors.items() if a != "header"})
            spans.update({f"value.{a}": t for a, t in pv.tensors.items() if a != "header"})
        if stop < n:
            windows += [("recent.k", k[..., stop:, :]), ("recent.v", v[..., stop:, :])]
        checked = {}
        for name, w in windows:  # the float32 windows: small, checked here (the spans by their quantizers)
            w = w.detach().to(torch.float32).contiguous()
            if not bool(torch.isfinite(w).all()):
                raise ValueError(f"{name}: non-finite value in the float32 window")
            checked[name] = w
        # the order of the arrays: sink, the key's and the value's arrays in their quantizer's order, recent
        tensors = {**{a: checked[a] for a in ("sink.k", "sink.v") if a in checked}, **spans,
                   **{a: checked[a] for a in ("recent.k", "recent.v") if a in checked}}
        tensors["header"] = make_header(n, d, k.device)
        cfg = self.config()
        cfg["quantized_span"] = [start, stop]
        return Packed(self.name, tuple(k.shape), k.dtype, tensors, cfg)

    def unpack(self, p: Packed) -> tuple[torch.Tensor, torch.Tensor]:
        if p.scheme != self.name:
            raise ValueError(f"residual_window: cannot unpack a Packed of scheme {p.scheme!r}")
        *lead, n, d = p.shape
        start, stop = self.spans(n)
        device = p.tensors["header"].device
        out_k = kernels.empty_float32(p.shape, device)
        out_v = kernels.empty_float32(p.shape, device)
        if start > 0:
            out_k[..., :start, :] = p.tensors["sink.k"]
            out_v[..., :start, :] = p.tensors["sink.v"]
        if stop > start:
            span_shape = (*lead, stop - start, d)
            for label, q, out in (("key", self.key, out_k), ("value", self.value, out_v)):
                inner = {a[len(label) + 1:]: t for a, t in p.tensors.items() if a.startswith(label + ".")}
                inner["header"] = make_header(stop - start, d, device)
                packed = Packed(q.name, span_shape, torch.float32, inner, q.config())
                target = out[..., start:stop, :]
                if hasattr(q, "dequantize_into"):  # decode straight into the cache, no temporary
                    q.dequantize_into(packed, target)
                else:
                    target.copy_(q.dequantize(packed))
        if stop < n:
            out_k[..., stop:, :] = p.tensors["recent.k"]
            out_v[..., stop:, :] = p.tensors["recent.v"]
        return out_k.to(p.dtype), out_v.to(p.dtype)
