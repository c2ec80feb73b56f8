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
  ``RTOL``/``ATOL``. The run's builder (testbed/report_html.py) is never imported.

What it cannot check: that the pixels of a PNG depict its data (a consistent forger can draw a
different picture beside the right numbers); docs/reliability.md lists that gap.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import struct
import zlib
from html.parser import HTMLParser

import numpy as np

from .common import TOLERANCES

__all__ = ["check_run", "derive_figures", "parse_report", "CSP"]

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

def _label(r):
    return r["distribution"] if "distribution" in r else r["case"]


def _ordered(values):
    seen = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


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


def _live_figure(rows, ctx):
    """One point per arm, or per (arm, context) where the study has several contexts (case ids
    ``c{n}-seg...``): labelled ``"arm @ n"``, the contexts in the order their rows come."""
    prefixes = _ordered([str(r["case"]).rpartition("-")[0] if "-" in str(r["case"]) else "" for r in rows])
    points, agreement = [], []
    for prefix in prefixes:
        sel = [r for r in rows if (str(r["case"]).rpartition("-")[0] if "-" in str(r["case"]) else "") == prefix]
        one = _live_points(sel, ctx, f" @ {prefix[1:]}" if len(prefixes) > 1 else "")
        if one is None:
            return [("live_quality", None)]
        points += one[0]
        agreement += one[1]
    return [("live_quality", {"arms": points, "block": STEP_BLOCK, "agreement": agreement})]


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
    """Per task and arm: teacher-forced EM accuracy and trial counts on the depth x length grid."""
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
            data = json.loads(fig["data"][0], parse_constant=lambda c: float("nan"))
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
