"""Compare two run folders numerically: ``python -m testbed.compare A B``.

Imports only the standard library and numpy (like the audit, whose strict readers it uses: no
pickle, nothing outside the two folders, no symlinks). It answers "did B reproduce A?" where a
byte-for-byte check (``audit --same-as``) is too strict: the same protocol run with another
instruction set's kernels gives the same results to within a few float32 ulps — and, where one
of those ulps moves an input across a rounding boundary, a flipped code — not the same bytes.
Floats are compared normwise (per array, and per field of one arm of an analysis across its cases), with a
looser tolerance for the analyses where one flipped code moves a number by a quantization step.
docs/compare.md says what may differ and by how much, as measured between AVX2 and SSE4.2 kernels.

- arrays, matched by what they are, not by the path the store chose: the array a row names
  (``row study=... case=... arm=... arrays.logprob``), a case record names, or, named by neither,
  its path. The store keeps equal arrays of a study once, and which arrays are equal to the last
  bit differs between machines (two arrays 1 ulp apart on one, one path on the other), so paths
  are the store's choice. For each pair of equal dtype and shape, the max absolute difference
  against the array's largest value (float arrays) or the count of differing elements (integer and
  boolean arrays: quantization codes, argmax, token ids);
- results.json rows, matched by their identity fields (study, analysis, case, arm, ... not by
  position); every number of a row (nested fields and lists included) compared, the max abs and
  rel difference kept per field; strings (except arrays' paths), booleans and nulls must be equal;
- the frozen protocol copies must be identical (a comparison of two different protocols means
  nothing). timings.json, report.md (it states the creation time; each run's own audit re-derives
  every cell of it from that run's results.json), results.csv (a view of results.json) and the
  studies' own manifests (they record the machine) are not compared.

Prints the ten largest differences and ``PASS`` or one ``FAIL: ...`` line per problem; exit 0
on PASS, 1 on FAIL, 2 on bad input (not a run folder, unreadable manifest or results).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from ._cli import entry
from .audit_checks.safe_io import AuditError, BadInput, Containers, load_json, safe_relpath

__all__ = ["TOLERANCES", "IDENTITY", "compare_runs", "main"]

# Cross-machine tolerances (docs/compare.md). Floats are compared normwise: a group of numbers (one
# array; one field of one analysis across all its rows) passes when max |a - b| <= rtol * max |b|
# (+ ATOL_FLOOR for an all-zero group), so a value near zero is judged on its group's scale, not on
# its own (a float32 arm's rel_l2 of 3e-7 is rounding noise whatever its relative change).
TOLERANCES = {
    # float kernels of another instruction set sum in another order: measured between AVX2 and
    # SSE4.2-level kernels on one CPU (docs/compare.md), at most 4.0e-4 on row numbers and 7.8e-4 on
    # float16 payload scales (one float16 ulp where an input moved across a rounding boundary)
    "float": {"rtol": 1e-3},
    # where one flipped code moves a number by a whole quantization step: the MX Q/K path on sharp
    # rows and the live study, 30 layers deep with flushes re-quantizing the window (per-token KL up
    # to 2.6e-2 normwise). A flip moves one row by an arbitrary amount, so up to 1 % of a group's
    # elements (at least one) may lie beyond rtol, none beyond outlier_rtol: measured, one SmolLM2
    # layer-9 row of 144 at 6.1e-2 of its group's scale, every other element within 5e-2
    "flip_sensitive": {"rtol": 5e-2, "outliers": 0.01, "outlier_rtol": 0.5},
    # the per-token arrays of a model study (log-probs, KL, argmax, generated tokens of the live and
    # retrieval studies): a 2-bit cache re-quantized at every flush turns a flipped code into a
    # changed prediction at a few tokens. Measured one instruction-set level down (AVX2 against the
    # AVX-512 evidence, 2 threads against 1): quanto int2's log-probs moved beyond 5e-2 of their
    # scale at 5 of 96 tokens (at most 8.3e-2), its KL at 1, its argmax at 1 of 96 tokens; every
    # testbed arm stayed within 1.4e-2. So up to 6 % of elements may lie beyond rtol (at least one),
    # none beyond outlier_rtol; integer arrays up to 2 % of elements, at least one
    "per_token": {"rtol": 5e-2, "outliers": 0.06, "outlier_rtol": 0.5},
    "per_token_integer_fraction": 0.02,
    # the ablation's per-row dropped-mass array (``stats.tau``) holds, on a mass-matched control's
    # rows, the mass the control's keys reached: first fit stops inside [(1 - 0.01) t, (1 + 0.01) t]
    # of the target's mass t, and one flipped comparison lets another key reach that band first. So
    # any number of flips moves an element by at most 0.02 t, within 2.5e-2 of the array's scale.
    # Measured: 1.8e-3 of the scale, AMD EPYC (Zen 4) against the Intel AVX-512 evidence/
    "mass_band": {"rtol": 2.5e-2},
    # quantization codes and argmax flip only where a value sits on a rounding boundary or a tie
    # (measured at most 3.3e-4 of an array's elements)
    "integer_array_fraction": 1e-3,
    # integers in results.json are counts, sizes and byte totals: shapes decide them, not floats
    "integer_number": 0,
}
ATOL_FLOOR = 1e-12
FIELD_FLOOR = 1e-2
# analyses whose numbers are flip-sensitive (the model studies' arrays are "per_token")
FLIP_SENSITIVE = ("mx_paths", "live_quality", "retrieval")
# fields of other analyses that come out of a selection a flipped comparison changes: the
# mass-matched control picks keys until its mass is within 0.01 of the target, so its mismatch moves
# by a whole key's share when one comparison flips (measured up to 6.3e-3 of the field's scale)
FLIP_FIELDS = ("mass_mismatch_mean", "mass_mismatch_max")
# float arrays of other analyses that come out of the mass-matched selection (above: "mass_band")
MASS_BAND_ARRAYS = ("stats.tau",)
# Arrays that no float kernel touches: they must be identical on any machine.
EXACT_ARRAYS = ("token_ids", "query_positions", "header")
# The fields that say which row a result is (together they are unique within a run).
IDENTITY = ("study", "analysis", "case", "arm", "scheme", "rotation", "path", "ablation", "scope", "layer", "head",
            "kv_head", "draw", "query")
NOT_COMPARED = ("timings.json", "report.md", "results.csv", "results.json")
TOP = 10


def float_ratio(d: np.ndarray, scale: float, kind: str) -> tuple[float, str]:
    """How far differences ``d`` (>= 0, one array or group) are from failing tolerance ``kind`` on
    a group of scale ``scale``: (worst / the limit that applies, that limit in words); above 1 fails.
    The limit is ``rtol * scale``; where the kind allows outliers and few enough elements pass it,
    none by more than ``outlier_rtol * scale``, the outlier limit applies instead."""
    tol = TOLERANCES[kind]
    limit = tol["rtol"] * scale + ATOL_FLOOR
    worst = float(d.max())
    ratio, words = worst / limit, f"{kind}: rtol {tol['rtol']:g} x max|b| {scale:.3g}"
    if "outliers" in tol and ratio > 1:
        allowed = max(1, int(tol["outliers"] * d.size))
        if int(np.count_nonzero(d > limit)) <= allowed and worst <= tol["outlier_rtol"] * scale + ATOL_FLOOR:
            ratio = worst / (tol["outlier_rtol"] * scale + ATOL_FLOOR)
            words += f" (<= {allowed} beyond, none past {tol['outlier_rtol']:g})"
    return ratio, words


def integers_allowed(size: int, exact: bool, per_token: bool = False) -> int:
    """How many of ``size`` integer elements may differ: none for an exact array; for a model
    study's per-token array (argmax, generated tokens) ``per_token_integer_fraction``, at least
    one; else ``integer_array_fraction``, rounded down."""
    if exact:
        return 0
    if per_token:
        return max(1, int(TOLERANCES["per_token_integer_fraction"] * size))
    return int(TOLERANCES["integer_array_fraction"] * size)


class Diffs:
    """Worst difference per compared item, and the FAIL lines."""

    def __init__(self):
        self.failures: list[str] = []
        self.worst: dict[str, dict] = {}  # what -> {abs, rel, ratio, limit}
        self.numbers = 0
        self.exact = 0

    def fail(self, what: str, reason: str) -> None:
        self.failures.append(f"FAIL: {what}: {reason}")

    def floats(self, what: str, a: np.ndarray, b: np.ndarray, kind: str = "float", labels=None,
               floor_scale: float = 0.0) -> None:
        """Normwise float comparison of a (from A) against b (from B, the reference): passes when
        max |a - b| <= rtol * max(max |b|, floor_scale) (+ ATOL_FLOOR). ``labels[i]`` names where
        element i comes from (the row of a field), for the FAIL line."""
        rtol = TOLERANCES[kind]["rtol"]
        a = np.asarray(a, dtype=np.float64).ravel()
        b = np.asarray(b, dtype=np.float64).ravel()
        self.numbers += a.size
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        if np.any(nan_a != nan_b):
            i = int(np.argmax(nan_a != nan_b))
            self.fail(labels[i] if labels else what, f"NaN at {int(np.sum(nan_a != nan_b))} position(s) in one run only")
            return
        ok = ~nan_a
        ok &= ~(np.isinf(a) & (a == b))
        if np.any(np.isinf(a[ok]) | np.isinf(b[ok])):
            self.fail(what, "an infinity in one run only")
            return
        idx = np.flatnonzero(ok)
        d = np.abs(a[idx] - b[idx])
        if d.size == 0 or not np.any(d):
            self.exact += 1
            return
        scale = max(float(np.abs(b[idx]).max()), floor_scale)
        j = int(np.argmax(d))
        i = int(idx[j])
        ratio, limit = float_ratio(d, scale, kind)
        entry = {"abs": float(d[j]), "rel": float(d[j]) / scale if scale else math.inf, "ratio": ratio,
                 "limit": limit, "beyond_1e-4": int(np.count_nonzero(d > 1e-4 * scale)), "n": int(d.size)}
        self._keep(what, entry)
        if entry["ratio"] > 1:
            at = labels[i] if labels else what
            elem = "" if labels else f" at element {i}"
            self.fail(at, f"differs by {d[j]:.3g}{elem}: {a[i]!r} against {b[i]!r}, {entry['rel']:.3g} of the "
                          f"{'field' if labels else 'array'}'s scale {scale:.3g} (tolerance {kind} rtol {rtol:g})")

    def integers(self, what: str, a: np.ndarray, b: np.ndarray, exact: bool, per_token: bool = False) -> None:
        self.numbers += a.size
        n = int(np.count_nonzero(a != b))
        if not n:
            self.exact += 1
            return
        allowed = integers_allowed(a.size, exact, per_token)
        self._keep(what, {"abs": float(n), "rel": n / a.size, "ratio": n / allowed if allowed else math.inf,
                          "limit": "identical" if exact else f"<= {allowed} elements"})
        if n > allowed:
            self.fail(what, f"{n} of {a.size} elements differ (allowed {allowed})")

    def _keep(self, what: str, entry: dict) -> None:
        old = self.worst.get(what)
        if old is None or entry["ratio"] > old["ratio"]:
            self.worst[what] = entry


def _run(root: Path) -> tuple[dict, dict]:
    if not root.is_dir():
        raise BadInput(f"{root} is not a folder")
    try:
        manifest = load_json(safe_relpath(root, "manifest.json"))
        results = load_json(safe_relpath(root, "results.json"))
    except AuditError as e:
        raise BadInput(f"{root}: not a run folder ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("arrays"), dict) \
            or not isinstance(manifest.get("files"), dict):
        raise BadInput(f"{root}/manifest.json: arrays and files must be objects")
    if not isinstance(results, dict) or not isinstance(results.get("rows"), list):
        raise BadInput(f"{root}/results.json: rows must be a list")
    return manifest, results


def array_names(manifest: dict, results: dict) -> dict[str, tuple[str, str | None]]:
    """What each array of a run is -> (its path, the row or case that names it, or None):
    ``row <identity> <field>`` for an array a row names
    (``row study=smollm2_quality analysis=live_quality case=seg001 arm=int4 arrays.logprob``),
    ``case study=S case=C <field>`` for one a case record names, and the path itself for an array
    nothing names. One path may be several arrays: the store keeps equal arrays of a study once, and
    which arrays are equal to the last bit differs between machines."""
    arrays = manifest["arrays"]
    names: dict[str, tuple[str, str | None]] = {}
    for key, row in _keyed(results["rows"], Path(".")).items():
        for field, v in _leaves(row):
            if isinstance(v, str) and v in arrays:
                names[f"{_label(key)} {field}"] = (v, _label(key))
    cases = results.get("cases")
    for study, recs in sorted(cases.items() if isinstance(cases, dict) else []):
        for case, rec in sorted(recs.items() if isinstance(recs, dict) else []):
            for field, v in _leaves(rec):
                if isinstance(v, str) and v in arrays:
                    names[f"case study={study} case={case} {field}"] = (v, f"case study={study} case={case}")
    named = {path for path, _ in names.values()}
    names.update({rel: (rel, None) for rel in arrays if rel not in named})
    return names


def _in_studies(path: str, studies: set) -> bool:
    """Whether an array path ``arrays/STUDY/...`` belongs to one of ``studies``."""
    parts = path.split("/")
    return len(parts) > 1 and parts[1] in studies


def float_array_kind(name: str, path: str, flip_studies: set) -> str:
    """The tolerance (a key of ``TOLERANCES``) of a float array named ``name`` stored at ``path``
    (``arrays/STUDY/CASE/FILE.npy``): a model study's per-token arrays, the ablation's per-row
    dropped mass (the mass-matched selection's band), or plain floats."""
    if _in_studies(path, flip_studies):
        return "per_token"
    last = path.rsplit("/", 1)[-1]
    stem = last[:-len(".npy")] if last.endswith(".npy") else last
    ablation = " analysis=ablation " in f" {name} " or stem.startswith("ablation.")
    if ablation and any(w.endswith(tuple("." + a for a in MASS_BAND_ARRAYS)) for w in (name, stem)):
        return "mass_band"
    return "float"


def _compare_arrays(ra: Path, rb: Path, ma: dict, mb: dict, res_a: dict, res_b: dict, out: Diffs,
                    flip_studies: set) -> int:
    """Arrays matched by what they are (:func:`array_names`), each distinct pair of paths compared once."""
    na, nb = array_names(ma, res_a), array_names(mb, res_b)
    owners_a, owners_b = {o for _, o in na.values()}, {o for _, o in nb.values()}

    def where(name: str, pa: str, pb: str) -> str:
        if name == pa == pb:
            return name
        return f"{name} ({pa})" if pa == pb else f"{name} ({pa} in {ra}, {pb} in {rb})"

    # an array of a row (or case) that one run lacks altogether is that row's FAIL line, not its own;
    # an array nothing names is missing when its path is
    for name in sorted(set(na) - set(nb)):
        path, owner = na[name]
        if (owner in owners_b) if owner is not None else path not in mb["arrays"]:
            out.fail(where(name, path, path), f"array only in {ra}")
    for name in sorted(set(nb) - set(na)):
        path, owner = nb[name]
        if (owner in owners_a) if owner is not None else path not in ma["arrays"]:
            out.fail(where(name, path, path), f"array only in {rb}")
    pairs: dict[tuple[str, str], str] = {}
    for name in sorted(set(na) & set(nb)):
        pairs.setdefault((na[name][0], nb[name][0]), name)
    ca, cb = Containers(ra), Containers(rb)
    for (pa, pb), name in sorted(pairs.items(), key=lambda kv: kv[1]):
        what = where(name, pa, pb)
        try:
            x = ca.load(pa, ma["arrays"][pa], check_sha=False)
            y = cb.load(pb, mb["arrays"][pb], check_sha=False)
        except AuditError as e:
            out.fail(what, f"cannot be read ({e}); audit both runs")
            continue
        if x.dtype != y.dtype or x.shape != y.shape:
            out.fail(what, f"{x.dtype.str} {list(x.shape)} in {ra}, {y.dtype.str} {list(y.shape)} in {rb}")
        elif x.dtype.kind == "f":
            out.floats(what, x, y, float_array_kind(name, pb, flip_studies))
        else:
            words = (name.rsplit(" ", 1)[-1], pb.rsplit("/", 1)[-1])
            out.integers(what, x, y, exact=any(word in w for word in EXACT_ARRAYS for w in words),
                         per_token=_in_studies(pb, flip_studies))
    ca.close()
    cb.close()
    return len(set(na) & set(nb))


def _identity(row: dict) -> str:
    return json.dumps([row.get(k) for k in IDENTITY])


def _keyed(rows: list, root: Path) -> dict[str, dict]:
    keyed: dict[str, dict] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise BadInput(f"{root}/results.json: row {i} is not an object")
        key, n = _identity(row), 1
        while key in keyed:  # repeated identities are matched in order
            n += 1
            key = f"{_identity(row)}#{n}"
        keyed[key] = row
    return keyed


def _label(key: str) -> str:
    ident, _, n = key.partition("#")
    bits = [f"{k}={v}" for k, v in zip(IDENTITY, json.loads(ident)) if v is not None]
    return "row " + " ".join(bits) + (f" (#{n})" if n else "")


def _leaves(value, path: str = ""):
    """(dotted path, leaf) pairs; list items are leaves of the path with ``[]`` appended when they
    are numbers (compared as one array), else of ``path[i]``."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list) and value and all(_is_number(v) for v in value):
        yield f"{path}[]", value
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _compare_rows(ra: Path, rb: Path, res_a: dict, res_b: dict, out: Diffs, arrays_a=(), arrays_b=()) -> int:
    a, b = _keyed(res_a["rows"], ra), _keyed(res_b["rows"], rb)
    for key in sorted(set(a) - set(b)):
        out.fail(f"results.json {_label(key)}", f"only in {ra}")
    for key in sorted(set(b) - set(a)):
        out.fail(f"results.json {_label(key)}", f"only in {rb}")
    per_field: dict[str, list] = {}
    for key in sorted(set(a) & set(b)):
        la, lb = dict(_leaves(a[key])), dict(_leaves(b[key]))
        where = f"results.json {_label(key)}"
        for field in sorted(set(la) | set(lb)):
            x, y = la.get(field), lb.get(field)
            if field not in la or field not in lb:
                out.fail(where, f"field {field} only in {ra if field in la else rb}")
            elif isinstance(x, list) or isinstance(y, list):
                if not (isinstance(x, list) and isinstance(y, list) and len(x) == len(y)):
                    out.fail(where, f"{field}: {len(x) if isinstance(x, list) else x!r} items against "
                                    f"{len(y) if isinstance(y, list) else y!r}")
                elif all(isinstance(v, int) for v in x + y):
                    _exact_ints(out, where, field, x, y)
                else:
                    per_field.setdefault(_group(a[key], field), []).append((where, x, y))
            elif isinstance(x, str) and isinstance(y, str) and x in arrays_a and y in arrays_b:
                continue  # an array's path: the store's choice; the array is compared by what it is
            elif _is_number(x) and _is_number(y):
                if isinstance(x, int) and isinstance(y, int):
                    _exact_ints(out, where, field, [x], [y])
                else:
                    per_field.setdefault(_group(a[key], field), []).append((where, [x], [y]))
            elif x != y or type(x) is not type(y):
                out.fail(where, f"{field}: {x!r} against {y!r}")
    # a group's scale is never taken below FIELD_FLOOR of its field's largest value across the
    # analysis: a float32 arm's rel_l2 (rounding noise, ~1e-7) is judged on that, not on itself
    field_scale: dict = {}
    for (study, analysis, field, _), items in per_field.items():
        ys = [abs(v) for _, _, y in items for v in y if isinstance(v, (int, float)) and math.isfinite(v)]
        key = (study, analysis, field)
        field_scale[key] = max([field_scale.get(key, 0.0)] + ys)
    for (study, analysis, field, rest), items in sorted(per_field.items(), key=lambda kv: repr(kv[0])):
        # one group per field of one arm (ablation, path, ...) across its cases: the table shows
        # groups, not rows
        xs = np.concatenate([np.asarray(x, dtype=np.float64) for _, x, _ in items])
        ys = np.concatenate([np.asarray(y, dtype=np.float64) for _, _, y in items])
        labels = [f"{where} {field}" for where, x, _ in items for _ in x]
        tag = " ".join(f"{k}={v}" for k, v in rest)
        out.floats(f"results.json {study} {analysis} {tag + ' ' if tag else ''}{field}", xs, ys,
                   "flip_sensitive" if analysis in FLIP_SENSITIVE or field in FLIP_FIELDS else "float", labels,
                   FIELD_FLOOR * field_scale[(study, analysis, field)])
    return len(set(a) & set(b))


def _group(row: dict, field: str) -> tuple:
    """The numbers judged together: one field of the rows that differ only by their case (seed,
    prompt, length), i.e. of one arm / ablation / path / scheme / head / layer of one analysis."""
    rest = tuple((k, row.get(k)) for k in IDENTITY if k not in ("study", "analysis", "case") and row.get(k) is not None)
    return (str(row.get("study")), str(row.get("analysis")), field, rest)


def _exact_ints(out: Diffs, where: str, field: str, x: list, y: list) -> None:
    out.numbers += len(x)
    if x != y:
        out.fail(where, f"{field}: {x if len(x) > 1 else x[0]!r} against {y if len(y) > 1 else y[0]!r} "
                        "(integers must be equal)")


def _compare_protocols(ma: dict, mb: dict, out: Diffs) -> None:
    pa = {e.get("name"): e.get("sha256") for e in ma.get("protocols", []) if isinstance(e, dict)}
    pb = {e.get("name"): e.get("sha256") for e in mb.get("protocols", []) if isinstance(e, dict)}
    for name in sorted(set(pa) | set(pb)):
        if pa.get(name) != pb.get(name):
            out.fail(f"protocol {name}", "the frozen protocol copies differ (or one run lacks it)")


def _studies(manifest: dict, results: dict) -> set[str]:
    rows = {r.get("study") for r in results["rows"] if isinstance(r, dict)}
    protos = {e.get("name") for e in manifest.get("protocols", []) if isinstance(e, dict)}
    return {s for s in rows | protos if isinstance(s, str)}


def _restrict(manifest: dict, results: dict, studies: set[str]) -> tuple[dict, dict]:
    """The part of a run that belongs to ``studies``: their rows, case records, protocol copies and
    arrays (a study's arrays live under ``arrays/<study>/``)."""
    arrays = {rel: v for rel, v in manifest["arrays"].items() if rel.split("/")[1:2] and rel.split("/")[1] in studies}
    m = {**manifest, "arrays": arrays,
         "protocols": [e for e in manifest.get("protocols", []) if isinstance(e, dict) and e.get("name") in studies]}
    cases = results.get("cases")
    r = {**results, "rows": [row for row in results["rows"] if isinstance(row, dict) and row.get("study") in studies],
         "cases": {k: v for k, v in cases.items() if k in studies} if isinstance(cases, dict) else cases}
    return m, r


def compare_runs(a: str | Path, b: str | Path, studies=None) -> tuple[bool, list[str], str]:
    """Compare run ``a`` with run ``b`` (the reference); returns (passed, lines to print, summary).
    ``studies``: compare only these studies (each must be in both runs), e.g. a run of some
    protocols against the archived default run. Raises BadInput for folders that are not runs."""
    ra, rb = Path(a), Path(b)
    (ma, res_a), (mb, res_b) = _run(ra), _run(rb)
    if studies:
        studies = set(studies)
        for root, m, r in ((ra, ma, res_a), (rb, mb, res_b)):
            missing = sorted(studies - _studies(m, r))
            if missing:
                raise BadInput(f"{root} has no study {', '.join(missing)} (its studies: {', '.join(sorted(_studies(m, r)))})")
        (ma, res_a), (mb, res_b) = _restrict(ma, res_a, studies), _restrict(mb, res_b, studies)
    out = Diffs()
    _compare_protocols(ma, mb, out)
    flip_studies = {r.get("study") for r in res_b["rows"]
                    if isinstance(r, dict) and r.get("analysis") in ("live_quality", "retrieval")}
    n_arrays = _compare_arrays(ra, rb, ma, mb, res_a, res_b, out, flip_studies)
    n_rows = _compare_rows(ra, rb, res_a, res_b, out, set(ma["arrays"]), set(mb["arrays"]))
    lines = _table(out)
    summary = ((f"studies {', '.join(sorted(studies))} only: " if studies else "")
               + f"{n_arrays} arrays and {n_rows} rows in both runs, {out.numbers} numbers compared "
               f"({len(out.worst)} items differ at all; floats normwise within rtol {TOLERANCES['float']['rtol']:g} "
               f"of their array's or field's largest value, {TOLERANCES['flip_sensitive']['rtol']:g} where a flipped "
               f"code moves them ({', '.join(FLIP_SENSITIVE)}, {', '.join(FLIP_FIELDS)}), the model studies' per-token "
               f"arrays {TOLERANCES['per_token']['rtol']:g} with up to {TOLERANCES['per_token']['outliers']:g} of "
               f"elements beyond (integers <= {TOLERANCES['per_token_integer_fraction']:g}), the ablation's per-row "
               f"dropped mass {TOLERANCES['mass_band']['rtol']:g} (the mass-matched band), other integer arrays <= "
               f"{TOLERANCES['integer_array_fraction']:g} of elements)")
    return not out.failures, lines + out.failures, summary


def _table(out: Diffs) -> list[str]:
    if not out.worst:
        return ["no differences: every compared array and number is identical"]
    top = sorted(out.worst.items(), key=lambda kv: -kv[1]["ratio"])[:TOP]
    width = min(120, max(len(w) for w, _ in top))
    lines = [f"largest differences ({len(out.worst)} items differ; 'of scale' = max |a - b| / max |b| of the "
             "array or field (integer arrays: share of elements); 'moved' = elements beyond 1e-4 of the scale; "
             "ratio = difference / tolerance):",
             f"  {'what':<{width}}  {'max abs':>9}  {'of scale':>9}  {'moved':>11}  {'ratio':>7}  tolerance"]
    for what, e in top:
        name = what if len(what) <= width else what[:width - 3] + "..."
        moved = f"{e['beyond_1e-4']}/{e['n']}" if "n" in e else "-"
        lines.append(f"  {name:<{width}}  {e['abs']:>9.3g}  {e['rel']:>9.3g}  {moved:>11}  {e['ratio']:>7.3g}  {e['limit']}")
    # the largest difference of each kind, against its tolerance
    kinds: dict[str, tuple] = {}
    for what, e in out.worst.items():
        kind = e["limit"].split(":")[0] if ":" in e["limit"] else "integer arrays"
        kind = ("rows " if what.startswith("results.json") else "arrays ") + kind
        if kind not in kinds or e["rel"] > kinds[kind][0]:
            kinds[kind] = (e["rel"], what)
    lines.append("largest difference of each kind: " + "; ".join(
        f"{k} {v[0]:.2g}" for k, v in sorted(kinds.items())))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.compare", description=__doc__.split("\n\n")[0],
                                 epilog="Tolerances and what may differ across machines: docs/compare.md.")
    ap.add_argument("a", metavar="A", help="the run folder to check (e.g. a run made on another machine)")
    ap.add_argument("b", metavar="B", help="the reference run folder to compare it with (e.g. the archived "
                    "evidence/): every tolerance is relative to B's values")
    ap.add_argument("--study", action="append", metavar="NAME",
                    help="compare only this study (repeatable; each must be in both runs): e.g. a run of some "
                         "protocols against the archived default run")
    args = ap.parse_args(argv)
    try:
        ok, lines, summary = compare_runs(args.a, args.b, args.study)
    except BadInput as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    if ok:
        print(f"PASS: {summary}")
        return 0
    print(f"{sum(1 for x in lines if x.startswith('FAIL: '))} problem(s): {args.a} does not match {args.b} "
          "within the cross-machine tolerances")
    return 1


def cli(argv=None) -> int:
    """The ``testbed-compare`` console script."""
    return entry(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
