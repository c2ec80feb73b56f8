"""The seed's selective rule in the ablation harness: sparse where attention is concentrated, dense
where it is diffuse, against a random and a reversed choice of heads at equal kept keys.

Per *unit* of a Case -- a KV head (its query heads share one kept set per query, the mass summed
over the group) or, with ``unit: "query_head"``, a query head (the synthetic video preset sets its
concentration per query head) -- the effective support ``exp(H) / visible keys`` of every row of
the float64 reference attention (`testbed.metrics.effective_support`, the observation analysis's
quantity) is reduced to its median; a unit is *concentrated* when that median is at most
``threshold`` (0.10: the observation analysis's "support <= 10 %" boundary), else *diffuse*.

A *sparse* unit keeps, per query, only the top ``k`` keys by attention mass among the keys the
query sees, ``k = max(1, ceil(keep_percent * visible / 100))`` (`testbed.metrics.top_counts`; ties
broken by key index); a *dense* unit keeps every visible key. Every unit has as many query rows and
the same visible keys per row, so ``n`` sparse units keep the same number of keys whichever units
they are: the kept share is ``1 - n (V - S) / (U V)`` (``U`` units, ``V`` visible and ``S`` top-k
keys per query head summed over the queries). ``n`` is the count in ``0..U`` whose kept share is
nearest ``budget`` (the smaller on a tie). Three arms sparsify ``n`` units each, so they keep
exactly the same keys in number:

- ``rule``: the ``n`` units of lowest median support (concentrated first; ties by unit index);
- ``reversed``: the ``n`` units of highest median support (diffuse first; the rule run on the
  reversed ranking, so disjoint from the rule's set whenever ``2n <= U`` and its complement at
  ``2n = U``);
- ``random``: ``n`` units drawn with ``random.Random(f"selective:{seed}:{case}:{draw}").sample``,
  one row per draw.

Each arm's output is a masked renormalized softmax per row over its kept keys (the ablation
engine's per-row path, `testbed.ablation.drop_rows`, on the tiles of `metrics.score_tiles`)
and its damage the attention-output relative L2 against the float64 full attention, over every
row of the Case (and per query head). The top-k sets of every unit are stored bit-packed (one
array per Case, ``[H, Tq, ceil(Tk / 8)]`` uint8, `numpy.packbits` along the keys) for the audit.
Rows: one per (case, arm, draw). Units of the report's statistics are seeds or prompts (one case
per unit and distribution), never rows or heads.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch
from tabulate import tabulate

from ..ablation import drop_rows
from ..context import case_fields
from ..metrics import effective_support, holm, paired_wilcoxon, score_tiles, top_counts
from ..resources import DEFAULT_MAX_SCORES
from ..schema import Key, Spec

__all__ = ["SPEC", "validate", "evaluate", "report", "classify", "sparse_count", "arm_units", "topk_mask", "UNITS"]

UNITS = ("kv_head", "query_head")

SPEC = Spec("analysis: selective", "The seed's selective rule: per unit (KV head or query head) classed concentrated "
            "or diffuse by its median effective support, the top-k keys kept on the sparse units and every key on the "
            "dense ones, against a random and a reversed choice of as many units (equal kept keys).", {
    "unit": Key(("choice", UNITS), "what is classed and sparsified: a KV head (its query heads share one kept set "
                                   "per query, from their summed mass) or a query head", "kv_head"),
    "threshold": Key(("range", float, 0.0, 1.0), "a unit is concentrated when the median effective support "
                                                 "exp(H)/visible keys of its rows is at most this", 0.10),
    "keep_percent": Key(("range", int, 1, 100), "a sparse unit keeps per query the top ceil(keep_percent * visible "
                                                "/ 100) keys (at least 1) by attention mass", 10),
    "budget": Key(("range", float, 0.0, 1.0), "kept keys as a share of all visible (query-head row, key) pairs: the "
                                              "number of sparse units is the one whose kept share is nearest", 0.7),
    "random_draws": Key(("range", int, 1, 64), "seeded random choices of as many units (the random control)", 4),
    "seed": Key(int, "seed of the random control's draws", 0),
    "max_scores": Key(("range", int, 1, 1 << 30), "float64 scores per tile (memory bound)", DEFAULT_MAX_SCORES),
})


def validate(params, where):
    return SPEC.check(params, where)


# ---------------------------------------------------------------------------------------------
# the rule's pieces (pure functions, tested on their own)
# ---------------------------------------------------------------------------------------------

def classify(medians: list[float], threshold: float) -> list[str]:
    """``concentrated`` where a unit's median support is at most ``threshold``, else ``diffuse``."""
    return ["concentrated" if m <= threshold else "diffuse" for m in medians]


def sparse_count(units: int, visible: int, topk: int, budget: float) -> int:
    """The number of sparse units (0..units) whose kept share ``1 - n (visible - topk) / (units
    visible)`` is nearest ``budget``, the smaller on a tie."""
    shares = [1.0 - n * (visible - topk) / (units * visible) for n in range(units + 1)]
    return min(range(units + 1), key=lambda n: (abs(shares[n] - budget), n))


def arm_units(arm: str, medians: list[float], n: int, case_id: str, seed: int = 0, draw: int = 0) -> list[int]:
    """The sorted units an arm sparsifies: ``rule`` the ``n`` of lowest median support, ``reversed``
    the ``n`` of highest (ties by unit index either way), ``random`` a seeded draw of ``n``."""
    u = len(medians)
    if arm == "rule":
        order = sorted(range(u), key=lambda i: (medians[i], i))
    elif arm == "reversed":
        order = sorted(range(u), key=lambda i: (-medians[i], i))
    elif arm == "random":
        return sorted(random.Random(f"selective:{seed}:{case_id}:{draw}").sample(range(u), n))
    else:
        raise ValueError(f"unknown arm {arm!r} (rule, reversed, random)")
    return sorted(order[:n])


def topk_mask(score: torch.Tensor, vis: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
    """``[..., c, Tk]`` bool: per row the ``k[c]`` visible keys of largest ``score`` (ties by key index)."""
    s = score if vis is None else score.masked_fill(~vis, float("-inf"))
    order = torch.sort(-s, dim=-1, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(s.shape[-1]).expand_as(order).contiguous())
    return rank < k.view(*([1] * (s.dim() - 2)), -1, 1)


# ---------------------------------------------------------------------------------------------
# evaluate
# ---------------------------------------------------------------------------------------------

def _support_pass(case, max_scores: int):
    """``support [H, Tq]`` and ``visible [Tq]`` of the float64 reference attention, tile by tile."""
    h, tq = case.heads, case.q.shape[1]
    support = torch.empty(h, tq, dtype=torch.float64)
    visible = torch.full((tq,), case.keys, dtype=torch.int64)
    for _, heads, qs, s, vis in score_tiles(case.q, case.k, case.query_positions, case.causal, max_scores):
        if vis is not None:
            s = s.masked_fill(~vis, float("-inf"))
            visible[qs] = vis.sum(dim=-1)
        p = torch.softmax(s, dim=-1)
        support[heads, qs] = effective_support(p, visible[qs].to(torch.float64).expand(p.shape[:-1]))
    return support, visible


def _unit_of_heads(case, unit: str) -> list[list[int]]:
    """The query heads of each unit."""
    if unit == "query_head":
        return [[hh] for hh in range(case.heads)]
    return [[hh for hh in range(case.heads) if case.head_map[hh] == j] for j in range(case.kv_heads)]


def _arms(medians, n, case_id, params) -> list[tuple[str, int | None, list[int]]]:
    out = [("rule", None, arm_units("rule", medians, n, case_id)),
           ("reversed", None, arm_units("reversed", medians, n, case_id))]
    out += [("random", d, arm_units("random", medians, n, case_id, params["seed"], d)) for d in range(params["random_draws"])]
    return out


def _ablate(case, k_rows: torch.Tensor, unit_heads, arms, unit: str, max_scores: int):
    """Per arm, per query head: ``err2``, ``ref2`` against the full float64 output, undefined rows,
    and the top-k sets of every unit, bit-packed along the keys tile by tile (``[H, Tq, ceil(Tk / 8)]``
    uint8: the case's only per-key array, an eighth of a byte per score)."""
    h, tq, tk = case.heads, case.q.shape[1], case.keys
    na = len(arms)
    err2 = torch.zeros(na, h, dtype=torch.float64)
    ref2 = torch.zeros(na, h, dtype=torch.float64)
    undefined = torch.zeros(na, h, dtype=torch.int64)
    top = np.zeros((h, tq, -(-tk // 8)), dtype=np.uint8)
    head_unit = {hh: u for u, hs in enumerate(unit_heads) for hh in hs}
    for j, heads, qs, s, vis in score_tiles(case.q, case.k, case.query_positions, case.causal, max_scores):
        vj = case.v[j].to(torch.float64)
        if vis is not None:
            s = s.masked_fill(~vis, float("-inf"))
        p = torch.softmax(s, dim=-1)
        full = torch.matmul(p, vj)
        kk = k_rows[qs]
        if unit == "kv_head":
            sel = topk_mask(p.sum(dim=0), vis, kk).unsqueeze(0).expand_as(p)
        else:
            sel = topk_mask(p, vis, kk)
        top[heads, qs] = np.packbits(sel.numpy(), axis=-1)
        hs = list(range(heads.start, heads.stop))
        for a, (_, _, sparse) in enumerate(arms):
            sparse_rows = torch.tensor([head_unit[hh] in sparse for hh in hs]).view(-1, 1, 1)
            drop = sparse_rows & ~sel
            if vis is not None:
                drop = drop & vis.unsqueeze(0)
            out, ok = drop_rows(s, vis, p, drop, vj, outputs_only=True)
            okd = ok.unsqueeze(-1)
            o = torch.where(okd, out, torch.zeros_like(out))
            r = torch.where(okd, full, torch.zeros_like(full))
            err2[a, heads] += ((o - r) ** 2).sum(dim=(-1, -2))
            ref2[a, heads] += (r ** 2).sum(dim=(-1, -2))
            undefined[a, heads] += (~ok).sum(dim=-1)
    return err2, ref2, undefined, top


def _rel(num, den) -> float | None:
    den = float(den)
    return None if den == 0 else (float(num) / den) ** 0.5


def evaluate(case, params, ctx) -> list[dict]:
    unit = params["unit"]
    support, visible = ctx.timed(case.id, "reference", "support", 0, lambda: _support_pass(case, params["max_scores"]))
    unit_heads = _unit_of_heads(case, unit)
    medians = [float(torch.quantile(support[hs].flatten(), 0.5)) for hs in unit_heads]
    classes = classify(medians, params["threshold"])
    k_rows = top_counts(visible, params["keep_percent"])
    v_sum, s_sum = int(visible.sum()), int(k_rows.sum())
    units = len(unit_heads)
    n = sparse_count(units, v_sum, s_sum, params["budget"])
    arms = _arms(medians, n, case.id, params)
    err2, ref2, undefined, top = ctx.timed(case.id, "selective", "ablate", 0,
                                           lambda: _ablate(case, k_rows, unit_heads, arms, unit, params["max_scores"]))
    path = ctx.store.save(f"{ctx.study}/{case.id}/selective/topk", torch.from_numpy(top))
    per_head = len(unit_heads[0])
    total = case.heads * v_sum
    kept = total - n * per_head * (v_sum - s_sum)
    base = {"study": ctx.study, "analysis": "selective", **case_fields(case), "unit": unit, "units": units,
            "heads": case.heads, "queries": case.q.shape[1], "keys": case.keys, "threshold": params["threshold"],
            "keep_percent": params["keep_percent"], "budget": params["budget"], "control_seed": params["seed"],
            "support_medians": medians, "classes": classes, "concentrated": classes.count("concentrated"),
            "sparse": n, "visible_keys": total, "kept_keys": kept, "kept_share": kept / total if total else None,
            "topk_keys": s_sum, "arrays": {"topk": path}}
    rows = []
    for a, (arm, draw, sparse) in enumerate(arms):
        rows.append({**base, "arm": arm, "draw": draw, "sparse_units": sparse,
                     "sparse_concentrated": sum(classes[u] == "concentrated" for u in sparse),
                     "rel_l2": _rel(err2[a].sum(), ref2[a].sum()),
                     "rel_l2_heads": [_rel(e, r) for e, r in zip(err2[a], ref2[a])],
                     "undefined_rows": int(undefined[a].sum())})
    return rows


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def _label(r):
    return r["distribution"] if "distribution" in r else r["case"]


def _unit(r) -> str:
    for key in ("prompt", "seed"):
        if r.get(key) is not None:
            return f"{key}={r[key]}"
    return f"case={r['case']}"


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])


def _pct(x, digits=3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}%"


def _p(x) -> str:
    return "n/a" if x is None else f"{x:.4f}" if x >= 1e-4 else f"{x:.1e}"


def per_case(rows) -> list[dict]:
    """One line per case: the three arms' rel-L2 (random: the mean over its draws)."""
    out = {}
    for r in rows:
        d = out.setdefault(r["case"], {"case": r["case"], "label": _label(r), "unit": _unit(r), "row": r,
                                       "random": []})
        if r["arm"] == "random":
            d["random"].append(r["rel_l2"])
        else:
            d[r["arm"]] = r["rel_l2"]
    for d in out.values():
        xs = [x for x in d["random"] if x is not None]
        d["random"] = sum(xs) / len(xs) if xs else None
    return list(out.values())


def summary(rows) -> list[dict]:
    """Per distribution: medians over units of each arm's rel-L2, wins of the rule, Wilcoxon p."""
    cases = per_case(rows)
    out = []
    for dist in dict.fromkeys(c["label"] for c in cases):
        sel = [c for c in cases if c["label"] == dist]
        acc = {}
        for c in sel:
            acc.setdefault(c["unit"], []).append(c)
        units = {u: {arm: _mean([c[arm] for c in cs]) for arm in ("rule", "random", "reversed")} for u, cs in acc.items()}
        line = {"distribution": dist, "units": len(units), "cases": len(sel)}
        r0 = [c["row"] for c in sel]
        line["unit_kind"] = r0[0]["unit"]
        line["sparse"] = f"{_median([r['sparse'] for r in r0]):g}/{r0[0]['units']}"
        line["concentrated"] = _median([r["concentrated"] for r in r0])
        rule = [r for r in rows if _label(r) == dist and r["arm"] == "rule"]
        line["rule_concentrated"] = f"{sum(r['sparse_concentrated'] for r in rule)}/{sum(r['sparse'] for r in rule)}"
        line["kept_share"] = _median([r["kept_share"] for r in r0])
        for arm in ("rule", "random", "reversed"):
            line[arm] = _median([u[arm] for u in units.values()])
        for ctrl in ("random", "reversed"):
            pairs = [(u["rule"], u[ctrl]) for u in units.values() if u["rule"] is not None and u[ctrl] is not None]
            line[f"wins_{ctrl}"] = f"{sum(a < b for a, b in pairs)}/{len(pairs)}"
            line[f"p_{ctrl}"] = paired_wilcoxon([a for a, _ in pairs], [b for _, b in pairs])["p"] if pairs else None
        out.append(line)
    adj = holm([p for line in out for p in (line["p_random"], line["p_reversed"])])
    for i, line in enumerate(out):
        line["holm_random"], line["holm_reversed"] = adj[2 * i], adj[2 * i + 1]
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def report(rows, params) -> str:
    out = ["Selective sparsity at equal kept keys: per unit (" + ", ".join(dict.fromkeys(r["unit"] for r in rows))
           + f"), concentrated when the median effective support of its rows is <= {100 * params['threshold']:g}%; "
           f"a sparse unit keeps per query the top {params['keep_percent']}% of its visible keys by attention mass, "
           "a dense one every key; the number of sparse units is set so the kept share is nearest "
           f"{100 * params['budget']:g}%, the same for the three arms: rule (lowest median support first), random "
           f"({params['random_draws']} seeded draws, rel-L2 averaged per case) and reversed (highest median support "
           "first). rel-L2: attention output against the float64 full attention, per case over all its rows; "
           "median over units (seeds or prompts). 'rule better': units where the rule's rel-L2 is below the "
           "control's; p: two-sided Wilcoxon signed-rank over units.\n"]
    tab = [[d["distribution"], d["units"], d["unit_kind"], d["sparse"], "n/a" if d["concentrated"] is None
            else f"{d['concentrated']:g}", _pct(d["kept_share"], 2), _pct(d["rule"]), _pct(d["random"]),
            d["rule_concentrated"], _pct(d["reversed"]), d["wins_random"], _p(d["p_random"]), _p(d["holm_random"]),
            d["wins_reversed"], _p(d["p_reversed"]), _p(d["holm_reversed"])]
           for d in summary(rows)]
    out.append(tabulate(tab, headers=["distribution", "units", "unit", "sparse units", "concentrated units (median)",
                                      "kept share", "rule rel-L2", "random rel-L2", "rule's sparse concentrated",
                                      "reversed rel-L2", "rule better than random", "p random", "Holm p random",
                                      "rule better than reversed", "p reversed", "Holm p reversed"],
                        tablefmt="github"))
    out.append("\nBy unit: the median over cases of the unit's median support and the share of cases in which it is "
               "concentrated.\n")
    tab = []
    for dist in dict.fromkeys(_label(r) for r in rows):
        sel = [r for r in rows if _label(r) == dist and r["arm"] == "rule"]
        for u in range(sel[0]["units"]):
            ms = [r["support_medians"][u] for r in sel]
            conc = sum(r["classes"][u] == "concentrated" for r in sel)
            tab.append([dist, u, len(sel), _pct(_median(ms), 2), f"{conc}/{len(sel)}"])
    out.append(tabulate(tab, headers=["distribution", "unit", "cases", "median support", "concentrated"],
                        tablefmt="github"))
    return "\n".join(out).rstrip()
