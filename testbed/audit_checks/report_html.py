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
  ``RTOL``/``ATOL``. The run's builder (testbed/report_html.py) is never imported;
- every word of the page: the audit writes the page the rows call for itself (``expected_page``:
  the title, style sheet and intro paragraph with its row and figure counts; per study its heading
  and its frozen protocol copy's description; per figure its number, key, alt text and caption,
  whose layer/distribution word, block size and segment count are derived from the figure's data),
  with every PNG payload and JSON block replaced by a placeholder (both checked above), and
  compares it line by line with the page: each differing line is a FAIL naming the intro, the
  section's heading or description, or the figure's caption or markup, with the words that differ.
  Static text (captions, style, intro) is the audit's own copy of the builder's, kept equal by a test.

What it cannot check: that the pixels of a PNG depict its data (a consistent forger can draw a
different picture beside the right numbers and words); docs/reliability.md lists that gap.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import html
import math
import re
import struct
import zlib
from html.parser import HTMLParser

import numpy as np

from .common import TOLERANCES, strict_json
from .live_policies import BUDGET_VERSUS, budget_of, versus_of
from .report_format import label as _label
from .report_format import ordered as _ordered

__all__ = ["check_run", "derive_figures", "parse_report", "expected_page", "page_lines", "caption", "CSP",
           "CAPTIONS", "STYLE", "INTRO", "TITLE"]

REL = "report.html"
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
# the audit's float64 tolerance (the embedded data carries 9 significant digits)
RTOL, ATOL = TOLERANCES["derived"]["rtol"], TOLERANCES["derived"]["atol"]
STEP_BLOCK = 8  # teacher-forced steps per point of the live agreement curve (docs/report: "per block of 8")
_URL_ATTRS = {"src", "href", "srcset", "poster", "action", "formaction", "background", "data", "xlink:href", "cite",
              "longdesc", "usemap", "manifest", "ping"}
_CSS_URL = re.compile(r"url\(\s*(['\"]?)([^'\")]*)", re.IGNORECASE)
_PNG_SIG = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# the HTML
# ---------------------------------------------------------------------------------------------

class _Reader(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.figures: list[dict] = []
        self.problems: list[str] = []
        self.csp: list[str] = []
        self._fig = None
        self._in_caption = False
        self._script = None  # (type, id, text parts) of the open <script>
        self._in_style = False

    def _refs(self, tag, attrs):
        for name, value in attrs:
            value = (value or "").strip()
            if name in _URL_ATTRS and not (value.startswith("data:") or value.startswith("#")):
                self.problems.append(f"<{tag} {name}=\"{value[:80]}\"> references something outside the file")
            if name == "style":
                self._css(value, f"<{tag} style>")
            if name.startswith("on"):
                self.problems.append(f"<{tag}> has an event handler attribute {name} (executable)")

    def _css(self, text, where):
        for _, url in _CSS_URL.findall(text):
            if not (url.strip().startswith("data:") or url.strip().startswith("#")):
                self.problems.append(f"{where} url({url[:80]}) references something outside the file")
        if "@import" in text.lower():
            self.problems.append(f"{where} has an @import")

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self._refs(tag, attrs)
        equiv = (a.get("http-equiv") or "").lower()
        if tag == "meta" and equiv == "content-security-policy":
            self.csp.append(a.get("content") or "")
        elif tag == "meta" and equiv == "refresh":
            self.problems.append("a <meta http-equiv=\"refresh\"> (navigates away from the file)")
        elif tag == "figure":
            if self._fig is not None:
                self.problems.append("a <figure> inside another figure")
            self._fig = {"key": a.get("data-key"), "id": a.get("id"), "imgs": [], "caption": [], "data": []}
            self.figures.append(self._fig)
        elif tag == "img":
            if self._fig is None:
                self.problems.append("an <img> outside any figure")
            else:
                self._fig["imgs"].append(a.get("src") or "")
        elif tag == "figcaption":
            self._in_caption = True
        elif tag == "script":
            self._script = ((a.get("type") or "").strip().lower(), a.get("id"), [])
        elif tag == "style":
            self._in_style = True
        elif tag in ("iframe", "object", "embed", "link", "base", "frame"):
            self.problems.append(f"a <{tag}> element (the report needs none)")

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag == "script":
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        if tag == "figure":
            self._fig = None
        elif tag == "figcaption":
            self._in_caption = False
        elif tag == "style":
            self._in_style = False
        elif tag == "script" and self._script is not None:
            kind, sid, text = self._script
            self._script = None
            if kind != "application/json":
                self.problems.append(f"an executable <script> (type {kind!r}); the report must need no script")
            elif self._fig is None:
                self.problems.append(f"a JSON data block ({sid}) outside any figure")
            else:
                self._fig["data"].append("".join(text))

    def handle_data(self, data):
        if self._script is not None:
            self._script[2].append(data)
        elif self._in_style:
            self._css(data, "<style>")
        elif self._in_caption and self._fig is not None:
            self._fig["caption"].append(data)


def parse_report(text: str) -> _Reader:
    r = _Reader()
    r.feed(text)
    r.close()
    return r


def png_size(src: str) -> tuple[int, int]:
    """Width and height of an inline PNG ``data:`` URI; ValueError unless every chunk's CRC holds and
    it ends with IEND."""
    prefix = "data:image/png;base64,"
    if not src.startswith(prefix):
        raise ValueError("image is not an inline PNG (data:image/png;base64,...)")
    try:
        raw = base64.b64decode(src[len(prefix):], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image payload is not valid base64") from None
    if not raw.startswith(_PNG_SIG):
        raise ValueError("image payload is not a PNG (bad signature)")
    pos, size, seen_end = len(_PNG_SIG), None, False
    while pos < len(raw):
        if pos + 12 > len(raw):
            raise ValueError("PNG truncated inside a chunk header")
        length, ctype = struct.unpack(">I4s", raw[pos:pos + 8])
        body = raw[pos + 8:pos + 8 + length]
        if len(body) != length or pos + 12 + length > len(raw):
            raise ValueError("PNG truncated inside a chunk")
        (crc,) = struct.unpack(">I", raw[pos + 8 + length:pos + 12 + length])
        if zlib.crc32(ctype + body) != crc:
            raise ValueError(f"PNG chunk {ctype!r} fails its CRC")
        if size is None:
            if ctype != b"IHDR" or length != 13:
                raise ValueError("PNG does not start with an IHDR chunk")
            size = struct.unpack(">II", body[:8])
        seen_end = ctype == b"IEND"
        pos += 12 + length
        if seen_end:
            break
    if not seen_end or pos != len(raw):
        raise ValueError("PNG does not end with its IEND chunk")
    if size[0] == 0 or size[1] == 0:
        raise ValueError(f"PNG is {size[0]} x {size[1]} pixels")
    return size


# ---------------------------------------------------------------------------------------------
# the audit's own figure data
# ---------------------------------------------------------------------------------------------

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
    " (prefill, adaptive)", " (prefill, pyramid, adaptive)" with its schedules); a dropped middle
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
    points, agreement = [], []
    for prefix in prefixes:
        sel = [r for r in rows if (str(r["case"]).rpartition("-")[0] if "-" in str(r["case"]) else "") == prefix]
        one = _live_points(sel, ctx, f" @ {prefix[1:]}" if len(prefixes) > 1 else "")
        if one is None:
            return [("live_quality", None), ("equal_bytes", budgets and {"budgets": budgets}),
                    ("frontier", _frontier_figure(rows))]
        points += one[0]
        agreement += one[1]
    return [("live_quality", {"arms": points, "block": STEP_BLOCK, "agreement": agreement}),
            ("equal_bytes", budgets and {"budgets": budgets}), ("frontier", _frontier_figure(rows))]


def _live_points(rows, ctx, suffix: str):
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
        delta = None
        if kind != "reference" and all(s in ref for s in ids):
            delta = 100.0 * math.expm1(math.fsum(r["nll"] - ref[s]["nll"] for r, s in zip(rs, ids)) / len(ids))
        points.append({"arm": arm + suffix, "kind": kind, "segments": ids,
                       "bytes_per_token": math.fsum(r["bytes_per_token"] for r in rs) / len(rs),
                       "mean_kl": math.fsum(r["mean_kl"] for r in rs) / len(rs), "delta_pct": delta})
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


def _first_difference(where: str, got, want):
    """Where ``got`` (embedded) and ``want`` (derived) first differ, or None."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{where or 'data'}: fields {sorted(got) if isinstance(got, dict) else type(got).__name__} != {sorted(want)}"
        for k in want:
            d = _first_difference(f"{where}.{k}" if where else k, got[k], want[k])
            if d:
                return d
        return None
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"{where}: {len(got) if isinstance(got, list) else type(got).__name__} entries, audit derives {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            d = _first_difference(f"{where}[{i}]", g, w)
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


# ---------------------------------------------------------------------------------------------
# the page's words: what the run's builder (testbed/report_html.py) writes, restated here
# ---------------------------------------------------------------------------------------------

# The audit's own copy of the builder's static text (tests/test_report_html.py keeps them equal):
# the title, the style sheet (a changed one could hide words), the intro paragraph (its two counts
# are derived) and each kind of figure's caption (its {dist_word}, {block} and {segments} derived).
TITLE = "testbed run report: figures"
STYLE = ("body{font-family:sans-serif;max-width:70em;margin:1em auto;padding:0 1em;color:#222}"
         "figure{margin:1.5em 0;border-top:1px solid #ccc;padding-top:.5em}img{max-width:100%;height:auto}"
         "figcaption{font-size:.9em;max-width:60em}")
INTRO = ("<p>{rows} result rows, {figures} figures. The tables are in report.md; every plotted value is embedded "
         "beside its figure as JSON and recomputed from results.json by <code>python -m testbed.audit</code>. "
         "Statistics are over seeds, prompts or segments; rows inside one of them are not independent.</p>")
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
    return CAPTIONS[d["kind"]].format(dist_word=dist_word, block=d.get("block"), segments=segments)


def expected_page(n_rows: int, figures: list[dict], descriptions: dict) -> list[tuple[str, str]]:
    """The page the rows call for, as ``(what, line)`` pairs in order (``what`` names the line in a
    FAIL), every PNG payload ``IMG`` and every JSON block ``DATA`` (both checked on their own)."""
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
    a = k
    while a > 0 and not want[a - 1].isspace():
        a -= 1
    gb, wb = len(got) - s, len(want) - s
    while gb < len(got) and not got[gb].isspace():
        gb += 1
    while wb < len(want) and not want[wb].isspace():
        wb += 1
    return k, f"page says {got[a:gb][:100]!r}, the rows and the builder's text call for {want[a:wb][:100]!r}"


def check_text(ctx, text: str, figures: list[dict]) -> None:
    """Every line of the page but its PNG payloads and JSON blocks must be what the builder writes
    for these rows: one FAIL per differing line, naming the figure or section and its part."""
    rows = ctx.results.get("rows", []) if isinstance(ctx.results, dict) else []
    descriptions = {name: (p.get("description") or "") for name, p in ctx.protocol_copies.items()}
    want = expected_page(len(rows) if isinstance(rows, list) else 0, figures, descriptions)
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
    seen = set()
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
        diff = _first_difference("", data, expected[fig["key"]])
        if diff:
            ctx.fail(name, f"plotted data differs from results.json: {diff}")
    for key in expected:
        if key not in seen:
            ctx.fail(f"{REL} figure {key}", "missing: the rows of results.json call for it")
    try:
        check_text(ctx, text, list(expected.values()))
    except Exception as e:  # noqa: BLE001 - rows the other checks already refused; still a FAIL line
        ctx.fail(REL, f"the page's text cannot be derived from results.json ({type(e).__name__}: {str(e)[:200]})")
