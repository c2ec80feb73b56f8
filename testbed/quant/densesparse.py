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

With ``rotation = "hadamard"`` (QuaRot's idea, KVQuant's pre-processing left aside), each row's
last axis is first rotated by ``R = diag(s) · blockdiag(H_n) / sqrt(n)`` (:func:`rotate`): ``n``
the largest power of two dividing ``D``, at most 128 (``D = 64``: one block of 64; ``D = 33``:
blocks of 1: the signs alone); ``H_n`` applied as the fast Walsh-Hadamard butterfly in float64 (stage
``h = 1, 2, .., n/2``: each pair ``(a, b)`` at distance ``h`` becomes ``(a + b, a - b)``), then
multiplied by ``1 / sqrt(n)`` and rounded once to float32; ``s`` a sign per channel drawn from
SHA-256 (:func:`rotation_signs`), so the audit re-derives them without torch. Outliers, groups and
codes are all taken in the rotated domain; decoding rotates back (``R^T``: the butterfly, the
scale, then the signs) and rounds once to float32. The seed is the whole of the rotation's
metadata: no array is stored for it.

Decoding decodes the dense part (float32) and writes each outlier's float16 value back over its
slot. Every byte is counted in ``nbytes``: the dense payload, 2 bytes per outlier value and 2 or 4
per index. At ``N = 128`` tokens of ``D = 64`` (one flush of a 128-token window) 1 % of outliers
cost 82 × 4 bytes, 0.32 bits per element on top of the dense part's bits.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Packed, Quantizer, check_input, register, register_kind
from .constants import FP16_MAX, KIVI_GROUP_SIZE
from .intgrouped import IntGrouped

__all__ = ["DenseSparse", "outlier_count", "index_dtype", "UINT16_SPAN", "ROTATIONS", "rotation_signs", "block_of",
           "rotate", "unrotate"]

ROTATIONS = (None, "hadamard")
MAX_BLOCK = 128

UINT16_SPAN = 1 << 16  # flat indices of a span up to this many elements fit uint16
_DENSE = ("codes", "scale", "zero", "header")


def outlier_count(fraction: float, n: int, d: int) -> int:
    """``floor(fraction * n * d + 1/2)``: the outliers of one ``[n, d]`` span."""
    return int(math.floor(fraction * n * d + 0.5))


def index_dtype(n: int, d: int) -> torch.dtype:
    """uint16 when every flat index of an ``[n, d]`` span fits it, else int32."""
    return torch.uint16 if n * d <= UINT16_SPAN else torch.int32


@functools.lru_cache(maxsize=16)
def _signs(d: int, seed: int) -> torch.Tensor:
    return rotation_signs(d, seed)


def rotation_signs(d: int, seed: int) -> torch.Tensor:
    """``d`` signs (float64, ±1): bit ``i`` (least significant first within each byte) of the stream
    ``SHA-256(b"testbed.hadamard:<seed>:<k>")`` for ``k = 0, 1, ..`` concatenated; a 1 bit is -1."""
    stream = b""
    k = 0
    while len(stream) * 8 < d:
        stream += hashlib.sha256(f"testbed.hadamard:{int(seed)}:{k}".encode()).digest()
        k += 1
    bits = [(stream[i // 8] >> (i % 8)) & 1 for i in range(d)]
    return torch.tensor([1.0 - 2.0 * b for b in bits], dtype=torch.float64)


def block_of(d: int) -> int:
    """The Hadamard block: the largest power of two dividing ``d``, at most 128."""
    return min(d & -d, MAX_BLOCK)


def _butterfly(y: torch.Tensor, n: int) -> torch.Tensor:
    """The Walsh-Hadamard transform of each block of ``n`` along the last axis (float64, unscaled)."""
    lead, d = y.shape[:-1], y.shape[-1]
    h = 1
    while h < n:
        z = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = z[..., 0, :], z[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(*lead, d)
        h *= 2
    return y


def rotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """``x R`` along the last axis, float64 inside, float32 out."""
    d = x.shape[-1]
    n = block_of(d)
    y = _butterfly(x.to(torch.float64) * _signs(d, int(seed)).to(x.device), n) * (1.0 / math.sqrt(n))
    return y.to(torch.float32)


def unrotate(y: torch.Tensor, seed: int) -> torch.Tensor:
    """``y R^T`` along the last axis (``H`` is symmetric): the butterfly, the scale, then the signs."""
    d = y.shape[-1]
    n = block_of(d)
    return ((_butterfly(y.to(torch.float64), n) * (1.0 / math.sqrt(n))) * _signs(d, int(seed)).to(y.device)).to(
        torch.float32)


def _fill_outliers(x: torch.Tensor, mask: torch.Tensor, dense: IntGrouped) -> torch.Tensor:
    """``x`` with each masked slot set to the smallest unmasked member of its group (0 where a group
    is all masked); groups as ``dense`` forms them (:meth:`IntGrouped.grouped`: edge padding
    included, then cut away)."""
    dim = -2 if dense.axis == "channel" else -1  # the axis the group members lie on
    n = x.shape[dim]
    xg, mg = dense.grouped(x), dense.grouped(mask)
    low = torch.where(mg, torch.full_like(xg, math.inf), xg).amin(dim=dim, keepdim=True)
    low = torch.where(torch.isinf(low), torch.zeros_like(low), low)
    out = torch.where(mg, low.expand_as(xg), xg)
    padded = out.flatten(-3, -2) if dense.axis == "channel" else out.flatten(-2, -1)
    return padded.narrow(dim, 0, n)


@dataclass(frozen=True)
class DenseSparse(Quantizer):
    """``bits``-bit grouped integers along ``axis`` with a fraction ``outliers`` kept in float16."""

    KIND: ClassVar[str] = "int_dense_sparse"
    bits: int = 3
    group_size: int = KIVI_GROUP_SIZE
    axis: str = "channel"
    outliers: float = 0.01
    rotation: str | None = None
    seed: int = 0

    def __post_init__(self):
        IntGrouped(self.bits, self.group_size, self.axis)  # the dense part's rules and errors
        p = self.outliers
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 0.25:
            raise ValueError(f"outliers must be a fraction of the elements in [0, 0.25], got {p!r}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be None or 'hadamard', got {self.rotation!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")

    @property
    def dense(self) -> IntGrouped:
        return IntGrouped(self.bits, self.group_size, self.axis)

    @property
    def permyriad(self) -> str:
        """The outlier fraction in units of 0.01 % (``100`` for 1 %), as names and labels print it."""
        return f"{self.outliers * 1e4:g}"

    @property
    def name(self) -> str:
        return (f"int{self.bits}_ds{self.permyriad}" + ("_hadamard" if self.rotation else "")
                + f"_{self.axis}_g{self.group_size}")

    @property
    def label(self) -> str:
        """Bits, group size, the outlier fraction (in 0.01 %) and ``_hadamard`` with the rotation; the
        axis is the layout's."""
        return f"int{self.bits}_grouped_g{self.group_size}_ds{self.permyriad}" + ("_hadamard" if self.rotation else "")

    def _check_packed(self, p: Packed) -> None:
        super()._check_packed(p)
        if p.config and p.config != self.config():  # the name leaves out the seed: a payload of another seed
            raise ValueError(f"{self.name}: cannot dequantize a payload made with {p.config}")

    def quantize_reference(self, x: torch.Tensor, *, name: str = "x") -> Packed:
        check_input(x, name)
        *lead, n, d = x.shape
        xf = x.detach().to(torch.float32)
        if self.rotation:
            xf = rotate(xf, self.seed)
        flat = xf.reshape(*lead, n * d)
        k = outlier_count(self.outliers, n, d)
        # stable sort of -|x|: equal magnitudes keep their flat order, so the lower index wins a tie
        top = torch.sort(-flat.abs(), dim=-1, stable=True).indices[..., :k]
        index = torch.sort(top, dim=-1).values
        picked = flat.gather(-1, index)
        if bool((picked.abs() > FP16_MAX).any()):
            raise ValueError(f"{name}: an outlier's magnitude exceeds float16 ({FP16_MAX:g}); it cannot be stored")
        mask = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, index, True).reshape(xf.shape)
        dense = self.dense.quantize(_fill_outliers(xf, mask, self.dense), name=name)
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
        y = y.reshape(p.shape)
        if self.rotation:
            y = unrotate(y, self.seed)
        return y.to(p.dtype)


register_kind("int_dense_sparse", DenseSparse)
for _bits in (2, 3):
    for _axis in ("channel", "token"):
        register(f"int{_bits}_ds100_{_axis}_g32", (lambda b=_bits, a=_axis: DenseSparse(b, 32, a, 0.01)))
    register(f"int{_bits}_ds0_hadamard_channel_g32", (lambda b=_bits: DenseSparse(b, 32, "channel", 0.0, "hadamard")))
    register(f"int{_bits}_ds100_hadamard_token_g32", (lambda b=_bits: DenseSparse(b, 32, "token", 0.01, "hadamard")))
