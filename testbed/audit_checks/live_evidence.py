"""The audit of a live policy's evidence layer (numpy only; no model, no testbed.policies).

For the one evidence layer of the first segment (``check_evidence``): the packed middle re-encoded
from the recorded float32 K/V with the audit's integer and MX encoders (``schemes.encode_tensor``),
byte for byte, the float32 sink and window equal to the inputs, and no other stored array; an
evicting policy's first S and newest W; a sink chosen from attention (``sink_scores``, recomputed in
float64 from the recorded prefill queries and keys); a per-head precision layer's bits and scores
(``concentration``) with each head re-encoded at its own bits; heavy hitters (the held tokens' K/V,
their scores' bounds, the oracle's choice from the oracle pass, ``accumulated``); keys stored before
the rotary embedding (``rope_rotate``). A scored selection's layer is ``live_scored``'s.
"""

from __future__ import annotations

import math

import numpy as np

from .calibration import calibrated_parts, layer_tables
from .common import TOLERANCES
from .live_policies import HEADER, ONE_FULL_LAYER, middle_config, model_dims, packed_payload, policy_bytes, spans
from .live_scored import rotate_half, scored_evidence
from .schemes import encode_tensor, payload_differences

__all__ = ["check_evidence", "sink_scores", "causal_softmax_tiles", "concentration", "rope_rotate", "accumulated"]


def sink_scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``[H_kv, t]`` in float64: each prefill key's mean share of attention over the causal queries
    that see it and the KV head's query heads (``q [H_q, t, D]``, ``k [H_kv, t, D]``, scale D^-1/2)."""
    hq, t, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    q64 = q.astype(np.float64).reshape(hkv, g, t, d)
    k64 = k.astype(np.float64)
    s = np.einsum("hgqd,hkd->hgqk", q64, k64) / math.sqrt(d)
    s = np.where(np.arange(t)[None, :] > np.arange(t)[:, None], -np.inf, s)
    s = s - s.max(axis=-1, keepdims=True)
    w = np.exp(s)
    w /= w.sum(axis=-1, keepdims=True)
    return w.sum(axis=(1, 2)) / ((t - np.arange(t)) * g)


def _chosen_sink(row, ctx, pol: dict, live: dict, a: dict):
    """The sink a ``"mass"`` policy chose at the prefill, checked: ``[H, S]`` token indices."""
    P, S = live["prefill"], pol["sink"]
    c = min(P, max(S, P - pol["window"]))
    q, score, index = a.get("input.q"), a.get("sink.score"), a.get("sink.index")
    x = a["input.k"]
    h = x.shape[0]
    if q is None or score is None or index is None:
        raise ValueError("a sink chosen from attention needs input.q, sink.score and sink.index in its evidence")
    if q.ndim != 3 or q.shape[1] != P or q.shape[0] % h or score.shape != (h, c) or index.shape != (h, min(S, P)):
        raise ValueError(f"input.q {list(q.shape)}, sink.score {list(score.shape)}, sink.index {list(index.shape)} "
                         f"do not fit a prefill of {P}, {c} candidates, sink {S}, {h} KV heads")
    if not (np.all(np.isfinite(q)) and np.all(np.isfinite(score))):
        raise ValueError("input.q and sink.score must be finite")
    mine = sink_scores(q, x[:, :P])[:, :c]
    tol = TOLERANCES["float32_softmax"]
    ctx.numbers += mine.size
    bad = ~(np.abs(score.astype(np.float64) - mine) <= tol["atol"] + tol["rtol"] * np.abs(mine))
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        ctx.fail(row, f"sink.score differs at {i}: stored {float(score[i]):.8g}, the audit's float64 share {mine[i]:.8g}")
    want = np.sort(np.argsort(-score.astype(np.float64), axis=-1, kind="stable")[:, :min(S, P)], axis=-1)
    ctx.numbers += want.size
    if not np.array_equal(index.astype(np.int64), want):
        ctx.fail(row, "sink.index is not the top-S of sink.score (ties to the lower index) in ascending order")
    return want


def causal_softmax_tiles(q: np.ndarray, k: np.ndarray, tile: int = 256):
    """The float64 causal softmax of a pass of ``q [H_q, n, D]`` over ``k [H_kv, n, D]`` (query i
    sees keys 0..i), over tiles of queries: yields ``(a, b, w)``, ``w [H_kv, G, b - a, n]`` the rows
    of queries ``a..b-1`` grouped by KV head (the audit's own statement)."""
    hq, n, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    kk = k.astype(np.float64)
    for a in range(0, n, tile):
        b = min(n, a + tile)
        s = np.einsum("hgqd,hkd->hgqk", q[:, a:b].astype(np.float64).reshape(hkv, g, b - a, d), kk) / math.sqrt(d)
        s = np.where(np.arange(n)[None, :] > np.arange(a, b)[:, None], -np.inf, s)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        yield a, b, w / w.sum(axis=-1, keepdims=True)


def concentration(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``[H_kv]`` float64: the mean effective support (exp(entropy) / visible keys) of a causal
    pass's rows over its queries and the KV head's query heads (``q [H_q, t, D]``, ``k [H_kv, t, D]``)."""
    hkv, g, t = k.shape[0], q.shape[0] // k.shape[0], q.shape[1]
    total = np.zeros(hkv)
    for a, b, w in causal_softmax_tiles(q, k):
        plogp = np.where(w > 0, w * np.log(np.where(w > 0, w, 1.0)), 0.0)
        total += (np.exp(-plogp.sum(axis=-1)) / (np.arange(a, b) + 1)).sum(axis=(1, 2))
    return total / (g * t)


def check_evidence(row, ctx, pol: dict, live: dict) -> None:
    ev = row.get("evidence")
    if not isinstance(ev, dict) or not isinstance(ev.get("arrays"), dict):
        raise ValueError("quantized policy row of the first batch has no evidence arrays")
    if ev.get("layer") != live.get("evidence_layer", 0):
        ctx.fail(row, f"evidence layer {ev.get('layer')!r} is not the protocol's {live.get('evidence_layer', 0)}")
    a = {k: ctx.load(v) for k, v in ev["arrays"].items()}
    n = live["prefill"] + live["steps"]
    if pol.get("scorer"):
        if pol.get("layer_keep"):  # a pyramid: the evidence layer holds its own count, re-derived above
            layer = ev.get("layer")
            if not isinstance(layer, int) or not 0 <= layer < len(pol["layer_keep"]):
                raise ValueError(f"evidence layer {layer!r}: the pyramid has layers 0..{len(pol['layer_keep']) - 1}")
            pol = {**pol, "keep": pol["layer_keep"][layer], "layer_keep": None}
        if pol.get("heads") == "selective":
            _selective_score(row, ctx, pol, live, a, ev.get("layer"))
        scored_evidence(row, ctx, pol, live, a, ev.get("layer"))
        return
    s, p, f = spans(pol, n)
    if pol.get("key_rope") == "pre":  # the stored keys are input.k_pre, which the recorded rotation makes input.k
        a["input.k"] = _pre_rope_keys(row, ctx, a, n)
    if pol["middle"] == "drop":  # what an evicting cache kept: the first S and the newest W inputs
        for name in ("k", "v"):
            x = a[f"input.{name}"]
            for label, want in (("sink", x[:, :s]), ("float", x[:, n - f:])):
                got = a.get(f"{label}.{name}")
                ctx.numbers += 1
                if got is None or got.shape != want.shape or got.tobytes() != want.tobytes():
                    ctx.fail(row, f"{label}.{name}: the kept tokens are not the inputs' first {s} / newest {f}")
        extra = sorted(k for k in a if not k.startswith(("input.", "sink.", "float.")))
        if extra:
            ctx.fail(row, f"an evicting cache stores no packed arrays, found {extra}")
        total = sum(int(v.nbytes) for k, v in a.items() if not k.startswith("input."))
        ctx.close(row, "evidence layer bytes", total + HEADER, policy_bytes(pol, n, {**model_dims(live, row), **ONE_FULL_LAYER}))
        return
    want = {}
    tables = 0  # a calibrated codebook: the middle re-encoded with the row's stored table of this layer
    enc = pol
    if calibrated_parts(pol):
        enc, tables = layer_tables(row, ctx, pol, ev.get("layer"))
    chosen = _chosen_sink(row, ctx, pol, live, a) if pol["sink_select"] == "mass" else None
    layer_bits = None
    if pol.get("low"):
        layer_bits = _mixed_evidence(row, ctx, pol, live, a, ev.get("layer"))
    if pol.get("heavy"):
        want.update(_heavy_evidence(row, ctx, pol, live, a, ev.get("layer"), p))
    for name, label in (("k", "key"), ("v", "value")):
        x = a[f"input.{name}"]
        if x.dtype != np.float32 or x.ndim != 3 or x.shape[1] != n:
            raise ValueError(f"input.{name} is {x.dtype} {list(x.shape)}, expected float32 [H, {n}, D]")
        if chosen is not None:  # the chosen tokens, then every other token in order, per head
            rest = np.ones(x.shape[:2], dtype=bool)
            np.put_along_axis(rest, chosen, False, axis=1)
            sink_part = np.take_along_axis(x, chosen[..., None], axis=1)
            x = np.concatenate([sink_part, x[rest].reshape(x.shape[0], n - chosen.shape[1], x.shape[2])], axis=1)
        want[f"sink.{name}"], want[f"float.{name}"] = x[:, :s], x[:, s + p:]
        if p and layer_bits is None:
            want.update({f"{label}.{arr}": w for arr, w in packed_payload(x[:, s:s + p], enc, name).items()})
        elif p:  # each head at its own stored bits, the heads of one width together in head order
            for scheme in sorted({pol["low"], pol["middle"]}):
                heads = np.flatnonzero(layer_bits == int(scheme[3:]))
                if heads.size:
                    cfg = middle_config({**pol, "middle": scheme}, name)
                    want.update({f"{scheme}.{label}.{arr}": w for arr, w in encode_tensor(x[heads, s:s + p], cfg).items()
                                 if arr != "header"})
    if layer_bits is not None:
        want["alloc.bits"] = layer_bits
    stored = {k: v for k, v in a.items() if not k.startswith(("input.", "oracle."))
              and k not in ("sink.index", "sink.score", "alloc.score")}
    if pol.get("heavy"):  # the heavy hitters' bytes are counted below with every held index, whole
        held = a.get("hh.index")
        held = None if held is None else int(held.shape[-1])
    ctx.numbers += len(want)
    for line in payload_differences(stored, want, f"the recorded float32 inputs (packed tokens [{s}, {s + p}))"):
        ctx.fail(row, line)
    # the chosen sink's indices and scores are the audit's evidence, not the cache's bytes: attention
    # needs no positions of held keys (post-RoPE, all in the past)
    total = sum(int(v.nbytes) for k, v in stored.items()) + tables
    one = {**model_dims(live, row), **ONE_FULL_LAYER}
    low_here = None if layer_bits is None else int((layer_bits == int(pol["low"][3:])).sum())
    held = held if pol.get("heavy") else None
    ctx.close(row, "evidence layer bytes", total + HEADER, policy_bytes(pol, n, one, low_here, held))


def rope_rotate(k: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``k [H, n, D]`` rotated by the rotary embedding ``cos``, ``sin`` ``[n, D]`` in float64: each channel
    pair (i, i + D/2) by the angle whose cosine and sine are ``cos[:, i]``, ``sin[:, i]`` (RoPE's
    rotate-half layout: ``k cos + rotate_half(k) sin``, with ``rotate_half(x) = (-x2, x1)``)."""
    k = k.astype(np.float64)
    return k * cos.astype(np.float64)[None] + rotate_half(k) * sin.astype(np.float64)[None]


def _pre_rope_keys(row, ctx, a: dict, n: int) -> np.ndarray:
    """A pre-RoPE cache's evidence: ``input.k_pre`` (the keys as the layer stores them, ``[H, n, D]``)
    rotated by the recorded ``input.rope_cos`` / ``input.rope_sin`` (``[n, D]``, rotate-half layout:
    both halves equal) gives the recorded post-RoPE ``input.k`` within ``rope_roundtrip``. Returns
    ``input.k_pre``, which every stored key is then checked against."""
    pre, cos, sin, post = (a.get(k) for k in ("input.k_pre", "input.rope_cos", "input.rope_sin", "input.k"))
    if pre is None or cos is None or sin is None:
        raise ValueError("a pre-RoPE policy's evidence needs input.k_pre, input.rope_cos and input.rope_sin")
    if pre.dtype != np.float32 or post is None or pre.shape != post.shape or pre.shape[1] != n:
        raise ValueError(f"input.k_pre is {pre.dtype} {list(pre.shape)}, expected float32 like input.k "
                         f"{None if post is None else list(post.shape)}")
    d = pre.shape[-1]
    if cos.shape != (n, d) or sin.shape != (n, d) or d % 2:
        raise ValueError(f"input.rope_cos / input.rope_sin are {list(cos.shape)} / {list(sin.shape)}, expected [{n}, {d}]")
    h = d // 2
    ctx.numbers += 2
    if not (np.array_equal(cos[:, :h], cos[:, h:]) and np.array_equal(sin[:, :h], sin[:, h:])):
        ctx.fail(row, "input.rope_cos / input.rope_sin are not a rotate-half rotary embedding (halves differ)")
    tol = TOLERANCES["rope_roundtrip"]
    got = rope_rotate(pre, cos, sin)
    if not np.allclose(got, post.astype(np.float64), rtol=tol["rtol"], atol=tol["atol"]):
        worst = float(np.max(np.abs(got - post.astype(np.float64))))
        ctx.fail(row, f"input.k_pre rotated by the recorded cos / sin is not input.k (max |diff| {worst:.3g}): the "
                      "stored keys are not the pre-RoPE keys of the inputs")
    return pre


def _heavy_evidence(row, ctx, pol: dict, live: dict, a: dict, layer, p: int) -> dict:
    """The evidence layer of a heavy-hitter row: ``hh.index`` is the row's ``hh_index[layer]``, and
    ``hh.k`` / ``hh.v`` are the recorded float32 inputs at those tokens, exactly. The scores
    (``hh.score``, ``float.score``) rest on attention the audit did not see; they are checked for
    form and bound only: finite, >= 0, and at most what every query head of the KV group that saw the
    token could give (one per query). Returns the arrays the stored payload must hold."""
    index = ctx.load(row.get("arrays", {}).get("hh_index"))
    if not isinstance(layer, int) or not 0 <= layer < index.shape[0]:
        raise ValueError(f"evidence layer {layer!r} is outside hh_index {list(index.shape)}")
    n = live["prefill"] + live["steps"]
    mine = index[layer]
    x_k, x_v = a["input.k"], a["input.v"]
    h, c = mine.shape
    ok = mine.size == 0 or (mine.min() >= 0 and mine.max() < p)
    at = np.clip(mine.astype(np.int64), 0, max(0, n - 1))[..., None]
    want = {"hh.index": mine, "hh.k": np.take_along_axis(x_k, at, axis=1) if ok else x_k[:, :0],
            "hh.v": np.take_along_axis(x_v, at, axis=1) if ok else x_v[:, :0]}
    s, _, f = spans(pol, n)
    q = model_dims(live, row).get("heads")  # query heads: a model given by path may not state them
    for name, shape, pos in (("hh.score", (h, c), mine.astype(np.int64)),
                             ("float.score", (h, f), np.broadcast_to(np.arange(n - f, n), (h, f)))):
        got = a.get(name)
        if got is None or got.dtype != np.float32 or got.shape != shape:
            ctx.fail(row, f"{name} must be float32 {list(shape)}, got "
                          f"{None if got is None else (got.dtype, list(got.shape))}")
            continue
        want[name] = got
        ctx.numbers += got.size
        if not np.all(np.isfinite(got)) or np.any(got < 0):
            ctx.fail(row, f"{name} holds a negative or non-finite accumulated attention")
        elif q and np.any(got.astype(np.float64) > (q // h) * (n - pos) * (1 + 1e-5)):
            ctx.fail(row, f"{name} exceeds what the queries that saw a token could give it (one per query)")
    if pol.get("heavy_rule") == "oracle" and ok:
        _check_oracle_choice(row, ctx, a, mine, n, p, layer)
    return want


def accumulated(q: np.ndarray, k: np.ndarray, tile: int = 256) -> np.ndarray:
    """``[H_kv, n]`` float64: the attention each key received in a causal pass of ``q [H_q, n, D]``
    over ``k [H_kv, n, D]``, summed over the queries and the KV head's query heads (H2O's score,
    the audit's own statement), over tiles of queries."""
    out = np.zeros((k.shape[0], k.shape[1]))
    for _, _, w in causal_softmax_tiles(q, k, tile):
        out += w.sum(axis=(1, 2))
    return out


def _check_oracle_choice(row, ctx, a: dict, held: np.ndarray, n: int, p: int, layer: int) -> None:
    """The heavy-hitter oracle's held tokens at the evidence layer are the top C of the packed
    tokens by the whole segment's accumulated attention, recomputed from the oracle pass's queries
    (``input.q`` then ``oracle.q``) and keys (``oracle.k``): no token left out scored more than one
    held (within the float32-softmax tolerance, for near ties)."""
    q0, later, k = a.get("input.q"), a.get("oracle.q"), a.get("oracle.k")
    if any(x is None or x.ndim != 3 for x in (q0, later, k)):
        raise ValueError("a heavy-hitter oracle's evidence needs the oracle pass's queries and keys (input.q, "
                         "oracle.q, oracle.k)")
    qq = np.concatenate([q0, later], axis=1)
    if qq.shape[1] != n or k.shape[1] != n or qq.shape[0] % k.shape[0]:
        raise ValueError(f"the oracle pass's queries {list(qq.shape)} and keys {list(k.shape)} are not the segment's "
                         f"{n} tokens")
    score = accumulated(qq, k)[:, :p]
    tol = TOLERANCES["float32_softmax"]
    for h in range(held.shape[0]):
        ctx.numbers += 1
        mask = np.zeros(p, dtype=bool)
        mask[held[h].astype(np.int64)] = True
        if mask.all() or not mask.any():
            continue
        lo, hi = score[h, mask].min(), score[h, ~mask].max()
        if hi > lo + tol["atol"] + tol["rtol"] * abs(lo):
            out = int(np.flatnonzero(~mask)[np.argmax(score[h, ~mask])])
            ctx.fail(row, f"layer {layer}, KV head {h}: packed token {out} received {hi:.6g} over the segment but is not "
                          f"held, while a held one received {lo:.6g} (the oracle keeps the top {held.shape[1]})")


def _mixed_evidence(row, ctx, pol: dict, live: dict, a: dict, layer) -> np.ndarray:
    """The evidence layer of a mixed row: its bits and scores are the row's, the scores recomputed
    from the recorded queries and keys; returns the layer's bits ``[H]``."""
    arrays = row.get("arrays", {})
    bits, score = ctx.load(arrays.get("alloc_bits")), ctx.load(arrays.get("alloc_score"))
    if not isinstance(layer, int) or not 0 <= layer < bits.shape[0]:
        raise ValueError(f"evidence layer {layer!r} is outside alloc_bits {list(bits.shape)}")
    _layer_of(row, ctx, a, "alloc.bits", bits, "alloc_bits", layer)
    _layer_of(row, ctx, a, "alloc.score", score, "alloc_score", layer)
    if pol["alloc"] in ("concentrated", "diffuse"):
        _check_concentration(row, ctx, pol, live, a, score, layer, "alloc_score", "allocation")
    return bits[layer]


def _layer_of(row, ctx, a: dict, key: str, full: np.ndarray, name: str, layer: int) -> None:
    """The evidence layer's ``key`` is the row's per-pair array ``name`` at the layer, dtype and values."""
    got = a.get(key)
    ctx.numbers += 1
    if got is None or got.dtype != full.dtype or not np.array_equal(got, full[layer]):
        ctx.fail(row, f"the evidence layer's {key} is not {name}[{layer}]")


def _check_concentration(row, ctx, pol: dict, live: dict, a: dict, score, layer: int, name: str, what: str) -> None:
    """The stored per-head concentration ``score[layer]`` (the row's ``name``) against the audit's own
    float64 concentration of the recorded queries and keys (the prefill's: ``input.q``, ``input.k``; the
    oracle's: ``input.q`` then ``oracle.q`` over ``oracle.k``), within float32 softmax rounding."""
    P, n = live["prefill"], live["prefill"] + live["steps"]
    q, k, t = a.get("input.q"), a.get("input.k"), P
    if pol["alloc_from"] == "oracle":  # the oracle pass: the prefill's queries, then the later ones, its own keys
        later, k, t = a.get("oracle.q"), a.get("oracle.k"), n
        q = None if q is None or later is None or q.ndim != 3 or later.ndim != 3 else np.concatenate([q, later], axis=1)
    if q is None or k is None or q.ndim != 3 or q.shape[1] != t or k.shape[1] < t or q.shape[0] % k.shape[0]:
        raise ValueError(f"a {pol['alloc_from']} {what}'s evidence needs queries and keys of {t} tokens")
    mine = concentration(q, k[:, :t])
    tol = TOLERANCES["float32_softmax"]
    ctx.numbers += mine.size
    bad = ~(np.abs(score[layer] - mine) <= tol["atol"] + tol["rtol"] * np.abs(mine))
    if bad.any():
        h = int(np.flatnonzero(bad)[0])
        ctx.fail(row, f"{name}[{layer}, {h}] = {score[layer, h]:.8g}; the audit's float64 concentration from the "
                      f"recorded queries and keys is {mine[h]:.8g}")


def _selective_score(row, ctx, pol: dict, live: dict, a: dict, layer) -> None:
    """The evidence layer of a selective row: its ``select.score`` is the row's ``select_score`` at the
    layer and, for a rule that reads attention, the audit's own float64 concentration of the recorded
    queries and keys (the prefill's: ``input.q``, ``input.k``; the oracle's: ``input.q`` then ``oracle.q``
    over ``oracle.k``), within float32 softmax rounding."""
    score = ctx.load(row.get("arrays", {}).get("select_score"))
    if not isinstance(layer, int) or score.ndim != 2 or not 0 <= layer < score.shape[0]:
        raise ValueError(f"evidence layer {layer!r} is outside select_score {list(score.shape)}")
    _layer_of(row, ctx, a, "select.score", score, "select_score", layer)
    if pol["alloc"] in ("concentrated", "diffuse"):
        _check_concentration(row, ctx, pol, live, a, score, layer, "select_score", "selective rule")
