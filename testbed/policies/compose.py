"""A cache policy as a *selection* and a *storage*, and policies declared by their fields in a protocol.

Every policy answers two questions per (layer, KV head), as tokens arrive:

- **which tokens are kept, and in which region** (:class:`Selection`): ``"all"`` keeps every token
  (a float32 sink of the first S, or of the S most attended at the prefill; float32 heavy hitters
  inside the middle); ``"sink_window"`` keeps the first S and the newest W and drops the rest
  (StreamingLLM; S = 0 is the newest W only);
- **how each kept region is stored** (:class:`Storage`): the middle's scheme (float32, a grouped
  integer width or an MX element format), the float32 recent window R, the groups (G tokens per
  flush, K per channel or per token, V per token over groups of features) and, for per-head
  precision, the low scheme, its share of the (layer, KV head) pairs and the rule that allocates it.

:func:`compose` turns the two into the :class:`~testbed.policies.policy.Policy` the cache runs, and
:func:`decompose` takes any policy apart again; every preset round-trips exactly
(``tests/test_compose.py``). A protocol's ``policies`` list may name a preset or declare a policy
by its fields (:func:`declared`)::

    {"name": "int4_g64", "selection": {"kind": "all"},
     "storage": {"middle": "int4", "window": 128, "group": 64},
     "description": "KIVI-style int4 with K grouped over 64 tokens"}

Unset fields take the protocol's ``window`` (R, the storage's float32 window of an ``"all"``
selection), ``group`` (G) and ``evict_window`` (W, the ``"sink_window"`` selection's window); a
scored selection's ``keep`` may come from a ``budget`` (:func:`~testbed.policies.budget.budget_keep`, in
``budget.py`` with the rest of the budget arithmetic), and with ``"layers": "pyramid"`` vary over layers
(PyramidKV: ``keep`` is the mean, the budget the whole cache's), and with ``"heads": "adaptive"`` over a
layer's KV heads (Ada-KV: ``keep`` is the mean over the heads); every other field takes its default
below (no sink, K per channel, groups of 32 features, no per-head precision, no heavy hitters).
The audit states the same mapping on its own (``audit_checks/live_policies.py``, ``declared_policy``)
and re-derives the bytes and the schedule from the frozen fields: a new combination is a protocol
edit, not a code change.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields

from . import scorers
from .budget import as_bytes, budget_keep, selective_budget
from .policy import ADA_ALPHA, HEAD_SCHEDULES, LAYER_SCHEDULES, Policy, pyramid_keep
from .presets import PRESETS, preset

__all__ = ["Selection", "Storage", "SELECTIONS", "compose", "decompose", "declared", "policy_name", "policies_from",
           "RESERVED_NAMES", "check_scored_prefill"]

# which tokens a selection keeps: every one, or the first S and the newest W
SELECTIONS = ("all", "sink_window")
# arm names a declared policy may not take: the presets, the reference and the quanto peers
RESERVED_NAMES = re.compile(r"^(dynamic_cache|quanto_int\d+)$")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Selection:
    """Which tokens of each (layer, KV head) are kept, and which of them form the float32 regions.

    ``kind``: ``"all"`` or ``"sink_window"`` (:data:`SELECTIONS`); ``sink``: S tokens kept float32
    at the start (``sink_select``: ``"first"`` or ``"mass"``, the most attended at the prefill);
    ``window``: W, the newest tokens a ``"sink_window"`` selection keeps; ``heavy``: C tokens of a
    quantized middle kept float32, chosen by ``heavy_rule`` (``"attention"``: H2O's accumulated
    attention; ``"first"``: the oldest, a control; ``"oracle"``: the whole segment's attention).

    A scored selection: ``kind`` a scorer of :mod:`testbed.policies.scorers` (``"knorm"``,
    ``"random"``, ...) or ``"file.py:Class"``; it keeps ``keep`` tokens per (layer, KV head): the
    newest ``window`` always (H2O's recent tokens; 0: none), the rest of largest score, deciding at
    the prefill only (``mode="prefill"``) or as every token arrives (``"online"``); ``seed`` for a
    seeded scorer. ``layers``: ``"uniform"`` (``keep`` at every layer) or ``"pyramid"`` (PyramidKV,
    prefill mode only: ``keep`` is the mean over layers, low layers keep more and high layers fewer,
    steepness ``beta``; :func:`~testbed.policies.policy.pyramid_keep`). ``heads``: ``"uniform"``
    (``keep`` per KV head) or ``"adaptive"`` (Ada-KV, prefill mode only: the layer keeps ``keep x``
    KV heads tokens, each head at least its own top ``safeguard_count(keep, alpha)``, the rest the
    layer's top scores over every head; :mod:`testbed.policies.scored`) or ``"selective"`` (the seed's
    rule, prefill mode only: ``round(sparse_share x pairs)`` of the model's (layer, KV head) pairs keep
    the scorer's top ``keep``, the rest every token, the sparse pairs chosen at the prefill's end by
    ``alloc`` -- ``"concentrated"`` (the seed's rule), ``"diffuse"`` (reversed), ``"random"``
    (content-blind), ``"late"`` -- from ``alloc_from``, ``"prefill"`` or ``"oracle"``, the whole
    segment's attention; with a ``budget``, ``sparse_share`` from it, :func:`selective_budget`; a
    storage ``middle`` other than float32 stores the dense pairs so, its ``window`` R float32,
    ``Policy.dense``).
    ``block``: B, a prefill-mode selection of one count keeps the top ``keep / B`` blocks of B
    consecutive prefill tokens by summed score, one int32 index and one float32 score per block of
    held tokens counted (0: per token; :func:`~testbed.policies.scorers.keep_blocks`)."""

    kind: str = "all"
    sink: int = 0
    sink_select: str = "first"
    window: int = 0
    heavy: int = 0
    heavy_rule: str = "attention"
    keep: int = 0
    mode: str = "online"
    seed: int = 0
    layers: str = "uniform"
    beta: int = 20
    heads: str = "uniform"
    alpha: float = ADA_ALPHA
    alloc: str | None = None
    alloc_from: str = "prefill"
    sparse_share: float = 0.0
    block: int = 0


@dataclass(frozen=True)
class Storage:
    """How the kept tokens are stored: the sink, the heavy hitters and the newest ``window`` (R)
    tokens float32; the rest (the middle) with ``middle`` (a scheme of
    :data:`~testbed.policies.policy.MIDDLE_SCHEMES` other than ``"drop"``), moved in whole groups
    of ``group`` tokens; K per ``key_axis``, V per token over ``feature_group`` features; per-head
    precision: ``low`` for ``round(low_share x pairs)`` pairs, chosen by ``alloc`` from
    ``alloc_from``; ``key_rope``: keys stored after the rotary embedding (``"post"``, the default)
    or before it (``"pre"``, rotated at every read; :class:`~testbed.policies.policy.Policy`)."""

    middle: str = "float32"
    window: int = 0
    group: int = 32
    feature_group: int = 32
    key_axis: str = "channel"
    low: str | None = None
    low_share: float = 0.0
    alloc: str | None = None
    alloc_from: str = "prefill"
    key_rope: str = "post"
    rest: str | None = None
    codec: dict | None = field(default=None, hash=False)


def compose(name: str, selection: Selection, storage: Storage, description: str = "", *,
            layer_keep: tuple = ()) -> Policy:
    """The policy that keeps ``selection``'s tokens stored as ``storage`` says (validated by
    :class:`Policy`; a ``"sink_window"`` selection keeps its tokens float32 and has no middle).
    ``layer_keep``: a pyramid's kept count per layer (:func:`declared` derives it)."""
    s, t = selection, storage
    if t.codec is not None and (t.middle != "codec" or s.kind != "all"):
        raise ValueError(f"policy {name}: storage codec (the quantizers of K and V) is the middle 'codec' of an 'all' "
                         f"selection, got middle {t.middle!r} for selection {s.kind!r}")
    if s.layers not in LAYER_SCHEDULES:
        raise ValueError(f"policy {name}: selection layers must be one of {list(LAYER_SCHEDULES)}, got {s.layers!r}")
    if isinstance(s.beta, bool) or not isinstance(s.beta, int) or s.beta < 1:
        raise ValueError(f"policy {name}: selection beta (the pyramid's steepness) must be an integer >= 1, "
                         f"got {s.beta!r}")
    if s.layers != "uniform" and s.kind in SELECTIONS:
        raise ValueError(f"policy {name}: a per-layer schedule (layers {s.layers!r}) belongs to a scored selection")
    if s.heads not in HEAD_SCHEDULES:
        raise ValueError(f"policy {name}: selection heads must be one of {list(HEAD_SCHEDULES)}, got {s.heads!r}")
    if (s.heads != "uniform" or s.alpha != ADA_ALPHA) and s.kind in SELECTIONS:
        raise ValueError(f"policy {name}: a per-head schedule (heads {s.heads!r}, alpha) belongs to a scored selection")
    if (s.alloc is not None or s.alloc_from != "prefill" or s.sparse_share) and s.heads != "selective":
        raise ValueError(f"policy {name}: selection alloc, alloc_from and sparse_share belong to the selective rule "
                         f"(heads 'selective'), got heads {s.heads!r}")
    if s.kind not in SELECTIONS and not (s.kind in scorers.SCORERS or scorers.is_user_scorer(s.kind)):
        raise ValueError(f"policy {name}: selection kind must be one of {list(SELECTIONS)}, a scorer "
                         f"({', '.join(scorers.SCORERS)}) or 'file.py:Class', got {s.kind!r}")
    if s.kind not in SELECTIONS:  # a scored selection: the top-keep tokens, float32 or stored by a storage
        store = t.middle != "float32"  # the kept set stored as a uniform storage stores a sequence of its length
        dense = store and s.heads == "selective"  # the selective rule's dense pairs stored so, its sparse ones float32
        if store and not dense and (t.middle == "drop" or s.mode != "prefill" or s.layers != "uniform"
                                    or s.heads != "uniform"):
            raise ValueError(f"policy {name}: a scored selection's kept tokens stored as {t.middle!r} need a quantized "
                             f"middle and a prefill-mode selection of one count at every layer and KV head (mode "
                             f"'prefill', layers and heads 'uniform'), got mode {s.mode!r}, layers {s.layers!r}, "
                             f"heads {s.heads!r}")
        if (t.window and not store) or t.low is not None or t.key_rope != "post":
            raise ValueError(f"policy {name}: a scored selection keeps its tokens float32 (storage middle 'float32', "
                             f"no window) or stored by a quantized middle (its window R float32), with no low scheme "
                             f"and post-RoPE keys, got middle {t.middle!r}, window {t.window}, key_rope {t.key_rope!r}")
        if s.sink or s.heavy or s.sink_select != "first":
            raise ValueError(f"policy {name}: a scored selection keeps its top-scored tokens and its newest window only "
                             "(no sink or heavy hitters)")
        modes = scorers.SCORERS[s.kind].MODES if s.kind in scorers.SCORERS else scorers.MODES
        if s.mode not in modes:
            raise ValueError(f"policy {name}: scorer {s.kind} decides {' or '.join(modes)}, not {s.mode!r}")
        need = getattr(scorers.SCORERS.get(s.kind), "WINDOW", 0)  # snapkv keeps its observation window whole
        if need and s.keep <= need:
            raise ValueError(f"policy {name}: {s.kind} keeps its last {need} prefill tokens first; keep must exceed "
                             f"{need}, got {s.keep}")
        if s.layers == "pyramid" and s.mode != "prefill":
            raise ValueError(f"policy {name}: a pyramid of per-layer budgets cuts the prefill once (PyramidKV, kvpress); "
                             f"mode must be 'prefill', got {s.mode!r}")
        if s.layers == "pyramid" and need and min(layer_keep or (s.keep,)) <= need:
            raise ValueError(f"policy {name}: {s.kind} keeps its last {need} prefill tokens first; every layer's keep "
                             f"must exceed {need}, got {list(layer_keep)}")
        # the per-head schedule's own checks (prefill only, alpha on an adaptive arm) are Policy._check_heads'
        pol = Policy(name, "drop", 0, s.window, t.group, t.feature_group, t.key_axis, scorer=s.kind, scorer_mode=s.mode,
                     keep=s.keep, seed=s.seed, description=description,
                     **({"store": t.middle, "store_window": t.window} if store and not dense else {}),
                     **({"dense": t.middle, "dense_window": t.window} if dense else {}),
                     **({"rest": t.rest} if t.rest is not None else {}),
                     **({"layers": s.layers, "beta": s.beta, "layer_keep": tuple(layer_keep)}
                        if s.layers != "uniform" else {}),
                     **({"heads": s.heads, "alpha": s.alpha} if s.heads != "uniform" or s.alpha != ADA_ALPHA else {}),
                     **({"alloc": s.alloc, "alloc_from": s.alloc_from, "sparse_share": s.sparse_share}
                        if s.heads == "selective" else {}),
                     **({"block": s.block} if s.block else {}))
        if s.kind in scorers.SCORERS:  # a user's class is read when its file is loaded (the cache's ScoredLayer)
            pol.always_kept(scorers.kept_first(s.kind))
        return pol
    if s.keep or s.seed or s.mode != "online" or s.beta != 20 or s.block:
        raise ValueError(f"policy {name}: keep, mode, seed, beta and block belong to a scored selection (kind a scorer)")
    if t.rest is not None:
        raise ValueError(f"policy {name}: storage rest (how a scored selection's dropped tokens are stored) belongs to "
                         "a scored selection")
    if s.kind == "sink_window":
        if t.middle != "float32" or t.low is not None:
            raise ValueError(f"policy {name}: a sink_window selection keeps its tokens float32 (storage middle "
                             f"'float32', no low scheme), got middle {t.middle!r}")
        if s.sink_select != "first" or s.heavy:
            raise ValueError(f"policy {name}: a sink_window selection keeps the first S tokens and no heavy hitters")
        if t.window:
            raise ValueError(f"policy {name}: a sink_window selection's kept window is the selection's window W; "
                             "leave the storage window at 0")
        return Policy(name, "drop", s.sink, s.window, t.group, t.feature_group, t.key_axis, key_rope=t.key_rope,
                      description=description)
    if s.window:
        raise ValueError(f"policy {name}: an 'all' selection keeps every token; its float32 recent window is the "
                         f"storage's window R (got selection window {s.window})")
    if t.middle == "drop":
        raise ValueError(f"policy {name}: 'drop' is a selection (kind 'sink_window'), not a storage scheme")
    return Policy(name, t.middle, s.sink, t.window, t.group, t.feature_group, t.key_axis, s.sink_select, t.low,
                  t.low_share, t.alloc, t.alloc_from, s.heavy, s.heavy_rule, key_rope=t.key_rope, description=description,
                  codec=t.codec)


def decompose(policy: Policy) -> tuple[Selection, Storage]:
    """The selection and storage of any policy: ``compose(p.name, *decompose(p), p.description) == p``."""
    p = policy
    if p.scored:
        return (Selection(p.scorer, window=p.window, keep=p.keep, mode=p.scorer_mode, seed=p.seed, layers=p.layers,
                          beta=p.beta, heads=p.heads, alpha=p.alpha, alloc=p.alloc, alloc_from=p.alloc_from,
                          sparse_share=p.sparse_share, block=p.block),
                Storage(p.store or p.dense or "float32", p.store_window if p.store else p.dense_window, p.group,
                        p.feature_group, p.key_axis, rest=p.rest))
    if p.evicts:
        return (Selection("sink_window", p.sink, p.sink_select, p.window, p.heavy, p.heavy_rule),
                Storage("float32", 0, p.group, p.feature_group, p.key_axis, key_rope=p.key_rope))
    return (Selection("all", p.sink, p.sink_select, 0, p.heavy, p.heavy_rule),
            Storage(p.middle, p.window, p.group, p.feature_group, p.key_axis, p.low, p.low_share, p.alloc, p.alloc_from,
                    p.key_rope, codec=p.codec))


def _fields_of(cls, given, where: str) -> dict:
    if not isinstance(given, dict):
        raise ValueError(f"{where} must be an object of {cls.__name__} fields, got {given!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; {cls.__name__} has {sorted(known)}")
    out = {}
    for key, value in given.items():
        want = known[key].type
        if key in ("low_share", "alpha", "sparse_share"):  # a share; 1/2 may be written 0.5
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}.{key}: expected a number, got {value!r}")
            value = float(value)
        elif want in ("int",) and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{where}.{key}: expected an integer, got {value!r}")
        elif want in ("str",) and not isinstance(value, str):
            raise ValueError(f"{where}.{key}: expected a string, got {value!r}")
        elif want == "str | None" and value is not None and not isinstance(value, str):
            raise ValueError(f"{where}.{key}: expected a string or null, got {value!r}")
        out[key] = value
    return out


def policy_name(entry) -> str:
    """The arm name of a protocol's ``policies`` entry: a preset's name, or a declared policy's ``name``."""
    return entry["name"] if isinstance(entry, dict) else entry


def declared(entry: dict, *, window: int, group: int, evict_window: int, where: str = "policy",
             budget: dict | None = None) -> Policy:
    """The policy a protocol declares by its fields (the module's docstring): ``name``,
    ``selection`` and ``storage`` objects, an optional ``description``; unset fields take the
    protocol's ``window`` (R), ``group`` (G) and ``evict_window`` (W). A scored selection's ``budget``
    (:func:`~testbed.policies.budget.budget_keep`) sets its ``keep`` from ``budget``: the study's
    ``prefill``, ``steps`` and the model's ``layers``, ``kv_heads``, ``head_dim`` (and ``tolerance``). A pyramid (selection
    ``layers: "pyramid"``) derives its per-layer counts from ``keep`` (its mean), the study's
    ``prefill`` and the model's ``layers``, so it needs ``budget`` for a known model without sliding
    layers, given ``keep`` or not. Raises ``ValueError`` naming the offending field."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a preset name or an object, got {entry!r}")
    unknown = sorted(set(entry) - {"name", "selection", "storage", "description", "budget"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; a declared policy has name, selection, storage, budget "
                         "and description")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{where}.name: a declared policy needs a name of letters, digits, '_', '.' or '-' "
                         f"(starting with a letter, at most 64), got {name!r}")
    if name in PRESETS or RESERVED_NAMES.match(name):
        raise ValueError(f"{where}.name: {name!r} is taken (a preset, the reference or a quanto peer); name the "
                         "declared policy by what it keeps")
    description = entry.get("description", "")
    if not isinstance(description, str):
        raise ValueError(f"{where}.description: expected a string, got {description!r}")
    sel = _fields_of(Selection, entry.get("selection", {}), f"{where}.selection")
    sto = _fields_of(Storage, entry.get("storage", {}), f"{where}.storage")
    codec = sto.get("codec")
    if codec is not None and not (isinstance(codec, dict) and all(isinstance(c, dict) for c in codec.values())):
        raise ValueError(f"{where} ({name}).storage.codec: a protocol states each quantizer by its config (an object "
                         f"with its \"kind\", as Quantizer.config() writes it), so that the audit can read it; got "
                         f"{codec!r}")
    if codec is not None:
        from .codec import normalize

        full = normalize(codec, f"{where} ({name}).storage.codec")
        if full != codec:  # the audit reads the protocol's config as written: every field stated
            raise ValueError(f"{where} ({name}).storage.codec: state every field of each quantizer, as "
                             f"Quantizer.config() writes it: {json.dumps(full)}")
    kind = sel.get("kind", "all")
    if kind == "sink_window":
        sel.setdefault("window", evict_window)
    elif kind == "all" and sto.get("middle", "float32") != "drop":
        sto.setdefault("window", window)
    elif kind != "sink_window" and sto.get("middle", "float32") not in ("float32", "drop"):
        sto.setdefault("window", window)  # a scored selection's kept set stored quantized: its float32 window R
    sto.setdefault("group", group)
    pyramid = sel.get("layers", "uniform") == "pyramid"
    if pyramid and kind in SELECTIONS:
        raise ValueError(f"{where} ({name}).selection: a per-layer schedule (layers 'pyramid') belongs to a scored "
                         f"selection, not {kind!r}")
    window_of = getattr(scorers.SCORERS.get(kind), "WINDOW", 0)  # the prefill tokens the scorer keeps first
    if pyramid and (budget is None or budget.get("layers") is None or budget.get("prefill") is None):
        raise ValueError(f"{where} ({name}): a pyramid's per-layer counts are derived from the study's prefill and the "
                         "model's layers: a live study of a known model without sliding layers (not a model given by "
                         "path, nor the retrieval study)")
    if pyramid and sel.get("mode", "online") != "prefill":
        raise ValueError(f"{where} ({name}).selection: a pyramid of per-layer budgets cuts the prefill once "
                         f"(PyramidKV, kvpress); mode must be 'prefill', got {sel.get('mode', 'online')!r}")
    beta = sel.get("beta", 20)
    if pyramid and (isinstance(beta, bool) or not isinstance(beta, int) or beta < 1):
        raise ValueError(f"{where} ({name}).selection.beta: the pyramid's steepness must be an integer >= 1, got {beta!r}")
    selective = sel.get("heads", "uniform") == "selective"
    if "budget" in entry and selective:  # the sparse pairs' share from the budget, at their kept count
        if budget is None or budget.get("layers") is None:
            raise ValueError(f"{where} ({name}): the selective rule's share of sparse pairs is derived from a budget "
                             "in bytes for a known model without sliding layers (the live study)")
        if "sparse_share" in sel or not isinstance(sel.get("keep"), int):
            raise ValueError(f"{where} ({name}): the selective rule with a budget takes the sparse pairs' kept count "
                             "(keep) and derives sparse_share from the budget; give keep, not sparse_share")
        given = as_bytes(entry["budget"], budget, window=window, group=group, evict_window=evict_window,
                         where=f"{where} ({name}).budget")
        dense = None  # the dense pairs' storage prices each of their tokens
        if sto.get("middle", "float32") not in ("float32", "drop"):
            dense = _storage_of(name + ".dense", sto, sto["middle"], sto["window"])
        sel["sparse_share"], sel["keep"] = selective_budget(given, sel["keep"], where=f"{where} ({name}).budget",
                                                            dense=dense, **budget)
    elif "budget" in entry and sel.get("block"):
        raise ValueError(f"{where} ({name}): a block selection keeps whole blocks; give keep (a multiple of block), "
                         "and a per-token arm its bytes as a budget in bytes_per_token")
    elif "budget" in entry:
        if kind == "all":
            raise ValueError(f"{where} ({name}): a budget sets the kept count of a scored or sink_window selection; "
                             "selection kind 'all' keeps every token")
        if "keep" in sel or (kind == "sink_window" and "window" in entry.get("selection", {})):
            raise ValueError(f"{where} ({name}): give either the kept count (keep, or a sink_window's window) or a "
                             "budget, not both")
        if budget is None:
            raise ValueError(f"{where} ({name}): a budget needs the study's context and model dimensions")
        entry = {**entry, "budget": as_bytes(entry["budget"], budget, window=window, group=group,
                                            evict_window=evict_window, where=f"{where} ({name}).budget")}
        if kind == "sink_window":  # the first S and the newest W, float32 K and V only: W from the budget
            held = budget_keep(entry["budget"], mode="online", where=f"{where} ({name}).budget", extra=0, **budget)
            if held <= sel.get("sink", 0):
                raise ValueError(f"{where} ({name}).budget: {held} tokens per (layer, KV head) leave no window "
                                 f"beside the sink of {sel.get('sink', 0)}")
            sel["window"] = held - sel.get("sink", 0)
        else:
            store = rest = None
            if sto.get("middle", "float32") not in ("float32", "drop"):  # the kept set's storage prices each token
                store = _storage_of(name + ".store", sto, sto["middle"], sto["window"])
            if sto.get("rest") is not None:  # the tokens not kept, stored quantized (MiKV)
                rest = _storage_of(name + ".rest", sto, sto["rest"], 0)
            sel["keep"] = budget_keep(entry["budget"], mode=sel.get("mode", "online"),
                                      where=f"{where} ({name}).budget", **budget, store=store, rest=rest,
                                      **({"pyramid_beta": beta, "pyramid_window": window_of} if pyramid else {}))
    layer_keep = ()
    if pyramid and isinstance(sel.get("keep"), int) and sel["keep"] >= 1:
        layer_keep = pyramid_keep(sel["keep"], budget["prefill"], budget["layers"], beta, window_of)
    try:
        return compose(name, Selection(**sel), Storage(**sto), description, layer_keep=layer_keep)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} ({name}): {e}") from None


def _storage_of(name: str, sto: dict, middle: str, window: int) -> Policy:
    """The uniform storage (no sink) that a declared storage's fields give a scored selection's stored
    kept set, quantized rest or stored dense class: ``middle``, the float32 ``window``, and the groups
    and key axis as :class:`Storage` fills them (the policy's own ``storage_policy``, ``rest_policy``
    and ``dense_policy`` once composed)."""
    d = Storage()
    return Policy(name, middle, 0, window, sto.get("group", d.group), sto.get("feature_group", d.feature_group),
                  sto.get("key_axis", d.key_axis))


def policies_from(entries, *, window: int, group: int, evict_window: int, sink: int,
                  where: str = "policies", budget: dict | None = None) -> list[Policy]:
    """The policies of a protocol's ``policies`` list: a preset's name (at the protocol's R, G, W and
    S) or a declared policy (:func:`declared`). Two entries of one name are refused."""
    out, seen = [], {}
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            try:
                pol = preset(entry, window=window, group=group, evict_window=evict_window, sink=sink)
            except ValueError as e:
                raise ValueError(f"{where}[{i}]: {e}") from None
        else:
            pol = declared(entry, window=window, group=group, evict_window=evict_window, where=f"{where}[{i}]",
                           budget=budget)
        if pol.name in seen:
            raise ValueError(f"{where}[{i}]: the arm {pol.name!r} is listed twice (also at index {seen[pol.name]})")
        seen[pol.name] = i
        out.append(pol)
    return out


def check_scored_prefill(pols, prefill: int, where: str) -> None:
    """Refuse (``ValueError``) a scored selection whose scorer reads more of the prefill's last queries
    than a prefill of ``prefill`` tokens has (snapkv's observation window of 64 needs at least 65)."""
    for pol in pols:
        need = getattr(scorers.SCORERS.get(pol.scorer), "WINDOW", 0) if pol.scored else 0
        if need and prefill <= need:
            raise ValueError(f"{where}: {pol.name}: {pol.scorer} observes the prefill's last {need} queries; a "
                             f"prefill of {prefill} tokens needs more than {need}")
