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
3. decodes the stored codes with its own E4M3/E5M2/E2M1 and E8M0 tables (``schemes.py``) and
   recomputes every per-row TV, argmax agreement (strict, and ties that include the reference's
   argmax), numerical-zero rate and row sum, their summaries, the share of clamped blocks, the
   output relative L2 and the payload bytes.

All of it over tiles of queries (`MAX_SCORES` float64 scores), each KV head shared by its query
heads without being expanded, so the audit never holds ``[H, Tq, Tk]``. A P-path row whose payload
was not stored (``store_p`` false, at the seed's scale) is re-derived from the audit's own encoding
of its own probabilities instead of the stored codes: every number of the row is still checked;
what cannot be checked is a byte-for-byte match with codes that were never written.
"""

from __future__ import annotations

import math

import numpy as np

from .common import E8M0_BIAS, HEADER_BYTES, visible
from .report_format import P, T, fixed, ordered, pct, text
from .schemes import MX_ELEMENTS, decode_mx_raw, encode_mx, pack_bits, unpack_bits
from .stats import mean

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


def _first_diff(a: np.ndarray, b: np.ndarray, row0: int = 0) -> tuple:
    """The first index at which ``a`` and ``b`` differ, its second-last (row) index moved by ``row0``."""
    at = [int(i) for i in np.argwhere(a != b)[0]]
    at[-2] += row0
    return tuple(at)


def _clamped(x_in: np.ndarray, scales: np.ndarray, element: str, block: int) -> tuple[int, int]:
    """(clamped blocks, blocks): blocks whose largest |x| / 2**(scale - 127) exceeds the element maximum."""
    _, table = MX_ELEMENTS[element]
    vmax = float(np.nanmax(np.abs(table[np.isfinite(table)])))
    x = np.asarray(x_in, dtype=np.float64)
    pad = (-x.shape[-1]) % block
    if pad:
        x = np.concatenate([x, np.zeros((*x.shape[:-1], pad))], axis=-1)
    amax = np.abs(x.reshape(*x.shape[:-1], -1, block)).max(axis=-1)
    scaled = np.ldexp(amax, E8M0_BIAS - scales.astype(np.int64))
    return int((scaled > vmax).sum()), int(scaled.size)


def _check_payload(row, audit, label: str, arrays: dict, x_in: np.ndarray, cfg: dict, clamped: list,
                   row0: int = 0) -> np.ndarray:
    """Stored codes == the audit's own encoding of ``x_in``; returns the decoded values (float64) and
    appends (clamped blocks, blocks) of the audit's own scales to ``clamped``. ``row0``: the first
    row (query) of ``arrays`` in the whole payload, for the index a failure names."""
    element, block = cfg["element"], cfg["block_size"]
    bits, _ = MX_ELEMENTS[element]
    rule = cfg.get("scale_rule", "floor")
    codes, scales = encode_mx(x_in, element, block, rule)
    stored_scales = arrays["scales"]
    if stored_scales.shape != scales.shape or not np.array_equal(stored_scales, scales):
        where = _first_diff(stored_scales, scales, row0) if stored_scales.shape == scales.shape else stored_scales.shape
        audit.fail(row, f"{label}: stored E8M0 scale codes differ from the audit's {rule.upper()}-rule encoding at {where}")
    stored_codes = unpack_bits(arrays["codes"], bits, codes.shape[-1])
    if stored_codes.shape != codes.shape or not np.array_equal(stored_codes, codes):
        where = _first_diff(stored_codes, codes, row0) if stored_codes.shape == codes.shape else stored_codes.shape
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


MAX_SCORES = 1 << 21  # float64 scores per tile of queries of the audit's own pass (about 16 MiB a tile)


def _tiles(heads: int, queries: int, keys: int) -> list[slice]:
    step = max(1, MAX_SCORES // max(1, heads * keys))
    return [slice(a, min(queries, a + step)) for a in range(0, queries, step)]


def _attention_tile(q: np.ndarray, k64: np.ndarray, v64: np.ndarray, qp: np.ndarray, causal: bool):
    """Probabilities ``[H, c, Tk]`` and output ``[H, c, D]`` in float64 of a tile of queries ``q [H, c, D]``
    against ``k64, v64 [H_kv, Tk, D]`` (float64): one two-dimensional product per KV head and its group
    of query heads, K and V never expanded to H heads."""
    h, c, d = q.shape
    hkv, tk = k64.shape[0], k64.shape[1]
    g = h // hkv
    qd = q.astype(np.float64).reshape(hkv, g * c, d)
    s = np.empty((hkv, g * c, tk))
    for j in range(hkv):
        np.matmul(qd[j], k64[j].T, out=s[j])
    s /= np.sqrt(np.float64(d))
    if causal:
        s = np.where(np.tile(visible(qp, tk, causal), (g, 1))[None], s, -np.inf)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s.reshape(h, c, tk), _times_v(s.reshape(h, c, tk), v64)


def _times_v(p: np.ndarray, v64: np.ndarray) -> np.ndarray:
    """``P V`` for ``p [H, c, Tk]`` with ``v64 [H_kv, Tk, D]`` shared by each group of query heads."""
    h, c, tk = p.shape
    hkv = v64.shape[0]
    pg = p.reshape(hkv, (h // hkv) * c, tk)
    out = np.empty((hkv, pg.shape[1], v64.shape[-1]))
    for j in range(hkv):
        np.matmul(pg[j], v64[j], out=out[j])
    return out.reshape(h, c, v64.shape[-1])


def _slice_payload(arrays: dict, sl: slice, keys: int) -> dict:
    """The rows ``sl`` of a stored ``[H, Tq, Tk]`` MX payload (its blocks run along the keys, so a slice of
    queries is a payload of its own, with its own header)."""
    rows = len(range(*sl.indices(arrays["scales"].shape[-2])))
    return {"codes": arrays["codes"][..., sl, :], "scales": arrays["scales"][..., sl, :],
            "header": np.array([rows, keys], dtype=np.int64)}


def check(row: dict, audit) -> None:
    """Re-derive a row over tiles of queries (`MAX_SCORES`), never holding ``[H, Tq, Tk]``.

    A P-path row with no stored payload (the analysis's ``store_p`` false; completeness checks that
    the protocol said so) is re-derived from the audit's own encoding of its own probabilities:
    every statistic, the clamped blocks and the payload's bytes are checked, and since the encoding
    is deterministic from the Case, nothing is left unchecked but bytes that were never written."""
    case = audit.case(row)
    q, k, v = case["q"], case["k"], case["v"]
    qp, causal = case["query_positions"], case["causal"]
    h, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    k64, v64 = audit.cached(("kv64", row["study"], row["case"]), lambda: (k.astype(np.float64), v.astype(np.float64)))
    cfg = row["quant"]
    audit.equal(row, "element", row["element"], cfg["element"])
    audit.equal(row, "block_size", row["block_size"], cfg["block_size"])
    audit.equal(row, "scale_rule", row["scale_rule"], cfg.get("scale_rule"))
    audit.equal(row, "scheme", row["scheme"], scheme_name(cfg))
    clamped: list = []
    loaded = {part: ({name: audit.load(path) for name, path in paths.items()} if isinstance(paths, dict) else None)
              for part, paths in row["arrays"].items()}
    payload = sum(a.nbytes for part in loaded.values() if part for a in part.values())
    if row["path"] == "qk":
        audit.equal(row, "payload_bytes", row["payload_bytes"], int(payload))
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
        audit.equal(row, "float32_bytes", row["float32_bytes"], 4 * (q.size + k.size))
    elif row["path"] == "p":
        audit.equal(row, "rotation", row["rotation"], "none")
        if cfg["rotation"] is not None:
            audit.fail(row, "the P path is never rotated")
        stored = loaded.get("p")
        if stored is not None:
            audit.equal(row, "payload_bytes", row["payload_bytes"], int(payload))
            header = stored["header"]
            if header.dtype != np.int64 or header.tolist() != [tq, tk]:
                audit.fail(row, f"p: header {header.tolist()} does not match (N, D) = ({tq}, {tk})")
                return
        elif set(loaded) - {"p"}:
            audit.fail(row, f"P-path arrays {sorted(loaded)} are not one payload p")
            return
        own_bytes = HEADER_BYTES  # the header of the whole payload, (N, D) as two int64
        audit.equal(row, "float32_bytes", row["float32_bytes"], 4 * h * tq * tk)
    else:
        audit.fail(row, f"unknown path {row['path']!r}")
        return
    tv, row_sum, zero = (np.empty((h, tq)) for _ in range(3))
    strict, tie = np.empty((h, tq), dtype=bool), np.empty((h, tq), dtype=bool)
    err2 = ref2 = 0.0
    bits = MX_ELEMENTS[cfg["element"]][0]
    for sl in _tiles(h, tq, tk):
        p_ref, o_ref = _attention_tile(q[:, sl], k64, v64, qp[sl], causal)
        if row["path"] == "qk":
            p_hat, o_hat = _attention_tile(q_hat[:, sl], k_hat, v64, qp[sl], causal)
        else:
            x_in = p_ref.astype(np.float32)
            if stored is not None:
                p_hat = _check_payload(row, audit, "p", _slice_payload(stored, sl, tk), x_in, cfg, clamped, sl.start)
            else:
                codes, scales = encode_mx(x_in, cfg["element"], cfg["block_size"], cfg.get("scale_rule", "floor"))
                own = {"codes": pack_bits(codes, bits), "scales": scales, "header": np.array(x_in.shape[-2:], np.int64)}
                own_bytes += own["codes"].nbytes + own["scales"].nbytes
                clamped.append(_clamped(x_in, scales, cfg["element"], cfg["block_size"]))
                p_hat = decode_mx_raw(own, cfg, x_in.shape)
                del codes, scales, own
            del x_in
            o_hat = _times_v(p_hat, v64)
            pos = p_ref > 0
            zero[:, sl] = (pos & (p_hat == 0)).sum(-1) / np.maximum(pos.sum(-1), 1)
            row_sum[:, sl] = p_hat.sum(-1)
            del pos
        tv[:, sl] = 0.5 * np.abs(p_hat - p_ref).sum(-1)
        ref = np.argmax(p_ref, axis=-1)
        strict[:, sl] = np.argmax(p_hat, axis=-1) == ref
        at_ref = np.take_along_axis(p_hat, ref[..., None], axis=-1)[..., 0]
        tie[:, sl] = ~strict[:, sl] & (at_ref == p_hat.max(axis=-1))
        err2 += float(np.sum((o_hat - o_ref) ** 2))
        ref2 += float(np.sum(o_ref ** 2))
        del p_ref, p_hat, o_ref, o_hat
    if row["path"] == "p" and stored is None:
        audit.equal(row, "payload_bytes", row["payload_bytes"], int(own_bytes))
    _summaries(row, audit, tv, (strict, tie), zero if row["path"] == "p" else None,
               row_sum if row["path"] == "p" else None)
    audit.close(row, "block_saturation", row["block_saturation"],
                sum(c for c, _ in clamped) / sum(n for _, n in clamped))
    num, den = float(np.sqrt(err2)), float(np.sqrt(ref2))
    audit.close(row, "rel_l2", row["rel_l2"], (0.0 if num == 0 else float("inf")) if den == 0 else num / den)

# ---------------------------------------------------------------------------------------------
# report.md: the expected blocks of this analysis's section (audit_checks/report_md.py compares them)
# ---------------------------------------------------------------------------------------------

# The seed study's published figures that the MX section quotes (a real video DiT, one prompt and
# seed): the audit's own copy, so that a changed quotation fails.
SEED_STUDY = {"qk_tv_median": 0.0152, "qk_argmax": 0.9433, "p_tv_median": 0.0106, "p_zero_median": 0.0,
              "p_zero_mean": 0.0245, "p_rows_with_zero": 0.3663, "p_row_sum_median": 0.999392}


def report_tables(rows, params) -> list:
    def pooled(sel, key):
        parts = [r["per_row"][key] for r in sel if r["per_row"].get(key) is not None]
        return np.asarray([x for part in parts for x in part], dtype=np.float64) if parts else None

    def p(x, digits=2):
        return pct(x, digits, none="-")

    def key(r):
        return r["path"], r["rotation"], r["scale_rule"], r["scheme"]

    arms = ordered(key(r) for r in rows)
    trs = []
    for arm in arms:
        sel = [r for r in rows if key(r) == arm]
        tv = pooled(sel, "tv")
        n = sum(r["rows"] for r in sel)
        z = pooled(sel, "numerical_zero_rate")
        s = pooled(sel, "row_sum")
        trs.append([text(arm[0]), text(arm[1]), text(arm[2]), text(arm[3]), text(len(sel)), text(n),
                    p(float(np.median(tv))), p(float(np.mean(tv))), p(float(np.quantile(tv, 0.95))),
                    p(float(np.mean(tv > TV_HIGH))),
                    p(math.fsum(r["argmax_agreement"] * r["rows"] for r in sel) / n),
                    p(math.fsum(r["argmax_tie"] * r["rows"] for r in sel) / n),
                    ("-",) if z is None else p(float(np.median(z))), ("-",) if z is None else p(float(np.mean(z))),
                    ("-",) if z is None else p(float(np.mean(z > 0))),
                    ("-",) if s is None else fixed(float(np.median(s)), 6),
                    p(mean([r["block_saturation"] for r in sel])),
                    p(mean([r["rel_l2"] for r in sel]), 3)])
    dtrs = []
    for dist in ordered(r.get("distribution", "-") for r in rows):
        line = [text(dist)]
        for arm in arms:
            tv = pooled([r for r in rows if r.get("distribution", "-") == dist and key(r) == arm], "tv")
            line.append(("-",) if tv is None else p(float(np.median(tv))))
        dtrs.append(line)
    several = len({a[2] for a in arms}) > 1
    seed = SEED_STUDY
    facts = [("seed study's Q/K median TV", r"Q/K median TV (\S+),", pct(seed["qk_tv_median"])),
             ("seed study's argmax agreement", r"argmax agreement (\S+) \(", pct(seed["qk_argmax"])),
             ("seed study's P path median TV", r"P path median TV (\S+),", pct(seed["p_tv_median"])),
             ("seed study's zero-rate median", r"numerical-zero rate median (\S+) and", pct(seed["p_zero_median"])),
             ("seed study's zero-rate mean", r"numerical-zero rate median \S+ and mean (\S+),", pct(seed["p_zero_mean"])),
             ("seed study's rows with a zero", r", (\S+) rows with a zero", pct(seed["p_rows_with_zero"])),
             ("seed study's row-sum median", r"row-sum median (\S+?)\.(?:\s|$)", text(seed["p_row_sum_median"]))]
    return [P("pooled", "Pooled over every (query head, query) row of every input"),
            T("MX paths", ["path", "rotation", "scale rule", "scheme", "inputs", "rows", "median TV", "mean TV",
                           "p95 TV", "rows TV>5%", "argmax agree", "argmax tie", "zero-rate median", "zero-rate mean",
                           "rows with a zero", "row-sum median", "blocks clamped", "mean rel-L2"], 4, trs),
            P("per distribution", "Median TV per distribution."),
            T("median TV per distribution", ["distribution"] + [f"{a} {b}" + (f" {c}" if several else "")
                                                                for a, b, c, _ in arms], 1, dtrs),
            P("seed study", "Seed study for comparison", facts)]
