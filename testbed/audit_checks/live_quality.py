"""Audit of the live quality study's rows (numpy only; no model, no testbed.policies).

What it re-derives for every (segment, arm) row, from the stored arrays and the frozen protocol:

- the schedule: tokens per forward (``context``), from its own statement of each policy's
  flush points (chunked; an evicting policy's chunks are masked, so only the chunk cap applies) or
  one token per forward (step, peers), the reference's chunks;
- every ``bytes`` entry of a policy against its own closed form of the policy's byte accounting at
  that context (float32 sink and window, packed codes + float16 scale / zero or E8M0 scales, the
  16-byte header, per layer, for the model's known dimensions), of the reference (float32 K+V) and
  of quanto's ``QuantizedCache`` (its schedule: the prefill quantized whole, a float residual that
  re-quantizes everything when it reaches its length; 4/2-bit codes, float32 scale and shift per
  group);
- nll, perplexity, mean KL, top-1 agreement (against the reference row's argmax of the same
  segment), bytes per token, context, forwards, scored tokens;
- for the one evidence layer of the first segment: the packed middle re-encoded from the recorded
  float32 K/V with the audit's integer and MX encoders (``schemes.encode_tensor``), byte for byte,
  the float32 sink and window equal to the inputs, and no other stored array; for an evicting
  policy, that it kept exactly the first S and newest W; for a sink chosen from attention
  (``*_sinkmass*``), its scores recomputed in float64 from the recorded prefill queries and keys,
  the chosen tokens the top S of the stored scores (ties to the lower index) among the candidates,
  the sink those tokens' inputs and the middle and window the rest, per KV head;
- for a per-head precision policy (``mix*``), in every row: the stored bits of every (layer, KV
  head) pair are the two widths only, exactly the protocol's share of pairs at the low one, and
  the pairs the rule picks from the stored scores (the audit's own rule: concentration up or down,
  last layers first, or its own SHA-256 order); the bytes re-derived with those counts; for the
  evidence layer, its scores recomputed in float64 from the recorded queries and keys (the
  prefill's, or the oracle pass's over the whole segment: ``input.q`` then ``oracle.q``, with
  ``oracle.k``) and each head's packed middle
  re-encoded at its own stored bits; with a shared prefill, one prefill (``input.q``, the prefill
  part of ``input.k`` and ``oracle.k``) and one prefill-rule ``alloc_score`` across a segment's arms;
- for a scored selection with per-layer budgets (``layers: "pyramid"``, PyramidKV): the mean kept
  count from the budget and each layer's count, by the audit's own statement of kvpress's
  arithmetic (``pyramid``), the row's ``layer_keep`` against them, the bytes from the per-layer
  counts, and the evidence layer's kept set of that layer's own count;
- for a scored selection with per-head budgets (``heads: "adaptive"``, Ada-KV): at the evidence
  layer, the heads' counts (``kept.count``) summing to the layer's count, each at least the
  safeguard (``adaptive_safeguard``, kvpress's ``AdaKVPress`` rule) and holding every token after
  the prefill, the empty slots after each head's count empty, the bytes from the held tokens only,
  and for a scorer it re-derives at the prefill, the kept set: each head's own top safeguard, the
  rest the layer's top scores over every head (near ties within the float32 tolerances);
- for a scored selection whose kept set a storage stores (``store``, ``store_window``) or whose dropped
  prefill tokens a low-precision rest keeps (``rest``, MiKV): the kept count from the budget (``as``: a
  preset's bytes per token; every count tried, the bytes not being monotone in it), the bytes from the
  storage's own closed form, one token per forward, and at the evidence layer the kept set as above,
  then the inputs at ``kept.index`` (and the prefill's other tokens, in order) re-encoded as the
  storage (and the rest) stores a sequence of that length, byte for byte;
- once per study: exactly one row per (segment, arm) the protocol implies, the segments' token ids
  against their recorded hashes, disjoint evenly spaced segment starts.

What it cannot re-derive: the log-probabilities, KL and argmax themselves rest on model forward
passes. It checks their shape, finiteness and sign (KL ≥ 0 up to float rounding), and three bounds
that hold for any model, every scored token of every row (the reference's too), the target of
scored step i being token ``prefill + i + 1`` of the segment's stored ``token_ids``:

- the log ½ bound: a token other than the argmax has at most the argmax's probability, so where
  the stored argmax is not the target, log p(target) ≤ log ½ (equivalently, a log-prob above
  log ½ belongs to the argmax);
- the target-token KL bound: KL(ref ‖ arm) is at least the KL of the two distributions coarsened
  to {target, every other token} (data processing; the log-sum inequality), computed from the
  reference's and the arm's stored log-probs of the target;
- the float32 cache bound: a ``float32`` policy holds the reference's own K/V and runs its chunks,
  so its KL is zero up to float32 rounding at every token.

Outputs swapped whole between two quantized arms (log-probs, argmax, KL and summaries together)
satisfy every bound: each arm's outputs are a real arm's outputs against the same reference.

This module holds the row and study checks (``check``, ``check_study``, the segments and the
bounds); what they check against is stated beside it: the policies, their bytes and chunk schedule
in ``live_policies``, the evidence layer's re-encoding in ``live_evidence``, a scored selection's
kept set in ``live_scored``.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from .capture import read_json
from .common import TOLERANCES
from .calibration import calibrated_parts, check_tables, check_windows
from .live_evidence import check_evidence
from .live_policies import (HEADER, SCORED_EXTRA, dense_pair_bytes, full_layers, low_count, model_dims, policy_bytes,
                            policy_names, policy_of, quanto_bytes, reference_bytes, schedule, scored_held,
                            selective_sparse, spans)

__all__ = ["check", "check_study", "check_grid", "check_selective", "views", "view_of", "segment_ids"]

KL_FLOOR = -TOLERANCES["kl_floor"]["atol"]
LOG_HALF = math.log(0.5)


def allocation_keys(pol: dict, scores: np.ndarray) -> np.ndarray:
    """``[L, H]`` sort keys of the rule (smallest first get the low bits), the audit's own statement."""
    n_layers, h = scores.shape
    if pol["alloc"] == "concentrated":
        return scores.astype(np.float64)
    if pol["alloc"] == "diffuse":
        return -scores.astype(np.float64)
    if pol["alloc"] == "late":
        return -np.repeat(np.arange(n_layers, dtype=np.float64)[:, None], h, axis=1)
    return np.array([[int.from_bytes(hashlib.sha256(f"{i}:{j}".encode()).digest()[:8], "big") / 2.0 ** 64
                      for j in range(h)] for i in range(n_layers)])


def _check_allocation(row, ctx, pol: dict, dims: dict) -> np.ndarray:
    """A mixed row's stored bits ``[L, H]`` against its scores and the rule; returns the bits."""
    arrays = row.get("arrays", {})
    bits, score = ctx.load(arrays.get("alloc_bits")), ctx.load(arrays.get("alloc_score"))
    shape = (dims["layers"], dims["kv_heads"])
    if bits.shape != shape or score.shape != shape or bits.dtype != np.uint8 or score.dtype != np.float64:
        raise ValueError(f"alloc_bits / alloc_score must be uint8 / float64 {list(shape)}, got {bits.dtype} "
                         f"{list(bits.shape)} / {score.dtype} {list(score.shape)}")
    hi, lo = int(pol["middle"][3:]), int(pol["low"][3:])
    if not np.all((bits == hi) | (bits == lo)):
        ctx.fail(row, f"alloc_bits holds widths {sorted(set(bits.flatten().tolist()))}, not only {lo} and {hi}")
    count = low_count(pol, bits.size)
    ctx.equal(row, "pairs at the low bits", int((bits == lo).sum()), count)
    if pol["alloc"] in ("late", "random"):
        ctx.equal(row, "alloc_score of a content-blind rule (nothing measured)", float(np.abs(score).max()), 0.0)
    elif not np.all(np.isfinite(score)) or np.any(score <= 0) or np.any(score > 1 + 1e-12):
        ctx.fail(row, "alloc_score: an effective support outside (0, 1]")
    order = np.argsort(allocation_keys(pol, score).flatten(), kind="stable")[:count]
    want = np.full(bits.size, hi, dtype=np.uint8)
    want[order] = lo
    ctx.numbers += bits.size
    if not np.array_equal(bits.flatten(), want):
        ctx.fail(row, f"alloc_bits are not the {pol['alloc']} rule's choice from alloc_score")
    return bits


def check_selective(row, ctx, pol: dict, dims: dict, live: dict) -> tuple:
    """A selective row's per-pair arrays ``[L, H]``: ``select_sparse`` (uint8, 1 sparse) the rule's choice
    of ``round(sparse_share x pairs)`` pairs from ``select_score`` (float64, the concentration; zero for a
    content-blind rule), ``select_count`` (int32) what each pair holds at the end (a sparse pair the
    prefill's top keep and every later token, a dense pair every token). Returns (sparse pairs, the last
    bytes re-derived from the counts: a header per layer, a class byte per pair, 8 D + 8 per held token
    of a sparse pair, 8 D per token of a dense pair or, stored, its storage's bytes for n tokens)."""
    arrays = row.get("arrays", {})
    sparse, score = ctx.load(arrays.get("select_sparse")), ctx.load(arrays.get("select_score"))
    count = ctx.load(arrays.get("select_count"))
    shape = (full_layers(dims), dims["kv_heads"])
    if (sparse.shape != shape or score.shape != shape or count.shape != shape or sparse.dtype != np.uint8
            or score.dtype != np.float64 or count.dtype != np.int32):
        raise ValueError(f"select_sparse / select_score / select_count must be uint8 / float64 / int32 {list(shape)}, "
                         f"got {sparse.dtype} {list(sparse.shape)} / {score.dtype} {list(score.shape)} / {count.dtype} "
                         f"{list(count.shape)}")
    if not np.all((sparse == 0) | (sparse == 1)):
        ctx.fail(row, "select_sparse holds a class other than 0 (dense) or 1 (sparse)")
    m = selective_sparse(pol, sparse.size)
    ctx.equal(row, "sparse pairs", int(sparse.sum()), m)
    if pol["alloc"] in ("late", "random"):
        ctx.equal(row, "select_score of a content-blind rule (nothing measured)", float(np.abs(score).max()), 0.0)
    elif not np.all(np.isfinite(score)) or np.any(score <= 0) or np.any(score > 1 + 1e-12):
        ctx.fail(row, "select_score: an effective support outside (0, 1]")
    order = np.argsort(allocation_keys(pol, score).flatten(), kind="stable")[:m]
    want = np.zeros(sparse.size, dtype=np.uint8)
    want[order] = 1
    ctx.numbers += 2 * sparse.size
    if not np.array_equal(sparse.flatten(), want):
        ctx.fail(row, f"select_sparse is not the {pol['alloc']} rule's choice of {m} sparse pairs from select_score")
    n = live["prefill"] + live["steps"]
    held = np.where(sparse == 1, scored_held(pol, n), n)
    if not np.array_equal(count, held):
        ctx.fail(row, f"select_count: a sparse pair holds the prefill's top {pol['keep']} and every later token "
                      f"({scored_held(pol, n)}), a dense pair all {n}")
    d = dims["head_dim"]
    on = sparse == 1
    last = (shape[0] * HEADER + sparse.size + int(count[on].astype(np.int64).sum()) * (8 * d + SCORED_EXTRA)
            + (int(count[~on].astype(np.int64).sum()) * 8 * d if not pol.get("dense")  # float32, or the storage's
               else int((~on).sum()) * dense_pair_bytes(pol, n, d)))
    return int(sparse.sum()), last


def _check_heavy_index(row, ctx, pol: dict, dims: dict, n: int) -> int:
    """A heavy-hitter row's stored indices ``hh_index [L, H, c]`` after n tokens: c is C, or every
    packed token while fewer are packed; each (layer, KV head)'s indices are distinct packed tokens
    (in [0, packed)), in ascending order. Returns c (the bytes are re-derived from it)."""
    index = ctx.load(row.get("arrays", {}).get("hh_index"))
    _, p, _ = spans(pol, n)
    c = min(pol["heavy"], p)
    shape = (full_layers(dims), dims["kv_heads"], c)
    if index.dtype != np.int32 or index.ndim != 3 or index.shape[:2] != shape[:2]:
        raise ValueError(f"hh_index must be int32 [{shape[0]}, {shape[1]}, count], got {index.dtype} {list(index.shape)}")
    ctx.equal(row, "heavy hitters held per (layer, KV head)", int(index.shape[2]), c)
    ctx.numbers += index.size
    if index.size and (index.min() < 0 or index.max() >= p):
        ctx.fail(row, f"hh_index holds a token outside the {p} packed tokens [0, {p})")
    if index.shape[2] > 1 and np.any(np.diff(index.astype(np.int64), axis=-1) <= 0):
        ctx.fail(row, "hh_index repeats a token or is not in ascending order within a (layer, KV head)")
    if pol.get("heavy_rule") == "first" and not np.array_equal(index, np.broadcast_to(np.arange(index.shape[2]),
                                                                                      index.shape)):
        ctx.fail(row, "hh_index of the content-blind rule 'first' is not the first packed tokens")
    return int(index.shape[2])


def views(live: dict) -> list[tuple[str, dict]]:
    """(case prefix, the protocol as one context) per context of a study: a protocol with
    ``contexts`` (each prefill + steps tokens) runs each as its own set of segments, whose case ids
    start with ``c{context}-``; one without has its single ``prefill`` and plain ``seg000`` ids."""
    contexts = live.get("contexts")
    if not contexts:
        return [("", live)]
    return [(f"c{n}", {**live, "prefill": int(n) - live["steps"]}) for n in contexts]


def segment_indices(live: dict) -> list[int]:
    """The segments a run of the protocol decodes: ``segment_range`` [first, stop] of them, else all."""
    first, stop = live.get("segment_range") or (0, live["segments"])
    return list(range(first, stop))


def segment_ids(prefix: str, live: dict) -> list[str]:
    return [f"{prefix}-seg{i:03d}" if prefix else f"seg{i:03d}" for i in segment_indices(live)]


def view_of(live: dict, case) -> dict:
    """The protocol as the one context that case ``case`` belongs to."""
    for prefix, v in views(live):
        if case in segment_ids(prefix, live):
            return v
    raise ValueError(f"case {case!r} is not a segment the protocol implies")


def _live_params(ctx, study) -> dict:
    proto = ctx.protocol_copies.get(study)
    if not isinstance(proto, dict) or proto.get("kind") != "live" or not isinstance(proto.get("live"), dict):
        raise ValueError(f"no frozen live protocol copy for study {study} passed its checks")
    return proto["live"]


def check_study(ctx, study: str, live: dict) -> bool:
    """Once per study: exactly one row per (segment, arm) the protocol implies, segments as the
    protocol lays them out, token ids that match their recorded hash."""
    arms = ["dynamic_cache"] + policy_names(live) + [f"quanto_int{p['bits']}" for p in live.get("peers", [])]
    where = f"results.json {study}"
    rng = live.get("segment_range")
    if rng is not None and not (isinstance(rng, list) and len(rng) == 2 and all(type(x) is int for x in rng)
                                and 0 <= rng[0] < rng[1] <= live["segments"]):
        ctx.fail(where, f"segment_range {rng!r} is not [first, stop] with 0 <= first < stop <= segments "
                        f"({live['segments']})")
        return True
    cases = ctx.results.get("cases", {}).get(study, {})
    every = [sid for prefix, _ in views(live) for sid in segment_ids(prefix, live)]
    try:  # where the run put each segment: the corpus's token count fixes the stride of every context
        manifest = read_json(ctx, f"{study}/live_manifest.json")
    except Exception as e:  # noqa: BLE001 - reported as a FAIL line
        ctx.fail(where, f"live_manifest.json: {e}")
        manifest = {}
    tokens, recorded = manifest.get("corpus_tokens"), manifest.get("segments")
    stride = tokens // live["segments"] if type(tokens) is int else None
    if not isinstance(recorded, dict) or sorted(recorded) != sorted(every):
        ctx.fail(where, "live_manifest.json's segments are not the study's segments")
        recorded = {}
    if sorted(cases) != sorted(every):
        ctx.fail(where, f"segments {sorted(cases)[:4]}... are not the protocol's {len(every)} ({every[0]}..)")
    for prefix, v in views(live):
        _check_segments(ctx, where, cases, segment_ids(prefix, live), segment_indices(live),
                        v["prefill"] + live["steps"] + 1, stride, recorded)
    check_windows(ctx, where, manifest, live, stride, ctx.load)
    check_grid(ctx, study, where, every, arms, "segment")
    return True


def check_grid(ctx, study: str, where: str, cases, arms, unit: str) -> None:
    """Exactly one row per (case, arm) of the study: none missing, none the protocol does not
    imply, none repeated (``unit`` names a case in the FAIL lines: segment, trial)."""
    seen: dict[tuple, int] = {}
    for r in ctx.results.get("rows", []):
        if isinstance(r, dict) and r.get("study") == study:
            key = (r.get("case"), r.get("arm"))
            seen[key] = seen.get(key, 0) + 1
    want = {(c, a) for c in cases for a in arms}
    for key in sorted(want - set(seen), key=repr):
        ctx.fail(where, f"row for {unit} {key[0]} arm {key[1]} is missing")
    for key in sorted(set(seen) - want, key=repr):
        ctx.fail(where, f"row for {unit} {key[0]} arm {key[1]} is not one the protocol implies")
    for key, count in sorted(seen.items(), key=repr):
        if count > 1:
            ctx.fail(where, f"{unit} {key[0]} arm {key[1]} has {count} rows")


def _check_segments(ctx, where: str, cases: dict, segs: list, index: list, length: int, stride: int | None,
                    recorded: dict) -> None:
    """The segments of one context (``index``: their places among the protocol's segments): token
    ids of ``length`` tokens matching their hash, segment ``i`` starting at ``i * stride`` (``stride``
    the corpus's token count over the protocol's segments, as the live manifest records it), as
    the manifest's map of starts says, disjoint."""
    starts = []
    for sid in segs:
        rec = cases.get(sid, {})
        meta = rec.get("meta", {}) if isinstance(rec, dict) else {}
        try:
            tok = ctx.load(rec.get("arrays", {}).get("token_ids"))
        except Exception as e:  # noqa: BLE001 - reported as a FAIL line
            ctx.fail(f"{where} {sid}", f"token_ids: {e}")
            continue
        if tok.shape != (length,) or tok.dtype != np.int32:
            ctx.fail(f"{where} {sid}", f"token_ids must be int32 [{length}], got {tok.dtype} {list(tok.shape)}")
        ctx.numbers += 1
        if hashlib.sha256(tok.tobytes()).hexdigest() != meta.get("token_ids_sha256"):
            ctx.fail(f"{where} {sid}", "token_ids do not match their recorded sha256")
        starts.append(meta.get("start_token"))
        if recorded and recorded.get(sid) != meta.get("start_token"):
            ctx.fail(f"{where} {sid}", f"start_token {meta.get('start_token')} is not the live manifest's "
                                       f"{recorded.get(sid)}")
    if len(starts) == len(segs) and all(isinstance(x, int) for x in starts):
        if stride is None:
            ctx.fail(where, "live_manifest.json records no corpus_tokens: the segments' places cannot be checked")
        elif starts != [i * stride for i in index] or stride < length:
            ctx.fail(where, f"segment starts {starts[:4]}... are not disjoint, evenly spaced windows of {length} tokens")


def check(row: dict, ctx) -> None:
    study = row.get("study")
    whole = _live_params(ctx, study)
    ctx.cached(("live_study", study), lambda: check_study(ctx, study, whole))
    live = view_of(whole, row.get("case"))
    dims = model_dims(live, row)
    arm, kind = row.get("arm"), row.get("kind")
    names = set(policy_names(live))
    peers = {f"quanto_int{p['bits']}": p for p in live.get("peers", [])}
    expected_kind = "reference" if arm == "dynamic_cache" else "policy" if arm in names else "peer" if arm in peers else None
    if expected_kind is None or kind != expected_kind:
        raise ValueError(f"arm {arm!r} (kind {kind!r}) is not an arm of the protocol")
    arrays = row.get("arrays", {})
    T = live["steps"]
    lp, am = ctx.load(arrays.get("logprob")), ctx.load(arrays.get("argmax"))
    by, cx = ctx.load(arrays.get("bytes")), ctx.load(arrays.get("context"))
    if lp.shape != (T,) or am.shape != (T,) or lp.dtype.kind != "f" or am.dtype.kind not in "iu":
        raise ValueError(f"logprob / argmax must be [{T}] arrays, got {lp.dtype} {list(lp.shape)} / {am.dtype} {list(am.shape)}")
    if not np.all(np.isfinite(lp)) or np.any(lp > 0):
        ctx.fail(row, "logprob holds a non-finite or positive log-probability")
    want_ctx = schedule(kind, arm, live)
    # the reference always runs chunked, quanto one token per forward, a policy in the protocol's mode
    ctx.equal(row, "mode", row.get("mode"), {"reference": "chunked", "peer": "step"}.get(kind, live.get("mode", "chunked")))
    ctx.equal(row, "context schedule", [int(x) for x in cx], want_ctx)
    ctx.equal(row, "forwards", row.get("forwards"), len(want_ctx))
    ctx.equal(row, "scored_tokens", row.get("scored_tokens"), T)
    ctx.equal(row, "context_final", row.get("context_final"), want_ctx[-1])
    if kind == "policy":
        pol = policy_of(arm, live)
        want_b = [policy_bytes(pol, n, dims) for n in want_ctx]
        cfg = row.get("policy", {})
        for key in ("middle", "sink", "window", "group", "feature_group", "key_axis", "sink_select", "low", "alloc",
                    "alloc_from", "heavy", "heavy_rule", "scorer", "scorer_mode", "keep", "seed", "key_rope",
                    "layers", "beta", "layer_keep", "heads", "alpha", "store", "store_window", "rest", "sparse_share", "codec",
                    "block"):
            ctx.equal(row, f"policy.{key}", cfg.get(key), pol.get(key))
        ctx.equal(row, "policy.name", cfg.get("name"), arm)
        if calibrated_parts(pol):  # the tables stored, the evidence layer's re-derived from its calibration input
            rec = ctx.cached(("live_calibration", study), lambda: read_json(ctx, f"{study}/live_manifest.json")
                             .get("calibration") or {})
            windows = (len(rec["starts"]), rec["tokens"]) if isinstance(rec.get("starts"), list) else None
            check_tables(row, ctx, pol, model_dims(live, row), live.get("evidence_layer", 0), windows)
        if pol.get("low"):
            ctx.close(row, "policy.low_share", cfg.get("low_share"), pol["low_share"])
        else:
            ctx.equal(row, "policy.low_share", cfg.get("low_share"), None)
        if pol.get("low"):
            bits = _check_allocation(row, ctx, pol, dims)
            low_pairs = int((bits == int(pol["low"][3:])).sum())
            want_b = [policy_bytes(pol, n, dims, low_pairs) for n in want_ctx]
        if pol.get("heads") == "selective":  # every forward's bytes at the classes stored, the last from the counts
            m, last = check_selective(row, ctx, pol, dims, live)
            want_b = [policy_bytes(pol, n, dims, sparse=m) for n in want_ctx]
            ctx.equal(row, "the last bytes against select_count's", want_b[-1], last)
        if pol.get("heavy"):  # the last bytes from the stored heavy-hitter indices themselves
            held = _check_heavy_index(row, ctx, pol, dims, want_ctx[-1])
            want_b[-1] = policy_bytes(pol, want_ctx[-1], dims, held=held)
    elif kind == "reference":
        want_b = [reference_bytes(n, dims) for n in want_ctx]
    else:
        peer = peers[arm]
        want_b = [quanto_bytes(n, live["prefill"], live.get("window", 128), peer["bits"], live.get("peer_group", 64), dims)
                  for n in want_ctx]
    ctx.equal(row, "bytes after each forward", [int(x) for x in by], want_b)
    ctx.equal(row, "bytes_final", row.get("bytes_final"), want_b[-1])
    ctx.close(row, "bytes_per_token", row.get("bytes_per_token"), want_b[-1] / want_ctx[-1])
    nll = -float(np.mean(lp.astype(np.float64)))
    ctx.close(row, "nll", row.get("nll"), nll)
    ctx.close(row, "perplexity", row.get("perplexity"), math.exp(nll))
    target = _targets(ctx, study, row.get("case"), live)
    _check_half_bound(row, ctx, lp, am, target)
    if kind == "reference":
        ctx.close(row, "mean_kl", row.get("mean_kl"), 0.0)
        ctx.close(row, "top1_agreement", row.get("top1_agreement"), 1.0)
        return
    kl = ctx.load(arrays.get("kl"))
    if kl.shape != (T,) or not np.all(np.isfinite(kl)) or np.any(kl < KL_FLOOR):
        ctx.fail(row, f"kl must be [{T}] finite values >= {KL_FLOOR:g}")
    ctx.close(row, "mean_kl", row.get("mean_kl"), float(np.mean(kl.astype(np.float64))))
    ref = _reference_row(ctx, study, row.get("case"))
    ref_am, ref_lp = ctx.load(ref["arrays"]["argmax"]), ctx.load(ref["arrays"]["logprob"])
    if ref_lp.shape != (T,) or ref_am.shape != (T,):
        raise ValueError(f"the reference row of {row.get('case')} has logprob / argmax {list(ref_lp.shape)} / "
                         f"{list(ref_am.shape)}, expected [{T}]")
    ctx.close(row, "top1_agreement", row.get("top1_agreement"), float(np.mean(am == ref_am)))
    if kl.shape == (T,) and np.all(np.isfinite(kl)):
        _check_kl_bound(row, ctx, kl, ref_lp, lp)
        if kind == "policy" and policy_of(arm, live)["middle"] == "float32":
            same = TOLERANCES["float32_same_cache"]["atol"]
            ctx.numbers += T
            if np.any(kl > same):
                i = int(np.argmax(kl))
                ctx.fail(row, f"the float32 cache bound: kl[{i}] = {float(kl[i]):.6g} > {same:g}, though a float32 "
                              "cache holds the reference's own K/V (its KL is zero up to float32 rounding)")
    first = segment_ids(row.get("case", "").rpartition("-")[0] if "-" in str(row.get("case")) else "", live)[0]
    if "evidence_layer" in live and live["evidence_layer"] is None:  # the protocol stores none
        if row.get("evidence") is not None:
            ctx.fail(row, "evidence arrays, though the protocol's evidence_layer is null")
    elif kind == "policy" and policy_of(arm, live)["middle"] != "float32" and row.get("case") == first:
        check_evidence(row, ctx, policy_of(arm, live), live)
        if whole.get("shared_prefill", True):
            ctx.cached(("live_shared_prefill", study, row.get("case")),
                       lambda: _check_shared_prefill(ctx, study, row.get("case"), live))


def _check_shared_prefill(ctx, study: str, case: str, live: dict) -> bool:
    """With a shared prefill every arm starts from one float32 prefill, so across the evidence rows
    of a segment: the prefill's keys (``input.k[:, :P]``), the recorded prefill queries (``input.q``)
    and an oracle pass's prefill keys (``oracle.k[:, :P]``, the same forward on the same tokens) are
    one array, and every prefill-rule allocation reads one measurement (``alloc_score`` equal). A
    forger who makes one arm's recorded queries tell another allocation breaks that agreement."""
    P = live["prefill"]
    groups: dict[str, dict[str, bytes]] = {"input.k[:, :P]": {}, "input.q": {}, "alloc_score (prefill rules)": {},
                                           "prefill queries, last 1": {}, "prefill queries, last 64": {}}
    for r in ctx.results.get("rows", []):
        if not (isinstance(r, dict) and r.get("study") == study and r.get("case") == case and r.get("kind") == "policy"):
            continue
        a = (r.get("evidence") or {}).get("arrays") or {}
        arm = r.get("arm")
        if "input.k" in a:
            k = ctx.load(a["input.k"])
            groups["input.k[:, :P]"][arm] = k[:, :P].tobytes()
            if "oracle.k" in a:
                groups["input.k[:, :P]"][f"{arm} (oracle.k)"] = ctx.load(a["oracle.k"])[:, :P].tobytes()
        if "input.q" in a:
            groups["input.q"][arm] = ctx.load(a["input.q"]).tobytes()
        # a scored arm's prefill.q (the last queries its prefill decision read) is the tail of those same
        # queries: equal across arms, and to a recorded input.q's last rows
        for w in (1, 64, P):
            for name in ("input.q", "prefill.q"):
                if name in a:
                    q = ctx.load(a[name])
                    if q.ndim == 3 and q.shape[1] >= w:
                        groups.setdefault(f"prefill queries, last {w}", {})[f"{arm} ({name})"] = q[:, -w:].tobytes()
        if "rope.inv_freq" in a:  # one model, one rotary schedule
            groups.setdefault("rope.inv_freq", {})[arm] = ctx.load(a["rope.inv_freq"]).tobytes()
        pol = policy_of(arm, live) if arm in policy_names(live) else {}
        if pol.get("low") and pol.get("alloc") in ("concentrated", "diffuse") and pol.get("alloc_from") == "prefill":
            groups["alloc_score (prefill rules)"][arm] = ctx.load((r.get("arrays") or {}).get("alloc_score")).tobytes()
        if (pol.get("heads") == "selective" and pol.get("alloc") in ("concentrated", "diffuse")
                and pol.get("alloc_from") == "prefill"):  # the selective rule reads the same measurement
            groups["alloc_score (prefill rules)"][arm] = ctx.load((r.get("arrays") or {}).get("select_score")).tobytes()
    for what, by_arm in groups.items():
        ctx.numbers += len(by_arm)
        if len(set(by_arm.values())) > 1:
            first = next(iter(by_arm.values()))
            odd = sorted(a for a, v in by_arm.items() if v != first)
            ctx.fail(f"results.json {study} {case}", f"{what} differs between arms that share one float32 prefill "
                     f"({odd[:3]} against {next(iter(by_arm))})")
    return True


def _targets(ctx, study, case, live: dict) -> np.ndarray:
    """The target of each scored step: step i feeds token ``prefill + i`` of the segment and scores
    its prediction of token ``prefill + i + 1`` (the prefill's own last prediction is not scored)."""
    def load():
        rec = ctx.results.get("cases", {}).get(study, {}).get(case)
        tok = ctx.load(rec.get("arrays", {}).get("token_ids")) if isinstance(rec, dict) else None
        P, T = live["prefill"], live["steps"]
        if tok is None or tok.shape != (P + T + 1,) or tok.dtype.kind not in "iu":
            raise ValueError(f"segment {case} has no integer token_ids of {P + T + 1} tokens to score against")
        return tok[P + 1:P + T + 1].astype(np.int64)

    return ctx.cached(("live_targets", study, case), load)


def _check_half_bound(row, ctx, lp: np.ndarray, am: np.ndarray, target: np.ndarray) -> None:
    """Where the stored argmax is not the target, the target has at most the argmax's probability,
    so at most ½ of a distribution (whose float32 probabilities sum to 1 within the tolerance)."""
    limit = math.log((1.0 + TOLERANCES["float32_log_softmax"]["atol"]) / 2.0)
    ctx.numbers += lp.size
    bad = (am.astype(np.int64) != target) & (lp.astype(np.float64) > limit)
    if bad.any():
        i = int(np.argmax(bad))
        ctx.fail(row, f"the log ½ bound: logprob[{i}] = {float(lp[i]):.6g} > log ½ where the stored argmax "
                      f"{int(am[i])} is not the target token {int(target[i])} (a token other than the argmax has "
                      "at most half the probability)")


def binary_kl_bound(p_lp: np.ndarray, q_lp: np.ndarray, slack: float) -> np.ndarray:
    """A lower bound of KL(P ‖ Q) from log P(t) and log Q(t) of one token t, per step: KL of the two
    coarsened to {t, the rest} (data processing). The rest's masses are the complements, each
    within ``slack`` (float32 probabilities sum to 1 only that closely): the bound takes the worst
    such masses, Q's rest largest and P's rest where ``x log(x / y)`` is smallest."""
    lp64, lq64 = p_lp.astype(np.float64), q_lp.astype(np.float64)
    p = np.exp(lp64)
    y = -np.expm1(lq64) + slack  # Q's rest at its largest: > 0
    lo, hi = np.maximum(-np.expm1(lp64) - slack, 0.0), -np.expm1(lp64) + slack
    x = np.clip(y / math.e, lo, hi)  # argmin of the convex x log(x / y) over [lo, hi]
    with np.errstate(divide="ignore", invalid="ignore"):
        rest = np.where(x > 0, x * np.log(x / y), 0.0)
    return p * (lp64 - lq64) + rest


def _check_kl_bound(row, ctx, kl: np.ndarray, ref_lp: np.ndarray, lp: np.ndarray) -> None:
    bound = binary_kl_bound(ref_lp, lp, TOLERANCES["float32_log_softmax"]["atol"])
    ctx.numbers += kl.size
    bad = kl.astype(np.float64) < bound - TOLERANCES["kl_floor"]["atol"]
    if bad.any():
        i = int(np.argmax(bound - kl))
        ctx.fail(row, f"the target-token KL bound: kl[{i}] = {float(kl[i]):.6g} is below {float(bound[i]):.6g}, the KL "
                      f"of the target token's probabilities alone (reference logprob {float(ref_lp[i]):.6g}, this "
                      f"arm's {float(lp[i]):.6g}): KL, log-probs or argmax do not belong together")


def _reference_row(ctx, study, case) -> dict:
    def find():
        for r in ctx.results.get("rows", []):
            if isinstance(r, dict) and r.get("study") == study and r.get("case") == case and r.get("arm") == "dynamic_cache":
                return r
        raise ValueError(f"segment {case} has no dynamic_cache reference row")

    return ctx.cached(("live_ref", study, case), find)
