"""Attention that reads a policy cache's packed history as codes, without decoding it first.

With K quantized per channel (KIVI), a key of group g is ``k_t,d = c_t,d * s_g,d + z_g,d``, so

    q · k_t = Σ_d (q_d s_g,d) c_t,d + Σ_d q_d z_g,d

— the scale folds into the query once per group and the zero-point into one constant; with V per
token over feature groups f, ``Σ_t p_t v_t,d = Σ_t (p_t s_t,f) c_t,d + Σ_t p_t z_t,f``, so the
scale folds into the probability. The packed part's scores and weighted values are computed from
the codes (:func:`packed_part`, a numba kernel on the CPU; the decode-then-attend definition
:func:`packed_part_reference` elsewhere and in the tests), the float32 part (sink, window, new
tokens) with torch, and the two are merged exactly through their running maxima and sums
(:func:`merge`). The history's float32 form never exists in memory: one token's codes are unpacked
into a 64-float scratch row at a time.

The definition is decode-then-attend (``PolicyLayer`` without ``direct``); this path must equal it
within float32 rounding (tests/test_policies.py: relative 1e-4 on random packed layers; in SmolLM2
the log-probs agree within 1e-4, tests/test_live.py).
"""

from __future__ import annotations

import numpy as np
import torch

try:
    from numba import njit, prange
except ImportError:  # pragma: no cover
    njit = None

__all__ = ["packed_part", "packed_part_reference", "merge", "float_part", "supported"]


def supported(policy) -> bool:
    """Integer middles with K per channel and V per token (the layouts whose scales fold)."""
    return policy.quantized and policy.middle.startswith("int") and policy.key_axis == "channel"


if njit is not None:
    @njit(parallel=True, fastmath={"nsz", "arcp", "contract", "afn", "reassoc"}, cache=True)  # no ninf/nnan: -inf is used
    def _kernel(q, kc, ks, kz, vc, vs, vz, bits, group, fgroup, scaling, num, mx, sm):  # pragma: no cover - numba
        nb, nh, nr, d = q.shape
        n = kc.shape[2]
        per = 8 // bits
        mask = (1 << bits) - 1
        nf = d // fgroup
        for bh in prange(nb * nh):
            b = bh // nh
            h = bh - b * nh
            sc = np.empty((nr, n), np.float32)
            qs = np.empty((nr, d), np.float32)
            qz = np.empty(nr, np.float32)
            row = np.empty(d, np.float32)
            for g in range(n // group):
                for r in range(nr):
                    acc = np.float32(0.0)
                    for j in range(d):
                        qs[r, j] = q[b, h, r, j] * ks[b, h, g, j]
                        acc += q[b, h, r, j] * kz[b, h, g, j]
                    qz[r] = acc
                for t in range(g * group, (g + 1) * group):
                    for j in range(d):
                        row[j] = np.float32((kc[b, h, t, j // per] >> ((j % per) * bits)) & mask)
                    for r in range(nr):
                        acc = qz[r]
                        for j in range(d):
                            acc += qs[r, j] * row[j]
                        sc[r, t] = acc * scaling
            for r in range(nr):
                m = np.float32(-np.inf)
                for t in range(n):
                    if sc[r, t] > m:
                        m = sc[r, t]
                mx[b, h, r] = m
                for j in range(d):
                    num[b, h, r, j] = 0.0
            ls = np.zeros(nr, np.float64)
            p = np.empty(nr, np.float32)
            for t in range(n):
                for r in range(nr):
                    p[r] = np.exp(sc[r, t] - mx[b, h, r])
                    ls[r] += p[r]
                for j in range(d):
                    row[j] = np.float32((vc[b, h, t, j // per] >> ((j % per) * bits)) & mask)
                for f in range(nf):
                    s = vs[b, h, t, f]
                    z = vz[b, h, t, f]
                    for r in range(nr):
                        ps = p[r] * s
                        pz = p[r] * z
                        for j in range(f * fgroup, (f + 1) * fgroup):
                            num[b, h, r, j] += ps * row[j] + pz
            for r in range(nr):
                sm[b, h, r] = ls[r]


def _rows(query: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B, Hq, tq, D] -> [B, Hkv, (Hq/Hkv) * tq, D]: the query rows of each KV head's group."""
    b, hq, tq, d = query.shape
    return query.reshape(b, hkv, (hq // hkv) * tq, d)


def _unrows(x: torch.Tensor, hq: int, tq: int) -> torch.Tensor:
    """Inverse of :func:`_rows` (trailing dims kept)."""
    return x.reshape(x.shape[0], hq, tq, *x.shape[3:])


def packed_part(query: torch.Tensor, layer, scaling: float, tokens: int | None = None):
    """(numerator [B, Hq, tq, D], max [B, Hq, tq], sum [B, Hq, tq]) of softmax attention over the
    layer's packed middle, from its codes. CPU float32 through the numba kernel, else the reference.
    Every packed key is older than every query, so no mask applies here (no padded batches)."""
    pk, pv = layer.mid_k.packed(tokens), layer.mid_v.packed(tokens)
    kq, vq = layer.mid_k.q, layer.mid_v.q
    if njit is None or query.device.type != "cpu" or query.shape[-1] % vq.group_size:
        return packed_part_reference(query, layer, scaling, tokens)
    b, hq, tq, d = query.shape
    hkv = pk.shape[-3]
    q = _rows(query.to(torch.float32), hkv).contiguous().numpy()
    nr = q.shape[2]
    num = np.empty((b, hkv, nr, d), np.float32)
    mx = np.empty((b, hkv, nr), np.float32)
    sm = np.empty((b, hkv, nr), np.float32)
    t = pk.tensors
    u = pv.tensors
    _kernel(q, t["codes"].numpy(), t["scale"].to(torch.float32).numpy(), t["zero"].to(torch.float32).numpy(),
            u["codes"].numpy(), u["scale"].to(torch.float32).numpy(), u["zero"].to(torch.float32).numpy(),
            kq.bits, kq.group_size, vq.group_size, np.float32(scaling), num, mx, sm)
    return (_unrows(torch.from_numpy(num), hq, tq), _unrows(torch.from_numpy(mx), hq, tq),
            _unrows(torch.from_numpy(sm), hq, tq))


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

