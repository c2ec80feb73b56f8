"""The audit's own statement of every quantizer kind: what a stored payload means.

Bit packing, each kind's encoder, decoder and label (grouped integers, MX minifloats with E8M0
scales, dense-and-sparse with its Hadamard rotation, codebooks with NormalFloat levels), the
registry ``SCHEMES`` that ``scheme``, ``encode_tensor``, ``decode_tensor`` and ``quantizer_label``
go through, the residual window's payload and the byte-for-byte comparison of two payloads.

Written independently of ``testbed.quant`` on purpose (numpy and the standard library only): the
audit is a second implementation that must agree with the first. The spec constants it reads are
the audit's own, in ``common.py``.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from typing import Callable, NamedTuple

import numpy as np

from .common import E8M0_BIAS, E8M0_NAN, FP16_MAX

__all__ = ["unpack_bits", "pack_bits", "encode_int_grouped", "decode_int_grouped", "label_int_grouped",
           "MX_ELEMENTS", "decode_e8m0", "decode_mx_raw", "encode_mx", "decode_mx", "encode_mx_payload", "label_mx",
           "hadamard_signs", "hadamard_block", "hadamard_rotate", "encode_dense_sparse", "decode_dense_sparse",
           "label_dense_sparse", "codebook_nf_levels", "codebook_table", "codebook_grouped",
           "codebook_normalized", "encode_codebook", "decode_codebook",
           "label_codebook", "Scheme", "SCHEMES", "scheme", "decode_tensor", "encode_tensor", "quantizer_label",
           "encode_residual_window", "decode_residual_window", "payload_differences"]


def unpack_bits(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """uint8 bytes -> codes along the last axis, lowest bits first, trimmed to ``n``."""
    if packed.dtype != np.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    if bits == 8:
        out = packed
    elif bits == 3:
        # eight 3-bit codes per 24-bit little-endian word of three bytes, code j in bits [3j, 3j+3)
        nb = packed.shape[-1]
        full = np.concatenate([packed, np.zeros((*packed.shape[:-1], (-nb) % 3), np.uint8)], axis=-1)
        trip = full.reshape(*packed.shape[:-1], full.shape[-1] // 3, 3).astype(np.uint32)
        word = trip[..., 0] | (trip[..., 1] << np.uint32(8)) | (trip[..., 2] << np.uint32(16))
        shifts = np.arange(8, dtype=np.uint32) * np.uint32(3)
        out = ((word[..., None] >> shifts) & np.uint32(7)).astype(np.uint8)
        out = out.reshape(*packed.shape[:-1], word.shape[-1] * 8)
    elif bits in (1, 2, 4):
        per = 8 // bits
        shifts = np.arange(per, dtype=np.uint8) * bits
        out = (packed[..., :, None] >> shifts) & np.uint8((1 << bits) - 1)
        out = out.reshape(*packed.shape[:-1], packed.shape[-1] * per)
    else:
        raise ValueError(f"unsupported code width {bits} bits")
    if out.shape[-1] < n:
        raise ValueError(f"packed codes hold {out.shape[-1]} codes per row, need {n}")
    return out[..., :n]


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`unpack_bits`: codes (each < 2**bits) along the last axis -> uint8 bytes,
    code ``j`` of a byte in bits ``[bits*j, bits*(j+1))``, the last byte filled with zero codes. At
    3 bits the codes form one little-endian bit stream (code ``j`` in stream bits ``[3j, 3j+3)``, stream
    bit ``i`` in bit ``i % 8`` of byte ``i // 8``), zero-filled to ``ceil(3L / 8)`` bytes."""
    codes = np.asarray(codes, dtype=np.uint8)
    if bits == 8:
        return np.ascontiguousarray(codes)
    if bits == 3:
        # bit by bit: code j's bit k is stream bit 3j + k, stream bit i lives in byte i // 8 at i % 8
        n = codes.shape[-1]
        nbytes = -(-3 * n // 8)
        stream = np.zeros((*codes.shape[:-1], nbytes * 8), np.uint8)
        for k in range(3):
            stream[..., k:3 * n:3] = (codes >> np.uint8(k)) & np.uint8(1)
        weights = (np.uint8(1) << np.arange(8, dtype=np.uint8)).astype(np.uint8)
        octets = stream.reshape(*codes.shape[:-1], nbytes, 8)
        return (octets * weights).sum(axis=-1, dtype=np.uint32).astype(np.uint8)
    if bits not in (1, 2, 4):
        raise ValueError(f"unsupported code width {bits} bits")
    per = 8 // bits
    pad = (-codes.shape[-1]) % per
    if pad:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], pad), np.uint8)], axis=-1)
    c = codes.reshape(*codes.shape[:-1], -1, per)
    out = c[..., 0].copy()
    for j in range(1, per):
        out |= c[..., j] << np.uint8(bits * j)
    return out


def _pad_edge(x: np.ndarray, axis: int, multiple: int) -> np.ndarray:
    """``x`` padded along ``axis`` to a multiple of ``multiple`` by repeating its last element."""
    pad = (-x.shape[axis]) % multiple
    if not pad:
        return x
    edge = np.take(x, [x.shape[axis] - 1], axis=axis)
    return np.concatenate([x, np.repeat(edge, pad, axis=axis)], axis=axis)


def encode_int_grouped(x: np.ndarray, cfg: dict) -> dict:
    """The audit's own asymmetric min-max grouped integer encoder: float32 ``x [..., N, D]`` ->
    ``{"codes", "scale", "zero", "header"}`` as the run must have stored them.

    K (``axis = "channel"``): groups of G consecutive tokens per feature, the token axis padded to
    whole groups by repeating the last token; V (``"token"``): groups of G consecutive features per
    token, the feature axis padded by repeating the last feature. Per group, in float32: ``scale =
    (max - min) / (2**bits - 1)`` and ``zero = min`` (``+ 0.0``: a zero is stored as +0), each rounded
    to float16 (IEEE nearest-even); ``code = rint((x - zero16) / scale16)`` (ties to even) clamped
    to ``[0, 2**bits - 1]``, 0 for a group of zero range. Codes are packed along the last axis."""
    bits, g, axis = cfg["bits"], cfg["group_size"], cfg["axis"]
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise ValueError(f"the integer encoder's input must be float32, got {x.dtype}")
    if not np.all(np.isfinite(x)):
        raise ValueError("the integer encoder's input holds a non-finite value")
    qmax = np.float32((1 << bits) - 1)
    *lead, n, d = x.shape
    if axis == "channel":
        xp = _pad_edge(x, -2, g)
        grouped = xp.reshape(*lead, xp.shape[-2] // g, g, d)
        red = -2
    elif axis == "token":
        xp = _pad_edge(x, -1, g)
        grouped = xp.reshape(*lead, n, xp.shape[-1] // g, g)
        red = -1
    else:
        raise ValueError(f"unknown axis {axis!r}")
    mn = grouped.min(axis=red)
    mx = grouped.max(axis=red)
    with np.errstate(over="ignore"):
        scale16 = ((mx - mn) / qmax + np.float32(0.0)).astype(np.float16)
        zero16 = (mn + np.float32(0.0)).astype(np.float16)
    if np.any(np.isinf(scale16)) or np.any(np.isinf(zero16)):
        raise ValueError("a group's range or minimum exceeds float16")
    s = np.expand_dims(scale16.astype(np.float32), red)
    z = np.expand_dims(zero16.astype(np.float32), red)
    live = s > 0
    codes = np.where(live, np.rint((grouped - z) / np.where(live, s, np.float32(1.0))), np.float32(0.0))
    codes = np.clip(codes, 0, qmax).astype(np.uint8)
    codes = codes.reshape(*lead, -1, d) if axis == "channel" else codes.reshape(*lead, n, -1)
    return {"codes": pack_bits(codes, bits), "scale": scale16, "zero": zero16,
            "header": np.array([n, d], dtype=np.int64)}


def decode_int_grouped(arrays: dict, cfg: dict, shape: tuple) -> np.ndarray:
    """Asymmetric grouped integer decode: ``code * scale16 + zero16`` in float32."""
    bits, g, axis = cfg["bits"], cfg["group_size"], cfg["axis"]
    *lead, n, d = shape
    scale = arrays["scale"]
    zero = arrays["zero"]
    if scale.dtype != np.float16 or zero.dtype != np.float16 or scale.shape != zero.shape:
        raise ValueError("scale and zero must be float16 arrays of one shape")
    s = scale.astype(np.float32)
    z = zero.astype(np.float32)
    if axis == "channel":
        n_pad = -(-n // g) * g
        if s.shape != (*lead, n_pad // g, d):
            raise ValueError(f"scale shape {s.shape} does not match {(*lead, n_pad // g, d)}")
        codes = unpack_bits(arrays["codes"], bits, d)
        if codes.shape != (*lead, n_pad, d):
            raise ValueError(f"codes shape {codes.shape} does not match {(*lead, n_pad, d)}")
        c = codes.reshape(*lead, n_pad // g, g, d).astype(np.float32)
        x = c * s[..., None, :] + z[..., None, :]
        return x.reshape(*lead, n_pad, d)[..., :n, :]
    if axis == "token":
        d_pad = -(-d // g) * g
        if s.shape != (*lead, n, d_pad // g):
            raise ValueError(f"scale shape {s.shape} does not match {(*lead, n, d_pad // g)}")
        codes = unpack_bits(arrays["codes"], bits, d_pad)
        if codes.shape != (*lead, n, d_pad):
            raise ValueError(f"codes shape {codes.shape} does not match {(*lead, n, d_pad)}")
        c = codes.reshape(*lead, n, d_pad // g, g).astype(np.float32)
        x = c * s[..., None] + z[..., None]
        return x.reshape(*lead, n, d_pad)[..., :d]
    raise ValueError(f"unknown axis {axis!r}")


def _minifloat_table(ebits: int, mbits: int, bias: int, special: str) -> np.ndarray:
    """Value of every code of a sign/exponent/mantissa format, from its bit fields (float64).

    ``special``: ``"fn"`` (E4M3: only S.1111.111 is NaN), ``"ieee"`` (E5M2: top exponent is
    Inf/NaN) or ``"none"`` (E2M1: every code finite)."""
    bits = 1 + ebits + mbits
    out = np.empty(1 << bits, dtype=np.float64)
    top = (1 << ebits) - 1
    for code in range(1 << bits):
        s = -1.0 if code >> (bits - 1) else 1.0
        e = (code >> mbits) & top
        m = code & ((1 << mbits) - 1)
        if special == "fn" and e == top and m == (1 << mbits) - 1:
            out[code] = np.nan
        elif special == "ieee" and e == top:
            out[code] = s * np.inf if m == 0 else np.nan
        elif e == 0:
            out[code] = s * (m / 2.0 ** mbits) * 2.0 ** (1 - bias)
        else:
            out[code] = s * (1 + m / 2.0 ** mbits) * 2.0 ** (e - bias)
    return out


# OCP MX v1.0 element formats: (bits per code, value of every code).
MX_ELEMENTS = {
    "e4m3": (8, _minifloat_table(4, 3, 7, "fn")),
    "e5m2": (8, _minifloat_table(5, 2, 15, "ieee")),
    "e2m1": (4, _minifloat_table(2, 1, 1, "none")),
}


def decode_e8m0(codes: np.ndarray) -> np.ndarray:
    """E8M0 scale codes -> ``2**(code - E8M0_BIAS)`` (float64); ``E8M0_NAN`` is NaN."""
    if codes.dtype != np.uint8:
        raise ValueError(f"E8M0 scale codes must be uint8, got {codes.dtype}")
    out = np.ldexp(1.0, codes.astype(np.int64) - E8M0_BIAS)
    return np.where(codes == E8M0_NAN, np.nan, out)


def decode_mx_raw(arrays: dict, cfg: dict, shape: tuple) -> np.ndarray:
    """MX block decode ``value(code) * 2**(scale - 127)`` in float64, trimmed to ``shape``; for a
    rotated config these are the rotated-domain values (no inverse rotation)."""
    bits, table = MX_ELEMENTS[cfg["element"]]
    g = cfg["block_size"]
    *lead, n, d = shape
    d_pad = -(-d // g) * g
    header = arrays["header"]
    if header.dtype != np.int64 or header.tolist() != [n, d]:
        raise ValueError(f"header {header.tolist()} does not match (N, D) = ({n}, {d})")
    scales = arrays["scales"]
    if scales.shape != (*lead, n, d_pad // g):
        raise ValueError(f"scales shape {scales.shape} does not match {(*lead, n, d_pad // g)}")
    codes = unpack_bits(arrays["codes"], bits, d_pad)
    if codes.shape != (*lead, n, d_pad):
        raise ValueError(f"codes shape {codes.shape} does not match {(*lead, n, d_pad)}")
    vals = table[codes].reshape(*lead, n, d_pad // g, g) * decode_e8m0(scales)[..., None]
    return vals.reshape(*lead, n, d_pad)[..., :d]


def encode_mx(x: np.ndarray, element: str, block: int, rule: str = "floor") -> tuple[np.ndarray, np.ndarray]:
    """float32 ``x [..., L]`` -> (element codes uint8 ``[..., L_pad]``, E8M0 codes ``[..., L_pad / block]``).

    Block scales: ``floor`` puts floor(log2(amax)) - emax (OCP MX v1.0); ``rceil`` the smallest
    power of two d' >= d of the float32 quotient d = fl32(amax / max) (cuBLAS block scaling)."""
    bits, table = MX_ELEMENTS[element]
    half = 1 << (bits - 1)
    grid = table[:half]
    finite = np.isfinite(grid)
    grid = grid[finite]                                      # positive codes 0.. in increasing value
    if not np.all(np.diff(grid) > 0):
        raise ValueError(f"{element}: positive codes are not increasing in value")
    vmax = grid[-1]
    emax = int(np.floor(np.log2(vmax)))
    x = np.asarray(x, dtype=np.float32)
    pad = (-x.shape[-1]) % block
    xp = np.concatenate([x, np.zeros((*x.shape[:-1], pad), np.float32)], axis=-1) if pad else x
    blocks = xp.astype(np.float64).reshape(*xp.shape[:-1], -1, block)
    amax = np.abs(blocks).max(axis=-1)
    if rule == "floor":
        _, e = np.frexp(amax)
        unbiased = e.astype(np.int64) - 1 - emax
    elif rule == "rceil":
        d = (amax.astype(np.float32) / np.float32(vmax)).astype(np.float64)
        m, e = np.frexp(d)
        unbiased = np.where(d == 0, -E8M0_BIAS, np.where(m == 0.5, e - 1, e)).astype(np.int64)
    else:
        raise ValueError(f"unknown MX scale rule {rule!r}")
    scale = np.clip(unbiased, -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    scale = np.where(amax == 0, 0, scale).astype(np.uint8)
    y = np.ldexp(blocks, (E8M0_BIAS - scale.astype(np.int64))[..., None])
    a = np.minimum(np.abs(y), vmax)
    hi = np.clip(np.searchsorted(grid, a, side="left"), 0, len(grid) - 1)
    lo = np.clip(hi - 1, 0, None)
    d_lo = a - grid[lo]
    d_hi = grid[hi] - a
    pick = np.where(d_hi < d_lo, hi, lo)
    pick = np.where((d_hi == d_lo) & (hi % 2 == 0), hi, pick)
    codes = pick.astype(np.uint8) | (np.signbit(y).astype(np.uint8) << np.uint8(bits - 1))
    return codes.reshape(xp.shape), scale


def decode_mx(arrays: dict, cfg: dict, shape: tuple) -> np.ndarray:
    if cfg.get("rotation"):
        raise ValueError("a rotated MX payload needs its rotation signs to be decoded (see audit_checks/mx_paths.py)")
    return decode_mx_raw(arrays, cfg, shape)


def encode_mx_payload(x: np.ndarray, cfg: dict) -> dict:
    """An unrotated MX payload of float32 ``x [..., N, D]``: element codes packed along the last axis
    (FP4 two to a byte), the E8M0 ``scales`` and the (N, D) header."""
    if cfg.get("rotation"):
        raise ValueError("a rotated MX payload needs its rotation signs to be encoded (see audit_checks/mx_paths.py)")
    bits, _ = MX_ELEMENTS[cfg["element"]]
    codes, scales = encode_mx(x, cfg["element"], cfg["block_size"], cfg.get("scale_rule", "floor"))
    return {"codes": pack_bits(codes, bits), "scales": scales, "header": np.array(x.shape[-2:], dtype=np.int64)}


def label_int_grouped(cfg: dict) -> str:
    """Bits and group size (the axis is the layout's: K per channel, V per token)."""
    return f"int{cfg.get('bits')}_grouped_g{cfg.get('group_size')}"


def label_mx(cfg: dict) -> str:
    """Element format and block, then ``_rceil`` and ``_hadamard`` where the scale rule or rotation says so."""
    return (f"mx_{cfg.get('element')}_b{cfg.get('block_size')}" + ("_rceil" if cfg.get("scale_rule") == "rceil" else "")
            + ("_hadamard" if cfg.get("rotation") else ""))


def _ds_count(cfg: dict, n: int, d: int) -> int:
    """Outliers of one ``[n, d]`` span: ``floor(outliers * n * d + 1/2)``."""
    return int(np.floor(float(cfg["outliers"]) * n * d + 0.5))


def _ds_dense_cfg(cfg: dict) -> dict:
    return {"kind": "int_grouped", "bits": cfg["bits"], "group_size": cfg["group_size"], "axis": cfg["axis"]}


def hadamard_signs(d: int, seed: int) -> np.ndarray:
    """The dense-and-sparse rotation's ``d`` signs (float64 ±1), by the audit: bit ``i`` (least
    significant first within each byte) of ``SHA-256(b"testbed.hadamard:<seed>:<k>")``, ``k = 0, 1,
    ..`` concatenated; a 1 bit is -1."""
    stream = b"".join(hashlib.sha256(f"testbed.hadamard:{int(seed)}:{k}".encode()).digest()
                      for k in range(-(-d // 256)))
    bits = np.unpackbits(np.frombuffer(stream, dtype=np.uint8), bitorder="little")[:d]
    return 1.0 - 2.0 * bits.astype(np.float64)


def _walsh_hadamard(y: np.ndarray, n: int) -> np.ndarray:
    """Each block of ``n`` along the last axis through the butterfly: at distance h = 1, 2, .., n/2,
    a pair (a, b) becomes (a + b, a - b), in float64 (unscaled)."""
    lead, d = y.shape[:-1], y.shape[-1]
    h = 1
    while h < n:
        z = y.reshape(*lead, d // (2 * h), 2, h)
        y = np.stack([z[..., 0, :] + z[..., 1, :], z[..., 0, :] - z[..., 1, :]], axis=-2).reshape(*lead, d)
        h *= 2
    return y


def hadamard_block(d: int) -> int:
    """The largest power of two dividing ``d``, at most 128."""
    return min(d & -d, 128)


def hadamard_rotate(x: np.ndarray, seed: int, inverse: bool = False) -> np.ndarray:
    """``x R`` (or ``x R^T``) along the last axis, ``R = diag(s) blockdiag(H_n) / sqrt(n)``; float32 out."""
    d = x.shape[-1]
    n, s = hadamard_block(d), hadamard_signs(d, seed)
    if inverse:
        return ((_walsh_hadamard(x.astype(np.float64), n) * (1.0 / math.sqrt(n))) * s).astype(np.float32)
    return (_walsh_hadamard(x.astype(np.float64) * s, n) * (1.0 / math.sqrt(n))).astype(np.float32)


def encode_dense_sparse(x: np.ndarray, cfg: dict) -> dict:
    """The audit's dense-and-sparse encoder (KVQuant's outliers over KIVI groups): per leading index
    the ``floor(p * N * D + 1/2)`` largest magnitudes (ties: lower flat index first) as float16 values
    at ascending flat indices (uint16 up to 65,536 elements per span, else int32); every other element
    by :func:`encode_int_grouped`, each outlier's slot first set to the smallest non-outlier of its
    group (0 in a group of outliers only)."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise ValueError(f"the dense-and-sparse encoder's input must be float32, got {x.dtype}")
    if not np.all(np.isfinite(x)):
        raise ValueError("the dense-and-sparse encoder's input holds a non-finite value")
    if cfg.get("rotation"):
        x = hadamard_rotate(x, cfg.get("seed", 0))
    *lead, n, d = x.shape
    flat = x.reshape(*lead, n * d)
    k = _ds_count(cfg, n, d)
    top = np.argsort(-np.abs(flat), axis=-1, kind="stable")[..., :k]
    index = np.sort(top, axis=-1)
    picked = np.take_along_axis(flat, index, axis=-1)
    if np.any(np.abs(picked) > FP16_MAX):
        raise ValueError("an outlier's magnitude exceeds float16")
    mask = np.zeros(flat.shape, dtype=bool)
    np.put_along_axis(mask, index, True, axis=-1)
    mask = mask.reshape(x.shape)
    g, axis = cfg["group_size"], cfg["axis"]
    red = -2 if axis == "channel" else -1
    xp, mp = _pad_edge(x, red, g), _pad_edge(mask, red, g)
    if axis == "channel":
        shape = (*lead, xp.shape[-2] // g, g, d)
    else:
        shape = (*lead, n, xp.shape[-1] // g, g)
    xg, mg = xp.reshape(shape), mp.reshape(shape)
    low = np.where(mg, np.float32(np.inf), xg).min(axis=red, keepdims=True)
    low = np.where(np.isinf(low), np.float32(0.0), low)
    filled = np.where(mg, low, xg).reshape(xp.shape)
    filled = filled[..., :n, :] if axis == "channel" else filled[..., :d]
    out = encode_int_grouped(np.ascontiguousarray(filled, dtype=np.float32), _ds_dense_cfg(cfg))
    out["outlier_values"] = picked.astype(np.float16)
    out["outlier_index"] = index.astype(np.uint16 if n * d <= 65536 else np.int32)
    return out


def decode_dense_sparse(arrays: dict, cfg: dict, shape: tuple) -> np.ndarray:
    """The dense part decoded as grouped integers, then each float16 outlier written over its slot."""
    *lead, n, d = shape
    values, index = arrays["outlier_values"], arrays["outlier_index"]
    k = _ds_count(cfg, n, d)
    want = np.uint16 if n * d <= 65536 else np.int32
    if values.dtype != np.float16 or values.shape != (*lead, k):
        raise ValueError(f"outlier_values must be float16 {[*lead, k]}, got {values.dtype} {list(values.shape)}")
    if index.dtype != want or index.shape != (*lead, k):
        raise ValueError(f"outlier_index must be {np.dtype(want).name} {[*lead, k]}, got {index.dtype} "
                         f"{list(index.shape)}")
    idx = index.astype(np.int64)
    if k and (idx.min() < 0 or idx.max() >= n * d or np.any(np.diff(idx, axis=-1) <= 0)):
        raise ValueError("outlier indices must be ascending, distinct and inside the span")
    x = decode_int_grouped(arrays, _ds_dense_cfg(cfg), shape).reshape(*lead, n * d).copy()
    np.put_along_axis(x, idx, values.astype(np.float32), axis=-1)
    x = x.reshape(shape)
    return hadamard_rotate(x, cfg.get("seed", 0), inverse=True) if cfg.get("rotation") else x


def label_dense_sparse(cfg: dict) -> str:
    """Bits, group size and the outlier fraction in units of 0.01 %."""
    return (f"int{cfg.get('bits')}_grouped_g{cfg.get('group_size')}_ds{float(cfg.get('outliers')) * 1e4:g}"
            + ("_hadamard" if cfg.get("rotation") else ""))


def codebook_nf_levels(bits: int) -> np.ndarray:
    """The NormalFloat levels of ``bits`` bits, by the audit (QLoRA's construction with an exact zero):
    with ``n = 2**bits`` and ``p = 1 - (1/(2n) + 1/(2(n - 1))) / 2``, the standard normal quantiles
    (``statistics.NormalDist().inv_cdf``) of ``n/2`` probabilities evenly spaced from ``p`` towards 1/2
    (``p`` included, 1/2 not) as positive levels, the negated quantiles of ``n/2 - 1`` such
    probabilities as negative levels, and 0; divided by the quantile of ``p``, sorted, rounded to
    float16 (+0 for the zero)."""
    if bits not in (2, 3, 4):
        raise ValueError(f"a codebook has 2, 3 or 4 bits, got {bits!r}")
    n = 1 << bits
    p = 1.0 - (1.0 / (2 * n) + 1.0 / (2 * (n - 1))) / 2.0
    inv = statistics.NormalDist().inv_cdf
    pos = [inv(p - (p - 0.5) * i / (n // 2)) for i in range(n // 2)]
    neg = [-inv(p - (p - 0.5) * i / (n // 2 - 1)) for i in range(n // 2 - 1)]
    vals = np.sort(np.array(pos + neg + [0.0]) / inv(p))
    return vals.astype(np.float16).astype(np.float64) + 0.0


def codebook_table(cfg: dict, d: int | None = None) -> np.ndarray:
    """A codebook config's levels as float64 ``[n]`` or ``[D, n]``: ``"nf"`` re-derived, or the config's
    table, which must hold float16 values, strictly increasing along its last axis, in [-1, 1], of
    ``2**bits`` per row (one row, or one per channel for ``axis = "channel"`` with ``D = d``)."""
    bits = cfg.get("bits")
    if bits not in (2, 3, 4) or isinstance(bits, bool):
        raise ValueError(f"a codebook has 2, 3 or 4 bits, got {bits!r}")
    n = 1 << bits
    levels = cfg.get("levels")
    if levels == "nf":
        return codebook_nf_levels(bits)
    if isinstance(levels, str) or not isinstance(levels, list):
        raise ValueError(f"codebook levels must be 'nf' or a list, got {levels!r}")
    t = np.asarray(levels, dtype=np.float64)
    per_channel = t.ndim == 2 and cfg.get("axis") == "channel"
    if not (t.ndim == 1 or per_channel) or t.shape[-1] != n or (per_channel and d is not None and t.shape[0] != d):
        raise ValueError(f"codebook table of shape {list(t.shape)} for {bits} bits, axis {cfg.get('axis')!r}"
                         + (f", D = {d}" if d is not None else ""))
    if not np.all(np.isfinite(t)) or np.any(t.astype(np.float16).astype(np.float64) != t):
        raise ValueError("codebook levels must be finite float16 values")
    if np.any(np.abs(t) > 1) or np.any(np.diff(t, axis=-1) <= 0):
        raise ValueError("codebook levels must be strictly increasing within [-1, 1]")
    return t + 0.0


def codebook_grouped(x: np.ndarray, cfg: dict) -> tuple[np.ndarray, int]:
    """float32 ``x [..., N, D]`` edge-padded and grouped: ``[..., N_pad/G, G, D]`` (channel) or
    ``[..., N, D_pad/G, G]`` (token), with the axis the group members lie on."""
    g, axis = cfg["group_size"], cfg["axis"]
    *lead, n, d = x.shape
    if axis == "channel":
        xp = _pad_edge(x, -2, g)
        return xp.reshape(*lead, xp.shape[-2] // g, g, d), -2
    if axis == "token":
        xp = _pad_edge(x, -1, g)
        return xp.reshape(*lead, n, xp.shape[-1] // g, g), -1
    raise ValueError(f"unknown axis {axis!r}")


def codebook_normalized(x: np.ndarray, cfg: dict) -> tuple:
    """float32 ``x [..., N, D]`` as the codebook normalizes it, in its groups (:func:`codebook_grouped`):
    ``(u, scale16, offset16, live, axis)``: ``u = (x - offset16) / scale16`` in float64 (a group of zero
    scale divided by 1), the float16 scale and offset and ``live`` (scale > 0) with the group's member
    axis kept (size 1), and that axis."""
    grouped, red = codebook_grouped(x, cfg)
    mn, mx = grouped.min(axis=red, keepdims=True), grouped.max(axis=red, keepdims=True)
    with np.errstate(over="ignore"):
        scale16 = ((mx - mn) * np.float32(0.5)).astype(np.float16)
        offset16 = ((mx + mn) * np.float32(0.5) + np.float32(0.0)).astype(np.float16)
    if np.any(np.isinf(scale16)) or np.any(np.isinf(offset16)):
        raise ValueError("a group's range or midpoint exceeds float16")
    s, z = scale16.astype(np.float32), offset16.astype(np.float32)
    live = s > 0
    return ((grouped - z) / np.where(live, s, np.float32(1.0))).astype(np.float64), scale16, offset16, live, red


def encode_codebook(x: np.ndarray, cfg: dict) -> dict:
    """The audit's codebook encoder: float32 ``x [..., N, D]`` in KIVI's groups (as
    :func:`encode_int_grouped` forms them), per group in float32 ``offset = (max + min) * 0.5`` (+0 for
    a zero) and ``scale = (max - min) * 0.5`` rounded to float16; ``u = (x - offset16) / scale16`` and
    the code is the number of the table's midpoints (float64) strictly below ``u`` (0 in a group of zero
    scale), packed along the last axis; arrays ``codes``, ``scale``, ``offset``, ``header``."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise ValueError(f"the codebook encoder's input must be float32, got {x.dtype}")
    if not np.all(np.isfinite(x)):
        raise ValueError("the codebook encoder's input holds a non-finite value")
    *lead, n, d = x.shape
    table = codebook_table(cfg, d)
    u, scale16, offset16, live, red = codebook_normalized(x, cfg)
    scale16, offset16 = scale16.squeeze(red), offset16.squeeze(red)
    mids = (table[..., 1:] + table[..., :-1]) / 2.0
    codes = np.zeros(u.shape, dtype=np.int64)
    for k in range(mids.shape[-1]):  # a per-channel table's column k is a [D] row along the channel axis
        codes += u > mids[..., k]
    codes = np.where(live, codes, 0).astype(np.uint8)
    codes = codes.reshape(*lead, -1, d) if cfg["axis"] == "channel" else codes.reshape(*lead, n, -1)
    return {"codes": pack_bits(codes, cfg["bits"]), "scale": scale16, "offset": offset16,
            "header": np.array([n, d], dtype=np.int64)}


def decode_codebook(arrays: dict, cfg: dict, shape: tuple) -> np.ndarray:
    """Codebook decode: ``level[code] * scale16 + offset16`` in float32 (each channel's own table where
    the table is per channel)."""
    g, axis, bits = cfg["group_size"], cfg["axis"], cfg["bits"]
    *lead, n, d = shape
    table = codebook_table(cfg, d).astype(np.float32)
    scale, offset = arrays["scale"], arrays["offset"]
    if scale.dtype != np.float16 or offset.dtype != np.float16 or scale.shape != offset.shape:
        raise ValueError("scale and offset must be float16 arrays of one shape")
    s, z = scale.astype(np.float32), offset.astype(np.float32)
    if axis == "channel":
        n_pad = -(-n // g) * g
        if s.shape != (*lead, n_pad // g, d):
            raise ValueError(f"scale shape {s.shape} does not match {(*lead, n_pad // g, d)}")
        codes = unpack_bits(arrays["codes"], bits, d).astype(np.int64)
        if codes.shape != (*lead, n_pad, d):
            raise ValueError(f"codes shape {codes.shape} does not match {(*lead, n_pad, d)}")
        vals = table[codes] if table.ndim == 1 else table[np.arange(d), codes]
        x = vals.reshape(*lead, n_pad // g, g, d) * s[..., None, :] + z[..., None, :]
        return x.reshape(*lead, n_pad, d)[..., :n, :]
    if axis == "token":
        d_pad = -(-d // g) * g
        if s.shape != (*lead, n, d_pad // g):
            raise ValueError(f"scale shape {s.shape} does not match {(*lead, n, d_pad // g)}")
        codes = unpack_bits(arrays["codes"], bits, d_pad).astype(np.int64)
        if codes.shape != (*lead, n, d_pad):
            raise ValueError(f"codes shape {codes.shape} does not match {(*lead, n, d_pad)}")
        x = table[codes].reshape(*lead, n, d_pad // g, g) * s[..., None] + z[..., None]
        return x.reshape(*lead, n, d_pad)[..., :d]
    raise ValueError(f"unknown axis {axis!r}")


def label_codebook(cfg: dict) -> str:
    """Bits, ``nf`` or ``cb`` with the first 8 hex digits of SHA-256 over ``"<shape>:"`` and the table's
    little-endian float16 bytes (row-major), and the group size."""
    if cfg.get("levels") == "nf":
        tag = "nf"
    else:
        t = np.ascontiguousarray(codebook_table(cfg).astype("<f2"))
        tag = "cb" + hashlib.sha256(f"{list(t.shape)}:".encode() + t.tobytes()).hexdigest()[:8]
    return f"int{cfg.get('bits')}_{tag}_g{cfg.get('group_size')}"


class Scheme(NamedTuple):
    """What the audit knows of one quantizer kind, each written from the kind's documented definition:
    ``decode(arrays, cfg, shape) -> x_hat``; ``encode(x, cfg) -> arrays`` (header included), compared
    byte for byte with a stored payload, or None where the payload is not deterministic from the
    input; ``label(cfg)``, the scheme's label in rows (the residual window's ``scheme``)."""

    decode: Callable[[dict, dict, tuple], np.ndarray]
    encode: Callable[[np.ndarray, dict], dict] | None
    label: Callable[[dict], str]


# One entry per quantizer kind (a config's "kind"): a kind missing here is an error wherever the
# audit meets it, never a fallback.
SCHEMES: dict[str, Scheme] = {
    "int_grouped": Scheme(decode_int_grouped, encode_int_grouped, label_int_grouped),
    "mx": Scheme(decode_mx, encode_mx_payload, label_mx),
    "int_dense_sparse": Scheme(decode_dense_sparse, encode_dense_sparse, label_dense_sparse),
    "int_codebook": Scheme(decode_codebook, encode_codebook, label_codebook),
}


def scheme(cfg: dict) -> Scheme:
    """The audit's entry for the quantizer config ``cfg`` (by its ``"kind"``); an unknown kind raises
    a ValueError naming it."""
    kind = cfg.get("kind") if isinstance(cfg, dict) else None
    if kind not in SCHEMES:
        raise ValueError(f"the audit knows no quantizer kind {kind!r} (known: {', '.join(sorted(SCHEMES))}); "
                         "a new kind needs its decoder, encoder and label in audit_checks/schemes.py (SCHEMES)")
    return SCHEMES[kind]


def decode_tensor(arrays: dict, cfg: dict, shape: tuple) -> np.ndarray:
    """One quantizer's payload decoded by the audit's decoder for its kind."""
    return scheme(cfg).decode(arrays, cfg, shape)


def encode_tensor(x: np.ndarray, cfg: dict) -> dict:
    """The stored arrays (header included) of one quantizer's payload of ``x``, by the audit's encoders."""
    enc = scheme(cfg).encode
    if enc is None:
        raise ValueError(f"quantizer kind {cfg['kind']!r} has no audit encoder: its payload is not deterministic "
                         "from the input")
    return enc(x, cfg)


def quantizer_label(cfg: dict) -> str:
    """The scheme label of one quantizer config, by the audit's label for its kind."""
    return scheme(cfg).label(cfg)


def encode_residual_window(k: np.ndarray, v: np.ndarray, cfg: dict) -> dict:
    """Every array of a residual-window payload of float32 ``k``, ``v [..., N, D]``, by the audit:
    tokens ``[0, S)`` stored as ``sink.k/v`` and ``[max(S, N - R), N)`` as ``recent.k/v`` (float32,
    exactly the inputs), the span between encoded by the key and value quantizers (``key.*``,
    ``value.*``, their own headers dropped), and one (N, D) header."""
    *_, n, d = k.shape
    start = min(cfg["sink"], n)
    stop = max(start, n - cfg["recent"])
    out = {}
    if start > 0:
        out["sink.k"], out["sink.v"] = k[..., :start, :], v[..., :start, :]
    if stop > start:
        for label, x in (("key", k), ("value", v)):
            enc = encode_tensor(np.ascontiguousarray(x[..., start:stop, :]), cfg[label])
            out.update({f"{label}.{a}": arr for a, arr in enc.items() if a != "header"})
    if stop < n:
        out["recent.k"], out["recent.v"] = k[..., stop:, :], v[..., stop:, :]
    out["header"] = np.array([n, d], dtype=np.int64)
    return out


def _as_bits(a: np.ndarray) -> np.ndarray:
    """The array's elements as unsigned integers of its item size (compares float bit patterns)."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a


def payload_differences(stored: dict, want: dict, what: str = "the input") -> list[str]:
    """One line per array where the stored payload and the audit's re-encoding differ: a missing or
    extra array, another dtype or shape, or the first element (C order) whose bytes differ."""
    lines = []
    for name in want:
        if name not in stored:
            lines.append(f"{name}: missing from the stored payload (the audit's re-encoding of {what} has it)")
            continue
        got, exp = np.asarray(stored[name]), np.asarray(want[name])
        if got.dtype != exp.dtype or got.shape != exp.shape:
            lines.append(f"{name}: stored payload is {got.dtype} {list(got.shape)}, the audit's re-encoding of "
                         f"{what} is {exp.dtype} {list(exp.shape)}")
            continue
        diff = np.flatnonzero(_as_bits(got).ravel() != _as_bits(exp).ravel())
        if diff.size:
            idx = [int(i) for i in np.unravel_index(diff[0], got.shape)]
            lines.append(f"{name}: stored payload differs from the audit's re-encoding of {what} at element "
                         f"{int(diff[0])} {idx} ({diff.size} of {got.size} elements differ)")
    for name in stored:
        if name not in want:
            lines.append(f"{name}: stored payload array that the audit's re-encoding of {what} does not produce")
    return lines


def decode_residual_window(arrays: dict, cfg: dict, shape: tuple) -> tuple[np.ndarray, np.ndarray]:
    """Rebuild float32 K and V from a residual-window payload."""
    *lead, n, d = shape
    header = arrays["header"]
    if header.dtype != np.int64 or header.tolist() != [n, d]:
        raise ValueError(f"header {header.tolist()} does not match (N, D) = ({n}, {d})")
    start = min(cfg["sink"], n)
    stop = max(start, n - cfg["recent"])
    ks, vs = [], []
    if start > 0:
        ks.append(arrays["sink.k"])
        vs.append(arrays["sink.v"])
    if stop > start:
        span = (*lead, stop - start, d)
        for label, out in (("key", ks), ("value", vs)):
            inner = {a[len(label) + 1:]: x for a, x in arrays.items() if a.startswith(label + ".")}
            # the pair shares one stored header; decoders that check theirs get the span's (N, D)
            inner["header"] = np.array([stop - start, d], dtype=np.int64)
            out.append(np.asarray(decode_tensor(inner, cfg[label], span), dtype=np.float32))
    if stop < n:
        ks.append(arrays["recent.k"])
        vs.append(arrays["recent.v"])
    for x in ks + vs:
        if x.dtype != np.float32:
            raise ValueError(f"residual window part has dtype {x.dtype}, expected float32")
    return np.concatenate(ks, axis=-2), np.concatenate(vs, axis=-2)
