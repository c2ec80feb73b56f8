"""Audit of observation rows: recompute the attention topology of a case from its q, k and layout.

numpy only, one head at a time and, within a head, over tiles of its queries (`common.row_tiles`:
never the head's whole [Tq, Tk] scores; the per-row statistics and the small [Tq, blocks] masses
are gathered, the sets and nulls drawn from them): float64 softmax over the visible keys, entropy-equivalent
support, top-k mass by sorting, the float32 softmax's strict zeros, region and history mass,
key-block masses, top-block sets, Jaccard overlaps (and their two nulls: a seeded random pair of
same-head queries that see the same key blocks, redrawn with stdlib ``random``; the
position-shuffled expectation from the hypergeometric law), the head-level fit (each query
against its head's leave-one-out block set, with the random-set null) and the temporal heatmap.

The strict-zero rate is compared with an absolute tolerance of ``ZERO_ATOL``: an entry that sits
at float32's underflow boundary can round either way depending on summation order, which two
implementations need not share. Everything else uses the protocol's tolerances.
"""

from __future__ import annotations

import bisect
import math
import random

import numpy as np

from .common import TOLERANCES, row_tiles
from .report_format import P, T, Num, fixed, label, ordered, pct, spread, text
from .stats import median, pooled

REGIONS = ("sink", "middle", "recent", "current", "history")
PERCENTS = (1, 5, 10)
COVERAGE_EPS = TOLERANCES["coverage"]["atol"]
ZERO_ATOL = TOLERANCES["float32_zero_rate"]["atol"]
HEATMAP_INLINE_MAX = 1024


def _top_sets(m: np.ndarray, coverage: float) -> np.ndarray:
    order = np.argsort(-m, axis=-1, kind="stable")
    srt = np.take_along_axis(m, order, axis=-1)
    csum = np.cumsum(srt, axis=-1)
    target = coverage * m.sum(axis=-1, keepdims=True) - COVERAGE_EPS
    needed = np.minimum((csum < target).sum(axis=-1, keepdims=True) + 1, m.shape[-1])
    inset = np.arange(m.shape[-1])[None, :] < needed
    out = np.zeros(m.shape, dtype=bool)
    np.put_along_axis(out, order, inset, axis=-1)
    return out


def _jaccard(a, b):
    inter = (a & b).sum(axis=-1)
    union = (a | b).sum(axis=-1)
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


def _shuffled_jaccard(a: int, a0: int, b: int, n: int) -> float:
    """Expected Jaccard of a fixed a-set (a0 of its blocks among n) with a uniform b-subset of the n."""
    out = 0.0
    for k in range(min(a0, b) + 1):
        ways = math.comb(a0, k) * math.comb(n - a0, b - k)
        if ways:
            out += ways / math.comb(n, b) * (k / (a + b - k) if a + b - k else 1.0)
    return out


def _nulls(sets: np.ndarray, vblocks: list, case_id: str, hh: int) -> tuple[np.ndarray, np.ndarray]:
    tq = sets.shape[0]
    pair = np.full(max(tq - 1, 0), np.nan)
    shuf = np.full(max(tq - 1, 0), np.nan)
    rng = random.Random(f"jaccard-null:{case_id}:{hh}")
    sizes = sets.sum(axis=1)
    same = {}
    for j, vb in enumerate(vblocks):
        same.setdefault(vb, []).append(j)
    for i in range(1, tq):
        # the partners: queries seeing as many blocks, other than i and its two neighbours, in order
        group = same[vblocks[i]]
        near = {i - 1, i, i + 1}
        count = len(group) - sum(1 for j in (i - 1, i, i + 1) if 0 <= j < tq and vblocks[j] == vblocks[i])
        if count > 0:
            r = rng.randrange(count)
            start = bisect.bisect_left(group, i - 1)          # the excluded ones sit together from here
            for pos in range(start, min(start + 3, len(group))):
                if group[pos] in near and pos <= r:
                    r += 1
            j = group[r]
            pair[i - 1] = float(_jaccard(sets[i], sets[j]))
        n = vblocks[i - 1]
        shuf[i - 1] = _shuffled_jaccard(int(sizes[i]), int(sets[i, :n].sum()), int(sizes[i - 1]), n)
    return pair, shuf


def _head_fit(bm: np.ndarray, sets: np.ndarray, vblocks: list, coverage: float) -> dict:
    """One head's set from its other queries (leave-one-out mean block mass over the blocks each
    query sees, its top-block set): the query's Jaccard with it and mass on it, each with the
    null of a uniformly random set of as many visible blocks."""
    tq, nb = bm.shape
    out = {k: np.full(tq, np.nan) for k in ("jaccard", "jaccard_null", "mass", "mass_null", "size")}
    if tq < 2:
        return out
    total = bm.sum(axis=0)
    for i in range(tq):
        n = vblocks[i]
        mean = (total - bm[i]) / (tq - 1)
        mean[n:] = 0.0
        hs = _top_sets(mean[None, :], coverage)[0]
        hs[n:] = False
        size = int(hs.sum())
        out["jaccard"][i] = float(_jaccard(sets[i], hs))
        out["mass"][i] = float(bm[i][hs].sum())
        out["size"][i] = size
        out["mass_null"][i] = size / n
        a = int(sets[i].sum())
        out["jaccard_null"][i] = _shuffled_jaccard(a, a, size, n)
    return out


def _tile_rows(s, vis, nvis, regions, frame, block, rows, hh, sl, fm, bm) -> None:
    """One tile of one head's queries: scores ``s [c, Tk]`` (float64, unmasked) to the per-row
    statistics ``rows[*][hh, sl]``, the per-frame masses ``fm[sl]`` and per-block masses ``bm[sl]``
    (the same array when blocks are frames). Every quantity is per row, so a tile's rows come out as
    they would from the whole head."""
    c, keys = s.shape
    s = np.where(vis, s, -np.inf)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    del e
    logp = np.log(np.where(p > 0, p, 1.0))
    rows["support"][hh, sl] = np.exp(-(p * logp).sum(axis=1)) / nvis
    del logp
    csum = np.cumsum(-np.sort(-p, axis=1), axis=1)
    for pc in PERCENTS:
        cnt = np.maximum((pc * nvis.astype(np.int64) + 99) // 100, 1)
        rows[f"top{pc}"][hh, sl] = csum[np.arange(c), np.minimum(cnt, keys) - 1]
    del csum
    s32 = s.astype(np.float32)
    e32 = np.exp(s32 - s32.max(axis=1, keepdims=True))
    p32 = e32 / e32.sum(axis=1, keepdims=True)
    rows["zero_rate"][hh, sl] = ((p32 == 0) & vis).sum(axis=1) / nvis
    del s32, e32, p32
    for name, (a, b) in regions.items():
        rows[f"{name}_mass"][hh, sl] = p[:, a:b].sum(axis=1)
    nkb = fm.shape[1]
    pp = np.concatenate([p, np.zeros((c, nkb * frame - keys))], axis=1) if nkb * frame != keys else p
    fm[sl] = pp.reshape(c, nkb, frame).sum(axis=2)                          # per frame: the heatmap
    if bm is not fm:
        nbb = bm.shape[1]
        pb = np.concatenate([p, np.zeros((c, nbb * block - keys))], axis=1) if nbb * block != keys else p
        bm[sl] = pb.reshape(c, nbb, block).sum(axis=2)                      # per key block: the sets


def derive(case, frame: int, coverage: float, case_id: str = "", block: int | None = None) -> dict:
    block = frame if block is None else block
    q, k = case["q"], case["k"]
    h, tq, d = q.shape
    keys = k.shape[1]
    group = h // k.shape[0]
    qp = case["query_positions"].astype(np.int64)
    causal = bool(case["causal"])
    # visible keys per query (key t is visible to a causal query at position p iff t <= p)
    nvis = (np.clip(qp + 1, 0, keys) if causal else np.full(tq, keys)).astype(np.float64)
    regions = {r["name"]: (int(r["start"]), int(r["stop"])) for r in case["layout"]}
    if "current" in regions:
        regions["history"] = (0, regions["current"][0])
    nkb = -(-keys // frame)
    qb = qp // frame
    blocks = sorted(set(qb.tolist()))
    qbi = np.array([blocks.index(b) for b in qb.tolist()])
    rows = {name: np.zeros((h, tq)) for name in ("visible_keys", "support", "top1", "top5", "top10", "zero_rate")}
    rows.update({f"{name}_mass": np.zeros((h, tq)) for name in regions})
    heat = np.zeros((h, len(blocks), nkb))
    jq = np.zeros((h, max(tq - 1, 0)))
    null_pair = np.zeros((h, max(tq - 1, 0)))
    null_shuf = np.zeros((h, max(tq - 1, 0)))
    vblocks = [-(-int(n) // block) for n in nvis]
    size = np.zeros((h, tq))
    nbb = -(-keys // block)
    fit = {k: np.zeros((h, tq)) for k in ("jaccard", "jaccard_null", "mass", "mass_null", "size")}
    scale = np.sqrt(np.float64(d))
    tiles = row_tiles(tq, keys)
    for hh in range(h):
        kk = k[hh // group].astype(np.float64)
        fm = np.zeros((tq, nkb))
        bm = fm if block == frame else np.zeros((tq, nbb))
        rows["visible_keys"][hh] = nvis
        for sl in tiles:                     # a tile of the head's queries: never [Tq, Tk]
            vis = (np.arange(keys)[None, :] <= qp[sl, None]) if causal else np.ones((sl.stop - sl.start, keys), bool)
            _tile_rows(q[hh, sl].astype(np.float64) @ kk.T / scale, vis, nvis[sl], regions, frame, block,
                       rows, hh, sl, fm, bm)
        sets = _top_sets(bm, coverage)
        for key, val in _head_fit(bm, sets, vblocks, coverage).items():
            fit[key][hh] = val
        size[hh] = sets.sum(axis=1)
        if tq > 1:
            jq[hh] = _jaccard(sets[1:], sets[:-1])
        null_pair[hh], null_shuf[hh] = _nulls(sets, vblocks, case_id, hh)
        for i in range(len(blocks)):
            heat[hh, i] = fm[qbi == i].mean(axis=0)
    bsets = _top_sets(heat, coverage)
    jb = _jaccard(bsets[:, 1:], bsets[:, :-1]) if len(blocks) > 1 else np.zeros((h, 0))
    hist_uniform = None
    if "history" in regions:
        hv = (np.minimum(qp + 1, regions["history"][1]).astype(np.float64) if case["causal"]
              else np.full(tq, float(regions["history"][1])))
        hist_uniform = np.broadcast_to(hv / nvis, (h, tq))
    return {"rows": rows, "heat": heat, "jq": jq, "jb": jb, "size": size, "blocks": blocks, "qbi": qbi,
            "null_pair": null_pair, "null_shuffled": null_shuf, "fit": fit,
            "hist_uniform": hist_uniform, "nkb": nkb}


def _finite_mean(x):
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else None


def _q(x, qs):
    return float(np.quantile(x, qs))


def _expected_stats(rows, sel, hist_uniform) -> dict:
    sup = rows["support"][sel].ravel()
    out = {"support_mean": float(sup.mean()), "support_median": _q(sup, 0.5), "support_q10": _q(sup, 0.1),
           "support_q25": _q(sup, 0.25), "support_q75": _q(sup, 0.75), "support_q90": _q(sup, 0.9),
           "support_le_10": float((sup <= 0.10).mean()), "support_le_25": float((sup <= 0.25).mean()),
           "support_ge_75": float((sup >= 0.75).mean())}
    for pc in PERCENTS:
        t = rows[f"top{pc}"][sel].ravel()
        out[f"top{pc}_mean"] = float(t.mean())
        out[f"top{pc}_median"] = _q(t, 0.5)
    out["top10_ge_80"] = float((rows["top10"][sel] >= 0.80).mean())
    for r in REGIONS:
        key = f"{r}_mass"
        out[key] = float(rows[key][sel].mean()) if key in rows else None
    if "history_mass" in rows:
        hm = rows["history_mass"][sel].ravel()
        out.update(history_median=_q(hm, 0.5), history_q10=_q(hm, 0.1), history_q25=_q(hm, 0.25),
                   history_q75=_q(hm, 0.75), history_q90=_q(hm, 0.9), history_lt_10=float((hm < 0.10).mean()),
                   history_gt_50=float((hm > 0.50).mean()), uniform_history=float(hist_uniform[sel].mean()))
    else:
        out.update(history_lt_10=None, history_gt_50=None, uniform_history=None)
    vk = rows["visible_keys"][sel]
    out["visible_keys"] = float(vk.mean())
    return out


def _zero_close(ctx, row, name, reported, derived, atol=ZERO_ATOL) -> None:
    a = np.asarray(reported, dtype=np.float64)
    b = np.asarray(derived, dtype=np.float64)
    ctx.numbers += 1
    if a.shape != b.shape or not bool(np.all(np.abs(a - b) <= atol)):
        ctx.fail(row, f"{name}: strict zeros differ from the audit's float32 softmax by more than {atol:.3g}")


def check(row: dict, ctx) -> None:
    case = ctx.case(row)
    tpf = case.get("tokens_per_frame")
    frame = int(tpf) if tpf else int(row["block_tokens"])
    ctx.equal(row, "frame", row["frame"], frame)
    tiles = row.get("spatial_tiles", 1)
    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1 or (tpf and frame % tiles):
        raise ValueError(f"spatial_tiles {tiles!r} must be a positive integer dividing the {frame} tokens per frame")
    block = frame // tiles if tpf else frame
    ctx.equal(row, "block", row.get("block"), block)
    coverage = float(row["coverage"])
    der = ctx.cached(("observation", row["study"], row["case"], frame, block, coverage),
                     lambda: derive(case, frame, coverage, row["case"], block))
    rows = der["rows"]
    h, tq = rows["support"].shape
    ctx.equal(row, "heads", row["heads"], h)  # the case's query heads (a head row carries them too)
    ctx.equal(row, "queries", row["queries"], tq)
    ctx.equal(row, "key_blocks", row["key_blocks"], der["nkb"])
    ctx.equal(row, "query_blocks", row["query_blocks"], der["blocks"])
    ctx.equal(row, "keys", row["keys"], case["k"].shape[1])
    sink = [r for r in case["layout"] if r["name"] == "sink"]
    ctx.equal(row, "sink_tokens", row["sink_tokens"], (sink[0]["stop"] - sink[0]["start"]) if sink else 0)
    if row["scope"] == "case":
        sel = (slice(None), slice(None))
        ctx.equal(row, "rows", row["rows"], h * tq)
        ctx.close(row, "jaccard_query", row["jaccard_query"], float(der["jq"].mean()) if der["jq"].size else None)
        ctx.close(row, "jaccard_block", row["jaccard_block"], float(der["jb"].mean()) if der["jb"].size else None)
        ctx.close(row, "block_set_size", row["block_set_size"], float(der["size"].mean()))
        for key in ("null_pair", "null_shuffled"):
            ctx.close(row, f"jaccard_query_{key}", row.get(f"jaccard_query_{key}"), _finite_mean(der[key]))
        for key, val in der["fit"].items():
            ctx.close(row, f"head_set_{key}", row.get(f"head_set_{key}"), _finite_mean(val))
        mean_heat = der["heat"].mean(axis=0)
        ctx.close(row, "heatmap", row["heatmap"], mean_heat if mean_heat.size <= HEATMAP_INLINE_MAX else None)
        ctx.close(row, "heatmap row sums", der["heat"].sum(axis=-1), np.ones(der["heat"].shape[:-1]))
        by = row["by_query_block"]
        ctx.equal(row, "by_query_block.block", by["block"], der["blocks"])
        for i in range(len(der["blocks"])):
            m = der["qbi"] == i
            ctx.equal(row, f"by_query_block.rows[{i}]", by["rows"][i], int(h * m.sum()))
            ctx.close(row, f"by_query_block.support_median[{i}]", by["support_median"][i], _q(rows["support"][:, m].ravel(), 0.5))
            for key in ("history_mass", "current_mass"):
                ctx.close(row, f"by_query_block.{key}[{i}]", by[key][i], float(rows[key][:, m].mean()) if key in rows else None)
    else:
        hh = int(row["head"])
        sel = (hh, slice(None))
        ctx.equal(row, "rows", row["rows"], tq)
        ctx.equal(row, "kv_head", row["kv_head"], case["head_map"][hh])
        conc = case["meta"].get("head_concentration")
        ctx.equal(row, "concentration", row["concentration"], conc[hh] if conc and hh < len(conc) else None)
        ctx.close(row, "jaccard_query", row["jaccard_query"], float(der["jq"][hh].mean()) if der["jq"].shape[1] else None)
        ctx.close(row, "jaccard_block", row["jaccard_block"], float(der["jb"][hh].mean()) if der["jb"].shape[1] else None)
        ctx.close(row, "block_set_size", row["block_set_size"], float(der["size"][hh].mean()))
        for key in ("null_pair", "null_shuffled"):
            ctx.close(row, f"jaccard_query_{key}", row.get(f"jaccard_query_{key}"), _finite_mean(der[key][hh]))
        for key, val in der["fit"].items():
            ctx.close(row, f"head_set_{key}", row.get(f"head_set_{key}"), _finite_mean(val[hh]))
    # the case's stored heatmap and per-row statistics: named by its case row and by each head row
    ctx.close(row, "arrays.heatmap", ctx.load(row["arrays"]["heatmap"]), der["heat"])
    ctx.equal(row, "row_fields", row["row_fields"], [f for f in ("visible_keys", "support", "top1", "top5", "top10",
                                                                 "zero_rate", *[f"{r}_mass" for r in REGIONS]) if f in rows])
    if "rows" in row["arrays"]:
        stored = ctx.load(row["arrays"]["rows"])
        for i, f in enumerate(row["row_fields"]):
            if f == "zero_rate":
                _zero_close(ctx, row, f"arrays.rows[{f}]", stored[i], rows[f])
            else:
                ctx.close(row, f"arrays.rows[{f}]", stored[i].astype(np.float64), rows[f])
    for key, val in _expected_stats(rows, sel, der["hist_uniform"]).items():
        ctx.close(row, key, row.get(key), val)
    z = rows["zero_rate"][sel].ravel()
    _zero_close(ctx, row, "zero_rate_mean", row["zero_rate_mean"], float(z.mean()))
    _zero_close(ctx, row, "zero_rate_median", row["zero_rate_median"], _q(z, 0.5))
    # one row flipping at the underflow boundary moves this share by 1/rows
    _zero_close(ctx, row, "zero_row_share", row["zero_row_share"], float((z > 0).mean()), max(ZERO_ATOL, 1.0 / z.size))
    vk = rows["visible_keys"][sel]
    ctx.equal(row, "visible_keys_min", row["visible_keys_min"], int(vk.min()))
    ctx.equal(row, "visible_keys_max", row["visible_keys_max"], int(vk.max()))

# ---------------------------------------------------------------------------------------------
# report.md: the expected blocks of this analysis's section (audit_checks/report_md.py compares them)
# ---------------------------------------------------------------------------------------------

def report_tables(rows, params) -> list:
    cases = [r for r in rows if r.get("scope") == "case"]
    dists = ordered(label(r) for r in cases)
    summ = []
    for dist in dists:
        sel = [r for r in cases if label(r) == dist]
        d = {"distribution": dist, "cases": len(sel), "rows": sum(r["rows"] for r in sel)}
        for key in ("support_le_10", "support_le_25", "support_ge_75", "top10_ge_80", "zero_rate_mean", "history_lt_10",
                    "history_gt_50", "uniform_history", "jaccard_query", "jaccard_block", "sink_mass", "middle_mass",
                    "recent_mass", "current_mass", "history_mass", "jaccard_query_null_pair",
                    "jaccard_query_null_shuffled", "head_set_jaccard", "head_set_jaccard_null", "head_set_mass",
                    "head_set_mass_null", "head_set_size"):
            d[key] = pooled(sel, key)
        paired = [r for r in sel if r.get("jaccard_query") is not None and r.get("jaccard_query_null_pair") is not None]
        d["over"] = (sum(r["jaccard_query"] > r["jaccard_query_null_pair"] for r in paired), len(paired))
        fit = [r for r in sel if r.get("head_set_jaccard") is not None and r.get("head_set_jaccard_null") is not None]
        d["fit_over"] = (sum(r["head_set_jaccard"] > r["head_set_jaccard_null"] for r in fit), len(fit))
        d["block"] = ", ".join(str(b) for b in ordered(r.get("block") for r in sel))
        for key in ("support_q10", "support_q25", "support_median", "support_q75", "support_q90", "history_q10",
                    "history_median", "history_q90", "top1_median", "top5_median", "top10_median"):
            d[key] = median([r.get(key) for r in sel])
        summ.append(d)
    out = [P("summary", "Sparsity and concentration of the float64 reference attention."),
           T("sparsity", ["distribution", "cases", "rows", "support q10", "q25", "median", "q75", "q90", "<=10%", "<=25%",
                          ">=75%", "top1% mass", "top5%", "top10%", "top10%>=80%", "fp32 strict zeros"], 1,
             [[text(d["distribution"]), text(d["cases"]), text(d["rows"])]
              + [pct(d[k]) for k in ("support_q10", "support_q25", "support_median", "support_q75", "support_q90",
                                     "support_le_10", "support_le_25", "support_ge_75", "top1_median", "top5_median",
                                     "top10_median", "top10_ge_80")] + [pct(d["zero_rate_mean"], 3)] for d in summ]),
           P("region", "Region mass (pooled mean) against the uniform expectation"),
           T("region mass", ["distribution", "sink", "middle", "recent", "current", "history", "uniform history",
                             "history q10", "median", "q90", "history <10%", "history >50%"], 1,
             [[text(d["distribution"])] + [pct(d[k]) for k in ("sink_mass", "middle_mass", "recent_mass", "current_mass",
                                                               "history_mass", "uniform_history", "history_q10",
                                                               "history_median", "history_q90", "history_lt_10",
                                                               "history_gt_50")] for d in summ]),
           P("block predictability", "Block predictability: mean Jaccard overlap", [
               ("coverage", r"fewest blocks carrying (\S+) of a row's mass", pct(params["coverage"], 0)),
               ("block tokens", r"a block is a latent frame, or (\S+) tokens\)", text(params["block_tokens"]))]),
           T("block predictability", ["distribution", "Jaccard neighbouring queries", "random pair (null)",
                                      "position-shuffled (null)", "excess over random pair", "cases above",
                                      "Jaccard neighbouring query blocks"], 1,
             [[text(d["distribution"]), pct(d["jaccard_query"], 1), pct(d["jaccard_query_null_pair"], 1),
               pct(d["jaccard_query_null_shuffled"], 1),
               ("n/a",) if d["jaccard_query"] is None or d["jaccard_query_null_pair"] is None else
               (Num(d["jaccard_query"] - d["jaccard_query_null_pair"], lambda v: f"{100 * v:+.1f} pts"),),
               text(f"{d['over'][0]}/{d['over'][1]}"), pct(d["jaccard_block"], 1)] for d in summ]),
           P("head set", "Head-level block predictability: can a head's key blocks be fixed ahead of its queries?", [
               ("block tokens", r"else (\S+) tokens; cases above", text(params["block_tokens"]))]),
           T("head set", ["distribution", "key block", "head set (blocks)", "Jaccard with head set", "random set (null)",
                          "mass kept by head set", "random set mass (null)", "cases above"], 1,
             [[text(d["distribution"]), text(d["block"]), fixed(d["head_set_size"], 1), pct(d["head_set_jaccard"], 1),
               pct(d["head_set_jaccard_null"], 1), pct(d["head_set_mass"], 1), pct(d["head_set_mass_null"], 1),
               text(f"{d['fit_over'][0]}/{d['fit_over'][1]}")] for d in summ])]
    heads = [r for r in rows if r.get("scope") == "head"]
    if heads:
        acc: dict = {}
        for r in heads:
            acc.setdefault((label(r), r["head"]), []).append(r)
        trs = []
        for (dist, hh), rs in acc.items():
            conc = rs[0].get("concentration")
            trs.append([text(dist), text(hh), text(None if conc is None else format(float(conc), "g")), text(len(rs)),
                        spread([r.get("support_median") for r in rs]), pct(pooled(rs, "top10_mean")),
                        pct(pooled(rs, "sink_mass")), pct(pooled(rs, "current_mass")), pct(pooled(rs, "history_mass")),
                        pct(pooled(rs, "jaccard_query"), 1)])
        out += [P("by head", "By head (median over cases"),
                T("by head", ["distribution", "head", "concentration", "cases", "median support [range over cases]",
                              "mean top10%", "sink", "current", "history", "Jaccard queries"], 2, trs)]
    layers = [r for r in cases if r.get("layer") is not None]
    if layers:
        acc = {}
        for r in layers:
            acc.setdefault((label(r), r["layer"]), []).append(r)
        trs = [[text(dist), text(layer), text(len(rs)), pct(pooled(rs, "sink_mass")), pct(pooled(rs, "recent_mass")),
                pct(pooled(rs, "current_mass")), pct(pooled(rs, "history_mass")),
                pct(median([r["support_median"] for r in rs]))]
               for (dist, layer), rs in sorted(acc.items(), key=lambda kv: (str(kv[0][0]), kv[0][1]))]
        out += [P("by layer", "By layer (pooled over the layer's cases)."),
                T("by layer", ["distribution", "layer", "cases", "sink", "recent", "current", "history", "median support"],
                  2, trs)]
    trs = []
    for dist in dists:
        sel = [r for r in cases if label(r) == dist]
        blocks = [r["by_query_block"] for r in sel]
        for i in range(min(len(b["block"]) for b in blocks)):
            n = sum(b["rows"][i] for b in blocks)
            hist = [b["history_mass"][i] for b in blocks]
            hm = None if any(h is None for h in hist) else math.fsum(h * b["rows"][i] for h, b in zip(hist, blocks)) / n
            trs.append([text(dist), text(i), text(n), pct(hm), pct(median([b["support_median"][i] for b in blocks]))])
    out += [P("by position", "By position: query block (frame) of the chunk"),
            T("by position", ["distribution", "query block", "rows", "history mass", "median support (median over cases)"],
              2, trs)]
    for dist in dists:
        sel = [r for r in cases if label(r) == dist]
        maps = [r.get("heatmap") for r in sel]
        if any(m is None for m in maps) or len({(len(m), len(m[0])) for m in maps}) != 1:
            continue
        stack = np.asarray(maps, dtype=np.float64)
        mean = stack.sum(axis=0) / len(maps)
        fmt = lambda v: f"{100 * v:.1f}"  # noqa: E731
        out += [P(f"heatmap {dist}", "Temporal heatmap of `", [
                    ("distribution", r"^Temporal heatmap of `([^`]*)`", text(dist)),
                    ("block tokens", r"query block x key block \((\S+) tokens each\)", text(sel[0]["frame"]))]),
                T(f"heatmap {dist}", ["query \\ key"] + [f"k{j}" for j in range(mean.shape[1])], 1,
                  [[text(f"q{i}")] + [(Num(x, fmt),) for x in row] for i, row in enumerate(mean.tolist())])]
    return out
