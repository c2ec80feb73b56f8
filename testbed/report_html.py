"""report.html: the run's figures, one self-contained file (inline PNGs, no script, no outside request).

Each figure is drawn from a *figure data* object computed here from the result rows (and the
arrays they name, already stored in the run): the same object is embedded beside the image as a
JSON data block (``<script type="application/json" id="figdata-N">``, which a browser never
executes), so that ``testbed.audit`` can recompute it from ``results.json`` with its own code and
compare (``testbed/audit_checks/report_html.py``). Units of every statistic are seeds, prompts or
segments (a case's rows are summarized first); row-level curves (ECDFs) say so in their caption.

matplotlib (Agg) is imported only when a report is built.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from .evidence import load_array
from .policies.presets import EQUAL_BYTES_VERSUS, equal_bytes_budget, equal_bytes_versus

__all__ = ["build_html", "figure_data", "figure_layout", "CSP", "AGREEMENT_BLOCK"]

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
REGIONS = ("sink", "middle", "recent", "current", "history")
AGREEMENT_BLOCK = 8  # teacher-forced steps per point of the top-1 agreement curve
_DIGITS = 9  # significant digits of the embedded figure data (the audit compares at rtol 1e-6)

_CAPTIONS = {
    "heatmap": ("Temporal attention heatmap per {dist_word}: query block (rows) x key block (columns), each row's "
                "mass summing to 1, the mean over the cases (seeds or prompts) and heads of each case's heatmap. "
                "What it does not show: the spread between cases or heads (a mean can hide opposite patterns), "
                "single queries, or anything about a quantized cache (this is the float64 reference attention)."),
    "support_ecdf": ("Empirical CDF of effective support (exp(entropy) / visible keys) over every query-head row, "
                     "pooled over the cases of each {dist_word}; low support = concentrated attention. What it does "
                     "not show: independent samples. Rows within one seed or prompt are not independent, so the curve "
                     "describes rows and is no confidence band; cases are not weighted separately."),
    "region_mass": ("Attention mass of the float64 reference in each key region: bars are the mean over cases of each "
                    "case's mean, dots one case (seed, or prompt x layer). History is every cached key (it contains "
                    "sink, middle and recent), so bars do not sum to 1; a missing bar is a region the layout lacks. "
                    "What it does not show: per-head differences, or whether the mass matters for the output (see the "
                    "ablation figure)."),
    "mx_paths": ("MXFP8 (E4M3, blocks of 32) against the float64 reference: ECDF of the total-variation distance per "
                 "softmax row on the Q/K path without and with the signed Hadamard rotation, and on the P path, for "
                 "each block-scale rule of the protocol (FLOOR, the OCP rule; RCEIL, the smallest scale that needs no "
                 "clamping); the P path's strict-zero rate per case and its row sums (ECDF over rows, 1 = a proper "
                 "distribution), for the protocol's first scale rule. "
                 "What it does not show: independent samples (rows within a case are not independent), other element "
                 "formats or block sizes, or the effect on model quality."),
    "ablation_pairs": ("Each ablation against its same-size seeded control on the float32 cache: attention-output "
                       "relative L2 against the float64 full attention, one line per unit (seed or prompt; the cases "
                       "of one unit, e.g. layers, averaged first) joining the ablation (left) and its control (right), "
                       "per {dist_word}. What it does not show: the quantized arms or a significance test (report.md "
                       "has the Wilcoxon signed-rank test over these units); few units per panel."),
    "residual_window": ("Attention-output relative L2 against the float64 reference per arm (float32, 4-bit with the "
                        "R most recent tokens kept float32, or the first tokens instead), per distribution: one dot per "
                        "seed (its lengths averaged), the bar the median over seeds. What it does not show: other bit "
                        "widths or group sizes, model quality; synthetic attention only."),
    "live_quality": ("Live quality study: left, perplexity change against the DynamicCache reference (exp of the mean "
                     "per-segment NLL difference, minus 1) and right, mean KL(reference || arm), both against the "
                     "cache's bytes per token at the end of a segment (mean over segments), one point per arm; below, "
                     "top-1 agreement with the reference's argmax per block of {block} teacher-forced steps (mean over "
                     "segments). What it does not show: free generation or task accuracy (teacher forcing), other models "
                     "(one small model, SmolLM2-135M), other text (one corpus), or an interval: {segments} segments."),
    "equal_bytes": ("Content-aware precision at equal bytes: one panel per byte budget (mix28_*: the bytes of int4; "
                    "mix24_*: a 3-bit layout's bytes; int2_hh*: int2's bytes, heavy hitters kept float32), its arms "
                    "sorted by the perplexity change against the DynamicCache reference (exp of the mean per-segment NLL "
                    "difference, minus 1: the live table's Δ; lower is better). The solid line is the arm of the same "
                    "bytes each is compared with (uniform int4, int3 or int2; mix24_random, the content-blind allocation, "
                    "where the run has no int3); dashed lines are the other uniform int2, int3 and int4 arms the run has. "
                    "Hollow markers are the oracle arms (*_oracle*), which choose from the whole segment's float32 attention: "
                    "impossible online, an upper bound for the online rule, not a policy. What it does not show: the "
                    "paired difference against the compared arm or its interval (report.md's equal-bytes table has both), "
                    "free generation or task accuracy (teacher forcing), other models (one small model, SmolLM2-135M), "
                    "other text (one corpus), or an interval: {segments} segments."),
    "frontier": ("What a byte of cache buys: the perplexity change against the DynamicCache reference (exp of the "
                 "mean per-segment NLL difference, minus 1) against the cache's bytes per token at the end of a segment "
                 "(mean over segments), one curve per family of policy (quantization: the grouped-int and MX presets; "
                 "quanto; streaming: a sink and the newest tokens; each scorer, online or compressing the prefill "
                 "once), one panel per context; lower and further left is better. What it does not show: retrieval "
                 "(the retrieval study), intervals or paired tests, free generation (teacher forcing), other models "
                 "(one small model, SmolLM2-135M), or other text (one corpus): {segments} segments."),
    "retrieval_heatmap": ("Needle retrieval: teacher-forced exact-match accuracy per needle depth (rows, 0 = the "
                          "haystack's start) and prefill length (columns), one panel per task and arm; each cell is "
                          "the share of its trials whose every answer token was the model's argmax (the number of "
                          "trials per cell is in the embedded data). What it does not show: intervals (report.md has "
                          "the Wilson intervals per length and the McNemar tests against the reference), other models "
                          "(one small model, SmolLM2-135M), or natural tasks (synthetic needles)."),
}


# ---------------------------------------------------------------------------------------------
# figure data (what the audit recomputes)
# ---------------------------------------------------------------------------------------------

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


def _live(study, rows, load):
    """The live figure's data; with several contexts each arm is one point per context
    (``"int4 @ 2048"``)."""
    groups = _context_groups(rows)
    arms, agreement = [], []
    for prefix, sel in groups:
        one = _live_context(sel, load, f" @ {prefix[1:]}" if len(groups) > 1 else "")
        if one is None:
            return None
        arms += one[0]
        agreement += one[1]
    return {"arms": arms, "block": AGREEMENT_BLOCK, "agreement": agreement}


def _live_context(rows, load, suffix: str):
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
                 "mean_kl": _mean([segs[s]["mean_kl"] for s in ids]), "delta_pct": None}
        if entry["kind"] != "reference" and all(s in ref for s in ids):
            d = [segs[s]["nll"] - ref[s]["nll"] for s in ids]
            entry["delta_pct"] = 100.0 * math.expm1(_mean(d))
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
    selection, how it decides and its per-layer and per-head schedules),
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


def _draw_retrieval(plt, d):
    n = len(d["maps"])
    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(min(2.8 * cols, _MAX_W), 2.5 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, m in zip(axes.flat, d["maps"]):
        acc = np.asarray([[np.nan if v is None else v for v in row] for row in m["accuracy"]], dtype=float)
        ax.imshow(acc, aspect="auto", cmap="viridis", vmin=0, vmax=1)
        for (i, j), v in np.ndenumerate(acc):  # the accuracy written in its cell: no colour scale to read
            if np.isfinite(v):
                ax.text(j, i, f"{v:.2g}", ha="center", va="center", color="black" if v > 0.5 else "white")
        ax.set_title(f"{m['task']}: {m['arm']}")
        ax.set_xticks(range(len(m["lengths"])), [str(x) for x in m["lengths"]])
        ax.set_yticks(range(len(m["depths"])), [f"{x:g}" for x in m["depths"]])
        ax.set_xlabel("prefill tokens")
        ax.set_ylabel("needle depth")
    return fig


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


# ---------------------------------------------------------------------------------------------
# drawing
# ---------------------------------------------------------------------------------------------

# The page shows a figure at its native width up to the body's content width (``_STYLE``: max-width
# 70em at the browser's 16 px = 1120 px, which a 1400 px window gives in full), so a figure is drawn
# at most that wide, at a dpi where every font (8.5 pt or more: ``_RC``) is at least 11 px there.
PAGE_PX = 1120
DPI = 100
MIN_TEXT_PX = 11
_MAX_W = PAGE_PX / DPI  # inches
_RC = {"font.size": 9, "axes.titlesize": 9.5, "axes.labelsize": 9, "xtick.labelsize": 8.5, "ytick.labelsize": 8.5,
       "legend.fontsize": 8.5, "figure.titlesize": 10.5, "figure.dpi": DPI, "savefig.dpi": DPI,
       "figure.autolayout": True,  # tight layout: half the time of constrained
       "text.antialiased": False}  # crisp glyphs: half the PNG bytes of smoothed ones, as legible at 1:1


def _log(ax, which: str = "y"):
    """A log scale without minor ticks (their labels are most of a figure's drawing time), called
    after the data are drawn: when fewer than two powers of ten lie in view, the ticks are 1, 2 and
    5 times a power of ten (or every integer multiple) with plain labels, so that two carry a label."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    axis.set_minor_locator(NullLocator())
    lo, hi = sorted(getattr(ax, f"get_{which}lim")())
    for subs in ((1.0,), (1.0, 2.0, 5.0), tuple(range(1, 10))):
        locator = LogLocator(base=10, subs=subs)
        if sum(lo <= t <= hi for t in locator.tick_values(lo, hi)) >= 2:
            break
    if subs != (1.0,):
        axis.set_major_locator(locator)
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _legend_right(ax, **kw):
    """A legend beside the axes (never over the data)."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kw)


def _legend_below(ax, **kw):
    """A legend under the axes, below its tick labels and x label (never over the data)."""
    return ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), borderaxespad=4.2, **kw)


def _ecdf(ax, x, **kw):
    x = np.asarray(x, dtype=float)
    return ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", **kw)


def _draw_heatmap(plt, d):
    n = len(d["panels"])
    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(min(2.7 * cols + 0.6, _MAX_W), 3.2 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, p in zip(axes.flat, d["panels"]):
        im = ax.imshow(np.asarray(p["mean"]), aspect="auto", cmap="viridis", vmin=0)
        ax.set_title(f"{p['distribution']} ({len(p['cases'])} cases)")
        ax.set_xlabel(f"key block ({p['frame']} tokens)")
        ax.set_ylabel("query block")
        ax.set_yticks(range(len(p["mean"])))
        fig.colorbar(im, ax=ax, fraction=0.05, label="attention mass" if ax is axes.flat[n - 1] else None)
    return fig


def _draw_support(plt, d):
    fig, ax = plt.subplots(figsize=(7.6, 3.4))
    for line in d["lines"]:
        _ecdf(ax, line["support_sorted"],
              label=f"{line['distribution']} ({len(line['cases'])} cases, {len(line['support_sorted'])} rows)")
    ax.set_xlabel("effective support (share of visible keys)")
    ax.set_ylabel("share of rows <= x")
    ax.set_xlim(0, 1)
    _legend_right(ax)
    return fig


def _draw_regions(plt, d):
    fig, ax = plt.subplots(figsize=(max(4.0, min(1.6 * len(d["groups"]) + 2.4, _MAX_W)), 3.4))
    width = 0.8 / len(REGIONS)
    labelled = set()
    for gi, g in enumerate(d["groups"]):
        for ri, reg in enumerate(REGIONS):
            vals = [v for v in g["regions"].get(reg, []) if v is not None]
            if not vals:
                continue
            x = gi + (ri - (len(REGIONS) - 1) / 2) * width
            ax.bar(x, np.mean(vals), width * 0.9, color=f"C{ri}")
            labelled.add(reg)
            ax.plot([x] * len(vals), vals, "k.", ms=4)
    for ri, reg in enumerate(REGIONS):  # legend in region order, whichever group has the region first
        if reg in labelled:
            ax.bar([0], [0], 0, color=f"C{ri}", label=f"{reg} (mean)")
    ax.plot([], [], "k.", ms=4, label="one case")
    ax.set_xticks(range(len(d["groups"])), [g["distribution"] for g in d["groups"]])
    ax.set_ylabel("attention mass")
    ax.set_ylim(0, 1)
    _legend_right(ax)
    return fig


def _draw_mx(plt, d):
    fig, axes = plt.subplots(2, 2, figsize=(_MAX_W, 6.6), height_ratios=[1.25, 1])
    (qk, pp), (zeros, sums) = axes
    styles = {}
    for s in d["series"]:
        ax = pp if s["path"] == "p" else qk
        style = styles.setdefault((s["rotation"], s["scale_rule"]), f"C{len(styles)}")
        _ecdf(ax, s["tv_sorted"], color=style, label=f"rotation {s['rotation']}, {s['scale_rule']}")
    for ax, path in ((qk, "Q/K"), (pp, "P")):
        if not ax.lines:
            ax.axis("off")
            continue
        ax.set_title(f"{path} path: TV distance per row")
        _log(ax, "x")
        ax.set_xlabel("TV distance per row")
        ax.set_ylabel("share of rows <= x")
        _legend_below(ax, ncol=2)
    p = d["p"]
    if not p:
        zeros.axis("off")
        sums.axis("off")
        return fig
    dists = list(dict.fromkeys(p["distributions"]))
    rates = [100 * z for z in p["zero_rate_mean"]]
    zeros.set_title("P path strict zeros, one dot per case")
    if all(r == 0 for r in rates):
        zeros.axis("off")
        zeros.text(0.5, 0.5, f"all zero: no strict zero in any of the {len(rates)} cases\n({', '.join(dists)})",
                   ha="center", va="center", transform=zeros.transAxes, wrap=True)
    else:
        zeros.plot([dists.index(t) for t in p["distributions"]], rates, "o", ms=5)
        zeros.set_xticks(range(len(dists)), dists)
        zeros.set_xlim(-0.5, len(dists) - 0.5)
        zeros.set_ylabel("% of entries")
    _ecdf(sums, p["row_sum_sorted"])
    sums.axvline(1.0, color="grey", lw=0.8)
    sums.set_title("P path row sums (1 = a proper distribution)")
    sums.set_xlabel("row sum")
    sums.set_ylabel("share of rows <= x")
    return fig


def _draw_ablation(plt, d):
    kinds = list(dict.fromkeys(p["ablation"] for p in d["pairs"]))
    fig, axes = plt.subplots(1, len(kinds), figsize=(min(5.2 * len(kinds), _MAX_W), 3.6), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        sel = [p for p in d["pairs"] if p["ablation"] == kind]
        for i, p in enumerate(sel):
            for a, b in zip(p["ablation_rel_l2"], p["control_rel_l2"]):
                ax.plot([3 * i, 3 * i + 1], [a, b], "-o", color=f"C{i}", ms=4, lw=0.8)
        ax.set_xticks([3 * i + 0.5 for i in range(len(sel))], [p["distribution"] for p in sel])
        ax.set_xlim(-0.6, 3 * len(sel) - 1.4)
        ax.set_title(f"{kind} (left) vs {sel[0]['control']} (right)")
        ax.set_ylabel("output rel-L2")
        if all(v > 0 for p in sel for v in p["ablation_rel_l2"] + p["control_rel_l2"]):
            _log(ax)
    return fig


def _draw_residual(plt, d):
    dists = list(dict.fromkeys(c["distribution"] for c in d["cells"]))
    arms = list(dict.fromkeys(c["arm"] for c in d["cells"]))
    fig, ax = plt.subplots(figsize=(min(1.2 * len(arms) + 3.0, _MAX_W), 3.6))
    width = 0.8 / len(dists)
    for di, dist in enumerate(dists):
        for c in [c for c in d["cells"] if c["distribution"] == dist]:
            x = arms.index(c["arm"]) + (di - (len(dists) - 1) / 2) * width
            ax.bar(x, float(np.median(c["rel_l2"])), width * 0.9, color=f"C{di}", alpha=0.5,
                   label=f"{dist} (median)" if c["arm"] == arms[0] else None)
            ax.plot([x] * len(c["rel_l2"]), c["rel_l2"], "k.", ms=4)
    ax.plot([], [], "k.", ms=4, label="one seed")
    ax.set_xticks(range(len(arms)), arms)
    _log(ax)
    ax.set_ylabel("output rel-L2")
    _legend_right(ax)
    return fig


def _place_labels(ax, points, labels, colors):
    """Label each point (display-free data coordinates) without overlap: beside the marker if that
    spot is free, else at the nearest free spot on rings around it with a leader line; labels stay
    inside the axes; a leader line has its point's colour. Call after the axes' limits and the
    figure's layout are final."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    px = fig.dpi / 72.0
    xy = ax.transData.transform(np.asarray(points, dtype=float))
    marker = 5.0 * px  # half a marker, pixels
    taken = [(x - marker, y - marker, x + marker, y + marker) for x, y in xy]
    sizes = []
    for text in labels:
        t = ax.text(0, 0, text)
        e = t.get_window_extent(renderer)
        sizes.append((e.width, e.height))
        t.remove()

    def free(b):
        return (b[0] >= box.x0 + 2 and b[2] <= box.x1 - 2 and b[1] >= box.y0 + 2 and b[3] <= box.y1 - 2
                and not any(b[0] < o[2] and o[0] < b[2] and b[1] < o[3] and o[1] < b[3] for o in taken))

    gap = 1.5 * px
    for i in np.argsort(xy[:, 0], kind="stable"):
        (x, y), (w, h) = xy[i], sizes[i]
        near = [((marker + gap, 0), "left", "center"), ((-marker - gap, 0), "right", "center"),
                ((0, marker + gap), "center", "bottom"), ((0, -marker - gap), "center", "top")]
        rings = [((r * math.cos(a), r * math.sin(a)), "center", "center")
                 for r in (20, 30, 42, 56, 72, 90, 110, 135, 165, 200) for a in np.radians(np.arange(0, 360, 22.5))]
        best = None
        for (dx, dy), ha, va in near + [((dx * px, dy * px), ha, va) for (dx, dy), ha, va in rings]:
            x0 = x + dx - {"left": 0, "center": w / 2, "right": w}[ha]
            y0 = y + dy - {"bottom": 0, "center": h / 2, "top": h}[va]
            b = (x0, y0, x0 + w, y0 + h)
            if free(b):
                best = (dx, dy, ha, va, b)
                break
        if best is None:  # nowhere free: beside the marker (the test on overlaps will say so)
            best = (marker + gap, 0, "left", "center", (x + marker + gap, y - h / 2, x + marker + gap + w, y + h / 2))
        dx, dy, ha, va, b = best
        far = math.hypot(dx, dy) > marker + gap + 0.5
        ax.annotate(labels[i], tuple(points[i]), xytext=(dx / px, dy / px), textcoords="offset points", ha=ha, va=va,
                    arrowprops={"arrowstyle": "-", "color": colors[i], "lw": 1.0, "shrinkA": 0, "shrinkB": 3}
                    if far else None, gid="data-label")
        taken.append(b)


def _draw_live(plt, d):
    """Quality against bytes (each point labelled with its arm; the marker's shape is the context
    when there are several), and top-1 agreement along the steps in one small panel per arm."""
    base = [e["arm"].rpartition(" @ ")[0] or e["arm"] for e in d["arms"]]
    contexts = list(dict.fromkeys(e["arm"].rpartition(" @ ")[2] for e in d["arms"] if " @ " in e["arm"]))
    names = list(dict.fromkeys(base))
    cmap = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    color = {n: cmap(i % cmap.N) for i, n in enumerate(names)}
    shapes, dashes = "osD^v<>p", ("-", "--", ":", "-.")

    def context(arm):
        return contexts.index(arm.rpartition(" @ ")[2]) if " @ " in arm else 0

    def shape(arm):
        return shapes[context(arm) % len(shapes)]

    cols = 5
    rows = -(-len(names) // cols)
    fig = plt.figure(figsize=(_MAX_W, 4.4 + 1.4 * rows))
    gs = fig.add_gridspec(1 + rows, 2 * cols, height_ratios=[3.6] + [1.15] * rows)
    a1, a2 = fig.add_subplot(gs[0, :cols]), fig.add_subplot(gs[0, cols:])
    pts = {a1: [], a2: []}
    for e, b in zip(d["arms"], base):
        for ax, y in ((a1, e["delta_pct"]), (a2, e["mean_kl"])):
            if y is not None:
                ax.plot(e["bytes_per_token"], y, shape(e["arm"]), color=color[b], ms=6)
                pts[ax].append(((e["bytes_per_token"], y), b, color[b]))
    for ax, label, lin in ((a1, "perplexity change vs reference (%)", 0.1), (a2, "mean KL (nats / token)", 1e-3)):
        ax.set_xlabel("bytes per token")
        ax.set_ylabel(label)
        ax.set_yscale("symlog", linthresh=lin)
        ax.margins(x=0.12, y=0.12)
        _log(ax, "x")
    for i, c in enumerate(contexts):
        a2.plot([], [], dashes[i % len(dashes)] + shapes[i % len(shapes)], color="0.3", label=f"{c} tokens")
    if contexts:
        _legend_right(a2, title="context")
    small = []
    for k, name in enumerate(names):
        ax = fig.add_subplot(gs[1 + k // cols, 2 * (k % cols):2 * (k % cols) + 2],
                             sharex=small[0] if small else None, sharey=small[0] if small else None)
        small.append(ax)
        for e in d["agreement"]:
            if (e["arm"].rpartition(" @ ")[0] or e["arm"]) == name:
                x = np.arange(len(e["values"])) * d["block"] + d["block"] / 2
                ax.plot(x, e["values"], dashes[context(e["arm"]) % len(dashes)] + shape(e["arm"]), color=color[name],
                        lw=1, ms=3)
        ax.set_title(name, color="black")
        ax.set_ylim(-0.05, 1.05)
        ax.set_yticks([0, 0.5, 1])
        if k % cols:
            ax.tick_params(labelleft=False)
        else:
            ax.set_ylabel("top-1 agr.")
        if k < len(names) - cols:
            ax.tick_params(labelbottom=False)
        else:
            ax.set_xlabel(f"step (blocks of {d['block']})")
    _title(fig, d)
    fig.canvas.draw()  # the layout, then labels placed in it, then no more layout
    fig.set_layout_engine("none")
    for ax in (a1, a2):
        if pts[ax]:
            _place_labels(ax, *zip(*pts[ax]))
    return fig


def _rule(arm: str) -> str:
    """The rule an equal-bytes arm stands for, one colour across budgets and with its oracle:
    ``mix28_oracle_diffuse`` -> ``diffuse``, ``int2_hh_oracle`` -> ``int2_hh``."""
    r = arm.replace("_oracle_", "_").removesuffix("_oracle")
    return r.split("_", 1)[1] if r.startswith("mix") else r


def _draw_equal_bytes(plt, d):
    """One panel per (context and) byte budget: the arms on the y axis, named there, sorted by Δ
    perplexity (best on top); the compared arm a solid line, the other uniform int2 / int3 / int4
    arms dashed lines, oracle arms hollow. The x axis is logarithmic when every Δ is positive (+0.3 % and +20 % both
    read), else symlog (linear within ±0.1 %)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator, SymmetricalLogLocator

    panels = d["budgets"]
    cols = min(len(panels), 2)
    rows = -(-len(panels) // cols)
    n_max = max(len(p["arms"]) for p in panels)
    fig, axes = plt.subplots(rows, cols, figsize=(_MAX_W, rows * (0.34 * n_max + 1.3) + 0.7), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    rules = list(dict.fromkeys(_rule(e["arm"]) for p in panels for e in p["arms"]))
    color = {r: f"C{i % 10}" for i, r in enumerate(rules)}
    styles = {"int2": (0, (5, 2)), "int3": (0, (4, 1, 1, 1)), "int4": (0, (2, 2))}
    values = [v for p in panels for v in [e["delta_pct"] for e in p["arms"] + p["uniform"]] + [p["versus"]["delta_pct"]]]
    lo, hi = min(values), max(values)
    span = math.log10(max(hi, 0.2) / (lo if lo > 0 else 0.1)) + 0.4  # decades in view (with the margins)
    subs = (1.0, 2.0, 5.0) if span < 2.2 else (1.0, 3.0) if span < 3.5 else (1.0,)  # labels that stay apart
    for ax, p in zip(axes.flat, panels):
        n = len(p["arms"])
        y = np.arange(n)[::-1]  # best (lowest Δ) on top
        ax.axvline(p["versus"]["delta_pct"], color="black", lw=1.4, zorder=1)
        for u in p["uniform"]:
            ax.axvline(u["delta_pct"], color="0.45", lw=1.1, ls=styles.get(u["arm"], ":"), zorder=1)
        for yi, e in zip(y, p["arms"]):
            c = color[_rule(e["arm"])]
            ax.plot([p["versus"]["delta_pct"], e["delta_pct"]], [yi, yi], "-", color=c, lw=1.0, alpha=0.6, zorder=2)
            ax.plot(e["delta_pct"], yi, "o", ms=7, mew=1.6, color=c, mfc="white" if e["oracle"] else c, zorder=3)
        ax.set_yticks(y, [e["arm"] for e in p["arms"]])
        ax.set_ylim(-0.7, n_max - 0.3)
        if lo > 0:  # every arm worse than the reference: a log axis, no room spent on 0
            ax.set_xscale("log")
            ax.set_xlim(lo / 1.6, hi * 1.6)
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
        else:
            ax.set_xscale("symlog", linthresh=0.1, linscale=0.5)
            ax.set_xlim(min(lo * 1.6, -0.05), max(hi * 1.6, 0.2))
            ax.xaxis.set_major_locator(SymmetricalLogLocator(base=10, linthresh=0.1, subs=subs))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:+g}" if v else "0"))
        ax.grid(axis="x", color="0.9", lw=0.6, zorder=0)
        ax.set_xlabel(f"Δ perplexity vs DynamicCache (%, {'log' if lo > 0 else 'symlog'} scale)")
        where = f" @ {p['context']} tokens" if p["context"] else ""
        star = "_*" if p["budget"].startswith("mix") else "*"
        ax.set_title(f"{p['budget']}{star}{where}: {p['versus']['bytes_per_token']:,.0f} B/token, vs {p['versus']['arm']}")
    compared = " / ".join(dict.fromkeys(p["versus"]["arm"] for p in panels))
    handles = [Line2D([], [], color="black", lw=1.4, label=f"compared arm ({compared})")]
    for u in dict.fromkeys(u["arm"] for p in panels for u in p["uniform"]):
        handles.append(Line2D([], [], color="0.45", lw=1.1, ls=styles.get(u, ":"), label=f"uniform {u}"))
    handles += [Line2D([], [], ls="", marker="o", ms=7, color="0.3", label="online rule"),
                Line2D([], [], ls="", marker="o", ms=7, mew=1.6, color="0.3", mfc="white",
                       label="oracle (impossible online)")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    _title(fig, d)
    fig.tight_layout(rect=(0, 0.06 / rows, 1, 1))
    fig.set_layout_engine("none")
    return fig


def _draw_frontier(plt, d):
    """One panel per context: Δ perplexity against bytes per token, one line per family."""
    n = len(d["contexts"])
    fig, axes = plt.subplots(1, n, figsize=(_MAX_W, 4.6), squeeze=False)
    names = list(dict.fromkeys(f["family"] for c in d["contexts"] for f in c["families"]))
    cmap = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    shapes = "osD^v<>ph*"
    for ax, c in zip(axes[0], d["contexts"]):
        for f in c["families"]:
            i = names.index(f["family"])
            ax.plot([p["bytes_per_token"] for p in f["points"]], [p["delta_pct"] for p in f["points"]],
                    "-" + shapes[i % len(shapes)], color=cmap(i % cmap.N), lw=1.2, ms=5, label=f["family"])
        ax.set_xlabel("bytes per token")
        ax.set_ylabel("perplexity change vs reference (%)")
        ax.set_yscale("symlog", linthresh=0.1)
        _log(ax, "x")
        if c["context"]:
            ax.set_title(f"{c['context']} tokens")
    _legend_right(axes[0][-1], title="family")
    return fig


_DRAW = {"frontier": _draw_frontier,
         "heatmap": _draw_heatmap, "support_ecdf": _draw_support, "region_mass": _draw_regions, "mx_paths": _draw_mx,
         "ablation_pairs": _draw_ablation, "residual_window": _draw_residual, "live_quality": _draw_live,
         "equal_bytes": _draw_equal_bytes, "retrieval_heatmap": _draw_retrieval}


def _title(fig, d):
    fig.suptitle(f"{d['study']}: {d['kind'].replace('_', ' ')}")


def _figure(plt, d):
    fig = _DRAW[d["kind"]](plt, d)
    _title(fig, d)
    return fig


def figure_layout(d) -> dict:
    """Draw figure ``d`` as the report does and say where its text and panels lie, in pixels of the
    PNG (drawing is deterministic): ``{"size": (w, h), "dpi", "texts": [{"text", "role", "size_pt",
    "bbox": (x0, y0, x1, y1)}], "legends": [bbox], "axes": [bbox of each visible panel], "log_axes":
    [(panel, "x" or "y", labelled ticks in view)], "all_zero_axes": [panel whose lines are all 0]}``.
    A text's role is ``"label"`` (a point's label), ``"legend"``, ``"tick"`` or ``"text"``; only
    texts actually drawn are listed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.legend import Legend
    from matplotlib.text import Text

    def box(b):
        return (float(b.x0), float(b.y0), float(b.x1), float(b.y1))

    with matplotlib.rc_context(_RC):
        fig = _figure(plt, d)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        seen = []
        draw = Text.draw

        def spy(self, *args, **kwargs):  # every text the figure draws (a Text skips itself when hidden)
            if self.get_visible() and self not in seen:
                seen.append(self)
            return draw(self, *args, **kwargs)

        Text.draw = spy
        try:
            fig.draw(renderer)
        finally:
            Text.draw = draw
        legends = fig.findobj(Legend)
        in_legend = {id(t) for lg in legends for t in lg.findobj(Text)}
        ticks = {id(t): (i, name) for i, ax in enumerate(fig.axes) for name in "xy"
                 for t in getattr(ax, f"{name}axis").get_ticklabels()}
        texts, labelled = [], defaultdict(int)
        for t in seen:
            if not t.get_text().strip():
                continue
            role = ("label" if t.get_gid() == "data-label" else "legend" if id(t) in in_legend
                    else "tick" if id(t) in ticks else "text")
            if role == "tick":
                labelled[ticks[id(t)]] += 1
            texts.append({"text": t.get_text(), "role": role, "size_pt": float(t.get_fontsize()),
                          "bbox": box(Text.get_window_extent(t, renderer))})
        panels = [ax for ax in fig.axes if ax.axison]
        out = {"size": (int(round(fig.get_figwidth() * fig.dpi)), int(round(fig.get_figheight() * fig.dpi))),
               "dpi": float(fig.dpi), "texts": texts,
               "legends": [box(lg.get_window_extent(renderer)) for lg in legends if lg.get_visible()],
               "axes": [box(ax.get_window_extent(renderer)) for ax in panels],
               "log_axes": [(i, name, labelled[(i, name)]) for i, ax in enumerate(fig.axes) if ax.axison
                            for name in "xy" if getattr(ax, f"get_{name}scale")() == "log"],
               "all_zero_axes": [i for i, ax in enumerate(fig.axes) if ax.axison and ax.lines
                                 and all(np.all(np.asarray(ln.get_ydata(), dtype=float) == 0) for ln in ax.lines)]}
        plt.close(fig)
    return out


def _png(plt, d) -> bytes:
    fig = _figure(plt, d)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    return _palette_png(buf.getvalue())


def _palette_png(raw: bytes) -> bytes:
    """The figure with a 256-colour palette (a plot has few colours; its anti-aliased edges lose
    nothing a reader sees): a third of the RGBA file's bytes, deterministic for the same pixels."""
    try:
        from PIL import Image
    except ImportError:  # matplotlib needs Pillow, so this is a guard, not a path
        return raw
    img = Image.open(io.BytesIO(raw)).convert("RGB")
    out = io.BytesIO()
    img.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(out, format="PNG",
                                                                                           optimize=True)
    return out.getvalue()


def _caption(d) -> str:
    dist_word = "layer" if any(str(x).startswith("L") for x in _distributions(d)) else "distribution or layout"
    segments = (len(d["arms"][0]["segments"]) if d["kind"] == "live_quality"
                else len(d["budgets"][0]["arms"][0]["segments"]) if d["kind"] == "equal_bytes"
                else len(d["contexts"][0]["families"][0]["points"][0]["segments"]) if d["kind"] == "frontier" else 0)
    return _CAPTIONS[d["kind"]].format(dist_word=dist_word, block=d.get("block"), segments=segments)


def _distributions(d):
    for key in ("panels", "lines", "groups", "pairs", "cells"):
        for item in d.get(key, []):
            yield item["distribution"]


def _json_block(d) -> str:
    # "<" never appears raw, so the block cannot close itself early or open a tag
    return json.dumps(d, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")


_STYLE = ("body{font-family:sans-serif;max-width:70em;margin:1em auto;padding:0 1em;color:#222}"
          "figure{margin:1.5em 0;border-top:1px solid #ccc;padding-top:.5em}img{max-width:100%;height:auto}"
          "figcaption{font-size:.9em;max-width:60em}")


def build_html(protocols: list[dict], rows: list[dict], root: Path) -> str:
    """The whole report.html of a run whose arrays are already stored under ``root``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def load(rel):
        return load_array(root, rel)

    figures = figure_data(rows, load)
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
             "<title>testbed run report: figures</title>", f"<style>{_STYLE}</style></head><body>",
             "<h1>testbed run report: figures</h1>",
             f"<p>{len(rows)} result rows, {len(figures)} figures. The tables are in report.md; every plotted value is "
             "embedded beside its figure as JSON and recomputed from results.json by <code>python -m testbed.audit</code>. "
             "Statistics are over seeds, prompts or segments; rows inside one of them are not independent.</p>"]
    names = {p["name"]: p for p in protocols}
    current = None
    with matplotlib.rc_context(_RC):
        for n, d in enumerate(figures, 1):
            if d["study"] != current:
                current = d["study"]
                desc = names.get(current, {}).get("description", "")
                parts.append(f"<h2>{html.escape(current)}</h2><p>{html.escape(desc)}</p>")
            img = base64.b64encode(_png(plt, d)).decode("ascii")
            parts.append(f'<figure id="fig-{n}" data-key="{html.escape(d["key"])}">'
                         f'<img src="data:image/png;base64,{img}" alt="{html.escape(d["key"])}">'
                         f"<figcaption><b>Figure {n}</b> ({html.escape(d['key'])}). {html.escape(_caption(d))}</figcaption>"
                         f'<script type="application/json" id="figdata-{n}">{_json_block(d)}</script></figure>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
