"""Audit of report.html: every figure's embedded data recomputed from the result rows.

Reads the HTML with the standard library's ``html.parser`` (nothing is rendered or executed) and
checks that:

- the file carries the Content-Security-Policy meta tag that forbids any outside request, holds no
  executable script (only ``application/json`` data blocks) and references nothing outside itself
  (every ``src``/``href``-like attribute and every CSS ``url()`` is a ``data:`` URI or a ``#``
  fragment; no ``@import``);
- every figure has one inline PNG whose chunk structure and CRCs are intact and whose size is not
  zero, a caption, and one JSON data block;
- the set of figures is exactly the one the rows call for, and each figure's data equals the
  audit's own recomputation from ``results.json`` (and the stored arrays the rows name) within
  ``RTOL``/``ATOL``. The run's builder (testbed/report_html/) is never imported;
- every word of the page: the audit writes the page the rows call for itself (``expected_page``:
  the title, style sheet and intro paragraph with its row and figure counts; per study its heading
  and its frozen protocol copy's description; per figure its number, key, alt text and caption,
  whose layer/distribution word, block size, segment count and model dimensions are derived from the
  figure's data; under a live figure the per-arm table, its caption, headings and one line per arm,
  sorted by bits per element and printed from the figure's data once that equals the audit's own),
  with every PNG payload and JSON block replaced by a placeholder (both checked above), and
  compares it line by line with the page: each differing line is a FAIL naming the intro, the
  section's heading or description, the figure's caption or markup, or the table's row (by arm),
  with the words that differ.
  Static text (captions, style, intro) is the audit's own copy of the builder's, kept equal by a test.

What it cannot check: that the pixels of a PNG depict its data (a consistent forger can draw a
different picture beside the right numbers and words); docs/reliability.md lists that gap.

The page is read by `report_html_parse` (HTML and PNG structure) and the figures' data derived by
`report_html_figures`; this module holds the page's words and the check.
"""


from __future__ import annotations

import difflib
import html
import re

from .common import strict_json
from .report_format import ordered as _ordered
from .report_html_figures import derive_figures, first_difference
from .report_html_parse import parse_report, png_size

__all__ = ["check_run", "expected_page", "page_lines", "caption", "table_lines", "CSP", "CAPTIONS", "STYLE", "INTRO",
           "TITLE", "BITS_AXIS", "TABLE_CAPTION", "TABLE_HEADERS"]

REL = "report.html"
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"


# ---------------------------------------------------------------------------------------------
# the page's words: what the run's builder (testbed/report_html/page.py) writes, restated here
# ---------------------------------------------------------------------------------------------

# The audit's own copy of the builder's static text (tests/test_report_html.py keeps them equal):
# the title, the style sheet (a changed one could hide words), the intro paragraph (its two counts
# are derived) and each kind of figure's caption (its {dist_word}, {block} and {segments} derived).
TITLE = "testbed run report: figures"
STYLE = ("body{font-family:sans-serif;max-width:70em;margin:1em auto;padding:0 1em;color:#222}"
         "figure{margin:1.5em 0;border-top:1px solid #ccc;padding-top:.5em}img{max-width:100%;height:auto}"
         "figcaption{font-size:.9em;max-width:60em}"
         "table{border-collapse:collapse;font-size:.9em;margin:0 0 1.5em}caption{caption-side:bottom;text-align:left;"
         "max-width:60em;padding-top:.5em}th,td{padding:.15em .7em;border-bottom:1px solid #ddd;white-space:nowrap}"
         "td{text-align:right;font-variant-numeric:tabular-nums}tbody th{text-align:left;font-weight:normal}"
         "thead th{border-bottom:2px solid #888}")
INTRO = ("<p>{rows} result rows, {figures} figures. The tables are in report.md, and a live study's per-arm table "
         "under its figure; every plotted or tabulated value is embedded beside its figure as JSON and recomputed "
         "from results.json by <code>python -m testbed.audit</code>. Statistics are over seeds, prompts or segments; "
         "rows inside one of them are not independent.</p>")
CAPTIONS = {
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

# the live figure's top axis where the rows state the model's dimensions, and the table under a live figure
BITS_AXIS = ("; the top axis reads the same bytes as bits per element, bytes per token × 8 / (2 × {layers} layers × "
             "{kv_heads} KV heads × {head_dim} head dim = {elements:,} K and V elements per token), every scale, "
             "zero-point, index and codebook byte and a policy's float32 tokens included since the bytes are the "
             "measured ones (the float32 reference is 32 where every layer holds every token)")
TABLE_CAPTION = ("<b>Table {n}</b> ({key}). Each arm of Figure {n}, sorted by bits per element{within} (bytes per "
                 "token × 8 over the model's K and V elements per token; — where the rows state no model dimensions): "
                 "bytes per token at the end of a segment and mean KL(reference || arm), means over segments; Δ "
                 "perplexity against the DynamicCache reference, the figure's value (exp of the mean per-segment NLL "
                 "difference, minus 1), with its 95 % interval, a percentile bootstrap over the segments of that mean "
                 "difference (2,000 resamples, numpy's default_rng(0): report.md's interval), given from 5 segments "
                 "on; top-1 agreement with the reference's argmax over every scored step, the mean over segments. "
                 "Intervals are over segments, never tokens.")
TABLE_HEADERS = ("arm", "bytes / token", "bits / element", "Δ ppl vs reference", "95 % CI (segments)", "mean KL",
                 "top-1 agree")

IMG, DATA = "data:image/png;base64,@", "@"  # what the page's PNG payloads and JSON blocks are replaced by
_IMG_SRC = re.compile(r'src="data:image/png;base64,[A-Za-z0-9+/=]*"')
_DATA_BLOCK = re.compile(r'(<script type="application/json" id="figdata-\d+">)(.*?)(</script>)', re.S)
_FIG_KEY = re.compile(r'<figure id="fig-\d+" data-key="([^"]*)"')


def caption(d: dict) -> str:
    """The caption the builder writes under figure data ``d``: its kind's text, with "layer" where a
    plotted group is a layer (``L0``, ...), and the block size and segment count of a live figure."""
    groups = [item.get("distribution") for key in ("panels", "lines", "groups", "pairs", "cells")
              for item in d.get(key, [])]
    dist_word = "layer" if any(str(x).startswith("L") for x in groups) else "distribution or layout"
    segments = (len(d["arms"][0]["segments"]) if d["kind"] == "live_quality"
                else len(d["budgets"][0]["arms"][0]["segments"]) if d["kind"] == "equal_bytes"
                else len(d["contexts"][0]["families"][0]["points"][0]["segments"]) if d["kind"] == "frontier" else 0)
    dims = d.get("dims") if d["kind"] == "live_quality" else None
    bits = ""
    if dims:
        elements = 2 * dims["layers"] * dims["kv_heads"] * dims["head_dim"]
        bits = BITS_AXIS.format(layers=dims["layers"], kv_heads=dims["kv_heads"], head_dim=dims["head_dim"],
                                elements=elements)
    return CAPTIONS[d["kind"]].format(dist_word=dist_word, block=d.get("block"), segments=segments, bits=bits)


def _context_of_arm(name: str) -> str:
    return name.rpartition(" @ ")[2] if " @ " in name else ""


def table_lines(n: int, d: dict) -> list[tuple[str, str]]:
    """The table the builder writes under live figure ``n`` (data ``d``) as ``(part, line)`` pairs,
    one per HTML line (``part`` names the line in a FAIL: " caption", " row 'int4'", ...): the arms
    grouped by context (in the order the data has them), within a context by bits per element (an
    arm without bits after those with), then name; numbers printed at fixed digits."""
    esc = html.escape
    contexts = _ordered([_context_of_arm(e["arm"]) for e in d["arms"]])
    arms = sorted(d["arms"], key=lambda e: (contexts.index(_context_of_arm(e["arm"])), e["bits_per_element"] is None,
                                            e["bits_per_element"] if e["bits_per_element"] is not None else 0.0,
                                            e["arm"]))

    def num(x, form):
        return "—" if x is None else form.format(x)

    lines = [("", f'<table id="table-{n}" data-key="{esc(d["key"])}">'),
             (" caption", "<caption>" + TABLE_CAPTION.format(n=n, key=esc(d["key"]), within=" within each context"
                                                            if any(c for c in contexts) else "") + "</caption>"),
             (" headings", "<thead><tr>" + "".join("<th>" + esc(h) + "</th>" for h in TABLE_HEADERS)
              + "</tr></thead><tbody>")]
    for e in arms:
        ci = e["delta_ci"]
        cells = [num(e["bytes_per_token"], "{:,.0f}"), num(e["bits_per_element"], "{:.3f}"),
                 num(e["delta_pct"], "{:+.2f} %"), "—" if ci is None else "[{:+.2f}, {:+.2f}]".format(*ci),
                 num(e["mean_kl"], "{:.5f}"), num(None if e["top1"] is None else 100.0 * e["top1"], "{:.2f} %")]
        lines.append((f" row {e['arm']!r}", "<tr><th>" + esc(e["arm"]) + "</th>"
                      + "".join("<td>" + esc(c) + "</td>" for c in cells) + "</tr>"))
    return lines + [("", "</tbody></table>")]


def expected_page(n_rows: int, figures: list[dict], descriptions: dict,
                  tables: dict | None = None) -> list[tuple[str, str]]:
    """The page the rows call for, as ``(what, line)`` pairs in order (``what`` names the line in a
    FAIL), every PNG payload ``IMG`` and every JSON block ``DATA`` (both checked on their own).

    A live figure's table is printed from ``tables[key]`` where given: the figure's embedded data once
    it is found within ``RTOL`` of the audit's own (its digits then printed as the builder printed
    them, with no rounding boundary between the two computations), else from ``figures``."""
    tables = tables or {}
    esc = html.escape
    out = [("doctype", "<!DOCTYPE html>"), ("head", '<html lang="en"><head><meta charset="utf-8">'),
           ("head", f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'),
           ("title", f"<title>{TITLE}</title>"), ("style sheet", f"<style>{STYLE}</style></head><body>"),
           ("heading", f"<h1>{TITLE}</h1>"), ("intro paragraph", INTRO.format(rows=n_rows, figures=len(figures)))]
    current = None
    for n, d in enumerate(figures, 1):
        if d["study"] != current:
            current = d["study"]
            part = f"<h2>{esc(str(current))}</h2><p>{esc(str(descriptions.get(current, '')))}</p>"
            out += [(f"section {current}", line) for line in part.split("\n")]
        key = esc(d["key"])
        part = (f'<figure id="fig-{n}" data-key="{key}"><img src="{IMG}" alt="{key}">'
                f"<figcaption><b>Figure {n}</b> ({key}). {esc(caption(d))}</figcaption>"
                f'<script type="application/json" id="figdata-{n}">{DATA}</script></figure>')
        out += [(f"figure {n} ({d['key']})", line) for line in part.split("\n")]
        if d["kind"] == "live_quality":  # its numbers from the embedded data the audit found equal to its own
            out += [(f"table {n} ({d['key']}){part}", line) for part, line in table_lines(n, tables.get(d["key"], d))]
    out.append(("end", "</body></html>"))
    return out


def page_lines(text: str) -> list[str]:
    """The page's lines with every PNG payload and JSON block replaced (blank lines dropped)."""
    text = _IMG_SRC.sub(f'src="{IMG}"', text)
    text = _DATA_BLOCK.sub(lambda m: m.group(1) + DATA + m.group(3), text)
    return [line for line in text.split("\n") if line.strip()]


def _part_of(what: str, line: str, at: int) -> str:
    """Which part of an expected line the character ``at`` falls in."""
    spans = (("caption", "<figcaption>", "</figcaption>"), ("heading", "<h2>", "</h2>"),
             ("description", "<p>", "</p>")) if what.startswith(("figure", "section")) else ()
    for name, start, end in spans:
        i, j = line.find(start), line.find(end)
        if 0 <= i and i + len(start) <= at <= j:
            return f"{what} {name}"
    return f"{what} markup" if what.startswith(("figure", "section")) else what


def _words_differ(got: str, want: str) -> tuple[int, str]:
    """(index where they part, 'page says X, the audit writes Y') with X, Y whole words."""
    k = 0
    while k < min(len(got), len(want)) and got[k] == want[k]:
        k += 1
    s = 0
    while s < min(len(got), len(want)) - k and got[-1 - s] == want[-1 - s]:
        s += 1
    def edge(c):  # a word ends at a space or a tag (a table cell is one word)
        return c.isspace() or c in "<>"

    a = k
    while a > 0 and not edge(want[a - 1]):
        a -= 1
    gb, wb = len(got) - s, len(want) - s
    while gb < len(got) and not edge(got[gb]):
        gb += 1
    while wb < len(want) and not edge(want[wb]):
        wb += 1
    return k, f"page says {got[a:gb][:100]!r}, the rows and the builder's text call for {want[a:wb][:100]!r}"


def check_text(ctx, text: str, figures: list[dict], tables: dict | None = None) -> None:
    """Every line of the page but its PNG payloads and JSON blocks must be what the builder writes
    for these rows: one FAIL per differing line, naming the figure, table or section and its part."""
    rows = ctx.results.get("rows", []) if isinstance(ctx.results, dict) else []
    descriptions = {name: (p.get("description") or "") for name, p in ctx.protocol_copies.items()}
    want = expected_page(len(rows) if isinstance(rows, list) else 0, figures, descriptions, tables)
    got = page_lines(text)
    on_page = {m.group(1) for m in map(_FIG_KEY.match, got) if m}
    keys = {d["key"] for d in figures}

    def reported(line: str, wanted: bool) -> bool:  # a figure the structural checks already named
        m = _FIG_KEY.match(line)
        return bool(m) and (html.unescape(m.group(1)) not in on_page if wanted else html.unescape(m.group(1)) not in keys)

    ops = difflib.SequenceMatcher(None, got, [line for _, line in want], autojunk=False).get_opcodes()
    for op, g0, g1, w0, w1 in ops:
        if op == "equal":
            continue
        pairs = min(g1 - g0, w1 - w0) if op == "replace" else 0
        for i in range(pairs):
            g, (what, w) = got[g0 + i], want[w0 + i]
            if reported(w, True) or reported(g, False):
                continue
            at, words = _words_differ(g, w)
            ctx.fail(f"{REL} {_part_of(what, w, at)}", f"words differ from what the rows call for: {words}")
        for line in got[g0 + pairs:g1]:
            if not reported(line, False):
                ctx.fail(REL, f"a line the run's builder does not write: {line[:120]!r}")
        for what, line in want[w0 + pairs:w1]:
            if not reported(line, True):
                ctx.fail(f"{REL} {what}", f"missing: {line[:120]!r}")


def check_run(ctx) -> None:
    """Check report.html of the run (see the module docstring); problems go to ``ctx.fail``."""
    if REL not in ctx.manifest.get("files", {}):
        ctx.fail(REL, "not named in the manifest (every run writes one)")
        return
    try:
        text = ctx.read_bytes(REL).decode("utf-8")
    except UnicodeDecodeError:
        ctx.fail(REL, "not UTF-8 text")
        return
    page = parse_report(text)
    if page.csp != [CSP]:
        ctx.fail(REL, f"Content-Security-Policy meta tags {page.csp!r}; expected exactly one with {CSP!r}")
    for problem in page.problems:
        ctx.fail(REL, problem)
    rows = [r for r in ctx.results.get("rows", []) if isinstance(r, dict)]
    try:
        expected = derive_figures(rows, ctx)
    except Exception as e:  # noqa: BLE001 - rows the other checks already refused; still a FAIL line
        ctx.fail(REL, f"figure data cannot be derived from results.json ({type(e).__name__}: {str(e)[:200]})")
        return
    seen, verified = set(), {}
    for n, fig in enumerate(page.figures, 1):
        name = f"{REL} figure {n} ({fig['key']})"
        ctx.numbers += 1
        if fig["key"] in seen:
            ctx.fail(name, "a second figure with this key")
            continue
        seen.add(fig["key"])
        if len(fig["imgs"]) != 1:
            ctx.fail(name, f"has {len(fig['imgs'])} images, needs exactly one")
        for src in fig["imgs"]:
            try:
                png_size(src)
            except ValueError as e:
                ctx.fail(name, str(e))
        if not "".join(fig["caption"]).strip():
            ctx.fail(name, "has no caption")
        if len(fig["data"]) != 1:
            ctx.fail(name, f"has {len(fig['data'])} JSON data blocks, needs exactly one")
            continue
        try:
            data = strict_json(fig["data"][0], parse_constant=lambda c: float("nan"))
        except ValueError as e:
            ctx.fail(name, f"data block is not valid JSON ({str(e)[:120]})")
            continue
        if fig["key"] not in expected:
            ctx.fail(name, "no such figure follows from the rows of results.json (added or renamed)")
            continue
        diff = first_difference("", data, expected[fig["key"]])
        if diff:
            ctx.fail(name, f"plotted data differs from results.json: {diff}")
        else:
            verified[fig["key"]] = data
    for key in expected:
        if key not in seen:
            ctx.fail(f"{REL} figure {key}", "missing: the rows of results.json call for it")
    try:
        check_text(ctx, text, list(expected.values()), verified)
    except Exception as e:  # noqa: BLE001 - rows the other checks already refused; still a FAIL line
        ctx.fail(REL, f"the page's text cannot be derived from results.json ({type(e).__name__}: {str(e)[:200]})")
