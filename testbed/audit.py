"""Independent audit of a testbed run: ``python -m testbed.audit DIR``.

Imports only the standard library and numpy, and never the testbed's quantizers, attention or
metrics. It checks, in order:

1. ``manifest.json`` parses, has the supported ``schema_version`` and names only paths inside
   the run (no absolute paths, no ``..``, no symlinks; nothing outside is read);
2. the files present are exactly those the manifest names (nothing missing, added or renamed);
3. every file's SHA-256, and every array's SHA-256, nbytes, dtype and shape; an array
   ``arrays/S/C/NAME.npy`` is member ``NAME.npy`` of the zip ``arrays/S/C.npz``, whose members must
   be exactly the manifest's arrays of that case (read with the stdlib's zipfile, stored or
   deflated only, sizes bounded by the manifest before decompressing, and no byte outside its
   members: entries back to back from byte 0, no comment, no zip64); ``.npy`` headers are read
   first and object dtypes refused, arrays are loaded with ``allow_pickle=False``;
4. the frozen protocol copies against their recorded hashes;
5. the source hashes (LF-normalized) against this checkout, unless ``--no-sources``;
6. every row of ``results.json``: payload bytes recomputed from the stored packed arrays, its own
   decoding and float64 attention, every reported number recomputed within the audit's own
   tolerances (``|a - b| <= atol + rtol * |b|``, integers exactly; the table is
   ``audit_checks.common.TOLERANCES``, a protocol may tighten it, never loosen it); the labels a row copies from its case agree
   with the case; no row is an exact duplicate; every stored array is used by a case or a row
   (so deleting a row, even with its hash re-computed, leaves its arrays orphaned and fails); the
   cases, rows, row parameters and exclusions are exactly those the frozen protocols produce
   (``audit_checks/completeness.py``, see docs/audit.md);
7. ``report.html``: no outside reference or executable script, one intact inline PNG per figure,
   every figure's embedded data recomputed from the rows, and every word of the page (headings,
   counts, descriptions, captions) the one the rows call for (``audit_checks/report_html.py``);
8. ``report.md``: its sections, tables, headers and rows exactly those the rows call for, and every
   table cell and every run-derived number of its prose re-derived from the rows and compared at
   its printed digits (``audit_checks/report_md.py``; the live table's wall times only against
   timings.json).

With ``--same-as OTHER`` it also compares the recorded array and result hashes with another run
of the same protocol: on one machine a run is deterministic, so a re-run is the check against a
forger who re-computed every array and number consistently (see docs/reliability.md).

The audit never reads a path outside the run, never follows a symlink and never unpickles; any
malformed manifest, results or array is a ``FAIL`` line, not a traceback.

Prints ``PASS: ...`` with counts and exits 0, or one ``FAIL: <file or row>: <reason>`` line per
problem and exits 1 (exit 2 for a missing folder or bad arguments).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from .audit_checks import CHECKS, RUN_CHECKS
from .audit_checks.common import TOLERANCES, strict_json
from .audit_checks.safe_io import (CONTROL_CHARS, MEMBER_NAME, AuditError, BadInput, Containers, container_of,
                                    load_json, present_files, safe_relpath, sha256_file)
from ._cli import entry as cli_entry
from .progress import Progress, stderr_emit

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCE_GLOBS = ("testbed/**/*.py", "protocols/*.json", "pyproject.toml")
# The row fields copied from the case's meta (testbed.context.CASE_FIELDS; kept equal by a test,
# since the audit may not import testbed.context, which imports torch).
CASE_FIELDS = ("source", "distribution", "seed", "n", "model", "prompt", "layer", "chunk", "step", "layout_kind")
DEFAULT_TOLERANCE = TOLERANCES["derived"]

__all__ = ["audit", "compare", "main", "load_json", "BadInput"]


class Consequence(AuditError):
    """A row that cannot be re-derived because an array it uses already failed its own checks: the
    cause has its FAIL line; the rows it takes down are summarized in one line, not one each."""


def repository_path(path: str, repo: Path = REPO_ROOT) -> str:
    """A recorded protocol path as the repository-relative path it names, however it is spelled
    (``./protocols/X.json``, ``protocols//X.json``, ``protocols/../protocols/X.json``, a backslash
    separator, an absolute path inside ``repo``); any other path as recorded. Lexical only: the
    file system is not consulted (no symlink is followed)."""
    text = path.replace("\\", "/")
    norm = os.path.normpath(text)
    if os.path.isabs(norm):
        for root in (repo, repo.resolve()):
            try:
                return Path(norm).relative_to(root).as_posix()
            except ValueError:
                continue
        return path
    norm = Path(norm).as_posix()
    return path if norm == ".." or norm.startswith("../") else norm


def source_hashes(root: Path = REPO_ROOT) -> dict[str, str]:
    out = {}
    for pattern in SOURCE_GLOBS:
        for p in sorted(root.glob(pattern)):
            if p.is_file() and "__pycache__" not in p.parts:
                out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes().replace(b"\r\n", b"\n")).hexdigest()
    return out


class Audit:
    """State of one audit: failures, loaded arrays, counters; handed to the per-analysis checks."""

    def __init__(self, root: Path, progress=None):
        self.root = root
        self.progress = progress  # a callable for progress lines (stderr), or None for none
        self.failures: list[str] = []
        self.bad_arrays: set[str] = set()  # arrays that failed their own checks (each has its FAIL line)
        self.consequences: dict[str, int] = {}  # bad array -> rows it kept from being re-derived
        self.arrays: dict[str, np.ndarray] = {}
        self.manifest: dict = {}
        self.results: dict = {}
        self.tolerances: dict[str, dict] = {}
        self.outside_protocols: dict[str, str] = {}
        self.outside_models: dict[str, str] = {}  # study -> a live model given by path (self-consistent only)
        # study -> scorers whose choice the audit cannot re-derive (a user's file; an online choice from
        # attention): their kept sets are checked self-consistently only
        self.user_scorers: dict[str, set] = {}
        self.protocol_copies: dict[str, dict] = {}  # study -> its frozen protocol copy, once it passed its checks
        self.numbers = 0
        self.rows_checked = 0
        self.cache: dict = {}  # loaded cases and derived values by key (`cached`); a check may evict what it is done with

    # -- reporting -------------------------------------------------------------------------
    def fail(self, where, reason: str) -> None:
        if isinstance(where, dict):
            where = self.row_label(where)
        self.failures.append(f"FAIL: {where}: {reason}")

    @staticmethod
    def row_label(row: dict) -> str:
        bits = [f"row {row.get('_index', '?')}", str(row.get("study")), str(row.get("analysis")), str(row.get("case"))]
        for key in ("arm", "query", "scheme", "rotation", "path", "ablation", "layer", "head"):
            if row.get(key) is not None:
                bits.append(f"{key}={row[key]}")
        return "results.json " + " ".join(bits)

    # -- helpers for checks ----------------------------------------------------------------
    def load(self, rel: str) -> np.ndarray:
        if isinstance(rel, str) and rel in self.bad_arrays:
            raise Consequence(rel)
        if not isinstance(rel, str) or rel not in self.arrays:
            raise AuditError(f"array {rel!r} is not in the manifest (or failed its checks)")
        return self.arrays[rel]

    def case_record(self, study, case_id) -> dict:
        try:
            rec = self.results["cases"][study][case_id]
        except (KeyError, TypeError):
            raise AuditError(f"case {study}/{case_id} is not in results.json") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("arrays"), dict):
            raise AuditError(f"case {study}/{case_id} in results.json has no arrays object")
        return rec

    def case(self, row: dict) -> dict:
        key = ("case", row.get("study"), row.get("case"))
        if key not in self.cache:
            rec = self.case_record(row.get("study"), row.get("case"))
            where = f"case {row.get('study')}/{row.get('case')}"
            case = {name: self.load(path) for name, path in rec["arrays"].items()}
            if "archive" in rec:
                # only a capture source whose frozen protocol asks for a partial archive makes one:
                # anywhere else an archive entry would let a forger drop the arrays and the checks
                src = (self.protocol_copies.get(row.get("study")) or {}).get("source") or {}
                if src.get("kind") != "capture" or src.get("archive") is None:
                    raise AuditError(f"{where}: has an archive entry, but its protocol's source keeps every array "
                                     "(only a capture source with 'archive' keeps part of them)")
                case["archive"] = _check_archive(case, rec["archive"], rec.get("head_map"), where)
                case["shapes"] = case["archive"]["shapes"]
            else:
                _check_case_arrays(case, where)
                case["shapes"] = {name: list(case[name].shape) for name in ("q", "k", "v")}
            meta = rec.get("meta", {})
            case.update({"causal": bool(rec["causal"]), "layout": rec["layout"], "meta": meta if isinstance(meta, dict) else {},
                         "tokens_per_frame": rec.get("tokens_per_frame"), "head_map": rec.get("head_map")})
            self.cache[key] = case
        case = self.cache[key]
        if "archive" in case and row.get("analysis") not in (None, "ablation"):
            raise AuditError(f"case {row.get('study')}/{row.get('case')} keeps only part of its Q/K/V (archive): "
                             f"only ablation rows can be re-derived, from its per-row statistics, not {row.get('analysis')} rows")
        return case

    def read_bytes(self, rel: str) -> bytes:
        """The bytes of a file of the run (inside it, no symlink followed)."""
        return safe_relpath(self.root, rel).read_bytes()

    def cached(self, key, fn):
        if key not in self.cache:
            self.cache[key] = fn()
        return self.cache[key]

    def _tol(self, row):
        return self.tolerances.get(row.get("study"), DEFAULT_TOLERANCE)

    def close(self, row: dict, name: str, reported, derived) -> bool:
        """Compare a reported value (number, None or array) with the audit's own."""
        self.numbers += 1
        tol = self._tol(row)
        if reported is None or derived is None:
            if reported is None and derived is None:
                return True
            self.fail(row, f"{name}: reported {reported!r}, audit derives {derived!r}")
            return False
        if isinstance(reported, (str, bool)) or (isinstance(reported, np.ndarray) and reported.dtype.kind not in "fiu"):
            self.fail(row, f"{name}: reported {reported!r} is not a number")
            return False
        if _integral(reported) and _integral(derived):
            tol = TOLERANCES["integer"]  # two integers: a count, a byte total, codes
        a = np.asarray(reported, dtype=np.float64)
        b = np.asarray(derived, dtype=np.float64)
        if a.shape != b.shape:
            self.fail(row, f"{name}: shape {a.shape} != derived {b.shape}")
            return False
        same_nan = np.isnan(a) & np.isnan(b)
        ok = same_nan | (np.abs(a - b) <= tol["atol"] + tol["rtol"] * np.abs(b))
        if not bool(np.all(ok)):
            if a.ndim == 0:
                self.fail(row, f"{name}: reported {float(a):.10g}, audit derives {float(b):.10g}")
            else:
                idx = tuple(int(i) for i in np.argwhere(~ok)[0])
                self.fail(row, f"{name}: differs at {idx}: stored {a[idx]:.10g}, audit derives {b[idx]:.10g}")
            return False
        return True

    def equal(self, row: dict, name: str, reported, derived) -> bool:
        self.numbers += 1
        if type(reported) is bool or reported != derived:
            self.fail(row, f"{name}: reported {reported!r}, audit derives {derived!r}")
            return False
        return True

    # -- stages ----------------------------------------------------------------------------
    def run(self, check_sources: bool) -> None:
        root = self.root
        try:
            manifest = load_json(safe_relpath(root, "manifest.json"))
        except AuditError as e:
            self.fail("manifest.json", str(e).removeprefix("manifest.json: "))
            return
        if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
            got = manifest.get("schema_version") if isinstance(manifest, dict) else type(manifest).__name__
            self.fail("manifest.json", f"schema_version {got!r} is not the supported {SCHEMA_VERSION}")
            return
        arrays = manifest.get("arrays")
        files = manifest.get("files")
        if not isinstance(arrays, dict) or not isinstance(files, dict):
            self.fail("manifest.json", "arrays and files must be objects")
            return
        self.manifest = manifest
        # each array's container (arrays/S/C.npz) is a file of the run; its members are the arrays
        cases: dict[str, set] = {}
        loose = set()  # array entries that name no container: expected as files, and failed below
        for rel in arrays:
            if rel.startswith("arrays/") and rel.endswith(".npy") and rel.count("/") == 3:
                container, member = container_of(rel)
                cases.setdefault(container, set()).add(member)
            else:
                loose.add(rel)
        expected = loose | set(files) | set(cases) | {"manifest.json"}
        present, links = present_files(root)
        for rel in sorted(links):
            self.fail(rel, "symlink inside the run; refused (not followed)")
        for rel in sorted(present - expected):
            self.fail(rel, "file not named in the manifest (added or renamed)")
        absent = {rel for rel in expected - present if rel not in links}
        for rel in sorted(absent):
            self.fail(rel if isinstance(rel, str) and not CONTROL_CHARS.search(rel) else repr(rel),
                      "named in the manifest but not a file of the run (deleted, renamed, or a path outside it)")

        def fail_once(rel, e):  # an absent file already has its line above; "missing" again adds nothing
            if not (rel in absent and str(e) == f"{rel}: missing"):
                self.fail(rel, str(e).removeprefix(f"{rel}: "))

        bar = self._bar(len(files) + len(arrays), "file")
        for rel, digest in sorted(files.items()):
            bar.step()
            try:
                path = safe_relpath(root, rel)
                if not isinstance(digest, str):
                    raise AuditError(f"manifest records {digest!r} instead of a sha256")
                if sha256_file(path) != digest:
                    raise AuditError("sha256 differs from the manifest")
            except AuditError as e:
                fail_once(rel, e)
        store = Containers(root)
        for container in sorted(set(cases) - absent):
            try:
                for member in store.members(container):
                    if member not in cases[container]:
                        self.fail(f"{container[:-len('.npz')]}/{member}",
                                  f"member of {container} not named in the manifest (added or renamed)")
            except AuditError as e:
                self.fail(container, str(e).removeprefix(f"{container}: "))
        for rel, entry in sorted(arrays.items()):
            bar.step()
            try:
                if not (isinstance(rel, str) and rel.startswith("arrays/") and rel.endswith(".npy")
                        and rel.count("/") == 3):
                    safe_relpath(root, rel)  # a path outside the run is named as such
                    raise AuditError("arrays must be .npy members arrays/STUDY/CASE/NAME.npy of arrays/STUDY/CASE.npz")
                container, member = container_of(rel)
                if container in absent:
                    raise AuditError(f"missing (its container {container} is not a file of the run)")
                safe_relpath(root, container)
                if any(part in ("..", ".", "") for part in rel.split("/")):
                    raise AuditError(f"path {rel!r} has an empty, '.' or '..' component; refused")
                if not MEMBER_NAME.fullmatch(member):
                    raise AuditError(f"member name {member!r} refused")
                self.arrays[rel] = store.load(rel, entry)
            except AuditError as e:
                self.bad_arrays.add(rel)
                self.fail(rel if not CONTROL_CHARS.search(str(rel)) else repr(rel), str(e).removeprefix(f"{rel}: "))
        store.close()
        self._check_gates()
        self._check_protocols()
        if check_sources:
            self._check_sources()
        self._check_results()
        self._check_results_csv()
        for rel, run_check in RUN_CHECKS.items():
            try:
                run_check(self)
            except AuditError as e:
                self.fail(rel, str(e).removeprefix(f"{rel}: "))

    def _check_gates(self) -> None:
        gates = self.manifest.get("gates", {})
        if not isinstance(gates, dict):
            self.fail("manifest.json gates", "must be an object")
            return
        studies = {e.get("name") for e in self.manifest.get("protocols", []) if isinstance(e, dict)} \
            if isinstance(self.manifest.get("protocols"), list) else set()
        for name, gate in sorted(gates.items()):
            if not isinstance(gate, dict) or set(gate) != {"expected", "actual"}:
                self.fail(f"manifest.json gates.{name}", f"a gate is {{expected, actual}}, not {gate!r}")
            elif gate["expected"] != gate["actual"]:
                self.fail(f"manifest.json gates.{name}", f"gate not met: {gate!r} (a finished run never has one)")
            if not any(isinstance(s, str) and name.startswith(s + ".") for s in studies):
                self.fail(f"manifest.json gates.{name}", "names no study of this run")

    def _check_protocols(self) -> None:
        entries = self.manifest.get("protocols")
        if not isinstance(entries, list) or not entries:
            self.fail("manifest.json protocols", "must be a non-empty list of frozen protocol copies")
            return
        sources = self.manifest.get("sources") if isinstance(self.manifest.get("sources"), dict) else {}
        for i, entry in enumerate(entries):
            where = f"manifest.json protocols[{i}]"
            if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in ("name", "copy", "sha256")):
                self.fail(where, "must be an object with string name, copy and sha256")
                continue
            rel, name = entry["copy"], entry["name"]
            # Rows of this study are still re-derived, at the strict default tolerances unless the
            # copy below passes every check.
            self.tolerances.setdefault(name, dict(DEFAULT_TOLERANCE))
            if rel not in self.manifest["files"]:
                self.fail(rel, "protocol copy is not listed in the manifest's files")
            try:
                raw = safe_relpath(self.root, rel).read_bytes()
                if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
                    raise AuditError("protocol copy does not match its recorded sha256")
                path = entry.get("path")
                if isinstance(path, str) and path:
                    # the repository's protocol is pinned by its source hash however the path is spelled
                    path = repository_path(path)
                if not isinstance(path, str) or not path:
                    self.fail(rel, "the protocol's path is not recorded (a run records where each protocol came from)")
                elif path in sources:
                    # A protocol from the repository is also covered by the source hashes, which the
                    # audit compares with the checkout: editing the copy means editing both records.
                    if hashlib.sha256(raw.replace(b"\r\n", b"\n")).hexdigest() != sources[path]:
                        raise AuditError(f"protocol copy differs from {path} as recorded in the manifest's sources")
                else:
                    # Nothing outside the run vouches for it: its rows are re-derived from it, so the
                    # run is consistent with that protocol, not shown to be the one its author ran.
                    self.outside_protocols[name] = path
                proto = load_json(safe_relpath(self.root, rel))
                if not isinstance(proto, dict) or proto.get("name") != name:
                    raise AuditError(f"protocol copy is not the protocol named {name!r}")
                self.tolerances[name] = _tolerances(proto)
                self.protocol_copies[name] = proto
            except AuditError as e:
                self.fail(rel, str(e).removeprefix(f"{rel}: "))

    def _check_sources(self) -> None:
        recorded = self.manifest.get("sources", {})
        if not isinstance(recorded, dict):
            self.fail("manifest.json sources", "must be an object")
            return
        current = source_hashes()
        for rel in sorted(set(recorded) | set(current)):
            if rel not in current:
                self.fail(f"source {rel}", "recorded in the manifest but absent from this checkout "
                                           "(use --no-sources for a run made by another version)")
            elif rel not in recorded:
                self.fail(f"source {rel}", "in this checkout but not recorded: the run predates it (regenerate, or --no-sources)")
            elif recorded[rel] != current[rel]:
                self.fail(f"source {rel}", "differs from the version that made this run (regenerate, or --no-sources)")

    def _check_results(self) -> None:
        if "results.json" not in self.manifest.get("files", {}):
            self.fail("results.json", "not named in the manifest")
            return
        try:
            self.results = load_json(safe_relpath(self.root, "results.json"))
        except AuditError as e:
            self.fail("results.json", str(e).removeprefix("results.json: "))
            return
        if not isinstance(self.results, dict) or self.results.get("schema_version") != SCHEMA_VERSION:
            self.fail("results.json", f"schema_version is not the supported {SCHEMA_VERSION}")
            return
        rows = self.results.get("rows")
        cases = self.results.get("cases")
        if not isinstance(rows, list) or not isinstance(cases, dict):
            self.fail("results.json", "rows must be a list and cases an object")
            return
        for study in sorted(set(cases) - set(self.tolerances)):
            self.fail(f"results.json cases.{study}", "no frozen protocol copy for this study in the manifest")
        seen: dict[str, int] = {}
        bar = self._bar(len(rows), "row")
        for i, row in enumerate(rows):
            bar.step()
            if not isinstance(row, dict):
                self.fail(f"results.json row {i}", "not an object")
                continue
            row = dict(row, _index=i)
            if not all(isinstance(row.get(k), str) for k in ("study", "analysis")):
                self.fail(f"results.json row {i}", "study and analysis must be strings")
                continue
            if row.get("study") not in self.tolerances:
                self.fail(row, "no frozen protocol copy for this row's study in the manifest")
                continue
            key = json.dumps(row | {"_index": None}, sort_keys=True, default=str)
            if key in seen:
                self.fail(row, f"exact duplicate of row {seen[key]}")
                continue
            seen[key] = i
            check = CHECKS.get(row.get("analysis"))
            if check is None:
                self.fail(row, f"no audit check for analysis {row.get('analysis')!r}")
                continue
            before = len(self.failures)
            try:
                self._check_row_labels(row)
                check(row, self)
            except Consequence as e:
                self.consequences[e.args[0]] = self.consequences.get(e.args[0], 0) + 1
                continue
            except AuditError as e:
                self.fail(row, str(e))
            except Exception as e:  # a forged row must give a FAIL line, never a traceback
                self.fail(row, f"cannot re-derive ({type(e).__name__}: {str(e)[:200]})")
            if len(self.failures) == before:
                self.rows_checked += 1
        if self.consequences:
            causes = sorted(self.consequences)
            self.fail("results.json", f"{sum(self.consequences.values())} row(s) not re-derived: they use "
                      f"{len(causes)} array(s) that failed above ({causes[0]}{', ...' if len(causes) > 1 else ''})")
        self._check_orphans()

    def _bar(self, total: int, unit: str) -> Progress:
        """A progress line every 2 s at most (and at the end) while a large run is audited."""
        return Progress(total, f"audit {self.root.name}", self.progress, unit=unit, interval=2.0)

    def _check_results_csv(self) -> None:
        """results.csv must say exactly what results.json says: same rows in the same order, every
        leaf of each row in its dotted column except the per-query-row lists under ``per_row``
        (:data:`CSV_OMITTED`), nothing else (testbed/tables.py describes the format)."""
        rows = self.results.get("rows") if isinstance(self.results, dict) else None
        if not isinstance(rows, list):
            return  # results.json itself already failed
        if "results.csv" not in self.manifest.get("files", {}):
            self.fail("results.csv", "not named in the manifest (every run writes one beside results.json)")
            return
        try:
            text = safe_relpath(self.root, "results.csv").read_bytes().decode("utf-8")
            table = list(csv.reader(io.StringIO(text, newline="")))
        except (AuditError, UnicodeDecodeError, csv.Error) as e:
            self.fail("results.csv", f"cannot be read as UTF-8 CSV ({str(e)[:200]})")
            return
        if not table:
            self.fail("results.csv", "empty (no header)")
            return
        header, body = table[0], table[1:]
        if len(set(header)) != len(header):
            self.fail("results.csv", "a column name repeats in the header")
            return
        if len(body) != len(rows):
            self.fail("results.csv", f"{len(body)} rows, results.json has {len(rows)}")
        for i, (cells, row) in enumerate(zip(body, rows)):
            where = f"results.csv row {i}" + (f" ({self.row_label(dict(row, _index=i))[len('results.json '):]})"
                                                if isinstance(row, dict) else "")
            if len(cells) != len(header):
                self.fail(where, f"{len(cells)} cells, the header has {len(header)} columns")
                continue
            leaves = _leaves({k: v for k, v in row.items() if k not in CSV_OMITTED}) if isinstance(row, dict) else {}
            for col in sorted(set(leaves) - set(header)):
                self.fail(where, f"no column {col!r} for a field of the row in results.json")
                break
            for col, cell in zip(header, cells):
                if not _cell_says(cell, leaves.get(col)):
                    self.fail(where, f"column {col!r} says {cell[:80]!r}, results.json says {leaves.get(col)!r:.80}")
                    break

    def _check_row_labels(self, row: dict) -> None:
        """The fields a row copies from its case (distribution, seed, n, layer, ...) must agree."""
        meta = self.case_record(row.get("study"), row.get("case")).get("meta")
        if not isinstance(meta, dict):
            raise AuditError("its case has no meta object")
        for key in CASE_FIELDS:
            if key in row and key in meta and row[key] != meta[key]:
                self.fail(row, f"{key}: row says {row[key]!r}, its case {row.get('case')!r} says {meta[key]!r}")

    def _check_orphans(self) -> None:
        """Every array must be used by a case or a row: a deleted row would leave its arrays behind."""
        used: set[str] = set()
        stack = [self.results]
        while stack:
            x = stack.pop()
            if isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, list):
                stack.extend(x)
            elif isinstance(x, str) and x.startswith("arrays/"):
                used.add(x)
        for rel in sorted(set(self.manifest.get("arrays", {})) - used):
            self.fail(rel, "not used by any case or row of results.json (was a row deleted?)")


# top-level row fields results.csv leaves out: per-query-row lists, read from results.json (the
# audit's own statement of testbed/tables.py's rule)
CSV_OMITTED = ("per_row",)


def _leaves(row: dict) -> dict:
    """Every leaf of a row under its dotted path; lists and empty objects are leaves."""
    out, todo = {}, [("", row)]
    while todo:
        path, obj = todo.pop()
        for key, value in obj.items():
            if isinstance(value, dict) and value:
                todo.append((f"{path}{key}.", value))
            else:
                out[f"{path}{key}"] = value
    return out


def _cell_says(cell: str, value) -> bool:
    """Whether one CSV cell states ``value`` (None: absent or null)."""
    if value is None:
        return cell == ""
    if isinstance(value, str):
        return cell == value
    try:
        parsed = strict_json(cell)
    except ValueError:
        return False
    if isinstance(value, bool) or isinstance(parsed, bool):
        return parsed is value
    if isinstance(value, (int, float)):
        if not isinstance(parsed, (int, float)):
            return False
        return parsed == value or (math.isnan(value) and math.isnan(parsed))
    return json.dumps(parsed, sort_keys=True) == json.dumps(value, sort_keys=True)


def _check_case_arrays(case: dict, where: str) -> None:
    """Shape rules of a Case: q [H, Tq, D], k = v [H_kv, Tk, D], H % H_kv == 0, integer
    query_positions [Tq] inside [0, Tk)."""
    try:
        q, k, v, qp = case["q"], case["k"], case["v"], case["query_positions"]
    except KeyError as e:
        raise AuditError(f"{where}: array {e} missing") from None
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3 or x.dtype.kind != "f" or x.size == 0:
            raise AuditError(f"{where}: {name} must be a non-empty rank-3 float array, got {x.dtype.str} {list(x.shape)}")
        if not np.isfinite(x).all():
            raise AuditError(f"{where}: {name} holds NaN or Inf")
    if k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[0] % k.shape[0]:
        raise AuditError(f"{where}: shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not form a Case")
    if qp.ndim != 1 or qp.dtype.kind not in "iu" or qp.shape[0] != q.shape[1]:
        raise AuditError(f"{where}: query_positions must be an integer array of shape [{q.shape[1]}]")
    if qp.size and (int(qp.min()) < 0 or int(qp.max()) >= k.shape[1]):
        raise AuditError(f"{where}: query_positions leave [0, {k.shape[1]})")


def _check_archive(case: dict, archive, head_map, where: str) -> dict:
    """A case that keeps only part of its Q/K/V: ``archive`` names the KV heads kept (with their
    query heads, by ``head_map``) and the full shapes; the arrays present must be exactly those."""
    if not isinstance(archive, dict) or set(archive) != {"kv_heads", "q_heads", "shapes"}:
        raise AuditError(f"{where}: archive must be an object with kv_heads, q_heads and shapes")
    shapes = archive["shapes"]
    if not isinstance(shapes, dict) or set(shapes) != {"q", "k", "v"} or not all(
            isinstance(x, list) and len(x) == 3 and all(_integral(n) and n > 0 for n in x) for x in shapes.values()):
        raise AuditError(f"{where}: archive.shapes must give positive rank-3 shapes of q, k and v")
    (h, tq, d), (hkv, tk, dk) = shapes["q"], shapes["k"]
    if shapes["v"] != shapes["k"] or dk != d or h % hkv:
        raise AuditError(f"{where}: archive.shapes q {shapes['q']}, k {shapes['k']}, v {shapes['v']} do not form a Case")
    if head_map != [i // (h // hkv) for i in range(h)]:
        raise AuditError(f"{where}: head_map {head_map!r} is not the GQA map of {h} query heads on {hkv} KV heads")
    kv = archive["kv_heads"]
    if not isinstance(kv, list) or not all(_integral(x) for x in kv) or kv != sorted(set(kv)) \
            or any(not 0 <= x < hkv for x in kv):
        raise AuditError(f"{where}: archive.kv_heads {kv!r} must be distinct ascending KV heads in [0, {hkv})")
    q_heads = [i for i, g in enumerate(head_map) if g in kv]
    if archive["q_heads"] != q_heads:
        raise AuditError(f"{where}: archive.q_heads {archive['q_heads']!r} are not the query heads {q_heads} of KV heads {kv}")
    qp = case.get("query_positions")
    if qp is None or qp.ndim != 1 or qp.dtype.kind not in "iu" or qp.shape[0] != tq or (qp.size and (
            int(qp.min()) < 0 or int(qp.max()) >= tk)):
        raise AuditError(f"{where}: query_positions must be an integer array of shape [{tq}] inside [0, {tk})")
    present = sorted(n for n in ("q", "k", "v") if n in case)
    if not kv:
        if present:
            raise AuditError(f"{where}: archives no KV head but stores {present}")
    else:
        _check_case_arrays(case, where)
        want = {"q": [len(q_heads), tq, d], "k": [len(kv), tk, d], "v": [len(kv), tk, d]}
        for name, shape in want.items():
            if list(case[name].shape) != shape:
                raise AuditError(f"{where}: archived {name} has shape {list(case[name].shape)}, the archive gives {shape}")
    return {"kv_heads": kv, "q_heads": q_heads, "shapes": shapes}


def _tolerances(proto: dict) -> dict:
    """The tolerances for a protocol's rows: the audit's own ("derived"), or tighter where the
    protocol's ``audit`` section asks for it. A looser value is a FAIL, not a setting: a forged copy
    with rtol = 1 would otherwise let a number inflated by half through."""
    section = proto.get("audit", {})
    if not isinstance(section, dict):
        raise AuditError("protocol audit section must be an object")
    out = {}
    for key, own in DEFAULT_TOLERANCE.items():
        val = section.get(key, own)
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) or val < 0:
            raise AuditError(f"audit.{key} = {val!r} is not a finite number >= 0")
        if val > own:
            raise AuditError(f"audit.{key} = {val!r} would loosen the audit's own tolerance {own:g} "
                             "(a protocol may only tighten it)")
        out[key] = float(val)
    return out


def _integral(x) -> bool:
    """An int, or an integer numpy array (bool excluded)."""
    if isinstance(x, np.ndarray):
        return x.dtype.kind in "iu"
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def audit(root: str | Path, check_sources: bool = True, progress=None) -> tuple[bool, list[str], str]:
    """Audit a run folder; returns (passed, FAIL lines, PASS summary). ``progress``: a callable
    that receives progress lines (the command line prints them on stderr unless --quiet)."""
    a = Audit(Path(root), progress)
    try:
        a.run(check_sources)
    except Exception as e:  # fail closed: an audit that cannot finish never passes
        a.fail(str(root), f"audit could not complete ({type(e).__name__}: {str(e)[:200]})")
    tols = sorted({(t["rtol"], t["atol"]) for t in a.tolerances.values()})
    summary = (f"PASS: {len(a.arrays)} arrays and {len(a.manifest.get('files', {}))} files match their sha256 "
               f"and nbytes; {a.rows_checked} rows re-derived ({a.numbers} numbers within tolerance "
               + ", ".join(f"rtol {r:g} atol {t:g}" for r, t in tols) + ")"
               + ("" if check_sources else "; source hashes not checked (--no-sources)")
               + "".join(f"; protocol {n} from outside the repository ({p}): self-consistent only"
                         for n, p in sorted(a.outside_protocols.items()))
               + "".join(f"; study {n} runs a model the audit does not know ({m}): its dimensions and bytes are "
                         "self-consistent only" for n, m in sorted(a.outside_models.items()))
               + "".join(f"; study {n} keeps tokens by {', '.join(sorted(m))}: those kept sets are checked "
                         "self-consistently (count, indices, K/V, bytes), not the choice itself"
                         for n, m in sorted(a.user_scorers.items())))
    return (not a.failures), a.failures, summary


def compare(root: str | Path, other: str | Path) -> list[str]:
    """FAIL lines for every array, result or protocol copy whose recorded hash differs between two runs.

    Only the two manifests are read (the audit of ``root`` checks its files against its manifest;
    audit ``other`` as well). Timings, report.md and the manifest's dates, environment and wall time
    are expected to differ and are not compared (report.md states the creation time; the audit of
    each run re-derives every cell of it from that run's results.json); nor is report.html, a
    rendering of the compared results and arrays (whose PNG bytes may change with the plotting
    library's version) whose plotted data and words the audit of each run recomputes."""
    out = []
    manifests = []
    for r in (root, other):
        try:
            m = load_json(safe_relpath(Path(r), "manifest.json"))
            if not isinstance(m, dict) or not isinstance(m.get("arrays"), dict) or not isinstance(m.get("files"), dict):
                raise AuditError("arrays and files must be objects")
        except AuditError as e:
            return [f"FAIL: {r}/manifest.json: {e}"]
        manifests.append(m)
    a, b = manifests

    def digest(m, rel):
        e = m["arrays"].get(rel)
        return e.get("sha256") if isinstance(e, dict) else None

    for rel in sorted(set(a["arrays"]) | set(b["arrays"])):
        if rel not in b["arrays"]:
            out.append(f"FAIL: {rel}: only in {root}")
        elif rel not in a["arrays"]:
            out.append(f"FAIL: {rel}: only in {other}")
        elif digest(a, rel) != digest(b, rel):
            out.append(f"FAIL: {rel}: differs from {other}")
    for rel in sorted(set(a["files"]) | set(b["files"])):
        if rel in ("timings.json", "report.md", "report.html"):
            continue
        if a["files"].get(rel) != b["files"].get(rel):
            out.append(f"FAIL: {rel}: differs from {other}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.audit", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", metavar="DIR", help="a finished run folder (e.g. evidence or target/x)")
    ap.add_argument("--no-sources", action="store_true",
                    help="do not compare recorded source hashes with this checkout (for runs made by another version)")
    ap.add_argument("--same-as", metavar="OTHER",
                    help="also require the same array, result and protocol hashes as the run OTHER "
                         "(a re-run of the same protocol on the same machine; see docs/reliability.md)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    root = Path(args.run_dir)
    if not root.is_dir():
        print(f"error: {root} is not a folder", file=sys.stderr)
        return 2
    if args.same_as is not None and not Path(args.same_as).is_dir():
        print(f"error: --same-as {args.same_as} is not a folder", file=sys.stderr)
        return 2
    ok, failures, summary = audit(root, check_sources=not args.no_sources, progress=None if args.quiet else stderr_emit)
    if args.same_as is not None:
        diff = compare(root, args.same_as)
        failures = failures + diff
        ok = ok and not diff
        summary += f"; identical array, result and protocol hashes to {args.same_as}"
    if ok:
        print(summary)
        return 0
    for line in failures:
        print(line)
    print(f"{len(failures)} problem(s) found in {root}")
    if args.same_as is not None and diff:
        print(f"(--same-as asks for identical bytes; how far apart the numbers are, within the cross-machine "
              f"tolerances or not: python -m testbed.compare {root} {args.same_as})")
    return 1


def cli(argv=None) -> int:
    """The ``testbed-audit`` console script: :func:`main` with Ctrl-C and a closed pipe handled."""
    return cli_entry(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
