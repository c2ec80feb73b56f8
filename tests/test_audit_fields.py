"""Every field of every kind of result row is re-derived by the audit, or listed as descriptive (issue #34).

The archived run in evidence/ holds rows of every default kind (observation case and head rows of
synthetic and captured attention, ablation rows of synthetic, captured and archived-capture cases,
MX paths, residual window, retrieval and live rows of every arm kind). One row of each kind is
taken, and each of its leaf fields (a dotted path; lists and nulls are leaves) is changed in turn
the way a consistent forger would change it: a number moved well beyond any tolerance, a string
edited, an array path pointed at another array of the run, a boolean flipped, a null given a value.

The forger also rewrites results.csv, report.md and report.html from the forged rows and records
every new sha256, so the audit's consistency checks (hashes, results.csv against results.json,
report.md and report.html re-derived from the rows) cannot notice by construction; what can is
the audit's re-derivation of the row (``CHECKS``), its label and orphan checks and the run checks
that compare the rows with the frozen protocols and the capture provenance (``completeness``,
``capture``). ``Probe`` runs exactly those, in process, on the forged rows (a full audit per field
would take a quarter of a minute each); ``test_consistent_forger_end_to_end`` does the whole forgery
on disk for a checked and a descriptive field and runs the whole audit, to show the probe agrees.

Each field must FAIL unless it is on ``DESCRIPTIVE_FIELDS`` (in the audit code, with its reason),
and each listed field must stay uncaught (else the list is stale) and must reach neither a
report.md table nor a report.html figure.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from testbed.audit import Audit, AuditError, audit
from testbed.audit_checks import CHECKS, RUN_CHECKS
from testbed.audit_checks.completeness import DESCRIPTIVE_FIELDS
from tests._helpers import REPO, forge_results

EVIDENCE = REPO / "evidence"
_ROWS = json.loads((EVIDENCE / "results.json").read_text())["rows"] if (EVIDENCE / "results.json").is_file() else []


def kind_of(row: dict) -> str:
    """A row's kind: its analysis, scope (observation), arm kind (live, retrieval), source and, to tell
    an archived capture's ablation rows (which carry ``stats_layout``) apart, its set of fields."""
    bits = [row["analysis"], row.get("scope"), row.get("kind"), row.get("source")]
    if "stats_layout" in row:
        bits.append("archived")
    return "-".join(str(b) for b in bits if b is not None)


def sample_rows(rows: list) -> dict[str, list[tuple[int, list[str]]]]:
    """kind -> [(row index, the fields to change in that row)]: the kind's first row and, greedily, the
    fewest more rows that give every field of the kind a non-null value somewhere (a quantized arm's
    packed arrays, a control's seed, a live row's evidence arrays, ...); each field is changed once,
    in the first of these rows where it is not null (or, for a field null in every row, in the first)."""
    by_kind: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by_kind.setdefault(kind_of(r), []).append(i)
    out = {}
    for kind, idx in by_kind.items():
        full = {i: {dotted(p): v is not None for p, v in leaves(rows[i]).items()} for i in idx}
        union = {n for i in idx for n, set_ in full[i].items() if set_}
        chosen, covered = [idx[0]], {n for n, set_ in full[idx[0]].items() if set_}
        while not union <= covered:
            best = max(idx, key=lambda i: len({n for n, set_ in full[i].items() if set_} - covered))
            chosen.append(best)
            covered |= {n for n, set_ in full[best].items() if set_}
        todo, plan = set().union(*(full[i] for i in idx)), []
        for i in chosen:
            mine = sorted(n for n in todo if full[i].get(n) or (n in full[i] and n not in union))
            todo -= set(mine)
            plan.append((i, mine))
        for i in idx:  # a field null in every chosen row and absent from the first: its first row
            mine = sorted(n for n in todo if n in full[i])
            if mine:
                plan.append((i, mine))
                todo -= set(mine)
        out[kind] = plan
    return out


def leaves(obj: dict, prefix: tuple = ()) -> dict[tuple, object]:
    """Every leaf of a row under its key path (keys may hold dots: ``arrays.packed.recent.k``)."""
    out = {}
    for key, value in obj.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def dotted(path: tuple) -> str:
    return ".".join(path)


SAMPLES = sample_rows(_ROWS)


def set_path(row: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        row = row[key]
    row[path[-1]] = value


def changed(value, others: list[str], sha: dict):
    """The value a forger puts in place of ``value``: a different one, beyond every tolerance."""
    if isinstance(value, bool):
        return not value
    if value is None:
        return 0.5
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return 0.5 if math.isnan(value) else value + max(0.25, 0.5 * abs(value))
    if isinstance(value, str):
        if value.startswith("arrays/"):  # another array of the run, with other bytes
            other = next((o for o in others if sha.get(o) != sha.get(value)), None)
            if other is not None:
                return other
        return value + "-x"
    if isinstance(value, list):
        if not value:
            return [1]
        out = copy.deepcopy(value)
        out[0] = changed(out[0], others, sha)
        return out
    if isinstance(value, dict):  # an empty object (a float32 arm's packed arrays)
        return {"x": 1}
    raise TypeError(f"no change for a {type(value).__name__}")


class Probe:
    """The audit of one archived run, kept loaded; ``failures(rows, i)`` re-runs on forged rows the
    checks a consistent forger cannot satisfy by rewriting files: the re-derivation of row ``i`` (and of
    the rows of its case before it, whose cached state the audit would reuse), the row labels, the
    orphan check and the run checks against the protocols and capture provenance."""

    def __init__(self, root: Path):
        self.audit = Audit(root)
        self.audit.run(check_sources=False)
        assert not self.audit.failures, self.audit.failures[:5]
        self.results = self.audit.results
        self.rows = self.results["rows"]
        self.sha = {rel: e["sha256"] for rel, e in self.audit.manifest["arrays"].items()}

    def failures(self, rows: list, index: int) -> list[str]:
        a = self.audit
        a.failures = []
        a.cache = {k: v for k, v in a.cache.items() if k[0] == "case"}  # the cases' arrays: not forged here
        a.results = dict(self.results, rows=rows)
        target = rows[index]
        try:
            for i, r in enumerate(rows[:index + 1]):
                if r.get("study") != target.get("study") or (i != index and r.get("case") != target.get("case")):
                    continue
                row = dict(r, _index=i)
                try:
                    a._check_row_labels(row)
                    CHECKS[row["analysis"]](row, a)
                except AuditError as e:
                    a.fail(row, str(e))
                except Exception as e:  # noqa: BLE001 - as the audit does: a forged row is a FAIL line
                    a.fail(row, f"cannot re-derive ({type(e).__name__}: {str(e)[:200]})")
            if a.failures:  # caught by its row's re-derivation: the run-wide checks cannot un-catch it
                return list(a.failures)
            a._check_orphans()
            for rel in ("results.json", "capture_manifest.json"):
                try:
                    RUN_CHECKS[rel](a)
                except AuditError as e:
                    a.fail(rel, str(e))
            return list(a.failures)
        finally:
            a.results = self.results


@pytest.fixture(scope="module")
def archived(tmp_path_factory) -> Path:
    if not _ROWS:
        pytest.skip("no archived run in evidence/")
    dst = tmp_path_factory.mktemp("fields") / "run"
    shutil.copytree(EVIDENCE, dst)
    return dst


@pytest.fixture(scope="module")
def probe(archived) -> Probe:
    return Probe(archived)


# Analyses with an audit check but no row in evidence/, each with the reason and where its audit is
# exercised instead. evidence/ is at its 20 MB limit: a one-seed selective variant costs 62 kB, 36 kB
# of it empty results.csv cells its 18 new columns add to every other row.
NOT_IN_EVIDENCE = {
    "selective": "not in the default run (evidence/ size); tests/test_selective.py runs it, audits it "
                 "and fails a forged class and a forged top-k set",
}


def test_samples_cover_every_kind_of_row():
    kinds = set(SAMPLES)
    for kind, plan in SAMPLES.items():  # every field of the kind is changed in some row
        rows = [i for i, r in enumerate(_ROWS) if kind_of(r) == kind]
        assert {n for i in rows for n in map(dotted, leaves(_ROWS[i]))} == {n for _, names in plan for n in names}, kind
    for analysis in CHECKS:
        if analysis in NOT_IN_EVIDENCE:
            assert not any(k.startswith(analysis + "-") for k in kinds), f"{analysis} is in evidence/ now: probe it"
            continue
        assert any(k.startswith(analysis + "-") for k in kinds), f"evidence/ has no {analysis} row"
    for must in ("observation-case-synthetic_video", "observation-head-capture", "ablation-capture-archived",
                 "live_quality-reference-corpus", "live_quality-policy-corpus", "live_quality-peer-corpus",
                 "retrieval-reference-retrieval", "retrieval-policy-retrieval"):
        assert must in kinds, sorted(kinds)


def test_unforged_rows_pass_the_probe(probe):
    for plan in SAMPLES.values():
        for index, _ in plan:
            assert probe.failures(probe.rows, index) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_every_field_is_rederived_or_listed(probe, kind, reliability):
    listed = DESCRIPTIVE_FIELDS.get(kind.split("-")[0], {})
    missed, tried = set(), set()
    for index, names in SAMPLES[kind]:
        row = probe.rows[index]
        fields = {dotted(p): (p, v) for p, v in leaves(row).items()}
        arrays = [v for _, v in fields.values() if isinstance(v, str) and v.startswith("arrays/")]
        for name in names:
            path, value = fields[name]
            new = changed(value, arrays, probe.sha)
            assert new != value, name
            forged = copy.deepcopy(row)
            set_path(forged, path, new)
            rows = list(probe.rows)
            rows[index] = forged
            failures = probe.failures(rows, index)
            tried.add(name)
            if name in listed:
                reliability("gap", f"{kind} row: descriptive {name} changed, every hash updated",
                            f"not caught: {listed[name]}", failures[0] if failures else "audit PASSED")
            if not failures:
                missed.add(f"{name} (row {index})")
    present = {n for n in listed if n in tried}
    assert {m.split(" (row")[0] for m in missed} == present, (
        f"{kind}: fields no check re-derives {sorted(m for m in missed if m.split(' (row')[0] not in listed)}; "
        f"listed as descriptive but caught (stale list) {sorted(present - {m.split(' (row')[0] for m in missed})}")


def _reports(run: Path, rows: list, studies: list[str]) -> tuple[str, list]:
    """report.md of ``studies`` (the run's builder) and report.html's figure data, from ``rows``."""
    from testbed.evidence import load_array
    from testbed.protocol import validate_protocol
    from testbed.report import build_report
    from testbed.report_html import figure_data

    m = json.loads((run / "manifest.json").read_text())
    protos = [validate_protocol(json.loads((run / e["copy"]).read_text())) for e in m["protocols"]]
    protos = [p for p in protos if p["name"] in studies]
    timings = json.loads((run / "timings.json").read_text())
    sel = [r for r in rows if r["study"] in studies]
    return build_report(protos, sel, m, timings), figure_data(sel, lambda rel: load_array(run, rel))


@pytest.mark.parametrize("analysis,field", [(a, f) for a, fs in sorted(DESCRIPTIVE_FIELDS.items()) for f in fs])
def test_descriptive_fields_reach_no_table_and_no_figure(archived, analysis, field):
    rows = json.loads((archived / "results.json").read_text())["rows"]
    path = tuple(field.split("."))
    hits = [i for i, r in enumerate(rows) if r["analysis"] == analysis and dotted(path) in map(dotted, leaves(r))]
    assert hits, f"no {analysis} row carries {field} in evidence/"
    studies = sorted({rows[i]["study"] for i in hits})
    before = _reports(archived, rows, studies)
    forged = copy.deepcopy(rows)
    for i in hits:  # every row that carries it, in every study
        set_path(forged[i], path, "FORGED DESCRIPTION 12345")
    after = _reports(archived, forged, studies)
    assert "FORGED DESCRIPTION" not in after[0] and "12345" not in after[0]
    assert after[0] == before[0], f"{field} reaches report.md"
    assert after[1] == before[1], f"{field} reaches report.html's figures"


def _tiny_png(plt, d) -> bytes:
    """A valid 1 x 1 PNG: what a forger may draw (the audit reads the data and words, not pixels)."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\x00")) + chunk(b"IEND", b""))


@pytest.mark.slow
@pytest.mark.parametrize("kind,field,caught", [("observation-head-capture", "heads", True),
                                               ("live_quality-policy-corpus", "policy.description", False)])
def test_consistent_forger_end_to_end(archived, tmp_path, monkeypatch, kind, field, caught, reliability):
    """The whole forgery on disk (results.json, results.csv, report.md and report.html rewritten by the
    run's own builders, every sha256 recorded) and the whole audit: the probe's verdict holds."""
    import testbed.report_html.page as builder

    monkeypatch.setattr(builder, "_png", _tiny_png)  # the drawing is slow and the audit does not read it
    run = tmp_path / "run"
    shutil.copytree(archived, run)
    res = json.loads((run / "results.json").read_text())
    index = SAMPLES[kind][0][0]
    row = res["rows"][index]
    path = tuple(field.split("."))
    value = dict(leaves(row))[path]
    set_path(row, path, changed(value, [], {}))
    forge_results(run, res)
    ok, failures, _ = audit(run, check_sources=False)
    desc = f"{kind} row: {field} changed; results.csv, report.md, report.html rewritten, every hash updated"
    if caught:
        hit = [f for f in failures if f"results.json row {index} " in f]
        reliability("tamper: consistent forger", desc, "FAIL naming the row", hit[0] if hit else "audit PASSED")
        assert not ok and hit, failures[:5]
    else:
        reliability("gap", desc, "not caught: descriptive (reaches no table and no figure)",
                    failures[0] if failures else "audit PASSED")
        assert ok, failures[:5]
