"""Attention topology of each Case: sparsity, region mass, temporal heatmap, block predictability.

The observational metrics of the video KV-cache attention study (docs/studies.md), computed
on the float64 reference attention of any Case with named regions (`testbed.metrics.observe`,
tile by tile): effective support ``exp(H)/Sk`` over the visible keys, top-1/5/10 % mass, the
strict-zero rate of the float32 softmax, region mass (sink, middle, recent, current, history),
the share of rows with history mass below 10 % and above 50 %, concentrated (support <= 10 %,
<= 25 %) and diffuse (>= 75 %) shares, summaries by head and by query block (position), the
temporal heatmap (query frame x key frame, rows summing to 1) and block predictability
(Jaccard overlap of top-mass key blocks between neighbouring queries and query blocks, and of
each query with its head's leave-one-out block set, beside their nulls; key blocks are frame x
spatial tile where the Case has frames).

Rows: one ``scope: case`` row per Case and one ``scope: head`` row per query head; no per-query
rows. The per-head heatmaps are stored as one array; the per-row metrics as one float32 array
when the Case is small enough (``store_rows_max`` query-head rows). Rows inside one prompt or
seed are not independent: the report gives shares and quantiles, and spreads across seeds.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from tabulate import tabulate

from ..context import case_fields
from ..metrics import TOP_PERCENTS, history_span, observe, summary
from ..schema import Key, Spec

__all__ = ["SPEC", "validate", "evaluate", "report", "ROW_FIELDS", "REGIONS"]

REGIONS = ("sink", "middle", "recent", "current", "history")
HEATMAP_INLINE_MAX = 1024  # query blocks x key blocks inlined in the case row (6 x 16 in the study)
ROW_FIELDS = ("visible_keys", "support", "top1", "top5", "top10", "zero_rate", "sink_mass", "middle_mass",
              "recent_mass", "current_mass", "history_mass")


SPEC = Spec("analysis: observation", "Attention topology of each Case on the float64 reference: effective support, "
            "top-k mass, strict zeros, region mass, temporal heatmap, block predictability.", {
    "block_tokens": Key(("range", int, 1, 1 << 20), "tokens per block (and per frame when the Case has no "
                                                    "tokens_per_frame)", 16),
    "coverage": Key(("range", float, 0.01, 1.0), "mass the top key blocks must reach (block predictability)", 0.9),
    "spatial_tiles": Key(("range", int, 1, 1 << 20), "block predictability of a Case with frames: key blocks are "
                                                     "frame x spatial tile, each frame split into this many tiles of "
                                                     "consecutive tokens (1: whole frames)", 1),
    "max_scores": Key(("range", int, 1, 1 << 30), "float64 scores per tile of the tiled pass (memory bound)", 1 << 21),
    "store_rows_max": Key(("range", int, 0, 1 << 24), "store per-row metrics when the Case has at most this many "
                                                      "query-head rows", 65536),
})


def validate(params, where):
    return SPEC.check(params, where)


def _median(x: torch.Tensor) -> float:
    """Median with linear interpolation (the mean of the two middle values for an even count)."""
    return float(torch.quantile(x.flatten().to(torch.float64), 0.5))


def _share(mask: torch.Tensor) -> float:
    return float(mask.to(torch.float64).mean())


def _stats(rows: dict, sel, hist_uniform: torch.Tensor | None) -> dict:
    """Scalar summaries of the per-row metrics in ``sel`` (an index into [H, Tq])."""
    sup = rows["support"][sel]
    out = {f"support_{k}": v for k, v in summary(sup).items()}
    out.update(support_le_10=_share(sup <= 0.10), support_le_25=_share(sup <= 0.25), support_ge_75=_share(sup >= 0.75))
    for pc in TOP_PERCENTS:
        t = rows[f"top{pc}"][sel]
        out[f"top{pc}_mean"] = float(t.mean())
        out[f"top{pc}_median"] = _median(t)
    out["top10_ge_80"] = _share(rows["top10"][sel] >= 0.80)
    z = rows["zero_rate"][sel]
    out.update(zero_rate_mean=float(z.mean()), zero_rate_median=_median(z), zero_row_share=_share(z > 0))
    for r in REGIONS:
        key = f"{r}_mass"
        out[key] = float(rows[key][sel].mean()) if key in rows else None
    if "history_mass" in rows:
        hm = rows["history_mass"][sel]
        out.update({f"history_{k}": v for k, v in summary(hm).items() if k != "mean"})
        out.update(history_lt_10=_share(hm < 0.10), history_gt_50=_share(hm > 0.50),
                   uniform_history=float(hist_uniform[sel].mean()))
    else:
        out.update(history_lt_10=None, history_gt_50=None, uniform_history=None)
    vk = rows["visible_keys"][sel]
    out.update(visible_keys=float(vk.mean()), visible_keys_min=int(vk.min()), visible_keys_max=int(vk.max()))
    return out


def evaluate(case, params, ctx) -> list[dict]:
    obs = ctx.timed(case.id, "reference", "observe", 0,
                    lambda: observe(case, block_tokens=params["block_tokens"], coverage=params["coverage"],
                                    max_scores=params["max_scores"], spatial_tiles=params["spatial_tiles"]))
    rows = obs.rows
    h, tq = case.heads, case.q.shape[1]
    hist = history_span(case.layout)
    hist_uniform = None
    if hist is not None:
        hv = torch.clamp(case.query_positions.to(torch.float64) + 1, max=hist[1]) if case.causal else \
            torch.full((tq,), float(hist[1]), dtype=torch.float64)
        hist_uniform = (hv / rows["visible_keys"][0]).expand(h, tq)
    prefix = f"{ctx.study}/{case.id}/observation"
    arrays = {"heatmap": ctx.store.save(f"{prefix}/heatmap", obs.heatmap)}
    fields = [f for f in ROW_FIELDS if f in rows]
    if h * tq <= params["store_rows_max"]:
        arrays["rows"] = ctx.store.save(f"{prefix}/rows", torch.stack([rows[f] for f in fields]).to(torch.float32))
    sink = case.region("sink")
    base = {"study": ctx.study, "analysis": "observation", **case_fields(case), "heads": h, "queries": tq,
            "keys": case.keys, "sink_tokens": sink.size if sink is not None else 0, "frame": obs.frame,
            "key_blocks": obs.heatmap.shape[-1], "query_blocks": obs.query_blocks, "coverage": params["coverage"],
            "block_tokens": params["block_tokens"], "spatial_tiles": params["spatial_tiles"], "block": obs.block,
            "row_fields": fields, "arrays": arrays}
    qb = torch.tensor([obs.query_blocks.index(b) for b in (case.query_positions // obs.frame).tolist()])
    by_block = {"block": obs.query_blocks, "rows": [], "support_median": [], "history_mass": [], "current_mass": []}
    for i in range(len(obs.query_blocks)):
        sel = (slice(None), qb == i)
        by_block["rows"].append(int(rows["support"][sel].numel()))
        by_block["support_median"].append(_median(rows["support"][sel]))
        for key in ("history_mass", "current_mass"):
            by_block[key].append(float(rows[key][sel].mean()) if key in rows else None)
    conc = case.meta.get("head_concentration")
    out = [{**base, "scope": "case", "head": None, "rows": h * tq, **_stats(rows, (slice(None), slice(None)), hist_uniform),
            "jaccard_query": float(obs.jaccard_query.mean()) if obs.jaccard_query.numel() else None,
            "jaccard_block": float(obs.jaccard_block.mean()) if obs.jaccard_block.numel() else None,
            **_nulls(obs, slice(None)), **_head_set(obs, slice(None)),
            "block_set_size": float(obs.block_set_size.mean()),
            # the mean heatmap is inlined for the report when small; the per-head array always has it
            "heatmap": obs.heatmap.mean(dim=0).tolist() if obs.heatmap[0].numel() <= HEATMAP_INLINE_MAX else None,
            "by_query_block": by_block}]
    for hh in range(h):
        out.append({**base, "scope": "head", "head": hh, "kv_head": case.head_map[hh], "rows": tq,
                    "concentration": conc[hh] if conc and hh < len(conc) else None,
                    **_stats(rows, (hh, slice(None)), hist_uniform),
                    "jaccard_query": float(obs.jaccard_query[hh].mean()) if obs.jaccard_query.shape[1] else None,
                    "jaccard_block": float(obs.jaccard_block[hh].mean()) if obs.jaccard_block.shape[1] else None,
                    **_nulls(obs, hh), **_head_set(obs, hh),
                    "block_set_size": float(obs.block_set_size[hh].mean())})
    return out


def _finite_mean(x: torch.Tensor) -> float | None:
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else None


def _nulls(obs, sel) -> dict:
    """Means of the two nulls of the neighbouring-query Jaccard (``metrics.jaccard_nulls``)."""
    return {"jaccard_query_null_pair": _finite_mean(obs.null_pair[sel]),
            "jaccard_query_null_shuffled": _finite_mean(obs.null_shuffled[sel])}


HEAD_SET_FIELDS = ("jaccard", "jaccard_null", "mass", "mass_null", "size")


def _head_set(obs, sel) -> dict:
    """Means of how well the head's (leave-one-out) block set predicts each query's (`head_set_fit`)."""
    return {f"head_set_{k}": _finite_mean(obs.head_set[k][sel]) for k in HEAD_SET_FIELDS}


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def _pct(x, digits=2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}%"


def _fixed(x, digits=1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _med(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])


def _pooled(rows, key):
    """Row-weighted mean over cases (exact pooled share for shares, pooled mean for means)."""
    rs = [r for r in rows if r.get(key) is not None]
    n = sum(r["rows"] for r in rs)
    return None if not n else sum(r[key] * r["rows"] for r in rs) / n


def _spread(rows, key) -> str:
    xs = [r[key] for r in rows if r.get(key) is not None]
    if not xs:
        return "n/a"
    return f"{_pct(_med(xs))} [{_pct(min(xs))}-{_pct(max(xs))}]"


def distribution_summary(rows) -> list[dict]:
    """Per distribution, from the case rows: pooled shares and means, per-case quantile medians."""
    out = []
    cases = [r for r in rows if r["scope"] == "case"]
    for dist in dict.fromkeys(r.get("distribution", r["case"]) for r in cases):
        sel = [r for r in cases if r.get("distribution", r["case"]) == dist]
        d = {"distribution": dist, "cases": len(sel), "rows": sum(r["rows"] for r in sel)}
        for key in ("support_le_10", "support_le_25", "support_ge_75", "top10_ge_80", "zero_row_share", "zero_rate_mean",
                    "history_lt_10", "history_gt_50", "uniform_history", "jaccard_query", "jaccard_block",
                    "jaccard_query_null_pair", "jaccard_query_null_shuffled",
                    *[f"head_set_{k}" for k in HEAD_SET_FIELDS],
                    *[f"{r}_mass" for r in REGIONS], *[f"top{pc}_mean" for pc in TOP_PERCENTS]):
            d[key] = _pooled(sel, key)
        for key in ("support_q10", "support_q25", "support_median", "support_q75", "support_q90",
                    "history_q10", "history_q25", "history_median", "history_q75", "history_q90",
                    *[f"top{pc}_median" for pc in TOP_PERCENTS]):
            d[key] = _med([r.get(key) for r in sel])
        paired = [r for r in sel if r.get("jaccard_query") is not None and r.get("jaccard_query_null_pair") is not None]
        d["jaccard_over_pair_cases"] = (sum(r["jaccard_query"] > r["jaccard_query_null_pair"] for r in paired), len(paired))
        fit = [r for r in sel if r.get("head_set_jaccard") is not None and r.get("head_set_jaccard_null") is not None]
        d["head_set_over_null_cases"] = (sum(r["head_set_jaccard"] > r["head_set_jaccard_null"] for r in fit), len(fit))
        d["block"] = ", ".join(str(b) for b in dict.fromkeys(r.get("block") for r in sel))
        out.append(d)
    return out


def report(rows, params) -> str:
    out = []
    dsum = distribution_summary(rows)
    out.append("Sparsity and concentration of the float64 reference attention. Shares and means pool every "
               "query-head row of the distribution; quantiles are the median over cases of each case's quantile. "
               "Support = exp(entropy) / visible keys.\n")
    tab = [[d["distribution"], d["cases"], d["rows"], _pct(d["support_q10"]), _pct(d["support_q25"]), _pct(d["support_median"]),
            _pct(d["support_q75"]), _pct(d["support_q90"]), _pct(d["support_le_10"]), _pct(d["support_le_25"]),
            _pct(d["support_ge_75"]), _pct(d["top1_median"]), _pct(d["top5_median"]), _pct(d["top10_median"]),
            _pct(d["top10_ge_80"]), _pct(d["zero_rate_mean"], 3)] for d in dsum]
    out.append(tabulate(tab, headers=["distribution", "cases", "rows", "support q10", "q25", "median", "q75", "q90",
                                      "<=10%", "<=25%", ">=75%", "top1% mass", "top5%", "top10%", "top10%>=80%",
                                      "fp32 strict zeros"], tablefmt="github"))
    out.append("\nRegion mass (pooled mean) against the uniform expectation for history (its share of visible keys), "
               "and the distribution of history mass over rows.\n")
    tab = [[d["distribution"], _pct(d["sink_mass"]), _pct(d["middle_mass"]), _pct(d["recent_mass"]), _pct(d["current_mass"]),
            _pct(d["history_mass"]), _pct(d["uniform_history"]), _pct(d["history_q10"]), _pct(d["history_median"]),
            _pct(d["history_q90"]), _pct(d["history_lt_10"]), _pct(d["history_gt_50"])] for d in dsum]
    out.append(tabulate(tab, headers=["distribution", "sink", "middle", "recent", "current", "history", "uniform history",
                                      "history q10", "median", "q90", "history <10%", "history >50%"], tablefmt="github"))
    out.append("\nBlock predictability: mean Jaccard overlap of the top-mass key-block sets (fewest blocks carrying "
               f"{_pct(params['coverage'], 0)} of a row's mass; a block is a latent frame, or {params['block_tokens']} "
               "tokens) between neighbouring queries and between neighbouring query blocks (chunks of queries), "
               "where a Case with frames split into spatial tiles (the head-set table's 'key block' column) has the "
               "neighbouring-query columns over tiles and the query-block column over frames, "
               "beside two nulls for the neighbouring queries: a random pair (each query against a seeded random "
               "query of the same head that sees the same key blocks and is not its neighbour: what any two queries "
               "of a head share) and position-shuffled (the expected overlap if the previous query's blocks sat at "
               "random among the blocks it sees). Excess = neighbours minus the random pair; cases above: in how many "
               "cases the neighbours overlap more than the random pairs (the random-pair mean is over the queries that "
               "have a partner). The query-block Jaccard has no null here, "
               "and under a causal mask its blocks see different keys.\n")
    out.append(tabulate([[d["distribution"], _pct(d["jaccard_query"], 1), _pct(d["jaccard_query_null_pair"], 1),
                          _pct(d["jaccard_query_null_shuffled"], 1),
                          "n/a" if d["jaccard_query"] is None or d["jaccard_query_null_pair"] is None
                          else f"{100 * (d['jaccard_query'] - d['jaccard_query_null_pair']):+.1f} pts",
                          f"{d['jaccard_over_pair_cases'][0]}/{d['jaccard_over_pair_cases'][1]}",
                          _pct(d["jaccard_block"], 1)] for d in dsum],
                        headers=["distribution", "Jaccard neighbouring queries", "random pair (null)",
                                 "position-shuffled (null)", "excess over random pair", "cases above",
                                 "Jaccard neighbouring query blocks"], tablefmt="github"))
    out.append("\nHead-level block predictability: can a head's key blocks be fixed ahead of its queries? Per query, "
               "the head set is the top-block set of the mean block mass of the head's other queries (leave-one-out) "
               "over the blocks the query sees; beside it, a uniformly random set of as many visible blocks (Jaccard "
               "in closed form; its mass is size / visible blocks). 'mass kept' is the query's attention mass on the "
               "head set: what a block-sparse kernel that keeps one fixed set per head would keep. Key blocks are "
               "frame x spatial tile where the Case has frames (the 'key block' column, in tokens), else "
               f"{params['block_tokens']} tokens; cases above: in how many cases the Jaccard beats the random set.\n")
    out.append(tabulate([[d["distribution"], d["block"], _fixed(d["head_set_size"]), _pct(d["head_set_jaccard"], 1),
                          _pct(d["head_set_jaccard_null"], 1), _pct(d["head_set_mass"], 1), _pct(d["head_set_mass_null"], 1),
                          f"{d['head_set_over_null_cases'][0]}/{d['head_set_over_null_cases'][1]}"] for d in dsum],
                        headers=["distribution", "key block", "head set (blocks)", "Jaccard with head set",
                                 "random set (null)", "mass kept by head set", "random set mass (null)", "cases above"],
                        tablefmt="github"))
    heads = [r for r in rows if r["scope"] == "head"]
    if heads:
        out.append("\nBy head (median over cases of each head's median support; pooled means otherwise).\n")
        acc = defaultdict(list)
        for r in heads:
            acc[(r.get("distribution", r["case"]), r["head"])].append(r)
        tab = []
        for (dist, hh), rs in acc.items():
            tab.append([dist, hh, rs[0].get("concentration"), len(rs), _spread(rs, "support_median"),
                        _pct(_pooled(rs, "top10_mean")), _pct(_pooled(rs, "sink_mass")), _pct(_pooled(rs, "current_mass")),
                        _pct(_pooled(rs, "history_mass")), _pct(_pooled(rs, "jaccard_query"), 1)])
        out.append(tabulate(tab, headers=["distribution", "head", "concentration", "cases", "median support [range over cases]",
                                          "mean top10%", "sink", "current", "history", "Jaccard queries"], tablefmt="github"))
    layers = [r for r in rows if r["scope"] == "case" and r.get("layer") is not None]
    if layers:
        out.append("\nBy layer (pooled over the layer's cases).\n")
        acc = defaultdict(list)
        for r in layers:
            acc[(r.get("distribution", r["case"]), r["layer"])].append(r)
        tab = [[dist, layer, len(rs), _pct(_pooled(rs, "sink_mass")), _pct(_pooled(rs, "recent_mass")),
                _pct(_pooled(rs, "current_mass")), _pct(_pooled(rs, "history_mass")),
                _pct(_med([r["support_median"] for r in rs]))]
               for (dist, layer), rs in sorted(acc.items(), key=lambda kv: (str(kv[0][0]), kv[0][1]))]
        out.append(tabulate(tab, headers=["distribution", "layer", "cases", "sink", "recent", "current", "history",
                                          "median support"], tablefmt="github"))
    cases = [r for r in rows if r["scope"] == "case"]
    out.append("\nBy position: query block (frame) of the chunk, in order; pooled over cases of the distribution.\n")
    tab = []
    for dist in dict.fromkeys(r.get("distribution", r["case"]) for r in cases):
        sel = [r for r in cases if r.get("distribution", r["case"]) == dist]
        nb = min(len(r["by_query_block"]["block"]) for r in sel)
        for i in range(nb):
            n = sum(r["by_query_block"]["rows"][i] for r in sel)
            hist = [r["by_query_block"]["history_mass"][i] for r in sel]
            hm = None if None in hist else sum(x * r["by_query_block"]["rows"][i] for x, r in zip(hist, sel)) / n
            tab.append([dist, i, n, _pct(hm), _pct(_med([r["by_query_block"]["support_median"][i] for r in sel]))])
    out.append(tabulate(tab, headers=["distribution", "query block", "rows", "history mass",
                                      "median support (median over cases)"], tablefmt="github"))
    for dist in dict.fromkeys(r.get("distribution", r["case"]) for r in cases):
        sel = [r for r in cases if r.get("distribution", r["case"]) == dist]
        if any(r["heatmap"] is None for r in sel):
            continue
        shapes = {(len(r["heatmap"]), len(r["heatmap"][0])) for r in sel}
        if len(shapes) != 1:
            continue
        qb, kb = shapes.pop()
        mean = [[sum(r["heatmap"][i][j] for r in sel) / len(sel) for j in range(kb)] for i in range(qb)]
        out.append(f"\nTemporal heatmap of `{dist}` (mean over cases and heads): query block x key block "
                   f"({sel[0]['frame']} tokens each), each row sums to 100%.\n")
        out.append(tabulate([[f"q{i}"] + [f"{100 * x:.1f}" for x in row] for i, row in enumerate(mean)],
                            headers=["query \\ key"] + [f"k{j}" for j in range(kb)], tablefmt="github"))
    return "\n".join(out).rstrip()
