"""Each figure's data, computed from the result rows and the arrays they name (`figure_data`):
the object drawn (`testbed.report_html.draw`) and embedded beside the image for the audit to
recompute (``testbed/audit_checks/report_html.py``)."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from ..live.summary import bootstrap
from ..policies.presets import EQUAL_BYTES_VERSUS, equal_bytes_budget, equal_bytes_versus
from ..sources.models import MODELS

__all__ = ["figure_data", "live_dims", "AGREEMENT_BLOCK", "REGIONS", "UNIFORM_REFERENCES", "is_oracle", "policy_family"]

REGIONS = ("sink", "middle", "recent", "current", "history")
AGREEMENT_BLOCK = 8  # teacher-forced steps per point of the top-1 agreement curve
_DIGITS = 9  # significant digits of the embedded figure data (the audit compares at rtol 1e-6)


def _dist(row):
    return row.get("distribution", row["case"])


def _unit(row) -> str:
    for key in ("prompt", "seed"):
        if row.get(key) is not None:
            return f"{key}={row[key]}"
    return f"case={row['case']}"


def _mean(xs):
    return float(np.mean(np.asarray(xs, dtype=np.float64)))


def _unit_means(rows, field):
    acc = defaultdict(list)
    for r in rows:
        if r.get(field) is not None:
            acc[_unit(r)].append(r[field])
    return {u: _mean(v) for u, v in acc.items()}


def _by_study(rows, analysis):
    out = defaultdict(list)
    for r in rows:
        if r.get("analysis") == analysis:
            out[r["study"]].append(r)
    return out


def _heatmaps(study, rows, load):
    panels = []
    cases = [r for r in rows if r.get("scope") == "case"]
    for dist in dict.fromkeys(_dist(r) for r in cases):
        sel = [r for r in cases if _dist(r) == dist]
        if any(r.get("heatmap") is None for r in sel) or len({np.shape(r["heatmap"]) for r in sel}) != 1:
            continue
        mean = np.mean([np.asarray(r["heatmap"], dtype=np.float64) for r in sel], axis=0)
        panels.append({"distribution": dist, "cases": [r["case"] for r in sel], "frame": sel[0]["frame"],
                       "mean": mean.tolist()})
    return {"panels": panels} if panels else None


def _support(study, rows, load):
    lines = []
    cases = [r for r in rows if r.get("scope") == "case" and "rows" in r.get("arrays", {})]
    for dist in dict.fromkeys(_dist(r) for r in cases):
        sel = [r for r in cases if _dist(r) == dist]
        vals = [np.asarray(load(r["arrays"]["rows"])[r["row_fields"].index("support")], np.float64).ravel() for r in sel]
        lines.append({"distribution": dist, "cases": [r["case"] for r in sel],
                      "support_sorted": np.sort(np.concatenate(vals)).tolist()})
    return {"lines": lines} if lines else None


def _regions(study, rows, load):
    groups = []
    cases = [r for r in rows if r.get("scope") == "case"]
    for dist in dict.fromkeys(_dist(r) for r in cases):
        sel = [r for r in cases if _dist(r) == dist]
        regions = {k: [r.get(f"{k}_mass") for r in sel] for k in REGIONS
                   if any(r.get(f"{k}_mass") is not None for r in sel)}
        groups.append({"distribution": dist, "cases": [r["case"] for r in sel], "regions": regions})
    return {"groups": groups} if groups else None


def _mx(study, rows, load):
    series = []
    for path, rotation, rule in dict.fromkeys((r["path"], r["rotation"], r["scale_rule"]) for r in rows):
        sel = [r for r in rows if (r["path"], r["rotation"], r["scale_rule"]) == (path, rotation, rule)]
        tv = np.concatenate([np.asarray(r["per_row"]["tv"], np.float64) for r in sel])
        series.append({"path": path, "rotation": rotation, "scale_rule": rule, "cases": [r["case"] for r in sel],
                       "tv_sorted": np.sort(tv).tolist()})
    p_rules = [r["scale_rule"] for r in rows if r["path"] == "p"]
    p = [r for r in rows if r["path"] == "p" and r["scale_rule"] == p_rules[0]] if p_rules else []
    p_data = None
    if p:
        sums = np.concatenate([np.asarray(r["per_row"]["row_sum"], np.float64) for r in p])
        p_data = {"cases": [r["case"] for r in p], "distributions": [_dist(r) for r in p],
                  "zero_rate_mean": [r["numerical_zero_rate_mean"] for r in p], "row_sum_sorted": np.sort(sums).tolist()}
    return {"series": series, "p": p_data} if series else None


def _ablation(study, rows, load):
    arm = rows[0]["arm"]
    names = list(dict.fromkeys(r["ablation"] for r in rows))
    pairs = []
    for dist in dict.fromkeys(_dist(r) for r in rows):
        sel = [r for r in rows if _dist(r) == dist and r["arm"] == arm and r["applicable"]]
        for ctrl in [n for n in names if n.startswith("control_")]:
            target = "drop_" + ctrl[len("control_"):]
            a = _unit_means([r for r in sel if r["ablation"] == target], "rel_l2")
            b = _unit_means([r for r in sel if r["ablation"] == ctrl], "rel_l2")
            units = sorted(set(a) & set(b))
            if units:
                pairs.append({"distribution": dist, "ablation": target, "control": ctrl, "units": units,
                              "ablation_rel_l2": [a[u] for u in units], "control_rel_l2": [b[u] for u in units]})
    return {"arm": arm, "pairs": pairs} if pairs else None


def _residual(study, rows, load):
    cells = []
    for dist in dict.fromkeys(_dist(r) for r in rows):
        for arm in dict.fromkeys(r["arm"] for r in rows):
            per = _unit_means([r for r in rows if _dist(r) == dist and r["arm"] == arm], "rel_l2")
            if per:
                units = sorted(per)
                cells.append({"distribution": dist, "arm": arm, "units": units, "rel_l2": [per[u] for u in units]})
    return {"cells": cells} if cells else None


def _context_groups(rows) -> list[tuple[str, list]]:
    """Rows per context of a live study (case ids ``c{n}-seg...``; one group, named "", without)."""
    groups: dict[str, list] = {}
    for r in rows:
        case = str(r["case"])
        groups.setdefault(case.rpartition("-")[0] if "-" in case else "", []).append(r)
    return list(groups.items())


def live_dims(row) -> dict | None:
    """The model dimensions bits per element divide by (``layers``, ``kv_heads``, ``head_dim``): the
    model table's for a model known by name, else the row's ``model_dims`` (a model given by path);
    None where neither states them."""
    dims = MODELS.get(row.get("model")) or row.get("model_dims")
    keys = ("layers", "kv_heads", "head_dim")
    if not isinstance(dims, dict) or not all(isinstance(dims.get(k), int) and dims[k] > 0 for k in keys):
        return None
    return {k: dims[k] for k in keys}


def _live(study, rows, load):
    """The live figure's data; with several contexts each arm is one point per context
    (``"int4 @ 2048"``). ``dims``: the model's layers, KV heads and head dimension, the K and V
    elements per token (2 x layers x KV heads x head dim) each arm's ``bits_per_element`` divides
    its measured bytes per token (x 8) by; None without them."""
    dims = live_dims(rows[0])
    groups = _context_groups(rows)
    arms, agreement = [], []
    for prefix, sel in groups:
        one = _live_context(sel, load, f" @ {prefix[1:]}" if len(groups) > 1 else "", dims)
        if one is None:
            return None
        arms += one[0]
        agreement += one[1]
    return {"arms": arms, "block": AGREEMENT_BLOCK, "agreement": agreement, "dims": dims}


def _optional_mean(segs, ids, field):
    vals = [segs[s].get(field) for s in ids]
    return None if any(v is None for v in vals) else _mean(vals)


def _live_context(rows, load, suffix: str, dims):
    by_arm: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_arm.setdefault(r["arm"], {})[r["case"]] = r
    ref = next((segs for segs in by_arm.values() if next(iter(segs.values()))["kind"] == "reference"), None)
    if ref is None:
        return None
    arms, agreement = [], []
    for arm, segs in by_arm.items():
        ids = sorted(segs)
        entry = {"arm": arm + suffix, "kind": segs[ids[0]]["kind"], "segments": ids,
                 "bytes_per_token": _mean([segs[s]["bytes_per_token"] for s in ids]),
                 "mean_kl": _mean([segs[s]["mean_kl"] for s in ids]), "delta_pct": None, "delta_ci": None,
                 "top1": _optional_mean(segs, ids, "top1_agreement"), "bits_per_element": None}
        if dims is not None:  # the measured bytes over the K and V elements a token adds
            entry["bits_per_element"] = entry["bytes_per_token"] * 8 / (2 * dims["layers"] * dims["kv_heads"]
                                                                        * dims["head_dim"])
        if entry["kind"] != "reference" and all(s in ref for s in ids):
            d = np.array([segs[s]["nll"] - ref[s]["nll"] for s in ids], dtype=np.float64)
            entry["delta_pct"] = 100.0 * math.expm1(_mean(d))
            lo, hi = bootstrap(d)  # report.md's interval: the same resamples of the same differences
            if not math.isnan(lo):
                entry["delta_ci"] = [100.0 * math.expm1(lo), 100.0 * math.expm1(hi)]
        arms.append(entry)
        same = np.mean([load(segs[s]["arrays"]["argmax"]) == load(ref[s]["arrays"]["argmax"]) for s in ids if s in ref],
                       axis=0)
        blocks = [float(np.mean(same[i:i + AGREEMENT_BLOCK])) for i in range(0, same.size, AGREEMENT_BLOCK)]
        agreement.append({"arm": arm + suffix, "values": blocks})
    return arms, agreement


UNIFORM_REFERENCES = ("int2", "int3", "int4")  # uniform arms drawn as further reference lines where present


def is_oracle(arm: str) -> bool:
    """An oracle arm (``*_oracle_*`` or ``*_oracle``): it decides from the whole segment's attention."""
    return "_oracle_" in arm or arm.endswith("_oracle")


def _delta_point(arm, segs, ref):
    """An arm's Δ perplexity against the reference (as the live figure's), None without every segment."""
    ids = sorted(segs)
    if not all(s in ref for s in ids):
        return None
    return {"arm": arm, "segments": ids, "bytes_per_token": _mean([segs[s]["bytes_per_token"] for s in ids]),
            "delta_pct": 100.0 * math.expm1(_mean([segs[s]["nll"] - ref[s]["nll"] for s in ids]))}


def _arms_of_context(sel):
    """One context's rows as ``{arm: {case: row}}`` (arms in row order) and the reference's segments
    (None without a reference)."""
    by_arm: dict[str, dict[str, dict]] = {}
    for r in sel:
        by_arm.setdefault(r["arm"], {})[r["case"]] = r
    ref = next((segs for segs in by_arm.values() if next(iter(segs.values()))["kind"] == "reference"), None)
    return by_arm, ref


def _equal_bytes(study, rows, load):
    """The equal-bytes figure's data: per context and byte budget (``mix28``, ``mix24``, ``int2_hh``),
    each arm that :func:`testbed.live.comparator` pairs with an arm of the run, its Δ perplexity
    against the reference (the live figure's ``delta_pct``), sorted by that value; the compared arm's
    and the other uniform int2 / int3 / int4 arms' Δ as reference lines. None without such an arm."""
    groups = _context_groups(rows)
    panels = []
    for prefix, sel in groups:
        by_arm, ref = _arms_of_context(sel)
        if ref is None:
            continue

        def point(arm, by_arm=by_arm, ref=ref):
            return _delta_point(arm, by_arm[arm], ref)

        for budget in EQUAL_BYTES_VERSUS:
            versus = equal_bytes_versus(budget, by_arm)
            if versus is None:
                continue
            arms = [point(a) for a in by_arm if equal_bytes_budget(a) == budget and a != versus]
            arms = sorted((p for p in arms if p is not None), key=lambda p: (p["delta_pct"], p["arm"]))
            vs = point(versus)
            if not arms or vs is None:
                continue
            for p in arms:
                p["oracle"] = is_oracle(p["arm"])
            uniform = [u for u in (point(a) for a in UNIFORM_REFERENCES if a in by_arm and a != versus) if u]
            panels.append({"context": prefix[1:] if len(groups) > 1 else "", "budget": budget, "versus": vs,
                           "uniform": uniform, "arms": arms})
    return {"budgets": panels} if panels else None


def policy_family(row) -> str | None:
    """The family a live row's arm belongs to on the frontier figure: ``"quanto"`` (a peer), the
    scorer (``"knorm"``, ``"snapkv (prefill)"``, ``"snapkv (prefill, pyramid, adaptive)"``: a scored
    selection, how it decides and its per-layer and per-head schedules; ``"snapkv (prefill, selective
    random)"``: the selective rule and how its pairs are chosen; ``"snapkv (prefill, blocks of 16)"``),
    ``"streaming"`` (a sink and the newest tokens), ``"quantization"`` (a quantized middle); None for
    the reference and a float32 cache."""
    if row["kind"] == "peer":
        return "quanto"
    pol = row.get("policy") if row["kind"] == "policy" else None
    if not pol or pol["middle"] == "float32":
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
    return "streaming" if pol["middle"] == "drop" else "quantization"


def _frontier(study, rows, load):
    """The frontier figure's data, for a study with a scored selection: per context, each family's
    arms (:func:`policy_family`) with their bytes per token and Δ perplexity (the live figure's),
    sorted by (bytes, name); families in the order their arms first come. None without a scorer."""
    if not any((r.get("policy") or {}).get("scorer") for r in rows):
        return None
    groups = _context_groups(rows)
    contexts = []
    for prefix, sel in groups:
        by_arm, ref = _arms_of_context(sel)
        if ref is None:
            continue
        families: dict[str, list] = {}
        for arm, segs in by_arm.items():
            fam = policy_family(next(iter(segs.values())))
            pt = None if fam is None else _delta_point(arm, segs, ref)
            if pt is not None:
                families.setdefault(fam, []).append(pt)
        contexts.append({"context": prefix[1:] if len(groups) > 1 else "",
                         "families": [{"family": f, "points": sorted(p, key=lambda x: (x["bytes_per_token"], x["arm"]))}
                                      for f, p in families.items()]})
    return {"contexts": contexts} if contexts else None


def _retrieval(study, rows, load):
    # a row of the question inside the compressed prefill is its own map: "<arm> (question inside)"
    rows = [r if r.get("question", "after") == "after" else {**r, "arm": f"{r['arm']} (question inside)"}
            for r in rows]
    maps = []
    for task in dict.fromkeys(r["task"] for r in rows):
        sel = [r for r in rows if r["task"] == task]
        lengths = sorted({r["length"] for r in sel})
        depths = sorted({r["depth"] for r in sel})
        for arm in dict.fromkeys(r["arm"] for r in sel):
            trials, acc = [], []
            for d in depths:
                cell = [[r["tf_em"] for r in sel if r["arm"] == arm and r["depth"] == d and r["length"] == n]
                        for n in lengths]
                trials.append([len(c) for c in cell])
                acc.append([sum(c) / len(c) if c else None for c in cell])
            maps.append({"task": task, "arm": arm, "lengths": lengths, "depths": depths, "trials": trials,
                         "accuracy": acc})
    return {"maps": maps} if maps else None



# (kind, analysis, builder), in the order figures appear within a study
_BUILDERS = (("heatmap", "observation", _heatmaps), ("support_ecdf", "observation", _support),
             ("region_mass", "observation", _regions), ("mx_paths", "mx_paths", _mx),
             ("ablation_pairs", "ablation", _ablation), ("residual_window", "residual_window", _residual),
             ("live_quality", "live_quality", _live), ("equal_bytes", "live_quality", _equal_bytes),
             ("frontier", "live_quality", _frontier),
             ("retrieval_heatmap", "retrieval", _retrieval))


def _rounded(x):
    if isinstance(x, float):
        return x if not math.isfinite(x) or x == 0 else float(f"{x:.{_DIGITS}g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def figure_data(rows: list[dict], load) -> list[dict]:
    """Every figure's data, in report order: ``{"key": "KIND/STUDY", "kind", "study", ...}``.

    ``load(rel)`` returns the stored array ``rel`` of the run."""
    studies = list(dict.fromkeys(r["study"] for r in rows))
    out = []
    for study in studies:
        for kind, analysis, build in _BUILDERS:
            sel = _by_study(rows, analysis).get(study)
            data = build(study, sel, load) if sel else None
            if data is not None:
                out.append(_rounded({"key": f"{kind}/{study}", "kind": kind, "study": study, **data}))
    return out

