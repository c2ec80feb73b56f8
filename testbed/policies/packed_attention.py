"""Attention that reads a policy cache's packed history as codes, without decoding it first.

With K quantized per channel (KIVI), a key of group g is ``k_t,d = c_t,d * s_g,d + z_g,d``, so

    q · k_t = Σ_d (q_d s_g,d) c_t,d + Σ_d q_d z_g,d

— the scale folds into the query once per group (for every query row of the KV head's GQA group)
and the zero-point into one constant per row and group. V is per token over feature groups f:
``Σ_t p_t v_t,d = Σ_t p_t (c_t,d s_t,f + z_t,f)``; its scales could fold into P the same way, but
decoding one token's row into a D-float scratch and adding ``p_t`` times it to every row was
measured faster (fewer, longer vector loops), so that is what the kernel does.

:func:`attend` is one numba kernel call per layer on the CPU, parallel over (batch × KV head ×
blocks of ``span`` packed keys, plus one block over the float32 keys: sink, window and the new
tokens, causal among them): each block gives a softmax partial (max, sum, numerator) and a second
pass merges them exactly. :func:`packed_part` is the packed blocks alone, to be merged
(:func:`merge`) with a float part computed by torch (:func:`float_part`). The history's float32
form never exists in memory: per block one group's folded query and one token's unpacked codes
are scratch.

The kernel's cost grows with the query rows per KV head, the definition's (decode once, then GEMMs)
hardly: above :data:`KERNEL_MAX_ROWS` rows (a chunk of several new tokens) and off the CPU the
definition :func:`packed_part_reference` runs instead (measured crossover, see
benchmarks/README.md). The definition is decode-then-attend (``PolicyLayer`` without ``direct``);
the kernel must equal it within float32 rounding (tests/test_policies.py: relative 1e-4 over
shapes, bits, GQA ratios and chunks; in SmolLM2 the log-probs agree within 1e-4, tests/test_live.py).
"""

from __future__ import annotations

import numpy as np
import torch

from ..quant import kernels

try:
    from numba import njit, prange
except ImportError:  # pragma: no cover
    njit = None

__all__ = ["attend", "packed_part", "packed_part_reference", "merge", "float_part", "supported", "kernel_serves",
           "KERNEL_MAX_ROWS"]

# query rows per KV head (GQA ratio × new tokens) up to which the kernel is used (measured crossover)
KERNEL_MAX_ROWS = 12


def supported(policy) -> bool:
    """Integer middles of whole codes per byte (2, 4, 8 bits: the kernel's unpacking; not int3, whose
    codes straddle bytes) with K per channel and V per token (the layouts whose scales fold)."""
    return policy.quantized and policy.middle in ("int2", "int4", "int8") and policy.key_axis == "channel" \
        and not policy.mixed and not policy.heavy


if njit is not None:
    _FM = {"nsz", "arcp", "contract", "afn", "reassoc"}  # no ninf/nnan: -inf is used
    _U = np.uint64  # unsigned loop indices: no negative-index wraparound, so the inner loops vectorize

    @njit(inline="always", fastmath=_FM, cache=True)
    def _unpack(row, x, bits, nseg, fb, sv, zv, scaled):  # pragma: no cover - numba
        """One token's codes into float32 ``x``, segment by segment (``nseg`` segments of ``fb``
        bytes: V's feature groups, or K's whole row). Inside a segment the channels are split by
        their position in the byte: ``x[f*fg + k*fb + i]`` holds channel ``(f*fb + i)*per + k``
        (``fg = per*fb``); each inner loop is one vectorizable stream. ``scaled``: ``code * sv[f]
        + zv[f]`` (a V row), else the code."""
        per = 8 // bits
        fg = per * fb
        for f in range(nseg):
            s = sv[f] if scaled else np.float32(1.0)
            z = zv[f] if scaled else np.float32(0.0)
            src = _U(f * fb)
            dst = _U(f * fg)
            if bits == 4:
                for i in range(_U(fb)):
                    c = row[src + i]
                    x[dst + i] = np.float32(c & np.uint8(15)) * s + z
                    x[dst + _U(fb) + i] = np.float32(c >> np.uint8(4)) * s + z
            elif bits == 2:
                for i in range(_U(fb)):
                    c = row[src + i]
                    x[dst + i] = np.float32(c & np.uint8(3)) * s + z
                    x[dst + _U(fb) + i] = np.float32((c >> np.uint8(2)) & np.uint8(3)) * s + z
                    x[dst + _U(2 * fb) + i] = np.float32((c >> np.uint8(4)) & np.uint8(3)) * s + z
                    x[dst + _U(3 * fb) + i] = np.float32(c >> np.uint8(6)) * s + z
            else:
                for i in range(_U(fb)):
                    x[dst + i] = np.float32(row[src + i]) * s + z

    @njit(inline="always", cache=True)
    def _pos(j, per, fb):  # pragma: no cover - numba
        """Where channel ``j`` sits in an unpacked row (see _unpack)."""
        fg = per * fb
        f = j // fg
        w = j - f * fg
        return f * fg + (w % per) * fb + w // per

    @kernels.parallel_kernel(fastmath=_FM)
    def _attend(q, kc, ks, kz, vc, vs, vz, f16, n, bits, group, fgroup, scaling, span,  # pragma: no cover
                fk, fv, tq, new, norm, num, mx, sm):
        # q [B, H, R, D] float32 (the R query rows of each KV head); kc [B, H, Tp, kb] uint8 codes
        # of K per channel, ks/kz [B, H, Tp/group, D] float16 bit patterns (uint16); vc [B, H, T,
        # vb] codes of V per token in feature groups of fgroup, vs/vz [B, H, T, nf]; f16 the
        # float32 value of every float16 pattern; n keys. Blocks of ``span`` keys (whole groups)
        # of every head run in parallel, each giving a softmax partial (max, sum, numerator); so
        # does one more block per head over the float32 keys fk/fv [B, H, nfl, D] (none when nfl
        # is 0) whose last ``new`` are the queries' own tokens, causal among them (row r is query
        # token r % tq); a second pass merges them exactly, and with ``norm`` divides by the sum.
        nb_, nh, nr, d = q.shape
        per = 8 // bits
        kb = kc.shape[3]
        vb = vc.shape[3]
        mk = per * kb
        mv = per * vb
        nf = vs.shape[3]
        fb = fgroup // per  # bytes of one feature group of V
        nblk = (n + span - 1) // span
        nfl = fk.shape[2]
        ntb = nblk + (1 if nfl else 0)  # blocks per head, the float one last
        pn = np.empty((nb_, nh, nblk, nr, mv), np.float32)
        pm = np.empty((nb_, nh, ntb, nr), np.float32)
        pl = np.empty((nb_, nh, ntb, nr), np.float32)
        fn = np.empty((nb_, nh, nr, d), np.float32)
        one = np.ones(1, np.float32)
        kpos = np.empty(d, np.int64)
        vpos = np.empty(d, np.int64)
        for j in range(d):
            kpos[j] = _pos(j, per, kb)
            vpos[j] = _pos(j, per, fb)
        for task in prange(nb_ * nh * ntb):
            bh = task // ntb
            blk = task - bh * ntb
            b = bh // nh
            h = bh - b * nh
            if blk == nblk:
                _float_block(q[b, h], fk[b, h], fv[b, h], scaling, tq, new, pm[b, h, blk], pl[b, h, blk], fn[b, h])
                continue
            t0 = blk * span
            t1 = min(n, t0 + span)
            sc = np.empty((nr, span), np.float32)
            qs = np.zeros((nr, mk), np.float32)  # the folded query q * s_g; padding channels stay 0
            qz = np.empty(nr, np.float32)
            x = np.empty(max(mk, mv), np.float32)
            s16 = np.empty(d, np.float32)
            z16 = np.empty(d, np.float32)
            # scores: q . k_t = sum_d (q_d s_g,d) c_t,d + sum_d q_d z_g,d over the group g of t
            for g in range(t0 // group, (t1 + group - 1) // group):
                for j in range(d):
                    s16[j] = f16[ks[b, h, g, j]]
                    z16[j] = f16[kz[b, h, g, j]]
                for r in range(nr):
                    acc = np.float32(0.0)
                    qr = qs[r]
                    for j in range(d):
                        acc += q[b, h, r, j] * z16[j]
                        qr[kpos[j]] = q[b, h, r, j] * s16[j]
                    qz[r] = acc
                for t in range(max(t0, g * group), min(t1, (g + 1) * group)):
                    _unpack(kc[b, h, t], x, bits, 1, kb, one, one, False)
                    for r in range(nr):
                        qr = qs[r]
                        acc = np.float32(0.0)
                        for m in range(_U(mk)):
                            acc += qr[m] * x[m]
                        sc[r, t - t0] = (acc + qz[r]) * scaling
            # the block's softmax partial; values: one token's row decoded into x at a time
            for r in range(nr):
                m0 = np.float32(-np.inf)
                for t in range(t1 - t0):
                    m0 = max(m0, sc[r, t])
                pm[b, h, blk, r] = m0
                l0 = np.float32(0.0)
                for t in range(t1 - t0):
                    e = np.exp(sc[r, t] - m0)
                    sc[r, t] = e
                    l0 += e
                pl[b, h, blk, r] = l0
            acc_v = pn[b, h, blk]
            acc_v[:] = 0.0
            sv = np.empty(nf, np.float32)
            zv = np.empty(nf, np.float32)
            for t in range(t0, t1):
                for f in range(nf):
                    sv[f] = f16[vs[b, h, t, f]]
                    zv[f] = f16[vz[b, h, t, f]]
                _unpack(vc[b, h, t], x, bits, nf, fb, sv, zv, True)
                for r in range(nr):
                    w = sc[r, t - t0]
                    ar = acc_v[r]
                    for m in range(_U(mv)):
                        ar[m] += w * x[m]
        # exact merge of each head's blocks
        for bh in prange(nb_ * nh):
            b = bh // nh
            h = bh - b * nh
            for r in range(nr):
                m0 = np.float32(-np.inf)
                for blk in range(ntb):
                    m0 = max(m0, pm[b, h, blk, r])
                mx[b, h, r] = m0
                out = num[b, h, r]
                out[:] = 0.0
                l0 = np.float32(0.0)
                for blk in range(nblk):
                    w = np.exp(pm[b, h, blk, r] - m0)
                    l0 += w * pl[b, h, blk, r]
                    part = pn[b, h, blk, r]
                    for j in range(d):
                        out[j] += w * part[vpos[j]]
                if nfl:
                    w = np.exp(pm[b, h, nblk, r] - m0)
                    l0 += w * pl[b, h, nblk, r]
                    part = fn[b, h, r]
                    for j in range(_U(d)):
                        out[j] += w * part[j]
                sm[b, h, r] = l0
                if norm:
                    for j in range(_U(d)):
                        out[j] /= l0

    @njit(inline="always", fastmath=_FM, cache=True)
    def _float_block(q, fk, fv, scaling, tq, new, pm, pl, fn):  # pragma: no cover - numba
        """Softmax partial of the query rows ``q`` [R, D] over float32 keys ``fk``/``fv`` [nfl, D]
        whose last ``new`` are the query tokens (key t hidden from row r when t > nfl - new + r % tq)."""
        nr, d = q.shape
        nfl = fk.shape[0]
        sc = np.empty(nfl, np.float32)
        for r in range(nr):
            qr = q[r]
            last = nfl - new + r % tq  # the newest key row r sees
            m0 = np.float32(-np.inf)
            for t in range(last + 1):
                kr = fk[t]
                acc = np.float32(0.0)
                for j in range(_U(d)):
                    acc += qr[j] * kr[j]
                sc[t] = acc * scaling
                m0 = max(m0, sc[t])
            pm[r] = m0
            out = fn[r]
            out[:] = 0.0
            l0 = np.float32(0.0)
            for t in range(last + 1):
                e = np.exp(sc[t] - m0)
                l0 += e
                vr = fv[t]
                for j in range(_U(d)):
                    out[j] += e * vr[j]
            pl[r] = l0


def _rows(query: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B, Hq, tq, D] -> [B, Hkv, (Hq/Hkv) * tq, D]: the query rows of each KV head's group."""
    b, hq, tq, d = query.shape
    return query.reshape(b, hkv, (hq // hkv) * tq, d)


def _unrows(x: torch.Tensor, hq: int, tq: int) -> torch.Tensor:
    """Inverse of :func:`_rows` (trailing dims kept)."""
    return x.reshape(x.shape[0], hq, tq, *x.shape[3:])


def _kernel_can(query: torch.Tensor, layer) -> bool:
    """numba present, CPU tensors, and V's feature groups made of whole code bytes."""
    vq = layer.mid_v.q
    return njit is not None and query.device.type == "cpu" and vq.group_size % (8 // vq.bits) == 0


def kernel_serves(query: torch.Tensor, layer) -> bool:
    """Whether :func:`packed_part` runs the kernel for this query: it can, and the query has at
    most :data:`KERNEL_MAX_ROWS` rows per KV head (else the definition is faster)."""
    rows = query.shape[1] // layer.mid_k.shape_lead[-1] * query.shape[2]
    return _kernel_can(query, layer) and rows <= KERNEL_MAX_ROWS


def _use_kernel(query, layer, kernel: bool | None) -> bool:
    if kernel is None:
        return kernel_serves(query, layer)
    if kernel and not _kernel_can(query, layer):
        raise ValueError("the kernel needs numba, CPU tensors and V feature groups of whole code bytes")
    return kernel


def packed_part(query: torch.Tensor, layer, scaling: float, tokens: int | None = None, *, kernel: bool | None = None,
                span: int = 256):
    """(numerator [B, Hq, tq, D], max [B, Hq, tq], sum [B, Hq, tq]) of softmax attention over the
    first ``tokens`` keys of the layer's packed middle (all by default). ``kernel``: None picks by
    :func:`kernel_serves`; True forces the kernel (tests), False the definition. ``span``: keys per
    parallel block of the kernel (rounded down to whole K groups). Every packed key is older than
    every query, so no mask applies here (no padded batches)."""
    if not _use_kernel(query, layer, kernel):
        return packed_part_reference(query, layer, scaling, tokens)
    return _run_kernel(query, layer, scaling, tokens, span, None, None, 0, False)


def attend(query: torch.Tensor, layer, keys: torch.Tensor, values: torch.Tensor, scaling: float, tokens: int | None,
           new: int, *, kernel: bool | None = None, span: int = 256) -> torch.Tensor:
    """Softmax attention [B, Hq, tq, D] over the first ``tokens`` keys of the packed middle and
    the float32 ``keys``/``values`` [B, Hkv, nfl, D] (sink, window, the ``new`` query tokens last,
    causal among them): the kernel, every part in one call, when :func:`kernel_serves` (or
    ``kernel``), else ``merge(packed_part_reference, float_part)``."""
    if not _use_kernel(query, layer, kernel):
        return merge(packed_part_reference(query, layer, scaling, tokens), float_part(query, keys, values, scaling, new))
    return _run_kernel(query, layer, scaling, tokens, span, keys, values, new, True)[0]


def _run_kernel(query, layer, scaling, tokens, span, keys, values, new, norm):
    t, u = layer.mid_k.arrays(), layer.mid_v.arrays()  # the buffers as stored: the kernel reads n tokens
    kq, vq = layer.mid_k.q, layer.mid_v.q
    n = layer.mid_k.tokens if tokens is None else tokens
    b, hq, tq, d = query.shape
    hkv = t["codes"].shape[-3]
    q = _rows(query.detach().to(torch.float32), hkv).contiguous().numpy()
    nr = q.shape[2]
    if keys is None:
        fk = fv = np.empty((b, hkv, 0, d), np.float32)
    else:
        fk = keys.detach().to(torch.float32).contiguous().numpy()
        fv = values.detach().to(torch.float32).contiguous().numpy()
    num = np.empty((b, hkv, nr, d), np.float32)
    mx = np.empty((b, hkv, nr), np.float32)
    sm = np.empty((b, hkv, nr), np.float32)
    g = kq.group_size
    kernels.set_threads(torch.get_num_threads())
    _attend(q, t["codes"].numpy(), _bits16(t["scale"]), _bits16(t["zero"]), u["codes"].numpy(), _bits16(u["scale"]),
            _bits16(u["zero"]), kernels.F16_VALUES, n, kq.bits, g, vq.group_size, np.float32(scaling),
            max(g, span // g * g), fk, fv, tq, new, norm, num, mx, sm)
    return (_unrows(torch.from_numpy(num), hq, tq), _unrows(torch.from_numpy(mx), hq, tq),
            _unrows(torch.from_numpy(sm), hq, tq))


def _bits16(x: torch.Tensor) -> np.ndarray:
    """A float16 tensor's bit patterns (uint16, no copy of a contiguous tensor)."""
    return x.contiguous().numpy().view(np.uint16)


def packed_part_reference(query: torch.Tensor, layer, scaling: float, tokens: int | None = None):
    """The definition: decode the packed middle, then softmax attention over it (float32)."""
    k = layer.mid_k.q.dequantize(layer.mid_k.packed(tokens))
    v = layer.mid_v.q.dequantize(layer.mid_v.packed(tokens))
    return float_part(query, k, v, scaling, new=0)


def float_part(query, keys, values, scaling: float, new: int):
    """Softmax attention parts over float keys whose last ``new`` are the query tokens themselves
    (causal among them; every earlier key is visible to every query)."""
    b, hq, tq, d = query.shape
    hkv = keys.shape[1]
    q = _rows(query.to(torch.float32), hkv)
    s = torch.matmul(q, keys.transpose(-1, -2).to(torch.float32)) * scaling
    if new:
        n = keys.shape[-2]
        qi = torch.arange(tq).repeat(hq // hkv)  # row r of a KV group is query r % tq
        kj = torch.arange(n)
        hide = kj[None, :] > (n - new + qi)[:, None]
        s = s.masked_fill(hide, float("-inf"))
    m = s.amax(dim=-1)
    p = torch.exp(s - m[..., None])
    num = torch.matmul(p, values.to(torch.float32))
    return _unrows(num, hq, tq), _unrows(m, hq, tq), _unrows(p.sum(-1), hq, tq)


def merge(*parts) -> torch.Tensor:
    """Exact softmax over the union of key sets from each part's (numerator, max, sum)."""
    m = parts[0][1]
    for _, mi, _ in parts[1:]:
        m = torch.maximum(m, mi)
    num = sum(n * torch.exp(mi - m)[..., None] for n, mi, _ in parts)
    den = sum(si * torch.exp(mi - m) for _, mi, si in parts)
    return num / den[..., None]
