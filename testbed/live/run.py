"""The live study's driver: :func:`plan` (model, corpus, segments, the live manifest) into units
of (batch of segments, arm) (:func:`batch_units`), and :func:`run_unit`, one arm on one batch: its
rows and stored arrays, for the reference what the batch's other arms are compared with."""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..policies import Policy
from ..sources.models import (INSTALL_HINT, INSTALL_HINTS, MODELS, CaptureUnavailable, forward_kwargs, hardware_info,
                              load_checked, load_model, software_info)
from .corpus import corpus_text, segment_starts
from .decode import chunk_schedule, run_arm
from .peers import dynamic_bytes, quanto_bytes, warm_quanto
from .prefill import mass_candidates, measures_concentration, oracle_passes, scored_needs, shared_prefill
from .spec import REFERENCE, arms_of, case_id, check_model, context_views, policies_of, segment_indices


def _summary(lp: np.ndarray, kl: np.ndarray, agree: np.ndarray) -> dict:
    nll = -float(np.mean(lp.astype(np.float64)))
    return {"nll": nll, "perplexity": math.exp(nll), "mean_kl": float(np.mean(kl.astype(np.float64))),
            "top1_agreement": float(np.mean(agree.astype(np.float64)))}


def _scorer_files(p: dict, base: Path | None) -> dict:
    """``{"file.py:Class": {"file": relative path, "sha256": of its bytes}}`` for the study's user scorers."""
    from ..policies import scorers

    out = {}
    for pol in policies_of(p):
        if pol.scored and scorers.is_user_scorer(pol.scorer):
            file = pol.scorer.split(":")[0]
            path = Path(file) if base is None else Path(base) / file
            out[pol.scorer] = {"file": file, "sha256": scorers.user_file_sha256(path)}
    return out


def plan(proto: dict, ctx, protocol_path: Path | None = None) -> tuple[dict, list[dict]]:
    """The study's shared part, done once into ``ctx`` (model, corpus, segments and their stored
    token ids, the live manifest): returns the segments as case records and the units, one per
    (batch of segments, arm), the reference of each batch first, every other arm of the batch
    needing it. No units when the model is missing (recorded as an exclusion, as a capture does)."""
    p = proto["live"]
    study = ctx.study
    progress = ctx.progress
    store = ctx.store
    base = Path(protocol_path).resolve().parent if protocol_path is not None else None
    hint = INSTALL_HINTS.get(p["model"], INSTALL_HINT)
    try:
        model, tokenizer, info, dims = load_checked(p["model"], base, progress, f"{study}: live.model")
    except CaptureUnavailable as e:
        entry = {"id": f"{study}/{p['model']}", "stage": e.stage, "error": f"{e}; install with: {hint}"}
        ctx.excluded.append(entry)
        print(f"[{study}] live study skipped: {e}; install with: {hint}", file=sys.stderr, flush=True)
        return {}, []
    check_model(p, dims, f"{study}: live")
    text, corpus_info = corpus_text(p["corpus"], base)
    t0 = time.perf_counter()
    stream = tokenizer(text, return_tensors="pt").input_ids[0]
    arms = arms_of(p)
    seg_tokens, cases, seg_starts, views = {}, {}, {}, []
    for prefix, prefill in context_views(p):
        length = prefill + p["steps"] + 1
        starts = segment_starts(int(stream.numel()), p["segments"], length)
        progress(f"[{study}] corpus: {corpus_info['characters']:,} characters, {stream.numel():,} tokens "
                 f"({time.perf_counter() - t0:.1f} s); {len(starts)} segments of {length} tokens"
                 + ("" if p["segment_range"] is None else f", this run segments {p['segment_range'][0]}.."
                                                          f"{p['segment_range'][1] - 1}"))
        picked = segment_indices(p)
        seg_ids = [case_id(prefix, i) for i in picked]
        views.append((prefill, seg_ids))
        for sid, s in zip(seg_ids, [starts[i] for i in picked]):
            tok = stream[s:s + length].to(torch.int64)
            seg_tokens[sid] = tok.tolist()
            seg_starts[sid] = int(s)
            arr = store.save(f"{study}/{sid}/token_ids", tok.to(torch.int32))
            cases[sid] = {
                "id": sid, "causal": True, "layout": [], "tokens_per_frame": None, "head_map": None,
                "meta": {"source": "corpus", "model": p["model"], "start_token": int(s), "tokens": length,
                         "token_ids_sha256": hashlib.sha256(tok.to(torch.int32).numpy().tobytes()).hexdigest()},
                "arrays": {"token_ids": arr}}
    calibration = None  # the calibrated codebooks of the study's codec middles, and where they are stored
    if p.get("calibration"):
        calibration, record = _calibration(p, model, stream, store, study, views[0][1][0], progress)
    ctx.extra_files[f"{study}/live_manifest.json"] = (json.dumps({
        "schema_version": 1,
        "experiment": f"{study}: cache policies inside {p['model']} (float32), teacher-forced decoding",
        "model": {k: v for k, v in info.items() if k not in ("load_seconds", "loaded_from")},
        "model_dims": dims,
        "corpus": corpus_info, "corpus_tokens": int(stream.numel()),
        "segments": seg_starts,
        "arms": [a for a, _ in arms],
        "scorer_files": _scorer_files(p, base),  # a user's scorer code, by the SHA-256 of its file
        **({} if calibration is None else {"calibration": record}),  # the windows the codebooks come from
        "software": software_info(), "hardware": hardware_info(),
    }, indent=1) + "\n").encode("utf-8")
    return cases, batch_units(p, views, seg_tokens, base, dims, calibration)


def _calibration(p: dict, model, stream: torch.Tensor, store, study: str, first: str, progress) -> tuple[dict, dict]:
    """The calibration windows' tables for every calibrated policy (:mod:`testbed.live.calibration`):
    ``{arm: {"tables": .., "arrays": {name: stored path}}}`` and the live manifest's record of the windows.
    Its arrays go into the first segment's container (the evidence layer's calibration input, the tables)."""
    from .calibration import calibrate_tables, tables_arrays, window_record, windows

    prefill = p["calibration"].get("tokens") or p["prefill"]  # the window's length
    starts = windows(int(stream.numel()), p["segments"], p["prefill"] + p["steps"] + 1, prefill,
                     p["calibration"]["windows"])
    ids = torch.stack([stream[s:s + prefill] for s in starts]).to(torch.int64)
    t0 = time.perf_counter()
    tables, samples = calibrate_tables(model, forward_kwargs(model), ids, policies_of(p), p["evidence_layer"], progress)
    token_ids = store.save(f"{study}/{first}/calibration/token_ids", ids.to(torch.int32))
    out = {}
    for arm, tab in tables.items():
        arrays = {name: store.save(f"{study}/{first}/calibration/{arm}/{name}", a)
                  for name, a in tables_arrays(tab).items()}
        arrays["calibration.token_ids"] = token_ids
        for part, x in samples.get(arm, {}).items():
            arrays[f"calibration.{part}"] = store.save(f"{study}/{first}/calibration/{arm}/input.{part}", x)
        out[arm] = {"tables": tab, "arrays": arrays}
    progress(f"[{study}] calibration: {len(starts)} windows of {prefill} tokens, {len(out)} calibrated arms "
             f"({time.perf_counter() - t0:.1f} s)")
    record = {**window_record(starts, prefill, ids), "windows": len(starts), "token_ids": token_ids}
    return out, record


def batch_units(p: dict, views: list[tuple[int, list[str]]], seg_tokens: dict[str, list[int]], base: Path | None,
                dims: dict, calibration: dict | None = None) -> list[dict]:
    """The units of a live study, one per (batch of segments, arm), the reference of each batch
    first: ``views`` is (prefill, segment ids) per context, ``seg_tokens`` each segment's token ids
    (:func:`plan`; :mod:`testbed.replay` rebuilds the same units from a finished run's arrays)."""
    batches = [(prefill, vi, seg_ids[i:i + p["batch"]]) for prefill, seg_ids in views
               for vi, i in enumerate(range(0, len(seg_ids), p["batch"]))]
    units = []
    for bi, (prefill, vi, batch) in enumerate(batches):
        ref = len(units)
        arms = arms_of({**p, "prefill": prefill})  # a budget's kept count is the context's
        for j, (arm, what) in enumerate(arms):
            # forward calls of the arm: what a scheduler starts first (quanto's one token per forward)
            forwards = 1 + (p["steps"] if what is not None and not isinstance(what, Policy) else
                            len(chunk_schedule(what, prefill, p["steps"], "chunked" if what is None else p["mode"],
                                               p["reference_chunk"])))
            units.append({"label": f"batch {bi + 1}/{len(batches)} {arm}", "batch": bi, "batches": len(batches),
                          "cost": cost_kind(what), "segments": batch,
                          "tokens": [seg_tokens[sid] for sid in batch], "arm": j, "needs": None if j == 0 else ref,
                          "forwards": forwards, "prefill": prefill, "first_of_context": vi == 0,
                          "model_base": None if base is None else str(base), "model_dims": dims,
                          **({"calibration": calibration[arm]} if calibration and arm in calibration else {})})
    return units


def run_unit(proto: dict, unit: dict, ctx, ref=None) -> tuple[list, tuple | None, str]:
    """One arm on one batch of segments: its rows (arrays into ``ctx.store``), for the reference
    ``(log-probabilities, argmax, shared prefill, oracle passes)`` that the batch's other arms are
    compared with and start from, and a note for the progress line."""
    p = dict(proto["live"])
    p["prefill"] = unit.get("prefill", p["prefill"])  # the view of this unit's context
    study = ctx.study
    store = ctx.store
    model, _, _ = load_model(model=p["model"], base=None if unit.get("model_base") is None else Path(unit["model_base"]))
    kw = forward_kwargs(model)
    cfg = model.config
    arm, what = arms_of(p)[unit["arm"]]
    if isinstance(what, Policy) and what.calibrated:  # its codebooks, calibrated by the plan
        if "calibration" not in unit:
            raise RuntimeError(f"arm {arm}: calibrated codebooks, and the plan handed on no calibration")
        what = what.with_(tables=unit["calibration"]["tables"])
    bi, batch = unit["batch"], unit["segments"]
    ids = torch.tensor(unit["tokens"], dtype=torch.int64)
    ref_logp, ref_argmax, shared, oracles = (None, None, None, None) if ref is None else ref
    if what is not None and not isinstance(what, Policy):
        ctx.one_off += warm_quanto(model, kw, cfg, ctx.progress)  # before the arm's clock starts
    evidence_layer = p["evidence_layer"] if unit.get("first_of_context", bi == 0) else None  # None: none stored
    if arm == REFERENCE and p["shared_prefill"]:
        # the one prefill of the batch: every arm starts from its K/V (the reference continues its cache)
        tail, received = scored_needs(p)  # what the scored selections read of the prefill
        shared, cache = shared_prefill(model, kw, ids[:, :p["prefill"]], mass_candidates(p), evidence_layer,
                                       measures_concentration(p), any(pol.heavy for pol in policies_of(p))
                                       or received, tail, any(pol.key_rope == "pre" for pol in policies_of(p)))
        ctx.timings.append({"study": study, "case": f"batch{bi}", "arm": None, "op": "prefill", "repeat": 0,
                            "seconds": shared.seconds, "segments": len(batch), "tokens": len(batch) * p["prefill"],
                            "forwards": 1, "context": p["prefill"] + p["steps"]})
    if arm == REFERENCE:
        # the batch's oracle passes, once for all its oracle arms (before the reference's decode grows its cache)
        oracles = oracle_passes(model, kw, ids, p, evidence_layer)
        for sched, e in ({} if oracles is None else oracles.passes).items():
            ctx.timings.append({"study": study, "case": f"batch{bi}", "arm": None, "op": "oracle", "repeat": 0,
                                "seconds": e["seconds"], "segments": len(batch), "forwards": len(sched),
                                "arms": e["arms"]})
    t_arm = time.perf_counter()
    oracle = None  # what an oracle arm reads of its batch's oracle pass (oracle_passes)
    own = not p["shared_prefill"]
    if arm == REFERENCE:
        from transformers import DynamicCache

        if own:
            cache = DynamicCache(config=cfg)
        schedule = chunk_schedule(None, p["prefill"], p["steps"], "chunked", p["reference_chunk"])
        res = run_arm(model, kw, ids, p, cache, schedule, None, keep_logp=True, bytes_of=lambda c: dynamic_bytes(c),
                       prefill=None if own else True)
        ref_logp = res.pop("logp")
        ref_argmax = res["argmax"]
        kind, mode = "reference", "chunked"
    elif isinstance(what, Policy):
        from ..policies.cache import PolicyCache
        from ..policies.hook import policy_attention

        scores = received = None
        schedule = chunk_schedule(what, p["prefill"], p["steps"], p["mode"], p["reference_chunk"])
        if what.oracle:  # float32 attention of the whole segment, in advance: the batch's pass (oracle_passes)
            if oracles is None:
                raise RuntimeError(f"oracle arm {arm}: the batch's reference handed on no oracle pass")
            oracle = oracles.of(what, p)
            if what.heavy_oracle:
                received = oracle["received"]
            else:
                scores = oracle["scores"]
        with policy_attention(model):
            cache = PolicyCache.for_model(what, cfg, record_layer=evidence_layer if what.middle != "float32" else None,
                                          scores=scores, received=received, scorer_base=unit.get("model_base"))
            res = run_arm(model, kw, ids, p, cache, schedule, ref_logp, bytes_of=lambda c: c.stored_bytes(),
                           prefill=None if own else shared)
        kind, mode = "policy", p["mode"]
    else:
        from transformers import QuantizedCache

        cache = QuantizedCache("quanto", cfg, nbits=what["bits"], q_group_size=p["peer_group"],
                               residual_length=p["window"])
        schedule = [1] * p["steps"]
        res = run_arm(model, kw, ids, p, cache, schedule, ref_logp, bytes_of=quanto_bytes,
                       prefill=None if own else shared)
        kind, mode = "peer", "step"
    seconds = time.perf_counter() - t_arm
    ctx.timings.append({"study": study, "case": f"batch{bi}", "arm": arm, "op": "decode", "repeat": 0,
                        "seconds": seconds, "segments": len(batch), "scored_tokens": len(batch) * p["steps"],
                        "forwards": len(schedule) + int(own), "context": p["prefill"] + p["steps"]})
    agree = (res["argmax"] == ref_argmax).numpy()
    rows = []
    for j, sid in enumerate(batch):
        prefix = f"{study}/{sid}/{arm}"
        lp = res["logprob"][j].numpy().astype(np.float32)
        kl = res["kl"][j].numpy().astype(np.float64)
        am = res["argmax"][j].numpy().astype(np.int32)
        arrays = {"logprob": store.save(f"{prefix}/logprob", lp), "argmax": store.save(f"{prefix}/argmax", am),
                  "bytes": store.save(f"{prefix}/bytes", res["bytes"]),
                  "context": store.save(f"{prefix}/context", res["context"])}
        if kind != "reference":
            arrays["kl"] = store.save(f"{prefix}/kl", kl)
        row = {"study": study, "analysis": "live_quality", "case": sid, "source": "corpus", "model": p["model"],
               "arm": arm, "kind": kind, "mode": mode, "forwards": len(schedule) + 1,
               **({} if p["model"] in MODELS else {"model_dims": unit["model_dims"]}),  # a model given by path
               "scored_tokens": p["steps"], "context_final": int(res["context"][-1]),
               "bytes_final": int(res["bytes"][-1]),
               "bytes_per_token": float(res["bytes"][-1]) / float(res["context"][-1]),
               **_summary(lp, kl, agree[j]),  # the reference: KL 0, agreement with itself 1
               "arrays": arrays}
        if isinstance(what, Policy):
            row["policy"] = what.config()
        if isinstance(what, Policy) and what.calibrated:  # its tables; on the evidence row, what they came from
            evidence_row = evidence_layer is not None and j == 0
            arrays.update({k: v for k, v in unit["calibration"]["arrays"].items()
                           if evidence_row or k not in ("calibration.k", "calibration.v")})
        if isinstance(what, Policy) and what.mixed:  # the allocation: each pair's bits, from which scores
            arrays["alloc_bits"] = store.save(f"{prefix}/alloc_bits", cache.alloc_bits()[j].numpy())
            arrays["alloc_score"] = store.save(f"{prefix}/alloc_score", cache.alloc_score[j].numpy().astype(np.float64))
        elif isinstance(what, Policy) and what.selective:  # each pair's class, what it was read from, what it holds
            arrays["select_sparse"] = store.save(f"{prefix}/select_sparse", cache.sel_sparse[j].numpy().astype(np.uint8))
            arrays["select_score"] = store.save(f"{prefix}/select_score", cache.sel_score[j].numpy().astype(np.float64))
            arrays["select_count"] = store.save(f"{prefix}/select_count", cache.held_counts()[j].numpy().astype(np.int32))
        elif isinstance(what, Policy) and what.heavy:  # the heavy hitters held at the end: [L, H, count] token indices
            held = [layer.hh_index[j] for layer in cache.layers if getattr(layer, "hh_index", None) is not None]
            arrays["hh_index"] = store.save(f"{prefix}/hh_index", torch.stack(held).numpy().astype(np.int32))
        elif kind == "peer":
            row["peer"] = {"backend": "quanto", "bits": what["bits"], "q_group_size": p["peer_group"],
                           "residual_length": p["window"], "axis_key": 0, "axis_value": 0}
        if isinstance(what, Policy) and what.middle != "float32" and evidence_layer is not None and j == 0:
            ev = cache.layers[evidence_layer].evidence()
            if oracle is not None:  # what the oracle's scores of this layer were computed from: the
                # prefill's queries (those of every prefill-rule arm), the later ones, every key
                ev["input.q"] = oracle["q"][0].contiguous()
                ev["oracle.q"] = torch.cat(oracle["q"][1:], dim=1).contiguous()
                ev["oracle.k"] = oracle["k"].contiguous()
            row["evidence"] = {"layer": evidence_layer,
                               "arrays": {k: store.save(f"{prefix}/L{evidence_layer:02d}.{k}", v) for k, v in ev.items()}}
        rows.append(row)
    note = (f"{arm}, {batch_note(unit, len(batch), 'segments')}: {len(schedule) + 1} forwards, {seconds:.1f} s, "
            f"{1000 * seconds / (len(batch) * p['steps']):.1f} ms per scored token")
    return rows, ((ref_logp, ref_argmax, shared, oracles) if arm == REFERENCE else None), note


def cost_kind(what) -> str:
    """The cost class of an arm for the progress estimate (testbed.units.COST_PRIOR): the reference
    (it holds the batch's prefill), a testbed policy, or a quanto peer (one token per forward)."""
    return "reference" if what is None else "testbed" if isinstance(what, Policy) else "quanto"


def batch_note(unit: dict, items: int, word: str) -> str:
    """Which batch of its study a unit decodes, for the progress line: ``batch 2/3 (4 segments)``
    (the batch's index among the study's batches and how many segments or trials it holds)."""
    total = unit.get("batches")
    return f"batch {unit['batch'] + 1}" + (f"/{total}" if total else "") + f" ({items} {word})"
