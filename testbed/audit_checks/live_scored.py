"""The audit of a scored selection's evidence layer (numpy only; no model, no testbed.policies).

A scored selection (a token scorer keeps its top ``keep`` per KV head) stores float32 K/V, the kept
indices and their scores, or the kept set as a storage stores a sequence (``store``), and a quantized
rest (``rest``, MiKV). At the evidence layer of the first segment the audit checks the kept indices,
the kept K/V against the recorded inputs, the stored arrays re-encoded byte for byte and their bytes;
for a scorer it re-derives, the stored scores against its own (``knorm``, ``random``: from the recorded
keys; ``snapkv``, ``tova``, ``expected_attention``: in float64 from the recorded prefill queries) and the
kept set the top of them (``_check_kept``), per head or, for Ada-KV (``heads: "adaptive"``), each head's
own safeguard then the layer's top (``_check_adaptive``). Entry: ``scored_evidence``, which
``live_evidence.check_evidence`` calls.
"""

from __future__ import annotations

import math

import numpy as np

from .common import TOLERANCES
from .live_policies import (ATTENTION_SCORERS, AUDIT_SCORERS, EA_FUTURE, EA_SINK, HEADER, KEPT_FIRST, ONE_FULL_LAYER,
                            SCORED_EXTRA, SNAPKV_KERNEL, adaptive_safeguard, dense_policy, middle_config, model_dims,
                            policy_bytes, rest_policy, scored_held, spans, store_policy)
from .schemes import encode_tensor, payload_differences

__all__ = ["scored_evidence", "rotate_half"]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    m = np.uint64(0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & m
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & m
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & m
        return z ^ (z >> np.uint64(31))


def _scores(pol: dict, k: np.ndarray, layer: int) -> np.ndarray:
    """[H, n] float32 scores of a built-in scorer over the recorded keys ``k [H, n, D]`` of
    positions 0..n-1: knorm, the negative float64 L2 norm rounded to float32; random, the top 24
    bits of SplitMix64 over seed * 2**40 + layer * 2**32 + head * 2**24 + position, over 2**24."""
    h, n = k.shape[:2]
    if pol["scorer"] == "knorm":
        return (-np.sqrt(np.sum(k.astype(np.float64) ** 2, axis=-1))).astype(np.float32)
    x = (np.uint64(pol["seed"]) << np.uint64(40)) + (np.uint64(layer) << np.uint64(32)) \
        + (np.arange(h, dtype=np.uint64)[:, None] << np.uint64(24)) + np.arange(n, dtype=np.uint64)[None, :]
    return (_splitmix64(x) >> np.uint64(40)).astype(np.float32) / np.float32(2 ** 24)


def scored_evidence(row, ctx, pol: dict, live: dict, a: dict, layer) -> None:
    """The evidence layer of a scored selection: the kept indices (ascending, in range, as many as
    the policy holds), the kept K/V equal to the recorded inputs at them, the bytes; for a built-in
    scorer, the stored scores its own scores of those keys and the kept set its top-keep (prefill
    mode: of the prefill, every later token kept), with near ties allowed within float32 rounding."""
    if pol.get("heads") == "adaptive":
        _adaptive_evidence(row, ctx, pol, live, a, layer)
        return
    if pol.get("heads") == "selective":
        _selective_evidence(row, ctx, pol, live, a, layer)
        return
    n = live["prefill"] + live["steps"]
    idx, score = a.get("kept.index"), a.get("kept.score")
    k, v = a.get("input.k"), a.get("input.v")
    if idx is None or score is None or k is None or v is None:
        raise ValueError("a scored selection's evidence needs kept.index, kept.score, input.k and input.v")
    held = scored_held(pol, n)
    if k.shape[1] != n or idx.dtype != np.int32 or idx.shape != (k.shape[0], held) or score.shape != idx.shape:
        raise ValueError(f"kept.index {idx.dtype} {list(idx.shape)} / kept.score {list(score.shape)}: expected int32 "
                         f"[{k.shape[0]}, {held}] over {n} recorded tokens")
    ctx.numbers += idx.size
    if np.any(np.diff(idx, axis=1) <= 0) or idx.min() < 0 or idx.max() >= n:
        ctx.fail(row, "kept.index: the kept tokens are not distinct positions in arrival order within the segment")
        return
    at = idx.astype(np.int64)[..., None]
    if pol.get("store"):  # the kept tokens, in order, stored as the storage stores a sequence of that length
        total = _stored_kept(row, ctx, pol, a, at, k, v)
        total += _rest_evidence(row, ctx, pol, live, a, idx, k, v) if pol.get("rest") else 0
    else:
        for name, x in (("k", k), ("v", v)):
            got = a.get(f"float.{name}")
            want = np.take_along_axis(x, at, axis=1)
            if got is None or got.shape != want.shape or got.tobytes() != want.tobytes():
                ctx.fail(row, f"float.{name}: the kept K/V are not the recorded inputs at kept.index")
        rest = _rest_evidence(row, ctx, pol, live, a, idx, k, v) if pol.get("rest") else 0
        extra = sorted(x for x in a if x not in ("float.k", "float.v", "kept.index", "kept.score", "input.k", "input.v",
                                                 "prefill.q", "rope.inv_freq") and not (pol.get("rest") and
                                                                                        x.startswith("rest.")))
        if extra:
            ctx.fail(row, f"a scored selection stores float K/V, indices and scores only, found {extra}")
        total = sum(int(a[x].nbytes) for x in ("float.k", "float.v", "kept.index", "kept.score")) + rest
        if pol.get("block"):  # the per-token indices and scores are evidence; the cache stores one of each per block
            total = sum(int(a[x].nbytes) for x in ("float.k", "float.v")) \
                + idx.shape[0] * -(-held // pol["block"]) * SCORED_EXTRA
    ctx.close(row, "evidence layer bytes", total + HEADER, policy_bytes(pol, n, {**model_dims(live, row), **ONE_FULL_LAYER}))
    w, last = pol.get("window", 0), (live["prefill"] if pol["scorer_mode"] == "prefill" else n)
    if w and not all(np.all(np.isin(np.arange(last - w, last), idx[hh])) for hh in range(idx.shape[0])):
        ctx.fail(row, f"kept set: the newest {w} tokens are always kept")  # whatever the scorer
    attention = pol["scorer"] in ATTENTION_SCORERS
    if pol["scorer"] not in AUDIT_SCORERS or (attention and (pol["scorer"] == "h2o" or pol["scorer_mode"] == "online")):
        what = pol["scorer"] + ("" if pol["scorer"] not in AUDIT_SCORERS else f" ({pol['scorer_mode']})")
        ctx.user_scorers.setdefault(row.get("study"), set()).add(what)  # self-consistent only: said in the summary
        return
    own = _own_scores(row, ctx, pol, live, a, layer)
    if own is not None and pol.get("block"):
        _check_blocks(row, ctx, pol, live, own[0], idx, score, own[1], atol=own[2])
    elif own is not None:
        _check_kept(row, ctx, pol, live, own[0], idx, score, own[1], atol=own[2])


def _check_blocks(row, ctx, pol: dict, live: dict, own: np.ndarray, idx: np.ndarray, score: np.ndarray, tol: float,
                  atol: float = 0.0) -> None:
    """A block selection (``block`` B, prefill mode): the stored scores the audit's own; the kept prefill
    tokens whole blocks of B from position 0, keep / B of them, each kept block's summed score (the
    newest ``window`` prefill tokens ranked above every score) at least every dropped block's, up to a
    near tie (the tolerance scaled by the block's size); every later token kept."""
    P, b = live["prefill"], pol["block"]
    kept_own = np.take_along_axis(own, idx.astype(np.int64), axis=1)
    decided = idx < (P if pol["scorer"] in ATTENTION_SCORERS else own.shape[1])
    ctx.numbers += score.size
    if not np.allclose(score[decided], kept_own[decided], rtol=tol, atol=atol):
        ctx.fail(row, f"kept.score: not the {pol['scorer']} scores of the kept keys")
    if P % b:
        ctx.fail(row, f"a block selection of {b} tokens needs a prefill of whole blocks, not {P}")
        return
    rank = own[:, :P].astype(np.float64)
    if pol.get("window"):
        rank[:, P - pol["window"]:] = np.inf
    sums = rank.reshape(rank.shape[0], P // b, b).sum(axis=2)
    for hh in range(idx.shape[0]):
        pre = idx[hh][idx[hh] < P].astype(np.int64)
        blocks = np.unique(pre // b)
        if pre.size != blocks.size * b or blocks.size != pol["keep"] // b \
                or not np.array_equal(pre, (blocks[:, None] * b + np.arange(b)).ravel()):
            ctx.fail(row, f"kept set: head {hh} does not keep {pol['keep'] // b} whole blocks of {b} prefill tokens")
            return
        if not np.array_equal(idx[hh][idx[hh] >= P], np.arange(P, P + live["steps"])):
            ctx.fail(row, "kept set: a prefill-mode selection keeps every token after the prefill")
            return
        dropped = np.ones(P // b, dtype=bool)
        dropped[blocks] = False
        if dropped.any():
            lo, hi = sums[hh][blocks].min(), sums[hh][dropped].max()
            if hi > lo + b * (tol * max(abs(float(lo)), abs(float(hi))) + atol):
                ctx.fail(row, f"kept set: head {hh} dropped a block scored {hi!r} and kept one scored {lo!r} "
                              f"({pol['scorer']}: the kept ones are the top {pol['keep'] // b} blocks of {b})")
                return


def _rest_evidence(row, ctx, pol: dict, live: dict, a: dict, idx: np.ndarray, k: np.ndarray, v: np.ndarray) -> int:
    """A quantized rest (MiKV): the prefill tokens not in ``kept.index``, per head in order, are the rest
    storage's sequence; its packed groups re-encoded and its float32 remainder equal the stored
    ``rest.*`` arrays byte for byte. Returns their bytes."""
    P = live["prefill"]
    h = k.shape[0]
    out = np.ones((h, P), dtype=bool)
    for hh in range(h):
        out[hh, idx[hh][(idx[hh] >= 0) & (idx[hh] < P)]] = False
    m = int(out[0].sum())
    if not np.all(out.sum(axis=1) == m):
        ctx.fail(row, "kept.index: the heads keep different counts of the prefill")
        return 0
    seq_k, seq_v = (x[:, :P][out].reshape(h, m, x.shape[2]) for x in (k, v))
    want = _sequence_payload(rest_policy(pol), seq_k, seq_v, "rest.")
    stored = {x: y for x, y in a.items() if x.startswith("rest.")}
    ctx.numbers += len(want)
    for line in payload_differences(stored, want, f"the recorded prefill inputs not kept ({m} per head)"):
        ctx.fail(row, line)
    return sum(int(y.nbytes) for y in stored.values())


def _sequence_payload(st: dict, k: np.ndarray, v: np.ndarray, prefix: str = "") -> dict:
    """The arrays a uniform storage ``st`` of no sink holds (header left out) after it was fed the
    sequence ``k``, ``v`` ``[H, m, D]``: its whole groups encoded by the audit's own encoders, the rest
    float32, each named ``prefix`` + the storage's own name (``key.codes``, ``float.k``, ...)."""
    _, p, _ = spans(st, k.shape[1])
    want = {}
    for name, label, x in (("k", "key", k), ("v", "value", v)):
        want[f"{prefix}sink.{name}"], want[f"{prefix}float.{name}"] = x[:, :0], x[:, p:]
        if p:
            want.update({f"{prefix}{label}.{arr}": w for arr, w in encode_tensor(x[:, :p], middle_config(st, name)).items()
                         if arr != "header"})
    return want


def _stored_kept(row, ctx, pol: dict, a: dict, at: np.ndarray, k: np.ndarray, v: np.ndarray) -> int:
    """A kept set stored by its storage: the recorded inputs at ``kept.index`` (``at``), in order, form the
    storage's sequence; its packed tokens re-encoded with the audit's encoders and its float32 window
    equal the stored arrays byte for byte, and no other array is stored. Returns the stored bytes."""
    st = store_policy(pol)
    _, p, _ = spans(st, at.shape[1])
    want = _sequence_payload(st, np.take_along_axis(k, at, axis=1), np.take_along_axis(v, at, axis=1))
    stored = {x: y for x, y in a.items() if not x.startswith(("input.", "rest.") if pol.get("rest") else "input.")
              and x not in ("kept.index", "kept.score", "prefill.q", "rope.inv_freq")}
    ctx.numbers += len(want)
    for line in payload_differences(stored, want, f"the recorded inputs at kept.index (packed kept tokens [0, {p}))"):
        ctx.fail(row, line)
    return sum(int(y.nbytes) for y in stored.values()) + int(a["kept.index"].nbytes) + int(a["kept.score"].nbytes)


def _stored_dense(row, ctx, pol: dict, a: dict, k: np.ndarray, v: np.ndarray) -> int:
    """A selective selection's stored dense class: every recorded token of the dense heads (``k``, ``v``
    ``[dense heads, n, D]``, in head order) is the storage's sequence; its packed groups re-encoded with
    the audit's encoders and its float32 window equal the stored ``dense.*`` arrays byte for byte (none
    when the layer has no dense head). Returns their bytes."""
    st = dense_policy(pol)
    _, p, _ = spans(st, k.shape[1])
    want = _sequence_payload(st, k, v, "dense.") if k.shape[0] else {}
    stored = {x: y for x, y in a.items() if x.startswith("dense.")}
    ctx.numbers += len(want)
    for line in payload_differences(stored, want, f"the recorded inputs of the {k.shape[0]} dense heads ({p} packed)"):
        ctx.fail(row, line)
    return sum(int(y.nbytes) for y in stored.values())


def _adaptive_evidence(row, ctx, pol: dict, live: dict, a: dict, layer) -> None:
    """The evidence layer of an adaptive selection (``heads: "adaptive"``, Ada-KV, prefill mode):
    ``kept.count [H]`` the tokens each head holds, summing to H x the layer's held count, each at
    least the safeguard plus every token after the prefill; the arrays ``[H, max count]``, each
    head's held tokens first (ascending, in range, K/V the recorded inputs there) and its empty slots
    after them (index -1, zero K, V and score); the bytes of the held tokens only; for a scorer the
    audit re-derives at the prefill, the kept set (:func:`_check_adaptive`)."""
    n, P = live["prefill"] + live["steps"], live["prefill"]
    idx, score, count = a.get("kept.index"), a.get("kept.score"), a.get("kept.count")
    k, v = a.get("input.k"), a.get("input.v")
    if idx is None or score is None or count is None or k is None or v is None:
        raise ValueError("an adaptive scored selection's evidence needs kept.index, kept.score, kept.count, input.k "
                         "and input.v")
    h = k.shape[0]
    held = scored_held(pol, n)  # per head on average: the layer's count and every token after the prefill
    if count.dtype != np.int32 or count.shape != (h,):
        raise ValueError(f"kept.count {count.dtype} {list(count.shape)}: expected int32 [{h}]")
    slots = int(count.max())
    if (k.shape[1] != n or idx.dtype != np.int32 or idx.shape != (h, slots) or score.shape != idx.shape
            or score.dtype != np.float32):
        raise ValueError(f"kept.index {idx.dtype} {list(idx.shape)} / kept.score {score.dtype} {list(score.shape)}: "
                         f"expected int32 / float32 [{h}, {slots}] (the largest kept.count) over {n} recorded tokens")
    ctx.numbers += idx.size + h
    safe = adaptive_safeguard(pol["keep"], pol["alpha"])
    if int(count.sum()) != h * held:
        ctx.fail(row, f"kept.count: the heads hold {int(count.sum())} tokens; the layer holds {h} x {held}")
    if np.any(count < min(safe, P) + n - P) or np.any(count > n):
        ctx.fail(row, f"kept.count: a head holds fewer than its safeguard ({safe}) and the {n - P} tokens after the "
                      f"prefill, or more than {n}: {count.tolist()}")
        return
    real = np.arange(slots)[None, :] < count[:, None]
    fk, fv = a.get("float.k"), a.get("float.v")
    if fk is None or fv is None or fk.shape != (h, slots, k.shape[2]) or fv.shape != (h, slots, v.shape[2]):
        raise ValueError(f"float.k / float.v: expected [{h}, {slots}, D], the kept K/V in the slots of kept.index")
    if np.any(idx[~real] != -1) or np.any(score[~real] != 0) or np.any(fk[~real] != 0) or np.any(fv[~real] != 0):
        ctx.fail(row, "kept.index: a head's slots after its count are not empty (index -1, zero K, V and score)")
        return
    for hh in range(h):
        got = idx[hh, : count[hh]]  # empty for a head that holds nothing (alpha 0 and no steps)
        if got.size and (np.any(np.diff(got) <= 0) or got.min() < 0 or got.max() >= n):
            ctx.fail(row, f"kept.index: head {hh}'s kept tokens are not distinct positions in arrival order within the "
                          "segment")
            return
        for name, x, stored in (("k", k, fk), ("v", v, fv)):
            if stored[hh, : count[hh]].tobytes() != x[hh, got.astype(np.int64)].tobytes():
                ctx.fail(row, f"float.{name}: head {hh}'s kept K/V are not the recorded inputs at kept.index")
        if not np.all(np.isin(np.arange(P, n), got)):
            ctx.fail(row, "kept set: a prefill-mode selection keeps every token after the prefill")
        w = pol.get("window", 0)
        if w and not np.all(np.isin(np.arange(P - w, P), got)):
            ctx.fail(row, f"kept set: the newest {w} tokens are always kept")
    extra = sorted(x for x in a if x not in ("float.k", "float.v", "kept.index", "kept.score", "kept.count", "input.k",
                                             "input.v", "prefill.q", "rope.inv_freq"))
    if extra:
        ctx.fail(row, f"a scored selection stores float K/V, indices, scores and per-head counts only, found {extra}")
    d = k.shape[2]
    ctx.close(row, "evidence layer bytes", int(count.sum()) * (8 * d + SCORED_EXTRA) + HEADER,
              policy_bytes(pol, n, {**model_dims(live, row), **ONE_FULL_LAYER}))
    attention = pol["scorer"] in ATTENTION_SCORERS
    if pol["scorer"] not in AUDIT_SCORERS or (attention and pol["scorer"] == "h2o"):
        ctx.user_scorers.setdefault(row.get("study"), set()).add(f"{pol['scorer']} (prefill, adaptive)")
        return
    own = _own_scores(row, ctx, pol, live, a, layer)
    if own is not None:
        _check_adaptive(row, ctx, pol, live, own[0], idx, score, count, own[1], own[2])


def _selective_evidence(row, ctx, pol: dict, live: dict, a: dict, layer) -> None:
    """The evidence layer of a selective selection (``heads: "selective"``, the seed's rule, prefill
    mode): ``kept.sparse [H]`` and ``kept.count [H]`` the row's ``select_sparse`` / ``select_count`` at
    the layer; a sparse head holds the prefill's top ``keep`` and every later token, a dense head every
    token (index 0..n-1); the arrays ``[H, max count]`` in Ada-KV's layout (each head's held tokens first,
    ascending, K/V the recorded inputs there; empty slots after them: index -1, zero K, V and score); the
    bytes from the counts (a header, a class byte per head, 8 D per held token, 8 more per token of a
    sparse head); for a scorer the audit re-derives, each sparse head's kept prefill tokens its top keep.
    Dense pairs stored (``dense`` set): a dense head's float slots are zero, and its tokens are the
    ``dense.*`` arrays, the recorded inputs of the dense heads re-encoded by the audit as the uniform
    storage stores a sequence (:func:`_stored_dense`), their bytes in place of 8 D per token."""
    n, P = live["prefill"] + live["steps"], live["prefill"]
    idx, score, count, sp = a.get("kept.index"), a.get("kept.score"), a.get("kept.count"), a.get("kept.sparse")
    k, v = a.get("input.k"), a.get("input.v")
    if idx is None or score is None or count is None or sp is None or k is None or v is None:
        raise ValueError("a selective selection's evidence needs kept.index, kept.score, kept.count, kept.sparse, "
                         "input.k and input.v")
    h = k.shape[0]
    if count.dtype != np.int32 or count.shape != (h,) or sp.dtype != np.uint8 or sp.shape != (h,):
        raise ValueError(f"kept.count / kept.sparse {count.dtype} {list(count.shape)} / {sp.dtype} {list(sp.shape)}: "
                         f"expected int32 / uint8 [{h}]")
    arrays = row.get("arrays", {})
    row_sparse, row_count = ctx.load(arrays.get("select_sparse")), ctx.load(arrays.get("select_count"))
    if not isinstance(layer, int) or not 0 <= layer < row_sparse.shape[0] or row_sparse.shape[1:] != (h,):
        raise ValueError(f"evidence layer {layer!r} is outside select_sparse {list(row_sparse.shape)}")
    ctx.numbers += 2 * h
    if not np.array_equal(sp, row_sparse[layer]):
        ctx.fail(row, f"the evidence layer's kept.sparse is not select_sparse[{layer}]")
    if not np.array_equal(count, row_count[layer]):
        ctx.fail(row, f"the evidence layer's kept.count is not select_count[{layer}]")
    held = scored_held(pol, n)
    if not np.array_equal(count, np.where(sp == 1, held, n)):
        ctx.fail(row, f"kept.count: a sparse head holds {held} tokens, a dense one {n}: {count.tolist()}")
        return
    slots = int(count.max())
    if (k.shape[1] != n or idx.dtype != np.int32 or idx.shape != (h, slots) or score.shape != idx.shape
            or score.dtype != np.float32):
        raise ValueError(f"kept.index {idx.dtype} {list(idx.shape)} / kept.score {score.dtype} {list(score.shape)}: "
                         f"expected int32 / float32 [{h}, {slots}] (the largest kept.count) over {n} recorded tokens")
    real = np.arange(slots)[None, :] < count[:, None]
    fk, fv = a.get("float.k"), a.get("float.v")
    if fk is None or fv is None or fk.shape != (h, slots, k.shape[2]) or fv.shape != (h, slots, v.shape[2]):
        raise ValueError(f"float.k / float.v: expected [{h}, {slots}, D], the kept K/V in the slots of kept.index")
    ctx.numbers += idx.size
    if np.any(idx[~real] != -1) or np.any(score[~real] != 0) or np.any(fk[~real] != 0) or np.any(fv[~real] != 0):
        ctx.fail(row, "kept.index: a head's slots after its count are not empty (index -1, zero K, V and score)")
        return
    w = pol.get("window", 0)
    for hh in range(h):
        got = idx[hh, : count[hh]]
        if np.any(np.diff(got) <= 0) or got.min() < 0 or got.max() >= n:
            ctx.fail(row, f"kept.index: head {hh}'s kept tokens are not distinct positions in arrival order within the "
                          "segment")
            return
        if sp[hh] == 0 and not np.array_equal(got, np.arange(n)):
            ctx.fail(row, f"kept set: dense head {hh} does not hold every token")
            return
        for name, x, stored in (("k", k, fk), ("v", v, fv)):
            if pol.get("dense") and sp[hh] == 0:  # a stored dense pair: its tokens are the dense.* arrays
                if np.any(stored[hh] != 0):
                    ctx.fail(row, f"float.{name}: stored dense head {hh} holds float32 K/V beside its dense.* arrays")
            elif stored[hh, : count[hh]].tobytes() != x[hh, got.astype(np.int64)].tobytes():
                ctx.fail(row, f"float.{name}: head {hh}'s kept K/V are not the recorded inputs at kept.index")
        if not np.all(np.isin(np.arange(P, n), got)):
            ctx.fail(row, "kept set: a prefill-mode selection keeps every token after the prefill")
        if w and not np.all(np.isin(np.arange(P - w, P), got)):
            ctx.fail(row, f"kept set: the newest {w} tokens are always kept")
    extra = sorted(x for x in a if x not in ("float.k", "float.v", "kept.index", "kept.score", "kept.count",
                                             "kept.sparse", "select.score", "input.k", "input.v", "input.q", "prefill.q",
                                             "rope.inv_freq", "oracle.q", "oracle.k")
                   and not (pol.get("dense") and x.startswith("dense.")))
    if extra:
        ctx.fail(row, f"a selective selection stores float K/V, indices, scores, per-head counts and classes only "
                      f"(and a stored dense class's dense.* arrays), found {extra}")
    d = k.shape[2]
    on = sp == 1
    dense = (int(count[~on].sum()) * 8 * d if not pol.get("dense")
             else _stored_dense(row, ctx, pol, a, k[~on], v[~on]))
    ctx.close(row, "evidence layer bytes", HEADER + h + int(count[on].sum()) * (8 * d + SCORED_EXTRA) + dense,
              policy_bytes(pol, n, {**model_dims(live, row), **ONE_FULL_LAYER}, sparse=int(sp.sum())))
    attention = pol["scorer"] in ATTENTION_SCORERS
    if pol["scorer"] not in AUDIT_SCORERS or (attention and pol["scorer"] == "h2o"):
        ctx.user_scorers.setdefault(row.get("study"), set()).add(f"{pol['scorer']} (prefill, selective)")
        return
    on = sp == 1
    if not on.any():
        return
    own = _own_scores(row, ctx, pol, live, a, layer)
    if own is not None:
        _check_kept(row, ctx, pol, live, own[0][on], idx[on][:, :held], score[on][:, :held], own[1], atol=own[2])


def _check_adaptive(row, ctx, pol: dict, live: dict, own: np.ndarray, idx: np.ndarray, score: np.ndarray,
                    count: np.ndarray, tol: float, atol: float) -> None:
    """An adaptive kept set against the audit's own scores ``own [H, n]``: the stored scores those of
    the kept keys; every token a head always keeps (the window, the scorer's own first ones) kept;
    each head's own top safeguard kept (no dropped token of the head above its safeguard-th kept
    score); and the rest the layer's top (no dropped token of any head above the lowest kept token
    beyond its head's safeguard) -- up to near ties (``tol`` relative, ``atol``)."""
    P = live["prefill"]
    h = own.shape[0]
    after = pol["scorer"] in ATTENTION_SCORERS  # a scorer of attention stores 0 after a prefill-only decision
    rank = own[:, :P].astype(np.float64)
    forced = np.zeros(P, dtype=bool)
    first, last = KEPT_FIRST.get(pol["scorer"], (0, 0))
    forced[:first] = True
    tail = max(last, pol.get("window", 0))  # the newest prefill tokens always kept
    if tail:
        forced[P - tail:] = True
    rank[:, forced] = np.inf
    safe = adaptive_safeguard(pol["keep"], pol["alpha"])
    kept = np.zeros((h, P), dtype=bool)
    beyond, dropped_max = [], -np.inf
    for hh in range(h):
        got = idx[hh, : count[hh]].astype(np.int64)
        ctx.numbers += got.size
        decided = got < (P if after else live["prefill"] + live["steps"])
        if not np.allclose(score[hh, : count[hh]][decided], own[hh, got[decided]], rtol=tol, atol=atol):
            ctx.fail(row, f"kept.score: head {hh}'s are not the {pol['scorer']} scores of the kept keys")
            return
        kept[hh, got[got < P]] = True
        if np.any(forced & ~kept[hh]):
            ctx.fail(row, f"kept set: head {hh} dropped a token {pol['scorer']} or the window always keeps")
            return
        mine = np.sort(rank[hh][kept[hh]])[::-1]
        if not (~kept[hh]).any():
            beyond.append(mine[safe:])
            continue
        hi = rank[hh][~kept[hh]].max()
        dropped_max = max(dropped_max, hi)
        lo = mine[safe - 1] if safe else np.inf
        if np.isfinite(lo) and hi > lo + tol * max(abs(lo), abs(hi)) + atol:
            ctx.fail(row, f"kept set: head {hh} dropped a token scored {hi!r} below its safeguard of {safe} (its "
                          f"{safe}th kept scores {lo!r})")
            return
        beyond.append(mine[safe:])
    rest = np.concatenate(beyond)
    rest = rest[np.isfinite(rest)]
    if rest.size and np.isfinite(dropped_max):
        lo, hi = float(rest.min()), float(dropped_max)
        if hi > lo + tol * max(abs(lo), abs(hi)) + atol:
            ctx.fail(row, f"kept set: a head dropped a token scored {hi!r} while the layer kept one scored {lo!r} beyond "
                          f"its head's safeguard ({pol['scorer']}, adaptive: the rest are the layer's top "
                          f"{h} x {pol['keep']} - {h} x {safe})")


def _own_scores(row, ctx, pol: dict, live: dict, a: dict, layer):
    """The audit's own scores ``[H, n]`` of a built-in scorer it re-derives (float32 of the recorded
    keys, or float64 of the recorded prefill queries) and the (rtol, atol) to compare them at; None
    after a failure that leaves nothing to compare."""
    k, v = a["input.k"], a["input.v"]
    attention = pol["scorer"] in ATTENTION_SCORERS
    if attention:  # a prefill decision from the recorded last queries over the prefill's keys
        q = a.get("prefill.q")
        P = live["prefill"]
        w = ATTENTION_SCORERS[pol["scorer"]] or P
        if q is None or q.ndim != 3 or q.shape[1] != w or q.shape[2] != k.shape[2] or q.shape[0] % k.shape[0]:
            raise ValueError(f"prefill.q: {pol['scorer']} decides from the prefill's last {w} queries [H_q, {w}, D], got "
                             f"{None if q is None else list(q.shape)}")
        own = np.zeros(k.shape[:2], dtype=np.float32)
        if pol["scorer"] == "expected_attention":
            inv = a.get("rope.inv_freq")
            if inv is None or inv.shape != (k.shape[2] // 2,) or inv.dtype != np.float32:
                raise ValueError(f"rope.inv_freq: expected_attention's evidence needs the float32 [{k.shape[2] // 2}] "
                                 "rotary frequencies its queries were rotated back with")
            if not _rope_schedule(inv):
                ctx.fail(row, "rope.inv_freq: not a rotary schedule (positive, each a constant ratio below the one "
                              "before: theta^(-2i/D), optionally divided by a linear factor)")
                return None
            own[:, :P] = _expected_attention(q, k[:, :P], v[:, :P], inv)
        else:
            own[:, :P] = _attention_scores(pol["scorer"], q, k[:, :P])
        return own, TOLERANCES["score_attention"]["rtol"], TOLERANCES["score_attention"]["atol"]
    return _scores(pol, k, int(layer)), TOLERANCES["score_near_tie"]["rtol"], 0.0


def _attention_scores(scorer: str, q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """[H_kv, P] the audit's own float64 scores of a prefill decision: ``q [H_q, w, D]`` the prefill's
    last w queries, ``k [H_kv, P, D]`` its keys, scale D^-1/2. snapkv: the window's mean causal softmax
    over the keys before the window, averaged over 5 neighbours (zero padding counted), over the KV
    head's query heads; the window itself the head's largest plus one. tova: the last query's
    softmax averaged over every query head, the same for each KV head; the last token the largest
    plus one."""
    hq, w, d = q.shape
    hkv, P = k.shape[:2]
    g = hq // hkv
    s = np.einsum("hqd,hkd->hqk", q.astype(np.float64), np.repeat(k.astype(np.float64), g, axis=0)) / math.sqrt(d)
    qpos = np.arange(P - w, P)
    s = np.where(np.arange(P)[None, None, :] > qpos[None, :, None], -np.inf, s)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    prob = s / s.sum(axis=-1, keepdims=True)  # [H_q, w, P]
    if scorer == "tova":
        mean = prob[:, -1, : P - 1].mean(axis=0)
        out = np.broadcast_to(mean, (hkv, P - 1))
        return np.concatenate([out, out.max(axis=-1, keepdims=True) + 1], axis=1)
    m = prob[:, :, : P - w].mean(axis=1)  # [H_q, P - w]
    padded = np.pad(m, ((0, 0), (SNAPKV_KERNEL // 2, SNAPKV_KERNEL // 2)))
    pooled = sum(padded[:, i:i + P - w] for i in range(SNAPKV_KERNEL)) / SNAPKV_KERNEL
    per_kv = pooled.reshape(hkv, g, P - w).mean(axis=1)
    return np.concatenate([per_kv, np.repeat(per_kv.max(axis=-1, keepdims=True) + 1, w, axis=1)], axis=1)


def _rope_schedule(inv: np.ndarray) -> bool:
    """``inv`` is a default RoPE schedule theta^(-2i/D) (or one divided by a linear factor): positive,
    and its log a straight line in i, within float32 rounding."""
    if inv.size < 2 or not np.all(np.isfinite(inv)) or np.any(inv <= 0):
        return False
    lg = np.log(inv.astype(np.float64))
    step = np.diff(lg)
    return bool(np.all(step < 0) and np.allclose(step, step.mean(), rtol=0, atol=TOLERANCES["rope_schedule"]["atol"]))


def rotate_half(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def _angles(pos: np.ndarray, inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [T, D] float64 of float32 angles (positions times frequencies in float32, as the
    model forms them), over both halves."""
    ang = pos.astype(np.float32)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=1)
    return np.cos(ang).astype(np.float64), np.sin(ang).astype(np.float64)


def _expected_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """[H_kv, P] the audit's own float64 expected attention (Devoto et al., 2025, kvpress's
    ExpectedAttentionPress defaults): the prefill's queries ``q [H_q, P, D]`` rotated back to before
    RoPE with ``inv``; their mean and covariance from position EA_SINK on; both carried by the mean
    rotation over the EA_FUTURE positions after the prefill; per query head the softmax over the keys
    after the sink of s k.mu + s^2/2 k^T S k (s = D^-1/2), averaged over the KV head's query heads,
    times each value's norm; the sink the head's largest plus one."""
    hq, P, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    cos, sin = _angles(np.arange(P), inv)
    x = q.astype(np.float64)
    pre = (x * cos - rotate_half(x) * sin)[:, EA_SINK:]
    mu = pre.mean(axis=1)
    c = pre - mu[:, None]
    cov = np.einsum("hti,htj->hij", c, c) / pre.shape[1]
    fc, fs = _angles(np.arange(P, P + EA_FUTURE), inv)
    turn = np.zeros((d, d))
    turn[: d // 2, d // 2:] = -np.eye(d // 2)
    turn[d // 2:, : d // 2] = np.eye(d // 2)
    rot = np.diag(fc.mean(axis=0)) + fs.mean(axis=0)[:, None] * turn
    mu = mu @ rot.T
    cov = rot @ cov @ rot.T
    s = 1.0 / math.sqrt(d)
    kk = np.repeat(k[:, EA_SINK:].astype(np.float64), g, axis=0)
    logit = s * np.einsum("hkd,hd->hk", kk, mu) + 0.5 * s * s * np.einsum("hkd,hde,hke->hk", kk, cov, kk)
    p = np.exp(logit - logit.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    per_kv = p.reshape(hkv, g, P - EA_SINK).mean(axis=1) * np.linalg.norm(v[:, EA_SINK:].astype(np.float64), axis=-1)
    return np.concatenate([np.repeat(per_kv.max(axis=-1, keepdims=True) + 1, EA_SINK, axis=1), per_kv], axis=1)


def _check_kept(row, ctx, pol: dict, live: dict, own: np.ndarray, idx: np.ndarray, score: np.ndarray, tol: float,
                atol: float = 0.0) -> None:
    """The stored scores of the prefill-or-online choice against the audit's own, and every kept
    eligible token scored at least as high as every dropped one, up to a near tie."""
    n = live["prefill"] + live["steps"]
    kept_own = np.take_along_axis(own, idx.astype(np.int64), axis=1)
    ctx.numbers += score.size
    # a scorer of attention stores 0 for the tokens after a prefill-only decision; a static one scores every token
    after = pol["scorer_mode"] == "prefill" and pol["scorer"] in ATTENTION_SCORERS
    decided = idx < (live["prefill"] if after else n)
    if not np.allclose(score[decided], kept_own[decided], rtol=tol, atol=atol):
        ctx.fail(row, f"kept.score: not the {pol['scorer']} scores of the kept keys")
    eligible = np.ones(own.shape, dtype=bool)
    # the newest window tokens at the last decision are kept whatever their score: the prefill's, or all n
    last = live["prefill"] if pol["scorer_mode"] == "prefill" else n
    w = pol.get("window", 0)
    if w:  # kept whatever their score (checked in scored_evidence)
        eligible[:, last - w:last] = False
    if pol["scorer_mode"] == "prefill":
        eligible[:, live["prefill"]:] = False  # every token after the prefill is kept
        if not all(np.all(np.isin(np.arange(live["prefill"], n), idx[hh])) for hh in range(idx.shape[0])):
            ctx.fail(row, "kept set: a prefill-mode selection keeps every token after the prefill")
    dropped = eligible.copy()
    np.put_along_axis(dropped, idx.astype(np.int64), False, axis=1)
    kept_eligible = ~dropped & eligible
    for hh in range(own.shape[0]):
        if dropped[hh].any() and kept_eligible[hh].any():
            lo, hi = own[hh][kept_eligible[hh]].min(), own[hh][dropped[hh]].max()
            if hi > lo + tol * max(abs(float(lo)), abs(float(hi))) + atol:
                ctx.fail(row, f"kept set: head {hh} dropped a token scored {hi!r} and kept one scored {lo!r} "
                              f"({pol['scorer']}: the kept ones are the top {pol['keep']})")
                return
