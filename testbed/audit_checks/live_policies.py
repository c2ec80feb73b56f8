"""The audit's own statement of the live policies (stdlib, the audit's tables, and its own encoders for a
codec middle's bytes).

What a live row's policy is and what follows from it in closed form, stated again from the
documented definitions (not imported from ``testbed.policies``): the presets' table
(``POLICY_TABLE``, with the per-head precision ``MIXED`` and heavy-hitter ``HEAVY`` presets and the
equal-bytes pairing ``BUDGET_VERSUS``), a policy declared by its fields (``declared_policy``, budgets
included: ``as_bytes``, PyramidKV's ``pyramid``, Ada-KV's ``adaptive_safeguard``), the scorers the audit
re-derives (``AUDIT_SCORERS``, ``ATTENTION_SCORERS``, ``KEPT_FIRST``), the tokens a policy holds
(``spans``, ``scored_held``) and their bytes (``policy_bytes``, ``reference_bytes``, ``quanto_bytes``,
for the model's dimensions, ``model_dims``), the quantizer of its packed middle (``middle_config``) and
its chunk schedule (``next_change``, ``schedule``). ``live_quality`` checks the rows against these,
``live_evidence`` and ``live_scored`` the evidence layer, ``retrieval`` its arms' bytes.
"""

from __future__ import annotations

import math
import re

import numpy as np

from .capture import MODELS  # the audit's one table of known models (layers, KV heads, head dim, layer types)
from .common import HEADER_BYTES, MX_BLOCK_SIZE
from .calibration import payload_config, table_bytes
from .schemes import encode_tensor, scheme

__all__ = ["MODELS", "POLICY_TABLE", "MIXED", "HEAVY", "BUDGET_VERSUS", "HEADER", "SCORED_EXTRA", "ONE_FULL_LAYER",
           "budget_of", "versus_of", "declared_policy", "policy_names", "policy_of", "as_bytes", "pyramid",
           "adaptive_safeguard", "selective_sparse", "selective_budget", "dense_policy", "dense_pair_bytes",
           "spans", "scored_held", "low_count",
           "full_layers", "policy_bytes", "reference_bytes",
           "quanto_bytes", "model_dims", "middle_config", "packed_payload", "next_change", "schedule"]


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


# a policy declared by its fields in the protocol (name, selection, storage, description): the audit's
# own statement of the mapping onto the fields above (testbed.policies.compose states the run's): an
# "all" selection keeps every token (sink S first or chosen by mass, heavy hitters), its storage the
# middle scheme, float32 window R (default: the protocol's window), groups (default: the protocol's
# group); a "sink_window" selection keeps the first S and newest W (default: the protocol's
# evict_window) float32 and drops the middle
DECLARED_SELECTION = {"kind": "all", "sink": 0, "sink_select": "first", "window": None, "heavy": 0,
                      "heavy_rule": "attention", "keep": 0, "mode": "online", "seed": 0, "layers": "uniform",
                      "beta": 20, "heads": "uniform", "alpha": 0.2, "alloc": None, "alloc_from": "prefill",
                      "sparse_share": 0.0, "block": 0}
# scored selections: the scorers whose choice the audit re-derives from the stored keys (its own
# definitions, live_scored._scores); a user's scorer ("file.py:Class") is checked self-consistently only
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


def selective_sparse(pol: dict, pairs: int) -> int:
    """The sparse pairs of a selective selection of ``pairs`` (layer, KV head) pairs: round(share x pairs),
    half to even (Python's round)."""
    return round(pol["sparse_share"] * pairs)


def selective_budget(budget, keep: int, live: dict, dense: dict | None = None) -> tuple:
    """The audit's own statement of the selective rule's budget: the fewest sparse pairs m whose bytes at
    the segment's end (every pair dense at 8 D bytes per token, or what its ``dense`` storage holds for
    one KV head, :func:`dense_pair_bytes`; a sparse one the prefill's top keep and every later token at
    8 D + 8, a class byte per pair, a header per layer) fit the budget, then the largest keep (at most
    the prefill) at that m that still fits; returns (m / pairs, keep)."""
    (kind, value), = as_bytes(budget, live).items()
    dims = MODELS.get(live.get("model"))
    if dims is None or dims.get("sliding_window") or kind not in ("bytes_per_token", "fp16_fraction"):
        raise ValueError(f"a selective rule's budget needs bytes (per token, a fraction of float16's or as a preset) for "
                         f"a model of the audit's table without sliding layers, not {kind!r} on {live.get('model')!r}")
    layers, h, d = dims["layers"], dims["kv_heads"], dims["head_dim"]
    P, n = live["prefill"], live["prefill"] + live["steps"]
    target = value * n if kind == "bytes_per_token" else value * n * layers * 4 * h * d
    pairs = layers * h
    per_dense = dense_pair_bytes(dense or {}, n, d)

    def cost(m: int, k: int) -> int:
        return layers * HEADER + pairs + m * (min(P, k) + n - P) * (8 * d + SCORED_EXTRA) + (pairs - m) * per_dense

    if (min(P, keep) + n - P) * (8 * d + SCORED_EXTRA) >= per_dense:
        raise ValueError(f"a selective rule whose sparse pair ({(min(P, keep) + n - P) * (8 * d + SCORED_EXTRA)} bytes at "
                         f"keep {keep}) costs no less than a dense one ({per_dense}) cannot meet a budget by making pairs "
                         "sparse")
    m = next((m for m in range(pairs + 1) if cost(m, keep) <= target), pairs)
    k = max([x for x in range(keep, P + 1) if cost(m, x) <= target] or [keep])
    return m / pairs, k


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


def dense_policy(pol: dict) -> dict:
    """A selective selection's stored dense class: a uniform policy of no sink, the middle ``dense``, the
    float32 window ``dense_window``, the selection's groups, fed every token of a dense pair."""
    return {"middle": pol["dense"], "sink": 0, "window": pol["dense_window"], "group": pol["group"],
            "feature_group": pol["feature_group"], "key_axis": pol["key_axis"], "sink_select": "first"}


def dense_pair_bytes(pol: dict, n: int, d: int) -> int:
    """One dense (layer, KV head) pair of a selective selection after n tokens: every token's float32 K and
    V, or (``dense`` set) its storage's float32 window and packed arrays for one KV head (no header)."""
    if not pol.get("dense"):
        return n * 8 * d
    dp = dense_policy(pol)
    _, p, f = spans(dp, n)
    return f * 8 * d + _packed_bytes(dp, p, 1, d)


def stored_layer_bytes(pol: dict, held: int, h: int, d: int) -> int:
    """One layer's bytes of a kept set of ``held`` tokens per KV head stored by its storage: the header,
    the storage's float32 window and packed arrays, an int32 index and a float32 score per held token."""
    st = store_policy(pol)
    _, p, f = spans(st, held)
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
    _, p, f = spans(rp, max(0, pol["_prefill"] - pol["keep"]))
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
                    "low": None, "low_share": 0.0, "alloc": None, "alloc_from": "prefill", "key_rope": "post", "rest": None,
                    "codec": None}


def _codec(codec, where: str) -> dict:
    """A codec middle's quantizers (storage ``codec``): {"k": config, "v": config}, each of a kind the
    audit encodes (schemes.SCHEMES; an unknown kind raises naming it)."""
    if not isinstance(codec, dict) or set(codec) != {"k", "v"}:
        raise ValueError(f"{where}: a codec middle needs codec {{\"k\": config, \"v\": config}}, got {codec!r}")
    for part in ("k", "v"):
        if not isinstance(codec[part], dict):
            raise ValueError(f"{where}: codec.{part} must be a quantizer config (an object with its kind), got "
                             f"{codec[part]!r}")
        scheme(payload_config(codec[part]))
    return {"k": dict(codec["k"]), "v": dict(codec["v"])}


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
        if t["codec"] is not None:
            raise ValueError(f"declared policy {entry.get('name')!r}: a codec middle is the storage of an 'all' selection")
        if s["layers"] not in ("uniform", "pyramid"):
            raise ValueError(f"declared policy {entry.get('name')!r}: layers {s['layers']!r} is not a schedule the "
                             "audit knows")
        up = s["layers"] == "pyramid"
        w = SNAPKV_WINDOW if s["kind"] == "snapkv" else 0  # the prefill tokens the scorer keeps first
        out = {"middle": "drop", "sink": 0, "window": s["window"] or 0, "group": group, "feature_group": t["feature_group"],
               "key_axis": t["key_axis"], "sink_select": "first", "scorer": s["kind"], "scorer_mode": s["mode"],
               "keep": keep, "seed": s["seed"], "_prefill": live.get("prefill")}
        if t["middle"] != "float32" and s["heads"] == "selective":  # the selective rule's dense pairs so stored
            if t["middle"] not in ("int2", "int3", "int4", "int8", "mxfp8", "mxfp4"):
                raise ValueError(f"declared policy {entry.get('name')!r}: dense pairs stored as {t['middle']!r} is not "
                                 "one the audit knows (a quantized middle)")
            out.update({"dense": t["middle"],
                        "dense_window": live.get("window", 128) if t["window"] is None else t["window"]})
        elif t["middle"] != "float32":  # the kept set stored as a uniform storage stores a sequence of its length
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
        if s["heads"] == "selective":  # the seed's rule: which pairs are sparse, and how many
            if s["alloc"] not in ("concentrated", "diffuse", "late", "random") or \
                    s["alloc_from"] not in ("prefill", "oracle") or s["mode"] != "prefill" or up:
                raise ValueError(f"declared policy {entry.get('name')!r}: a selective rule of alloc {s['alloc']!r} from "
                                 f"{s['alloc_from']!r} (mode {s['mode']!r}, layers {s['layers']!r}) is not one the audit "
                                 "knows")
            out.update({"heads": "selective", "alloc": s["alloc"], "alloc_from": s["alloc_from"],
                        "sparse_share": float(s["sparse_share"])})
            if "budget" in entry:
                out["sparse_share"], out["keep"] = selective_budget(entry["budget"], keep, live,
                                                                    out if out.get("dense") else None)
            return out
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
        if s["block"]:  # the top keep / B blocks of B prefill tokens; a row's config has the field only then
            b = s["block"]
            if not (isinstance(b, int) and b >= 2 and not b & (b - 1)) or keep % b or "budget" in entry \
                    or s["mode"] != "prefill" or up or s["heads"] != "uniform" or out.get("store") or out.get("rest"):
                raise ValueError(f"declared policy {entry.get('name')!r}: block {b!r} is not one the audit knows (a power "
                                 "of two dividing keep, a prefill cut of one count kept float32, no budget)")
            out["block"] = b
        return out
    if s["kind"] == "sink_window":
        window = live.get("evict_window", 256) if s["window"] is None else s["window"]
        if "budget" in entry:  # the first S and newest W float32, no index or score: W from the budget
            window = _budget_keep(entry["budget"], "online", live, extra=0) - s["sink"]
        out = {"middle": "drop", "sink": s["sink"], "window": window}
    elif s["kind"] == "all":
        out = {"middle": t["middle"], "sink": s["sink"], "window": live.get("window", 128) if t["window"] is None
               else t["window"]}
        if t["middle"] == "codec":  # the middle stored by the given quantizers, one payload per group
            out["codec"] = _codec(t["codec"], f"declared policy {entry.get('name')!r}")
    else:
        raise ValueError(f"declared policy {entry.get('name')!r}: selection kind {s['kind']!r} is not one the audit "
                         "knows")
    if t["codec"] is not None and t["middle"] != "codec":
        raise ValueError(f"declared policy {entry.get('name')!r}: codec is the quantizers of middle 'codec'")
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


def low_count(pol: dict, pairs: int) -> int:
    return round(pol["low_share"] * pairs) if pol.get("low") else 0


def spans(pol: dict, n: int) -> tuple[int, int, int]:
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
    if m == "codec":  # one payload per group of G tokens: its arrays less the header, K's and V's
        g = pol["group"]
        return (p // g) * sum(_group_bytes(pol["codec"][part], heads, g, d) for part in ("k", "v"))
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


def full_layers(dims: dict) -> int:
    return len(dims["full_layers"]) if dims.get("full_layers") is not None else dims["layers"]


def sliding_bytes(n: int, dims: dict) -> int:
    """What the sliding-window layers hold after n tokens, as DynamicCache keeps them (the policy
    runs on full-attention layers only): the newest window - 1 tokens, float32 K and V, no header."""
    w = dims.get("sliding_window")
    if not w:
        return 0
    return (dims["layers"] - full_layers(dims)) * min(n, w - 1) * 2 * dims["kv_heads"] * dims["head_dim"] * 4


def policy_bytes(pol: dict, n: int, dims: dict, low_pairs: int | None = None, held: int | None = None,
                 sparse: int | None = None) -> int:
    """The cache's bytes after n tokens; a mixed policy's with ``low_pairs`` of its (layer, KV head)
    pairs at the low scheme (default: the protocol's share) and one byte of bits per pair; a
    heavy-hitter policy's with ``held`` heavy hitters per (layer, KV head) (default: C, or every
    packed token while fewer are packed), each float32 K and V, an int32 index and a float32 score,
    and a float32 score per float32 window token."""
    h, d = dims["kv_heads"], dims["head_dim"]
    full = full_layers(dims)
    if pol.get("heads") == "selective":  # sparse pairs: held tokens with index and score; dense: every token
        pairs = full * h
        m = selective_sparse(pol, pairs) if sparse is None else sparse
        return (full * HEADER + pairs + m * scored_held(pol, n) * (8 * d + SCORED_EXTRA)
                + (pairs - m) * dense_pair_bytes(pol, n, d) + sliding_bytes(n, dims))
    if pol.get("scorer") and pol.get("layer_keep"):  # a pyramid: each layer its own count (no sliding layers)
        if len(pol["layer_keep"]) != full:
            raise ValueError(f"a pyramid of {len(pol['layer_keep'])} layers on a model of {full} full layers")
        return sum(HEADER + h * scored_held(pol, n, i) * (8 * d + SCORED_EXTRA) for i in range(full))
    if pol.get("scorer") and pol.get("store"):  # the kept set stored by its storage (and a quantized rest)
        return full * (stored_layer_bytes(pol, scored_held(pol, n), h, d) + rest_bytes(pol, h, d)) + sliding_bytes(n, dims)
    if pol.get("scorer") and pol.get("block"):  # float32 K and V per held token, index and score per block of B
        held = scored_held(pol, n)
        return full * (HEADER + h * (held * 8 * d + -(-held // pol["block"]) * SCORED_EXTRA)) + sliding_bytes(n, dims)
    if pol.get("scorer"):
        return (full * (HEADER + h * scored_held(pol, n) * (8 * d + SCORED_EXTRA) + rest_bytes(pol, h, d))
                + sliding_bytes(n, dims))
    s, p, f = spans(pol, n)
    heavy = 0
    if pol.get("heavy"):
        held = min(pol["heavy"], p) if held is None else held
        heavy = full * h * (held * (2 * d * 4 + 4 + 4) + f * 4)
    if not pol.get("low"):  # a calibrated codebook's tables: stored once per layer
        return (full * (HEADER + (s + f) * 2 * h * d * 4 + _packed_bytes(pol, p, h, d) + table_bytes(pol, d)) + heavy
                + sliding_bytes(n, dims))
    pairs = full * h
    lo = low_count(pol, pairs) if low_pairs is None else low_pairs
    return (full * (HEADER + (s + f) * 2 * h * d * 4) + lo * _packed_bytes({**pol, "middle": pol["low"]}, p, 1, d)
            + (pairs - lo) * _packed_bytes(pol, p, 1, d) + pairs + sliding_bytes(n, dims))


def reference_bytes(n: int, dims: dict) -> int:
    """DynamicCache in float32: every token on full-attention layers, the window on sliding ones."""
    return full_layers(dims) * n * 2 * dims["kv_heads"] * dims["head_dim"] * 4 + sliding_bytes(n, dims)


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
    if pol.get("dense"):  # a selective selection's dense storage holds every token: a uniform cache's flushes
        return next_change(dense_policy(pol), n)
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


def _group_bytes(cfg: dict, heads: int, g: int, d: int) -> int:
    """One group's payload bytes (header left out) under the audit's own encoder of ``cfg``'s kind,
    the same for two unlike inputs (a live middle's size is set by its shape)."""
    cfg = payload_config(cfg)  # a calibrated table is not in the payload
    sizes = set()
    for seed in (0, 1):
        x = (np.random.default_rng(seed).standard_normal((heads, 1, g, d)) * (1 + 9 * seed)).astype(np.float32)
        sizes.add(sum(int(a.nbytes) for k, a in encode_tensor(x, cfg).items() if k != "header"))
    if len(sizes) != 1:
        raise ValueError(f"quantizer {cfg}: its payload's size depends on the values ({sorted(sizes)} bytes)")
    return sizes.pop()


def packed_payload(x, pol: dict, name: str) -> dict:
    """The stored arrays (header left out) of the packed middle of K (``name = "k"``) or V holding
    ``x [H, p, D]``: one payload over the p tokens (the built-in layouts), or a codec's one payload
    per group of G tokens, ``x`` read as ``[H, p / G, G, D]``."""
    cfg = middle_config(pol, name)
    if pol["middle"] == "codec":
        h, p, d = x.shape
        x = x.reshape(h, p // pol["group"], pol["group"], d)
    return {k: v for k, v in encode_tensor(x, cfg).items() if k != "header"}


def middle_config(pol: dict, name: str) -> dict:
    """The quantizer config of the packed middle of K (``name = "k"``) or V, from the audit's policy table."""
    if pol["middle"] == "codec":
        return pol["codec"][name]
    if pol["middle"] in ("mxfp8", "mxfp4"):
        return {"kind": "mx", "element": "e4m3" if pol["middle"] == "mxfp8" else "e2m1", "block_size": 32, "rotation": None}
    axis = pol["key_axis"] if name == "k" else "token"
    return {"kind": "int_grouped", "bits": int(pol["middle"][3:]), "axis": axis,
            "group_size": pol["group"] if axis == "channel" else pol["feature_group"]}
