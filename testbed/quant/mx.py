"""OCP Microscaling (MX v1.0) block quantization: MXFP8 (E4M3, E5M2) and MXFP4 (E2M1).

Follows the OCP Microscaling Formats (MX) v1.0 specification, section 6.3 ("minimally supported"
conversion), with the FLOOR scale rule used by torchao's ``to_mx`` (``ScaleCalculationMode.FLOOR``)
by default:

- the last axis is cut into blocks of ``block_size`` (32) elements; a last axis that is not a
  multiple of the block is **zero-padded** to whole blocks (padding never changes a block's
  amax; the padding codes are stored and counted in ``nbytes``, and dropped on decode);
- one E8M0 scale per block: ``X = 2**clamp(floor(log2(amax)) - emax_elem, -127, 127)`` where
  ``emax_elem`` is the exponent of the element format's largest normal (8 for E4M3, 15 for
  E5M2, 2 for E2M1); the scale code is ``e + 127`` (uint8; 255 = NaN is never produced). An
  all-zero block gets scale code 0;
- every element is ``x / X`` (exact: X is a power of two, computed in float64), clamped to the
  element format's ±max (448, 57344, 6) and rounded to nearest, ties to even. Signs are kept,
  so -0.0 and negative underflows encode as negative zero (0x80, or 0x8 in FP4);
- decoding is ``value(code) * 2**(scale_code - 127)``, exact in float32.

FLOOR puts the block amax at ``x / X`` in ``[2**emax, 2**(emax+1))``, so the part above the
element max (448..512 for E4M3) saturates: that is the rule's known cost and it is kept, not
hidden. ``scale_rule="rceil"`` instead takes ``X = 2**ceil(log2(d))`` of the float32 quotient
``d = fl32(amax / max)`` (cuBLAS block scaling, torchao's ``ScaleCalculationMode.RCEIL``): the
smallest power of two that needs no clamping, so the scale is FLOOR's or one above and no block
saturates. :func:`saturated_blocks` counts the blocks that clamp. torchao's CPU path takes the
ceil of a float32 ``log2``, which lands one scale lower when ``d`` is a hair above a power of two;
this module takes the exact value (``tests/quant/test_mx.py`` checks every other block bit for
bit against torchao and that each difference is such a block). Inputs are first rounded to float32
(the precision of the kernels' inputs); the codes are those of the float32 value.

Divergence from torchao, on purpose: for a non-zero block whose scale code is 0 (amax below
2**-118 for E4M3) torchao divides by float32's smallest normal 2**-126 instead of 2**-127 (its
triton workaround) while it decodes code 0 as 2**-127; this module applies 2**-127 both ways as
the spec says. Every other block matches torchao bit for bit (``tests/quant/test_mx.py``).

Optional ``rotation="signed_hadamard"`` rotates the last axis (the head dimension of Q and K)
with :class:`~testbed.quant.rotation.SignedHadamard` before quantization; :meth:`MX.dequantize`
rotates back, :meth:`MX.decode_rotated` returns the rotated-domain values a kernel would multiply.

Stored arrays (append-friendly along the token axis, leading dims = heads):

- ``codes``  uint8 ``[..., N, D_pad]`` (8-bit elements) or ``[..., N, D_pad / 2]`` (FP4, two codes
  per byte, first code in the low nibble)
- ``scales`` uint8 ``[..., N, D_pad / block_size]`` (E8M0 bit patterns)
- ``header`` int64 ``[2]`` = (N, D)

So MXFP8 costs 8 + 8/32 = 8.25 bits per (padded) element plus 16 bytes, MXFP4 4.25.

Two encoders produce the same codes: the fast path uses torch's native float8 casts (after
clamping, since older eager casts do not saturate), and :func:`encode_elements_reference`
rounds in float64 arithmetic from the format's bit fields (used for FP4, and kept so that any
later fast path can be compared bit for bit).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

import numpy as np

from . import kernels
from .base import Packed, Quantizer, check_input, make_header, register, register_kind
from .constants import E8M0_BIAS, MX_BLOCK_SIZE
from .packing import pack_codes, unpack_codes
from .rotation import SignedHadamard

__all__ = ["ElementFormat", "ELEMENTS", "MX", "MXFP8", "MXFP4", "block_scale_codes", "encode_elements",
           "encode_elements_reference", "element_values", "quantize_blocks", "saturated_blocks", "ROTATIONS",
           "SCALE_RULES"]

ROTATIONS = (None, "signed_hadamard")
SCALE_RULES = ("floor", "rceil")


@dataclass(frozen=True)
class ElementFormat:
    """A small float format: sign, ``ebits`` exponent bits (bias ``bias``), ``mbits`` mantissa bits."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max: float          # largest finite magnitude (saturation value)
    emax: int           # floor(log2(max)): the FLOOR rule subtracts it from floor(log2(amax))
    torch_dtype: torch.dtype | None

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal."""
        return 1 - self.bias


ELEMENTS = {
    "e4m3": ElementFormat("e4m3", 4, 3, 7, 448.0, 8, torch.float8_e4m3fn),
    "e5m2": ElementFormat("e5m2", 5, 2, 15, 57344.0, 15, torch.float8_e5m2),
    "e2m1": ElementFormat("e2m1", 2, 1, 1, 6.0, 2, None),
}


def block_scale_codes(amax: torch.Tensor, fmt: ElementFormat, rule: str = "floor") -> torch.Tensor:
    """E8M0 codes (uint8) of blocks with absolute maxima ``amax`` (float32).

    ``floor``: ``floor(log2(amax)) - emax`` (OCP MX v1.0 section 6.3). ``rceil``: the smallest
    power of two that brings the block inside the element range, ``ceil(log2(d))`` of the float32
    quotient ``d = fl32(amax / max)`` (cuBLAS block scaling; torchao ``ScaleCalculationMode.RCEIL``),
    exact: the float32 ``d`` is a power of two exactly when its frexp mantissa is 1/2."""
    if rule == "floor":
        _, e = torch.frexp(amax.to(torch.float64))          # amax = m * 2**e, m in [0.5, 1)
        unbiased = e.to(torch.int32) - 1 - fmt.emax
    elif rule == "rceil":
        d = (amax.to(torch.float32) / torch.tensor(fmt.max, dtype=torch.float32)).to(torch.float64)
        m, e = torch.frexp(d)                                # d = m * 2**e: log2 d = e - 1 when m == 1/2
        unbiased = torch.where(m == 0.5, e - 1, e).to(torch.int32)
        unbiased = torch.where(d == 0, torch.full_like(unbiased, -E8M0_BIAS), unbiased)  # quotient underflowed
    else:
        raise ValueError(f"scale rule must be one of {SCALE_RULES}, got {rule!r}")
    codes = (unbiased.clamp_(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
    return torch.where(amax == 0, torch.zeros_like(codes), codes)


def saturated_blocks(x: torch.Tensor, scales: torch.Tensor, fmt: ElementFormat, block_size: int) -> torch.Tensor:
    """Boolean ``[..., L_pad / block]``: blocks where some ``|x| / X`` exceeds the element maximum,
    so that at least one element was clamped (FLOOR's known cost; RCEIL scales never need it but
    for a quotient rounded down to a power of two)."""
    xf = x.detach().to(torch.float32)
    pad = (-xf.shape[-1]) % block_size
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // block_size, block_size).to(torch.float64)
    inv = torch.ldexp(torch.ones_like(scales, dtype=torch.float64), (E8M0_BIAS - scales.to(torch.float64)))
    return (blocks.abs() * inv.unsqueeze(-1)).amax(dim=-1) > fmt.max


def encode_elements_reference(y: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Element codes of ``y`` (already divided by the block scale), rounded in float64 arithmetic.

    ``|y|`` is clamped to ``fmt.max`` and rounded to the nearest multiple of the quantum of its
    binade, ``2**(max(floor(log2|y|), emin) - mbits)``, ties to even (``torch.round``); the
    result's bit fields are then assembled directly.
    """
    y = y.to(torch.float64)
    sign = torch.signbit(y).to(torch.uint8) << (fmt.bits - 1)
    a = y.abs().clamp_(max=fmt.max)
    _, e = torch.frexp(a)
    e = (e - 1).clamp_(min=fmt.emin)
    quantum = torch.ldexp(torch.ones_like(a), (e - fmt.mbits).to(torch.float64))
    r = torch.round(a / quantum) * quantum                # exact: quantum is a power of two
    _, er = torch.frexp(r)
    er = er - 1
    normal = r >= 2.0 ** fmt.emin
    exp_field = torch.where(normal, er + fmt.bias, torch.zeros_like(er))
    mant_scale = torch.where(normal, er, torch.full_like(er, fmt.emin)) - fmt.mbits
    mant = r / torch.ldexp(torch.ones_like(r), mant_scale.to(torch.float64))
    mant = torch.where(normal, mant - (1 << fmt.mbits), mant)
    return sign | (exp_field.to(torch.uint8) << fmt.mbits) | mant.to(torch.uint8)


def encode_elements(y: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Element codes of ``y`` (float64, already scaled): native float8 cast when there is one."""
    if fmt.torch_dtype is None:
        return encode_elements_reference(y, fmt)
    clamped = y.clamp(-fmt.max, fmt.max).to(torch.float32)   # exact in the range that can round to non-zero
    return clamped.to(fmt.torch_dtype).view(torch.uint8)


def element_values(fmt: ElementFormat, device: torch.device | str = "cpu") -> torch.Tensor:
    """Decoded value of every code ``0 .. 2**bits - 1`` (float64; NaN/Inf codes of FP8 included)."""
    c = torch.arange(1 << fmt.bits, dtype=torch.int64, device=device)
    sign = torch.where((c >> (fmt.bits - 1)) & 1 == 1, -1.0, 1.0).to(torch.float64)
    exp_field = (c >> fmt.mbits) & ((1 << fmt.ebits) - 1)
    mant = (c & ((1 << fmt.mbits) - 1)).to(torch.float64)
    normal = exp_field > 0
    e = torch.where(normal, exp_field - fmt.bias, torch.full_like(exp_field, fmt.emin)).to(torch.float64)
    frac = torch.where(normal, 1.0 + mant / (1 << fmt.mbits), mant / (1 << fmt.mbits))
    v = sign * frac * torch.exp2(e)
    if fmt.name == "e4m3":                                  # S.1111.111 is NaN (no infinities)
        v = torch.where((exp_field == 15) & (mant == 7), torch.tensor(float("nan"), dtype=torch.float64, device=device), v)
    elif fmt.name == "e5m2":                                # exponent 31: Inf (mantissa 0) or NaN
        special = exp_field == 31
        v = torch.where(special & (mant == 0), sign * float("inf"), v)
        v = torch.where(special & (mant != 0), torch.tensor(float("nan"), dtype=torch.float64, device=device), v)
    return v


def quantize_blocks(x: torch.Tensor, fmt: ElementFormat, block_size: int,
                    rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., L]`` -> (element codes uint8 ``[..., L_pad]`` unpacked, scale codes uint8 ``[..., L_pad/B]``)."""
    xf = x.detach().to(torch.float32)
    pad = (-xf.shape[-1]) % block_size
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // block_size, block_size)
    scales = block_scale_codes(blocks.abs().amax(dim=-1), fmt, rule)
    inv = torch.ldexp(torch.ones_like(scales, dtype=torch.float64), (E8M0_BIAS - scales.to(torch.float64)))
    y = blocks.to(torch.float64) * inv.unsqueeze(-1)        # exact: |x| >= 2**-149, factor in 2**[-127, 127]
    codes = encode_elements(y, fmt).reshape(xf.shape)
    return codes, scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, fmt: ElementFormat, block_size: int,
                      length: int) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks` (float32, trimmed to ``length``)."""
    lut = element_values(fmt, codes.device)
    vals = lut[codes.to(torch.int64)].reshape(*codes.shape[:-1], scales.shape[-1], block_size)
    s = torch.ldexp(torch.ones_like(scales, dtype=torch.float64), scales.to(torch.float64) - E8M0_BIAS)
    x = (vals * s.unsqueeze(-1)).to(torch.float32)          # exact: <= 4 significant bits times 2**k
    return x.reshape(*codes.shape)[..., :length]


@functools.lru_cache(maxsize=None)
def _rotation(dim: int, seed: int) -> SignedHadamard:
    return SignedHadamard(dim, seed)


@functools.lru_cache(maxsize=None)
def _lut(element: str) -> np.ndarray:
    return element_values(ELEMENTS[element]).numpy()


@dataclass(frozen=True)
class MX(Quantizer):
    """MX block quantization with ``element`` in {e4m3, e5m2, e2m1} along the last axis."""

    KIND: ClassVar[str] = "mx"
    element: str = "e4m3"
    block_size: int = MX_BLOCK_SIZE
    rotation: str | None = None
    seed: int = 0
    scale_rule: str = "floor"

    def __post_init__(self):
        if self.element not in ELEMENTS:
            raise ValueError(f"element must be one of {sorted(ELEMENTS)}, got {self.element!r}")
        b = self.block_size
        if not isinstance(b, int) or isinstance(b, bool) or b < 2 or b & (b - 1):
            raise ValueError(f"block_size must be a power of two >= 2, got {b!r}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be None or 'signed_hadamard', got {self.rotation!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {self.scale_rule!r}")

    @property
    def fmt(self) -> ElementFormat:
        return ELEMENTS[self.element]

    @property
    def name(self) -> str:
        family = "mxfp4" if self.fmt.bits == 4 else "mxfp8"
        return (f"{family}_{self.element}_b{self.block_size}" + ("_rceil" if self.scale_rule == "rceil" else "")
                + ("_hadamard" if self.rotation else ""))

    @property
    def label(self) -> str:
        """Element format and block, then the scale rule and rotation where they are not the defaults."""
        return (f"mx_{self.element}_b{self.block_size}" + ("_rceil" if self.scale_rule == "rceil" else "")
                + ("_hadamard" if self.rotation else ""))

    def rotation_for(self, dim: int) -> SignedHadamard | None:
        """The rotation applied to a last axis of size ``dim`` (None without rotation)."""
        return None if self.rotation is None else _rotation(dim, self.seed)

    def rotated(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as float32, rotated along its last axis when the scheme has a rotation."""
        xf = x.detach().to(torch.float32)
        rot = self.rotation_for(x.shape[-1])
        return xf if rot is None else rot.apply(xf)

    def _quantize_fast(self, x: torch.Tensor, name: str) -> Packed:
        check_input(x, name, finite=False)
        *lead, n, d = x.shape
        xf = self.rotated(x)
        f = self.fmt
        kernels.set_threads(torch.get_num_threads())
        codes, scales, bad = kernels.mx_quantize(xf.reshape(-1, d).numpy(), self.block_size, f.ebits, f.mbits,
                                                 f.bias, f.max, f.emax, rceil=self.scale_rule == "rceil")
        if bad:
            check_input(x, name)  # raises with the tensor's name and the first bad index
        tensors = {
            "codes": torch.from_numpy(codes).reshape(*lead, n, codes.shape[-1]),
            "scales": torch.from_numpy(scales).reshape(*lead, n, scales.shape[-1]),
            "header": make_header(n, d),
        }
        return Packed(self.name, tuple(x.shape), x.dtype, tensors, self.config())

    def quantize_reference(self, x: torch.Tensor, *, name: str = "x") -> Packed:
        """The torch implementation: the definition the fused kernel must match bit for bit."""
        check_input(x, name)
        n, d = x.shape[-2], x.shape[-1]
        codes, scales = quantize_blocks(self.rotated(x), self.fmt, self.block_size, self.scale_rule)
        tensors = {
            "codes": pack_codes(codes, self.fmt.bits) if self.fmt.bits < 8 else codes,
            "scales": scales,
            "header": make_header(n, d, x.device),
        }
        return Packed(self.name, tuple(x.shape), x.dtype, tensors, self.config())

    def decode_rotated(self, p: Packed) -> torch.Tensor:
        """Decoded values in the rotated domain (float32; equals :meth:`dequantize` without rotation)."""
        self._check_packed(p)
        codes = p.tensors["codes"]
        if kernels.use_fast(codes):
            *lead, n, d = p.shape
            out = kernels.mx_dequantize(codes.reshape(-1, codes.shape[-1]).numpy(),
                                        p.tensors["scales"].reshape(-1, p.tensors["scales"].shape[-1]).numpy(),
                                        _lut(self.element), self.block_size, self.fmt.bits, d)
            return torch.from_numpy(out).reshape(*lead, n, d)
        return self.decode_rotated_reference(p)

    def decode_rotated_reference(self, p: Packed) -> torch.Tensor:
        self._check_packed(p)
        d = p.shape[-1]
        d_pad = p.tensors["scales"].shape[-1] * self.block_size
        codes = p.tensors["codes"]
        if self.fmt.bits < 8:
            codes = unpack_codes(codes, self.fmt.bits, d_pad)
        return dequantize_blocks(codes, p.tensors["scales"], self.fmt, self.block_size, d)

    def dequantize(self, p: Packed) -> torch.Tensor:
        y = self.decode_rotated(p)
        rot = self.rotation_for(p.shape[-1])
        if rot is not None:
            y = rot.invert(y)
        return y.to(p.dtype)


def MXFP8(block_size: int = MX_BLOCK_SIZE, rotation: str | None = None, seed: int = 0, element: str = "e4m3") -> MX:
    if ELEMENTS.get(element) is None or ELEMENTS[element].bits != 8:
        raise ValueError(f"MXFP8 elements are e4m3 or e5m2, got {element!r}")
    return MX(element, block_size, rotation, seed)


def MXFP4(block_size: int = MX_BLOCK_SIZE, rotation: str | None = None, seed: int = 0) -> MX:
    return MX("e2m1", block_size, rotation, seed)


register_kind("mx", MX)
register("mxfp8_e4m3_b32", lambda: MX("e4m3", 32))
register("mxfp8_e5m2_b32", lambda: MX("e5m2", 32))
register("mxfp4_e2m1_b32", lambda: MX("e2m1", 32))
