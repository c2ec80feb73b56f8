"""The page: each figure's caption, its PNG (`draw_figure`, reduced to a palette) and its embedded
data block, under a live figure the table of its arms (printed from that data, `_table`), assembled
into report.html (`build_html`)."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from ..evidence import load_array
from .data import figure_data
from .draw import DPI, RC, draw_figure

__all__ = ["build_html", "CSP"]

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

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
                     "cache's bytes per token at the end of a segment (mean over segments), one point per arm{bits}; "
                     "below, top-1 agreement with the reference's argmax per block of {block} teacher-forced steps (mean "
                     "over segments). What it does not show: free generation or task accuracy (teacher forcing), other "
                     "models (one small model, SmolLM2-135M), other text (one corpus), or an interval: {segments} "
                     "segments (the table below gives Δ's interval over them)."),
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


# the live figure's top axis, where the rows state the model's dimensions (else nothing)
_BITS_AXIS = ("; the top axis reads the same bytes as bits per element, bytes per token × 8 / (2 × {layers} layers × "
              "{kv_heads} KV heads × {head_dim} head dim = {elements:,} K and V elements per token), every scale, "
              "zero-point, index and codebook byte and a policy's float32 tokens included since the bytes are the "
              "measured ones (the float32 reference is 32 where every layer holds every token)")
# the table under a live figure: its caption and column headings
_TABLE_CAPTION = ("<b>Table {n}</b> ({key}). Each arm of Figure {n}, sorted by bits per element{within} (bytes per "
                  "token × 8 over the model's K and V elements per token; — where the rows state no model dimensions): "
                  "bytes per token at the end of a segment and mean KL(reference || arm), means over segments; Δ "
                  "perplexity against the DynamicCache reference, the figure's value (exp of the mean per-segment NLL "
                  "difference, minus 1), with its 95 % interval, a percentile bootstrap over the segments of that mean "
                  "difference (2,000 resamples, numpy's default_rng(0): report.md's interval), given from 5 segments "
                  "on; top-1 agreement with the reference's argmax over every scored step, the mean over segments. "
                  "Intervals are over segments, never tokens.")
_TABLE_HEADERS = ("arm", "bytes / token", "bits / element", "Δ ppl vs reference", "95 % CI (segments)", "mean KL",
                  "top-1 agree")


def _png(plt, d) -> bytes:
    fig = draw_figure(plt, d)
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
    dims = d.get("dims") if d["kind"] == "live_quality" else None
    bits = "" if not dims else _BITS_AXIS.format(**dims, elements=2 * dims["layers"] * dims["kv_heads"] * dims["head_dim"])
    return _CAPTIONS[d["kind"]].format(dist_word=dist_word, block=d.get("block"), segments=segments, bits=bits)


def _table_rows(d) -> list[dict]:
    """The live figure's arms in the table's order: per context (the order they come), by bits per
    element (none last), then name."""
    contexts = list(dict.fromkeys(e["arm"].rpartition(" @ ")[2] if " @ " in e["arm"] else "" for e in d["arms"]))

    def key(e):
        bits = e["bits_per_element"]
        return (contexts.index(e["arm"].rpartition(" @ ")[2] if " @ " in e["arm"] else ""), bits is None, bits or 0.0,
                e["arm"])

    return sorted(d["arms"], key=key)


def _cells(e) -> list[str]:
    """One arm's table cells (text, before escaping)."""
    ci, top1 = e["delta_ci"], e["top1"]
    return [e["arm"], f"{e['bytes_per_token']:,.0f}",
            "—" if e["bits_per_element"] is None else f"{e['bits_per_element']:.3f}",
            "—" if e["delta_pct"] is None else f"{e['delta_pct']:+.2f} %",
            "—" if ci is None else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]", f"{e['mean_kl']:.5f}",
            "—" if top1 is None else f"{100 * top1:.2f} %"]


def _table(n: int, d) -> list[str]:
    """The per-arm table under live figure ``n``: one line per row (an audit FAIL names its line)."""
    esc = html.escape
    within = " within each context" if any(" @ " in e["arm"] for e in d["arms"]) else ""
    out = [f'<table id="table-{n}" data-key="{esc(d["key"])}">',
           f"<caption>{_TABLE_CAPTION.format(n=n, key=esc(d['key']), within=within)}</caption>",
           "<thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in _TABLE_HEADERS) + "</tr></thead><tbody>"]
    for e in _table_rows(d):
        cells = _cells(e)
        out.append(f"<tr><th>{esc(cells[0])}</th>" + "".join(f"<td>{esc(c)}</td>" for c in cells[1:]) + "</tr>")
    out.append("</tbody></table>")
    return out


def _distributions(d):
    for key in ("panels", "lines", "groups", "pairs", "cells"):
        for item in d.get(key, []):
            yield item["distribution"]


def _json_block(d) -> str:
    # "<" never appears raw, so the block cannot close itself early or open a tag
    return json.dumps(d, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")


_STYLE = ("body{font-family:sans-serif;max-width:70em;margin:1em auto;padding:0 1em;color:#222}"
          "figure{margin:1.5em 0;border-top:1px solid #ccc;padding-top:.5em}img{max-width:100%;height:auto}"
          "figcaption{font-size:.9em;max-width:60em}"
          "table{border-collapse:collapse;font-size:.9em;margin:0 0 1.5em}caption{caption-side:bottom;text-align:left;"
          "max-width:60em;padding-top:.5em}th,td{padding:.15em .7em;border-bottom:1px solid #ddd;white-space:nowrap}"
          "td{text-align:right;font-variant-numeric:tabular-nums}tbody th{text-align:left;font-weight:normal}"
          "thead th{border-bottom:2px solid #888}")


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
             f"<p>{len(rows)} result rows, {len(figures)} figures. The tables are in report.md, and a live study's per-arm "
             "table under its figure; every plotted or tabulated value is embedded beside its figure as JSON and "
             "recomputed from results.json by <code>python -m testbed.audit</code>. "
             "Statistics are over seeds, prompts or segments; rows inside one of them are not independent.</p>"]
    names = {p["name"]: p for p in protocols}
    current = None
    with matplotlib.rc_context(RC):
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
            if d["kind"] == "live_quality":
                parts += _table(n, d)
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"

