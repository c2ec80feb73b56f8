"""The audit's own figure data for report.html (`derive_figures`), recomputed from the result rows
and the stored arrays they name, written again from the documented definitions (the run's builder,
testbed/report_html/, is never imported), and `first_difference`, where an embedded figure's data
first departs from it beyond ``RTOL``/``ATOL``."""

from __future__ import annotations

import math

import numpy as np

from .common import TOLERANCES
from .live_policies import BUDGET_VERSUS, MODELS, budget_of, versus_of
from .report_format import label as _label
from .report_format import ordered as _ordered
from .stats import bootstrap

__all__ = ["derive_figures", "first_difference", "RTOL", "ATOL", "STEP_BLOCK"]

# the audit's float64 tolerance (the embedded data carries 9 significant digits)
RTOL, ATOL = TOLERANCES["derived"]["rtol"], TOLERANCES["derived"]["atol"]
STEP_BLOCK = 8  # teacher-forced steps per point of the live agreement curve (docs/report: "per block of 8")


def _unit_of(r):
    if r.get("prompt") is not None:
        return f"prompt={r['prompt']}"
    if r.get("seed") is not None:
        return f"seed={r['seed']}"
    return f"case={r['case']}"


def _per_unit_mean(rows, field):
    sums: dict[str, list] = {}
    for r in rows:
        if r.get(field) is not None:
            sums.setdefault(_unit_of(r), []).append(float(r[field]))
    return {u: math.fsum(v) / len(v) for u, v in sums.items()}


def _sorted_concat(parts):
    return np.sort(np.concatenate([np.asarray(p, dtype=np.float64).ravel() for p in parts])).tolist()


def _observation_figures(rows, ctx):
    cases = [r for r in rows if r.get("scope") == "case"]
    labels = _ordered([_label(r) for r in cases])
    heat, ecdf, mass = [], [], []
    for lab in labels:
        group = [r for r in cases if _label(r) == lab]
        names = [r["case"] for r in group]
        maps = [r.get("heatmap") for r in group]
        if all(m is not None for m in maps) and len({np.asarray(m).shape for m in maps}) == 1:
            stack = np.stack([np.asarray(m, dtype=np.float64) for m in maps])
            heat.append({"distribution": lab, "cases": names, "frame": group[0]["frame"],
                         "mean": (stack.sum(axis=0) / len(maps)).tolist()})
        stored = [r for r in group if "rows" in r.get("arrays", {})]
        if stored:
            ecdf.append({"distribution": lab, "cases": [r["case"] for r in stored], "support_sorted": _sorted_concat(
                ctx.load(r["arrays"]["rows"])[list(r["row_fields"]).index("support")] for r in stored)})
        regions = {}
        for reg in ("sink", "middle", "recent", "current", "history"):
            vals = [r.get(reg + "_mass") for r in group]
            if any(v is not None for v in vals):
                regions[reg] = vals
        mass.append({"distribution": lab, "cases": names, "regions": regions})
    return [("heatmap", heat and {"panels": heat}), ("support_ecdf", ecdf and {"lines": ecdf}),
            ("region_mass", mass and {"groups": mass})]


def _mx_figure(rows, ctx):
    series = []
    for path, rot, rule in _ordered([(r["path"], r["rotation"], r["scale_rule"]) for r in rows]):
        sel = [r for r in rows if (r["path"], r["rotation"], r["scale_rule"]) == (path, rot, rule)]
        series.append({"path": path, "rotation": rot, "scale_rule": rule, "cases": [r["case"] for r in sel],
                       "tv_sorted": _sorted_concat(r["per_row"]["tv"] for r in sel)})
    p_rules = [r["scale_rule"] for r in rows if r["path"] == "p"]
    p_rows = [r for r in rows if r["path"] == "p" and r["scale_rule"] == p_rules[0]] if p_rules else []
    p = None if not p_rows else {
        "cases": [r["case"] for r in p_rows], "distributions": [_label(r) for r in p_rows],
        "zero_rate_mean": [r["numerical_zero_rate_mean"] for r in p_rows],
        "row_sum_sorted": _sorted_concat(r["per_row"]["row_sum"] for r in p_rows)}
    return [("mx_paths", series and {"series": series, "p": p})]


def _ablation_figure(rows, ctx):
    arm = rows[0]["arm"]
    names = _ordered([r["ablation"] for r in rows])
    pairs = []
    for lab in _ordered([_label(r) for r in rows]):
        usable = [r for r in rows if _label(r) == lab and r["arm"] == arm and r["applicable"]]
        for ctrl in (n for n in names if n.startswith("control_")):
            drop = "drop_" + ctrl.removeprefix("control_")
            a = _per_unit_mean([r for r in usable if r["ablation"] == drop], "rel_l2")
            b = _per_unit_mean([r for r in usable if r["ablation"] == ctrl], "rel_l2")
            units = sorted(a.keys() & b.keys())
            if units:
                pairs.append({"distribution": lab, "ablation": drop, "control": ctrl, "units": units,
                              "ablation_rel_l2": [a[u] for u in units], "control_rel_l2": [b[u] for u in units]})
    return [("ablation_pairs", pairs and {"arm": arm, "pairs": pairs})]


def _residual_figure(rows, ctx):
    cells = []
    for lab in _ordered([_label(r) for r in rows]):
        for arm in _ordered([r["arm"] for r in rows]):
            per = _per_unit_mean([r for r in rows if _label(r) == lab and r["arm"] == arm], "rel_l2")
            if per:
                cells.append({"distribution": lab, "arm": arm, "units": sorted(per), "rel_l2": [per[u] for u in sorted(per)]})
    return [("residual_window", cells and {"cells": cells})]


UNIFORM_LINES = ("int2", "int3", "int4")


def _context_of(r):
    case = str(r["case"])
    return case.rpartition("-")[0] if "-" in case else ""


def _versus_reference(arm, by_case, ref):
    ids = sorted(by_case)
    if any(s not in ref for s in ids):
        return None
    rs = [by_case[s] for s in ids]
    return {"arm": arm, "segments": ids, "bytes_per_token": math.fsum(r["bytes_per_token"] for r in rs) / len(rs),
            "delta_pct": 100.0 * math.expm1(math.fsum(r["nll"] - ref[s]["nll"] for r, s in zip(rs, ids)) / len(ids))}


def _context_arms(rows, prefix):
    """A context's arms in row order, their rows per case, and the reference arms among them."""
    sel = [r for r in rows if _context_of(r) == prefix]
    names = _ordered([r["arm"] for r in sel])
    seg = {arm: {r["case"]: r for r in sel if r["arm"] == arm} for arm in names}
    return names, seg, [a for a in names if next(iter(seg[a].values()))["kind"] == "reference"]


def _equal_bytes_figure(rows):
    """Per context (in row order) and budget: the budget's arms (``mixNN_<rule>``, ``int2_hh*``, other
    than its compared arm) with Δ perplexity against the reference, 100 * (exp(mean over segments of
    the NLL difference) - 1), sorted by (Δ, name), flagged oracle when named ``*_oracle_*`` or
    ``*_oracle``; the compared arm's and the uniform int2 / int3 / int4 arms' Δ as lines. An arm with
    a segment the reference lacks is left out."""
    prefixes = _ordered([_context_of(r) for r in rows])
    budgets = []
    for prefix in prefixes:
        names, seg, refs = _context_arms(rows, prefix)
        if not refs:
            continue
        ref = seg[refs[0]]

        def delta(arm, seg=seg, ref=ref):
            return _versus_reference(arm, seg[arm], ref)

        for budget, _ in BUDGET_VERSUS:
            versus = versus_of(budget, seg)
            if versus is None:
                continue
            vs = delta(versus)
            arms = [p for p in (delta(a) for a in names if budget_of(a) == budget and a != versus) if p]
            if vs is None or not arms:
                continue
            arms.sort(key=lambda p: (p["delta_pct"], p["arm"]))
            for p in arms:
                p["oracle"] = "_oracle_" in p["arm"] or p["arm"].endswith("_oracle")
            lines = [p for p in (delta(a) for a in UNIFORM_LINES if a in seg and a != versus) if p]
            budgets.append({"context": prefix[1:] if len(prefixes) > 1 else "", "budget": budget, "versus": vs,
                            "uniform": lines, "arms": arms})
    return budgets


def _family(r):
    """The frontier figure's family of a row (the audit's own rule): a peer "quanto"; a policy with a
    scorer its scorer, " (prefill)" when it decides at the prefill only (" (prefill, pyramid)",
    " (prefill, adaptive)", " (prefill, pyramid, adaptive)" with its schedules; the selective rule's
    " (prefill, selective concentrated)", its oracle's " (prefill, selective concentrated oracle)"; blocks'
    " (prefill, blocks of 16)"); a dropped middle
    "streaming"; another non-float32 middle "quantization"; else none."""
    if r["kind"] == "peer":
        return "quanto"
    pol = r.get("policy") if r["kind"] == "policy" else None
    if not isinstance(pol, dict) or pol.get("middle") == "float32":
        return None
    if pol.get("scorer"):
        if pol.get("scorer_mode") != "prefill":
            return pol["scorer"]
        how = ["prefill"] + ["pyramid"] * (pol.get("layers") == "pyramid") + ["adaptive"] * (pol.get("heads") == "adaptive")
        how += [pol["store"]] if pol.get("store") else []  # a kept set stored quantized: its storage
        how += [f"rest {pol['rest']}"] if pol.get("rest") else []  # the dropped tokens kept at low precision (MiKV)
        if pol.get("heads") == "selective":  # the seed's rule: which pairs are sparse, from what
            how += [f"selective {pol.get('alloc')}" + (" oracle" if pol.get("alloc_from") == "oracle" else "")]
            how += [f"dense {pol['dense']}"] if pol.get("dense") else []  # the dense pairs stored quantized
        how += [f"blocks of {pol['block']}"] if pol.get("block") else []  # structured blocks: one index per block
        return f"{pol['scorer']} ({', '.join(how)})"
    return "streaming" if pol.get("middle") == "drop" else "quantization"


def _frontier_figure(rows):
    """Per context (row order): each family's arms with bytes per token and Δ perplexity against the
    reference, sorted by (bytes, arm), families in the order of their first arm; only for a study
    with a scored selection."""
    if not any(isinstance(r.get("policy"), dict) and r["policy"].get("scorer") for r in rows):
        return None
    prefixes = _ordered([_context_of(r) for r in rows])
    contexts = []
    for prefix in prefixes:
        names, seg, refs = _context_arms(rows, prefix)
        if not refs:
            continue
        families: dict = {}
        for arm in names:
            fam = _family(next(iter(seg[arm].values())))
            p = None if fam is None else _versus_reference(arm, seg[arm], seg[refs[0]])
            if p is not None:
                families.setdefault(fam, []).append(p)
        contexts.append({"context": prefix[1:] if len(prefixes) > 1 else "",
                         "families": [{"family": f, "points": sorted(v, key=lambda x: (x["bytes_per_token"], x["arm"]))}
                                      for f, v in families.items()]})
    return {"contexts": contexts} if contexts else None


def _live_figure(rows, ctx):
    """One point per arm, or per (arm, context) where the study has several contexts (case ids
    ``c{n}-seg...``): labelled ``"arm @ n"``, the contexts in the order their rows come."""
    prefixes = _ordered([str(r["case"]).rpartition("-")[0] if "-" in str(r["case"]) else "" for r in rows])
    budgets = _equal_bytes_figure(rows)
    dims = _model_dims(rows[0])
    points, agreement = [], []
    for prefix in prefixes:
        sel = [r for r in rows if (str(r["case"]).rpartition("-")[0] if "-" in str(r["case"]) else "") == prefix]
        one = _live_points(sel, ctx, f" @ {prefix[1:]}" if len(prefixes) > 1 else "", dims)
        if one is None:
            return [("live_quality", None), ("equal_bytes", budgets and {"budgets": budgets}),
                    ("frontier", _frontier_figure(rows))]
        points += one[0]
        agreement += one[1]
    return [("live_quality", {"arms": points, "block": STEP_BLOCK, "agreement": agreement, "dims": dims}),
            ("equal_bytes", budgets and {"budgets": budgets}), ("frontier", _frontier_figure(rows))]


def _model_dims(row):
    """Layers, KV heads and head dimension of the study's model: the audit's own table for a model
    named there, else the row's ``model_dims`` (a model given by path); None where neither has all three."""
    dims = MODELS.get(row.get("model")) or row.get("model_dims")
    keys = ("layers", "kv_heads", "head_dim")
    if not isinstance(dims, dict) or any(type(dims.get(k)) is not int or dims[k] <= 0 for k in keys):
        return None
    return {k: dims[k] for k in keys}


def _live_points(rows, ctx, suffix: str, dims):
    """Per arm: the mean over segments of bytes per token, KL and top-1 agreement; bits per element,
    8 x bytes per token / (2 x layers x KV heads x head dim); Δ perplexity against the reference and
    its 95 % interval, the bootstrap of the mean per-segment NLL difference (``stats.bootstrap``,
    report.md's), both through 100 * (exp(x) - 1); the top-1 agreement curve per block of steps."""
    arms = _ordered([r["arm"] for r in rows])
    seg = {arm: {r["case"]: r for r in rows if r["arm"] == arm} for arm in arms}
    refs = [a for a in arms if next(iter(seg[a].values()))["kind"] == "reference"]
    if not refs:
        return None
    ref = seg[refs[0]]
    points, agreement = [], []
    for arm in arms:
        ids = sorted(seg[arm])
        rs = [seg[arm][s] for s in ids]
        kind = rs[0]["kind"]
        delta = ci = None
        if kind != "reference" and all(s in ref for s in ids):
            diffs = np.array([r["nll"] - ref[s]["nll"] for r, s in zip(rs, ids)], dtype=np.float64)
            delta = 100.0 * math.expm1(math.fsum(diffs) / len(ids))
            bounds = bootstrap(diffs)
            ci = None if bounds is None else [100.0 * math.expm1(b) for b in bounds]
        per_token = math.fsum(r["bytes_per_token"] for r in rs) / len(rs)
        top1 = [r.get("top1_agreement") for r in rs]
        points.append({"arm": arm + suffix, "kind": kind, "segments": ids, "bytes_per_token": per_token,
                       "mean_kl": math.fsum(r["mean_kl"] for r in rs) / len(rs), "delta_pct": delta, "delta_ci": ci,
                       "top1": None if None in top1 else math.fsum(top1) / len(top1),
                       "bits_per_element": None if dims is None
                       else 8.0 * per_token / (2 * dims["layers"] * dims["kv_heads"] * dims["head_dim"])})
        hits = np.stack([(ctx.load(seg[arm][s]["arrays"]["argmax"]) == ctx.load(ref[s]["arrays"]["argmax"])).astype(np.float64)
                         for s in ids if s in ref])
        per_step = hits.mean(axis=0)
        n_blocks = -(-per_step.size // STEP_BLOCK)
        agreement.append({"arm": arm + suffix, "values": [float(per_step[i * STEP_BLOCK:(i + 1) * STEP_BLOCK].mean())
                                                          for i in range(n_blocks)]})
    return points, agreement


def _retrieval_figure(rows, ctx):
    """Per task and arm: teacher-forced EM accuracy and trial counts on the depth x length grid; the
    rows of the question inside the compressed prefill as one more arm, ``<arm> (question inside)``."""
    rows = [r if r.get("question", "after") == "after" else {**r, "arm": f"{r['arm']} (question inside)"}
            for r in rows]
    maps = []
    for task in _ordered([r["task"] for r in rows]):
        sel = [r for r in rows if r["task"] == task]
        lengths = sorted(set(r["length"] for r in sel))
        depths = sorted(set(r["depth"] for r in sel))
        for arm in _ordered([r["arm"] for r in sel]):
            count = {(d, n): 0 for d in depths for n in lengths}
            hits = dict(count)
            for r in sel:
                if r["arm"] == arm:
                    count[(r["depth"], r["length"])] += 1
                    hits[(r["depth"], r["length"])] += int(r["tf_em"] == 1)
            maps.append({"task": task, "arm": arm, "lengths": lengths, "depths": depths,
                         "trials": [[count[(d, n)] for n in lengths] for d in depths],
                         "accuracy": [[hits[(d, n)] / count[(d, n)] if count[(d, n)] else None for n in lengths]
                                      for d in depths]})
    return [("retrieval_heatmap", maps and {"maps": maps})]


_BY_ANALYSIS = (("observation", _observation_figures), ("mx_paths", _mx_figure), ("ablation", _ablation_figure),
                ("residual_window", _residual_figure), ("live_quality", _live_figure),
                ("retrieval", _retrieval_figure))


def derive_figures(rows: list[dict], ctx) -> dict[str, dict]:
    """key -> the figure data the audit expects, from the rows (and the arrays ``ctx.load`` gives)."""
    out = {}
    for study in _ordered([r["study"] for r in rows]):
        for analysis, derive in _BY_ANALYSIS:
            sel = [r for r in rows if r["study"] == study and r.get("analysis") == analysis]
            if not sel:
                continue
            for kind, data in derive(sel, ctx):
                if data:
                    out[f"{kind}/{study}"] = {"key": f"{kind}/{study}", "kind": kind, "study": study, **data}
    return out


def first_difference(where: str, got, want):
    """Where ``got`` (embedded) and ``want`` (derived) first differ, or None."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{where or 'data'}: fields {sorted(got) if isinstance(got, dict) else type(got).__name__} != {sorted(want)}"
        for k in want:
            d = first_difference(f"{where}.{k}" if where else k, got[k], want[k])
            if d:
                return d
        return None
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"{where}: {len(got) if isinstance(got, list) else type(got).__name__} entries, audit derives {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            d = first_difference(f"{where}[{i}]", g, w)
            if d:
                return d
        return None
    number = (int, float)
    if isinstance(want, number) and not isinstance(want, bool):
        if isinstance(got, bool) or not isinstance(got, number) or not math.isfinite(got) \
                or abs(got - want) > ATOL + RTOL * abs(want):
            return f"{where}: embedded {got!r}, audit derives {want!r}"
        return None
    if got != want or type(got) is not type(want):
        return f"{where}: embedded {got!r}, audit derives {want!r}"
    return None

