"""Audit of the selective rule's rows (analysis ``selective``), written again from its definition
(docs in `testbed/analyses/selective.py`) with numpy and the standard library only.

From the case's stored Q/K/V: the float64 softmax of every row, its effective support
``exp(H) / visible keys``, each unit's median (``np.median``: the mean of the two middle values
for an even count), its class at the threshold, the top-k count per query, the number of sparse
units nearest the budget, each arm's sparse units (the rule's and the reversed rule's ranking, the
random draws redrawn with ``random.Random``); then the stored top-k sets: exactly ``k`` visible
keys per row, every one of them at least as heavy as every visible key left out (within
``TOLERANCES["selective_tie"]``, so a near tie may fall either way), the same set for every query
head of a KV head; and each arm's output, a masked renormalized softmax over its kept keys, with
its relative L2 against the full float64 output, per query head and over the case.
"""

from __future__ import annotations

import math
import random

import numpy as np

from .common import TOLERANCES, softmax_attention
from .report_format import P, T, Num, label, ordered, pct, pvalue, text
from .stats import holm, median, unit_of, wilcoxon_p

__all__ = ["check", "derive", "report_tables"]

ARMS = ("rule", "random", "reversed")


def _units(unit: str, heads: int, head_map: list) -> list[list[int]]:
    if unit == "query_head":
        return [[h] for h in range(heads)]
    return [[h for h in range(heads) if head_map[h] == j] for j in range(max(head_map) + 1)]


def _sparse_count(units: int, visible: int, topk: int, budget: float) -> int:
    best = None
    for n in range(units + 1):
        d = abs(1.0 - n * (visible - topk) / (units * visible) - budget)
        if best is None or d < best[0]:
            best = (d, n)
    return best[1]


def _arm_units(arm: str, medians: list, n: int, case_id: str, seed: int, draw) -> list[int]:
    u = len(medians)
    if arm == "random":
        return sorted(random.Random(f"selective:{seed}:{case_id}:{draw}").sample(range(u), n))
    sign = 1.0 if arm == "rule" else -1.0
    return sorted(sorted(range(u), key=lambda i: (sign * medians[i], i))[:n])


def derive(case: dict, params: dict, case_id: str) -> dict:
    """Everything the rows of one case follow from, except the stored top-k sets."""
    q, k = case["q"], case["k"]
    h, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    p, full = softmax_attention(q, k, case["v"], case["query_positions"], case["causal"])
    qp = np.asarray(case["query_positions"], dtype=np.int64)
    vis = (np.arange(tk)[None, :] <= qp[:, None]) if case["causal"] else np.ones((tq, tk), dtype=bool)
    nvis = vis.sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(axis=-1)
    support = np.exp(ent) / nvis[None, :]
    head_map = case.get("head_map") or [i // (h // k.shape[0]) for i in range(h)]
    groups = _units(params["unit"], h, head_map)
    medians = [float(np.median(support[g])) for g in groups]
    classes = ["concentrated" if m <= params["threshold"] else "diffuse" for m in medians]
    kq = np.maximum(1, -(-params["keep_percent"] * nvis // 100))
    n = _sparse_count(len(groups), int(nvis.sum()), int(kq.sum()), params["budget"])
    return {"p": p, "full": full, "vis": vis, "nvis": nvis, "k": kq, "groups": groups, "medians": medians,
            "classes": classes, "n": n}


def _check_topk(row, ctx, d: dict, top: np.ndarray) -> bool:
    """The stored top-k sets are top-k sets of the audit's own mass (within the tie tolerance)."""
    tol = TOLERANCES["selective_tie"]
    vis, kq, p = d["vis"], d["k"], d["p"]
    ok = True
    if np.any(top & ~vis[None]):
        ctx.fail(row, "arrays.topk: keeps a key its query does not see")
        ok = False
    counts = top.sum(axis=-1)
    if not np.array_equal(counts, np.broadcast_to(kq[None, :], counts.shape)):
        hh, qq = (int(i) for i in np.argwhere(counts != kq[None, :])[0])
        ctx.fail(row, f"arrays.topk: head {hh} query {qq} keeps {int(counts[hh, qq])} keys, the top-k count is {int(kq[qq])}")
        ok = False
    for g in d["groups"]:
        score = p[g].sum(axis=0) if row["unit"] == "kv_head" else None
        for hh in g:
            if row["unit"] == "kv_head" and not np.array_equal(top[hh], top[g[0]]):
                ctx.fail(row, f"arrays.topk: query heads {g[0]} and {hh} of one KV head keep different sets")
                return False
            s = score if score is not None else p[hh]
            kept_min = np.where(top[hh], s, np.inf).min(axis=-1)
            left_max = np.where(vis & ~top[hh], s, -np.inf).max(axis=-1)
            bad = left_max > kept_min + tol["atol"] + tol["rtol"] * np.abs(kept_min)
            if np.any(bad):
                qq = int(np.argwhere(bad)[0][0])
                ctx.fail(row, f"arrays.topk: head {hh} query {qq} leaves out a key of mass {left_max[qq]:.6g} above "
                              f"a kept one of {kept_min[qq]:.6g}: not a top-k set")
                ok = False
    ctx.numbers += 1
    return ok


def check(row: dict, ctx) -> None:
    case = ctx.case(row)
    params = {f: row[f] for f in ("unit", "threshold", "keep_percent", "budget")}
    d = ctx.cached(("selective", row["study"], row["case"], json_key(params)), lambda: derive(case, params, row["case"]))
    h, tq, tk = case["q"].shape[0], case["q"].shape[1], case["k"].shape[1]
    for f, want in (("heads", h), ("queries", tq), ("keys", tk), ("units", len(d["groups"])),
                    ("concentrated", d["classes"].count("concentrated")), ("sparse", d["n"]),
                    ("classes", d["classes"])):
        ctx.equal(row, f, row.get(f), want)
    ctx.close(row, "support_medians", row.get("support_medians"), d["medians"])
    v_sum, s_sum = int(d["nvis"].sum()), int(d["k"].sum())
    per = len(d["groups"][0])
    total = h * v_sum
    kept = total - d["n"] * per * (v_sum - s_sum)
    ctx.equal(row, "visible_keys", row.get("visible_keys"), total)
    ctx.equal(row, "topk_keys", row.get("topk_keys"), s_sum)
    ctx.equal(row, "kept_keys", row.get("kept_keys"), kept)
    ctx.close(row, "kept_share", row.get("kept_share"), kept / total)
    arm, draw = row.get("arm"), row.get("draw")
    if arm not in ARMS or (arm == "random") != isinstance(draw, int) or isinstance(draw, bool):
        ctx.fail(row, f"arm {arm!r} / draw {draw!r}: an arm is rule, reversed (no draw) or random (a draw number)")
        return
    sparse = _arm_units(arm, d["medians"], d["n"], row["case"], row["control_seed"], draw)
    ctx.equal(row, "sparse_units", row.get("sparse_units"), sparse)
    ctx.equal(row, "sparse_concentrated", row.get("sparse_concentrated"),
              sum(d["classes"][u] == "concentrated" for u in sparse))
    packed = ctx.load(row["arrays"]["topk"])
    if packed.dtype != np.uint8 or packed.shape != (h, tq, -(-tk // 8)):
        ctx.fail(row, f"arrays.topk: {packed.dtype} {packed.shape}, expected uint8 {(h, tq, -(-tk // 8))}")
        return
    top = np.unpackbits(packed, axis=-1, count=tk).astype(bool)
    if not ctx.cached(("selective-topk", row["study"], row["case"], row["arrays"]["topk"]),
                      lambda: _check_topk(row, ctx, d, top)):
        return
    # the arm's kept keys: the top-k set on its sparse units' query heads, every visible key elsewhere
    sparse_heads = [hh for u in sparse for hh in d["groups"][u]]
    keep = np.broadcast_to(d["vis"][None], top.shape).copy()
    keep[sparse_heads] = top[sparse_heads]
    defined = keep.any(axis=-1)
    ctx.equal(row, "undefined_rows", row.get("undefined_rows"), int((~defined).sum()))
    # the masked renormalized softmax: P restricted to the kept keys, divided by its kept mass
    pk = np.where(keep, d["p"], 0.0)
    pa = pk / np.where(defined, pk.sum(axis=-1), 1.0)[..., None]
    v = np.repeat(case["v"].astype(np.float64), h // case["v"].shape[0], axis=0)
    out = pa @ v
    err2 = ((out - d["full"]) ** 2).sum(axis=(-1, -2))
    ref2 = (d["full"] ** 2).sum(axis=(-1, -2))
    ctx.close(row, "rel_l2", row.get("rel_l2"), math.sqrt(err2.sum() / ref2.sum()) if ref2.sum() else None)
    heads = [math.sqrt(a / b) if b else None for a, b in zip(err2, ref2)]
    got = row.get("rel_l2_heads")
    if not isinstance(got, list) or len(got) != h:
        ctx.fail(row, f"rel_l2_heads: {got!r} is not a list of {h} numbers")
        return
    for hh, (a, b) in enumerate(zip(got, heads)):
        # a head whose kept set is every visible key: zero within float64 rounding of two softmaxes
        if b is not None and b < 1e-12 and isinstance(a, float) and 0 <= a < 1e-12:
            continue
        ctx.close(row, f"rel_l2_heads[{hh}]", a, b)


def json_key(params: dict) -> tuple:
    return tuple(sorted(params.items()))


# ---------------------------------------------------------------------------------------------
# report.md
# ---------------------------------------------------------------------------------------------

def _mean(xs):
    xs = [x for x in xs if x is not None]
    return math.fsum(xs) / len(xs) if xs else None


def report_tables(rows, params) -> list:
    cases = {}
    for r in rows:
        c = cases.setdefault(r["case"], {"label": label(r), "unit": unit_of(r), "row": r, "random": []})
        if r["arm"] == "random":
            c["random"].append(r["rel_l2"])
        else:
            c[r["arm"]] = r["rel_l2"]
    for c in cases.values():
        c["random"] = _mean(c["random"])
    trs = []
    for dist in ordered(c["label"] for c in cases.values()):
        sel = [c for c in cases.values() if c["label"] == dist]
        units = {}
        for c in sel:
            units.setdefault(c["unit"], []).append(c)
        per = {u: {a: _mean([c.get(a) for c in cs]) for a in ARMS} for u, cs in units.items()}
        r0 = [c["row"] for c in sel]
        line = [text(dist), text(len(per)), text(r0[0]["unit"]),
                (Num(median([r["sparse"] for r in r0]), lambda v: f"{v:g}", exact=True), f"/{r0[0]['units']}"),
                (Num(median([r["concentrated"] for r in r0]), lambda v: f"{v:g}", exact=True),),
                pct(median([r["kept_share"] for r in r0]), 2)]
        rel = [pct(median([x[a] for x in per.values() if x[a] is not None]), 3) for a in ARMS]
        rule = [r for r in rows if label(r) == dist and r["arm"] == "rule"]
        line += rel[:2] + [text(f"{sum(r['sparse_concentrated'] for r in rule)}/{sum(r['sparse'] for r in rule)}"),
                           rel[2]]
        for ctrl in ("random", "reversed"):
            pairs = [(x["rule"], x[ctrl]) for x in per.values() if x["rule"] is not None and x[ctrl] is not None]
            p, exact = wilcoxon_p([a for a, _ in pairs], [b for _, b in pairs]) if pairs else (None, True)
            line += [text(f"{sum(a < b for a, b in pairs)}/{len(pairs)}"), pvalue(p, exact=exact), (p, exact)]
        trs.append(line)
    # Holm over every test of the table (both controls, every distribution), in the run's order
    cols = (12, 15)
    ps = [line[c][0] for line in trs for c in cols]
    exact = all(line[c][1] for line in trs for c in cols)
    adj = holm(ps)
    for i, line in enumerate(trs):
        for j, c in enumerate(cols):
            line[c] = pvalue(adj[2 * i + j], exact=exact)
    out = [P("selective", "Selective sparsity at equal kept keys: per unit ("),
           T("selective", ["distribution", "units", "unit", "sparse units", "concentrated units (median)", "kept share",
                           "rule rel-L2", "random rel-L2", "rule's sparse concentrated", "reversed rel-L2",
                           "rule better than random", "p random", "Holm p random", "rule better than reversed",
                           "p reversed", "Holm p reversed"], 1, trs),
           P("by unit", "By unit: the median over cases of the unit's median support")]
    utrs = []
    for dist in ordered(label(r) for r in rows):
        sel = [r for r in rows if label(r) == dist and r["arm"] == "rule"]
        for u in range(sel[0]["units"]):
            utrs.append([text(dist), text(u), text(len(sel)), pct(median([r["support_medians"][u] for r in sel]), 2),
                         text(f"{sum(r['classes'][u] == 'concentrated' for r in sel)}/{len(sel)}")])
    out.append(T("by unit", ["distribution", "unit", "cases", "median support", "concentrated"], 2, utrs))
    return out

