"""Fused streaming analysis of one record: every observational metric, the MX Q/K and P paths and
the region ablations from one pass over tiles of queries, with one score matrix per tile.

`observe` (metrics), `ablate` (ablation) and the ``mx_paths`` analysis each recompute ``Q Kᵀ``
and the softmax, and the P path materializes ``P [H, Tq, Tk]``. At the seed study's scale (32
heads, 2,340 queries x 6,240 keys, D = 128: 467 M scores per path) that costs minutes and gigabytes.
`analyze` computes, per tile of one KV head's query-head group (GQA) x a slice of queries:

1. the scores ``S = (Q / sqrt(D)) Kᵀ`` once, and per Q/K rotation the scores of the MX-decoded
   ``Q̂, K̂`` (quantized once per KV head into reused buffers: signed Hadamard by butterflies in
   float64, then MX encode/decode, bit-identical to `testbed.quant.mx.MX`, checked by the tests);
2. one numba kernel over the tile's rows that does steps 2a-2c on each row while it is in cache:
   a. the reference: the max per key *atom* (the key spans cut at every region, ablation-span and
      key-block boundary), ``e = exp(S - max)`` in place with the sums ``Z_a`` per atom and
      ``sum e (S - max)`` (the entropy without a logarithm per key), the argmax, and the top
      1/5/10 % mass by an exact radix select on the bits of ``e`` (a histogram of 1,024 buckets
      spanning the row's own range, one pass summing the keys above each boundary bucket, one
      marking the keys inside it, and those few sorted) -- no sort of the row;
   b. per Q/K rotation: softmax of the scores (into a per-thread scratch row), TV against ``P``,
      argmax, and ``P̂ - P`` for the output-error product;
   c. the P path: ``float32(e / Z)`` MX-quantized (E8M0 FLOOR scale per 32-key block, elements
      rounded to nearest even and saturated) and decoded, bit-identical to `testbed.quant.mx.MX`,
      with its numerical-zero count, row sum, TV and argmax;
3. the P·V products: ``e`` per ablation atom (``sum_a e_a V_a = Z O``: the ablations cost no
   extra matmul, dropping a region is merging the other atoms, as in `testbed.ablation_core`), and the
   paths' output errors ``(P̂ - P) V``; a small kernel turns them into per-row errors.

Only per-row results (a few floats per head x query) and per-head sums are kept, never
``[H, Tq, Tk]``. A tile holds about ``max_scores`` scores per path.

Precision. ``dtype=torch.float64`` follows the testbed's reference (float64 scores, softmax and
P·V) and agrees with `observe`, `ablate` and ``mx_paths`` to rounding (1e-12, tests). The fast
path is ``float32``: scores, softmax and the reference P·V in float32 (the precision of the
Case's Q, K, V and of the attention kernels being simulated) with float64 accumulation of every
row sum, mass and error; it halves memory traffic and matmul time. The paths' output errors are
an error of an error, so float32 forms ``(P̂ - P) V`` with the difference and V in bfloat16,
float32 accumulation, one product for all paths (oneDNN's AVX512-BF16 GEMM, ~2.7x a float32 one
per row here). On the video record every reported median and mean of float32 is within ~1e-6 of
float64; the paths' rel-L2 move by up to ~5e-5 relative (measured on two heads: Q/K 3e-5 and
4e-5, P 1.6e-5; a high + low bfloat16 split of the Q/K difference brought the Q/K arms to 3e-6
and 2e-5 for a third more error-product work; `benchmarks/bench_streaming.py` measures it on a
sample). Deviations by design, each stated:

- ``exp`` is a range-reduced polynomial (Cody-Waite, ``2^t`` from its bits; ~1 ulp in float32,
  ~1e-16 in float64) so that it vectorizes; ``exp(x)`` below ``-87`` (float32) / ``-708``
  (float64) is clamped to a tiny positive value instead of flushing to 0, so "reference-positive
  keys" are all visible keys, as in float64;
- the strict-zero rate of `observe` is that of torch's float32 softmax; a row can only have such
  zeros when its logits span more than ~87 nats, so rows spanning more than 80 are recomputed
  exactly by `metrics.strict_zero_rate` (counted in ``fallback_rows["zero_rate"]``);
- an ablation whose kept keys all lie more than 60 (float32) / 600 (float64) nats below the row
  max would renormalize underflowed values; such rows are recomputed by `testbed.ablation_core.ablate`
  itself (``fallback_rows["ablation"]``);
- argmax is the first key of largest ``e`` (the first largest score), i.e. ties are those of the
  scores, as for a float64 softmax.

Threads: torch (MKL) and numba each run their own OpenMP pool, and both spin a while after a
parallel region; a tile therefore runs its Q Kᵀ matmuls, then its one row kernel, then its P·V.
``seconds`` and ``cpu_seconds`` of the result give wall and CPU time per stage.

References: the video KV-cache attention study (docs/studies.md) for the metrics and the
ablations; OCP Microscaling Formats v1.0 for MX (see `testbed.quant.mx`); the online-softmax
merge of partial sums (Milakov and Gimelshein 2018; FlashAttention, Dao et al. 2022); the fast
Walsh-Hadamard transform for the signed-Hadamard rotation (QuaRot, Ashkboos et al. 2024)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .ablation_core import ArmResult, ablate, cut_points, history_span, make_ablation
from .metrics import Observation, TOP_PERCENTS, frame_size, jaccard, strict_zero_rate, top_blocks, top_counts
from .quant.kernels import parallel_kernel
from .quant.mx import ELEMENTS, MX

__all__ = ["analyze", "StreamResult", "QKPath", "PPath", "DEFAULT_ABLATIONS", "DEFAULT_MAX_SCORES"]

DEFAULT_ABLATIONS = ("drop_sink", "drop_recent", "drop_history")
DEFAULT_MAX_SCORES = 1 << 22
ZERO_GATE = 80.0                     # nats: below this span a float32 softmax row has no exact zeros
FRAGILE = {torch.float32: 60.0, torch.float64: 600.0}
_SENTINEL = -3.0e38
_NB = 1024                           # top-k histogram buckets, spanning each row's own range of e
_GCAP = 512                          # boundary-bucket keys the preallocated gather scratch holds

try:
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover - numba is a declared dependency
    numba = None


# ------------------------------------------------------------------------------------------------
# numba kernels. Helpers that reduce are compiled with fastmath (so the reductions vectorize);
# the MX rounding helper is strict, because it relies on ``(y + C) - C`` rounding exactly once.
# ------------------------------------------------------------------------------------------------

if numba is not None:
    # Every helper loops over a whole (sliced) array from index 0: numba's negative-index
    # wraparound otherwise keeps LLVM from vectorizing a loop that starts at a run-time offset.

    @njit(fastmath=True, cache=True)
    def _max_all(x):
        """max of x (len >= 1); eight independent lanes so that the reduction vectorizes."""
        n = x.shape[0]
        m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = x[0]
        n8 = n // 8 * 8
        for j in range(0, n8, 8):
            m0 = max(m0, x[j])
            m1 = max(m1, x[j + 1])
            m2 = max(m2, x[j + 2])
            m3 = max(m3, x[j + 3])
            m4 = max(m4, x[j + 4])
            m5 = max(m5, x[j + 5])
            m6 = max(m6, x[j + 6])
            m7 = max(m7, x[j + 7])
        m = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
        for j in range(n8, n):
            m = max(m, x[j])
        return m

    @njit(cache=True)
    def _first_eq(x, val):
        """First index j with x[j] == val (len(x) when none); 64-key chunks tested vectorized."""
        n = x.shape[0]
        n64 = n // 64 * 64
        for c0 in range(0, n64, 64):
            hit = False
            for u in range(64):
                hit |= x[c0 + u] == val
            if hit:
                for u in range(64):
                    if x[c0 + u] == val:
                        return c0 + u
        for j in range(n64, n):
            if x[j] == val:
                return j
        return n

    @njit(fastmath=True, inline="always", cache=True)
    def _e32(d):
        """exp(d) in float32 for d >= -87 (Cody-Waite reduction, degree-7 Taylor, 2^t built from its
        bits: ~1 ulp)."""
        t = np.floor(d * np.float32(1.4426950408889634) + np.float32(0.5))
        r = d - t * np.float32(0.693145751953125) - t * np.float32(1.4286067653301870e-06)
        p = np.float32(1.0 / 5040)
        p = p * r + np.float32(1.0 / 720)
        p = p * r + np.float32(1.0 / 120)
        p = p * r + np.float32(1.0 / 24)
        p = p * r + np.float32(1.0 / 6)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        p = p * r + np.float32(1.0)
        return p * np.int32((np.int32(t) + 127) << 23).view(np.float32)

    @njit(fastmath=True, cache=True)
    def _exp32(x, m, gate):
        """x <- exp(x - m) in float32 (`_e32`, the argument clamped at -87 so that 2^t stays a
        normal float32); returns (sum e, sum e (x - m), keys below m - gate) with float64 sums."""
        xmin = np.float32(-87.0)
        mm = np.float32(m)
        g = np.float32(-gate)
        z = 0.0
        hh = 0.0
        far = 0
        for j in range(x.shape[0]):
            d = np.float32(x[j]) - mm
            far += d < g
            d = d if d > xmin else xmin
            e = _e32(d)
            x[j] = e
            z += np.float64(e)
            hh += np.float64(e) * np.float64(d)
        return z, hh, far

    @njit(fastmath=True, cache=True)
    def _exp32_to(x, y, m):
        """y <- exp(x - m) in float32 (as `_exp32`, x left alone); returns sum e (float64). A loop of
        its own: one function for both, called in place with y = x, loses its vectorization to the
        possible aliasing."""
        xmin = np.float32(-87.0)
        mm = np.float32(m)
        z = 0.0
        for j in range(x.shape[0]):
            d = np.float32(x[j]) - mm
            d = d if d > xmin else xmin
            e = _e32(d)
            y[j] = e
            z += np.float64(e)
        return z

    @njit(fastmath=True, cache=True)
    def _exp64(x, m, gate):
        """float64 version of `_exp32` (degree-13 Taylor: ~1e-16 relative)."""
        l2e = 1.4426950408889634
        h = 0.6931471803691238
        lo = 1.9082149292705877e-10
        xmin = -708.0                               # 2^t stays a normal float64 (t >= -1022)
        g = -gate
        z = 0.0
        hh = 0.0
        far = 0
        for j in range(x.shape[0]):
            d = np.float64(x[j]) - m
            far += d < g
            d = d if d > xmin else xmin
            t = np.floor(d * l2e + 0.5)
            r = d - t * h - t * lo
            p = 1.0 / 6227020800.0
            p = p * r + 1.0 / 479001600.0
            p = p * r + 1.0 / 39916800.0
            p = p * r + 1.0 / 3628800.0
            p = p * r + 1.0 / 362880.0
            p = p * r + 1.0 / 40320.0
            p = p * r + 1.0 / 5040.0
            p = p * r + 1.0 / 720.0
            p = p * r + 1.0 / 120.0
            p = p * r + 1.0 / 24.0
            p = p * r + 1.0 / 6.0
            p = p * r + 0.5
            p = p * r + 1.0
            p = p * r + 1.0
            e = p * np.int64((np.int64(t) + 1023) << 52).view(np.float64)
            x[j] = e
            z += e
            hh += e * d
        return z, hh, far

    @njit(cache=True)
    def _exp(x, m, gate, wide):
        if wide:
            return _exp64(x, m, gate)
        return _exp32(x, m, gate)

    @njit(cache=True)
    def _fill_zero(x):
        for j in range(x.shape[0]):
            x[j] = 0

    @njit(cache=True)
    def _softmax_row(x, n, cuts, wide, gate, amax, asum):
        """Scores x[:n] -> e = exp(x - max) in place (0 beyond n). Per atom f (``cuts[f]:cuts[f+1]``
        clipped to n): ``amax[f]`` its max score (sentinel when empty), ``asum[f]`` its sum of e.
        Returns (max, sum e (x - max), keys below max - gate)."""
        nf = cuts.shape[0] - 1
        m = _SENTINEL
        for f in range(nf):
            a = cuts[f]
            b = min(cuts[f + 1], n)
            if b > a:
                v = np.float64(_max_all(x[a:b]))
                amax[f] = v
                if v > m:
                    m = v
            else:
                amax[f] = _SENTINEL
        hh = 0.0
        far = 0
        for f in range(nf):
            a = cuts[f]
            b = min(cuts[f + 1], n)
            if b > a:
                z, h1, f1 = _exp(x[a:b], m, gate, wide)
                asum[f] = z
                hh += h1
                far += f1
            else:
                asum[f] = 0.0
        _fill_zero(x[n:])
        return m, hh, far

    # -- top-k mass: exact radix select on the bits of e (monotone for non-negative floats) ----------

    @njit(cache=True)
    def _min_bits(xi):
        m0 = m1 = m2 = m3 = xi[0]
        n4 = xi.shape[0] // 4 * 4
        for j in range(0, n4, 4):
            m0 = min(m0, xi[j])
            m1 = min(m1, xi[j + 1])
            m2 = min(m2, xi[j + 2])
            m3 = min(m3, xi[j + 3])
        m = min(min(m0, m1), min(m2, m3))
        for j in range(n4, xi.shape[0]):
            m = min(m, xi[j])
        return m

    @njit(cache=True)
    def _bucket_pass(xi, bone, shift, B):
        """B[j] = bucket of x[j]: its bit distance below the float with bits ``bone``, >> shift."""
        for j in range(xi.shape[0]):
            B[j] = (bone - xi[j]) >> shift

    @njit(fastmath=True, cache=True)
    def _sum_above3(x, xi, h0, h1, h2):
        """Sums of x over the keys with bits above h0, h1, h2 (the bits of x >= 0 are monotone)."""
        s0 = 0.0
        s1 = 0.0
        s2 = 0.0
        for j in range(x.shape[0]):
            v = xi[j]
            w = np.float64(x[j])
            s0 += w if v > h0 else 0.0
            s1 += w if v > h1 else 0.0
            s2 += w if v > h2 else 0.0
        return s0, s1, s2

    @njit(cache=True)
    def _mark3(xi, l0, h0, l1, h1, l2, h2, M):
        """M[j] = 1 where the bits of key j lie in any of (l_u, h_u], else 0 (one flat loop)."""
        for j in range(xi.shape[0]):
            v = xi[j]
            M[j] = ((v > l0) & (v <= h0)) | ((v > l1) & (v <= h1)) | ((v > l2) & (v <= h2))

    @njit(cache=True)
    def _gather(M, out):
        """The indices j with M[j] set into out, in order; returns their count. M (a multiple of 8
        bytes) is tested 8 bytes at a time, so that the long empty stretches cost one test each."""
        W = M.view(np.uint64)
        c = 0
        for w in range(W.shape[0]):
            if W[w]:
                for j in range(w * 8, w * 8 + 8):
                    out[c] = j
                    c += M[j]
        return c

    @njit(cache=True)
    def _top_in(x, xi, idx, lo, hi, need, tmp):
        """Sum of the ``need`` largest keys among the gathered ``idx`` with bits in (lo, hi]
        (an insertion sort of the few, on the bits)."""
        m = 0
        for i in range(idx.shape[0]):
            j = idx[i]
            v = xi[j]
            if v > lo and v <= hi:
                p = m
                while p > 0 and xi[tmp[p - 1]] < v:
                    tmp[p] = tmp[p - 1]
                    p -= 1
                tmp[p] = j
                m += 1
        t = 0.0
        for i in range(need):
            t += np.float64(x[tmp[i]])
        return t

    @njit(cache=True)
    def _top_sums(x, xi, ks, bone, out, B, cnt, gi, M, bnd):
        """out[i] = sum of the ks[i] largest of x (x >= 0, at most the float with bits ``bone``),
        exact, without sorting the row: a histogram of the bit distances below ``bone`` in _NB
        buckets spanning the row's own range gives each k's boundary bucket; one pass sums the keys
        above those buckets, one marks the keys inside them, and those few are gathered and sorted.
        ``ks`` must be non-decreasing. Scratch: B [n] uint16, cnt [4 * _NB] int32, gi [2, _GCAP]
        int64, M [>= n rounded up to 8] uint8, bnd [6] of xi's dtype; nothing is allocated unless
        the boundary buckets hold more than _GCAP keys."""
        n = x.shape[0]
        span = bone - _min_bits(xi)
        shift = 0
        while (span >> shift) >= _NB:
            shift += 1
        _bucket_pass(xi, bone, shift, B)
        for b in range(4 * _NB):
            cnt[b] = 0
        n4 = n // 4 * 4
        for j in range(0, n4, 4):
            cnt[B[j]] += 1
            cnt[_NB + B[j + 1]] += 1
            cnt[2 * _NB + B[j + 2]] += 1
            cnt[3 * _NB + B[j + 3]] += 1
        for j in range(n4, n):
            cnt[B[j]] += 1
        for b in range(_NB):
            cnt[b] += cnt[_NB + b] + cnt[2 * _NB + b] + cnt[3 * _NB + b]
        nm = (n + 7) // 8 * 8
        for j in range(n, nm):
            M[j] = 0
        npc = ks.shape[0]
        for i0 in range(0, npc, 3):
            # up to three k at once: each one's boundary bucket, with its bit range (lo, hi] (lo may
            # be negative: the lowest bucket reaches down to 0), and the keys it needs from it;
            # an unused slot gets the empty range (bone + 1, bone + 1]. The bounds pass through bnd
            # so that they carry xi's integer width: the passes' compares then vectorize at full width
            cum = 0
            b = 0
            tot = 0
            prev = -1
            d0 = d1 = d2 = 0
            for u in range(3):
                bnd[u] = bone + 1
                bnd[3 + u] = bone + 1
            for u in range(min(3, npc - i0)):
                k = ks[i0 + u]
                while cum + cnt[b] < k:
                    cum += cnt[b]
                    b += 1
                bnd[u] = bone - (b << shift)
                bnd[3 + u] = bone - ((b + 1) << shift)
                if u == 0:
                    d0 = k - cum
                elif u == 1:
                    d1 = k - cum
                else:
                    d2 = k - cum
                tot += cnt[b] if b != prev else 0
                prev = b
            h0 = bnd[0]
            h1 = bnd[1]
            h2 = bnd[2]
            l0 = bnd[3]
            l1 = bnd[4]
            l2 = bnd[5]
            s0, s1, s2 = _sum_above3(x, xi, h0, h1, h2)
            _mark3(xi, l0, h0, l1, h1, l2, h2, M[:n])
            if tot <= gi.shape[1]:
                g = gi[0]
                srt = gi[1]
            else:
                g = np.empty(tot, np.int64)
                srt = np.empty(tot, np.int64)
            m = _gather(M[:nm], g)
            for u in range(min(3, npc - i0)):
                s, d = (s0, d0) if u == 0 else ((s1, d1) if u == 1 else (s2, d2))
                out[i0 + u] = s + _top_in(x, xi, g[:m], bnd[3 + u], bnd[u], d, srt)

    @njit(cache=True)
    def _ref_row(x, xi, n, cuts, wide, gate, ks, bone, amax, asum, top, B, cnt, gi, M, bnd):
        """One reference softmax row: x -> e in place (0 beyond n), the atoms' max and sum of e, the
        top-k masses into ``top``; returns (max, 1 / Z, entropy, keys below max - gate, argmax)."""
        m, hh, fr = _softmax_row(x, n, cuts, wide, gate, amax, asum)
        z = 0.0
        for f in range(asum.shape[0]):
            z += asum[f]
        arg = _first_eq(x[:n], 1.0)
        _top_sums(x[:n], xi[:n], ks, bone, top, B[:n], cnt, gi, M, bnd)
        for i in range(top.shape[0]):
            top[i] = top[i] / z
        return m, 1.0 / z, math.log(z) - hh / z, fr, arg

    @njit(inline="always", cache=True)
    def _bf16_bits(v):
        """bfloat16 bit pattern of the float32 v, rounded to nearest even."""
        b = np.int64(np.float32(v).view(np.int32)) & 0xFFFFFFFF
        return np.uint16((b + 0x7FFF + ((b >> 16) & 1)) >> 16)

    @njit(fastmath=True, cache=True)
    def _tv_row(xh, invh, x, inv):
        tv = 0.0
        for j in range(x.shape[0]):
            tv += abs(np.float64(xh[j]) * invh - np.float64(x[j]) * inv)
        return 0.5 * tv

    @njit(fastmath=True, cache=True)
    def _tv_diff_row(xh, invh, x, inv, dh):
        """TV, and the difference P-hat - P written as bfloat16 (for the output-error product)."""
        tv = 0.0
        for j in range(x.shape[0]):
            dd = np.float64(xh[j]) * invh - np.float64(x[j]) * inv
            tv += abs(dd)
            dh[j] = _bf16_bits(np.float32(dd))
        return 0.5 * tv

    @njit(cache=True)
    def _arm_row(xh, n, wide, e, inv, dh, eh):
        """One Q/K-path row: its scores xh -> e-hat (0 beyond n); returns (1 / Z-hat, TV against
        the reference row e / Z, argmax). With dh non-empty (float32) also P-hat - P as bfloat16
        there (0 beyond n), and e-hat goes to the scratch row eh, not back to memory; else e-hat
        replaces xh (float64: the P-hat V product uses it)."""
        m = np.float64(_max_all(xh[:n]))
        if dh.shape[0] > 0:
            z = _exp32_to(xh[:n], eh[:n], m)
            tv = _tv_diff_row(eh[:n], 1.0 / z, e[:n], inv, dh[:n])
            _fill_zero(dh[n:])
            return 1.0 / z, tv, _first_eq(eh[:n], 1.0)
        z, h1, f1 = _exp(xh[:n], m, 1e30, wide)
        _fill_zero(xh[n:])
        tv = _tv_row(xh[:n], 1.0 / z, e[:n], inv)
        return 1.0 / z, tv, _first_eq(xh[:n], 1.0)

    # -- P path: MX fake quantization of float32(e / Z), bit-identical to testbed.quant.mx --------

    @njit(fastmath=True, cache=True)
    def _block_max(e, block, bm):
        """bm[k] = max of block k of e (full blocks; lanes of 8 when the block allows it)."""
        nbk = e.shape[0] // block
        if block % 8 == 0:
            for k in range(nbk):
                o = k * block
                m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = e[o]
                for u in range(0, block, 8):
                    m0 = max(m0, e[o + u])
                    m1 = max(m1, e[o + u + 1])
                    m2 = max(m2, e[o + u + 2])
                    m3 = max(m3, e[o + u + 3])
                    m4 = max(m4, e[o + u + 4])
                    m5 = max(m5, e[o + u + 5])
                    m6 = max(m6, e[o + u + 6])
                    m7 = max(m7, e[o + u + 7])
                bm[k] = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
        else:
            for k in range(nbk):
                bm[k] = _max_all(e[k * block:(k + 1) * block])
        if nbk * block < e.shape[0]:
            bm[nbk] = _max_all(e[nbk * block:])

    @njit(cache=True)
    def _mx_row(e, invc, block, scs, downs, ups, emin, mbits, maxv, ph):
        """ph = decode(encode(float32(e * invc))) over whole blocks with scales 2^scs[k]: y = v 2^-sc
        is exact, ``(y + c) - c`` with ``c = quantum * 2^23`` rounds it to nearest even on the
        element's quantum ``2^(max(floor(log2 y), emin) - mbits)``; then saturation (strict float32)."""
        nbk = e.shape[0] // block
        for k in range(nbk):
            sc = scs[k]
            down = downs[k]
            up = ups[k]
            o = k * block
            for u in range(block):
                v = np.float32(e[o + u] * invc)
                ey = ((np.float32(v).view(np.int32) >> 23) & 255) - 127 - sc
                ee = ey if ey > emin else emin
                c = np.int32((ee - mbits + 150) << 23).view(np.float32)
                q = (v * down + c) - c
                q = q if q < maxv else maxv
                ph[o + u] = q * up

    @njit(cache=True)
    def _mx_one(v, sc, emin, mbits, maxv):
        """decode(encode(v)) of one non-negative float32 with block scale 2^sc, in float64 (exact)."""
        y = np.float64(v) * math.ldexp(1.0, -sc)
        if y <= 0:
            return 0.0
        _, ey = math.frexp(y)
        qu = math.ldexp(1.0, max(ey - 1, emin) - mbits)
        return min(np.rint(y / qu) * qu, np.float64(maxv)) * math.ldexp(1.0, sc)

    @njit(fastmath=True, cache=True)
    def _p_stats(e, inv, ph, dd):
        """TV, row sum, zeros and positives of one row; with a non-empty ``dd`` also P-hat - P
        written there as bfloat16 (its error product needs no more)."""
        write = dd.shape[0] > 0
        tv = 0.0
        rs = 0.0
        zeros = 0
        pos = 0
        for j in range(e.shape[0]):
            p = np.float64(e[j]) * inv
            h = np.float64(ph[j])
            tv += abs(h - p)
            rs += h
            zeros += (p > 0) & (h == 0)
            pos += p > 0
            if write:
                dd[j] = _bf16_bits(np.float32(h - p))
        return 0.5 * tv, rs, zeros, pos

    @njit(cache=True)
    def _p_row(e, n, inv, block, emax, emin, mbits, maxv, ph, dp, bm, scs, downs, ups):
        """One P-path row: ph = MX fake-quantized float32(e * inv) (e is 0 beyond n), bit-identical
        to `testbed.quant.mx.MX` on float32(P); returns its (TV against P, row sum, numerical-zero
        rate, argmax: the first key of the largest decoded value). With dp non-empty also P-hat - P
        as bfloat16 there (0 beyond n). Scratch bm, scs, downs, ups: one entry per key block."""
        T = e.shape[0]
        mvf = np.float32(maxv)
        nbk = (T + block - 1) // block
        full = T // block
        bm[0] = inv                         # 1 / Z in e's precision, as the reference quantizes float32(P)
        invc = bm[0]
        if block == 32:                     # literal call sites: the block loops get constant trip counts
            _block_max(e, 32, bm)
        else:
            _block_max(e, block, bm)
        slow = False
        best_in = np.float32(0.0)
        best_k = 0
        for k in range(nbk):
            amax = np.float32(bm[k] * invc)
            field = (np.float32(amax).view(np.int32) >> 23) & 255
            sc = min(max(field - 127 - emax, -127), 127)
            if field == 0 and amax > 0:
                _, ex = math.frexp(amax)
                sc = min(max(ex - 1 - emax, -127), 127)
            if amax > 0 and (field == 0 or sc < -127 - emin):
                slow = True
            scs[k] = sc
            downs[k] = np.int32((127 - sc) << 23).view(np.float32)
            ups[k] = np.int32((127 + sc) << 23).view(np.float32) if sc > -127 else np.float32(2.0 ** -127)
            if amax > best_in:                              # quantization is monotone: decode the largest
                best_in = amax
                best_k = k
        if block == 32 and mbits == 3 and emin == -6:             # MXFP8 E4M3: constants inlined
            _mx_row(e[:full * block], invc, 32, scs, downs, ups, -6, 3, mvf, ph)
        else:
            _mx_row(e[:full * block], invc, block, scs, downs, ups, emin, mbits, mvf, ph)
        if full < nbk:                                          # last, partial block
            _mx_row(e[full * block:], invc, T - full * block, scs[full:], downs[full:], ups[full:],
                    emin, mbits, mvf, ph[full * block:])
        if slow:                                                # blocks whose bits go subnormal: float64 route
            for k in range(nbk):
                amax = np.float32(bm[k] * invc)
                if amax > 0 and (((np.float32(amax).view(np.int32) >> 23) & 255) == 0 or scs[k] < -127 - emin):
                    for j in range(k * block, min((k + 1) * block, T)):
                        ph[j] = np.float32(_mx_one(np.float32(e[j] * invc), scs[k], emin, mbits, maxv))
        best = _mx_one(best_in, scs[best_k], emin, mbits, maxv) if best_in > 0 else 0.0
        t, s, z, pos = _p_stats(e[:n], inv, ph[:n], dp[:n] if dp.shape[0] > 0 else dp)
        if dp.shape[0] > 0:
            _fill_zero(dp[n:])
        return t, s, z / max(pos, 1), _first_eq(ph[:n], best)

    @parallel_kernel()
    def _tile(S, Si, nvis, cuts, wide, gate, ks, bone, amax, asum, mx, inv, ent, arg, far, top,
              X, narms, invh, ptv, parg, DQ, p_path, block, emax, emin, mbits, maxv, rsum, zrate,
              Bs, cnts, gidx, marks, bnds, PH, bms, scss, downss, upss):
        """Every row of a tile in one pass while the row is in cache: the reference softmax and its
        statistics (S -> e in place), the ``narms`` Q/K arms (scores in X rows ``a * R + r``), the P
        path. DQ non-empty (float32): the paths' P-hat - P as bfloat16 into DQ rows
        ``path * R + r``, the arms' e-hat and the P path's P-hat only in the per-thread row PH; DQ
        empty (float64): e-hat in place in X and P-hat into X row ``narms * R + r`` (the P-hat V
        product then uses them). The remaining arguments are per-thread scratch rows."""
        R = S.shape[0]
        bf16 = DQ.shape[0] > 0
        nodiff = np.empty(0, np.uint16)
        for r in prange(R):
            t = numba.get_thread_id()
            x = S[r]
            n = nvis[r]
            m, iz, en, fr, am = _ref_row(x, Si[r], n, cuts, wide, gate, ks[r], bone, amax[r], asum[r], top[r],
                                         Bs[t], cnts[t], gidx[t], marks[t], bnds[t])
            mx[r] = m
            inv[r] = iz
            ent[r] = en
            far[r] = fr
            arg[r] = am
            for a in range(narms):
                dh = DQ[a * R + r] if bf16 else nodiff
                invh[a, r], ptv[a, r], parg[a, r] = _arm_row(X[a * R + r], n, wide, x, iz, dh, PH[t])
            if p_path:
                ph = PH[t] if bf16 else X[narms * R + r]
                dp = DQ[narms * R + r] if bf16 else nodiff
                ptv[narms, r], rsum[r], zrate[r], parg[narms, r] = _p_row(
                    x, n, iz, block, emax, emin, mbits, maxv, ph, dp, bms[t], scss[t], downss[t], upss[t])

    # -- MX Q/K: signed Hadamard (fast Walsh-Hadamard transform in float64) + MX decode(encode(.)) ----

    @njit(fastmath=True, cache=True)
    def _absmax(x):
        m = abs(x[0])
        for j in range(x.shape[0]):
            m = max(m, abs(x[j]))
        return m

    @njit(cache=True)
    def _mx_signed_block(v, ob, sc, down, up, emin, mbits, maxv):
        """ob = decode(encode(v)) for one block of signed float32 values with block scale 2^sc."""
        for u in range(v.shape[0]):
            a = abs(v[u])
            ey = ((np.float32(a).view(np.int32) >> 23) & 255) - 127 - sc
            ee = ey if ey > emin else emin
            c = np.int32((ee - mbits + 150) << 23).view(np.float32)
            q = (a * down + c) - c
            q = q if q < maxv else maxv
            ob[u] = math.copysign(q * up, v[u])

    _FWHT_ROWS = 16

    @parallel_kernel()
    def _mx_rows(X, signs, hb, block, emax, emin, mbits, maxv, out):
        """out[r] = MX decode(encode(rotate(X[r]))), the values `MX.decode_rotated(MX.quantize(X))`
        returns. ``signs`` empty: no rotation; else ``x -> (x * signs) blockdiag(H_hb) / sqrt(hb)``
        in float64 by butterflies (the sums of SignedHadamard's dense product; the tests check the
        codes bit for bit), rounded to float32 as SignedHadamard.apply does. The butterflies run on
        16 rows at once (transposed), so that every stage is a contiguous vector operation."""
        N, D = X.shape
        G = _FWHT_ROWS
        sq = math.sqrt(hb)
        nbk = (D + block - 1) // block
        mvf = np.float32(maxv)
        ngrp = (N + G - 1) // G
        for grp in prange(ngrp):
            r0 = grp * G
            nr = min(G, N - r0)
            v = np.empty((G, D), np.float32)
            if signs.shape[0] > 0:
                t = np.zeros((D, G))
                for u in range(nr):
                    for i in range(D):
                        t[i, u] = np.float64(X[r0 + u, i]) * signs[i]
                for b0 in range(0, D, hb):
                    h = 1
                    while h < hb:
                        for i in range(b0, b0 + hb, 2 * h):
                            for jj in range(i, i + h):
                                ta = t[jj]
                                tb = t[jj + h]
                                for u in range(G):
                                    x = ta[u]
                                    y = tb[u]
                                    ta[u] = x + y
                                    tb[u] = x - y
                        h *= 2
                for u in range(nr):
                    for i in range(D):
                        v[u, i] = np.float32(t[i, u] / sq)
            else:
                for u in range(nr):
                    for i in range(D):
                        v[u, i] = X[r0 + u, i]
            for u in range(nr):
                vu = v[u]
                o = out[r0 + u]
                for k in range(nbk):
                    a0 = k * block
                    b0 = min(a0 + block, D)
                    amax = np.float32(_absmax(vu[a0:b0]))
                    if amax == 0:
                        for i in range(a0, b0):
                            o[i] = vu[i]                      # +-0 keep their sign, as the codes do
                        continue
                    field = (np.float32(amax).view(np.int32) >> 23) & 255
                    sc = min(max(field - 127 - emax, -127), 127)
                    if field == 0 or sc < -127 - emin:
                        if field == 0:
                            _, ex = math.frexp(amax)
                            sc = min(max(ex - 1 - emax, -127), 127)
                        for i in range(a0, b0):
                            y1 = abs(np.float64(vu[i])) * math.ldexp(1.0, -sc)
                            q = 0.0
                            if y1 > 0:
                                _, ey = math.frexp(y1)
                                qu = math.ldexp(1.0, max(ey - 1, emin) - mbits)
                                q = min(np.rint(y1 / qu) * qu, np.float64(maxv))
                            o[i] = math.copysign(np.float32(q * math.ldexp(1.0, sc)), vu[i])
                    else:
                        down = np.int32((127 - sc) << 23).view(np.float32)
                        up = np.int32((127 + sc) << 23).view(np.float32) if sc > -127 else np.float32(2.0 ** -127)
                        _mx_signed_block(vu[a0:b0], o[a0:b0], sc, down, up, emin, mbits, mvf)

    @parallel_kernel(fastmath=True)
    def _post_tile(NA, zc, inv, OH, invh, drop, kept_vis, out_ref, ref2, err_arm, ab_err2, ab_dot, ab_out2,
                   ab_tau, ab_tv, ab_ok):
        """Per-row outputs and errors from the P.V partial products.

        NA [A, R, D]: e_a V_a per ablation atom; zc [R, A]: sum e per atom; OH [P, R, D]: the paths'
        P-hat V (scaled by invh [P, R]). drop [B, A]: the atoms each ablation drops.
        """
        A, R, D = NA.shape
        P = OH.shape[0]
        B = drop.shape[0]
        for r in prange(R):
            o = np.zeros(D)
            for a in range(A):
                for d in range(D):
                    o[d] += np.float64(NA[a, r, d])
            s = 0.0
            for d in range(D):
                o[d] *= inv[r]
                out_ref[r, d] = o[d]
                s += o[d] * o[d]
            ref2[r] = s
            for p in range(P):
                s = 0.0
                for d in range(D):
                    t = np.float64(OH[p, r, d]) * invh[p, r] - o[d]
                    s += t * t
                err_arm[p, r] = s
            vk = np.empty(D)
            for i in range(B):
                kz = 0.0
                vis = 0
                for d in range(D):
                    vk[d] = 0.0
                for a in range(A):
                    if not drop[i, a]:
                        kz += zc[r, a]
                        vis += kept_vis[r, a]
                        for d in range(D):
                            vk[d] += np.float64(NA[a, r, d])
                if vis == 0 or kz == 0:
                    ab_ok[i, r] = False
                    continue
                ab_ok[i, r] = True
                e2 = 0.0
                dt = 0.0
                o2 = 0.0
                for d in range(D):
                    v = vk[d] / kz
                    e2 += (v - o[d]) * (v - o[d])
                    dt += v * o[d]
                    o2 += v * v
                ab_err2[i, r] = e2
                ab_dot[i, r] = dt
                ab_out2[i, r] = o2
                tau = 0.0
                tv = 0.0
                for a in range(A):
                    w = zc[r, a] * inv[r]
                    if drop[i, a]:
                        tau += w
                        tv += w
                    else:
                        tv += abs(w - zc[r, a] / kz)
                ab_tau[i, r] = tau
                ab_tv[i, r] = 0.5 * tv


if numba is not None:

    @njit(cache=True)
    def _fragile_rows(amax, coarse_of_fine, drop, ok, mx, fragile, out):
        """out[i, r]: ablation i keeps only keys more than ``fragile`` nats below row r's max."""
        R, F = amax.shape
        for r in range(R):
            for i in range(drop.shape[0]):
                km = _SENTINEL
                for f in range(F):
                    if not drop[i, coarse_of_fine[f]]:
                        km = max(km, amax[r, f])
                out[i, r] = ok[i, r] and (mx[r] - km > fragile)

    @njit(cache=True)
    def _scatter_tile(h0, c, s0, nv, ent, top, top_rows, asum, inv, f2r, f2b, ref2, ptv, parg, arg, err_arm, zr, rs,
                      ok, tau, tv2, e2, dt, o2, rows, ref2_head, path_tv, path_agree, path_err2, pp_zero, pp_sum,
                      ab_dm, ab_tv, undefined, sums, bm):
        """Per-row results of one tile into the [H, Tq] arrays (row r is head h0 + r // c, query
        s0 + r % c) and per-head sums; ``bm`` receives the rows' key-block masses."""
        R, F = asum.shape
        nreg = f2r.shape[1]
        nkb = f2b.shape[1]
        npc = top.shape[1]
        for r in range(R):
            hh = h0 + r // c
            qq = s0 + r % c
            nvf = np.float64(nv[r])
            rows[0, hh, qq] = nvf
            rows[1, hh, qq] = math.exp(ent[r]) / nvf
            for i in range(npc):
                rows[top_rows[i], hh, qq] = top[r, i]
            rows[2 + npc, hh, qq] = 0.0
            iv = inv[r]
            for x in range(nreg):
                t = 0.0
                for f in range(F):
                    t += asum[r, f] * iv * f2r[f, x]
                rows[3 + npc + x, hh, qq] = t
            for x in range(nkb):
                t = 0.0
                for f in range(F):
                    t += asum[r, f] * iv * f2b[f, x]
                bm[r, x] = t
            ref2_head[hh] += ref2[r]
            for p in range(ptv.shape[0]):
                path_tv[p, hh, qq] = ptv[p, r]
                path_agree[p, hh, qq] = parg[p, r] == arg[r]
                path_err2[p, hh] += err_arm[p, r]
            if pp_zero.shape[0] > 0:
                pp_zero[hh, qq] = zr[r]
                pp_sum[hh, qq] = rs[r]
            for i in range(ab_dm.shape[0]):
                if ok[i, r]:
                    ab_dm[i, hh, qq] = tau[i, r]
                    ab_tv[i, hh, qq] = tv2[i, r]
                    sums[0, i, hh] += e2[i, r]
                    sums[1, i, hh] += ref2[r]
                    sums[2, i, hh] += dt[i, r]
                    sums[3, i, hh] += o2[i, r]
                else:
                    undefined[i, hh] += 1


# ------------------------------------------------------------------------------------------------
# results
# ------------------------------------------------------------------------------------------------

class _RecordError:
    """``rel_l2`` over the whole record from per-head sums ``err2`` and ``ref2``, as ``mx_paths``."""

    err2: torch.Tensor
    ref2: torch.Tensor

    @property
    def rel_l2(self) -> float:
        return float((self.err2.sum() / self.ref2.sum()).sqrt())


@dataclass
class QKPath(_RecordError):
    """MXFP8 on Q and K (one rotation): per-row TV and argmax agreement ``[H, Tq]``, and per-head
    sums of ``||O-hat - O||^2`` and ``||O||^2`` (``rel_l2`` is over the whole record, as ``mx_paths``)."""

    rotation: str
    scheme: str
    tv: torch.Tensor
    argmax_agree: torch.Tensor
    err2: torch.Tensor
    ref2: torch.Tensor


@dataclass
class PPath(_RecordError):
    """MX on the probabilities (32-key blocks): per-row TV, argmax agreement, numerical-zero rate and
    row sum of the decoded P ``[H, Tq]``; per-head error sums."""

    scheme: str
    tv: torch.Tensor
    argmax_agree: torch.Tensor
    zero_rate: torch.Tensor
    row_sum: torch.Tensor
    err2: torch.Tensor
    ref2: torch.Tensor


@dataclass
class StreamResult:
    """Everything `analyze` measured on one record.

    ``observation``: a `metrics.Observation` with the same rows, heatmap and Jaccard arrays as
    `metrics.observe`. ``ablation``: a `ablation.ArmResult` for the float arm measured against its
    own full output (``err2 == own_err2``); ``output`` is the full ``[H, Tq, D]`` output only with
    ``keep_output=True``, else None. ``qk``: one `QKPath` per rotation; ``p``: the `PPath` or None.
    ``seconds`` / ``cpu_seconds``: wall and process CPU time per stage; ``fallback_rows``: rows
    recomputed by the reference code.
    """

    dtype: torch.dtype
    observation: Observation
    ablation: ArmResult
    qk: dict
    p: PPath | None
    seconds: dict = field(default_factory=dict)
    cpu_seconds: dict = field(default_factory=dict)
    tiles: int = 0
    fallback_rows: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------

def _cuts(keys: int, frame: int, layout, spans: dict) -> tuple[list[int], list[int]]:
    """Fine cuts (regions, ablation spans, key blocks) and coarse cuts (regions, spans)."""
    coarse = cut_points(keys, layout, spans)
    fine = sorted(set(coarse) | set(range(0, keys, frame)))
    return fine, coarse


def _group_of(fine: list[int], bounds: list[tuple[int, int]]) -> np.ndarray:
    """One-hot ``[F, G]``: which of the spans ``bounds`` each fine atom lies in."""
    f = len(fine) - 1
    m = np.zeros((f, len(bounds)), np.float64)
    for i in range(f):
        a, b = fine[i], fine[i + 1]
        for g, (s, t) in enumerate(bounds):
            if s <= a and b <= t:
                m[i, g] = 1.0
    return m


class _Clock:
    """Wall time per stage (``seconds``) and process CPU time per stage (``cpu_seconds``)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self._t = time.perf_counter()
        self._c = time.process_time()

    def lap(self, name: str) -> None:
        t, c = time.perf_counter(), time.process_time()
        self.seconds[name] = self.seconds.get(name, 0.0) + (t - self._t)
        self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + (c - self._c)
        self._t, self._c = t, c


def analyze(case, *, dtype: torch.dtype = torch.float32, rotations=("none", "signed_hadamard"),
            p_path: bool = True, ablations=DEFAULT_ABLATIONS, element: str = "e4m3", block_size: int = 32,
            rotation_seed: int = 0, block_tokens: int = 16, coverage: float = 0.9, percents=TOP_PERCENTS,
            max_scores: int = DEFAULT_MAX_SCORES, keep_output: bool = False) -> StreamResult:
    """Fused single-pass analysis of ``case`` (see the module docstring).

    Parameters mirror the non-fused implementations: ``rotations``/``element``/``block_size``/
    ``rotation_seed``/``p_path`` those of ``mx_paths``; ``ablations`` names ablations of
    `testbed.ablation_core` (non-applicable ones are skipped, ``none`` is implied); ``block_tokens``/
    ``coverage``/``percents`` those of `metrics.observe`. ``dtype`` is float32 (fast) or float64
    (the reference precision). ``max_scores`` bounds the scores of one tile (per path).
    """
    if numba is None:  # pragma: no cover
        raise RuntimeError("testbed.streaming needs numba")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if element not in ELEMENTS:
        raise ValueError(f"element must be one of {sorted(ELEMENTS)}, got {element!r}")
    for rot in rotations:
        if rot not in ("none", "signed_hadamard"):
            raise ValueError(f"rotation must be 'none' or 'signed_hadamard', got {rot!r}")
    clock = _Clock()
    wide = dtype == torch.float64
    np_dt = np.float64 if wide else np.float32
    h, tq, d = case.q.shape
    hkv, tk, _ = case.k.shape
    g = h // hkv
    scale = 1.0 / math.sqrt(d)
    percents = tuple(percents)
    order = sorted(range(len(percents)), key=lambda i: percents[i])        # the kernel wants k ascending

    # ---- layout: atoms (fine: regions, spans, key blocks; coarse: regions, spans) -------------
    frame = frame_size(case, block_tokens)
    nkb = -(-tk // frame)
    spans = {}
    for name in ablations:
        sp = make_ablation(name).dropped(case)
        if sp is not None and name != "none":
            spans[name] = sp
    names = list(spans)
    nab = len(names)
    fine, coarse = _cuts(tk, frame, case.layout, spans)
    cuts = np.asarray(fine, np.int64)
    nf = len(fine) - 1
    coarse_b = list(zip(coarse[:-1], coarse[1:]))
    na = len(coarse_b)
    fine_to_coarse = _group_of(fine, coarse_b)                                           # [F, A]
    coarse_of_fine = fine_to_coarse.argmax(axis=1)
    fine_to_block = _group_of(fine, [(b * frame, min(tk, (b + 1) * frame)) for b in range(nkb)])
    region_bounds = {r.name: (r.start, r.stop) for r in case.layout}
    hist = history_span(case.layout)
    if hist is not None:
        region_bounds["history"] = hist
    rnames = list(region_bounds)
    fine_to_region = _group_of(fine, list(region_bounds.values()))                       # [F, regions]
    drop = np.zeros((nab, na), np.bool_)
    for i, nm in enumerate(names):
        for a, (s, t) in enumerate(coarse_b):
            drop[i, a] = any(x <= s and t <= y for x, y in spans[nm])
    coarse_lo = np.array([s for s, _ in coarse_b], np.int64)
    coarse_hi = np.array([t for _, t in coarse_b], np.int64)

    qpos = case.query_positions.to(torch.int64).cpu()
    nvis_q = (torch.clamp(qpos + 1, max=tk) if case.causal else torch.full((tq,), tk, dtype=torch.int64)).numpy()
    ks_q = np.stack([top_counts(torch.from_numpy(nvis_q), percents[i]).numpy() for i in order], axis=1)
    qblock = qpos // frame
    qblocks = sorted(set(qblock.tolist()))
    qb_index = torch.tensor([qblocks.index(b) for b in qblock.tolist()], dtype=torch.int64)

    # ---- MX Q/K: quantized per KV head (rows are independent) into buffers reused across heads,
    # so that no record-sized array is allocated and first touched -------------------------------
    fmt = ELEMENTS[element]
    arms = []                  # (rotation, scheme name, signs, Hadamard block, Q-hat buffer, K-hat buffer)
    for rot in rotations:
        mx = MX(element, block_size, None if rot == "none" else rot, rotation_seed)
        r = mx.rotation_for(d)
        signs = r.signs.to(torch.float64).numpy() if r is not None else np.empty(0)
        arms.append((rot, mx.name, signs, r.block if r is not None else 1,
                     np.empty((g * tq, d), np.float32), np.empty((tk, d), np.float32)))

    def mx_head(j: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per arm: (Q-hat / sqrt(D) of KV head j's query heads [g, Tq, D], K-hat of head j [Tk, D])
        in ``dtype``, the values `MX.decode_rotated(MX.quantize(.))` gives (tested bit for bit)."""
        xq = case.q[j * g:(j + 1) * g].detach().to(torch.float32).reshape(-1, d).contiguous().numpy()
        xk = case.k[j].detach().to(torch.float32).contiguous().numpy()
        out = []
        for _, _, signs, hb, qb, kb in arms:
            _mx_rows(xq, signs, hb, block_size, fmt.emax, fmt.emin, fmt.mbits, fmt.max, qb)
            _mx_rows(xk, signs, hb, block_size, fmt.emax, fmt.emin, fmt.mbits, fmt.max, kb)
            out.append((torch.from_numpy(qb).view(g, tq, d).to(dtype) * scale, torch.from_numpy(kb).to(dtype)))
        return out
    clock.lap("setup (MX Q/K quantize, layout)")

    # ---- per-row and per-head results (numpy, returned as torch views) ------------------------
    f64 = np.float64
    pnames = [f"top{pc}" for pc in percents]
    row_keys = ["visible_keys", "support", *pnames, "zero_rate", *[f"{r}_mass" for r in rnames]]
    rows_arr = np.empty((len(row_keys), h, tq), f64)       # visible, support, top*, zero_rate, regions
    rows = {key: rows_arr[i] for i, key in enumerate(row_keys)}
    top_rows = np.array([2 + order[col] for col in range(len(order))], np.int64)
    heat = torch.zeros(h, len(qblocks), nkb, dtype=torch.float64)
    counts = torch.bincount(qb_index, minlength=len(qblocks)).to(torch.float64)
    jq = torch.empty(h, max(tq - 1, 0), dtype=torch.float64)
    set_size = torch.empty(h, tq, dtype=torch.float64)
    dropped_mass = np.full((nab, h, tq), np.nan)
    ab_tv = np.full((nab, h, tq), np.nan)
    undefined = np.zeros((nab, h), np.int64)
    sums_arr = np.zeros((4, nab, h))
    sums = dict(zip(("err2", "ref2", "dot", "out2"), sums_arr))
    output = np.empty((h, tq, d)) if keep_output else None
    npaths = len(arms) + (1 if p_path else 0)
    path_tv = np.empty((npaths, h, tq))
    path_agree = np.empty((npaths, h, tq), np.bool_)
    path_err2 = np.zeros((npaths, h))
    ref2_head = np.zeros(h)
    pp_zero = np.empty((h, tq) if p_path else (0, 0))
    pp_sum = np.empty((h, tq) if p_path else (0, 0))
    fallback = {"zero_rate": 0, "ablation": 0}

    # ---- tile buffers, reused ----------------------------------------------------------------
    step = max(1, int(max_scores) // (g * tk))
    rmax = g * min(step, tq)
    S = np.empty((rmax, tk), np_dt)
    # float32: the paths' output errors come from (P-hat - P) V with the difference and V in
    # bfloat16, one product for every path; float64 keeps P-hat V in float64
    bf16 = not wide and npaths > 0
    nx = len(arms) + (0 if bf16 else int(p_path))                         # rows of X per tile row
    X = np.empty((max(nx, 1) * rmax, tk), np_dt)          # Q/K arms' scores (float64: e-hat in place, then P-hat)
    NA = np.empty((na, rmax, d), np_dt)
    OH = np.empty((max(npaths, 1) * rmax, d), np_dt)
    DQ = np.empty((npaths * rmax, tk) if bf16 else (0, 0), np.uint16)
    bone = int(np.array(1.0, np_dt).view(np.int64 if wide else np.int32))
    nthr = numba.config.NUMBA_NUM_THREADS                                 # scratch: one row per thread
    Bs = np.empty((nthr, tk), np.uint16)
    cnts = np.empty((nthr, 4 * _NB), np.int32)
    gidx = np.empty((nthr, 2, _GCAP), np.int64)
    marks = np.empty((nthr, (tk + 7) // 8 * 8), np.uint8)
    bnds = np.empty((nthr, 6), np.int64 if wide else np.int32)
    nbp = -(-tk // block_size)
    PH = np.empty((nthr, tk), np_dt)                      # float32: the arms' e-hat, then the P path's P-hat
    bms, scss = np.empty((nthr, nbp), np_dt), np.empty((nthr, nbp), np.int64)
    downss, upss = np.empty((nthr, nbp), np.float32), np.empty((nthr, nbp), np.float32)
    amax = np.empty((rmax, nf))
    asum = np.empty((rmax, nf))
    mx_, inv, ent = np.empty(rmax), np.empty(rmax), np.empty(rmax)
    far, arg = np.empty(rmax, np.int64), np.empty(rmax, np.int64)
    top = np.empty((rmax, len(percents)))
    invh = np.ones((max(npaths, 1), rmax))               # 1 / Z-hat; the P path's row stays 1 (P-hat is normalized)
    ptv = np.empty((max(npaths, 1), rmax))
    parg = np.empty((max(npaths, 1), rmax), np.int64)
    rs, zr = np.empty(rmax), np.empty(rmax)
    out_ref, ref2 = np.empty((rmax, d)), np.empty(rmax)
    err_arm = np.empty((max(npaths, 1), rmax))
    e2, dt_, o2, tau, tv2 = (np.zeros((max(nab, 1), rmax)) for _ in range(5))
    ok = np.zeros((max(nab, 1), rmax), np.bool_)
    frag = np.zeros((max(nab, 1), rmax), np.bool_)
    bm_t = np.empty((rmax, nkb))
    bm_head = np.empty((g, tq, nkb))
    fragile = FRAGILE[dtype]
    tiles = 0
    for j in range(hkv):
        heads = slice(j * g, (j + 1) * g)
        qj = case.q[heads].to(dtype) * scale
        kj = case.k[j].to(dtype)
        vj = case.v[j].to(dtype)
        vj16 = vj.to(torch.bfloat16) if bf16 else None
        arm_qk = mx_head(j)
        clock.lap("setup (MX Q/K quantize, layout)")
        for s0 in range(0, tq, step):
            qs = slice(s0, min(tq, s0 + step))
            c = qs.stop - qs.start
            R = g * c
            tiles += 1
            Sv = S[:R]
            torch.matmul(qj[:, qs].reshape(R, d), kj.T, out=torch.from_numpy(Sv))
            clock.lap("QK^T matmul (reference)")
            # every Q Kᵀ of the tile back to back, then the numba kernels: torch's and numba's OpenMP
            # pools each spin a while after their parallel regions, so fewer switches waste less
            for ai, (aq, ak) in enumerate(arm_qk):
                torch.matmul(aq[:, qs].reshape(R, d), ak.T, out=torch.from_numpy(X[ai * R:(ai + 1) * R]))
            clock.lap("QK^T matmul (MX Q/K arms)")
            nv = np.tile(nvis_q[qs], g)
            ks = np.tile(ks_q[qs], (g, 1))
            _tile(Sv, Sv.view(np.int64 if wide else np.int32), nv, cuts, wide, ZERO_GATE, ks, bone,
                  amax[:R], asum[:R], mx_[:R], inv[:R], ent[:R], arg[:R], far[:R], top[:R],
                  X[: nx * R], len(arms), invh[:, :R], ptv[:, :R], parg[:, :R], DQ[: npaths * R] if bf16 else DQ,
                  p_path, block_size, fmt.emax, fmt.emin, fmt.mbits, fmt.max, rs[:R], zr[:R],
                  Bs, cnts, gidx, marks, bnds, PH, bms, scss, downss, upss)
            clock.lap("softmax, metrics and paths kernel")

            # P.V: e per ablation atom (sums to Z O), and the paths' P-hat V in one product
            for a, (s, t) in enumerate(coarse_b):
                torch.matmul(torch.from_numpy(Sv[:, s:t]), vj[s:t], out=torch.from_numpy(NA[a, :R]))
            if bf16:
                prod = torch.matmul(torch.from_numpy(DQ[: npaths * R]).view(torch.bfloat16), vj16).view(npaths, R, d).float()
                for ai in range(npaths):
                    err_arm[ai, :R] = prod[ai].double().square().sum(dim=-1).numpy()
            elif npaths:
                torch.matmul(torch.from_numpy(X[: npaths * R]), vj, out=torch.from_numpy(OH[: npaths * R]))
            clock.lap("P.V matmuls")

            zc = asum[:R] @ fine_to_coarse
            kept_vis = np.clip(np.minimum(nv[:, None], coarse_hi[None, :]) - coarse_lo[None, :], 0, None)
            npost = 0 if bf16 else npaths                       # bfloat16: the errors are already in err_arm
            _post_tile(NA[:, :R], zc, inv[:R], OH[: max(npaths, 1) * R].reshape(max(npaths, 1), R, d)[:npost],
                       invh[:npost, :R], drop, kept_vis, out_ref[:R], ref2[:R], err_arm[:, :R],
                       e2[:, :R], dt_[:, :R], o2[:, :R], tau[:, :R], tv2[:, :R], ok[:, :R])
            clock.lap("output errors kernel")

            # ---- per-row results into [H, Tq] ----
            if nab:
                _fragile_rows(amax[:R], coarse_of_fine, drop, ok[:, :R], mx_[:R], fragile, frag[:, :R])
                for i, rr in zip(*np.nonzero(frag[:nab, :R])):   # kept keys far below the max: `ablate` recomputes
                    fallback["ablation"] += 1
                    hh_, qq = j * g + rr // c, s0 + rr % c
                    res = ablate(case.q[hh_:hh_ + 1, qq:qq + 1], case.k[j:j + 1], case.v[j:j + 1],
                                 case.query_positions[qq:qq + 1], case.causal, case.layout, {names[i]: spans[names[i]]})
                    e2[i, rr], dt_[i, rr], o2[i, rr] = float(res.err2[0, 0]), float(res.dot[0, 0]), float(res.out2[0, 0])
                    tau[i, rr], tv2[i, rr] = float(res.dropped_mass[0, 0, 0]), float(res.tv[0, 0, 0])
            _scatter_tile(j * g, c, s0, nv, ent[:R], top[:R], top_rows, asum[:R], inv[:R], fine_to_region, fine_to_block,
                          ref2[:R], ptv[:npaths, :R], parg[:npaths, :R], arg[:R], err_arm[:npaths, :R], zr[:R], rs[:R],
                          ok[:nab, :R], tau[:nab, :R], tv2[:nab, :R], e2[:nab, :R], dt_[:nab, :R], o2[:nab, :R],
                          rows_arr, ref2_head, path_tv, path_agree, path_err2, pp_zero, pp_sum, dropped_mass, ab_tv,
                          undefined, sums_arr, bm_t[:R])
            if keep_output:
                output[heads, qs] = out_ref[:R].reshape(g, c, d)
            for rr in np.nonzero(far[:R] > 0)[0]:  # logits spanning > ZERO_GATE nats: torch's float32 softmax
                fallback["zero_rate"] += 1
                hh_, qq = j * g + rr // c, s0 + rr % c
                s64 = (case.q[hh_, qq:qq + 1].to(torch.float64) @ case.k[j].to(torch.float64).T) * scale
                vis = torch.arange(tk).unsqueeze(0) < int(nv[rr])
                p32 = torch.softmax(s64.to(torch.float32).masked_fill(~vis, float("-inf")), dim=-1)
                rows["zero_rate"][hh_, qq] = float(strict_zero_rate(p32, vis if case.causal else None)[0])
            bm_head[:, qs] = bm_t[:R].reshape(g, c, nkb)
            clock.lap("per-tile bookkeeping")
        # key-block masses of the whole head group: heatmap, top-block sets, Jaccard (metrics' own code)
        bm = torch.from_numpy(bm_head)
        heat[heads].index_add_(1, qb_index, bm)
        sets = top_blocks(bm, coverage)
        set_size[heads] = sets.sum(dim=-1).to(torch.float64)
        if tq > 1:
            jq[heads] = jaccard(sets[:, 1:], sets[:, :-1])
        clock.lap("per-tile bookkeeping")

    heat = heat / counts.view(1, -1, 1)
    bsets = top_blocks(heat, coverage)
    jb = jaccard(bsets[:, 1:], bsets[:, :-1]) if len(qblocks) > 1 else torch.empty(h, 0, dtype=torch.float64)
    T = torch.from_numpy
    obs = Observation({k: T(v.copy()) for k, v in rows.items()}, heat, qblocks, frame, jq, jb, set_size)
    rmass = {rn: T(rows[f"{rn}_mass"]) for rn in rnames}
    arm = ArmResult(names, T(dropped_mass), T(ab_tv), T(undefined), T(sums["err2"].copy()), T(sums["ref2"].copy()),
                    T(sums["dot"].copy()), T(sums["out2"].copy()), T(sums["err2"].copy()), T(sums["ref2"].copy()), rmass,
                    None if output is None else T(output))
    qk = {rot: QKPath(rot, name, T(path_tv[ai]), T(path_agree[ai]), T(path_err2[ai]), T(ref2_head.copy()))
          for ai, (rot, name, *_) in enumerate(arms)}
    pres = None
    if p_path:
        pi = len(arms)
        pres = PPath(MX(element, block_size).name, T(path_tv[pi]), T(path_agree[pi]), T(pp_zero), T(pp_sum),
                     T(path_err2[pi]), T(ref2_head.copy()))
    clock.lap("finish")
    return StreamResult(dtype, obs, arm, qk, pres, clock.seconds, clock.cpu_seconds, tiles, fallback)
