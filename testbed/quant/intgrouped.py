"""Asymmetric min-max integer quantization in groups (the KIVI layout).

K is quantized per channel (each feature channel, groups of G consecutive tokens: ``axis =
"channel"``), V per token (each token, groups of G consecutive features: ``axis = "token"``),
following KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache"): key outliers are channel-wise, value error is token-local.

Per group: ``zero = min``, ``scale = (max - min) / (2**bits - 1)``, both stored as float16 (a
zero as +0); codes are ``round((x - zero16) / scale16)`` (round half to even) clamped to
``[0, 2**bits-1]``, and ``x_hat = code * scale16 + zero16`` in float32. A degenerate group
(max == min) stores scale 0 and code 0 and decodes to ``zero16`` without any division. Quantized spans are padded
to whole groups by repeating the edge value (so the padding never widens a group's range); the
padding codes are stored and counted in ``nbytes``.

Bits 2, 3, 4 and 8 (3 bits packs eight codes in three bytes, :mod:`testbed.quant.packing`).

Stored arrays (all append-friendly along the token axis):

- ``codes``  uint8 ``[..., T_pad, ceil(D * bits / 8)]`` (channel) or ``[..., T, ceil(D_pad * bits / 8)]`` (token)
- ``scale``, ``zero``  float16 ``[..., T_pad / G, D]`` (channel) or ``[..., T, D_pad / G]`` (token)
- ``header`` int64 ``[2]`` = (T, D)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from . import kernels
from .base import Packed, Quantizer, check_input, make_header, register, register_kind
from .constants import FP16_MAX, KIVI_GROUP_SIZE
from .packing import pack_codes, unpack_codes

__all__ = ["IntGrouped", "Int2Grouped", "Int3Grouped", "Int4Grouped", "Int8Grouped"]


def _pad_edge(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    n = x.shape[dim]
    pad = (-n) % multiple
    if not pad:
        return x
    edge = x.narrow(dim, n - 1, 1)
    reps = [1] * x.dim()
    reps[dim] = pad
    return torch.cat([x, edge.repeat(reps)], dim=dim)


@dataclass(frozen=True)
class IntGrouped(Quantizer):
    """``bits``-bit asymmetric grouped quantization along ``axis`` in groups of ``group_size``."""

    KIND: ClassVar[str] = "int_grouped"
    bits: int = 4
    group_size: int = KIVI_GROUP_SIZE
    axis: str = "channel"

    def __post_init__(self):
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or self.bits not in (2, 3, 4, 8):
            raise ValueError(f"bits must be 2, 3, 4 or 8, got {self.bits!r}")
        g = self.group_size
        if not isinstance(g, int) or isinstance(g, bool) or g < 2 or g & (g - 1):
            raise ValueError(f"group_size must be a power of two >= 2, got {g!r}")
        if self.axis not in ("channel", "token"):
            raise ValueError(f"axis must be 'channel' (K: groups of tokens) or 'token' (V: groups of features), "
                             f"got {self.axis!r}")

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1

    @property
    def name(self) -> str:
        return f"int{self.bits}_grouped_{self.axis}_g{self.group_size}"

    @property
    def label(self) -> str:
        """Bits and group size; the axis is the layout's (K per channel, V per token)."""
        return f"int{self.bits}_grouped_g{self.group_size}"

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """View of the padded tensor with the group members on the second-to-last (channel) or last (token) axis."""
        g = self.group_size
        if self.axis == "channel":
            xp = _pad_edge(x, -2, g)
            return xp.reshape(*xp.shape[:-2], xp.shape[-2] // g, g, xp.shape[-1])
        xp = _pad_edge(x, -1, g)
        return xp.reshape(*xp.shape[:-1], xp.shape[-1] // g, g)

    def _overflow(self, name: str) -> ValueError:
        return ValueError(
            f"{name}: a group's range or minimum exceeds float16 (|value| or max-min above {FP16_MAX:g}); "
            "the float16 scale/zero-point cannot represent it"
        )

    def _quantize_fast(self, x: torch.Tensor, name: str) -> Packed:
        check_input(x, name, finite=False)
        *lead, n, d = x.shape
        # a strided view (e.g. the quantized span of a residual window) is read in place
        x3 = x.detach().to(torch.float32).reshape(-1, n, d).numpy()
        kernels.set_threads(torch.get_num_threads())
        fn = kernels.int_quantize_channel if self.axis == "channel" else kernels.int_quantize_token
        codes, scale, zero, bad = fn(x3, self.bits, self.group_size)
        if bad:
            check_input(x, name)  # raises with the tensor's name and the first bad index
            raise self._overflow(name)  # all finite: a scale or zero-point overflowed float16
        tensors = {
            "codes": torch.from_numpy(codes).reshape(*lead, *codes.shape[1:]),
            "scale": torch.from_numpy(scale).reshape(*lead, *scale.shape[1:]),
            "zero": torch.from_numpy(zero).reshape(*lead, *zero.shape[1:]),
            "header": make_header(n, d),
        }
        return Packed(self.name, tuple(x.shape), x.dtype, tensors, self.config())

    def quantize_reference(self, x: torch.Tensor, *, name: str = "x") -> Packed:
        """The plain torch implementation: the definition the fused kernel must match bit for bit."""
        check_input(x, name)
        n, d = x.shape[-2], x.shape[-1]
        xf = x.detach().to(torch.float32)
        grouped = self.grouped(xf)
        red = -2 if self.axis == "channel" else -1
        mn = grouped.amin(dim=red)
        mx = grouped.amax(dim=red)
        scale16 = ((mx - mn) / self.qmax + 0.0).to(torch.float16)
        zero16 = (mn + 0.0).to(torch.float16)  # + 0.0: a zero range or minimum is stored as +0
        if bool(torch.isinf(scale16).any()) or bool(torch.isinf(zero16).any()):
            raise self._overflow(name)
        s = scale16.to(torch.float32).unsqueeze(red)
        z = zero16.to(torch.float32).unsqueeze(red)
        live = s > 0
        codes = torch.where(live, torch.round((grouped - z) / torch.where(live, s, torch.ones_like(s))),
                            torch.zeros_like(grouped))
        codes = codes.clamp_(0, self.qmax).to(torch.uint8)
        if self.axis == "channel":
            codes = codes.reshape(*codes.shape[:-3], -1, d)
        else:
            codes = codes.reshape(*codes.shape[:-2], -1)
        tensors = {
            "codes": pack_codes(codes, self.bits),
            "scale": scale16,
            "zero": zero16,
            "header": make_header(n, d, x.device),
        }
        return Packed(self.name, tuple(x.shape), x.dtype, tensors, self.config())

    def dequantize(self, p: Packed) -> torch.Tensor:
        self._check_packed(p)
        if self._fast_decode(p):
            out = kernels.empty_float32(p.shape)
            self._dequantize_fast(p, out)
            return out.to(p.dtype)
        return self.dequantize_reference(p)

    def dequantize_into(self, p: Packed, out: torch.Tensor) -> torch.Tensor:
        """Decode into ``out`` (float32, shape ``p.shape``; may be a token span of a larger cache)."""
        self._check_packed(p)
        *_, n, d = p.shape
        if self._fast_decode(p) and out.device.type == "cpu" and out.dtype == torch.float32:
            try:
                target = out.view(-1, n, d)  # a view or nothing: the kernel must write into out itself
            except RuntimeError:
                target = None
            if target is not None:
                self._dequantize_fast(p, target)
                return out
        out.copy_(self.dequantize(p))
        return out

    @staticmethod
    def _fast_decode(p: Packed) -> bool:
        codes = p.tensors["codes"]  # at 4 bits a code byte holds two elements
        return kernels.use_fast(codes) and codes.numel() * 2 >= kernels.MIN_FAST_ELEMENTS

    def _dequantize_fast(self, p: Packed, out: torch.Tensor) -> None:
        *lead, n, d = p.shape
        codes = p.tensors["codes"]
        kernels.set_threads(torch.get_num_threads())
        fn = kernels.int_dequantize_channel if self.axis == "channel" else kernels.int_dequantize_token
        c3 = codes.reshape(-1, *codes.shape[-2:]).contiguous().numpy()
        s3 = p.tensors["scale"].reshape(-1, *p.tensors["scale"].shape[-2:]).numpy()
        z3 = p.tensors["zero"].reshape(-1, *p.tensors["zero"].shape[-2:]).numpy()
        fn(c3, s3, z3, self.group_size, self.bits, n, d, out=out.view(-1, n, d).numpy())

    def dequantize_reference(self, p: Packed) -> torch.Tensor:
        self._check_packed(p)
        *lead, n, d = p.shape
        g = self.group_size
        scale = p.tensors["scale"].to(torch.float32)
        zero = p.tensors["zero"].to(torch.float32)
        if self.axis == "channel":
            n_pad = scale.shape[-2] * g
            codes = unpack_codes(p.tensors["codes"], self.bits, d).reshape(*lead, n_pad // g, g, d)
            x = codes.to(torch.float32) * scale.unsqueeze(-2) + zero.unsqueeze(-2)
            x = x.reshape(*lead, n_pad, d)[..., :n, :]
        else:
            d_pad = scale.shape[-1] * g
            codes = unpack_codes(p.tensors["codes"], self.bits, d_pad).reshape(*lead, n, d_pad // g, g)
            x = codes.to(torch.float32) * scale.unsqueeze(-1) + zero.unsqueeze(-1)
            x = x.reshape(*lead, n, d_pad)[..., :d]
        return x.to(p.dtype)


def Int2Grouped(group_size: int = KIVI_GROUP_SIZE, axis: str = "channel") -> IntGrouped:
    return IntGrouped(2, group_size, axis)


def Int3Grouped(group_size: int = KIVI_GROUP_SIZE, axis: str = "channel") -> IntGrouped:
    return IntGrouped(3, group_size, axis)


def Int4Grouped(group_size: int = KIVI_GROUP_SIZE, axis: str = "channel") -> IntGrouped:
    return IntGrouped(4, group_size, axis)


def Int8Grouped(group_size: int = KIVI_GROUP_SIZE, axis: str = "channel") -> IntGrouped:
    return IntGrouped(8, group_size, axis)


register_kind("int_grouped", IntGrouped)
for _bits in (2, 3, 4, 8):
    for _axis in ("channel", "token"):
        register(f"int{_bits}_grouped_{_axis}_g32", (lambda b=_bits, a=_axis: IntGrouped(b, 32, a)))
