"""Audit of report.md: every table cell, and every number of its prose that comes from the run,
re-derived from results.json with the audit's own code.

The run's builders (testbed/report.py, the analyses' ``report`` functions, testbed/live.py) are
never imported: this module is a second statement, in numpy + stdlib, of what each table says
(written from their documented meaning), applied to the rows of ``results.json`` (which the
per-row checks re-derive from the stored arrays first). It reads report.md as text, splits it into
headings, paragraphs and GitHub pipe tables, and checks:

- **structure**: the ``## study`` sections are the manifest's protocols in order, each study's
  ``### analysis`` sections are its frozen protocol copy's analyses in order (``live_quality`` for a
  live study), and inside each section the sequence of paragraphs and tables is exactly the one
  the rows call for (a table per distribution where there is one, the by-head / by-layer tables
  only where the rows have heads / layers, ...). Each table's header must be the expected one,
  column for column, and its rows exactly the expected row keys (distribution, ablation, arm, ...)
  in the expected order: a row deleted, added, duplicated or moved is a FAIL line naming it;
- **every cell**: the audit formats its own value with the builder's documented format (digits,
  ``%``, thousands separators, ``n/a``) and requires the printed cell to be that text. A printed
  cell that looks like a plain decimal number is compared after Python's ``"g"`` format on both
  sides, which is what tabulate does to an all-numeric column (``0.97390`` prints ``0.9739``,
  ``4.0`` prints ``4``). Where the printed text differs, the cell still passes if formatting a value
  within ``TOLERANCES["report"]`` (1e-12 relative and absolute: the audit reads the same float64
  row values as the run's builder, only its summation order differs) of the audit's own gives the
  printed text, so only a value sitting on a rounding boundary of the printed digits can print
  either way; numbers the run and the audit both compute exactly (Wilcoxon p as a ratio of counts,
  byte ratios) get no such allowance. In effect every number is compared at its printed precision;
- **prose numbers from the run**: the header line's row count, creation time and environment (the
  manifest's), the exclusions (the manifest's), each study's description (the frozen protocol
  copy's text, word for word: it is the protocol author's prose, so the counts it states are not
  re-derived -- a test's cut-down copy of a protocol keeps the default's description), the
  coverage and block size of the block-predictability caption, the distribution and frame of each
  heatmap caption, the seed study's figures quoted beside the MX paths (the audit's own copy of
  those published numbers) and the live notes' segments, steps, prefill, layers, float16 bytes per
  token and the bootstrap's minimum segment count.

Re-derivations that rest on something other than the rows:

- Wilcoxon p-values are recomputed from the per-unit pairs with the audit's own exact two-sided
  signed-rank p (the null distribution of the positive-rank sum by enumeration over sign flips,
  average ranks for ties, zero differences dropped), the normal approximation only where scipy's
  ``method="auto"`` takes it (more than 50 pairs, or ties or zeros and more than 13 pairs);
- the live table's bootstrap interval (given from 5 segments on) is re-drawn with the audit's own
  resampling on numpy's seeded ``default_rng(0)``: it is deterministic given the seed and numpy's
  PCG64 stream, which numpy keeps stable in practice but does not promise across versions;
- **not re-derivable**: the live table's "ms / scored token" is wall time. It is recomputed from
  ``timings.json`` (the study's ``decode`` entries: seconds over scored tokens), which is hashed in
  the manifest but is itself a measurement: a forger who edits timings.json and report.md
  consistently is not caught (docs/audit.md, docs/reliability.md).

Not checked: the wording of static prose (captions, notes, the header's fixed sentences; only
each caption's opening words are compared, so that a table stands under its own caption), and the
column alignment padding of the tables. Each problem is one FAIL line naming the section, the
table, the row key, the column, the printed and the derived text.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter

import numpy as np

from .common import TOLERANCES, strict_json
from .completeness import ANALYSIS_DEFAULTS
from . import live_quality
from .retrieval import arms_of as retrieval_arms
from .retrieval import params_of as retrieval_params
from .retrieval_stats import mcnemar_p, wilson_bounds

__all__ = ["check_run", "derive_document", "parse_blocks", "parse_table", "wilcoxon_p", "cell_values", "REL"]

REL = "report.md"
REFERENCE_ARM = "dynamic_cache"
MIN_CI_SEGMENTS = 5  # the live bootstrap interval is given from this many segments on
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 2000, 0
TV_HIGH = 0.05  # the MX table's "rows TV>5%"
# The seed study's published figures that the MX section quotes (a real video DiT, one prompt and
# seed): the audit's own copy, so that a changed quotation fails.
SEED_STUDY = {"qk_tv_median": 0.0152, "qk_argmax": 0.9433, "p_tv_median": 0.0106, "p_zero_median": 0.0,
              "p_zero_mean": 0.0245, "p_rows_with_zero": 0.3663, "p_row_sum_median": 0.999392}
LIVE_HEADERS = ["arm", "mode, forwards", "perplexity", "Δ ppl vs DynamicCache", "95 % CI (segments)", "segments worse",
                "mean KL", "top-1 agree", "bytes / token", "÷ float16", "ms / scored token"]
EQUAL_HEADERS = ["arm", "compared with", "Δ ppl vs compared", "95 % CI (segments)", "segments better", "mean KL",
                 "compared's KL", "top-1 agree", "bytes / token", "bytes vs compared's"]
_FLOAT = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+|\d+(?:\.\d*)?[eE][+-]?\d+)")
_INT = re.compile(r"[+-]?\d+")
_SEP = re.compile(r":?-+:?")


# ---------------------------------------------------------------------------------------------
# expected cells: literal text and numbers with the format they are printed in
# ---------------------------------------------------------------------------------------------

class Num:
    """A number the audit derived and the format the report prints it in."""

    __slots__ = ("value", "fmt", "exact")

    def __init__(self, value: float, fmt, exact: bool = False):
        self.value = float(value)
        self.fmt = fmt
        self.exact = exact  # computed by the same exact operations as the run (no tolerance)

    def text(self, shift: int, tol: dict) -> str:
        x = self.value
        if shift:
            x += shift * (tol["atol"] + tol["rtol"] * abs(x))
        return self.fmt(x)


def _render(cell: tuple, tol: dict, shifts=None) -> str:
    out, k = [], 0
    for part in cell:
        if isinstance(part, Num) and not part.exact:
            out.append(part.text(shifts[k] if shifts else 0, tol))
            k += 1
        elif isinstance(part, Num):
            out.append(part.text(0, tol))
        else:
            out.append(part)
    return "".join(out)


def _norm(s: str) -> str:
    """A plain decimal number as tabulate prints a numeric column (Python's "g"); anything else as is."""
    s = s.strip()
    if _FLOAT.fullmatch(s):
        return format(float(s), "g")
    if _INT.fullmatch(s):
        return str(int(s))
    return s


def cell_ok(printed: str, cell: tuple, tol: dict) -> bool:
    """Whether ``printed`` is the text of ``cell``, some value within ``tol`` of each number allowed."""
    got = _norm(printed)
    if got == _norm(_render(cell, tol)):
        return True
    n = sum(isinstance(p, Num) and not p.exact for p in cell)
    if not n or n > 4:
        return False
    return any(got == _norm(_render(cell, tol, s)) for s in itertools.product((-1, 0, 1), repeat=n))


def _isnum(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not (isinstance(x, float) and math.isnan(x))


def _pct_fmt(digits: int):
    return lambda v: f"{100 * v:.{digits}f}%"


def pct(x, digits: int = 2, none: str = "n/a") -> tuple:
    return (Num(x, _pct_fmt(digits)),) if _isnum(x) else (none,)


def fixed(x, digits: int, none: str = "n/a", exact: bool = False) -> tuple:
    return (Num(x, lambda v: f"{v:.{digits}f}", exact),) if _isnum(x) else (none,)


def _p_text(v) -> str:
    return f"{v:.4f}" if v >= 1e-4 else f"{v:.1e}"


def pvalue(x, exact: bool = False, none: str = "n/a") -> tuple:
    """A p-value as the report prints it: four decimals, two significant digits below 0.0001."""
    return (Num(x, _p_text, exact),) if _isnum(x) else (none,)


def text(s) -> tuple:
    return ("" if s is None else str(s),)


def spread(xs, digits: int = 2) -> tuple:
    """``median [min-max]`` of the non-missing values, each a percentage."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return ("n/a",)
    f = _pct_fmt(digits)
    return (Num(_median(xs), f), " [", Num(min(xs), f), "-", Num(max(xs), f), "]")


def cell_values(cell: tuple) -> list[float]:
    """The numbers of an expected cell (for tests that compare other documents with the run)."""
    return [p.value for p in cell if isinstance(p, Num)]


# ---------------------------------------------------------------------------------------------
# small statistics, the audit's own
# ---------------------------------------------------------------------------------------------

def _ordered(values) -> list:
    seen = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def _median(xs):
    xs = sorted(x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x)))
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return math.fsum(xs) / len(xs) if xs else float("nan")


def _pooled(rows, key):
    """Row-weighted mean over cases of the rows that have ``key``."""
    rs = [r for r in rows if r.get(key) is not None]
    n = sum(r["rows"] for r in rs)
    return None if not n else math.fsum(r[key] * r["rows"] for r in rs) / n


def _label(r):
    return r["distribution"] if "distribution" in r else r["case"]


def _unit(r) -> str:
    """The independent unit of a row: its prompt, else its seed, else its case."""
    for key in ("prompt", "seed"):
        if r.get(key) is not None:
            return f"{key}={r[key]}"
    return f"case={r['case']}"


def _per_unit(rows, field) -> dict:
    acc: dict = {}
    for r in rows:
        if r.get(field) is not None:
            acc.setdefault(_unit(r), []).append(r[field])
    return {u: math.fsum(v) / len(v) for u, v in acc.items()}


def wilcoxon_p(x, y) -> tuple:
    """``(p, exact)``: the two-sided Wilcoxon signed-rank p of paired values (None with fewer than
    two non-zero differences) and whether it is an exact count (a ratio of integers, printed with
    no tolerance: p = 2/2^6 = 0.03125 sits exactly on a rounding boundary of 4 decimals).

    Zero differences are dropped (Wilcox); |d| is ranked with average ranks for ties.
    Exact: the positive-rank sum's null distribution over all 2^m sign flips, counted with doubled
    (integer) ranks, p = min(1, 2 min(P(T <= t), P(T >= t))). Where scipy's ``method="auto"`` falls
    back to the normal approximation (over 50 pairs; ties or zeros and over 13 pairs), that one,
    without continuity correction and with the tie correction of the variance."""
    pairs = [(float(a), float(b)) for a, b in zip(x, y) if math.isfinite(float(a)) and math.isfinite(float(b))]
    d = [a - b for a, b in pairs]
    nz = [v for v in d if v != 0]
    if len(nz) < 2:
        return None, True
    order = sorted(range(len(nz)), key=lambda i: abs(nz[i]))
    rank2 = [0] * len(nz)  # twice the average rank: an integer
    ties = []
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and abs(nz[order[j + 1]]) == abs(nz[order[i]]):
            j += 1
        for k in range(i, j + 1):
            rank2[order[k]] = i + j + 2
        ties.append(j - i + 1)
        i = j + 1
    t2 = sum(r for r, v in zip(rank2, nz) if v > 0)
    m = len(nz)
    has_ties = any(t > 1 for t in ties)
    n_zero = len(d) - m
    if len(d) > 50 or ((has_ties or n_zero) and len(d) > 13):
        mean = m * (m + 1) / 4
        var = (m * (m + 1) * (2 * m + 1) - sum(t ** 3 - t for t in ties) / 2) / 24
        z = (t2 / 2 - mean) / math.sqrt(var)
        return math.erfc(abs(z) / math.sqrt(2)), False
    counts = {0: 1}
    for r in rank2:
        nxt = dict(counts)
        for s, c in counts.items():
            nxt[s + r] = nxt.get(s + r, 0) + c
        counts = nxt
    total = 2 ** m
    le = sum(c for s, c in counts.items() if s <= t2)
    ge = sum(c for s, c in counts.items() if s >= t2)
    return min(1.0, 2 * min(le, ge) / total), True


def _bootstrap(x: np.ndarray):
    """95 % percentile interval of the mean of ``x`` over its units, resampled with replacement
    (numpy's default_rng(0), 2,000 resamples); None below MIN_CI_SEGMENTS units."""
    if x.size < MIN_CI_SEGMENTS:
        return None
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    draws = rng.integers(0, x.size, size=(BOOTSTRAP_RESAMPLES, x.size))
    means = x[draws].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


# ---------------------------------------------------------------------------------------------
# the expected blocks of each analysis section
# ---------------------------------------------------------------------------------------------

def P(name: str, prefix: str, facts=()) -> dict:
    """A paragraph that must start with ``prefix`` and state each fact: (what, regex with one
    group, expected cell)."""
    return {"kind": "para", "name": name, "prefix": prefix, "facts": list(facts)}


def T(name: str, headers: list, key: int, rows: list) -> dict:
    return {"kind": "table", "name": name, "headers": list(headers), "key": key, "rows": rows}


def _observation(rows, params) -> list:
    cases = [r for r in rows if r.get("scope") == "case"]
    dists = _ordered(_label(r) for r in cases)
    summ = []
    for dist in dists:
        sel = [r for r in cases if _label(r) == dist]
        d = {"distribution": dist, "cases": len(sel), "rows": sum(r["rows"] for r in sel)}
        for key in ("support_le_10", "support_le_25", "support_ge_75", "top10_ge_80", "zero_rate_mean", "history_lt_10",
                    "history_gt_50", "uniform_history", "jaccard_query", "jaccard_block", "sink_mass", "middle_mass",
                    "recent_mass", "current_mass", "history_mass", "jaccard_query_null_pair",
                    "jaccard_query_null_shuffled", "head_set_jaccard", "head_set_jaccard_null", "head_set_mass",
                    "head_set_mass_null", "head_set_size"):
            d[key] = _pooled(sel, key)
        paired = [r for r in sel if r.get("jaccard_query") is not None and r.get("jaccard_query_null_pair") is not None]
        d["over"] = (sum(r["jaccard_query"] > r["jaccard_query_null_pair"] for r in paired), len(paired))
        fit = [r for r in sel if r.get("head_set_jaccard") is not None and r.get("head_set_jaccard_null") is not None]
        d["fit_over"] = (sum(r["head_set_jaccard"] > r["head_set_jaccard_null"] for r in fit), len(fit))
        d["block"] = ", ".join(str(b) for b in _ordered(r.get("block") for r in sel))
        for key in ("support_q10", "support_q25", "support_median", "support_q75", "support_q90", "history_q10",
                    "history_median", "history_q90", "top1_median", "top5_median", "top10_median"):
            d[key] = _median([r.get(key) for r in sel])
        summ.append(d)
    out = [P("summary", "Sparsity and concentration of the float64 reference attention."),
           T("sparsity", ["distribution", "cases", "rows", "support q10", "q25", "median", "q75", "q90", "<=10%", "<=25%",
                          ">=75%", "top1% mass", "top5%", "top10%", "top10%>=80%", "fp32 strict zeros"], 1,
             [[text(d["distribution"]), text(d["cases"]), text(d["rows"])]
              + [pct(d[k]) for k in ("support_q10", "support_q25", "support_median", "support_q75", "support_q90",
                                     "support_le_10", "support_le_25", "support_ge_75", "top1_median", "top5_median",
                                     "top10_median", "top10_ge_80")] + [pct(d["zero_rate_mean"], 3)] for d in summ]),
           P("region", "Region mass (pooled mean) against the uniform expectation"),
           T("region mass", ["distribution", "sink", "middle", "recent", "current", "history", "uniform history",
                             "history q10", "median", "q90", "history <10%", "history >50%"], 1,
             [[text(d["distribution"])] + [pct(d[k]) for k in ("sink_mass", "middle_mass", "recent_mass", "current_mass",
                                                               "history_mass", "uniform_history", "history_q10",
                                                               "history_median", "history_q90", "history_lt_10",
                                                               "history_gt_50")] for d in summ]),
           P("block predictability", "Block predictability: mean Jaccard overlap", [
               ("coverage", r"fewest blocks carrying (\S+) of a row's mass", pct(params["coverage"], 0)),
               ("block tokens", r"a block is a latent frame, or (\S+) tokens\)", text(params["block_tokens"]))]),
           T("block predictability", ["distribution", "Jaccard neighbouring queries", "random pair (null)",
                                      "position-shuffled (null)", "excess over random pair", "cases above",
                                      "Jaccard neighbouring query blocks"], 1,
             [[text(d["distribution"]), pct(d["jaccard_query"], 1), pct(d["jaccard_query_null_pair"], 1),
               pct(d["jaccard_query_null_shuffled"], 1),
               ("n/a",) if d["jaccard_query"] is None or d["jaccard_query_null_pair"] is None else
               (Num(d["jaccard_query"] - d["jaccard_query_null_pair"], lambda v: f"{100 * v:+.1f} pts"),),
               text(f"{d['over'][0]}/{d['over'][1]}"), pct(d["jaccard_block"], 1)] for d in summ]),
           P("head set", "Head-level block predictability: can a head's key blocks be fixed ahead of its queries?", [
               ("block tokens", r"else (\S+) tokens; cases above", text(params["block_tokens"]))]),
           T("head set", ["distribution", "key block", "head set (blocks)", "Jaccard with head set", "random set (null)",
                          "mass kept by head set", "random set mass (null)", "cases above"], 1,
             [[text(d["distribution"]), text(d["block"]), fixed(d["head_set_size"], 1), pct(d["head_set_jaccard"], 1),
               pct(d["head_set_jaccard_null"], 1), pct(d["head_set_mass"], 1), pct(d["head_set_mass_null"], 1),
               text(f"{d['fit_over'][0]}/{d['fit_over'][1]}")] for d in summ])]
    heads = [r for r in rows if r.get("scope") == "head"]
    if heads:
        acc: dict = {}
        for r in heads:
            acc.setdefault((_label(r), r["head"]), []).append(r)
        trs = []
        for (dist, hh), rs in acc.items():
            conc = rs[0].get("concentration")
            trs.append([text(dist), text(hh), text(None if conc is None else format(float(conc), "g")), text(len(rs)),
                        spread([r.get("support_median") for r in rs]), pct(_pooled(rs, "top10_mean")),
                        pct(_pooled(rs, "sink_mass")), pct(_pooled(rs, "current_mass")), pct(_pooled(rs, "history_mass")),
                        pct(_pooled(rs, "jaccard_query"), 1)])
        out += [P("by head", "By head (median over cases"),
                T("by head", ["distribution", "head", "concentration", "cases", "median support [range over cases]",
                              "mean top10%", "sink", "current", "history", "Jaccard queries"], 2, trs)]
    layers = [r for r in cases if r.get("layer") is not None]
    if layers:
        acc = {}
        for r in layers:
            acc.setdefault((_label(r), r["layer"]), []).append(r)
        trs = [[text(dist), text(layer), text(len(rs)), pct(_pooled(rs, "sink_mass")), pct(_pooled(rs, "recent_mass")),
                pct(_pooled(rs, "current_mass")), pct(_pooled(rs, "history_mass")),
                pct(_median([r["support_median"] for r in rs]))]
               for (dist, layer), rs in sorted(acc.items(), key=lambda kv: (str(kv[0][0]), kv[0][1]))]
        out += [P("by layer", "By layer (pooled over the layer's cases)."),
                T("by layer", ["distribution", "layer", "cases", "sink", "recent", "current", "history", "median support"],
                  2, trs)]
    trs = []
    for dist in dists:
        sel = [r for r in cases if _label(r) == dist]
        blocks = [r["by_query_block"] for r in sel]
        for i in range(min(len(b["block"]) for b in blocks)):
            n = sum(b["rows"][i] for b in blocks)
            hist = [b["history_mass"][i] for b in blocks]
            hm = None if any(h is None for h in hist) else math.fsum(h * b["rows"][i] for h, b in zip(hist, blocks)) / n
            trs.append([text(dist), text(i), text(n), pct(hm), pct(_median([b["support_median"][i] for b in blocks]))])
    out += [P("by position", "By position: query block (frame) of the chunk"),
            T("by position", ["distribution", "query block", "rows", "history mass", "median support (median over cases)"],
              2, trs)]
    for dist in dists:
        sel = [r for r in cases if _label(r) == dist]
        maps = [r.get("heatmap") for r in sel]
        if any(m is None for m in maps) or len({(len(m), len(m[0])) for m in maps}) != 1:
            continue
        stack = np.asarray(maps, dtype=np.float64)
        mean = stack.sum(axis=0) / len(maps)
        fmt = lambda v: f"{100 * v:.1f}"  # noqa: E731
        out += [P(f"heatmap {dist}", "Temporal heatmap of `", [
                    ("distribution", r"^Temporal heatmap of `([^`]*)`", text(dist)),
                    ("block tokens", r"query block x key block \((\S+) tokens each\)", text(sel[0]["frame"]))]),
                T(f"heatmap {dist}", ["query \\ key"] + [f"k{j}" for j in range(mean.shape[1])], 1,
                  [[text(f"q{i}")] + [(Num(x, fmt),) for x in row] for i, row in enumerate(mean.tolist())])]
    return out


def holm(ps) -> list:
    """Holm's step-down adjustment, the audit's own: of the m p-values that are not None, the i-th
    smallest becomes the largest of min(1, (m - j + 1) p_(j)) over j <= i; None stays None."""
    order = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])
    adjusted = [None] * len(ps)
    top = 0.0
    for rank, i in enumerate(order):
        top = max(top, min(1.0, (len(order) - rank) * ps[i]))
        adjusted[i] = top
    return adjusted


def _holm_cells(lines: list, col: int) -> None:
    """Replace the ``(p, exact)`` placeholder at ``col`` of each table line by its Holm-adjusted
    cell, over the family of every test of the table. Exact (no tolerance) when every p of the
    family is: integer multiples, min and max of exact values are exact."""
    ps = [line[col][0] for line in lines]
    exact = all(line[col][1] for line in lines)
    for line, adj in zip(lines, holm(ps)):
        line[col] = pvalue(adj, exact=exact)


def _ablation(rows, params) -> list:
    arms = _ordered(r["arm"] for r in rows)
    names = _ordered(r["ablation"] for r in rows)
    dists = _ordered(_label(r) for r in rows)
    first = arms[0]
    trs = []
    for dist in dists:
        sel = [r for r in rows if _label(r) == dist and r["arm"] == first]
        for name in names:
            rs = [r for r in sel if r["ablation"] == name]
            app = [r for r in rs if r["applicable"]]
            if not app:
                trs.append([text(dist), text(name), text(f"0/{len(rs)}"), ("n/a",), ("n/a",), ("n/a",), ("n/a",), ("-",)])
                continue
            cos = list(_per_unit(app, "cosine").values())
            trs.append([text(dist), text(name), text(f"{len(app)}/{len(rs)}"),
                        spread(list(_per_unit(app, "dropped_mass").values())), spread(list(_per_unit(app, "tv").values())),
                        spread(list(_per_unit(app, "rel_l2").values())), fixed(_median(cos), 5) if cos else ("n/a",),
                        text(f"{sum(r['undefined_rows'] for r in app)}/{sum(r['rows'] for r in app)}")])
    out = [P("damage", "Output damage of each ablation on the float32 cache"),
           T("ablation damage", ["distribution", "ablation", "applicable", "tau (dropped mass)", "TV(P,P')", "rel-L2",
                                 "cosine (median)", "undefined rows"], 2, trs)]
    pairs = []
    for dist in dists:
        sel = [r for r in rows if _label(r) == dist and r["arm"] == first and r["applicable"]]
        for ctrl in [n for n in names if n.startswith("control_")]:
            target = "drop_" + ctrl[len("control_"):]
            tgt = [r for r in sel if r["ablation"] == target]
            con = [r for r in sel if r["ablation"] == ctrl]
            a, b = _per_unit(tgt, "rel_l2"), _per_unit(con, "rel_l2")
            units = sorted(set(a) & set(b))
            if not units:
                if a:  # the ablation ran, no valid control: the run says so in a row of its own
                    pairs.append([text(dist), text(target), pct(_median(list(a.values())), 3), text(ctrl), ("n/a",),
                                  ("n/a",), ("n/a",), ("n/a",), ("n/a",), text("0/0"), ("n/a",), (None, True),
                                  text("none valid")])
                continue
            ta, tb = _per_unit(tgt, "dropped_mass"), _per_unit(con, "dropped_mass")
            pa, pb = _per_unit(tgt, "rel_l2_per_mass"), _per_unit(con, "rel_l2_per_mass")
            kinds = sorted({r["control_kind"] for r in con})
            p, exact = wilcoxon_p([a[u] for u in units], [b[u] for u in units])
            pairs.append([text(dist), text(target), pct(_median([a[u] for u in units]), 3), text(ctrl),
                          pct(_median([b[u] for u in units]), 3), pct(_median([ta.get(u) for u in units])),
                          pct(_median([tb.get(u) for u in units])), fixed(_median([pa.get(u) for u in units]), 3),
                          fixed(_median([pb.get(u) for u in units]), 3),
                          text(f"{sum(1 for u in units if a[u] > b[u])}/{len(units)}"), pvalue(p, exact=exact),
                          (p, exact), text(", ".join(kinds))])
    _holm_cells(pairs, 11)
    if pairs:
        out += [P("controls", "Each ablation next to its same-size control"),
                T("ablation vs control", ["distribution", "ablation", "rel-L2", "control", "control rel-L2", "tau",
                                          "control tau", "rel-L2 / tau", "control rel-L2 / tau", "ablation worse",
                                          "Wilcoxon p", "Holm p", "control keys"], 2, pairs)]
    mass = []
    for dist in dists:
        sel = [r for r in rows if _label(r) == dist and r["arm"] == first and r["applicable"]]
        for mc in [n for n in names if n.startswith("mass_control_")]:
            region = mc[len("mass_control_"):]
            tgt = [r for r in sel if r["ablation"] == "drop_" + region]
            con = [r for r in sel if r["ablation"] == mc]
            if not tgt or not con:
                continue
            size = _per_unit([r for r in sel if r["ablation"] == "control_" + region], "rel_l2")
            whole = _per_unit(tgt, "rel_l2")
            a, b = _per_unit(con, "target_rel_l2_matched"), _per_unit(con, "rel_l2")
            units = sorted(set(a) & set(b))
            n_match = sum(r["matched_rows"] for r in con)
            n_rows = sum(r["rows"] for r in con)
            with_rows = [r for r in con if r["matched_rows"]]
            mean = (sum(r["mass_mismatch_mean"] * r["matched_rows"] for r in with_rows) / n_match) if n_match else None
            worst = max((r["mass_mismatch_max"] for r in with_rows), default=None)
            line = [text(dist), text("drop_" + region), pct(_median(list(whole.values())), 3),
                    pct(_median(list(size.values())), 3) if size else ("n/a",)]
            if units:
                ta, tb = _per_unit(con, "target_mass"), _per_unit(con, "dropped_mass")
                p, exact = wilcoxon_p([a[u] for u in units], [b[u] for u in units])
                line += [pct(_median([a[u] for u in units]), 3), pct(_median([b[u] for u in units]), 3),
                         pct(_median([ta.get(u) for u in units])), pct(_median([tb.get(u) for u in units]))]
            else:
                p, exact = None, True
                line += [("n/a",), ("n/a",), ("n/a",), ("n/a",)]
            line += [text(f"{n_match}/{n_rows}"), pct(mean, 3) + (" / ",) + pct(worst, 3),
                     text(f"{sum(1 for u in units if a[u] > b[u])}/{len(units)}"), pvalue(p, exact=exact), (p, exact)]
            mass.append(line)
    _holm_cells(mass, 12)
    if mass:
        out += [P("mass controls", "Each ablation next to its size-matched and its mass-matched control"),
                T("ablation vs mass-matched control", ["distribution", "ablation", "rel-L2", "size-matched rel-L2",
                                                       "rel-L2 (matched rows)", "mass-matched rel-L2",
                                                       "tau (matched rows)", "mass-matched tau", "matched rows",
                                                       "mass mismatch mean / max", "ablation worse", "Wilcoxon p",
                                                       "Holm p"], 2, mass)]
    if len(arms) > 1:
        out.append(P("quantization", "Quantization meets ablation"))
        for dist in dists:
            trs = []
            for name in names:
                line = [text(dist), text(name)]
                for arm in arms:
                    app = [r for r in rows if _label(r) == dist and r["arm"] == arm and r["ablation"] == name
                           and r["applicable"]]
                    line.append(pct(_median(list(_per_unit(app, "rel_l2").values())), 3) if app else ("n/a",))
                trs.append(line)
            line = [text(dist), text("cache payload / float32")]
            half = [text(dist), text("cache payload / float16 or bfloat16")]
            for arm in arms:
                rs = [r for r in rows if _label(r) == dist and r["arm"] == arm]
                ratio = sum(r["payload_bytes"] for r in rs) / max(1, sum(r["baseline_bytes"] for r in rs))
                line.append(fixed(ratio, 3, exact=True))  # integers and one division, as the run
                half.append(fixed(2 * ratio, 3, exact=True))  # a 16-bit cache holds half the float32 bytes
            trs.append(line)
            trs.append(half)
            out.append(T(f"quantization {dist}", ["distribution", "ablation"] + arms, 2, trs))
    return out


def _mx_paths(rows, params) -> list:
    def pooled(sel, key):
        parts = [r["per_row"][key] for r in sel if r["per_row"].get(key) is not None]
        return np.asarray([x for part in parts for x in part], dtype=np.float64) if parts else None

    def p(x, digits=2):
        return pct(x, digits, none="-")

    def key(r):
        return r["path"], r["rotation"], r["scale_rule"], r["scheme"]

    arms = _ordered(key(r) for r in rows)
    trs = []
    for arm in arms:
        sel = [r for r in rows if key(r) == arm]
        tv = pooled(sel, "tv")
        n = sum(r["rows"] for r in sel)
        z = pooled(sel, "numerical_zero_rate")
        s = pooled(sel, "row_sum")
        trs.append([text(arm[0]), text(arm[1]), text(arm[2]), text(arm[3]), text(len(sel)), text(n),
                    p(float(np.median(tv))), p(float(np.mean(tv))), p(float(np.quantile(tv, 0.95))),
                    p(float(np.mean(tv > TV_HIGH))),
                    p(math.fsum(r["argmax_agreement"] * r["rows"] for r in sel) / n),
                    p(math.fsum(r["argmax_tie"] * r["rows"] for r in sel) / n),
                    ("-",) if z is None else p(float(np.median(z))), ("-",) if z is None else p(float(np.mean(z))),
                    ("-",) if z is None else p(float(np.mean(z > 0))),
                    ("-",) if s is None else fixed(float(np.median(s)), 6),
                    p(_mean([r["block_saturation"] for r in sel])),
                    p(_mean([r["rel_l2"] for r in sel]), 3)])
    dtrs = []
    for dist in _ordered(r.get("distribution", "-") for r in rows):
        line = [text(dist)]
        for arm in arms:
            tv = pooled([r for r in rows if r.get("distribution", "-") == dist and key(r) == arm], "tv")
            line.append(("-",) if tv is None else p(float(np.median(tv))))
        dtrs.append(line)
    several = len({a[2] for a in arms}) > 1
    seed = SEED_STUDY
    facts = [("seed study's Q/K median TV", r"Q/K median TV (\S+),", pct(seed["qk_tv_median"])),
             ("seed study's argmax agreement", r"argmax agreement (\S+) \(", pct(seed["qk_argmax"])),
             ("seed study's P path median TV", r"P path median TV (\S+),", pct(seed["p_tv_median"])),
             ("seed study's zero-rate median", r"numerical-zero rate median (\S+) and", pct(seed["p_zero_median"])),
             ("seed study's zero-rate mean", r"numerical-zero rate median \S+ and mean (\S+),", pct(seed["p_zero_mean"])),
             ("seed study's rows with a zero", r", (\S+) rows with a zero", pct(seed["p_rows_with_zero"])),
             ("seed study's row-sum median", r"row-sum median (\S+?)\.(?:\s|$)", text(seed["p_row_sum_median"]))]
    return [P("pooled", "Pooled over every (query head, query) row of every input"),
            T("MX paths", ["path", "rotation", "scale rule", "scheme", "inputs", "rows", "median TV", "mean TV",
                           "p95 TV", "rows TV>5%", "argmax agree", "argmax tie", "zero-rate median", "zero-rate mean",
                           "rows with a zero", "row-sum median", "blocks clamped", "mean rel-L2"], 4, trs),
            P("per distribution", "Median TV per distribution."),
            T("median TV per distribution", ["distribution"] + [f"{a} {b}" + (f" {c}" if several else "")
                                                                for a, b, c, _ in arms], 1, dtrs),
            P("seed study", "Seed study for comparison", facts)]


def _residual_window(rows, params) -> list:
    arms = _ordered(r["arm"] for r in rows)
    kept = [a for a in arms if a.startswith("R=") and a != "R=0"] + [a for a in arms if a.startswith("first")]
    trs = []
    for dist in _ordered(_label(r) for r in rows):
        sel = [r for r in rows if _label(r) == dist]
        line = [text(dist), text(len({r["case"] for r in sel}))]
        line += [pct(_mean([r["rel_l2"] for r in sel if r["arm"] == a]), 3, none="nan%") for a in arms]
        line += [pct(_mean([r["protected_mass"] for r in sel if r["arm"] == a]), 2, none="nan%") for a in kept]
        line.append(pct(_mean([r["focus_mass"] for r in sel if r["arm"] == arms[0]]), 2, none="-"))
        trs.append(line)
    out = [P("rel-L2", "Mean attention-output relative L2 per input"),
           T("rel-L2 per distribution", ["distribution", "inputs"] + [f"rel-L2 {a}" for a in arms]
             + [f"mass kept fp32 {a}" for a in kept] + ["focus mass"], 1, trs)]
    sizes = sorted({r["n"] for r in rows if "n" in r})
    if sizes:
        btrs = []
        for n in sizes:
            for a in arms:
                sel = [r for r in rows if r.get("n") == n and r["arm"] == a]
                if sel:
                    pay, base = sel[0]["payload_bytes"], sel[0]["baseline_bytes"]
                    half = base // 2
                    btrs.append([text(n), text(a), text(f"{pay:,}"), text(f"{base:,}"),
                                 (Num(1.0 - pay / base, lambda v: f"{100 * v:.1f}%", exact=True),), text(f"{half:,}"),
                                 (Num(1.0 - pay / half, lambda v: f"{100 * v:.1f}%", exact=True),)])
        out += [P("payload", "Payload bytes of K+V"),
                T("payload bytes", ["N", "arm", "payload B", "float32 K+V B", "reduction", "16-bit K+V B",
                                    "reduction vs 16-bit"], 2, btrs)]
    return out


def _live(rows, live: dict, timings: list, study: str) -> list:
    """The live section: per context of the study (``live_quality.views``) a table and its notes,
    each led by a paragraph naming the context where there are several."""
    if not rows:
        return [P("no rows", "(no rows: the live study was excluded")]
    vs = live_quality.views(live)
    if len(vs) == 1:  # one context (a protocol's prefill, or "contexts" of one length): no context paragraph
        return _live_context(rows, vs[0][1], timings, study)
    out = []
    for prefix, v in vs:
        n = v["prefill"] + live["steps"]
        sel = [r for r in rows if str(r.get("case", "")).startswith(prefix + "-")]
        times = [t for t in timings if isinstance(t, dict) and t.get("context") == n]
        out.append(P(f"context {n}", f"**Context {n:,} tokens** ({v['prefill']:,}-token prefill, then "
                                     f"{live['steps']:,} scored tokens)"))
        out += [dict(b, name=f"{b['name']} ({n})") for b in _live_context(sel, v, times, study)]
    return out


def _live_context(rows, live: dict, timings: list, study: str) -> list:
    if not rows:
        return [P("no rows", "(no rows: the live study was excluded")]
    dims = live_quality.model_dims(live, rows[0])
    # float16 bytes per token: the reference's (DynamicCache, sliding layers as it keeps them) halved
    refs = [r["bytes_per_token"] for r in rows if r.get("kind") == "reference"]
    f16 = float(np.mean(refs)) / 2 if refs else dims["layers"] * dims["kv_heads"] * dims["head_dim"] * 2 * 2
    by_arm: dict = {}
    for r in rows:
        by_arm.setdefault(r["arm"], {})[r["case"]] = r
    ref = by_arm.get(REFERENCE_ARM, {})
    secs: dict = {}
    for t in timings:
        if isinstance(t, dict) and t.get("study") == study and t.get("op") == "decode" and t.get("arm") is not None \
                and t.get("scored_tokens"):
            secs.setdefault(t["arm"], []).append((t["seconds"], t["scored_tokens"]))
    entries = []
    for arm, segs in by_arm.items():
        ids = sorted(segs)
        rs = [segs[s] for s in ids]
        nll = np.asarray([r["nll"] for r in rs], dtype=np.float64)
        e = {"arm": arm, "first": rs[0], "segments": len(ids), "ppl": math.exp(math.fsum(nll) / nll.size),
             "kl": _mean([r["mean_kl"] for r in rs]), "top1": _mean([r["top1_agreement"] for r in rs]),
             "bpt": float(np.mean([r["bytes_per_token"] for r in rs]))}
        if arm != REFERENCE_ARM and all(s in ref for s in ids):
            d = nll - np.asarray([ref[s]["nll"] for s in ids], dtype=np.float64)
            e["delta"] = 100.0 * math.expm1(math.fsum(d) / d.size)
            ci = _bootstrap(d)
            e["ci"] = None if ci is None else (100.0 * math.expm1(ci[0]), 100.0 * math.expm1(ci[1]))
            e["worse"] = int((d > 0).sum())
        entries.append(e)
    trs = []
    for e in sorted(entries, key=lambda e: (-e["bpt"], e["arm"])):
        ms = secs.get(e["arm"])
        ms = 1000 * math.fsum(s for s, _ in ms) / sum(n for _, n in ms) if ms else float("nan")
        signed = lambda v: f"{v:+.2f}"  # noqa: E731
        trs.append([text(e["arm"]), text(f"{e['first']['mode']}, {e['first']['forwards']}"), fixed(e["ppl"], 4),
                    ("—",) if "delta" not in e else (Num(e["delta"], signed), " %"),
                    ("—",) if not e.get("ci") else ("[", Num(e["ci"][0], signed), ", ", Num(e["ci"][1], signed), "]"),
                    ("—",) if "worse" not in e else text(f"{e['worse']}/{e['segments']}"), fixed(e["kl"], 5),
                    (Num(e["top1"], lambda v: f"{100 * v:.2f} %"),), (Num(e["bpt"], lambda v: f"{v:,.0f}"),),
                    fixed(e["bpt"] / f16, 3), fixed(ms, 1, none="nan")])
    out = [T("live quality", LIVE_HEADERS, 1, trs)]
    etrs = []
    for arm in sorted(by_arm):
        budget = live_quality.budget_of(arm)  # the equal-bytes pairing (live_quality.BUDGET_VERSUS)
        other = None if budget is None else live_quality.versus_of(budget, by_arm)
        if other is None or other == arm or other not in by_arm or set(by_arm[arm]) != set(by_arm[other]):
            continue
        ids = sorted(by_arm[arm])
        a, b = [by_arm[arm][s] for s in ids], [by_arm[other][s] for s in ids]
        d = np.asarray([x["nll"] for x in a], dtype=np.float64) - np.asarray([y["nll"] for y in b], dtype=np.float64)
        ci = _bootstrap(d)
        signed = lambda v: f"{v:+.2f}"  # noqa: E731
        bpt, vbpt = float(np.mean([x["bytes_per_token"] for x in a])), float(np.mean([y["bytes_per_token"] for y in b]))
        etrs.append([text(arm), text(other), (Num(100.0 * math.expm1(math.fsum(d) / d.size), signed), " %"),
                     ("—",) if ci is None else ("[", Num(100.0 * math.expm1(ci[0]), signed), ", ",
                                                Num(100.0 * math.expm1(ci[1]), signed), "]"),
                     text(f"{int((d < 0).sum())}/{len(ids)}"), fixed(_mean([x["mean_kl"] for x in a]), 5),
                     fixed(_mean([y["mean_kl"] for y in b]), 5), (Num(_mean([x["top1_agreement"] for x in a]),
                                                                      lambda v: f"{100 * v:.2f} %"),),
                     (Num(bpt, lambda v: f"{v:,.0f}"),), (Num(100 * (bpt / vbpt - 1), lambda v: f"{v:+.3f}"), " %")])
    notes = P("notes", "", [
                ("segments", r"^(\S+) segments ×", text(len({r["case"] for r in rows}))),
                ("steps", r"× (\S+) teacher-forced steps", text(live["steps"])),
                ("prefill", r"after a (\S+)-token prefill", text(live["prefill"])),
                ("layers", r"the whole cache of all (\S+) layers", text(dims["layers"])),
                ("float16 bytes per token", r"float16 K\+V would be (\S+) B/token", text(f"{f16:,.0f}")),
                ("bootstrap minimum", r"given from (\S+) segments on", text(MIN_CI_SEGMENTS))])
    out.append(notes)
    if etrs:
        out += [P("equal bytes", "Per-head precision at equal bytes"), T("equal bytes", EQUAL_HEADERS, 1, etrs)]
    return out


RETRIEVAL_HEADERS = ["arm", "length", "trials", "TF exact match", "Wilson 95 %", "greedy exact match",
                     "mean answer log-prob", "McNemar p vs reference (b/c)"]


def _retrieval(rows, p: dict) -> list:
    """Per task a table of (arm, length) over trials: teacher-forced EM with its Wilson interval,
    greedy EM, the mean answer log-prob and the exact McNemar p of the arm against the reference
    on the same trials; then the notes' trial counts."""
    if not rows:
        return [P("no rows", "(no rows: the retrieval study was excluded")]
    one = lambda v: f"{100 * v:.1f}"  # noqa: E731
    out = []
    for task in _ordered(r["task"] for r in rows):
        trs = []
        for arm in retrieval_arms(p):
            for length in sorted({r["length"] for r in rows if r["task"] == task and r["arm"] == arm}):
                cell = {r["case"]: r for r in rows if r["task"] == task and r["arm"] == arm and r["length"] == length}
                ref = {r["case"]: r for r in rows if r["task"] == task and r["arm"] == REFERENCE_ARM
                       and r["length"] == length}
                n = len(cell)
                k = sum(1 for r in cell.values() if r["tf_em"] == 1)
                g = sum(1 for r in cell.values() if r["greedy_em"] == 1)
                lo, hi = wilson_bounds(k, n)
                if arm == REFERENCE_ARM or not set(cell) <= set(ref):
                    test = ("—",)
                else:
                    b = sum(1 for c, r in cell.items() if ref[c]["tf_em"] == 1 and r["tf_em"] != 1)
                    c_ = sum(1 for c, r in cell.items() if ref[c]["tf_em"] != 1 and r["tf_em"] == 1)
                    test = (Num(mcnemar_p(b, c_), _p_text), f" ({b}/{c_})")
                trs.append([text(arm), text(length), text(n), (Num(k / n, one, exact=True), " %"),
                            ("[", Num(lo, one), ", ", Num(hi, one), "] %"), (Num(g / n, one, exact=True), " %"),
                            fixed(math.fsum(r["answer_logprob"] for r in cell.values()) / n, 3), test])
        out += [P(f"task {task}", f"Task {task}:"), T(f"retrieval {task}", RETRIEVAL_HEADERS, 2, trs)]
    depths = [float(d) for d in p["depths"]]
    out.append(P("notes", "", [("trials", r"^(\S+) trials \(", text(len({r["case"] for r in rows}))),
                               ("trials per cell", r"\((\S+) per task, length and depth", text(p["trials"])),
                               ("depths", r"; (\S+) depths from", text(len(depths))),
                               ("first depth", r"depths from (\S+) to", text(min(depths))),
                               ("last depth", r" to (\S+)\), each its own", text(max(depths)))]))
    return out


_ANALYSES = {"observation": _observation, "ablation": _ablation, "mx_paths": _mx_paths,
             "residual_window": _residual_window}

def derive_document(ctx, rows: list, timings: list) -> dict:
    """What report.md must say: the header facts and, per study, its description and the expected
    blocks of each analysis section (see ``T`` and ``P``)."""
    m = ctx.manifest
    env = m.get("environment", {}) if isinstance(m.get("environment"), dict) else {}
    studies = []
    for entry in m.get("protocols", []):
        name = entry.get("name") if isinstance(entry, dict) else None
        proto = ctx.protocol_copies.get(name)
        if proto is None:
            raise ValueError(f"study {name!r} has no frozen protocol copy that passed its checks")
        sel = [r for r in rows if r.get("study") == name]
        if proto.get("kind") == "live":
            sections = [("live_quality", _live(sel, proto["live"], timings, name))]
        elif proto.get("kind") == "retrieval":
            sections = [("retrieval", _retrieval(sel, retrieval_params(ctx, name)))]
        else:
            sections = []
            for analysis, params in proto["analyses"].items():
                arows = [r for r in sel if r.get("analysis") == analysis]
                if not arows:
                    sections.append((analysis, [P("no rows", "(no rows)")]))
                    continue
                p = {**ANALYSIS_DEFAULTS.get(analysis, {}), **params}
                sections.append((analysis, _ANALYSES[analysis](arows, p)))
        studies.append({"name": name, "description": proto.get("description") or None, "sections": sections})
    header = [("creation time", str(m.get("created_utc"))), ("python", str(env.get("python"))),
              ("torch", str(env.get("torch"))), ("numpy", str(env.get("numpy"))), ("cpu", str(env.get("cpu"))),
              ("rows", str(len(rows)))]
    excluded = [f"- `{e.get('id')}` at stage `{e.get('stage')}`: {e.get('error')}" for e in m.get("excluded") or []
                if isinstance(e, dict)]
    return {"header": header, "excluded": excluded, "studies": studies}


# ---------------------------------------------------------------------------------------------
# reading report.md
# ---------------------------------------------------------------------------------------------

def parse_blocks(doc: str) -> list[dict]:
    """Blank-line separated blocks: {"kind": h1 | h2 | h3 | table | para, "line": first line number,
    "text": the block's text (a heading's title), "lines": its lines}."""
    blocks, cur = [], []
    for no, line in enumerate(doc.split("\n") + [""], 1):
        if line.strip():
            cur.append((no, line))
            continue
        if cur:
            lines = [ln for _, ln in cur]
            first = lines[0]
            kind = "para"
            for mark, k in (("# ", "h1"), ("## ", "h2"), ("### ", "h3")):
                if first.startswith(mark):
                    kind = k
            if first.lstrip().startswith("|"):
                kind = "table"
            title = first[first.index(" ") + 1:].strip() if kind.startswith("h") else "\n".join(lines)
            blocks.append({"kind": kind, "line": cur[0][0], "text": title, "lines": lines})
            cur = []
    return blocks


def parse_table(lines: list[str]) -> tuple[list[str], list[list[str]]]:
    """(header cells, body rows of cells) of a GitHub pipe table; ValueError if it is not one."""
    cells = []
    for ln in lines:
        s = ln.strip()
        if not (s.startswith("|") and s.endswith("|")) or len(s) < 2:
            raise ValueError(f"line {s[:60]!r} is not a table row")
        cells.append([c.strip() for c in s[1:-1].split("|")])
    if len(cells) < 2 or not all(_SEP.fullmatch(c) for c in cells[1]):
        raise ValueError("no |---| separator line under the header")
    return cells[0], cells[2:]


# ---------------------------------------------------------------------------------------------
# comparing
# ---------------------------------------------------------------------------------------------

def _key_text(key: tuple) -> str:
    return "(" + ", ".join(key) + ")"


def _check_para(ctx, where: str, block: dict, spec: dict, tol: dict) -> None:
    body = block["text"]
    if not body.startswith(spec["prefix"]):
        ctx.fail(f"{where} paragraph '{spec['name']}' (line {block['line']})",
                 f"starts {body[:60]!r}, the rows call for a paragraph starting {spec['prefix'][:60]!r}")
        return
    for what, pattern, cell in spec["facts"]:
        ctx.numbers += 1
        found = re.search(pattern, body)
        want = _render(cell, tol)
        if found is None:
            ctx.fail(f"{where} paragraph '{spec['name']}' (line {block['line']})", f"does not state the {what} "
                     f"(the audit derives {want!r})")
        elif not cell_ok(found.group(1), cell, tol):
            ctx.fail(f"{where} paragraph '{spec['name']}' (line {block['line']})",
                     f"{what}: printed {found.group(1)!r}, audit derives {want!r}")


def _check_table(ctx, where: str, block: dict, spec: dict, tol: dict) -> None:
    name = f"{where} table '{spec['name']}' (line {block['line']})"
    try:
        header, body = parse_table(block["lines"])
    except ValueError as e:
        ctx.fail(name, str(e))
        return
    want_h = spec["headers"]
    if len(header) != len(want_h):
        ctx.fail(name, f"{len(header)} columns {header}, the rows call for {len(want_h)}: {want_h}")
        return
    for i, (g, w) in enumerate(zip(header, want_h)):
        if g != w:
            ctx.fail(name, f"column {i + 1} header printed {g!r}, the rows call for {w!r}")
    k = spec["key"]
    want = {}
    for row in spec["rows"]:
        want[tuple(_render(c, tol) for c in row[:k])] = row
    got, counts = {}, Counter()
    for cells in body:
        if len(cells) != len(header):
            ctx.fail(name, f"row {_key_text(tuple(cells[:k]))} has {len(cells)} cells, the header {len(header)}")
            continue
        key = tuple(cells[:k])
        counts[key] += 1
        got.setdefault(key, cells)
    for key, n in counts.items():
        if n > 1:
            ctx.fail(f"{name} row {_key_text(key)}", f"appears {n} times; the rows call for it once")
    for key in want:
        if key not in got:
            ctx.fail(f"{name} row {_key_text(key)}", "missing: the rows of results.json call for it")
    for key in got:
        if key not in want:
            ctx.fail(f"{name} row {_key_text(key)}", "no such row follows from the rows of results.json")
    order_got = [key for key in got if key in want]
    if order_got != [key for key in want if key in got]:
        ctx.fail(name, "rows out of order: the rows of results.json call for "
                 + ", ".join(_key_text(key) for key in want))
    for key in order_got:
        for j in range(k, len(want_h)):
            ctx.numbers += 1
            printed, cell = got[key][j], want[key][j]
            if not cell_ok(printed, cell, tol):
                ctx.fail(f"{name} row {_key_text(key)} column {want_h[j]!r}",
                         f"printed {printed!r}, audit derives {_render(cell, tol)!r}")


def _check_section(ctx, where: str, blocks: list, expected: list, tol: dict) -> None:
    for i, spec in enumerate(expected):
        if i >= len(blocks):
            ctx.fail(where, f"ends after {len(blocks)} blocks; missing the {spec['kind']} '{spec['name']}' "
                     "(and what follows it) that the rows call for")
            return
        b = blocks[i]
        if b["kind"] != spec["kind"]:
            found = "a table" if b["kind"] == "table" else f"{b['kind']} {b['text'][:60]!r}"
            ctx.fail(f"{where} (line {b['line']})", f"found {found} where the rows call for the {spec['kind']} "
                     f"'{spec['name']}' (a block added or deleted?)")
            return
        (_check_table if spec["kind"] == "table" else _check_para)(ctx, where, b, spec, tol)
    for b in blocks[len(expected):]:
        ctx.fail(f"{where} (line {b['line']})", f"a {b['kind']} the rows do not call for: {b['text'][:60]!r}")


def _split(blocks: list, kind: str) -> tuple[list, list]:
    """(blocks before the first ``kind`` heading, [(title, line, blocks under it)])."""
    head, parts = [], []
    for b in blocks:
        if b["kind"] == kind:
            parts.append((b["text"], b["line"], []))
        elif parts:
            parts[-1][2].append(b)
        else:
            head.append(b)
    return head, parts


def _match_headings(ctx, where: str, parts: list, want: list, what: str) -> list:
    """Pairs (found blocks, wanted name) of the headings; FAILs on missing, extra, repeated or moved."""
    names = [p[0] for p in parts]
    for n, c in Counter(names).items():
        if c > 1:
            ctx.fail(f"{where}", f"the {what} {n!r} appears {c} times")
    for n in want:
        if n not in names:
            ctx.fail(f"{where}", f"the {what} {n!r} is missing (the run's protocols call for it)")
    for title, line, _ in parts:
        if title not in want:
            ctx.fail(f"{where} (line {line})", f"a {what} {title!r} that the run's protocols do not call for")
    if [n for n in names if n in want] != [n for n in want if n in names] and len(set(names)) == len(names):
        ctx.fail(where, f"{what}s out of order: the run's protocols call for {want}")
    first = {}
    for title, _line, blocks in parts:
        first.setdefault(title, blocks)
    return [(first[n], n) for n in want if n in first]


def _check_description(ctx, where: str, head: list, study: dict) -> None:
    """The text between a study's heading and its first analysis: its protocol's description."""
    desc = study["description"]
    got = "\n\n".join(b["text"] for b in head)
    if desc is None and got:
        ctx.fail(where, "text before the first analysis, but the protocol has no description")
    elif desc is not None and got != desc.strip():
        ctx.fail(where, "the study's description is not its frozen protocol copy's")


def _check_header(ctx, blocks: list, doc: dict) -> None:
    """The blocks before the first study: the title, the 'Created ... Rows: N.' line, the note on
    units and, when the manifest excludes anything, the list of exclusions."""
    if not blocks or blocks[0]["kind"] != "h1" or blocks[0]["text"] != "testbed run report":
        ctx.fail(REL, "does not start with the heading '# testbed run report'")
        return
    line = blocks[1]["text"] if len(blocks) > 1 and blocks[1]["kind"] == "para" else ""
    found = re.match(r"Created (\S+) with python (.*?), torch (.*?), numpy (.*?) on (.*?)\. Rows: (\S+)\. ", line)
    if found is None:
        ctx.fail(f"{REL} header", "no 'Created ... Rows: N.' line under the title")
    else:
        for (what, want), got in zip(doc["header"], found.groups()):
            ctx.numbers += 1
            if got != want:
                ctx.fail(f"{REL} header", f"{what}: printed {got!r}, the run has {want!r}")
    rest = blocks[2:]
    if not rest or not rest[0]["text"].startswith("Rows inside one seed or prompt are not independent"):
        ctx.fail(f"{REL} header", "the note on independent units is missing")
    excl = [b for b in rest if b["text"].startswith("Excluded (not counted as results):")]
    got = excl[0]["lines"][1:] if excl else []
    if got != doc["excluded"]:
        ctx.fail(f"{REL} exclusions", f"lists {got}, the manifest excludes {doc['excluded']}")
    if len(rest) != 1 + bool(doc["excluded"]):
        ctx.fail(f"{REL} header", f"{len(rest)} blocks between the 'Created' line and the first study; the run calls "
                 f"for {1 + bool(doc['excluded'])}")


def check_run(ctx) -> None:
    """Check report.md of the run (see the module docstring); problems go to ``ctx.fail``."""
    if REL not in ctx.manifest.get("files", {}):
        ctx.fail(REL, "not named in the manifest (every run writes one)")
        return
    try:
        doc_text = ctx.read_bytes(REL).decode("utf-8")
    except UnicodeDecodeError:
        ctx.fail(REL, "not UTF-8 text")
        return
    if not isinstance(ctx.results, dict) or not isinstance(ctx.results.get("rows"), list):
        return  # results.json has its own FAIL line; there is nothing to derive the tables from
    rows = [r for r in ctx.results["rows"] if isinstance(r, dict)]
    timings = []
    if "timings.json" in ctx.manifest.get("files", {}):
        try:
            timings = strict_json(ctx.read_bytes("timings.json").decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - a missing or broken file also has its own FAIL line
            ctx.fail(f"{REL} timings", f"timings.json cannot be read ({type(e).__name__}); the ms column is unchecked")
            timings = []
        if not isinstance(timings, list):
            timings = []
    try:
        doc = derive_document(ctx, rows, timings)
    except Exception as e:  # noqa: BLE001 - rows the other checks already refused; still a FAIL line
        ctx.fail(REL, f"tables cannot be derived from results.json ({type(e).__name__}: {str(e)[:200]})")
        return
    if not doc_text.endswith("\n") or doc_text.endswith("\n\n"):
        ctx.fail(REL, "does not end with exactly one newline")
    blocks = parse_blocks(doc_text)
    head, studies = _split(blocks, "h2")
    _check_header(ctx, head, doc)
    want = [s["name"] for s in doc["studies"]]
    by_name = {s["name"]: s for s in doc["studies"]}
    for sblocks, name in _match_headings(ctx, REL, studies, want, "study section"):
        study = by_name[name]
        tol = TOLERANCES["report"]
        pre, parts = _split(sblocks, "h3")
        _check_description(ctx, f"{REL} ## {name}", pre, study)
        specs = dict(study["sections"])
        for ablocks, analysis in _match_headings(ctx, f"{REL} ## {name}", parts, list(specs), "analysis section"):
            _check_section(ctx, f"{REL} {name}/{analysis}", ablocks, specs[analysis], tol)
