"""Fused CPU kernels (numba) for the grouped integer and MX quantizers: the fast path.

Each kernel reads a block of the input once into cache (one group of tokens for K, one token
for V), computes the group statistics, rounds them to float16 exactly as ``Tensor.half()`` does
(round to nearest even, subnormals, overflow to inf), and writes packed codes, in parallel over
blocks. They reproduce the torch reference implementations in ``intgrouped.py`` bit for bit (the
same float32 operations in the same order, no fast-math); ``tests/quant/test_fast_path.py``
checks that on random shapes. The reference path is used when numba is missing, on non-CPU
devices, for small tensors (where the kernel's call overhead dominates), and when
``TESTBED_FAST=0``.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

try:  # numba is a declared dependency; keep the testbed usable if a platform lacks a wheel
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only where numba is missing
    numba = None

__all__ = ["available", "use_fast", "empty_float32", "float16_round", "int_quantize_channel", "int_quantize_token",
           "int_dequantize_channel", "int_dequantize_token", "mx_quantize", "mx_dequantize"]

MIN_FAST_ELEMENTS = 1 << 16


def available() -> bool:
    return numba is not None


def use_fast(x) -> bool:
    """Whether the fused kernels serve this tensor (CPU, float32-convertible, large enough)."""
    if numba is None or os.environ.get("TESTBED_FAST", "1") == "0" or not isinstance(x, torch.Tensor):
        return False  # anything that is not a tensor goes to the reference path, which refuses it clearly
    return x.device.type == "cpu" and x.numel() >= MIN_FAST_ELEMENTS


def empty_float32(shape, device="cpu"):
    """An uninitialized float32 tensor; on the CPU allocated by numpy, which asks the kernel for
    transparent huge pages on large arrays, so first-touch page faults cost a fraction of what a
    plain ``torch.empty`` of 128 MiB costs (measured: ~20 ms against ~55 ms to fill)."""
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=torch.float32, device=device)
    return torch.from_numpy(np.empty(tuple(shape), np.float32))


def set_threads(n: int) -> None:
    if numba is not None:
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


if numba is not None:

    @njit(inline="always", cache=True)
    def _f16(v):
        """float32 -> nearest float16 (ties to even) -> float32, exactly as IEEE conversion does."""
        a = abs(v)
        if a == 0.0 or a != a:
            return v
        if a >= np.float32(65520.0):
            return np.float32(np.inf) if v > 0 else np.float32(-np.inf)
        if a < np.float32(6.103515625e-05):  # float16 subnormal range: quantum 2^-24
            q = np.float32(np.rint(a * np.float32(16777216.0)) * np.float32(5.9604644775390625e-08))
        else:
            m, e = math.frexp(a)
            quantum = np.float32(math.ldexp(1.0, e - 11))
            q = np.float32(np.rint(a / quantum) * quantum)
        return q if v > 0 else -q

    @njit(cache=True)
    def _f16_array(a):
        out = np.empty_like(a)
        for i in range(a.size):
            out.flat[i] = _f16(a.flat[i])
        return out

    @njit(parallel=True, cache=True)
    def _int_q_channel(x, g, bits, codes, scale, zero, bad):
        # x [B, T, D] float32; codes [B, Tp, ceil(D/per)]; scale, zero [B, Tp/g, D] float32 (float16 values)
        B, T, D = x.shape
        ng = scale.shape[1]
        per = 8 // bits
        qmax = np.float32((1 << bits) - 1)
        nbytes = codes.shape[2]
        for blk in prange(B * ng):
            b = blk // ng
            gi = blk % ng
            t0 = gi * g
            mn = np.empty(D, np.float32)
            mx = np.empty(D, np.float32)
            first = min(t0, T - 1)
            for d in range(D):
                mn[d] = x[b, first, d]
                mx[d] = x[b, first, d]
            nan = 0
            for t in range(t0 + 1, min(t0 + g, T)):
                for d in range(D):
                    v = x[b, t, d]
                    nan += v != v
                    if v < mn[d]:
                        mn[d] = v
                    if v > mx[d]:
                        mx[d] = v
            for d in range(D):
                if not (np.isfinite(mn[d]) and np.isfinite(mx[d])):
                    nan += 1
            bad[blk] = nan > 0
            s = np.empty(D, np.float32)
            z = np.empty(D, np.float32)
            live = np.empty(D, np.float32)
            for d in range(D):
                s[d] = _f16(np.float32((mx[d] - mn[d]) / qmax))
                z[d] = _f16(mn[d])
                scale[b, gi, d] = s[d]
                zero[b, gi, d] = z[d]
                live[d] = np.float32(1.0) if s[d] > 0 else np.float32(0.0)
                if s[d] <= 0:
                    s[d] = np.float32(1.0)
            for t in range(t0, t0 + g):
                src = min(t, T - 1)  # padded rows repeat the edge token
                for k in range(nbytes):
                    byte = 0
                    for j in range(per):
                        d = k * per + j
                        if d < D:
                            c = np.rint((x[b, src, d] - z[d]) / s[d])
                            c = min(max(c, np.float32(0.0)), qmax) * live[d]
                            byte |= int(c) << (bits * j)
                    codes[b, t, k] = byte

    ROWS_PER_TASK = 64

    @njit(parallel=True, cache=True)
    def _int_q_token(x, g, bits, codes, scale, zero, bad):
        # x [B, T, D]; codes [B, T, ceil(Dp/per)]; scale, zero [B, T, Dp/g]; one task = 64 rows
        B, T, D = x.shape
        ng = scale.shape[2]
        per = 8 // bits
        qmax = np.float32((1 << bits) - 1)
        nbytes = codes.shape[2]
        dp = ng * g
        rows = B * T
        ntask = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
        for task in prange(ntask):
            s = np.empty(ng, np.float32)
            z = np.empty(ng, np.float32)
            live = np.empty(ng, np.float32)
            c = np.zeros(nbytes * per, np.uint8)
            nan = 0
            for row in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
                b = row // T
                t = row - b * T
                for gi in range(ng):
                    d0 = gi * g
                    first = min(d0, D - 1)
                    mn = x[b, t, first]
                    mx = mn
                    for d in range(d0 + 1, min(d0 + g, D)):
                        v = x[b, t, d]
                        nan += v != v
                        mn = min(mn, v)
                        mx = max(mx, v)
                    if not (np.isfinite(mn) and np.isfinite(mx)):
                        nan += 1
                    sv = _f16(np.float32((mx - mn) / qmax))
                    zv = _f16(mn)
                    scale[b, t, gi] = sv
                    zero[b, t, gi] = zv
                    lv = np.float32(1.0) if sv > 0 else np.float32(0.0)
                    if sv <= 0:
                        sv = np.float32(1.0)
                    for j in range(g):
                        d = min(d0 + j, D - 1)  # padded features repeat the edge feature
                        cv = np.rint((x[b, t, d] - zv) / sv)
                        c[d0 + j] = np.uint8(min(max(cv, np.float32(0.0)), qmax) * lv)
                for k in range(nbytes):
                    byte = 0
                    for j in range(per):
                        byte |= int(c[k * per + j]) << (bits * j)
                    codes[b, t, k] = byte
            bad[task] = nan > 0

    @njit(parallel=True, cache=True)
    def _int_dq_channel(codes, scale, zero, g, bits, out):
        # codes are unpacked a row at a time into a float buffer, then one multiply-add per feature
        B, T, D = out.shape
        per = 8 // bits
        mask = (1 << bits) - 1
        nbytes = codes.shape[2]
        rows = B * T
        ntask = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
        for task in prange(ntask):
            c = np.empty(nbytes * per, np.float32)
            for row in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
                b = row // T
                t = row - b * T
                gi = t // g
                for k in range(nbytes):
                    byte = codes[b, t, k]
                    for j in range(per):
                        c[k * per + j] = np.float32((byte >> (bits * j)) & mask)
                for d in range(D):
                    out[b, t, d] = c[d] * scale[b, gi, d] + zero[b, gi, d]

    @njit(parallel=True, cache=True)
    def _int_dq_token(codes, scale, zero, g, bits, out):
        B, T, D = out.shape
        per = 8 // bits
        mask = (1 << bits) - 1
        ng = scale.shape[2]
        rows = B * T
        ntask = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
        for task in prange(ntask):
            c = np.empty(codes.shape[2] * per, np.float32)
            for row in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
                b = row // T
                t = row - b * T
                for k in range(codes.shape[2]):
                    byte = codes[b, t, k]
                    for j in range(per):
                        c[k * per + j] = np.float32((byte >> (bits * j)) & mask)
                for gi in range(ng):
                    sv = scale[b, t, gi]
                    zv = zero[b, t, gi]
                    for j in range(min(g, D - gi * g)):
                        out[b, t, gi * g + j] = c[gi * g + j] * sv + zv


    @njit(inline="always", cache=True)
    def _mx_encode(y, emin, mbits, bias, maxv, sign_shift):
        """Element code of ``y`` (float64, already divided by the block scale): saturate, then round
        to nearest even on the quantum of its binade; a carry into the next binade falls out of the
        arithmetic ``(e + bias - 1) * 2**mbits + q``."""
        neg = math.copysign(1.0, y) < 0
        a = abs(y)
        if a > maxv:
            a = maxv
        code = 0
        if a > 0:
            m, ex = math.frexp(a)
            e = ex - 1
            if e < emin:
                e = emin
            q = int(np.rint(math.ldexp(a, mbits - e)))
            code = (e + bias - 1) * (1 << mbits) + q
        if neg:
            code |= 1 << sign_shift
        return code

    @njit(inline="always", cache=True)
    def _mx_encode_bits(xb, x, sc, emin, emax, mbits, bias, maxv, maxbits, maxcode, sign_shift):
        """Element code from the float32 bit pattern ``xb`` of ``x``: y = x * 2**(127 - sc) has the
        same mantissa and exponent ``Ex - sc``, so saturation is a compare of bit patterns and
        round-to-nearest-even is integer arithmetic on the mantissa. Values that are float32
        subnormal or fall into the element's subnormal range take the float64 route."""
        ax = xb & 0x7FFFFFFF
        ex = ax >> 23
        ey = ex - sc
        if ex == 0 or ey < emin:
            return _mx_encode(np.float64(x) * math.ldexp(1.0, 127 - sc), emin, mbits, bias, maxv, sign_shift)
        code = 0
        yb = ax + ((127 - sc) << 23)
        if yb > maxbits:
            code = maxcode
        else:
            shift = 23 - mbits
            mant = ax & 0x7FFFFF
            keep = mant >> shift
            rem = mant & ((1 << shift) - 1)
            half = 1 << (shift - 1)
            up = 1 if (rem > half or (rem == half and (keep & 1) == 1)) else 0
            code = ((ey + bias) << mbits) + keep + up
        if xb >> 31:
            code |= 1 << sign_shift
        return code

    @njit(parallel=True, cache=True)
    def _mx_q(x, xi, block, emax, emin, mbits, bias, maxv, maxbits, maxcode, bits, codes, scales, bad):
        # x [R, D] float32 and its uint32 view xi; codes [R, ceil(D_pad * bits / 8)]; scales [R, D_pad / block]
        R, D = x.shape
        nb = scales.shape[1]
        sign_shift = bits - 1
        per = 8 // bits
        for r in prange(R):
            nan = 0
            for bi in range(nb):
                d0 = bi * block
                amax = np.float32(0.0)
                for d in range(d0, min(d0 + block, D)):
                    v = abs(x[r, d])
                    nan += v != v
                    amax = max(amax, v)
                if amax == np.inf:
                    nan += 1
                sc = 0
                if amax > 0:
                    m, ex = math.frexp(amax)
                    u = min(max(ex - 1 - emax, -127), 127)
                    sc = u + 127
                scales[r, bi] = sc
                if per == 1:
                    # branch-free over the block (vectorizable); elements in the float32 or element
                    # subnormal range are flagged and redone by the exact routine
                    shift = 23 - mbits
                    half = 1 << (shift - 1)
                    low = (1 << shift) - 1
                    rebias = (127 - sc) << 23
                    slow = 0
                    for d in range(d0, min(d0 + block, D)):
                        xb = np.int64(xi[r, d])
                        ax = xb & 0x7FFFFFFF
                        ex = ax >> 23
                        ey = ex - sc
                        keep = (ax & 0x7FFFFF) >> shift
                        rem = ax & low
                        up = np.int64(rem > half) | (np.int64(rem == half) & (keep & 1))
                        code = ((ey + bias) << mbits) + keep + up
                        code = maxcode if ax + rebias > maxbits else code
                        slow += np.int64(ex == 0) | np.int64(ey < emin)
                        codes[r, d] = (code & 0x7F) | ((xb >> 31) << sign_shift)
                    if slow:
                        for d in range(d0, min(d0 + block, D)):
                            codes[r, d] = _mx_encode_bits(np.int64(xi[r, d]), x[r, d], sc, emin, emax, mbits,
                                                          bias, maxv, maxbits, maxcode, sign_shift)
                    for d in range(max(d0, D), d0 + block):
                        codes[r, d] = 0
                else:
                    for j in range(0, block, per):
                        byte = 0
                        for k in range(per):
                            d = d0 + j + k
                            if d < D:
                                c = _mx_encode_bits(np.int64(xi[r, d]), x[r, d], sc, emin, emax, mbits, bias,
                                                    maxv, maxbits, maxcode, sign_shift)
                                byte |= c << (bits * k)
                        codes[r, (d0 + j) // per] = byte
            bad[r] = nan > 0

    @njit(parallel=True, cache=True)
    def _mx_dq(codes, scales, lut, block, bits, out):
        R, D = out.shape
        per = 8 // bits
        mask = (1 << bits) - 1
        nb = scales.shape[1]
        for r in prange(R):
            for bi in range(nb):
                s = math.ldexp(1.0, int(scales[r, bi]) - 127)
                for j in range(block):
                    d = bi * block + j
                    if d >= D:
                        break
                    if per == 1:
                        c = codes[r, d]
                    else:
                        c = (codes[r, d // per] >> (bits * (d % per))) & mask
                    out[r, d] = np.float32(lut[c] * s)


def mx_quantize(x: np.ndarray, block: int, ebits: int, mbits: int, bias: int, maxv: float, emax: int):
    """x [R, D] float32 -> (codes uint8 [R, D_pad*bits/8], scales uint8 [R, D_pad/block], any non-finite)."""
    R, D = x.shape
    bits = 1 + ebits + mbits
    nb = _ceil_div(D, block)
    codes = np.empty((R, nb * block * bits // 8), np.uint8)
    scales = np.empty((R, nb), np.uint8)
    bad = np.zeros(R, np.bool_)
    x = np.ascontiguousarray(x, dtype=np.float32)
    maxbits = int(np.array(maxv, np.float32).view(np.uint32))
    maxcode = ((emax + bias) << mbits) | ((1 << mbits) - 1) if ebits != 4 else 0x7E  # E4M3: S.1111.111 is NaN
    _mx_q(x, x.view(np.uint32), block, emax, 1 - bias, mbits, bias, float(maxv), maxbits, maxcode, bits,
          codes, scales, bad)
    return codes, scales, bool(bad.any())


def mx_dequantize(codes: np.ndarray, scales: np.ndarray, lut: np.ndarray, block: int, bits: int, d: int) -> np.ndarray:
    """Inverse of :func:`mx_quantize`: float32 [R, d]; ``lut`` is the float64 value of every code."""
    out = np.empty((codes.shape[0], d), np.float32)
    _mx_dq(codes, scales, lut, block, bits, out)
    return out


def float16_round(a: np.ndarray) -> np.ndarray:
    """float32 array rounded to float16 values (kept as float32) by the kernel's own routine."""
    return _f16_array(np.ascontiguousarray(a, dtype=np.float32))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _slabs(x: np.ndarray):
    """Yield ``(b0, b1)`` ranges over the first axis such that ``x[b0:b1]`` is C-contiguous: all of
    it when ``x`` is, one slab at a time when only the inner [T, D] slabs are (a token span cut out
    of a [B, N, D] cache), and None when neither holds (the caller copies)."""
    if x.flags.c_contiguous:
        yield 0, x.shape[0]
        return
    if x.shape[0] and all(x[b:b + 1].flags.c_contiguous for b in range(x.shape[0])):
        for b in range(x.shape[0]):
            yield b, b + 1
        return
    yield None


def _over_slabs(kernel, x, outs, *args):
    """Run ``kernel(x_slab, *args, *out_slabs)`` over contiguous slabs of ``x`` (copying if needed)."""
    for span in _slabs(x):
        if span is None:
            kernel(np.ascontiguousarray(x), *args, *outs)
        else:
            b0, b1 = span
            kernel(x[b0:b1], *args, *(o[b0:b1] for o in outs))


def int_quantize_channel(x: np.ndarray, bits: int, g: int):
    """x [B, T, D] float32 -> (codes uint8 [B, Tp, ceil(D*bits/8)], scale f32, zero f32 [B, Tp/g, D],
    any non-finite input)."""
    B, T, D = x.shape
    ng = _ceil_div(T, g)
    codes = np.empty((B, ng * g, _ceil_div(D, 8 // bits)), np.uint8)
    scale = np.empty((B, ng, D), np.float32)
    zero = np.empty((B, ng, D), np.float32)
    bad = np.zeros((B, ng), np.bool_)

    def run(xs, g_, bits_, c, s, z, bd):
        _int_q_channel(xs, g_, bits_, c, s, z, bd.reshape(-1))

    _over_slabs(run, x, (codes, scale, zero, bad), g, bits)
    return codes, scale, zero, bool(bad.any())


def int_quantize_token(x: np.ndarray, bits: int, g: int):
    """x [B, T, D] float32 -> (codes uint8 [B, T, ceil(Dp*bits/8)], scale f32, zero f32 [B, T, Dp/g],
    any non-finite input)."""
    B, T, D = x.shape
    ng = _ceil_div(D, g)
    codes = np.empty((B, T, _ceil_div(ng * g, 8 // bits)), np.uint8)
    scale = np.empty((B, T, ng), np.float32)
    zero = np.empty((B, T, ng), np.float32)
    flags = []

    def run(xs, g_, bits_, c, s, z):
        bd = np.zeros(-(-(xs.shape[0] * xs.shape[1]) // ROWS_PER_TASK), np.bool_)
        _int_q_token(xs, g_, bits_, c, s, z, bd)
        flags.append(bool(bd.any()))

    _over_slabs(run, x, (codes, scale, zero), g, bits)
    return codes, scale, zero, any(flags)


def _dequantize(kernel, codes, scale, zero, g, bits, n, d, out):
    if out is None:
        out = np.empty((codes.shape[0], n, d), np.float32)
    for span in _slabs(out):
        if span is None:
            tmp = np.empty(out.shape, np.float32)
            kernel(codes, scale, zero, g, bits, tmp)
            out[...] = tmp
        else:
            b0, b1 = span
            kernel(codes[b0:b1], scale[b0:b1], zero[b0:b1], g, bits, out[b0:b1])
    return out


def int_dequantize_channel(codes, scale, zero, g: int, bits: int, n: int, d: int, out=None) -> np.ndarray:
    """Decode into ``out`` ([B, n, d] float32, may be a token span of a larger cache) or a new array."""
    return _dequantize(_int_dq_channel, codes, scale, zero, g, bits, n, d, out)


def int_dequantize_token(codes, scale, zero, g: int, bits: int, n: int, d: int, out=None) -> np.ndarray:
    return _dequantize(_int_dq_token, codes, scale, zero, g, bits, n, d, out)
