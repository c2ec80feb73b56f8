"""Generate the "Reliability" table from the reliability test suites, never by hand.

    .venv/bin/python tools/reliability_table.py            # run the suites, write docs/reliability.md
    .venv/bin/python tools/reliability_table.py --no-run   # re-render from target/reliability/
    .venv/bin/python tools/reliability_table.py --readme FILE   # also refresh the marker-delimited block in FILE

In CI, to reuse the one full pytest run instead of running the suites twice::

    rm -rf target/reliability
    TESTBED_RELIABILITY_DIR=target/reliability .venv/bin/python -m pytest -q -p no:cacheprovider \
        --junitxml=target/reliability/junit.xml
    .venv/bin/python tools/reliability_table.py --no-run

It runs pytest on the suites with ``TESTBED_RELIABILITY_DIR=target/reliability`` (the tests record
what they try through the ``reliability`` fixture, tests/_reliability.py) and ``--junitxml``; the
result of each record comes from the JUnit XML, i.e. from pytest's own verdict on the test that
made it. A strict xfail is a known gap (the audit does not notice that change) and is listed as
such. The summary sits between ``<!-- reliability-table:begin -->`` and
``<!-- reliability-table:end -->`` so that a README can include the same block.

Exit status: pytest's (0 when every suite passed), or 1 when there is nothing to render.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUITES = ["tests/test_tamper.py", "tests/test_run_cli.py", "tests/test_determinism.py", "tests/test_fuzz_inputs.py",
          "tests/test_resource_guard.py", "tests/test_report_html.py", "tests/test_audit_report_md.py",
          "tests/test_audit_completeness.py", "tests/test_audit_reencode.py", "tests/test_capture_provenance.py",
          "tests/test_audit_fields.py"]
BEGIN, END = "<!-- reliability-table:begin -->", "<!-- reliability-table:end -->"

# (summary line, categories) in table order
GROUPS = [
    ("Tampering, naive: a file changed, the manifest left alone", ["tamper: naive", "tamper: files"]),
    ("Tampering, consistent forger: a file changed and its sha256 re-computed", ["tamper: consistent forger"]),
    ("Completeness, consistent forger: cases or rows removed, added or relabelled, a row parameter changed",
     ["tamper: completeness"]),
    ("Payloads re-encoded: integer codes, scales, zero-points or float32 windows replaced, re-hashed",
     ["tamper: re-encode"]),
    ("Capture provenance: model identity, gates, token ids, case metadata forged, re-hashed", ["tamper: capture"]),
    ("Per-case array zips: not a zip, a member stored twice, a byte flipped inside (CRC)", ["tamper: containers"]),
    ("Manifest unreadable, of another schema, or with malformed entries", ["tamper: manifest"]),
    ("Manifest paths leaving the run (../, absolute, symlinks, NUL, ...)", ["tamper: paths"]),
    ("Arrays that would need pickle (object dtype, raw pickle, lying header)", ["tamper: unsafe arrays"]),
    ("Fuzzed manifest.json / results.json (hypothesis)", ["tamper: fuzz"]),
    ("Untouched run (control)", ["tamper"]),
    ("Kills and interrupts (SIGKILL, SIGINT, SIGTERM, crash)", ["kill"]),
    ("Bad command lines (--out)", ["bad input: CLI"]),
    ("Bad protocols", ["bad input: protocol"]),
    ("Bad tensors into quantizers, residual window and Case", ["bad input: tensors"]),
    ("Determinism (same protocol, same bytes)", ["determinism"]),
    ("Memory guard", ["resource guard"]),
    ("One-ulp flips, sha256 re-computed (below the tolerance by design: recorded, not required)", ["ulp"]),
]
OK_WORD = {"tamper: naive": "caught", "tamper: files": "caught", "tamper: consistent forger": "caught",
           "tamper: completeness": "caught", "tamper: re-encode": "caught", "tamper: capture": "caught",
           "tamper: manifest": "caught", "tamper: containers": "caught", "tamper: paths": "refused, nothing outside opened",
           "tamper: unsafe arrays": "refused unread", "tamper: fuzz": "held", "tamper": "passed", "kill": "held",
           "bad input: CLI": "refused", "bad input: protocol": "held", "bad input: tensors": "held",
           "determinism": "held", "resource guard": "held"}


def run_suites(folder: Path, junit: Path, extra: list[str]) -> int:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    env = dict(os.environ, TESTBED_RELIABILITY_DIR=str(folder))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *SUITES, *extra]
    print("running:", " ".join(cmd), file=sys.stderr)
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


def outcomes(junit: Path) -> dict[str, str]:
    """nodeid -> passed | failed | xfailed | skipped (an XPASS of a strict xfail is a failure in JUnit)."""
    out = {}
    for tc in ET.parse(junit).getroot().iter("testcase"):
        mod = tc.get("classname", "")
        nodeid = mod.replace(".", "/") + ".py::" + tc.get("name", "")
        status = "passed"
        for child in tc:
            if child.tag in ("failure", "error"):
                status = "failed"
            elif child.tag == "skipped":
                status = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        out[nodeid] = status
    return out


def load_records(folder: Path) -> list[dict]:
    recs = []
    for path in sorted(folder.glob("records-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                recs.append(json.loads(line))
    return recs


_TMP = re.compile(r"/tmp/pytest-of-[^/\s]+/pytest-\d+/[^/\s]+")


def clean(text: str, limit: int = 140) -> str:
    text = _TMP.sub("<tmp>", str(text)).replace(str(REPO), "<repo>").replace("|", "\\|").replace("\n", " ")
    text = re.sub(r"\.partial-\d+", ".partial-PID", text)  # PIDs change from run to run
    return text if len(text) <= limit else text[: limit - 1] + "…"


_RANK = {"failed": 3, "not run": 2, "skipped": 1, "xfailed": 0, "passed": 0}


def collapse(recs: list[dict]) -> list[dict]:
    """Records with the same category, case and expectation (one per parametrization) become one row
    with a count; its status is the worst of theirs."""
    out: dict[tuple, dict] = {}
    for r in recs:
        key = (r["category"], r["case"], r["expect"])
        if key in out:
            o = out[key]
            o["count"] += 1
            if _RANK.get(r["status"], 2) > _RANK.get(o["status"], 2):
                o["status"] = r["status"]
        else:
            out[key] = dict(r, count=1)
    return list(out.values())


def render(recs: list[dict], status: dict[str, str]) -> tuple[str, bool]:
    for r in recs:
        r["status"] = status.get(r["nodeid"], "not run")
    recorded = {r["nodeid"] for r in recs}
    recs = collapse(recs)
    by_cat = defaultdict(list)
    for r in recs:
        by_cat[r["category"]].append(r)
    unrecorded = [n for n in status if n not in recorded and any(n.startswith(s) for s in SUITES)]
    all_ok = all(s in ("passed", "xfailed") for s in status.values())

    lines = [BEGIN, "", "| What is tried | Cases | Result |", "|---|---:|---|"]
    for title, cats in GROUPS:
        rs = [r for c in cats for r in by_cat.get(c, [])]
        if not rs:
            continue
        good = sum(r["status"] == "passed" for r in rs)
        bad = len(rs) - good
        if cats == ["ulp"]:
            hit = sum(r["observed"].startswith("FAIL") for r in rs)
            result = f"{hit} caught, {len(rs) - hit} not" + (f"; **{bad} FAILED**" if bad else "")
        else:
            word = OK_WORD[cats[0]]
            result = f"all {good} {word}" if not bad else f"**{bad} FAILED**, {good} {word}"
        lines.append(f"| {title} | {len(rs)} | {result} |")
    for cat, title, word in (("gap", "Known gaps: single changes the audit does not notice (asserted as such)",
                              "not caught, listed below"),
                             ("bug", "Known bugs found in modules outside the reliability work (strict xfail)",
                              "listed below")):
        rs = by_cat.get(cat, [])
        if rs:
            broken = [r for r in rs if r["status"] == "failed"]
            lines.append(f"| {title} | {len(rs)} | {len(rs) - len(broken)} {word}"
                         + (f"; **{len(broken)} changed behaviour: update the list**" if broken else "") + " |")
    total = sum(r["count"] for r in recs)
    lines += ["", f"{total} recorded cases from {len(status)} test items "
              f"({sum(s == 'passed' for s in status.values())} passed, {sum(s == 'xfailed' for s in status.values())} "
              f"strict xfails for the known gaps and bugs, {sum(s == 'failed' for s in status.values())} failed); "
              f"{len(unrecorded)} further unit checks. "
              "Generated by `.venv/bin/python tools/reliability_table.py` from the test results.", "", END]
    summary = "\n".join(lines)

    body = ["# Reliability", "",
            "What the reliability suites try against testbed, and what happened, generated from one pytest run "
            f"({', '.join(SUITES)}). Do not edit by hand: run `.venv/bin/python tools/reliability_table.py`.", "",
            summary, ""]
    for title, cats in GROUPS + [("Known gaps", ["gap"]), ("Known bugs", ["bug"])]:
        rs = [r for c in cats for r in by_cat.get(c, [])]
        if not rs:
            continue
        body += [f"## {title}", "", "| Case | Expected | Observed | Test |", "|---|---|---|---|"]
        listed = cats[0] in ("gap", "bug")
        for r in rs:
            verdict = {"passed": "as listed" if listed else "✓", "xfailed": "as listed (xfail)",
                       "failed": "**✗ changed**" if listed else "**✗ FAILED**"}.get(r["status"], r["status"])
            case = clean(r["case"], 110) + (f" (×{r['count']})" if r["count"] > 1 else "")
            body.append(f"| {case} | {clean(r['expect'], 90)} | {clean(r['observed'])} | {verdict} |")
        body.append("")
    return "\n".join(body).rstrip() + "\n", all_ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-run", action="store_true", help="render from the last run's files in --dir")
    ap.add_argument("--dir", default=str(REPO / "target" / "reliability"),
                    help="records and junit.xml (default target/reliability)")
    ap.add_argument("--out", default=str(REPO / "docs" / "reliability.md"), help="markdown to write")
    ap.add_argument("--readme", help="also replace the marker-delimited block in this file (e.g. README.md)")
    ap.add_argument("pytest_args", nargs="*", help="extra arguments for pytest (after --)")
    args = ap.parse_args(argv)
    folder = Path(args.dir)
    junit = folder / "junit.xml"
    code = 0
    if not args.no_run:
        code = run_suites(folder, junit, args.pytest_args)
    if not junit.exists():
        print(f"error: {junit} not found (run without --no-run)", file=sys.stderr)
        return 1
    recs = load_records(folder)
    if not recs:
        print(f"error: no records in {folder}", file=sys.stderr)
        return 1
    status = {n: st for n, st in outcomes(junit).items() if any(n.startswith(s + "::") for s in SUITES)}
    recs = [r for r in recs if r["nodeid"] in status]  # records of an older run (same folder) are dropped
    text, all_ok = render(recs, status)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(recs)} cases{'' if all_ok else '; SOME FAILED'})", file=sys.stderr)
    if args.readme:
        readme = Path(args.readme)
        old = readme.read_text(encoding="utf-8")
        if BEGIN not in old or END not in old:
            print(f"error: {readme} has no {BEGIN} ... {END} block", file=sys.stderr)
            return 1
        block = text[text.index(BEGIN): text.index(END) + len(END)]
        readme.write_text(old[: old.index(BEGIN)] + block + old[old.index(END) + len(END):], encoding="utf-8")
        print(f"updated the block in {readme}", file=sys.stderr)
    return code or (0 if all_ok else 1)


if __name__ == "__main__":
    sys.exit(main())
