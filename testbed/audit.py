"""Independent audit of a testbed run: ``python -m testbed.audit DIR``.

Imports only the standard library and numpy, and never the testbed's quantizers, attention or
metrics. It checks, in order:

1. ``manifest.json`` parses, has the supported ``schema_version`` and names only paths inside
   the run (no absolute paths, no ``..``, no symlinks; nothing outside is read);
2. the files present are exactly those the manifest names (nothing missing, added or renamed);
3. every file's SHA-256, and every array's SHA-256, nbytes, dtype and shape; ``.npy`` headers are
   read first and object dtypes refused, arrays are loaded with ``allow_pickle=False``;
4. the frozen protocol copies against their recorded hashes;
5. the source hashes (LF-normalized) against this checkout, unless ``--no-sources``;
6. every row of ``results.json``: payload bytes recomputed from the stored packed arrays, its own
   decoding and float64 attention, every reported number recomputed within the protocol's
   tolerances (``|a - b| <= atol + rtol * |b|``).

Prints ``PASS: ...`` with counts and exits 0, or one ``FAIL: <file or row>: <reason>`` line per
problem and exits 1 (exit 2 for a missing folder or bad arguments).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import stat
import sys
from pathlib import Path

import numpy as np

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCE_GLOBS = ("testbed/**/*.py", "protocols/*.json", "pyproject.toml")

__all__ = ["audit", "main"]


class AuditError(Exception):
    """A problem that stops the audit of one file or row."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _safe_relpath(root: Path, rel: str) -> Path:
    """Resolve ``rel`` inside ``root`` without following any symlink; refuse anything else."""
    if not isinstance(rel, str) or not rel or rel.startswith(("/", "\\")) or (len(rel) > 1 and rel[1] == ":"):
        raise AuditError(f"path {rel!r} is absolute or empty")
    parts = Path(rel).parts
    if any(p in ("..", ".", "") for p in parts) or "\\" in rel:
        raise AuditError(f"path {rel!r} leaves the run folder")
    cur = root
    for part in parts:
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            raise AuditError(f"{rel}: missing") from None
        if stat.S_ISLNK(st.st_mode):
            raise AuditError(f"{rel}: is a symlink; refused")
    if not stat.S_ISREG(os.lstat(cur).st_mode):
        raise AuditError(f"{rel}: not a regular file")
    return cur


def _present_files(root: Path) -> tuple[set[str], list[str]]:
    files, links = set(), []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in list(dirnames) + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                links.append(rel)
            elif name in filenames:
                files.add(rel)
    return files, links


def _load_npy(path: Path, rel: str, entry: dict) -> np.ndarray:
    """Check the .npy header before reading; refuse object dtypes and pickles."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise AuditError(f"{rel}: unsupported .npy version {version}")
        except ValueError as e:
            raise AuditError(f"{rel}: not a valid .npy file ({e})") from None
    if dtype.hasobject:
        raise AuditError(f"{rel}: object dtype {dtype} refused (would need pickle)")
    if dtype.str != entry.get("dtype") or list(shape) != entry.get("shape"):
        raise AuditError(f"{rel}: header says {dtype.str} {list(shape)}, manifest says {entry.get('dtype')} {entry.get('shape')}")
    try:
        arr = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise AuditError(f"{rel}: cannot load without pickle ({e})") from None
    if int(arr.nbytes) != entry.get("nbytes"):
        raise AuditError(f"{rel}: nbytes {arr.nbytes} != manifest {entry.get('nbytes')}")
    arr.setflags(write=False)
    return arr


def source_hashes(root: Path = REPO_ROOT) -> dict[str, str]:
    out = {}
    for pattern in SOURCE_GLOBS:
        for p in sorted(root.glob(pattern)):
            if p.is_file() and "__pycache__" not in p.parts:
                out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes().replace(b"\r\n", b"\n")).hexdigest()
    return out


class Audit:
    """State of one audit: failures, loaded arrays, counters; handed to the per-analysis checks."""

    def __init__(self, root: Path):
        self.root = root
        self.failures: list[str] = []
        self.arrays: dict[str, np.ndarray] = {}
        self.manifest: dict = {}
        self.results: dict = {}
        self.tolerances: dict[str, dict] = {}
        self.numbers = 0
        self._cache: dict = {}

    # -- reporting -------------------------------------------------------------------------
    def fail(self, where, reason: str) -> None:
        if isinstance(where, dict):
            where = self.row_label(where)
        self.failures.append(f"FAIL: {where}: {reason}")

    @staticmethod
    def row_label(row: dict) -> str:
        bits = [f"row {row.get('_index', '?')}", str(row.get("study")), str(row.get("analysis")), str(row.get("case"))]
        for key in ("arm", "scheme", "rotation", "path", "ablation", "layer", "head"):
            if row.get(key) is not None:
                bits.append(f"{key}={row[key]}")
        return "results.json " + " ".join(bits)

    # -- helpers for checks ----------------------------------------------------------------
    def load(self, rel: str) -> np.ndarray:
        if rel not in self.arrays:
            raise AuditError(f"array {rel!r} is not in the manifest (or failed its checks)")
        return self.arrays[rel]

    def case(self, row: dict) -> dict:
        key = ("case", row["study"], row["case"])
        if key not in self._cache:
            try:
                rec = self.results["cases"][row["study"]][row["case"]]
            except (KeyError, TypeError):
                raise AuditError(f"case {row.get('study')}/{row.get('case')} is not in results.json") from None
            case = {name: self.load(path) for name, path in rec["arrays"].items()}
            case.update({"causal": bool(rec["causal"]), "layout": rec["layout"], "meta": rec.get("meta", {}),
                         "tokens_per_frame": rec.get("tokens_per_frame"), "head_map": rec.get("head_map")})
            self._cache[key] = case
        return self._cache[key]

    def cached(self, key, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def _tol(self, row):
        return self.tolerances.get(row.get("study"), {"rtol": 1e-6, "atol": 1e-9})

    def close(self, row: dict, name: str, reported, derived) -> bool:
        """Compare a reported value (number, None or array) with the audit's own."""
        self.numbers += 1
        tol = self._tol(row)
        if reported is None or derived is None:
            if reported is None and derived is None:
                return True
            self.fail(row, f"{name}: reported {reported!r}, audit derives {derived!r}")
            return False
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
        if reported != derived:
            self.fail(row, f"{name}: reported {reported!r}, audit derives {derived!r}")
            return False
        return True

    # -- stages ----------------------------------------------------------------------------
    def run(self, check_sources: bool) -> None:
        root = self.root
        try:
            mpath = _safe_relpath(root, "manifest.json")
            manifest = json.loads(mpath.read_text(encoding="utf-8"))
        except AuditError as e:
            self.fail("manifest.json", str(e))
            return
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self.fail("manifest.json", f"not valid JSON ({e})")
            return
        if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
            got = manifest.get("schema_version") if isinstance(manifest, dict) else type(manifest).__name__
            self.fail("manifest.json", f"schema_version {got!r} is not the supported {SCHEMA_VERSION}")
            return
        self.manifest = manifest
        arrays = manifest.get("arrays")
        files = manifest.get("files")
        if not isinstance(arrays, dict) or not isinstance(files, dict):
            self.fail("manifest.json", "arrays and files must be objects")
            return
        expected = set(arrays) | set(files) | {"manifest.json"}
        present, links = _present_files(root)
        for rel in sorted(links):
            self.fail(rel, "symlink inside the run; refused")
        for rel in sorted(present - expected):
            self.fail(rel, "file not named in the manifest (added or renamed)")
        for rel in sorted(expected - present):
            if rel not in links:
                self.fail(rel, "named in the manifest but missing (deleted or renamed)")
        for rel, digest in sorted(files.items()):
            try:
                path = _safe_relpath(root, rel)
            except AuditError as e:
                self.fail(rel, str(e))
                continue
            if _sha256(path) != digest:
                self.fail(rel, "sha256 differs from the manifest")
        for rel, entry in sorted(arrays.items()):
            try:
                path = _safe_relpath(root, rel)
                if not rel.endswith(".npy"):
                    raise AuditError("arrays must be .npy files")
                if not isinstance(entry, dict) or _sha256(path) != entry.get("sha256"):
                    raise AuditError("sha256 differs from the manifest")
                self.arrays[rel] = _load_npy(path, rel, entry)
            except AuditError as e:
                self.fail(rel, str(e).removeprefix(f"{rel}: "))
        self._check_protocols()
        if check_sources:
            self._check_sources()
        self._check_results()

    def _check_protocols(self) -> None:
        for entry in self.manifest.get("protocols", []):
            rel = entry.get("copy", "")
            try:
                path = _safe_relpath(self.root, rel)
                raw = path.read_bytes()
                if hashlib.sha256(raw).hexdigest() != entry.get("sha256"):
                    raise AuditError("protocol copy does not match its recorded sha256")
                proto = json.loads(raw)
                self.tolerances[entry.get("name")] = {"rtol": float(proto.get("audit", {}).get("rtol", 1e-6)),
                                                      "atol": float(proto.get("audit", {}).get("atol", 1e-9))}
            except AuditError as e:
                self.fail(rel or "manifest.json protocols", str(e).removeprefix(f"{rel}: "))
            except (ValueError, AttributeError) as e:
                self.fail(rel, f"protocol is not valid JSON ({e})")

    def _check_sources(self) -> None:
        recorded = self.manifest.get("sources", {})
        current = source_hashes()
        for rel in sorted(set(recorded) | set(current)):
            if rel not in current:
                self.fail(f"source {rel}", "recorded in the manifest but absent from this checkout (use --no-sources for a run made by another version)")
            elif rel not in recorded:
                self.fail(f"source {rel}", "in this checkout but not recorded: the run predates it (regenerate, or --no-sources)")
            elif recorded[rel] != current[rel]:
                self.fail(f"source {rel}", "differs from the version that made this run (regenerate, or --no-sources)")

    def _check_results(self) -> None:
        from .audit_checks import CHECKS

        if "results.json" not in self.manifest.get("files", {}):
            self.fail("results.json", "not named in the manifest")
            return
        try:
            self.results = json.loads(_safe_relpath(self.root, "results.json").read_text(encoding="utf-8"))
        except AuditError as e:
            self.fail("results.json", str(e))
            return
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self.fail("results.json", f"not valid JSON ({e})")
            return
        rows = self.results.get("rows") if isinstance(self.results, dict) else None
        if not isinstance(rows, list):
            self.fail("results.json", "rows must be a list")
            return
        self.rows_checked = 0
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                self.fail(f"results.json row {i}", "not an object")
                continue
            row = dict(row, _index=i)
            check = CHECKS.get(row.get("analysis"))
            if check is None:
                self.fail(row, f"no audit check for analysis {row.get('analysis')!r}")
                continue
            try:
                check(row, self)
                self.rows_checked += 1
            except AuditError as e:
                self.fail(row, str(e))
            except (KeyError, TypeError, ValueError, IndexError) as e:
                self.fail(row, f"cannot re-derive ({type(e).__name__}: {e})")


def audit(root: str | Path, check_sources: bool = True) -> tuple[bool, list[str], str]:
    """Audit a run folder; returns (passed, FAIL lines, PASS summary)."""
    a = Audit(Path(root))
    a.run(check_sources)
    summary = (f"PASS: {len(a.arrays)} arrays and {len(a.manifest.get('files', {}))} files match their sha256 "
               f"and nbytes; {getattr(a, 'rows_checked', 0)} rows re-derived ({a.numbers} numbers within tolerance)"
               + ("" if check_sources else "; source hashes not checked (--no-sources)"))
    return (not a.failures), a.failures, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.audit", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", metavar="DIR", help="a finished run folder (e.g. evidence or target/x)")
    ap.add_argument("--no-sources", action="store_true",
                    help="do not compare recorded source hashes with this checkout (for runs made by another version)")
    args = ap.parse_args(argv)
    root = Path(args.run_dir)
    if not root.is_dir():
        print(f"error: {root} is not a folder", file=sys.stderr)
        return 2
    ok, failures, summary = audit(root, check_sources=not args.no_sources)
    if ok:
        print(summary)
        return 0
    for line in failures:
        print(line)
    print(f"{len(failures)} problem(s) found in {root}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
