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
  float32 K/V with the audit's integer and MX encoders (``common.encode_tensor``), byte for byte,
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
"""

from __future__ import annotations

import hashlib
import math
import re

import numpy as np

from .capture import MODELS  # the audit's one table of known models (layers, KV heads, head dim, layer types)
from .common import HEADER_BYTES, MX_BLOCK_SIZE, TOLERANCES, encode_tensor, payload_differences

__all__ = ["check", "MODELS", "POLICY_TABLE", "declared_policy", "policy_names", "policy_of", "check_study"]

# Known models' cache dimensions (the audit's own table; a live row of any other model fails).
# the audit's own table of the models it knows; a model given by path carries its dimensions in
# its rows (``model_dims``), and its byte accounting is then self-consistent only
# name -> (middle, sink from protocol?, window key, key axis[, sink selection]): the audit's own
# statement of the presets
POLICY_TABLE = {
    "float32": ("float32", False, None, "channel"),
    "int4": ("int4", False, "window", "channel"),
    "int2": ("int2", False, "window", "channel"),
    "int3": ("int3", False, "window", "channel"),
    "int4_sink4": ("int4", True, "window", "channel"),
    "int2_sink4": ("int2", True, "window", "channel"),
    "int4_sinkmass4": ("int4", True, "window", "channel", "mass"),
    "int2_sinkmass4": ("int2", True, "window", "channel", "mass"),
    "int2_ktoken": ("int2", False, "window", "token"),
    "mxfp8": ("mxfp8", False, "window", "channel"),
    "mxfp4": ("mxfp4", False, "window", "channel"),
    "streaming": ("drop", True, "evict_window", "channel"),
    "window_only": ("drop", False, "evict_window", "channel"),
}
# per-head precision presets: budget -> (high scheme, low scheme, share of pairs low); rule ->
# (alloc, alloc_from)
MIXED_BUDGETS = {"mix24": ("int4", "int2", 0.5), "mix28": ("int8", "int2", 2 / 3)}
MIXED_RULES = {"concentrated": ("concentrated", "prefill"), "diffuse": ("diffuse", "prefill"), "late": ("late", "prefill"),
               "random": ("random", "prefill"), "oracle_concentrated": ("concentrated", "oracle"),
               "oracle_diffuse": ("diffuse", "oracle")}
MIXED = {f"{b}_{r}": (high, low, share, alloc, source) for b, (high, low, share) in MIXED_BUDGETS.items()
         for r, (alloc, source) in MIXED_RULES.items()}
POLICY_TABLE.update({name: (high, False, "window", "channel") for name, (high, *_) in MIXED.items()})
# heavy-hitter presets: name -> middle; window R - G (at least 1) and a heavy-hitter count C per
# (layer, KV head) that int2's bytes at window R pay for (heavy_count, the audit's own statement)
HEAVY = {"int2_hh": ("int2", "attention"), "int2_hh_first": ("int2", "first"), "int2_hh_oracle": ("int2", "oracle")}
POLICY_TABLE.update({name: (middle, False, "window", "channel") for name, (middle, _) in HEAVY.items()})
# equal-bytes budgets (arms: the name itself or name_*) and the arms of the same bytes each is compared
# with, the first the run has (the study's pairing, docs: mix28_* the bytes of int4 against int4,
# mix24_* a 3-bit layout's bytes against int3, else mix24_random; int2_hh* int2's bytes against int2)
BUDGET_VERSUS = (("mix28", ("int4",)), ("mix24", ("int3", "mix24_random")), ("int2_hh", ("int2",)))


def budget_of(arm: str) -> str | None:
    """The equal-bytes budget an arm belongs to, else None."""
    return next((b for b, _ in BUDGET_VERSUS if arm == b or arm.startswith(b + "_")), None)


def versus_of(budget: str, arms) -> str | None:
    """The arm of ``budget``'s bytes the run has (the first of its candidates), else None."""
    return next((a for a in dict(BUDGET_VERSUS)[budget] if a in arms), None)
MIXED_FIELDS = ("low", "low_share", "alloc", "alloc_from")
HEADER = HEADER_BYTES
KL_FLOOR = -TOLERANCES["kl_floor"]["atol"]
LOG_HALF = math.log(0.5)


# a policy declared by its fields in the protocol (name, selection, storage, description): the audit's
# own statement of the mapping onto the fields above (testbed.policies.compose states the run's): an
# "all" selection keeps every token (sink S first or chosen by mass, heavy hitters), its storage the
# middle scheme, float32 window R (default: the protocol's window), groups (default: the protocol's
# group); a "sink_window" selection keeps the first S and newest W (default: the protocol's
# evict_window) float32 and drops the middle
DECLARED_SELECTION = {"kind": "all", "sink": 0, "sink_select": "first", "window": None, "heavy": 0,
                      "heavy_rule": "attention", "keep": 0, "mode": "online", "seed": 0, "layers": "uniform",
                      "beta": 20, "heads": "uniform", "alpha": 0.2}
# scored selections: the scorers whose choice the audit re-derives from the stored keys (its own
# definitions, _scores); a user's scorer ("file.py:Class") is checked self-consistently only
AUDIT_SCORERS = ("knorm", "random", "snapkv", "tova", "h2o", "expected_attention")
# scorers of attention whose prefill decision the audit re-derives from the recorded queries (the
# last SNAPKV_WINDOW, the last one, or every one: None); online, or h2o's (every query), it checks
# the kept set self-consistently
ATTENTION_SCORERS = {"snapkv": 64, "tova": 1, "h2o": 0, "expected_attention": None}
SNAPKV_WINDOW, SNAPKV_KERNEL = 64, 5
# expected_attention: the first EA_SINK tokens left out of the query statistics and kept first; the
# future queries modelled over the EA_FUTURE positions after the prefill (kvpress's defaults)
EA_SINK, EA_FUTURE = 4, 512
USER_SCORER = re.compile(r"^[^:]+\.py:[A-Za-z_][A-Za-z0-9_]*$")
SCORED_EXTRA = 8  # per kept token and KV head: int32 index, float32 score
# the prefill's (first, last) tokens a built-in scorer always keeps; an adaptive selection (Ada-KV,
# whose heads compete) ranks them above every score, as kvpress scores them above the whole layer's
KEPT_FIRST = {"snapkv": (0, SNAPKV_WINDOW), "tova": (0, 1), "expected_attention": (EA_SINK, 0)}


def adaptive_safeguard(keep: int, alpha: float) -> int:
    """The audit's own statement of kvpress 0.5.5's AdaKVPress safeguard: each KV head keeps its own
    top int(keep * alpha) tokens first (Python's float product, truncated), at least 1 when alpha > 0."""
    n = int(keep * alpha)
    return max(1, n) if alpha > 0 and keep > 0 else n


def pyramid(mean: int, P: int, layers: int, beta: int, w: int) -> list:
    """The audit's own statement of PyramidKV's per-layer kept prefill tokens (Cai et al., 2024;
    kvpress's PyramidKVPress): the last layer keeps mean / beta, the first 2 mean - mean / beta (at
    most P - w, the last layer then raised to keep their sum 2 mean), the layers between on the
    straight line, each rounded (half to even); where P >= first >= last >= w fails, mean at every
    layer (kvpress's fallback). ``w``: the prefill tokens the scorer keeps first (snapkv's window)."""
    lo = mean / beta
    hi = 2 * mean - lo
    if hi >= P - w:
        hi = P - w
        lo = 2 * mean - hi
    if not (P >= hi and hi >= lo and lo >= w):
        return [mean] * layers
    step = (hi - lo) / (layers - 1) if layers > 1 else 0.0  # kvpress's order of operations: a count at .5 rounds alike
    return [round(hi - i * step) for i in range(layers)]


def _pyramid_dims(live: dict) -> dict:
    dims = MODELS.get(live.get("model"))
    if dims is None or dims.get("sliding_window"):
        raise ValueError(f"a pyramid's per-layer counts need a model of the audit's table without sliding layers, not "
                         f"{live.get('model')!r}")
    return dims


def as_bytes(budget, live: dict):
    """A budget ``{"as": preset}``: that preset's whole-cache bytes per token at the segment's end (a
    policy the audit's table knows that keeps every token), as ``{"bytes_per_token": b}``."""
    if not (isinstance(budget, dict) and set(budget) == {"as"}):
        return budget
    arm = budget["as"]
    if arm not in POLICY_TABLE or POLICY_TABLE[arm][0] == "drop" or "oracle" in arm:
        raise ValueError(f"a budget as {arm!r}: not a preset the audit knows that keeps every token")
    n = live["prefill"] + live["steps"]
    dims = MODELS.get(live.get("model"))
    if dims is None:
        raise ValueError(f"a budget in bytes needs a model of the audit's table, not {live.get('model')!r}")
    return {"bytes_per_token": policy_bytes(policy_of(arm, {k: v for k, v in live.items() if k != "policies"}), n,
                                            dims) / n}


def store_policy(pol: dict) -> dict:
    """A stored kept set's storage: a uniform policy of no sink, the middle ``store``, the float32
    window ``store_window``, the selection's groups, fed the held tokens as its own sequence."""
    return {"middle": pol["store"], "sink": 0, "window": pol["store_window"], "group": pol["group"],
            "feature_group": pol["feature_group"], "key_axis": pol["key_axis"], "sink_select": "first"}


def stored_layer_bytes(pol: dict, held: int, h: int, d: int) -> int:
    """One layer's bytes of a kept set of ``held`` tokens per KV head stored by its storage: the header,
    the storage's float32 window and packed arrays, an int32 index and a float32 score per held token."""
    st = store_policy(pol)
    _, p, f = _spans(st, held)
    return HEADER + f * 2 * h * d * 4 + _packed_bytes(st, p, h, d) + h * held * SCORED_EXTRA


def rest_policy(pol: dict) -> dict:
    """A quantized rest's storage (MiKV): a uniform policy of the middle ``rest``, no sink, no window, the
    selection's groups, fed the prefill tokens the selection does not keep as its own sequence."""
    return {"middle": pol["rest"], "sink": 0, "window": 0, "group": pol["group"], "feature_group": pol["feature_group"],
            "key_axis": pol["key_axis"], "sink_select": "first"}


def rest_bytes(pol: dict, h: int, d: int) -> int:
    """One layer's bytes of a quantized rest (no header): the prefill's tokens beyond ``keep``, whole
    groups packed, the remainder float32."""
    if not pol.get("rest"):
        return 0
    rp = rest_policy(pol)
    _, p, f = _spans(rp, max(0, pol["_prefill"] - pol["keep"]))
    return f * 2 * h * d * 4 + _packed_bytes(rp, p, h, d)


def _stored_budget_keep(target: float, pol: dict, live: dict, dims: dict) -> int:
    """The largest kept count of at most the prefill whose stored bytes at the segment's end fit."""
    P, T = live["prefill"], live["steps"]
    # every count is tried: a flush or a rest's float32 remainder makes the bytes fall as well as rise
    return next((k for k in range(P, 0, -1) if policy_bytes({**pol, "keep": k}, P + T, dims) <= target), 0)


def _budget_keep(budget, mode: str, live: dict, extra: int = SCORED_EXTRA, beta: int | None = None,
                 w: int = 0, store: dict | None = None) -> int:
    """The audit's own statement of a budget's kept count: the largest count whose whole-cache
    bytes at the end of the segment (prefill + steps) do not exceed the budget (bytes per token, or
    that fraction of a float16 cache's; or the tokens given; or a preset's bytes per token, ``as``), for
    a model of the audit's table; of a pyramid (``beta`` set), the largest mean whose per-layer counts,
    each with every decode token, fit the budget summed over the layers; of a kept set stored by a
    storage (``store``: the policy's fields), the largest count whose stored bytes fit."""
    (kind, value), = as_bytes(budget, live).items()
    if kind == "tokens":
        return int(value)
    dims = MODELS.get(live.get("model"))
    if dims is None:
        raise ValueError(f"a budget in bytes needs a model of the audit's table, not {live.get('model')!r}")
    layers, h, d = dims["layers"], dims["kv_heads"], dims["head_dim"]
    n = live["prefill"] + live["steps"]
    target = value * n if kind == "bytes_per_token" else value * n * layers * 4 * h * d
    if store is not None:
        return _stored_budget_keep(target, store, live, dims)
    if beta is not None:  # the prefill tokens per KV head, over every layer, the budget pays for
        P, T = live["prefill"], live["steps"]
        room = int((target - layers * HEADER) // (h * (8 * d + extra))) - layers * T
        best = 0
        for mean in range(max(1, room // layers - layers - 2), min(P, room // layers + layers + 2) + 1):
            if sum(pyramid(mean, P, layers, beta, w)) <= room:
                best = mean
        return best
    held = int((target / layers - HEADER) // (h * (8 * d + extra)))
    return held if mode == "online" else held - live["steps"]
DECLARED_STORAGE = {"middle": "float32", "window": None, "group": None, "feature_group": 32, "key_axis": "channel",
                    "low": None, "low_share": 0.0, "alloc": None, "alloc_from": "prefill", "key_rope": "post", "rest": None}


def policy_names(live: dict) -> list:
    """The arm names of a protocol's ``policies``: a preset's name, or a declared policy's ``name``."""
    return [e.get("name") if isinstance(e, dict) else e for e in live.get("policies", [])]


def declared_policy(entry: dict, live: dict) -> dict:
    """The fields of a declared policy (the protocol's object), in the form of :func:`policy_of`'s."""
    sel, sto = entry.get("selection", {}), entry.get("storage", {})
    if not isinstance(sel, dict) or not isinstance(sto, dict):
        raise ValueError(f"declared policy {entry.get('name')!r}: selection and storage must be objects")
    extra = sorted(set(sel) - set(DECLARED_SELECTION)) + sorted(set(sto) - set(DECLARED_STORAGE))
    if extra:
        raise ValueError(f"declared policy {entry.get('name')!r}: field(s) {extra} are not ones the audit knows")
    s = {**DECLARED_SELECTION, **sel}
    t = {**DECLARED_STORAGE, **sto}
    group = live.get("group", 32) if t["group"] is None else t["group"]
    if s["kind"] not in ("all", "sink_window"):  # a scored selection: its top-keep tokens float32
        if not (s["kind"] in AUDIT_SCORERS or USER_SCORER.match(str(s["kind"]))):
            raise ValueError(f"declared policy {entry.get('name')!r}: selection kind {s['kind']!r} is not one the "
                             "audit knows")
        keep = s["keep"]
        if s["layers"] not in ("uniform", "pyramid"):
            raise ValueError(f"declared policy {entry.get('name')!r}: layers {s['layers']!r} is not a schedule the "
                             "audit knows")
        up = s["layers"] == "pyramid"
        w = SNAPKV_WINDOW if s["kind"] == "snapkv" else 0  # the prefill tokens the scorer keeps first
        out = {"middle": "drop", "sink": 0, "window": s["window"] or 0, "group": group, "feature_group": t["feature_group"],
               "key_axis": t["key_axis"], "sink_select": "first", "scorer": s["kind"], "scorer_mode": s["mode"],
               "keep": keep, "seed": s["seed"], "_prefill": live.get("prefill")}
        if t["middle"] != "float32":  # the kept set stored as a uniform storage stores a sequence of its length
            if t["middle"] not in ("int2", "int3", "int4", "int8", "mxfp8", "mxfp4") or s["mode"] != "prefill":
                raise ValueError(f"declared policy {entry.get('name')!r}: a kept set stored as {t['middle']!r} is not "
                                 "one the audit knows (a quantized middle, a prefill-mode selection)")
            out.update({"store": t["middle"],
                        "store_window": live.get("window", 128) if t["window"] is None else t["window"]})
        if t["rest"] is not None:  # the tokens not kept stored quantized (MiKV)
            if t["rest"] not in ("int2", "int3", "int4", "int8", "mxfp8", "mxfp4") or s["mode"] != "prefill":
                raise ValueError(f"declared policy {entry.get('name')!r}: a rest stored as {t['rest']!r} is not one the "
                                 "audit knows (a quantized middle, a prefill-mode selection)")
            out["rest"] = t["rest"]
        if "budget" in entry:
            keep = _budget_keep(entry["budget"], s["mode"], live, beta=s["beta"] if up else None, w=w,
                                store=out if out.get("store") or out.get("rest") else None)
            out["keep"] = keep
        if up:  # the per-layer counts from the declared mean, the prefill and the model's layers
            out.update({"layers": "pyramid", "beta": s["beta"],
                        "layer_keep": pyramid(keep, live["prefill"], _pyramid_dims(live)["layers"], s["beta"], w)})
        if s["heads"] not in ("uniform", "adaptive"):
            raise ValueError(f"declared policy {entry.get('name')!r}: heads {s['heads']!r} is not a schedule the "
                             "audit knows")
        if s["heads"] == "adaptive":  # a row's config has the per-head fields only then
            out.update({"heads": "adaptive", "alpha": float(s["alpha"])})
        return out
    if s["kind"] == "sink_window":
        window = live.get("evict_window", 256) if s["window"] is None else s["window"]
        if "budget" in entry:  # the first S and newest W float32, no index or score: W from the budget
            window = _budget_keep(entry["budget"], "online", live, extra=0) - s["sink"]
        out = {"middle": "drop", "sink": s["sink"], "window": window}
    elif s["kind"] == "all":
        out = {"middle": t["middle"], "sink": s["sink"], "window": live.get("window", 128) if t["window"] is None
               else t["window"]}
    else:
        raise ValueError(f"declared policy {entry.get('name')!r}: selection kind {s['kind']!r} is not one the audit "
                         "knows")
    out.update({"group": group, "feature_group": t["feature_group"], "key_axis": t["key_axis"],
                "sink_select": s["sink_select"]})
    if t["low"] is not None:
        out.update({"low": t["low"], "low_share": float(t["low_share"]), "alloc": t["alloc"],
                    "alloc_from": t["alloc_from"]})
    if s["heavy"]:
        out.update({"heavy": s["heavy"], "heavy_rule": s["heavy_rule"]})
    if t["key_rope"] != "post":  # keys stored before the rotary embedding (a row's config has it only then)
        if t["key_rope"] != "pre":
            raise ValueError(f"declared policy {entry.get('name')!r}: key_rope {t['key_rope']!r} is not one the audit "
                             "knows")
        out["key_rope"] = "pre"
    return out


def policy_of(name: str, live: dict) -> dict:
    for entry in live.get("policies", []):
        if isinstance(entry, dict) and entry.get("name") == name:
            return declared_policy(entry, live)
    if name not in POLICY_TABLE:
        raise ValueError(f"policy {name!r} is neither a preset the audit knows nor declared in the protocol")
    middle, has_sink, wkey, axis, *select = POLICY_TABLE[name]
    out = {"middle": middle, "sink": live.get("sink", 4) if has_sink else 0,
           "window": 0 if wkey is None else live.get(wkey, 128 if wkey == "window" else 256),
           "group": live.get("group", 32), "feature_group": 32, "key_axis": axis,
           "sink_select": select[0] if select else "first"}
    if name in MIXED:  # a uniform policy's config has no mixed fields (low, low_share, alloc, alloc_from)
        out.update(zip(MIXED_FIELDS, MIXED[name][1:]))
    if name in HEAVY:  # the window gives G tokens to the middle; the bytes freed pay for C heavy hitters
        out["heavy"] = heavy_count(out["window"], out["group"])
        out["heavy_rule"] = HEAVY[name][1]
        out["window"] = max(1, out["window"] - out["group"])
    return out


def heavy_count(window: int, group: int, d: int = 64) -> int:
    """C for a heavy-hitter int2 policy beside uniform int2 at window ``window`` (head dim 64): G
    float32 window tokens (8 d bytes per KV head each) become int2 tokens (d / 4 code bytes of K
    and of V, a float16 scale and zero per channel per G tokens of K, per 32 features of V); what that
    frees, less a float32 score for each of at most ``window - 1`` float32 tokens, buys heavy
    hitters of 8 d + 8 bytes each (float32 K and V, int32 index, float32 score)."""
    int2 = 2 * (d // 4) + 4 * d / group + 4 * (d // 32)
    return max(0, int((group * (8 * d - int2) - 4 * (window - 1)) // (8 * d + 8)))


def _low_count(pol: dict, pairs: int) -> int:
    return round(pol["low_share"] * pairs) if pol.get("low") else 0


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


def _spans(pol: dict, n: int) -> tuple[int, int, int]:
    """(sink tokens, packed tokens, float tokens after the sink) held after n tokens."""
    s = min(pol["sink"], n)
    if pol["middle"] == "drop":
        return s, 0, n - max(s, n - pol["window"])
    if pol["middle"] == "float32":
        return s, 0, n - s
    aged = n - s - pol["window"]
    p = pol["group"] * (aged // pol["group"]) if aged > 0 else 0
    return s, p, n - s - p


def _packed_bytes(pol: dict, p: int, heads: int, d: int) -> int:
    """Bytes of p packed tokens of K + V in one layer, from the stored arrays' shapes."""
    if p == 0:
        return 0
    m = pol["middle"]
    if m in ("mxfp8", "mxfp4"):
        dp = -(-d // MX_BLOCK_SIZE) * MX_BLOCK_SIZE
        codes = dp if m == "mxfp8" else dp // 2
        return 2 * heads * p * (codes + dp // MX_BLOCK_SIZE)
    bits = int(m[3:])
    f = pol["feature_group"]
    dp = -(-d // f) * f
    v = heads * p * (-(-dp * bits // 8) + 2 * 2 * (dp // f))
    if pol["key_axis"] == "channel":
        k = heads * (p * -(-d * bits // 8) + 2 * 2 * d * (p // pol["group"]))
    else:
        k = v
    return k + v


def scored_held(pol: dict, n: int, layer: int | None = None) -> int:
    """Tokens a scored selection holds per (layer, KV head) after n tokens: online, at most keep; at
    the prefill only, the prefill's top keep and every token after it (a pyramid: the layer's count)."""
    keep = pol["keep"] if not pol.get("layer_keep") else pol["layer_keep"][layer]
    if pol["scorer_mode"] == "online":
        return min(n, keep)
    return min(pol["_prefill"], keep) + n - pol["_prefill"]


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


def _scored_evidence(row, ctx, pol: dict, live: dict, a: dict, layer) -> None:
    """The evidence layer of a scored selection: the kept indices (ascending, in range, as many as
    the policy holds), the kept K/V equal to the recorded inputs at them, the bytes; for a built-in
    scorer, the stored scores its own scores of those keys and the kept set its top-keep (prefill
    mode: of the prefill, every later token kept), with near ties allowed within float32 rounding."""
    if pol.get("heads") == "adaptive":
        _adaptive_evidence(row, ctx, pol, live, a, layer)
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
    if own is not None:
        _check_kept(row, ctx, pol, live, own[0], idx, score, own[1], atol=own[2])


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
    rp = rest_policy(pol)
    _, p, f = _spans(rp, m)
    want = {}
    for name, label, x in (("k", "key", k), ("v", "value", v)):
        seq = x[:, :P][out].reshape(h, m, x.shape[2])
        want[f"rest.sink.{name}"], want[f"rest.float.{name}"] = seq[:, :0], seq[:, p:]
        if p:
            want.update({f"rest.{label}.{arr}": w for arr, w in encode_tensor(seq[:, :p], _middle_config(rp, name)).items()
                         if arr != "header"})
    stored = {x: y for x, y in a.items() if x.startswith("rest.")}
    ctx.numbers += len(want)
    for line in payload_differences(stored, want, f"the recorded prefill inputs not kept ({m} per head)"):
        ctx.fail(row, line)
    return sum(int(y.nbytes) for y in stored.values())


def _stored_kept(row, ctx, pol: dict, a: dict, at: np.ndarray, k: np.ndarray, v: np.ndarray) -> int:
    """A kept set stored by its storage: the recorded inputs at ``kept.index`` (``at``), in order, form the
    storage's sequence; its packed tokens re-encoded with the audit's encoders and its float32 window
    equal the stored arrays byte for byte, and no other array is stored. Returns the stored bytes."""
    st = store_policy(pol)
    held = at.shape[1]
    _, p, f = _spans(st, held)
    want = {}
    for name, label, x in (("k", "key", k), ("v", "value", v)):
        seq = np.take_along_axis(x, at, axis=1)
        want[f"sink.{name}"], want[f"float.{name}"] = seq[:, :0], seq[:, p:]
        if p:
            want.update({f"{label}.{arr}": w for arr, w in encode_tensor(seq[:, :p], _middle_config(st, name)).items()
                         if arr != "header"})
    stored = {x: y for x, y in a.items() if not x.startswith(("input.", "rest.") if pol.get("rest") else "input.")
              and x not in ("kept.index", "kept.score", "prefill.q", "rope.inv_freq")}
    ctx.numbers += len(want)
    for line in payload_differences(stored, want, f"the recorded inputs at kept.index (packed kept tokens [0, {p}))"):
        ctx.fail(row, line)
    return sum(int(y.nbytes) for y in stored.values()) + int(a["kept.index"].nbytes) + int(a["kept.score"].nbytes)


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


def _rotate_half(x: np.ndarray) -> np.ndarray:
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
    pre = (x * cos - _rotate_half(x) * sin)[:, EA_SINK:]
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
    if w:  # kept whatever their score (checked in _scored_evidence)
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


def _full_layers(dims: dict) -> int:
    return len(dims["full_layers"]) if dims.get("full_layers") is not None else dims["layers"]


def sliding_bytes(n: int, dims: dict) -> int:
    """What the sliding-window layers hold after n tokens, as DynamicCache keeps them (the policy
    runs on full-attention layers only): the newest window - 1 tokens, float32 K and V, no header."""
    w = dims.get("sliding_window")
    if not w:
        return 0
    return (dims["layers"] - _full_layers(dims)) * min(n, w - 1) * 2 * dims["kv_heads"] * dims["head_dim"] * 4


def policy_bytes(pol: dict, n: int, dims: dict, low_pairs: int | None = None, held: int | None = None) -> int:
    """The cache's bytes after n tokens; a mixed policy's with ``low_pairs`` of its (layer, KV head)
    pairs at the low scheme (default: the protocol's share) and one byte of bits per pair; a
    heavy-hitter policy's with ``held`` heavy hitters per (layer, KV head) (default: C, or every
    packed token while fewer are packed), each float32 K and V, an int32 index and a float32 score,
    and a float32 score per float32 window token."""
    h, d = dims["kv_heads"], dims["head_dim"]
    full = _full_layers(dims)
    if pol.get("scorer") and pol.get("layer_keep"):  # a pyramid: each layer its own count (no sliding layers)
        if len(pol["layer_keep"]) != full:
            raise ValueError(f"a pyramid of {len(pol['layer_keep'])} layers on a model of {full} full layers")
        return sum(HEADER + h * scored_held(pol, n, i) * (8 * d + SCORED_EXTRA) for i in range(full))
    if pol.get("scorer") and pol.get("store"):  # the kept set stored by its storage (and a quantized rest)
        return full * (stored_layer_bytes(pol, scored_held(pol, n), h, d) + rest_bytes(pol, h, d)) + sliding_bytes(n, dims)
    if pol.get("scorer"):
        return (full * (HEADER + h * scored_held(pol, n) * (8 * d + SCORED_EXTRA) + rest_bytes(pol, h, d))
                + sliding_bytes(n, dims))
    s, p, f = _spans(pol, n)
    heavy = 0
    if pol.get("heavy"):
        held = min(pol["heavy"], p) if held is None else held
        heavy = full * h * (held * (2 * d * 4 + 4 + 4) + f * 4)
    if not pol.get("low"):
        return (full * (HEADER + (s + f) * 2 * h * d * 4 + _packed_bytes(pol, p, h, d)) + heavy
                + sliding_bytes(n, dims))
    pairs = full * h
    lo = _low_count(pol, pairs) if low_pairs is None else low_pairs
    return (full * (HEADER + (s + f) * 2 * h * d * 4) + lo * _packed_bytes({**pol, "middle": pol["low"]}, p, 1, d)
            + (pairs - lo) * _packed_bytes(pol, p, 1, d) + pairs + sliding_bytes(n, dims))


def reference_bytes(n: int, dims: dict) -> int:
    """DynamicCache in float32: every token on full-attention layers, the window on sliding ones."""
    return _full_layers(dims) * n * 2 * dims["kv_heads"] * dims["head_dim"] * 4 + sliding_bytes(n, dims)


def model_dims(live: dict, row: dict | None = None) -> dict:
    """The audit's dimensions of the study's model; for a model given by path, the row's
    ``model_dims`` (checked for form only: the audit cannot know another model)."""
    known = MODELS.get(live.get("model"))
    if known is not None:
        return known
    dims = (row or {}).get("model_dims")
    keys = ("layers", "kv_heads", "head_dim")
    if not isinstance(dims, dict) or not all(isinstance(dims.get(k), int) and dims[k] > 0 for k in keys):
        raise ValueError(f"model {live.get('model')!r} is not one the audit knows and the row has no model_dims")
    full = dims.get("full_layers")
    if full is not None and (not isinstance(full, list) or not all(isinstance(i, int) and 0 <= i < dims["layers"]
                                                                     for i in full)):
        raise ValueError(f"model_dims.full_layers {full!r} are not layer indices")
    return dims


ONE_FULL_LAYER = {"layers": 1, "full_layers": [0], "sliding_window": None}


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
    count = _low_count(pol, bits.size)
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


def _check_heavy_index(row, ctx, pol: dict, dims: dict, n: int) -> int:
    """A heavy-hitter row's stored indices ``hh_index [L, H, c]`` after n tokens: c is C, or every
    packed token while fewer are packed; each (layer, KV head)'s indices are distinct packed tokens
    (in [0, packed)), in ascending order. Returns c (the bytes are re-derived from it)."""
    index = ctx.load(row.get("arrays", {}).get("hh_index"))
    _, p, _ = _spans(pol, n)
    c = min(pol["heavy"], p)
    shape = (_full_layers(dims), dims["kv_heads"], c)
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


def quanto_bytes(n: int, prefill: int, residual: int, bits: int, group: int, dims: dict) -> int:
    """QuantizedCache after a prefill of ``prefill`` then one token per forward up to n tokens."""
    r = (n - prefill) % residual if residual > 0 else 0
    q = n - r
    h, d = dims["kv_heads"], dims["head_dim"]
    per_q = 2 * h * (d * bits // 8 + (d // group) * 8)  # K and V: codes, float32 scale + shift per group
    return dims["layers"] * (q * per_q + r * 2 * h * d * 4)


def next_change(pol: dict, n: int):
    if pol["middle"] == "float32":
        return math.inf
    if pol.get("store"):  # a stored kept set flushes at held counts the prefill sets: one token per forward
        return 1
    if pol.get("scorer"):  # online: the append that first holds more than keep evicts after its attention
        return math.inf if pol["scorer_mode"] == "prefill" else max(1, pol["keep"] + 1 - n)
    if pol["middle"] == "drop":  # the cache masks what each token of a chunk would have evicted
        return math.inf
    base, g = pol["sink"] + pol["window"], pol["group"]
    m = base + g if n < base + g else base + g * ((n - base) // g + 1)
    return m - n


def schedule(kind: str, name: str, live: dict) -> list[int]:
    P, T = live["prefill"], live["steps"]
    pol = policy_of(name, live) if kind == "policy" else None
    out, n = [P], P
    while n < P + T:
        cap = live.get("reference_chunk", 256)
        if kind == "reference":
            c = cap
        elif kind == "peer" or live.get("mode", "chunked") == "step":
            c = 1
        else:
            c = min(next_change(pol, n), cap)
        n += int(min(c, P + T - n))
        out.append(n)
    return out


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


def _middle_config(pol: dict, name: str) -> dict:
    """The quantizer config of the packed middle of K (``name = "k"``) or V, from the audit's policy table."""
    if pol["middle"] in ("mxfp8", "mxfp4"):
        return {"kind": "mx", "element": "e4m3" if pol["middle"] == "mxfp8" else "e2m1", "block_size": 32, "rotation": None}
    axis = pol["key_axis"] if name == "k" else "token"
    return {"kind": "int_grouped", "bits": int(pol["middle"][3:]), "axis": axis,
            "group_size": pol["group"] if axis == "channel" else pol["feature_group"]}


def _check_evidence(row, ctx, pol: dict, live: dict) -> None:
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
        _scored_evidence(row, ctx, pol, live, a, ev.get("layer"))
        return
    s, p, f = _spans(pol, n)
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
            want.update({f"{label}.{arr}": w for arr, w in encode_tensor(x[:, s:s + p], _middle_config(pol, name)).items()
                         if arr != "header"})
        elif p:  # each head at its own stored bits, the heads of one width together in head order
            for scheme in sorted({pol["low"], pol["middle"]}):
                heads = np.flatnonzero(layer_bits == int(scheme[3:]))
                if heads.size:
                    cfg = _middle_config({**pol, "middle": scheme}, name)
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
    total = sum(int(v.nbytes) for k, v in stored.items())
    one = {**model_dims(live, row), **ONE_FULL_LAYER}
    low_here = None if layer_bits is None else int((layer_bits == int(pol["low"][3:])).sum())
    held = held if pol.get("heavy") else None
    ctx.close(row, "evidence layer bytes", total + HEADER, policy_bytes(pol, n, one, low_here, held))


def rope_rotate(k: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``k [H, n, D]`` rotated by the rotary embedding ``cos``, ``sin`` ``[n, D]`` in float64: each channel
    pair (i, i + D/2) by the angle whose cosine and sine are ``cos[:, i]``, ``sin[:, i]`` (RoPE's
    rotate-half layout: ``k cos + rotate_half(k) sin``, with ``rotate_half(x) = (-x2, x1)``)."""
    k = k.astype(np.float64)
    return k * cos.astype(np.float64)[None] + _rotate_half(k) * sin.astype(np.float64)[None]


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
    s, _, f = _spans(pol, n)
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
    lb = a.get("alloc.bits")
    ctx.numbers += 1
    if lb is None or lb.dtype != np.uint8 or not np.array_equal(lb, bits[layer]):
        ctx.fail(row, f"the evidence layer's alloc.bits are not alloc_bits[{layer}]")
    stored_score = a.get("alloc.score")
    ctx.numbers += 1
    if stored_score is None or not np.array_equal(stored_score, score[layer]):
        ctx.fail(row, f"the evidence layer's alloc.score is not alloc_score[{layer}]")
    if pol["alloc"] in ("concentrated", "diffuse"):
        P, n = live["prefill"], live["prefill"] + live["steps"]
        q, k, t = a.get("input.q"), a.get("input.k"), P
        if pol["alloc_from"] == "oracle":  # the oracle pass: the prefill's queries, then the later ones, its own keys
            later, k, t = a.get("oracle.q"), a.get("oracle.k"), n
            q = None if q is None or later is None or q.ndim != 3 or later.ndim != 3 else np.concatenate([q, later], axis=1)
        if q is None or k is None or q.ndim != 3 or q.shape[1] != t or k.shape[1] < t or q.shape[0] % k.shape[0]:
            raise ValueError(f"a {pol['alloc_from']} allocation's evidence needs queries and keys of {t} tokens")
        mine = concentration(q, k[:, :t])
        tol = TOLERANCES["float32_softmax"]
        ctx.numbers += mine.size
        bad = ~(np.abs(score[layer] - mine) <= tol["atol"] + tol["rtol"] * np.abs(mine))
        if bad.any():
            h = int(np.flatnonzero(bad)[0])
            ctx.fail(row, f"alloc_score[{layer}, {h}] = {score[layer, h]:.8g}; the audit's float64 concentration "
                          f"from the recorded queries and keys is {mine[h]:.8g}")
    return bits[layer]


def check_study(ctx, study: str, live: dict) -> bool:
    """Once per study: exactly one row per (segment, arm) the protocol implies, segments as the
    protocol lays them out, token ids that match their recorded hash."""
    arms = ["dynamic_cache"] + policy_names(live) + [f"quanto_int{p['bits']}" for p in live.get("peers", [])]
    where = f"results.json {study}"
    cases = ctx.results.get("cases", {}).get(study, {})
    every = [sid for prefix, _ in views(live) for sid in segment_ids(prefix, live)]
    if sorted(cases) != sorted(every):
        ctx.fail(where, f"segments {sorted(cases)[:4]}... are not the protocol's {len(every)} ({every[0]}..)")
    for prefix, v in views(live):
        _check_segments(ctx, where, cases, segment_ids(prefix, live), segment_indices(live),
                        v["prefill"] + live["steps"] + 1)
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


def _check_segments(ctx, where: str, cases: dict, segs: list, index: list, length: int) -> None:
    """The segments of one context (``index``: their places among the protocol's segments): token
    ids of ``length`` tokens matching their hash, disjoint, evenly spaced."""
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
    if len(starts) == len(segs) and all(isinstance(x, int) for x in starts):
        if len(starts) > 1:
            stride = (starts[1] - starts[0]) // (index[1] - index[0])
        else:
            stride = starts[0] // index[0] if index[0] else length
        if starts != [i * stride for i in index] or stride < length:
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
                    "layers", "beta", "layer_keep", "heads", "alpha", "store", "store_window", "rest"):
            ctx.equal(row, f"policy.{key}", cfg.get(key), pol.get(key))
        ctx.equal(row, "policy.name", cfg.get("name"), arm)
        if pol.get("low"):
            ctx.close(row, "policy.low_share", cfg.get("low_share"), pol["low_share"])
        else:
            ctx.equal(row, "policy.low_share", cfg.get("low_share"), None)
        if pol.get("low"):
            bits = _check_allocation(row, ctx, pol, dims)
            low_pairs = int((bits == int(pol["low"][3:])).sum())
            want_b = [policy_bytes(pol, n, dims, low_pairs) for n in want_ctx]
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
        _check_evidence(row, ctx, policy_of(arm, live), live)
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
