"""numpy-only building blocks of the audit: decoders, float64 attention, metrics.

Written independently of ``testbed.quant`` and ``testbed.attention`` on purpose: the audit is a
second implementation that must agree with the first.
"""

from __future__ import annotations

import numpy as np

# The audit's tolerances, one per kind of number (docs/audit.md). They are the audit's: nothing a
# run wrote (its protocol copies included) can loosen them; a protocol may only tighten "derived".
TOLERANCES = {
    # counts, bytes, shapes, codes, indices, token ids: exact
    "integer": {"rtol": 0.0, "atol": 0.0},
    # a number the run and the audit both compute in float64 from the same stored arrays
    "derived": {"rtol": 1e-6, "atol": 1e-9},
    # rates of strict float32 zeros: an entry at the float32 underflow edge may land either side in
    # two softmax implementations, so the rate is compared with this absolute tolerance
    "float32_zero_rate": {"rtol": 0.0, "atol": 1e-3},
    # KL of two float32 softmaxes summed in float64 may dip this far below zero
    "kl_floor": {"rtol": 0.0, "atol": 1e-6},
    # the coverage threshold of effective support (a sum of float64 masses against coverage x total)
    "coverage": {"rtol": 0.0, "atol": 1e-9},
}

__all__ = ["TOLERANCES", "unpack_bits", "decode_int_grouped", "decode_residual_window", "softmax_attention", "rel_l2", "cosine",
           "max_abs", "visible", "expand_heads", "MX_ELEMENTS", "decode_e8m0", "decode_mx_raw", "decode_mx"]


def unpack_bits(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """uint8 bytes -> codes along the last axis, lowest bits first, trimmed to ``n``."""
    if packed.dtype != np.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    if bits == 8:
        out = packed
    else:
        per = 8 // bits
        shifts = np.arange(per, dtype=np.uint8) * bits
        out = (packed[..., :, None] >> shifts) & np.uint8((1 << bits) - 1)
        out = out.reshape(*packed.shape[:-1], packed.shape[-1] * per)
    if out.shape[-1] < n:
        raise ValueError(f"packed codes hold {out.shape[-1]} codes per row, need {n}")
    return out[..., :n]


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
    """E8M0 scale codes -> ``2**(code - 127)`` (float64); 255 is NaN."""
    if codes.dtype != np.uint8:
        raise ValueError(f"E8M0 scale codes must be uint8, got {codes.dtype}")
    out = np.ldexp(1.0, codes.astype(np.int64) - 127)
    return np.where(codes == 255, np.nan, out)


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


def decode_mx(arrays: dict, cfg: dict, shape: tuple) -> np.ndarray:
    if cfg.get("rotation"):
        raise ValueError("a rotated MX payload needs its rotation signs to be decoded (see audit_checks/mx_paths.py)")
    return decode_mx_raw(arrays, cfg, shape)


DECODERS = {"int_grouped": decode_int_grouped, "mx": decode_mx}


def decode_tensor(arrays: dict, cfg: dict, shape: tuple) -> np.ndarray:
    kind = cfg.get("kind")
    if kind not in DECODERS:
        raise ValueError(f"no audit decoder for quantizer kind {kind!r}")
    return DECODERS[kind](arrays, cfg, shape)


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


def expand_heads(x: np.ndarray, heads: int) -> np.ndarray:
    return np.repeat(x, heads // x.shape[0], axis=0)


def visible(query_positions: np.ndarray, keys: int, causal: bool) -> np.ndarray:
    """[Tq, Tk] visibility (all True when not causal)."""
    if not causal:
        return np.ones((len(query_positions), keys), dtype=bool)
    return np.arange(keys)[None, :] <= query_positions[:, None]


def softmax_attention(q, k, v, query_positions, causal, dtype=np.float64):
    """Probabilities [H, Tq, Tk] and output [H, Tq, D] computed in ``dtype``."""
    h = q.shape[0]
    qd = q.astype(dtype)
    kd = expand_heads(k, h).astype(dtype)
    vd = expand_heads(v, h).astype(dtype)
    s = qd @ kd.transpose(0, 2, 1) / np.sqrt(dtype(q.shape[-1]))
    vis = visible(query_positions, k.shape[1], causal)
    s = np.where(vis[None], s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    p = e / e.sum(axis=-1, keepdims=True)
    return p, p @ vd


def rel_l2(x, ref) -> float:
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    den = np.linalg.norm(ref.ravel())
    num = np.linalg.norm((x - ref).ravel())
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / den)


def cosine(x, ref) -> float:
    x = np.asarray(x, np.float64).ravel()
    ref = np.asarray(ref, np.float64).ravel()
    den = np.linalg.norm(x) * np.linalg.norm(ref)
    if den == 0:
        return 1.0 if np.array_equal(x, ref) else 0.0
    return float(x @ ref / den)


def max_abs(x, ref) -> float:
    return float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(ref, np.float64))))
