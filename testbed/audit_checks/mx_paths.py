"""Audit of MX Q/K-path and P-path rows (numpy and the standard library only).

For every row the audit:

1. rebuilds the quantizer's input itself: Q and K of the Case (times its own rotation matrix
   ``diag(signs) · blockdiag(H_n) / sqrt(n)``, Sylvester-built here from the stored signs, for the
   rotated arm), or its own float64 softmax probabilities rounded to float32 for the P path;
2. encodes that input with its own MX encoder (E8M0 scale by the row's rule: FLOOR from
   ``np.frexp`` of the block amax, RCEIL from ``np.frexp`` of the float32 quotient amax / max;
   elements by nearest-value search in its own lookup table, ties to the even code) and requires
   the stored scale and element codes to be identical, byte for byte; counts the blocks whose
   largest scaled element exceeds the element maximum (clamped);
3. decodes the stored codes with its own E4M3/E5M2/E2M1 and E8M0 tables (``common.py``) and
   recomputes every per-row TV, argmax agreement (strict, and ties that include the reference's
   argmax), numerical-zero rate and row sum, their summaries, the share of clamped blocks, the
   output relative L2 and the payload bytes.
"""

from __future__ import annotations

import numpy as np

from .common import MX_ELEMENTS, decode_mx_raw, encode_mx, expand_heads, rel_l2, softmax_attention, unpack_bits

TV_HIGH = 0.05
ROTATION_BLOCK_MAX = 128


def sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    if h.shape[0] != n:
        raise ValueError(f"no Sylvester matrix of size {n}")
    return h


def rotation_matrix(signs: np.ndarray) -> np.ndarray:
    """``R = diag(signs) · blockdiag(H_n) / sqrt(n)``, ``n = D`` (power of two <= 128) or 128."""
    d = signs.shape[0]
    if signs.ndim != 1 or not np.all(np.abs(signs.astype(np.int64)) == 1):
        raise ValueError("rotation signs must be a vector of +1/-1")
    if d & (d - 1) == 0 and d <= ROTATION_BLOCK_MAX:
        n = d
    elif d % ROTATION_BLOCK_MAX == 0:
        n = ROTATION_BLOCK_MAX
    else:
        raise ValueError(f"head dimension {d} cannot be rotated")
    h = sylvester(n) / np.sqrt(n)
    r = np.zeros((d, d))
    for i in range(0, d, n):
        r[i:i + n, i:i + n] = h
    return signs.astype(np.float64)[:, None] * r


def _first_diff(a: np.ndarray, b: np.ndarray) -> tuple:
    return tuple(int(i) for i in np.argwhere(a != b)[0])


def _clamped(x_in: np.ndarray, scales: np.ndarray, element: str, block: int) -> tuple[int, int]:
    """(clamped blocks, blocks): blocks whose largest |x| / 2**(scale - 127) exceeds the element maximum."""
    _, table = MX_ELEMENTS[element]
    vmax = float(np.nanmax(np.abs(table[np.isfinite(table)])))
    x = np.asarray(x_in, dtype=np.float64)
    pad = (-x.shape[-1]) % block
    if pad:
        x = np.concatenate([x, np.zeros((*x.shape[:-1], pad))], axis=-1)
    amax = np.abs(x.reshape(*x.shape[:-1], -1, block)).max(axis=-1)
    scaled = np.ldexp(amax, 127 - scales.astype(np.int64))
    return int((scaled > vmax).sum()), int(scaled.size)


def _check_payload(row, audit, label: str, arrays: dict, x_in: np.ndarray, cfg: dict, clamped: list) -> np.ndarray:
    """Stored codes == the audit's own encoding of ``x_in``; returns the decoded values (float64) and
    appends (clamped blocks, blocks) of the audit's own scales to ``clamped``."""
    element, block = cfg["element"], cfg["block_size"]
    bits, _ = MX_ELEMENTS[element]
    rule = cfg.get("scale_rule", "floor")
    codes, scales = encode_mx(x_in, element, block, rule)
    stored_scales = arrays["scales"]
    if stored_scales.shape != scales.shape or not np.array_equal(stored_scales, scales):
        where = _first_diff(stored_scales, scales) if stored_scales.shape == scales.shape else stored_scales.shape
        audit.fail(row, f"{label}: stored E8M0 scale codes differ from the audit's {rule.upper()}-rule encoding at {where}")
    stored_codes = unpack_bits(arrays["codes"], bits, codes.shape[-1])
    if stored_codes.shape != codes.shape or not np.array_equal(stored_codes, codes):
        where = _first_diff(stored_codes, codes) if stored_codes.shape == codes.shape else stored_codes.shape
        audit.fail(row, f"{label}: stored {element} element codes differ from the audit's encoding at {where}")
    audit.numbers += 2
    clamped.append(_clamped(x_in, scales, element, block))
    return decode_mx_raw(arrays, cfg, x_in.shape)


def _summaries(row, audit, tv, agree, zero, row_sum) -> None:
    audit.close(row, "per_row.tv", row["per_row"]["tv"], tv.ravel())
    audit.equal(row, "rows", row["rows"], int(tv.size))
    audit.close(row, "tv_median", row["tv_median"], float(np.median(tv)))
    audit.close(row, "tv_mean", row["tv_mean"], float(np.mean(tv)))
    audit.close(row, "tv_p95", row["tv_p95"], float(np.percentile(tv, 95)))
    audit.close(row, "tv_max", row["tv_max"], float(np.max(tv)))
    audit.close(row, "tv_over_5pct", row["tv_over_5pct"], float(np.mean(tv > TV_HIGH)))
    strict, tie = agree
    audit.close(row, "argmax_agreement", row["argmax_agreement"], float(np.mean(strict)))
    audit.close(row, "argmax_tie", row["argmax_tie"], float(np.mean(tie)))
    if zero is None:
        for key in ("numerical_zero_rate_median", "numerical_zero_rate_mean", "rows_with_zero", "row_sum_median",
                    "row_sum_min", "row_sum_max"):
            audit.close(row, key, row[key], None)
        audit.close(row, "per_row.numerical_zero_rate", row["per_row"]["numerical_zero_rate"], None)
        audit.close(row, "per_row.row_sum", row["per_row"]["row_sum"], None)
        return
    audit.close(row, "per_row.numerical_zero_rate", row["per_row"]["numerical_zero_rate"], zero.ravel())
    audit.close(row, "per_row.row_sum", row["per_row"]["row_sum"], row_sum.ravel())
    audit.close(row, "numerical_zero_rate_median", row["numerical_zero_rate_median"], float(np.median(zero)))
    audit.close(row, "numerical_zero_rate_mean", row["numerical_zero_rate_mean"], float(np.mean(zero)))
    audit.close(row, "rows_with_zero", row["rows_with_zero"], float(np.mean(zero > 0)))
    audit.close(row, "row_sum_median", row["row_sum_median"], float(np.median(row_sum)))
    audit.close(row, "row_sum_min", row["row_sum_min"], float(np.min(row_sum)))
    audit.close(row, "row_sum_max", row["row_sum_max"], float(np.max(row_sum)))


def scheme_name(cfg: dict) -> str:
    """The scheme label of an MX config, as the quantizer names itself: family, element, block size,
    and ``_rceil`` / ``_hadamard`` where the scale rule / rotation says so (e.g. ``mxfp8_e4m3_b32``)."""
    family = "mxfp4" if MX_ELEMENTS[cfg["element"]][0] == 4 else "mxfp8"
    return (f"{family}_{cfg['element']}_b{cfg['block_size']}" + ("_rceil" if cfg.get("scale_rule") == "rceil" else "")
            + ("_hadamard" if cfg.get("rotation") else ""))


def check(row: dict, audit) -> None:
    case = audit.case(row)
    q, k, v = case["q"], case["k"], case["v"]
    qp, causal = case["query_positions"], case["causal"]
    p_ref, o_ref = audit.cached(("ref", row["study"], row["case"]), lambda: softmax_attention(q, k, v, qp, causal))
    cfg = row["quant"]
    audit.equal(row, "element", row["element"], cfg["element"])
    audit.equal(row, "block_size", row["block_size"], cfg["block_size"])
    audit.equal(row, "scale_rule", row["scale_rule"], cfg.get("scale_rule"))
    audit.equal(row, "scheme", row["scheme"], scheme_name(cfg))
    clamped: list = []
    loaded = {part: ({name: audit.load(path) for name, path in paths.items()} if isinstance(paths, dict) else None)
              for part, paths in row["arrays"].items()}
    payload = sum(a.nbytes for part in loaded.values() if part for a in part.values())
    audit.equal(row, "payload_bytes", row["payload_bytes"], int(payload))
    if row["path"] == "qk":
        rotation = row["rotation"]
        audit.equal(row, "rotation", rotation, "none" if cfg["rotation"] is None else cfg["rotation"])
        if rotation == "signed_hadamard":
            signs = audit.load(row["arrays"]["signs"])
            r = rotation_matrix(signs)
            q_in = (q.astype(np.float64) @ r).astype(np.float32)
            k_in = (k.astype(np.float64) @ r).astype(np.float32)
        elif rotation == "none":
            if "signs" in row["arrays"]:
                audit.fail(row, "an unrotated arm stores rotation signs")
            q_in, k_in = q, k
        else:
            audit.fail(row, f"unknown rotation {rotation!r}")
            return
        q_hat = _check_payload(row, audit, "q", loaded["q"], q_in, cfg, clamped)
        k_hat = _check_payload(row, audit, "k", loaded["k"], k_in, cfg, clamped)
        p_hat, o_hat = softmax_attention(q_hat, k_hat, v, qp, causal)
        zero = row_sum = None
        audit.equal(row, "float32_bytes", row["float32_bytes"], 4 * (q.size + k.size))
    elif row["path"] == "p":
        audit.equal(row, "rotation", row["rotation"], "none")
        if cfg["rotation"] is not None:
            audit.fail(row, "the P path is never rotated")
        p_hat = _check_payload(row, audit, "p", loaded["p"], p_ref.astype(np.float32), cfg, clamped)
        o_hat = p_hat @ expand_heads(v, q.shape[0]).astype(np.float64)
        pos = p_ref > 0
        zero = (pos & (p_hat == 0)).sum(-1) / np.maximum(pos.sum(-1), 1)
        row_sum = p_hat.sum(-1)
        audit.equal(row, "float32_bytes", row["float32_bytes"], 4 * p_ref.size)
    else:
        audit.fail(row, f"unknown path {row['path']!r}")
        return
    tv = 0.5 * np.abs(p_hat - p_ref).sum(-1)
    ref = np.argmax(p_ref, axis=-1)
    strict = np.argmax(p_hat, axis=-1) == ref
    at_ref = np.take_along_axis(p_hat, ref[..., None], axis=-1)[..., 0]
    tie = ~strict & (at_ref == p_hat.max(axis=-1))
    _summaries(row, audit, tv, (strict, tie), zero, row_sum)
    audit.close(row, "block_saturation", row["block_saturation"],
                sum(c for c, _ in clamped) / sum(n for _, n in clamped))
    audit.close(row, "rel_l2", row["rel_l2"], rel_l2(o_hat, o_ref))
