"""Completeness of a run: exactly the cases and rows its frozen protocol copies produce.

A second statement, in numpy + stdlib, of what each source and analysis makes (written from the
run side's documented behaviour, never imported from it). From each frozen protocol copy
(``Audit.protocol_copies``, defaults applied here by the audit's own table) it expands:

- the cases of the source, with the meta fields that follow from the protocol (seed, length,
  distribution, layout, chunk, prompt, layer, ...) and, for synthetic sources, the array shapes;
- per case and analysis, the rows and their identity (``IDENTITY``), and every parameter a row
  carries (group sizes, bits, windows, block sizes, seeds, control seeds, quantizer configs);

and FAILs, one line each, on a missing, extra or duplicated case or row, on a row parameter that
is not the protocol's (even when the row's numbers were re-derived consistently from it), and on
an exclusion in the manifest that the protocol does not allow. Capture prompts shorter than the
protocol's ``tokens`` are excluded by the run; the audit accepts exactly those exclusions whose
recorded reason says so (it has no tokenizer to count the tokens itself). Trace studies are
expanded from the run's ``STUDY/trace_manifest.json`` listing of each file's records: that part is
only as good as that listing (the audit cannot open the trace files, which are outside the run).
The live study's (segment, arm) grid is the live check's own study-level check, run here too
so that a study with every row deleted is still checked.
"""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath, PureWindowsPath

from . import ablation_audit as ablation_check
from . import live_quality
from . import residual_window as residual_window_check
from . import retrieval as retrieval_check
from .common import strict_json

__all__ = ["check_run", "IDENTITY", "DESCRIPTIVE_FIELDS", "expected_cases", "expected_rows"]

# The fields that tell apart the rows of one analysis of one case.
IDENTITY = {
    "residual_window": ("arm",),
    "ablation": ("arm", "ablation"),
    "mx_paths": ("path", "rotation", "scale_rule"),
    "observation": ("scope", "head"),
    "live_quality": ("arm",),
    "retrieval": ("arm", "question"),
    "selective": ("arm", "draw"),
}

# The row fields no check re-derives, by analysis, each with the reason: descriptive text that
# reaches no report.md table and no report.html figure. Every other field of every kind of row is
# re-derived or pinned to the protocol (tests/test_audit_fields.py changes each field of a row of
# every kind in an archived run and requires a FAIL, and shows these reach neither report).
DESCRIPTIVE_FIELDS = {
    "live_quality": {"policy.description": "the preset's prose summary for a reader of results.json; the parameters "
                                           "it summarizes (policy.middle, sink, window, group, ...) are checked"},
    "retrieval": {"policy.description": "the preset's prose summary for a reader of results.json; the parameters "
                                        "it summarizes (policy.middle, sink, window, group, ...) are checked"},
}

ABSENT = object()  # a field the row must not have
PRESENT = object()  # a field the row must have (any value)

# The audit's own statement of the protocol defaults (the run side's schemas; a protocol copy is
# frozen as written, without them).
SOURCE_DEFAULTS = {
    "synthetic": {"head_dim": 32, "queries": 8, "heads": 1, "kv_heads": 1, "focus_tokens": 16, "focus_logit": 4.0},
    "synthetic_video": {"chunks": [3], "tokens_per_frame": 4, "sink_frames": 4, "recent_frames": 6,
                        "current_frames": 6, "llm_sink": 4, "llm_middle": 28, "llm_recent": 16, "llm_current": 32,
                        "heads": 4, "kv_heads": 4, "llm_kv_heads": 2, "head_dim": 32},
    "capture": {"kv_heads": None, "queries": None, "record_chunks": [-1]},
    "trace": {"records": None},
}
ANALYSIS_DEFAULTS = {
    "residual_window": {"early_window": 16, "float32_arm": True, "recent_mass_window": 16},
    "ablation": {"ablations": ["none", "drop_sink", "control_sink", "mass_control_sink", "drop_recent", "control_recent",
                               "mass_control_recent", "drop_middle", "drop_history", "keep_current_only"],
                 "control_seed": 0,
                 "kv_arms": [{"name": "float32"},
                             {"name": "int4", "key": {"kind": "int_grouped", "bits": 4, "group_size": 32, "axis": "channel"},
                              "value": {"kind": "int_grouped", "bits": 4, "group_size": 32, "axis": "token"}, "window": 0}]},
    "mx_paths": {"element": "e4m3", "block_size": 32, "rotations": ["none", "signed_hadamard"], "rotation_seed": 0,
                 "p_path": True, "scale_rules": ["floor"], "store_p": True},
    "observation": {"block_tokens": 16, "coverage": 0.9, "store_rows_max": 65536, "spatial_tiles": 1},
    "selective": {"unit": "kv_head", "threshold": 0.1, "keep_percent": 10, "budget": 0.7, "random_draws": 4, "seed": 0},
}
TOKENIZE_REASON = re.compile(r"^prompt has (\d+) tokens, the protocol needs (\d+)$")


def _with_defaults(params: dict, defaults: dict) -> dict:
    return {**defaults, **params}


# -- cases ------------------------------------------------------------------------------------

def expected_cases(ctx, study: str, proto: dict, accepted: set) -> dict:
    """case id -> {"meta": {field: value}, "shapes": {array: shape}} the protocol's source makes;
    adds the exclusion ids it allows to ``accepted``."""
    src = proto["source"]
    kind = src["kind"]
    p = _with_defaults(src, SOURCE_DEFAULTS.get(kind, {}))
    out = {}
    if kind == "synthetic":
        for seed in p["seeds"]:
            for n in p["lengths"]:
                for dist in p["distributions"]:
                    ft = p["focus_tokens"]
                    focus = [0, ft] if dist == "early_focus" else [n - ft, n] if dist == "recent_focus" else None
                    q = [p["heads"], p["queries"], p["head_dim"]]
                    kv = [p["kv_heads"], n, p["head_dim"]]
                    out[f"{dist}-s{seed}-n{n}"] = {
                        "meta": {"source": "synthetic", "distribution": dist, "seed": seed, "n": n,
                                 "head_dim": p["head_dim"], "focus_tokens": ft, "focus_logit": p["focus_logit"],
                                 "focus_span": focus},
                        "shapes": {"q": q, "k": kv, "v": kv, "query_positions": [p["queries"]]}}
    elif kind == "synthetic_video":
        for seed in p["seeds"]:
            for layout in p["layouts"]:
                if layout == "video":
                    tpf = p["tokens_per_frame"]
                    keys = (p["sink_frames"] + p["recent_frames"] + p["current_frames"]) * tpf
                    tq = p["current_frames"] * tpf
                    for chunk in p["chunks"]:
                        out[f"video-s{seed}-c{chunk}"] = {
                            "meta": {"source": "synthetic_video", "distribution": "video", "layout_kind": "video",
                                     "seed": seed, "chunk": chunk},
                            "shapes": _attention_shapes(p["heads"], p["kv_heads"], tq, keys, p["head_dim"])}
                else:
                    keys = p["llm_sink"] + p["llm_middle"] + p["llm_recent"] + p["llm_current"]
                    out[f"llm-s{seed}"] = {
                        "meta": {"source": "synthetic_video", "distribution": "llm_causal", "layout_kind": "llm",
                                 "seed": seed},
                        "shapes": _attention_shapes(p["heads"], p["llm_kv_heads"], p["llm_current"], keys, p["head_dim"])}
    elif kind == "capture":
        out = _capture_cases(ctx, study, p, accepted)
    elif kind == "trace":
        out = _trace_cases(ctx, study, p)
    else:
        raise ValueError(f"source kind {kind!r} is not one the audit can expand")
    return out


def _attention_shapes(heads, kv_heads, tq, keys, d) -> dict:
    return {"q": [heads, tq, d], "k": [kv_heads, keys, d], "v": [kv_heads, keys, d], "query_positions": [tq]}


def _exclusions(ctx) -> dict:
    """id -> exclusion entry of the manifest (a malformed list is reported once, by check_run)."""
    ex = ctx.manifest.get("excluded", [])
    return {e["id"]: e for e in ex if isinstance(e, dict) and isinstance(e.get("id"), str)} if isinstance(ex, list) else {}


def _capture_cases(ctx, study: str, p: dict, accepted: set) -> dict:
    excluded = _exclusions(ctx)
    whole = f"{study}/{p['model']}"
    if whole in excluded:
        # The model could not load: the whole capture is skipped. The audit cannot tell whether
        # the model really was missing on the machine that ran it (see docs/audit.md).
        accepted.add(whole)
        return {}
    n_chunks = p["tokens"] // p["chunk"]
    chunks = sorted({c % n_chunks for c in p["record_chunks"]})
    out = {}
    for prompt in p["prompts"]:
        pid = prompt["id"]
        entry = excluded.get(f"{study}/{pid}")
        if entry is not None:
            m = TOKENIZE_REASON.match(str(entry.get("error", "")))
            if entry.get("stage") == "tokenize" and m and int(m.group(2)) == p["tokens"] and int(m.group(1)) < p["tokens"]:
                accepted.add(f"{study}/{pid}")
                continue
            # not accepted: check_run reports the entry, and the prompt's cases are still expected
        for chunk in chunks:
            for layer in sorted(p["layers"]):
                out[f"{pid}-L{layer:02d}-c{chunk:02d}"] = {
                    "meta": {"source": "capture", "model": p["model"], "prompt": pid, "layer": layer, "chunk": chunk,
                             "step": 0, "layout_kind": "llm_stream",
                             "distribution": f"L{layer:02d}" + (f"-c{chunk:02d}" if len(chunks) > 1 else "")},
                    "shapes": {}}
    return out


def _trace_cases(ctx, study: str, p: dict) -> dict:
    # Only as good as the run's listing: the trace files are outside the run, so which records a
    # file holds is what STUDY/trace_manifest.json (hashed in the manifest) says it holds.
    rel = f"{study}/trace_manifest.json"
    if rel not in ctx.manifest.get("files", {}):
        raise ValueError(f"{rel} is not among the run's files (the listing of the trace records)")
    listing = strict_json(ctx.read_bytes(rel).decode("utf-8"))
    files = listing.get("files") if isinstance(listing, dict) else None
    if not isinstance(files, list) or [f.get("file") if isinstance(f, dict) else None for f in files] != list(p["files"]):
        raise ValueError(f"{rel} does not list the protocol's trace files {p['files']} in order")
    wanted = None if p["records"] is None else set(p["records"])
    out, seen = {}, set()
    for entry in files:
        name = PureWindowsPath(entry["file"]).name if "\\" in entry["file"] else PurePosixPath(entry["file"]).name
        for rid in entry.get("records", []):
            if wanted is not None and rid not in wanted:
                continue
            seen.add(rid)
            out[rid] = {"meta": {"trace_file": name, "trace_sha256": entry.get("sha256")}, "shapes": {}}
    if wanted is not None and wanted - seen:
        raise ValueError(f"the protocol's trace records {sorted(wanted - seen)} are not in the listing {rel}")
    return out


# -- rows -------------------------------------------------------------------------------------

def expected_rows(ctx, study: str, analysis: str, params: dict, case_id: str, rec: dict) -> dict:
    """identity tuple -> {field: expected value (or ABSENT / PRESENT)} for one case and analysis."""
    p = _with_defaults(params, ANALYSIS_DEFAULTS.get(analysis, {}))
    shapes = _shapes(ctx, rec)
    if analysis == "residual_window":
        return _residual_window_rows(p, shapes["k"][1])
    if analysis == "mx_paths":
        return _mx_rows(p)
    if analysis == "observation":
        h, tq = shapes["q"][0], shapes["q"][1]
        common = {"block_tokens": p["block_tokens"], "coverage": p["coverage"], "spatial_tiles": p["spatial_tiles"]}
        out = {("case", None): {**common, "arrays.rows": PRESENT if h * tq <= p["store_rows_max"] else ABSENT}}
        out.update({("head", hh): dict(common) for hh in range(h)})
        return out
    if analysis == "ablation":
        return _ablation_rows(ctx, study, case_id, p)
    if analysis == "selective":
        common = {"unit": p["unit"], "threshold": p["threshold"], "keep_percent": p["keep_percent"],
                  "budget": p["budget"], "control_seed": p["seed"]}
        out = {(arm, None): dict(common) for arm in ("rule", "reversed")}
        out.update({("random", d): dict(common) for d in range(p["random_draws"])})
        return out
    raise ValueError(f"analysis {analysis!r} is not one the audit can expand")


def _shapes(ctx, rec: dict) -> dict:
    arrays = rec.get("arrays") if isinstance(rec, dict) else None
    if not isinstance(arrays, dict):
        raise ValueError("the case has no arrays object")
    if "archive" in rec:  # a case that keeps part of its Q/K/V: its full shapes (checked by the audit's case reader)
        shapes = rec["archive"].get("shapes") if isinstance(rec["archive"], dict) else None
        if not isinstance(shapes, dict) or not all(isinstance(shapes.get(n), list) and len(shapes[n]) == 3 for n in ("q", "k")):
            raise ValueError("the case's archive has no rank-3 shapes of q and k")
        return {n: shapes[n] for n in ("q", "k")}
    out = {}
    for name in ("q", "k"):
        entry = ctx.manifest.get("arrays", {}).get(arrays.get(name))
        if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list) or len(entry["shape"]) != 3:
            raise ValueError(f"the case's {name} array is not a rank-3 array of the manifest")
        out[name] = entry["shape"]
    return out


def _int_config(bits, group, axis) -> dict:
    return {"kind": "int_grouped", "bits": bits, "group_size": group, "axis": axis}


def _residual_window_rows(p: dict, n: int) -> dict:
    if p.get("key") is not None:
        kc, vc = p["key"], p["value"]
    else:
        kc, vc = _int_config(p["bits"], p["group_size"], "channel"), _int_config(p["bits"], p["group_size"], "token")

    def quant(recent, sink):
        return {"kind": "residual_window", "key": kc, "value": vc, "recent": recent, "sink": sink}

    scheme = residual_window_check.scheme_label(kc, vc)
    out = {}
    if p["float32_arm"]:
        out[("float32",)] = {"scheme": "float32", "residual": None, "sink_window": None, "recent_mass_window": n,
                             "quant": None}
    for r in p["residuals"]:
        out[(f"R={r}",)] = {"scheme": scheme, "residual": r, "sink_window": 0,
                            "recent_mass_window": r if r > 0 else p["recent_mass_window"], "quant": quant(r, 0)}
    e = p["early_window"]
    if e:
        out[(f"first{e}",)] = {"scheme": scheme, "residual": 0, "sink_window": e,
                               "recent_mass_window": p["recent_mass_window"], "quant": quant(0, e)}
    return out


def _mx_rows(p: dict) -> dict:
    e, b = p["element"], p["block_size"]
    out = {}
    for rule in p["scale_rules"]:
        for rot in p["rotations"]:
            out[("qk", rot, rule)] = {"element": e, "block_size": b, "scale_rule": rule, "quant": {
                "kind": "mx", "element": e, "block_size": b, "rotation": None if rot == "none" else rot,
                "seed": p["rotation_seed"], "scale_rule": rule}}
        if p["p_path"]:
            out[("p", "none", rule)] = {"element": e, "block_size": b, "scale_rule": rule,
                                        "quant": {"kind": "mx", "element": e, "block_size": b, "rotation": None,
                                                  "seed": 0, "scale_rule": rule},
                                        "arrays.p": PRESENT if p["store_p"] else ABSENT}
    return out


def _ablation_rows(ctx, study: str, case_id: str, p: dict) -> dict:
    case = ctx.case({"study": study, "case": case_id})
    regions = {r["name"]: (int(r["start"]), int(r["stop"])) for r in case["layout"]}
    stop = regions["current"][0] if "current" in regions else ablation_check.case_keys(case)
    seed = p["control_seed"]
    out = {}
    for arm in sorted(p["kv_arms"], key=lambda a: a["name"] != "float32"):
        name = arm["name"]
        quant = None
        if name != "float32":
            w = arm.get("window", 0)
            if w == "recent":
                if "recent" not in regions:
                    continue  # the run skips an arm whose residual window is a region the case lacks
                w = regions["recent"][1] - regions["recent"][0]
            if stop == 0:
                continue  # no cached history to quantize
            quant = {"kind": "residual_window", "key": arm["key"], "value": arm["value"], "recent": w, "sink": 0}
        for abl in p["ablations"]:
            if abl.startswith(ablation_check.MASS_PREFIX):
                target = abl[len(ablation_check.MASS_PREFIX):]
                ok = ablation_check.mass_orders(case, case_id, target, seed) is not None
                want = {"applicable": ok, "quant": ABSENT}
                if ok:
                    want.update(control_seed=seed, control_of=target, control_kind="mass_matched",
                                mass_tolerance=ablation_check.MASS_TOLERANCE, mass_attempts=ablation_check.MASS_ATTEMPTS)
                else:
                    want.update(control_seed=ABSENT, control_of=ABSENT, control_kind=ABSENT)
                out[(name, abl)] = want
                continue
            spans = ablation_check.expected_spans(case, case_id, abl, seed)
            want = {"applicable": spans is not None, "quant": quant if abl == "none" else ABSENT}
            if abl.startswith("control_") and spans is not None:
                want.update(control_seed=seed, control_of=abl[len("control_"):])
            else:
                want.update(control_seed=ABSENT, control_of=ABSENT)
            out[(name, abl)] = want
    return out


def _get(row: dict, field: str):
    x = row
    for part in field.split("."):
        if not isinstance(x, dict) or part not in x:
            return ABSENT
        x = x[part]
    return x


def _matches(got, want) -> bool:
    """``want`` a value, ABSENT or PRESENT; a quantizer config matches when every key the protocol
    names has the protocol's value (the run may add its quantizer's defaults)."""
    if want is PRESENT:
        return got is not ABSENT
    if want is ABSENT or got is ABSENT:
        return got is want
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and _matches(got[k], v) for k, v in want.items())
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    return got == want


def _show(x) -> str:
    return "absent" if x is ABSENT else "present" if x is PRESENT else repr(x)


def _ident_label(analysis: str, ident: tuple) -> str:
    return " ".join(f"{k}={v}" for k, v in zip(IDENTITY[analysis], ident) if v is not None)


# -- the run check ----------------------------------------------------------------------------

def check_run(ctx) -> None:
    results = ctx.results
    if not isinstance(results, dict) or not isinstance(results.get("cases"), dict) or not isinstance(results.get("rows"), list):
        return  # results.json itself already failed
    excluded = ctx.manifest.get("excluded", [])
    if not isinstance(excluded, list) or not all(isinstance(e, dict) for e in excluded):
        ctx.fail("manifest.json excluded", "must be a list of objects")
        excluded = []
    accepted: set = set()
    rows_by_study: dict = {}
    for i, row in enumerate(results["rows"]):
        if isinstance(row, dict) and isinstance(row.get("study"), str):
            rows_by_study.setdefault(row["study"], []).append(dict(row, _index=i))
    for study, proto in sorted(ctx.protocol_copies.items()):
        try:
            if proto.get("kind") == "live":
                _check_live(ctx, study, proto, rows_by_study.get(study, []), accepted)
            elif proto.get("kind") == "retrieval":
                _check_retrieval(ctx, study, proto, rows_by_study.get(study, []), accepted)
            else:
                _check_study(ctx, study, proto, rows_by_study.get(study, []), accepted)
        except Exception as e:  # noqa: BLE001 - a forged protocol or record must give a FAIL line
            ctx.fail(f"results.json {study}", f"cannot expand the protocol's cases and rows "
                                              f"({type(e).__name__}: {str(e)[:200]})")
    for i, e in enumerate(excluded):
        if not isinstance(e.get("id"), str) or e["id"] not in accepted:
            ctx.fail(f"manifest.json excluded[{i}]", f"{e.get('id')!r} (stage {e.get('stage')!r}: {e.get('error')!r}) "
                                                     "is not an exclusion the protocols allow")


def _check_study(ctx, study: str, proto: dict, rows: list, accepted: set) -> None:
    want_cases = expected_cases(ctx, study, proto, accepted)
    got_cases = ctx.results["cases"].get(study, {})
    if not isinstance(got_cases, dict):
        ctx.fail(f"results.json cases.{study}", "must be an object")
        return
    for cid in sorted(set(want_cases) - set(got_cases)):
        ctx.fail(f"results.json cases.{study}.{cid}", "missing: the protocol produces this case (and it is not excluded)")
    for cid in sorted(set(got_cases) - set(want_cases)):
        ctx.fail(f"results.json cases.{study}.{cid}", "not a case the protocol produces")
    analyses = proto["analyses"]
    want_rows: dict = {}
    for cid in sorted(set(want_cases) & set(got_cases)):
        rec = got_cases[cid]
        meta = rec.get("meta") if isinstance(rec, dict) else None
        if not isinstance(meta, dict):
            ctx.fail(f"results.json cases.{study}.{cid}", "has no meta object")
            continue
        for key, val in want_cases[cid]["meta"].items():
            if not _matches(meta.get(key, ABSENT), val):
                ctx.fail(f"results.json cases.{study}.{cid}", f"meta.{key}: case says {_show(meta.get(key, ABSENT))}, "
                                                              f"the protocol gives {val!r}")
        for name, shape in want_cases[cid]["shapes"].items():
            entry = ctx.manifest.get("arrays", {}).get(rec.get("arrays", {}).get(name))
            got = entry.get("shape") if isinstance(entry, dict) else None
            if got != shape:
                ctx.fail(f"results.json cases.{study}.{cid}", f"{name} has shape {got}, the protocol gives {shape}")
        for analysis, params in analyses.items():
            try:
                for ident, fields in expected_rows(ctx, study, analysis, params, cid, rec).items():
                    want_rows[(cid, analysis, ident)] = fields
            except Exception as e:  # noqa: BLE001 - a case that cannot be read already failed its own check
                ctx.fail(f"results.json {study}/{cid} {analysis}", f"cannot expand the rows ({type(e).__name__}: {str(e)[:200]})")
    seen: dict = {}
    for row in rows:
        analysis = row.get("analysis")
        if not isinstance(analysis, str) or analysis not in analyses:
            ctx.fail(row, f"analysis {analysis!r} is not one of the protocol's {sorted(analyses)}")
            continue
        key = (_hashable(row.get("case")), analysis, tuple(_hashable(row.get(f)) for f in IDENTITY.get(analysis, ())))
        seen.setdefault(key, []).append(row)
    for key in sorted(set(want_rows) - set(seen), key=repr):
        cid, analysis, ident = key
        ctx.fail(f"results.json {study}/{cid} {analysis} {_ident_label(analysis, ident)}",
                 "missing: the protocol produces this row")
    for key, found in sorted(seen.items(), key=lambda kv: repr(kv[0])):
        cid, analysis, ident = key
        if key not in want_rows:
            for row in found:
                if cid in want_cases and cid in got_cases:
                    ctx.fail(row, f"not a row the protocol produces for this case "
                                  f"({_ident_label(analysis, ident) or 'no identity'} is not one of its rows)")
                # a row of a case the protocol does not make fails with its case
            continue
        if len(found) > 1:
            ctx.fail(found[1], f"duplicate: rows {[r['_index'] for r in found]} are the one row "
                               f"{study}/{cid} {analysis} {_ident_label(analysis, ident)}")
        for row in found:
            _check_fields(ctx, row, want_rows[key])


def _hashable(x):
    return json.dumps(x, sort_keys=True) if isinstance(x, (dict, list)) else x


def _check_fields(ctx, row: dict, want: dict) -> None:
    for field, val in want.items():
        got = _get(row, field)
        ctx.numbers += 1
        if not _matches(got, val):
            ctx.fail(row, f"{field}: row says {_show(got)}, the protocol gives {_show(val)}")


def _excluded_model(ctx, study: str, whole: str, rows: list, accepted: set) -> bool:
    """Whether the study's model could not load (an ``excluded`` entry ``whole``): then the study has
    no cases and no rows (the audit cannot tell whether it really was missing where the run ran)."""
    if whole not in _exclusions(ctx):
        return False
    accepted.add(whole)
    for cid in sorted(ctx.results["cases"].get(study, {}) or {}):
        ctx.fail(f"results.json cases.{study}.{cid}", "the study is excluded (its model did not load), yet has cases")
    for row in rows:
        ctx.fail(row, "the study is excluded (its model did not load), yet has rows")
    return True


def _check_live(ctx, study: str, proto: dict, rows: list, accepted: set) -> None:
    live = proto["live"]
    if _excluded_model(ctx, study, f"{study}/{live['model']}", rows, accepted):
        return
    # The (segment, arm) grid and the segments: the live check's own study-level check (cached, so
    # it runs once whether a row triggered it or not).
    ctx.cached(("live_study", study), lambda: live_quality.check_study(ctx, study, live))
    peers = {f"quanto_int{p['bits']}": p for p in live.get("peers", [])}
    for row in rows:
        peer = peers.get(row.get("arm"))
        if peer is not None:
            _check_fields(ctx, row, {"peer.backend": "quanto", "peer.bits": peer["bits"],
                                     "peer.q_group_size": live.get("peer_group", 64),
                                     "peer.residual_length": live.get("window", 128),
                                     "peer.axis_key": 0, "peer.axis_value": 0})  # quanto's axes, as the run sets them


def _check_retrieval(ctx, study: str, proto: dict, rows: list, accepted: set) -> None:
    """The retrieval study's grid of trials and (trial, arm) rows: the retrieval check's own
    study-level check (cached: it runs once whether a row triggered it or not); an excluded model
    leaves no cases and no rows."""
    if _excluded_model(ctx, study, f"{study}/SmolLM2-135M-Instruct.Q4_1", rows, accepted):
        return
    p = retrieval_check.params_of(ctx, study)
    ctx.cached(("retrieval_study", study), lambda: retrieval_check.check_study(ctx, study, p))
