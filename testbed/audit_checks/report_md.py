"""Audit of report.md: every table cell, and every number of its prose that comes from the run,
re-derived from results.json with the audit's own code.

The run's builders (testbed/report.py, the analyses' ``report`` functions, testbed/live/summary.py) are
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

Where the pieces are: each analysis's expected blocks are ``report_tables(rows, params)`` in its
own audit module (``_ANALYSES``; the retrieval study's in ``retrieval.py``), the live study's here;
the printed formats and ``cell_ok`` in ``report_format.py``; the statistics in ``stats.py``; the
reading of the text in ``report_parse.py``. This module derives the whole document and compares.

Not checked: the wording of static prose (captions, notes, the header's fixed sentences; only
each caption's opening words are compared, so that a table stands under its own caption), and the
column alignment padding of the tables. Each problem is one FAIL line naming the section, the
table, the row key, the column, the printed and the derived text.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np

from . import ablation_audit, live_policies, live_quality, mx_paths, observation, residual_window, retrieval, selective
from .common import TOLERANCES, strict_json
from .completeness import ANALYSIS_DEFAULTS
from .report_format import P, T, Num, cell_ok, fixed, render, text
from .report_parse import parse_blocks, parse_table, split_at
from .stats import MIN_CI_SEGMENTS, bootstrap, mean

__all__ = ["check_run", "derive_document", "REL"]

REL = "report.md"
REFERENCE_ARM = "dynamic_cache"
LIVE_HEADERS = ["arm", "mode, forwards", "perplexity", "Δ ppl vs DynamicCache", "95 % CI (segments)", "segments worse",
                "mean KL", "top-1 agree", "bytes / token", "÷ float16", "ms / scored token"]
EQUAL_HEADERS = ["arm", "compared with", "Δ ppl vs compared", "95 % CI (segments)", "segments better", "mean KL",
                 "compared's KL", "top-1 agree", "bytes / token", "bytes vs compared's"]


# ---------------------------------------------------------------------------------------------
# the expected blocks of each section: the analyses' own (``report_tables`` in each audit module)
# and the live study's, here
# ---------------------------------------------------------------------------------------------


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
    dims = live_policies.model_dims(live, rows[0])
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
             "kl": mean([r["mean_kl"] for r in rs]), "top1": mean([r["top1_agreement"] for r in rs]),
             "bpt": float(np.mean([r["bytes_per_token"] for r in rs]))}
        if arm != REFERENCE_ARM and all(s in ref for s in ids):
            d = nll - np.asarray([ref[s]["nll"] for s in ids], dtype=np.float64)
            e["delta"] = 100.0 * math.expm1(math.fsum(d) / d.size)
            ci = bootstrap(d)
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
        budget = live_policies.budget_of(arm)  # the equal-bytes pairing (live_policies.BUDGET_VERSUS)
        other = None if budget is None else live_policies.versus_of(budget, by_arm)
        if other is None or other == arm or other not in by_arm or set(by_arm[arm]) != set(by_arm[other]):
            continue
        ids = sorted(by_arm[arm])
        a, b = [by_arm[arm][s] for s in ids], [by_arm[other][s] for s in ids]
        d = np.asarray([x["nll"] for x in a], dtype=np.float64) - np.asarray([y["nll"] for y in b], dtype=np.float64)
        ci = bootstrap(d)
        signed = lambda v: f"{v:+.2f}"  # noqa: E731
        bpt, vbpt = float(np.mean([x["bytes_per_token"] for x in a])), float(np.mean([y["bytes_per_token"] for y in b]))
        etrs.append([text(arm), text(other), (Num(100.0 * math.expm1(math.fsum(d) / d.size), signed), " %"),
                     ("—",) if ci is None else ("[", Num(100.0 * math.expm1(ci[0]), signed), ", ",
                                                Num(100.0 * math.expm1(ci[1]), signed), "]"),
                     text(f"{int((d < 0).sum())}/{len(ids)}"), fixed(mean([x["mean_kl"] for x in a]), 5),
                     fixed(mean([y["mean_kl"] for y in b]), 5), (Num(mean([x["top1_agreement"] for x in a]),
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


_ANALYSES = {"observation": observation.report_tables, "ablation": ablation_audit.report_tables,
             "mx_paths": mx_paths.report_tables, "residual_window": residual_window.report_tables,
             "selective": selective.report_tables}


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
            sections = [("retrieval", retrieval.report_tables(sel, retrieval.params_of(ctx, name)))]
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
# comparing report.md (read by report_parse.py) with the expected blocks
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
        want = render(cell, tol)
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
        want[tuple(render(c, tol) for c in row[:k])] = row
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
                         f"printed {printed!r}, audit derives {render(cell, tol)!r}")


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
    head, studies = split_at(blocks, "h2")
    _check_header(ctx, head, doc)
    want = [s["name"] for s in doc["studies"]]
    by_name = {s["name"]: s for s in doc["studies"]}
    for sblocks, name in _match_headings(ctx, REL, studies, want, "study section"):
        study = by_name[name]
        tol = TOLERANCES["report"]
        pre, parts = split_at(sblocks, "h3")
        _check_description(ctx, f"{REL} ## {name}", pre, study)
        specs = dict(study["sections"])
        for ablocks, analysis in _match_headings(ctx, f"{REL} ## {name}", parts, list(specs), "analysis section"):
            _check_section(ctx, f"{REL} {name}/{analysis}", ablocks, specs[analysis], tol)
