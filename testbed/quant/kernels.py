"""Fused CPU kernels (numba) for the grouped integer and MX quantizers: the fast path.

Each kernel reads a block of the input once into cache (one group of tokens for K, one token
for V), computes the group statistics, rounds them to float16 exactly as ``Tensor.half()`` does
(round to nearest even, subnormals, overflow to inf), and writes packed codes, in parallel over
blocks. They reproduce the torch reference implementations in ``intgrouped.py`` and ``mx.py`` bit
for bit (the same float32 operations, no fast-math; a group's min and max are exact in any scan
order, and a zero minimum or range is stored as +0 on both paths); ``tests/quant/test_fast_path.py``
checks the stored bytes on random shapes. The reference path is used when numba is missing, on non-CPU
devices, for small tensors (where the kernel's call overhead dominates), and when
``TESTBED_FAST=0``.
"""

from __future__ import annotations

import functools
import math
import os
import platform

import numpy as np
import torch

from .constants import E8M0_BIAS

try:  # numba is a declared dependency; keep the testbed usable if a platform lacks a wheel
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only where numba is missing
    numba = None

__all__ = ["available", "use_fast", "empty_float32", "parallel_kernel", "float16_round", "float16_bits", "int_quantize_channel",
           "int_quantize_token",
           "int_dequantize_channel", "int_dequantize_token", "mx_quantize", "mx_dequantize", "F16_VALUES"]

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


def _keeps_torch_threads(fn):
    """Run ``fn`` and give torch back its intra-op thread count. numba's threading layer (started
    by ``numba.set_num_threads`` or a parallel launch) can reset the OpenMP thread count that torch
    reads: a run pinned to one torch thread would compute every reduction after it with all cores,
    so its last bits would depend on the machine (the capture manifest caught it as
    ``torch_threads`` 1 -> 2)."""
    @functools.wraps(fn)
    def kept(*args, **kwargs):
        threads = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
    return kept


def parallel_kernel(**options):
    """``njit(parallel=True, cache=True, **options)`` for a kernel launched from Python, which
    leaves torch's thread count as it found it: every parallel numba kernel of the package is
    declared with it."""
    def declare(fn):
        return _keeps_torch_threads(njit(parallel=True, cache=True, **options)(fn))
    return declare


@_keeps_torch_threads
def set_threads(n: int) -> None:
    if numba is not None:
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


if numba is not None:
    from llvmlite import binding as _llvm
    from llvmlite import ir as _ir
    from numba import types as _types
    from numba.extending import intrinsic

    # float32 -> float16 -> float32 through the hardware conversion (F16C on x86-64, native on
    # ARM): one instruction, vectorizable, IEEE round-to-nearest-even with subnormals and overflow
    # to inf. x86 CPUs without F16C would need a runtime-library call, so they take the software
    # routine below instead, as do other architectures (same results; tests/quant/test_fast_path.py).
    # ``TESTBED_F16=soft`` forces the software routine (tests; give it its own NUMBA_CACHE_DIR,
    # since numba's cache keys on the CPU, not on this choice).
    _MACHINE = platform.machine().lower()
    if _MACHINE in ("x86_64", "amd64", "i386", "i686"):
        _NATIVE_F16 = "+f16c" in _llvm.get_host_cpu_features().flatten()
    else:
        _NATIVE_F16 = _MACHINE in ("aarch64", "arm64")
    _NATIVE_F16 = _NATIVE_F16 and os.environ.get("TESTBED_F16", "") != "soft"

    @intrinsic
    def _f16_hw(typingctx, v):
        if v != _types.float32:
            return None

        def codegen(context, builder, signature, args):
            return builder.fpext(builder.fptrunc(args[0], _ir.HalfType()), _ir.FloatType())

        return _types.float32(_types.float32), codegen

    @intrinsic
    def _f16_bits_hw(typingctx, v):
        if v != _types.float32:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], _ir.HalfType()), _ir.IntType(16))

        return _types.uint16(_types.float32), codegen

    @njit(inline="always", cache=True)
    def _f16_soft(v):
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

    @njit(inline="always", cache=True)
    def _f16_bits_soft(v):
        """IEEE binary16 bit pattern of the float16 nearest ``v``."""
        q = _f16_soft(v)
        sign = 0x8000 if math.copysign(1.0, q) < 0 else 0
        a = abs(q)
        if a != a:
            return np.uint16(sign | 0x7E00)
        if a == np.inf:
            return np.uint16(sign | 0x7C00)
        if a < np.float32(6.103515625e-05):  # zero or subnormal: a multiple of 2^-24
            return np.uint16(sign | int(a * np.float32(16777216.0)))
        m, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1): exponent field e + 14, 10 mantissa bits
        return np.uint16(sign | ((e + 14) << 10) | int((m * 2.0 - 1.0) * 1024.0))

    _f16 = _f16_hw if _NATIVE_F16 else _f16_soft
    _f16_bits = _f16_bits_hw if _NATIVE_F16 else _f16_bits_soft

    @njit(cache=True)
    def _f16_arrays(a, soft):
        """(values, bit patterns) of the float16 nearest each element: by the routine the kernels
        use, or with ``soft`` by the software routine."""
        vals = np.empty_like(a)
        bits = np.empty(a.shape, np.uint16)
        for i in range(a.size):
            v = a.flat[i]
            vals.flat[i] = _f16_soft(v) if soft else _f16(v)
            bits.flat[i] = _f16_bits_soft(v) if soft else _f16_bits(v)
        return vals, bits

    _ABS = np.uint32(0x7FFFFFFF)
    _INF_BITS = 0x7F800000  # |x| bit patterns at or above this are inf or NaN

    @njit(inline="always", cache=True)
    def _word3(c, o):
        """The 24-bit word of the eight 3-bit codes ``c[o:o+8]``, code ``j`` in bits ``[3j, 3j+3)``."""
        return (np.uint32(c[o]) | (np.uint32(c[o + 1]) << np.uint32(3)) | (np.uint32(c[o + 2]) << np.uint32(6))
                | (np.uint32(c[o + 3]) << np.uint32(9)) | (np.uint32(c[o + 4]) << np.uint32(12))
                | (np.uint32(c[o + 5]) << np.uint32(15)) | (np.uint32(c[o + 6]) << np.uint32(18))
                | (np.uint32(c[o + 7]) << np.uint32(21)))

    @njit(inline="always", cache=True)
    def _unword3(w, c, o):
        """The eight codes of the 24-bit word ``w`` into float32 ``c[o:o+8]``."""
        for j in range(8):
            c[o + j] = np.float32((w >> np.uint32(3 * j)) & np.uint32(7))

    @njit(inline="always", cache=True)
    def _capacity(nbytes, bits):
        """Codes a row buffer holds for ``nbytes`` packed bytes (at 3 bits whole 3-byte words)."""
        return (nbytes + 2) // 3 * 8 if bits == 3 else nbytes * (8 // bits)

    @njit(inline="always", cache=True)
    def _pack_row(c, out, bits):
        """Pack the codes ``c`` (uint8, at least ``_capacity(len(out), bits)`` of them) into ``out``,
        element ``j`` of each byte in bits ``[bits*j, bits*(j+1))`` (at 3 bits, of each 3-byte
        little-endian word in bits ``[3j, 3j+3)``); written per width so the loop vectorizes."""
        n = out.shape[0]
        if bits == 3:  # eight codes per 24-bit little-endian word; a partial last word keeps its low bytes
            for k in range((n + 2) // 3):
                w = _word3(c, 8 * k)
                for j in range(min(3, n - 3 * k)):
                    out[3 * k + j] = np.uint8((w >> np.uint32(8 * j)) & np.uint32(255))
        elif bits == 4:
            for k in range(n):
                out[k] = c[2 * k] | (c[2 * k + 1] << np.uint8(4))
        elif bits == 8:
            for k in range(n):
                out[k] = c[k]
        else:
            for k in range(n):
                out[k] = (c[4 * k] | (c[4 * k + 1] << np.uint8(2)) | (c[4 * k + 2] << np.uint8(4))
                          | (c[4 * k + 3] << np.uint8(6)))

    @njit(inline="always", cache=True)
    def _unpack_row(codes, c, bits):
        """Inverse of :func:`_pack_row` into float32 ``c`` (the code values)."""
        n = codes.shape[0]
        if bits == 3:  # a partial last word reads its low bytes, the rest zero
            for k in range((n + 2) // 3):
                w = np.uint32(0)
                for j in range(min(3, n - 3 * k)):
                    w |= np.uint32(codes[3 * k + j]) << np.uint32(8 * j)
                _unword3(w, c, 8 * k)
        elif bits == 4:
            for k in range(n):
                byte = codes[k]
                c[2 * k] = np.float32(byte & np.uint8(15))
                c[2 * k + 1] = np.float32(byte >> np.uint8(4))
        elif bits == 8:
            for k in range(n):
                c[k] = np.float32(codes[k])
        else:
            for k in range(n):
                byte = codes[k]
                c[4 * k] = np.float32(byte & np.uint8(3))
                c[4 * k + 1] = np.float32((byte >> np.uint8(2)) & np.uint8(3))
                c[4 * k + 2] = np.float32((byte >> np.uint8(4)) & np.uint8(3))
                c[4 * k + 3] = np.float32(byte >> np.uint8(6))

    @njit(inline="always", cache=True)
    def _code(v, zv, sv, lv, qmax):
        """round((v - zero16) / scale16) clamped to [0, qmax], zeroed for a degenerate group, as
        float32 (NaN when ``v``, the group's range or its minimum is not finite: a NaN anywhere in
        a group makes its own quotient NaN or the group's minimum NaN, an inf makes the scale inf
        and its quotient inf/inf). The select form keeps loops vectorizable; same value as min/max."""
        cv = np.rint((v - zv) / sv)
        cv = np.float32(0.0) if cv < np.float32(0.0) else cv
        cv = qmax if cv > qmax else cv
        return cv * lv

    @parallel_kernel()
    def _int_q_channel(x, g, bits, codes, scale, zero, bad):
        # x [B, T, D] float32; codes [B, Tp, ceil(D/per)]; scale, zero [B, Tp/g, D] uint16 (float16
        # bit patterns); bad [B * Tp/g]: a non-finite input in the block (a NaN code, see _code) or
        # a scale or zero-point beyond float16
        B, T, D = x.shape
        ng = scale.shape[1]
        qmax = np.float32((1 << bits) - 1)
        nbytes = codes.shape[2]
        for blk in prange(B * ng):
            b = blk // ng
            gi = blk % ng
            t0 = gi * g
            mn = x[b, t0].copy()
            mx = x[b, t0].copy()
            for t in range(t0 + 1, min(t0 + g, T)):
                xr = x[b, t]
                for d in range(D):
                    v = xr[d]
                    mn[d] = v if v < mn[d] else mn[d]
                    mx[d] = v if v > mx[d] else mx[d]
            s = np.empty(D, np.float32)
            z = np.empty(D, np.float32)
            live = np.empty(D, np.float32)
            over = False
            for d in range(D):
                # + 0.0: a zero range or minimum is stored as +0 whatever the order of the scan
                raw_s = np.float32((mx[d] - mn[d]) / qmax) + np.float32(0.0)
                raw_z = mn[d] + np.float32(0.0)
                sv = _f16(raw_s)
                zv = _f16(raw_z)
                scale[b, gi, d] = _f16_bits(raw_s)
                zero[b, gi, d] = _f16_bits(raw_z)
                over |= (sv == np.inf) | (abs(zv) == np.inf)
                z[d] = zv
                live[d] = np.float32(1.0) if sv > 0 else np.float32(0.0)
                s[d] = sv if sv > 0 else np.float32(1.0)
            c = np.zeros(_capacity(nbytes, bits), np.uint8)
            nan = False
            for t in range(t0, t0 + g):
                xr = x[b, min(t, T - 1)]  # padded rows repeat the edge token
                for d in range(D):
                    y = _code(xr[d], z[d], s[d], live[d], qmax)
                    nan |= y != y
                    c[d] = np.uint8(y)
                _pack_row(c, codes[b, t], bits)
            bad[blk] = nan | over

    ROWS_PER_TASK = 64

    # Index arithmetic inside the row loops is unsigned: numba wraps negative signed indices
    # (``a[-1]``), and proving a runtime offset like ``gi * g`` non-negative is beyond the
    # compiler, so signed offsets cost a compare-and-select per element and block vectorization
    # (measured 1.8x slower on the V kernel). Mixing uint64 with int64 would give float64 in
    # numba, so every index in these loops is uint64.
    _U1 = np.uint64(1)

    @njit(inline="always", cache=True)
    def _group_range(xr, d0, d1):
        """(min, max) of ``xr[d0:d1]`` (uint64 bounds), in four interleaved chains so the
        comparisons overlap (min and max do not depend on the order, up to the sign of a zero,
        which the callers normalize)."""
        m0 = xr[d0]
        m1 = m0
        m2 = m0
        m3 = m0
        x0 = m0
        x1 = m0
        x2 = m0
        x3 = m0
        d = d0
        while d + np.uint64(4) <= d1:
            v0 = xr[d]
            v1 = xr[d + _U1]
            v2 = xr[d + np.uint64(2)]
            v3 = xr[d + np.uint64(3)]
            m0 = v0 if v0 < m0 else m0
            m1 = v1 if v1 < m1 else m1
            m2 = v2 if v2 < m2 else m2
            m3 = v3 if v3 < m3 else m3
            x0 = v0 if v0 > x0 else x0
            x1 = v1 if v1 > x1 else x1
            x2 = v2 if v2 > x2 else x2
            x3 = v3 if v3 > x3 else x3
            d += np.uint64(4)
        while d < d1:
            v0 = xr[d]
            m0 = v0 if v0 < m0 else m0
            x0 = v0 if v0 > x0 else x0
            d += _U1
        m0 = m1 if m1 < m0 else m0
        m2 = m3 if m3 < m2 else m2
        x0 = x1 if x1 > x0 else x0
        x2 = x3 if x3 > x2 else x2
        return (m2 if m2 < m0 else m0), (x2 if x2 > x0 else x0)

    @parallel_kernel()
    def _int_q_token(x, g, bits, codes, scale, zero, bad):
        # x [R, D] float32 rows; codes [R, ceil(Dp/per)]; scale, zero [R, Dp/g] uint16 (float16 bit
        # patterns); one task = 64 rows; bad[task]: a non-finite input in its rows (a NaN code,
        # see _code) or a scale or zero-point beyond float16
        rows, D = x.shape
        ng = scale.shape[1]
        qmax = np.float32((1 << bits) - 1)
        nbytes = codes.shape[1]
        gu = np.uint64(g)
        du = np.uint64(D)
        ntask = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
        for task in prange(ntask):
            c = np.zeros(_capacity(nbytes, bits), np.uint8)
            nan = False
            over = False
            for r in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
                xr = x[r]
                for gi in range(ng):
                    d0 = np.uint64(gi) * gu
                    d1 = min(d0 + gu, du)
                    mn, mx = _group_range(xr, d0, d1)
                    # + 0.0: a zero range or minimum is stored as +0 whatever the order of the scan
                    raw_s = np.float32((mx - mn) / qmax) + np.float32(0.0)
                    raw_z = mn + np.float32(0.0)
                    sv = _f16(raw_s)
                    zv = _f16(raw_z)
                    scale[r, gi] = _f16_bits(raw_s)
                    zero[r, gi] = _f16_bits(raw_z)
                    over |= (sv == np.inf) | (abs(zv) == np.inf)
                    lv = np.float32(1.0) if sv > 0 else np.float32(0.0)
                    sv = sv if sv > 0 else np.float32(1.0)
                    for d in range(d0, d1):
                        y = _code(xr[d], zv, sv, lv, qmax)
                        nan |= y != y
                        c[d] = np.uint8(y)
                    for d in range(d1, d0 + gu):  # padded features repeat the edge feature
                        c[d] = c[du - _U1]
                _pack_row(c, codes[r], bits)
            bad[task] = nan | over

    @parallel_kernel()
    def _int_dq_channel(codes, scale, zero, f16, g, bits, out):
        # codes are unpacked a row at a time into a float buffer, then one multiply-add per feature;
        # scale and zero are float16 bit patterns, f16 the float32 value of every pattern, looked
        # up once per group of tokens
        B, T, D = out.shape
        ng = scale.shape[1]
        rows = B * T
        ntask = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
        for task in prange(ntask):
            c = np.empty(_capacity(codes.shape[2], bits), np.float32)
            sf = np.empty(D, np.float32)
            zf = np.empty(D, np.float32)
            cur = -1
            for row in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
                b = row // T
                t = row - b * T
                if b * ng + t // g != cur:
                    cur = b * ng + t // g
                    sr = scale[b, t // g]
                    zr = zero[b, t // g]
                    for d in range(D):
                        sf[d] = f16[sr[d]]
                        zf[d] = f16[zr[d]]
                _unpack_row(codes[b, t], c, bits)
                orow = out[b, t]
                for d in range(D):
                    orow[d] = c[d] * sf[d] + zf[d]

    @parallel_kernel()
    def _int_dq_token(codes, scale, zero, f16, g, bits, out):
        B, T, D = out.shape
        ng = scale.shape[2]
        gu = np.uint64(g)
        du = np.uint64(D)
        rows = B * T
        ntask = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
        for task in prange(ntask):
            c = np.empty(_capacity(codes.shape[2], bits), np.float32)
            for row in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
                b = row // T
                t = row - b * T
                _unpack_row(codes[b, t], c, bits)
                sr = scale[b, t]
                zr = zero[b, t]
                orow = out[b, t]
                for gi in range(ng):
                    sv = f16[sr[gi]]
                    zv = f16[zr[gi]]
                    d0 = np.uint64(gi) * gu
                    for d in range(d0, min(d0 + gu, du)):
                        orow[d] = c[d] * sv + zv

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

    @parallel_kernel()
    def _mx_q(x, xi, block, emax, emin, mbits, bias, maxv, maxbits, maxcode, bits, rceil, codes, scales, bad):
        # x [R, D] float32 and its uint32 view xi; codes [R, ceil(D_pad * bits / 8)]; scales [R, D_pad / block]
        R, D = x.shape
        nb = scales.shape[1]
        sign_shift = bits - 1
        per = 8 // bits
        shift = 23 - mbits
        half = 1 << (shift - 1)
        low = (1 << shift) - 1
        bu = np.uint64(block)
        du = np.uint64(D)
        for r in prange(R):
            xr = x[r]
            ir = xi[r]
            cr = codes[r]
            worst = np.uint32(0)
            for bi in range(nb):
                d0 = np.uint64(bi) * bu  # unsigned: see _U1
                d1 = min(d0 + bu, du)
                am = np.uint32(0)
                for d in range(d0, d1):
                    a = ir[d] & _ABS
                    am = a if a > am else am
                worst = am if am > worst else worst
                if rceil:
                    # RCEIL: ceil(log2(d)) of the float32 quotient d = fl32(amax / max) (the float64
                    # quotient rounded once to float32 is the correctly rounded float32 one); d as a
                    # float64 is m * 2**e with m in [0.5, 1), a power of two exactly when m == 0.5
                    amf = np.float64(abs(xr[d0]))
                    for d in range(d0, d1):
                        v = np.float64(abs(xr[d]))
                        amf = v if v > amf else amf
                    qv = np.float64(np.float32(amf / maxv))
                    m, e = math.frexp(qv)
                    ue = e - 1 if m == 0.5 else e
                    if qv == 0.0:
                        ue = -127  # the quotient underflowed float32: the smallest scale
                    sc = 0 if am == 0 else min(max(ue, -127), 127) + 127
                else:
                    # shared exponent floor(log2(amax)) - emax, clamped to E8M0's [-127, 127]: the biased
                    # exponent field of a normal amax is floor(log2(amax)) + 127, and a zero or
                    # subnormal amax (field 0) clamps to -127 just as its true exponent would
                    sc = min(max(np.int64(am >> np.uint32(23)) - 127 - emax, -127), 127) + 127
                scales[r, bi] = sc
                if per == 1:
                    # branch-free over the block (vectorizable); elements in the float32 or element
                    # subnormal range are flagged and redone by the exact routine
                    rebias = (127 - sc) << 23
                    slow = 0
                    for d in range(d0, d1):
                        xb = np.int64(ir[d])
                        ax = xb & 0x7FFFFFFF
                        ex = ax >> 23
                        ey = ex - sc
                        keep = (ax & 0x7FFFFF) >> shift
                        rem = ax & low
                        up = np.int64(rem > half) | (np.int64(rem == half) & (keep & 1))
                        code = ((ey + bias) << mbits) + keep + up
                        code = maxcode if ax + rebias > maxbits else code
                        slow |= np.int64(ex == 0) | np.int64(ey < emin)
                        cr[d] = (code & 0x7F) | ((xb >> 31) << sign_shift)
                    if slow:
                        for d in range(d0, d1):
                            cr[d] = _mx_encode_bits(np.int64(ir[d]), xr[d], sc, emin, emax, mbits, bias, maxv,
                                                    maxbits, maxcode, sign_shift)
                    for d in range(d1, d0 + bu):
                        cr[d] = 0
                else:
                    for j in range(0, block, per):
                        byte = 0
                        for k in range(per):
                            d = d0 + np.uint64(j + k)
                            if d < du:
                                c = _mx_encode_bits(np.int64(ir[d]), xr[d], sc, emin, emax, mbits, bias, maxv,
                                                    maxbits, maxcode, sign_shift)
                                byte |= c << (bits * k)
                        cr[(d0 + np.uint64(j)) // np.uint64(per)] = byte
            bad[r] = worst >= _INF_BITS

    @parallel_kernel()
    def _mx_dq(codes, scales, lut, pow2, block, bits, out):
        # lut: float64 value of every element code; pow2[s] = 2**(s - 127), the E8M0 scale
        R, D = out.shape
        per = 8 // bits
        mask = (1 << bits) - 1
        nb = scales.shape[1]
        bu = np.uint64(block)
        du = np.uint64(D)
        for r in prange(R):
            cr = codes[r]
            orow = out[r]
            for bi in range(nb):
                s = pow2[scales[r, bi]]
                d0 = np.uint64(bi) * bu  # unsigned: see _U1
                if per == 1:
                    for d in range(d0, min(d0 + bu, du)):
                        orow[d] = np.float32(lut[cr[d]] * s)
                else:
                    for d in range(d0, min(d0 + bu, du)):
                        c = (cr[d // np.uint64(per)] >> np.uint64(bits) * (d % np.uint64(per))) & np.uint64(mask)
                        orow[d] = np.float32(lut[c] * s)


def mx_quantize(x: np.ndarray, block: int, ebits: int, mbits: int, bias: int, maxv: float, emax: int,
                rceil: bool = False):
    """x [R, D] float32 -> (codes uint8 [R, D_pad*bits/8], scales uint8 [R, D_pad/block], any non-finite);
    block scales by the FLOOR rule, or RCEIL with ``rceil`` (``mx.block_scale_codes`` defines both)."""
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
          bool(rceil), codes, scales, bad)
    return codes, scales, bool(bad.any())


_POW2 = np.ldexp(1.0, np.arange(256) - E8M0_BIAS)  # value of every E8M0 scale code (E8M0_NAN, never decoded)


def mx_dequantize(codes: np.ndarray, scales: np.ndarray, lut: np.ndarray, block: int, bits: int, d: int) -> np.ndarray:
    """Inverse of :func:`mx_quantize`: float32 [R, d]; ``lut`` is the float64 value of every code."""
    out = np.empty((codes.shape[0], d), np.float32)
    _mx_dq(codes, scales, lut, _POW2, block, bits, out)
    return out


def float16_round(a: np.ndarray) -> np.ndarray:
    """float32 array rounded to float16 values (kept as float32) by the kernels' own routine."""
    return _f16_arrays(np.ascontiguousarray(a, dtype=np.float32), False)[0]


def float16_bits(a: np.ndarray) -> np.ndarray:
    """IEEE binary16 bit patterns (uint16) of the float16 nearest each float32, by the kernels' routine."""
    return _f16_arrays(np.ascontiguousarray(a, dtype=np.float32), False)[1]


def float16_round_soft(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The software routine (used where the CPU has no float16 conversion): (values, bit patterns)."""
    return _f16_arrays(np.ascontiguousarray(a, dtype=np.float32), True)


_INT_BITS = (2, 3, 4, 8)  # at 3 bits eight codes share three bytes (testbed.quant.packing)


def _check_int_bits(bits: int) -> None:
    if bits not in _INT_BITS:
        raise ValueError(f"the fused integer kernels pack {_INT_BITS} bits, got {bits}")


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
    """x [B, T, D] float32 -> (codes uint8 [B, Tp, ceil(D*bits/8)], scale, zero float16 [B, Tp/g, D],
    whether a value was not finite or a scale/zero-point overflowed float16)."""
    _check_int_bits(bits)
    B, T, D = x.shape
    ng = _ceil_div(T, g)
    codes = np.empty((B, ng * g, _ceil_div(D * bits, 8)), np.uint8)
    scale = np.empty((B, ng, D), np.uint16)
    zero = np.empty((B, ng, D), np.uint16)
    bad = np.zeros((B, ng), np.bool_)

    def run(xs, g_, bits_, c, s, z, bd):
        _int_q_channel(xs, g_, bits_, c, s, z, bd.reshape(-1))

    _over_slabs(run, x, (codes, scale, zero, bad), g, bits)
    return codes, scale.view(np.float16), zero.view(np.float16), bool(bad.any())


def int_quantize_token(x: np.ndarray, bits: int, g: int):
    """x [B, T, D] float32 -> (codes uint8 [B, T, ceil(Dp*bits/8)], scale, zero float16 [B, T, Dp/g],
    whether a value was not finite or a scale/zero-point overflowed float16)."""
    _check_int_bits(bits)
    B, T, D = x.shape
    ng = _ceil_div(D, g)
    codes = np.empty((B, T, _ceil_div(ng * g * bits, 8)), np.uint8)
    scale = np.empty((B, T, ng), np.uint16)
    zero = np.empty((B, T, ng), np.uint16)
    flags = []

    def run(xs, g_, bits_, c, s, z):
        bd = np.zeros(-(-(xs.shape[0] * xs.shape[1]) // ROWS_PER_TASK), np.bool_)
        x2 = xs.reshape(-1, xs.shape[2])
        _int_q_token(x2, g_, bits_, c.reshape(x2.shape[0], -1), s.reshape(x2.shape[0], -1),
                     z.reshape(x2.shape[0], -1), bd)
        flags.append(bool(bd.any()))

    _over_slabs(run, x, (codes, scale, zero), g, bits)
    return codes, scale.view(np.float16), zero.view(np.float16), any(flags)


F16_VALUES = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)  # every float16, exactly


def _dequantize(kernel, codes, scale, zero, g, bits, n, d, out):
    """``scale``/``zero`` are float16 arrays, read by the kernels as bit patterns through a table."""
    _check_int_bits(bits)
    if out is None:
        out = np.empty((codes.shape[0], n, d), np.float32)
    scale = np.ascontiguousarray(scale, dtype=np.float16).view(np.uint16)
    zero = np.ascontiguousarray(zero, dtype=np.float16).view(np.uint16)
    if out.strides[-1] == out.itemsize:
        # contiguous rows (e.g. the token span of a [B, N, D] cache): one call over all of it, so
        # the threads split the batch and first-touch disjoint pages (one call per slab made both
        # threads fault the same fresh pages: 5x slower on a VM)
        kernel(codes, scale, zero, F16_VALUES, g, bits, out)
    else:
        tmp = np.empty(out.shape, np.float32)
        kernel(codes, scale, zero, F16_VALUES, g, bits, tmp)
        out[...] = tmp
    return out


def int_dequantize_channel(codes, scale, zero, g: int, bits: int, n: int, d: int, out=None) -> np.ndarray:
    """Decode into ``out`` ([B, n, d] float32, may be a token span of a larger cache) or a new array."""
    return _dequantize(_int_dq_channel, codes, scale, zero, g, bits, n, d, out)


def int_dequantize_token(codes, scale, zero, g: int, bits: int, n: int, d: int, out=None) -> np.ndarray:
    return _dequantize(_int_dq_token, codes, scale, zero, g, bits, n, d, out)
