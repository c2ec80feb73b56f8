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

__all__ = ["build_html", "figure_data", "CSP", "AGREEMENT_BLOCK"]

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


def _retrieval(study, rows, load):
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
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, m in zip(axes.flat, d["maps"]):
        acc = np.asarray([[np.nan if v is None else v for v in row] for row in m["accuracy"]], dtype=float)
        ax.imshow(acc, aspect="auto", cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"{m['task']}: {m['arm']}", fontsize=8)
        ax.set_xticks(range(len(m["lengths"])), [str(x) for x in m["lengths"]], fontsize=7)
        ax.set_yticks(range(len(m["depths"])), [f"{x:g}" for x in m["depths"]], fontsize=7)
        ax.set_xlabel("prefill tokens", fontsize=7)
        ax.set_ylabel("needle depth", fontsize=7)
    return fig


# (kind, analysis, builder), in the order figures appear within a study
_BUILDERS = (("heatmap", "observation", _heatmaps), ("support_ecdf", "observation", _support),
             ("region_mass", "observation", _regions), ("mx_paths", "mx_paths", _mx),
             ("ablation_pairs", "ablation", _ablation), ("residual_window", "residual_window", _residual),
             ("live_quality", "live_quality", _live), ("retrieval_heatmap", "retrieval", _retrieval))


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

def _log(ax, which: str = "y"):
    """A log scale without minor ticks (their labels are most of a figure's drawing time)."""
    from matplotlib.ticker import NullLocator

    getattr(ax, f"set_{which}scale")("log")
    getattr(ax, f"{which}axis").set_minor_locator(NullLocator())


def _draw_heatmap(plt, d):
    n = len(d["panels"])
    fig, axes = plt.subplots(1, n, figsize=(min(3.6 * n, 13), 3.0), squeeze=False)
    for ax, p in zip(axes[0], d["panels"]):
        im = ax.imshow(np.asarray(p["mean"]), aspect="auto", cmap="viridis", vmin=0)
        ax.set_title(f"{p['distribution']} ({len(p['cases'])} cases)", fontsize=9)
        ax.set_xlabel(f"key block ({p['frame']} tokens)", fontsize=8)
        ax.set_ylabel("query block", fontsize=8)
        ax.set_yticks(range(len(p["mean"])))
        fig.colorbar(im, ax=ax, fraction=0.05)
    return fig


def _draw_support(plt, d):
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for line in d["lines"]:
        x = np.asarray(line["support_sorted"])
        ax.step(x, np.arange(1, x.size + 1) / x.size, where="post",
                label=f"{line['distribution']} ({len(line['cases'])} cases, {x.size} rows)")
    ax.set_xlabel("effective support (share of visible keys)")
    ax.set_ylabel("share of rows <= x")
    ax.set_xlim(0, 1)
    ax.legend(fontsize=7)
    return fig


def _draw_regions(plt, d):
    fig, ax = plt.subplots(figsize=(7, 3.2))
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
            ax.plot([x] * len(vals), vals, "k.", ms=3)
    for ri, reg in enumerate(REGIONS):  # legend in region order, whichever group has the region first
        if reg in labelled:
            ax.bar([0], [0], 0, color=f"C{ri}", label=reg)
    ax.set_xticks(range(len(d["groups"])), [g["distribution"] for g in d["groups"]], fontsize=8)
    ax.set_ylabel("attention mass")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncol=5, loc="upper center")
    return fig


def _draw_mx(plt, d):
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for s in d["series"]:
        x = np.asarray(s["tv_sorted"])
        axes[0].step(x, np.arange(1, x.size + 1) / x.size, where="post",
                     label=f"{s['path']} path, rotation {s['rotation']}, {s['scale_rule']}")
    _log(axes[0], "x")
    axes[0].set_xlabel("TV distance per row")
    axes[0].set_ylabel("share of rows <= x")
    axes[0].legend(fontsize=7)
    p = d["p"]
    if p:
        dists = list(dict.fromkeys(p["distributions"]))
        xs = [dists.index(t) for t in p["distributions"]]
        axes[1].plot(xs, [100 * z for z in p["zero_rate_mean"]], "o", ms=4)
        axes[1].set_xticks(range(len(dists)), dists, fontsize=8)
        axes[1].set_ylabel("P path strict zeros (% of entries)")
        x = np.asarray(p["row_sum_sorted"])
        axes[2].step(x, np.arange(1, x.size + 1) / x.size, where="post")
        axes[2].axvline(1.0, color="grey", lw=0.8)
        axes[2].set_xlabel("P path row sum")
        axes[2].set_ylabel("share of rows <= x")
    return fig


def _draw_ablation(plt, d):
    kinds = list(dict.fromkeys(p["ablation"] for p in d["pairs"]))
    fig, axes = plt.subplots(1, len(kinds), figsize=(min(5 * len(kinds), 13), 3.4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        sel = [p for p in d["pairs"] if p["ablation"] == kind]
        for i, p in enumerate(sel):
            for a, b in zip(p["ablation_rel_l2"], p["control_rel_l2"]):
                ax.plot([3 * i, 3 * i + 1], [a, b], "-o", color=f"C{i}", ms=3, lw=0.8)
        ax.set_xticks([3 * i + 0.5 for i in range(len(sel))], [p["distribution"] for p in sel], fontsize=8)
        ax.set_title(f"{kind} (left) vs {sel[0]['control']} (right)", fontsize=9)
        ax.set_ylabel("output rel-L2")
        if all(v > 0 for p in sel for v in p["ablation_rel_l2"] + p["control_rel_l2"]):
            _log(ax)
    return fig


def _draw_residual(plt, d):
    dists = list(dict.fromkeys(c["distribution"] for c in d["cells"]))
    arms = list(dict.fromkeys(c["arm"] for c in d["cells"]))
    fig, ax = plt.subplots(figsize=(8, 3.4))
    width = 0.8 / len(dists)
    for di, dist in enumerate(dists):
        for c in [c for c in d["cells"] if c["distribution"] == dist]:
            x = arms.index(c["arm"]) + (di - (len(dists) - 1) / 2) * width
            ax.bar(x, float(np.median(c["rel_l2"])), width * 0.9, color=f"C{di}", alpha=0.5,
                   label=dist if c["arm"] == arms[0] else None)
            ax.plot([x] * len(c["rel_l2"]), c["rel_l2"], "k.", ms=3)
    ax.set_xticks(range(len(arms)), arms, fontsize=8)
    _log(ax)
    ax.set_ylabel("output rel-L2")
    ax.legend(fontsize=7)
    return fig


def _draw_live(plt, d):
    fig, ax = plt.subplot_mosaic([["ppl", "kl"], ["top1", "top1"]], figsize=(11, 6.6))
    a1, a2, a3 = ax["ppl"], ax["kl"], ax["top1"]
    for i, e in enumerate(d["arms"]):
        if e["delta_pct"] is not None:
            a1.plot(e["bytes_per_token"], e["delta_pct"], "o" if i < 10 else "s", color=f"C{i % 10}")
            a1.annotate(e["arm"], (e["bytes_per_token"], e["delta_pct"]), fontsize=6)
        a2.plot(e["bytes_per_token"], e["mean_kl"], "o" if i < 10 else "s", color=f"C{i % 10}")
        a2.annotate(e["arm"], (e["bytes_per_token"], e["mean_kl"]), fontsize=6)
    for ax, label in ((a1, "perplexity change vs reference (%)"), (a2, "mean KL (nats / token)")):
        ax.set_xlabel("bytes per token")
        ax.set_ylabel(label, fontsize=8)
        ax.set_yscale("symlog", linthresh=0.1 if ax is a1 else 1e-3)
    for i, e in enumerate(d["agreement"]):
        x = np.arange(len(e["values"])) * d["block"] + d["block"] / 2
        a3.plot(x, e["values"], "-" if i < 10 else "--", color=f"C{i % 10}", lw=1, label=e["arm"])
    a3.set_xlabel(f"teacher-forced step (blocks of {d['block']})")
    a3.set_ylabel("top-1 agreement")
    a3.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return fig


_DRAW = {"heatmap": _draw_heatmap, "support_ecdf": _draw_support, "region_mass": _draw_regions, "mx_paths": _draw_mx,
         "ablation_pairs": _draw_ablation, "residual_window": _draw_residual, "live_quality": _draw_live,
         "retrieval_heatmap": _draw_retrieval}


def _png(plt, d) -> bytes:
    fig = _DRAW[d["kind"]](plt, d)
    fig.suptitle(f"{d['study']}: {d['kind'].replace('_', ' ')}", fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72, metadata={"Software": None})
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
    segments = len(d["arms"][0]["segments"]) if d["kind"] == "live_quality" else 0
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
    with matplotlib.rc_context({"font.size": 8, "figure.autolayout": True}):  # tight layout: half the time of constrained
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
