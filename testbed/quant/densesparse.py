"""Dense-and-sparse grouped integers: the largest-magnitude elements stored apart in float16.

KVQuant (Hooper et al., 2024, "KVQuant: Towards 10 Million Context Length LLM Inference with KV
Cache Quantization") keeps about 1 % of a cache's values, its outliers, in float16 beside a
low-bit dense part, so that the dense part's ranges are set by the ordinary values. Here, per
leading index (one head's ``[N, D]`` span, as one payload is quantized):

- the ``k = floor(outliers * N * D + 1/2)`` elements of largest magnitude are the outliers (ties:
  the lower flat index ``t * D + c`` first). Their flat indices are stored in ascending order
  (``outlier_index``: uint16 when ``N * D <= 65,536``, else int32) with their values rounded to
  float16 (``outlier_values``);
- every other element is quantized by :class:`~testbed.quant.intgrouped.IntGrouped` (``bits``,
  ``group_size``, ``axis``: KIVI's asymmetric min-max groups, K per channel, V per token). An
  outlier's own slot in the dense part is first filled with the smallest non-outlier member of its
  group (0 in a group of outliers only), so each group's range is that of its ordinary members.
  The dense payload's arrays are stored as ``IntGrouped`` stores them (``codes``, ``scale``,
  ``zero``, ``header``).

Decoding decodes the dense part (float32) and writes each outlier's float16 value back over its
slot. Every byte is counted in ``nbytes``: the dense payload, 2 bytes per outlier value and 2 or 4
per index. At ``N = 128`` tokens of ``D = 64`` (one flush of a 128-token window) 1 % of outliers
cost 82 × 4 bytes, 0.32 bits per element on top of the dense part's bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Packed, Quantizer, check_input, register, register_kind
from .constants import FP16_MAX, KIVI_GROUP_SIZE
from .intgrouped import IntGrouped

__all__ = ["DenseSparse", "outlier_count", "index_dtype", "UINT16_SPAN"]

UINT16_SPAN = 1 << 16  # flat indices of a span up to this many elements fit uint16
_DENSE = ("codes", "scale", "zero", "header")


def outlier_count(fraction: float, n: int, d: int) -> int:
    """``floor(fraction * n * d + 1/2)``: the outliers of one ``[n, d]`` span."""
    return int(math.floor(fraction * n * d + 0.5))


def index_dtype(n: int, d: int) -> torch.dtype:
    """uint16 when every flat index of an ``[n, d]`` span fits it, else int32."""
    return torch.uint16 if n * d <= UINT16_SPAN else torch.int32


def _fill_outliers(x: torch.Tensor, mask: torch.Tensor, group: int, axis: str) -> torch.Tensor:
    """``x`` with each masked slot set to the smallest unmasked member of its group (0 where a group
    is all masked); groups as IntGrouped forms them (edge padding included, then cut away)."""
    dim = -2 if axis == "channel" else -1
    n = x.shape[dim]
    pad = (-n) % group
    if pad:
        reps = [1] * x.dim()
        reps[dim] = pad
        x = torch.cat([x, x.narrow(dim, n - 1, 1).repeat(reps)], dim=dim)
        mask = torch.cat([mask, mask.narrow(dim, n - 1, 1).repeat(reps)], dim=dim)
    if axis == "channel":
        shape = (*x.shape[:-2], x.shape[-2] // group, group, x.shape[-1])
        red = -2
    else:
        shape = (*x.shape[:-1], x.shape[-1] // group, group)
        red = -1
    xg, mg = x.reshape(shape), mask.reshape(shape)
    low = torch.where(mg, torch.full_like(xg, math.inf), xg).amin(dim=red, keepdim=True)
    low = torch.where(torch.isinf(low), torch.zeros_like(low), low)
    out = torch.where(mg, low.expand_as(xg), xg).reshape(x.shape)
    return out.narrow(dim, 0, n)


@dataclass(frozen=True)
class DenseSparse(Quantizer):
    """``bits``-bit grouped integers along ``axis`` with a fraction ``outliers`` kept in float16."""

    KIND: ClassVar[str] = "int_dense_sparse"
    bits: int = 3
    group_size: int = KIVI_GROUP_SIZE
    axis: str = "channel"
    outliers: float = 0.01

    def __post_init__(self):
        IntGrouped(self.bits, self.group_size, self.axis)  # the dense part's rules and errors
        p = self.outliers
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 0.25:
            raise ValueError(f"outliers must be a fraction of the elements in [0, 0.25], got {p!r}")

    @property
    def dense(self) -> IntGrouped:
        return IntGrouped(self.bits, self.group_size, self.axis)

    @property
    def permyriad(self) -> str:
        """The outlier fraction in units of 0.01 % (``100`` for 1 %), as names and labels print it."""
        return f"{self.outliers * 1e4:g}"

    @property
    def name(self) -> str:
        return f"int{self.bits}_ds{self.permyriad}_{self.axis}_g{self.group_size}"

    @property
    def label(self) -> str:
        """Bits, group size and the outlier fraction (in 0.01 %); the axis is the layout's."""
        return f"int{self.bits}_grouped_g{self.group_size}_ds{self.permyriad}"

    def quantize_reference(self, x: torch.Tensor, *, name: str = "x") -> Packed:
        check_input(x, name)
        *lead, n, d = x.shape
        xf = x.detach().to(torch.float32)
        flat = xf.reshape(*lead, n * d)
        k = outlier_count(self.outliers, n, d)
        # stable sort of -|x|: equal magnitudes keep their flat order, so the lower index wins a tie
        top = torch.sort(-flat.abs(), dim=-1, stable=True).indices[..., :k]
        index = torch.sort(top, dim=-1).values
        picked = flat.gather(-1, index)
        if bool((picked.abs() > FP16_MAX).any()):
            raise ValueError(f"{name}: an outlier's magnitude exceeds float16 ({FP16_MAX:g}); it cannot be stored")
        mask = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, index, True).reshape(xf.shape)
        dense = self.dense.quantize(_fill_outliers(xf, mask, self.group_size, self.axis), name=name)
        tensors = {**dense.tensors, "outlier_values": picked.to(torch.float16),
                   "outlier_index": index.to(index_dtype(n, d))}
        return Packed(self.name, tuple(x.shape), x.dtype, tensors, self.config())

    def dequantize(self, p: Packed) -> torch.Tensor:
        self._check_packed(p)
        *lead, n, d = p.shape
        dense = Packed(self.dense.name, p.shape, torch.float32, {k: p.tensors[k] for k in _DENSE},
                       self.dense.config())
        y = self.dense.dequantize(dense).to(torch.float32).reshape(*lead, n * d).clone()
        index = p.tensors["outlier_index"].to(torch.int64)
        y.scatter_(-1, index, p.tensors["outlier_values"].to(torch.float32))
        return y.reshape(p.shape).to(p.dtype)


register_kind("int_dense_sparse", DenseSparse)
for _bits in (2, 3):
    for _axis in ("channel", "token"):
        register(f"int{_bits}_ds100_{_axis}_g32", (lambda b=_bits, a=_axis: DenseSparse(b, 32, a, 0.01)))
