"""The live study's report.md section: per arm over segments (:func:`summarize`), the per-head
precision arms against their equal-bytes comparators (:func:`equal_bytes`), bootstrap intervals over
segments, and the tables with their notes (:func:`report`)."""

from __future__ import annotations

import math

import numpy as np

from ..policies.presets import equal_bytes_budget, equal_bytes_versus
from ..sources.models import MODELS
from .spec import REFERENCE, context_views


MIN_CI_SEGMENTS = 5  # below this a bootstrap over segments is no interval at all (2 values: their min and max)


def bootstrap(x: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of the mean over units (segments), resampled with replacement;
    NaN below ``MIN_CI_SEGMENTS`` units."""
    if x.size < MIN_CI_SEGMENTS:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n, x.size))].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def summarize(rows: list[dict]) -> list[dict]:
    """Per arm, over segments: perplexity, paired Δ vs the reference, KL, agreement, bytes."""
    by_arm: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_arm.setdefault(r["arm"], {})[r["case"]] = r
    ref = by_arm.get(REFERENCE, {})
    out = []
    for arm, segs in by_arm.items():
        ids = sorted(segs)
        nll = np.array([segs[s]["nll"] for s in ids])
        ref_nll = np.array([ref[s]["nll"] for s in ids if s in ref])
        ppl = math.exp(float(nll.mean()))
        entry = {"arm": arm, "kind": segs[ids[0]]["kind"], "mode": segs[ids[0]]["mode"], "segments": len(ids),
                 "perplexity": ppl, "mean_kl": float(np.mean([segs[s]["mean_kl"] for s in ids])),
                 "top1": float(np.mean([segs[s]["top1_agreement"] for s in ids])),
                 "bytes_per_token": float(np.mean([segs[s]["bytes_per_token"] for s in ids])),
                 "context": segs[ids[0]]["context_final"], "forwards": segs[ids[0]]["forwards"]}
        if ref_nll.size == nll.size and arm != REFERENCE:
            d = nll - ref_nll  # per segment; perplexity ratio over all segments = exp(mean d)
            entry["delta_pct"] = 100.0 * math.expm1(float(d.mean()))
            lo, hi = bootstrap(d)
            entry["delta_ci"] = (100.0 * math.expm1(lo), 100.0 * math.expm1(hi))
            entry["worse"] = int((d > 0).sum())
        out.append(entry)
    return sorted(out, key=lambda e: (-e["bytes_per_token"], e["arm"]))


def comparator(arm: str, arms) -> str | None:
    """The arm a per-head precision arm is compared with at equal bytes: ``mix28_*`` (the bytes of
    int4) with uniform ``int4``; ``mix24_*`` (a 3-bit layout's bytes) with uniform ``int3`` where the
    study runs it, else with ``mix24_random``, the content-blind allocation of the same bytes;
    ``int2_hh`` (heavy hitters at int2's bytes), ``int2_hh_first`` (its content-blind control) and
    ``int2_hh_oracle`` (its oracle bound) with uniform ``int2``; None when that arm is absent
    (:data:`testbed.policies.presets.EQUAL_BYTES_VERSUS`)."""
    budget = equal_bytes_budget(arm)
    other = None if budget is None else equal_bytes_versus(budget, arms)
    return other if other != arm else None


def equal_bytes(rows: list[dict]) -> list[dict]:
    """Per per-head precision arm: paired over segments against its :func:`comparator` -- Δ
    perplexity (exp of the mean per-segment NLL difference, minus 1), its bootstrap interval (from
    ``MIN_CI_SEGMENTS`` segments), segments where the arm's perplexity is lower, mean KL of both,
    bytes per token of both."""
    by_arm: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_arm.setdefault(r["arm"], {})[r["case"]] = r
    out = []
    for arm in sorted(by_arm):
        other = comparator(arm, by_arm)
        if other is None or set(by_arm[arm]) != set(by_arm[other]):
            continue
        ids = sorted(by_arm[arm])
        a, b = [by_arm[arm][s] for s in ids], [by_arm[other][s] for s in ids]
        d = np.array([x["nll"] for x in a]) - np.array([y["nll"] for y in b])
        lo, hi = bootstrap(d)
        mean = lambda rs, k: float(np.mean([x[k] for x in rs]))  # noqa: E731
        out.append({"arm": arm, "versus": other, "segments": len(ids), "delta_pct": 100.0 * math.expm1(float(d.mean())),
                    "delta_ci": (100.0 * math.expm1(lo), 100.0 * math.expm1(hi)), "better": int((d < 0).sum()),
                    "mean_kl": mean(a, "mean_kl"), "versus_kl": mean(b, "mean_kl"), "top1": mean(a, "top1_agreement"),
                    "bytes_per_token": mean(a, "bytes_per_token"), "versus_bytes": mean(b, "bytes_per_token")})
    return out


EQUAL_BYTES_NOTE = (
    "Per-head precision at equal bytes: each mix* arm (and int2_hh) against the arm of the same bytes it is compared with "
    "(mix28_*, the bytes of int4 with 60 of the 90 (layer, KV head) pairs int2 and 30 int8, against uniform int4; "
    "mix24_*, a 3-bit layout's bytes with 45 pairs int2 and 45 int4, against uniform int3 where the study runs it, "
    "else against mix24_random, the content-blind allocation of those bytes; int2_hh, heavy hitters kept float32 "
    "at int2's bytes, and "
    "int2_hh_first, its content-blind control, and int2_hh_oracle, its oracle, against uniform int2). Δ is "
    "paired per segment (exp of the mean NLL difference, minus 1; negative: the "
    "arm predicts better); 'segments better' counts segments whose perplexity fell. Oracle arms (*_oracle*) decide from the "
    "whole segment's float32 attention: impossible online, an upper bound for the online rule, not a policy.")


def report(rows: list[dict], params: dict, timings: list | None = None) -> str:
    """report.md's section: one table with its notes per context of the study."""
    if not rows:
        return "(no rows: the live study was excluded; see the manifest's excluded entries)"
    views = context_views(params)
    if len(views) == 1:
        return _report_context(rows, {**params, "prefill": views[0][1]}, timings)
    parts = []
    for prefix, prefill in views:
        n = prefill + params["steps"]
        sel = [r for r in rows if r["case"].startswith(prefix + "-")]
        times = [t for t in timings or [] if t.get("context") == n]
        parts.append(f"**Context {n:,} tokens** ({prefill:,}-token prefill, then {params['steps']:,} scored tokens)"
                     f"\n\n{_report_context(sel, {**params, 'prefill': prefill}, times)}")
    return "\n\n".join(parts)


def _report_context(rows: list[dict], params: dict, timings: list | None = None) -> str:
    from tabulate import tabulate

    dims = MODELS.get(params["model"]) or rows[0]["model_dims"]
    # float16 K + V bytes per token: the reference's (DynamicCache's layout, sliding layers included) halved
    ref_rows = [r for r in rows if r["kind"] == "reference"]
    f16 = (float(np.mean([r["bytes_per_token"] for r in ref_rows])) / 2 if ref_rows
           else dims["layers"] * dims["kv_heads"] * dims["head_dim"] * 2 * 2)
    secs: dict[str, list] = {}
    study = rows[0]["study"]  # a run's timings hold every study's, and arm names repeat across live studies
    for t in timings or []:
        if t.get("study") == study and t.get("op") == "decode" and t.get("arm") is not None and t.get("scored_tokens"):
            secs.setdefault(t["arm"], []).append((t["seconds"], t["scored_tokens"]))
    table = []
    for e in summarize(rows):
        ms = secs.get(e["arm"])
        ms = 1000 * sum(s for s, _ in ms) / sum(n for _, n in ms) if ms else float("nan")
        ci = e.get("delta_ci")
        table.append([e["arm"], f"{e['mode']}, {e['forwards']}", f"{e['perplexity']:.4f}",
                      "—" if "delta_pct" not in e else f"{e['delta_pct']:+.2f} %",
                      "—" if not ci or math.isnan(ci[0]) else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]",
                      "—" if "worse" not in e else f"{e['worse']}/{e['segments']}",
                      f"{e['mean_kl']:.5f}", f"{100 * e['top1']:.2f} %", f"{e['bytes_per_token']:,.0f}",
                      f"{e['bytes_per_token'] / f16:.3f}", f"{ms:.1f}"])
    n_seg = len({r["case"] for r in rows})
    text = tabulate(table, headers=["arm", "mode, forwards", "perplexity", "Δ ppl vs DynamicCache", "95 % CI (segments)",
                                    "segments worse", "mean KL", "top-1 agree", "bytes / token", "÷ float16",
                                    "ms / scored token"], tablefmt="github")
    notes = (f"\n\n{n_seg} segments × {params['steps']} teacher-forced steps after a {params['prefill']}-token prefill; "
             "forwards per segment batch (prefill included); sorted by bytes per token (the whole cache of all "
             f"{dims['layers']} layers at the end of a segment, ÷ the tokens it has "
             f"seen; float16 K+V would be {f16:,.0f} B/token). Δ is the perplexity over all segments against the "
             "DynamicCache reference (exp of the mean per-segment NLL difference, minus 1); its interval is a "
             f"bootstrap over segments of that mean difference, given from {MIN_CI_SEGMENTS} segments on; "
             "'segments worse' counts segments whose perplexity rose. KL is KL(p_float32 ‖ p_arm) per scored token, averaged. "
             "Log-probabilities and KL rest on model forward passes the audit cannot repeat; the audit re-derives "
             "every aggregate, agreement and byte count from the stored arrays. ms / scored token is wall time of "
             "the arm's decoding (with a shared prefill, the prefill is timed once per batch apart: "
             "timings.json, op \"prefill\") on this machine, not a benchmark. Intervals are over segments, "
             "never tokens. What this table does not show: one small model "
             "(float32 weights dequantized from Q4_1), one corpus of technical English, teacher forcing (no "
             "free-running generation, no task accuracy); a policy's bytes per token include its float32 window, "
             "which dominates at short contexts.")
    eq = equal_bytes(rows)
    if eq:
        t2 = [[e["arm"], e["versus"], f"{e['delta_pct']:+.2f} %",
               "—" if math.isnan(e["delta_ci"][0]) else f"[{e['delta_ci'][0]:+.2f}, {e['delta_ci'][1]:+.2f}]",
               f"{e['better']}/{e['segments']}", f"{e['mean_kl']:.5f}", f"{e['versus_kl']:.5f}", f"{100 * e['top1']:.2f} %",
               f"{e['bytes_per_token']:,.0f}", f"{100 * (e['bytes_per_token'] / e['versus_bytes'] - 1):+.3f} %"] for e in eq]
        notes += "\n\n" + EQUAL_BYTES_NOTE + "\n\n" + tabulate(
            t2, headers=["arm", "compared with", "Δ ppl vs compared", "95 % CI (segments)", "segments better", "mean KL",
                         "compared's KL", "top-1 agree", "bytes / token", "bytes vs compared's"], tablefmt="github")
    return text + notes
