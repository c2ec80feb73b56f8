"""Sampled replay of a finished run's model studies: ``python -m testbed.replay RUN``.

The audit (:mod:`testbed.audit`) re-derives every number from the stored arrays but cannot run
the model, so the per-token log-probabilities, argmaxes and generated tokens of the live study
(``"kind": "live"``) and of the retrieval study (``"kind": "retrieval"``) are taken on trust
there. This command runs the model again on a random sample of them and compares.

A **unit** is one row of such a study: (study, segment or trial, arm). Sampled units are re-run
from the run itself — the frozen protocol copy under ``protocols/`` and the token ids stored as
the cases' arrays, never the corpus or the tokenizer — through the run's own code path
(:func:`testbed.live.run_unit`, :func:`testbed.retrieval_study.run_unit`, with the batch of
segments or trials the run put the unit in, after its batch's reference arm, whose shared prefill
and log-probabilities the arm takes). The run is read by the audit's strict readers (no symlink,
nothing outside the run folder, no pickle). Every array of the row is compared with the stored one
(after checking the stored bytes against the manifest's SHA-256): the per-token log-probabilities
and KL, the argmaxes, the generated tokens, the stored bytes and context per forward, and the
evidence layer's recorded inputs and codes.

Tolerance (``TOLERANCES``), chosen from what the replay shares with the run:

- ``same``: the run's torch version, CPU instruction set (``torch_cpu_capability``), thread count
  and source files. The same code then does the same float operations in the same order, so the
  replay is expected to be bit-identical; floats may differ by at most 1e-5 (absolute; in nats for
  log-probabilities and KL), integer arrays (argmax, generated tokens, codes, bytes) not at all.
- ``cross``: anything else. Kernels of another instruction set sum in another order, a few ulps
  per operation through 30 layers, and a flipped quantization code moves a token by more: the rule
  testbed.compare applies to the model studies' per-token arrays across machines (``per_token``):
  floats within 5e-2 of the array's largest magnitude, up to 6 % of elements (at least one) beyond
  that but none beyond half of it; integer arrays differing in at most 2 % of their elements (at
  least one).

Chance that forged units escape: sampling N of T units without replacement misses one forged unit
with probability 1 - N/T, and all of k forged units with C(T-k, N) / C(T, N). The default N is the
fewest units that leave one forged unit at most a 5 % chance (``ESCAPE``): T - floor(T/20)
(:func:`default_sample`; 143 of the default run's 150 units); ``--all`` replays every unit.

Prints the share of units checked and the seed, those chances, the sampled units (study case
arm, on one line), one ``FAIL:`` line per unit that differs (its
study, case, arm, the chunk of forward calls holding its worst difference, and that difference)
and ``PASS`` or ``FAIL``; progress lines (counts, time left) go to stderr. Exit 0 PASS, 1 FAIL,
2 bad input (no such folder, not a run, no live or retrieval rows, N < 1, the model missing).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import math
import random
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import live, retrieval_study
from ._cli import entry
from .audit_checks.safe_io import AuditError, BadInput, Containers, load_json, safe_relpath
from .context import RunContext
from .compare import TOLERANCES as CMP_TOL, float_ratio, integers_allowed
from .evidence import REPO_ROOT, RecordingStore, array_rel, environment, source_hashes
from .progress import Progress
from .protocol import ProtocolError, validate_protocol
from .sources.models import INSTALL_HINT, CaptureUnavailable, load_model, model_dims
from .units import COST_PRIOR, pinned_torch

__all__ = ["main", "replay", "plan_units", "escape_chance", "default_sample", "ESCAPE", "TOLERANCES", "BadInput"]

ESCAPE = (5, 100)  # the default sample leaves one forged unit at most this chance to escape (5 %)

TOLERANCES = {
    "same": {"float_atol": 1e-5, "integer_fraction": 0.0},
    # testbed.compare's per-token rule (measured one instruction-set level down: docs/compare.md)
    "cross": {"float_rtol": CMP_TOL["per_token"]["rtol"], "outliers": CMP_TOL["per_token"]["outliers"],
              "outlier_rtol": CMP_TOL["per_token"]["outlier_rtol"],
              "integer_fraction": CMP_TOL["per_token_integer_fraction"]},  # at least one (integers_allowed)
}
KINDS = ("live", "retrieval")
PRIORITY = ("logprob", "argmax", "generated", "kl")  # the array a FAIL line names first, when it differs


@dataclass
class Unit:
    """One row of a model study: where it sits in results.json and the run unit (batch x arm) that
    produced it."""
    study: str
    kind: str
    case: str
    arm: str
    row: int  # index in results.json rows
    batch: int | None  # the run unit's batch index; None: the protocol plans no such (case, arm)
    arm_index: int | None


@dataclass
class Study:
    name: str
    kind: str
    proto: dict
    units: list  # the run units (batch x arm dicts), as plan() made them
    base: Path | None  # the original protocol's folder (a model given by path resolves there)


# -- reading the run: the audit's strict readers (no symlink, nothing outside the run, no pickle) --

def _read_json(root: Path, rel: str):
    try:
        return load_json(safe_relpath(root, rel))
    except AuditError as e:
        raise BadInput(f"{root}: not a run folder ({rel}: {e})") from None


def _stored(arrays: Containers, manifest: dict, rel: str) -> np.ndarray:
    """A stored array, its bytes checked against the manifest's SHA-256 (and its header against the
    manifest's dtype, shape and nbytes) first, by the audit's reader. Raises ``AuditError``."""
    try:
        return arrays.load(rel, manifest.get("arrays", {}).get(rel), check_sha=True)
    except AuditError as e:
        text = str(e) if str(e).startswith(str(rel)) else f"{rel}: {e}"
        raise AuditError(f"{text} (python -m testbed.audit says more)") from None


def _base(entry_: dict) -> Path | None:
    path = entry_.get("path")
    if not isinstance(path, str) or not path:
        return None
    p = Path(path)
    return (p if p.is_absolute() else REPO_ROOT / p).resolve().parent


def _live_units(arrays: Containers, manifest: dict, cases: dict, proto: dict, base) -> list:
    p = proto["live"]
    views, tokens = [], {}
    for prefix, prefill in live.context_views(p):
        ids = [live.case_id(prefix, i) for i in live.segment_indices(p)]
        views.append((prefill, ids))
        for sid in ids:
            rec = cases.get(sid)
            if not isinstance(rec, dict) or "token_ids" not in rec.get("arrays", {}):
                raise BadInput(f"{proto['name']}: segment {sid} has no stored token ids: not a complete live run")
            tokens[sid] = _stored(arrays, manifest, rec["arrays"]["token_ids"]).astype(np.int64).tolist()
    return live.batch_units(p, views, tokens, base, None)


def _retrieval_units(arrays: Containers, manifest: dict, cases: dict, proto: dict) -> list:
    trials = []
    for cid in sorted(cases):
        rec = cases[cid]
        meta = rec.get("meta", {})
        ids = _stored(arrays, manifest, rec["arrays"]["token_ids"]).astype(np.int64).tolist()
        P, n_q = int(meta["length"]), int(meta["question_tokens"])
        trials.append({"case": cid, "task": meta["task"], "length": P, "depth": meta["depth"], "trial": meta["trial"],
                       "seed": meta["seed"], "question_ids": ids[P:P + n_q], "answer_ids": ids[P + n_q:], "ids": ids})
    return retrieval_study.batch_units(proto["retrieval"], trials)


def _studies(root: Path, manifest: dict, all_cases: dict, arrays: Containers) -> dict[str, Study]:
    """The run's live and retrieval studies with cases, from their frozen protocol copies (read by
    the audit's strict readers, checked against the manifest's SHA-256)."""
    studies: dict[str, Study] = {}
    for e in manifest["protocols"]:
        copy = e.get("copy") if isinstance(e, dict) else None
        try:
            path = safe_relpath(root, copy)
            raw = path.read_bytes()
        except (AuditError, OSError) as err:
            raise BadInput(f"{root}: manifest.json protocols: the frozen copy {copy!r} cannot be read inside the run "
                           f"({err})") from None
        if hashlib.sha256(raw).hexdigest() != e.get("sha256"):
            raise BadInput(f"{root}: {copy} does not match its recorded SHA-256 (python -m testbed.audit says more)")
        try:
            proto = validate_protocol(load_json(path), where=copy)
        except (AuditError, ProtocolError, ValueError) as err:
            raise BadInput(f"{root}: {copy}: {' '.join(str(err).splitlines())}") from None
        kind = proto.get("kind")
        if kind not in KINDS:
            continue
        cases = all_cases.get(proto["name"], {})
        if not isinstance(cases, dict):
            raise BadInput(f"{root}: results.json cases.{proto['name']} must be an object (case id -> record)")
        if not cases:  # the model was missing when it ran: an exclusion, nothing to replay
            continue
        if kind == "live" and proto["live"].get("calibration"):
            raise BadInput(f"{root}: {proto['name']}: replay of a live study with calibrated codebooks is not supported "
                           "yet (its units take per-layer tables that the plan calibrates, not stored token ids)")
        if kind == "retrieval" and "multi_query" in proto["retrieval"].get("tasks", []):
            raise BadInput(f"{root}: {proto['name']}: replay of a retrieval study with multi_query is not supported yet "
                           "(its trials feed several questions and answers, its rows are told apart by their query)")
        if kind == "retrieval" and proto["retrieval"].get("question", ["after"]) != ["after"]:
            raise BadInput(f"{root}: {proto['name']}: replay of a retrieval study with the question inside the "
                           "prefill is not supported yet (its rows are told apart by their question placement)")
        try:
            units = (_live_units(arrays, manifest, cases, proto, _base(e)) if kind == "live"
                     else _retrieval_units(arrays, manifest, cases, proto))
        except (AuditError, KeyError, TypeError, AttributeError, ValueError, OSError) as err:
            raise BadInput(f"{root}: {proto['name']}: cannot rebuild the run's units ({type(err).__name__}: {err})") \
                from None
        studies[proto["name"]] = Study(proto["name"], kind, proto, units, _base(e))
    return studies


def plan_units(root: str | Path) -> tuple[dict, dict, dict[str, Study], list[Unit]]:
    """(manifest, results, studies, units) of the run in ``root``: every row of its live and
    retrieval studies as a :class:`Unit`, in results.json order. Raises :class:`BadInput`."""
    root = Path(root)
    if not root.is_dir():
        raise BadInput(f"{root} is not a folder")
    manifest = _read_json(root, "manifest.json")
    results = _read_json(root, "results.json")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("protocols"), list) \
            or not isinstance(results, dict) or not isinstance(results.get("rows"), list):
        raise BadInput(f"{root}: not a run folder (manifest.json protocols or results.json rows missing)")
    if not isinstance(manifest.get("arrays", {}), dict):
        raise BadInput(f"{root}: manifest.json arrays must be an object (path -> entry)")
    all_cases = results.get("cases", {})
    if not isinstance(all_cases, dict):
        raise BadInput(f"{root}: results.json cases must be an object (study -> case records)")
    arrays = Containers(root)
    try:
        studies = _studies(root, manifest, all_cases, arrays)
    finally:
        arrays.close()
    out = []
    for i, r in enumerate(results["rows"]):
        st = studies.get(r.get("study")) if isinstance(r, dict) else None
        if st is None:
            continue
        where = _where(st)
        hit = where.get((r.get("case"), r.get("arm")))
        out.append(Unit(st.name, st.kind, str(r.get("case")), str(r.get("arm")), i,
                        None if hit is None else hit[0], None if hit is None else hit[1]))
    if not out:
        raise BadInput(f"{root}: no rows of a live or retrieval study to replay")
    return manifest, results, studies, out


def _where(st: Study) -> dict:
    """{(case, arm name): (batch, arm index)} of a study's run units."""
    arms = _arms(st)
    out = {}
    for u in st.units:
        for case in (u["segments"] if st.kind == "live" else [t["case"] for t in u["trials"]]):
            out[(case, arms[u["arm"]][0])] = (u["batch"], u["arm"])
    return out


def _arms(st: Study) -> list:
    """(name, what) of the study's arms; a retrieval study's by name only (what: None), a budget's kept
    count being its unit's (:func:`testbed.retrieval_study.unit_arms`)."""
    if st.kind == "live":
        return live.arms_of(st.proto["live"])
    return [(name, None) for name in retrieval_study.arm_names(st.proto["retrieval"])]


# -- sampling ---------------------------------------------------------------------------------------

def escape_chance(total: int, sampled: int, forged: int = 1) -> float:
    """Probability that none of ``forged`` forged units is among ``sampled`` units drawn without
    replacement from ``total``: C(total - forged, sampled) / C(total, sampled)."""
    if forged > total - sampled:
        return 0.0
    return math.comb(total - forged, sampled) / math.comb(total, sampled)


def default_sample(total: int) -> int:
    """The fewest units N of ``total`` with 1 - N/T at most 5 % (:data:`ESCAPE`): T - floor(T/20),
    in integers (no float rounds the bound)."""
    return total - total * ESCAPE[0] // ESCAPE[1]


def sample(units: list[Unit], n: int, seed: int) -> list[Unit]:
    """``n`` units drawn without replacement (all when ``n`` reaches their number), in run order."""
    if n >= len(units):
        return list(units)
    picked = sorted(random.Random(seed).sample(range(len(units)), n))
    return [units[i] for i in picked]


# -- comparing --------------------------------------------------------------------------------------

def _diff(name: str, stored: np.ndarray, new: np.ndarray, tol: dict) -> dict | None:
    """None when equal to the last bit; else the worst difference and whether it is within ``tol``."""
    if stored.shape != new.shape or (stored.dtype.kind == "f") != (new.dtype.kind == "f"):
        return {"name": name, "ok": False, "index": None, "text": f"{name}: stored {stored.dtype}{list(stored.shape)}, "
                                                                   f"replayed {new.dtype}{list(new.shape)}"}
    if np.array_equal(stored, new, equal_nan=stored.dtype.kind == "f"):
        return None
    a, b = stored.ravel(), new.ravel()
    if stored.dtype.kind == "f":
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        with np.errstate(invalid="ignore"):  # inf - inf: set below
            d = np.abs(a64 - b64)
        d[(a64 == b64) | (np.isnan(a64) & np.isnan(b64))] = 0.0  # equal infinities, NaN in both
        d[np.isnan(a64) != np.isnan(b64)] = np.inf
        i = int(np.argmax(d))
        if "float_atol" in tol:
            ratio, rule = float(d[i]) / tol["float_atol"], f"{tol['float_atol']:g}"
        else:  # testbed.compare's per-token rule, on the stored array's scale
            finite = np.abs(a64[np.isfinite(a64)])
            ratio, rule = float_ratio(d, float(finite.max()) if finite.size else 0.0, "per_token")
        ok = bool(ratio <= 1)
        return {"name": name, "ok": ok, "index": i, "ratio": ratio,
                "text": f"{name}[{i}] stored {a[i].item():.9g}, replayed {b[i].item():.9g}: |Δ| {d[i]:.3g} "
                        f"({'within' if ok else 'beyond'} {rule})"}
    bad = np.flatnonzero(a != b)
    allowed = 0 if "float_atol" in tol else integers_allowed(a.size, exact=False, per_token=True)
    i = int(bad[0])
    ok = bad.size <= allowed
    return {"name": name, "ok": ok, "index": i, "ratio": bad.size / allowed if allowed else math.inf,
            "text": f"{name}[{i}] stored {a[i].item()!r}, replayed {b[i].item()!r}: {bad.size} of {a.size} differ "
                    f"(allowed {allowed})"}


def _arrays_of(row: dict) -> dict[str, str]:
    out = dict(row.get("arrays") or {})
    ev = row.get("evidence")
    if isinstance(ev, dict):
        out.update({f"evidence.{k}": v for k, v in (ev.get("arrays") or {}).items()})
    return out


def _chunk(st: Study, unit: dict, new_row: dict, arrays: dict, name: str, index: int | None) -> str:
    """Where element ``index`` of array ``name`` was computed: the chunk of forward calls."""
    if index is None:
        return ""
    if name.startswith("evidence."):
        return f"evidence layer {new_row['evidence']['layer']}"
    if st.kind == "live":
        ctxs = arrays["context"].astype(np.int64)
        bounds = ctxs - ctxs[0]  # scored tokens before each forward
        n = len(bounds) - 1
        if name in ("bytes", "context"):
            if index == 0:
                return "after the prefill"
            return f"chunk {index}/{n} (scored tokens {bounds[index - 1]}..{bounds[index] - 1})"
        c = int(np.searchsorted(bounds, index, side="right"))
        return f"chunk {c}/{n} (scored tokens {bounds[c - 1]}..{bounds[c] - 1})"
    if name == "generated":
        return f"greedy step {index + 1}"
    trial = unit["trials"][0]
    n_q, n_a, P = len(trial["question_ids"]), len(trial["answer_ids"]), trial["length"]
    sched = retrieval_study.arm_schedule(retrieval_study.unit_arms(st.proto["retrieval"], unit)[unit["arm"]][1], P,
                                      n_q + n_a - 1)
    bounds = np.concatenate([[0], np.cumsum(sched)])
    pos = n_q - 1 + index  # the fed position that predicts answer token ``index``
    c = int(np.searchsorted(bounds, pos, side="right"))
    return f"chunk {c}/{len(sched)} (answer token {index})"


# -- running ----------------------------------------------------------------------------------------

def replay(root: str | Path, n: int | None = None, seed: int = 0, threads: int | None = None, tolerance: str = "auto",
           progress=None) -> dict:
    """Replay ``n`` sampled units of the run in ``root`` (None: :func:`default_sample` of them).
    Returns a dict: ``ok``, ``lines`` (what to print), ``checked``, ``total``, ``identical``,
    ``regime``, ``seconds``."""
    if n is not None and n < 1:
        raise BadInput(f"--sample {n}: sample at least one unit")
    progress = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    root = Path(root)
    manifest, results, studies, units = plan_units(root)
    chosen = "" if n is not None else (f" (the default: the fewest that leave one forged unit at most "
                                       f"{100 * ESCAPE[0] // ESCAPE[1]} % to escape)")
    n = default_sample(len(units)) if n is None else n
    env = manifest.get("environment") if isinstance(manifest.get("environment"), dict) else {}
    if threads is None:
        threads = env.get("torch_threads") if isinstance(env.get("torch_threads"), int) and env["torch_threads"] > 0 else 1
    picked = sample(units, n, seed)
    t0 = time.perf_counter()
    lines, identical, failures = [], 0, 0
    arrays = Containers(root)
    try:
        with pinned_torch(threads):
            now = environment()
            same = {"torch": env.get("torch") == now["torch"],
                    "CPU instruction set": env.get("torch_cpu_capability") == now["torch_cpu_capability"],
                    "threads": env.get("torch_threads") == threads,
                    "source files": manifest.get("sources") == source_hashes()}
            regime = tolerance if tolerance != "auto" else ("same" if all(same.values()) else "cross")
            tol = TOLERANCES[regime]
            total = len(units)
            share = 100.0 * len(picked) / total
            lines.append(f"replay of {root}: {len(picked)} of {total} units checked ({share:.1f} %){chosen}, seed {seed}, "
                         f"{threads} thread(s)")
            why = ", ".join(k for k, v in same.items() if not v)
            ints = "exact" if not tol["integer_fraction"] else f"in at most {tol['integer_fraction']:g} of their elements"
            floats = (f"within {tol['float_atol']:g} (absolute; nats for log-probs)" if "float_atol" in tol else
                      f"within {tol['float_rtol']:g} of their largest magnitude, up to {tol['outliers']:g} of elements "
                      f"beyond (none past {tol['outlier_rtol']:g})")
            lines.append(f"tolerance {regime}: floats {floats}, integer arrays {ints}"
                         + (f" (differs from the run: {why})" if why else " (the run's torch, CPU instruction set, threads "
                            "and sources: expected bit-identical)"))
            ks = [k for k in (2, 5, 10) if k <= total]
            one = 100 * escape_chance(total, len(picked))
            lines.append(f"chance one forged unit escapes: 1 - {len(picked)}/{total} = {one:.1f} %"
                         + ("; k forged units all escape: " + ", ".join(
                             f"k={k} {100 * escape_chance(total, len(picked), k):.1f} %" for k in ks) if ks else "")
                         + f" (C({total}-k, {len(picked)}) / C({total}, {len(picked)}))")
            lines.append("units (study case arm): " + "; ".join(f"{u.study} {u.case} {u.arm}" for u in picked))
            # run units needed: per (study, batch) the reference, then each sampled arm once
            groups: dict[tuple, dict[int, list[Unit]]] = {}
            for u in picked:
                if u.batch is None:
                    failures += 1
                    lines.append(f"FAIL: {u.study} case {u.case} arm {u.arm}: results.json row {u.row} is no unit the "
                                 "frozen protocol plans")
                    continue
                groups.setdefault((u.study, u.batch), {}).setdefault(u.arm_index, []).append(u)
            # the cost class of every arm run, in the order they run (the progress line's time left)
            kinds = [_unit(studies[study], batch, j).get("cost", "unit") for (study, batch), arms in groups.items()
                     for j in [0] + sorted(j for j in arms if j != 0)]
            progress(f"[replay] {len(picked)} units of {total}: {len(kinds)} arm runs over {len(groups)} batches")
            t_load = time.perf_counter()
            for study in dict.fromkeys(study for study, _ in groups):  # before the clock of the first arm run
                _load(studies[study])
            if groups:
                progress(f"[replay] model(s) loaded ({time.perf_counter() - t_load:.1f} s)")
            bar = Progress(len(kinds), "replay", progress, unit="arm run", kinds=kinds, prior=COST_PRIOR)
            for (study, batch), arms in groups.items():
                st = studies[study]
                mod, ref_unit = _module(st), _unit(st, batch, 0)
                rows_ref, out, saves, one_off = _run(st, mod, ref_unit, None, progress)
                bar.step(f"{study} batch {batch + 1} {_arms(st)[0][0]}", kind=ref_unit.get("cost", "unit"), one_off=one_off)
                for j in sorted(arms):
                    if j == 0:
                        rows, arr = rows_ref, saves
                    else:
                        unit = _unit(st, batch, j)
                        rows, _, arr, one_off = _run(st, mod, unit, out, progress)
                        bar.step(f"{study} batch {batch + 1} {_arms(st)[j][0]}", kind=unit.get("cost", "unit"),
                                 one_off=one_off)
                    for u in arms[j]:
                        ok, exact, line = _compare(arrays, manifest, results["rows"][u.row], u, st,
                                                   _unit(st, batch, j), rows, arr, tol)
                        identical += exact
                        if not ok:
                            failures += 1
                            lines.append(line)
                del out
    finally:
        arrays.close()
    seconds = time.perf_counter() - t0
    if failures:
        lines.append(f"FAIL: {failures} of {len(picked)} replayed units differ beyond the {regime} tolerance "
                     f"({seconds:.1f} s)")
    else:
        lines.append(f"PASS: {len(picked)} of {total} units replayed within the {regime} tolerance, {identical} "
                     f"bit-identical ({seconds:.1f} s)")
    return {"ok": not failures, "lines": lines, "checked": len(picked), "total": total, "identical": identical,
            "regime": regime, "seconds": seconds}


def _module(st: Study):
    return live if st.kind == "live" else retrieval_study


def _unit(st: Study, batch: int, arm: int) -> dict:
    return next(u for u in st.units if u["batch"] == batch and u["arm"] == arm)


def _load(st: Study) -> None:
    """Load the study's model (memoized per process); a live unit also carries the model's
    dimensions, which its rows record for a model given by path."""
    if st.kind == "retrieval":
        load_model()
        return
    model, _, _ = load_model(model=st.proto["live"]["model"], base=st.base)
    dims = model_dims(model.config)
    for u in st.units:
        u["model_dims"] = dims


def _run(st: Study, mod, unit: dict, dep, progress):
    """One run unit through the run's own ``run_unit``, into a store that keeps the arrays in
    memory: (rows, the output its dependents take, {run-relative path: .npy bytes}, seconds of
    one-off work such as quanto's first-use compile)."""
    if st.kind == "live" and unit.get("model_dims") is None:
        _load(st)
    store = RecordingStore()
    ctx = RunContext(store, study=st.name, timing_repeats=0, timing_seed=0, progress=progress, base=st.base)
    rows, out, _ = mod.run_unit(st.proto, unit, ctx, dep)
    return rows, out, {array_rel(rel)[1]: data for rel, data in store.saves}, ctx.one_off


def _compare(arrays: Containers, manifest: dict, stored_row: dict, u: Unit, st: Study, unit: dict, rows: list,
             saves: dict, tol: dict) -> tuple[bool, int, str]:
    """(within tolerance, bit-identical, the FAIL line) of one sampled unit."""
    label = f"{u.study} case {u.case} arm {u.arm}"
    new_row = next((r for r in rows if r["case"] == u.case), None)
    if new_row is None:
        return False, 0, f"FAIL: {label}: the replay produced no row for this case"
    new_arrays = {k: np.load(io.BytesIO(saves[rel]), allow_pickle=False) for k, rel in _arrays_of(new_row).items()}
    stored_paths = _arrays_of(stored_row)
    if set(stored_paths) != set(new_arrays):
        return False, 0, (f"FAIL: {label}: stored arrays {sorted(stored_paths)}, the replay computes "
                          f"{sorted(new_arrays)}")
    diffs = []
    for name, rel in stored_paths.items():
        try:
            old = _stored(arrays, manifest, rel)
        except AuditError as e:
            return False, 0, f"FAIL: {label}: {name}: {e}"
        d = _diff(name, old, new_arrays[name], tol)
        if d is not None:
            diffs.append(d)
    if not diffs:
        return True, 1, ""
    bad = [d for d in diffs if not d["ok"]]
    if not bad:
        return True, 0, ""
    # the line names the per-token outputs first (log-prob, then argmax, generated, KL), else the worst
    worst = min(bad, key=lambda d: (PRIORITY.index(d["name"]) if d["name"] in PRIORITY else len(PRIORITY),
                                    -d.get("ratio", math.inf)))
    where = _chunk(st, unit, new_row, new_arrays, worst["name"], worst["index"])
    others = [d["name"] for d in bad if d is not worst]
    return False, 0, (f"FAIL: {label}{' ' + where if where else ''}: {worst['text']}"
                      + (f"; also differ: {', '.join(others)}" if others else ""))


# -- command line -----------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    same, cross = TOLERANCES["same"], TOLERANCES["cross"]
    epilog = (f"Tolerance: same (the run's torch, CPU instruction set, threads and sources; expected bit-identical): "
              f"floats within {same['float_atol']:g}, integer arrays exact; cross (anything else, testbed.compare's "
              f"per-token rule): floats within {cross['float_rtol']:g} of the array's largest magnitude, up to "
              f"{cross['outliers']:g} of elements (at least one) beyond but none past {cross['outlier_rtol']:g} of it, "
              f"integer arrays in at most {cross['integer_fraction']:g} of their elements (at least one). "
              "A forged unit escapes with probability 1 - N/T (k forged: C(T-k, N) / C(T, N)); the default N, "
              "T - floor(T/20), makes that at most 5 %. "
              "Exit 0 PASS, 1 FAIL, 2 bad input. See docs/replay.md.")
    ap = argparse.ArgumentParser(prog="python -m testbed.replay", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=textwrap.fill(epilog, width=100))
    ap.add_argument("run_dir", metavar="RUN", help="a finished run folder")
    pick = ap.add_mutually_exclusive_group()
    pick.add_argument("--sample", type=int, default=None, metavar="N",
                      help="units (study, segment or trial, arm) to replay, drawn without replacement (default: the "
                           "fewest that leave one forged unit at most a 5 %% chance to escape, T - floor(T/20) of T; "
                           "all when N reaches their number)")
    pick.add_argument("--all", action="store_true", help="replay every unit (no forged unit escapes the sample)")
    ap.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the draw (default 0)")
    ap.add_argument("--threads", type=int, default=None, metavar="T",
                    help="torch intra-op threads (default: the run's own count, for bit-identical replays)")
    ap.add_argument("--tolerance", choices=("auto", "same", "cross"), default="auto",
                    help="auto (default): same when the run's torch, CPU instruction set, threads and sources are "
                         "this replay's, else cross")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.sample is not None and args.sample < 1:
        print(f"error: --sample {args.sample}: sample at least one unit", file=sys.stderr)
        return 2
    if args.threads is not None and not 1 <= args.threads <= 1024:
        print(f"error: --threads {args.threads} must be between 1 and 1024", file=sys.stderr)
        return 2
    progress = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        n = 1 << 62 if args.all else args.sample  # every unit: sample() takes all when N reaches their number
        result = replay(args.run_dir, n, args.seed, args.threads, args.tolerance, progress)
    except BadInput as e:
        print(f"error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    except CaptureUnavailable as e:
        print(f"error: the run's model cannot be loaded here: {e}; install with: {INSTALL_HINT}", file=sys.stderr)
        return 2
    for line in result["lines"]:
        print(line)
    return 0 if result["ok"] else 1


def cli(argv=None) -> int:
    return entry(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
