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

Unset fields take the protocol's ``window`` (R, a storage field), ``group`` (G) and
``evict_window`` (W, the ``"sink_window"`` selection's window); every other field takes its default
below (no sink, K per channel, groups of 32 features, no per-head precision, no heavy hitters).
The audit states the same mapping on its own (``audit_checks/live_quality.py``, ``declared_policy``)
and re-derives the bytes and the schedule from the frozen fields: a new combination is a protocol
edit, not a code change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from .policy import PRESETS, Policy, preset

__all__ = ["Selection", "Storage", "SELECTIONS", "compose", "decompose", "declared", "policy_name", "policies_from",
           "RESERVED_NAMES"]

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
    attention; ``"first"``: the oldest, a control; ``"oracle"``: the whole segment's attention)."""

    kind: str = "all"
    sink: int = 0
    sink_select: str = "first"
    window: int = 0
    heavy: int = 0
    heavy_rule: str = "attention"


@dataclass(frozen=True)
class Storage:
    """How the kept tokens are stored: the sink, the heavy hitters and the newest ``window`` (R)
    tokens float32; the rest (the middle) with ``middle`` (a scheme of
    :data:`~testbed.policies.policy.MIDDLE_SCHEMES` other than ``"drop"``), moved in whole groups
    of ``group`` tokens; K per ``key_axis``, V per token over ``feature_group`` features; per-head
    precision: ``low`` for ``round(low_share x pairs)`` pairs, chosen by ``alloc`` from
    ``alloc_from``."""

    middle: str = "float32"
    window: int = 0
    group: int = 32
    feature_group: int = 32
    key_axis: str = "channel"
    low: str | None = None
    low_share: float = 0.0
    alloc: str | None = None
    alloc_from: str = "prefill"


def compose(name: str, selection: Selection, storage: Storage, description: str = "") -> Policy:
    """The policy that keeps ``selection``'s tokens stored as ``storage`` says (validated by
    :class:`Policy`; a ``"sink_window"`` selection keeps its tokens float32 and has no middle)."""
    s, t = selection, storage
    if s.kind not in SELECTIONS:
        raise ValueError(f"policy {name}: selection kind must be one of {list(SELECTIONS)}, got {s.kind!r}")
    if s.kind == "sink_window":
        if t.middle != "float32" or t.low is not None:
            raise ValueError(f"policy {name}: a sink_window selection keeps its tokens float32 (storage middle "
                             f"'float32', no low scheme), got middle {t.middle!r}")
        if s.sink_select != "first" or s.heavy:
            raise ValueError(f"policy {name}: a sink_window selection keeps the first S tokens and no heavy hitters")
        if t.window:
            raise ValueError(f"policy {name}: a sink_window selection's kept window is the selection's window W; "
                             "leave the storage window at 0")
        return Policy(name, "drop", s.sink, s.window, t.group, t.feature_group, t.key_axis, description=description)
    if s.window:
        raise ValueError(f"policy {name}: an 'all' selection keeps every token; its float32 recent window is the "
                         f"storage's window R (got selection window {s.window})")
    if t.middle == "drop":
        raise ValueError(f"policy {name}: 'drop' is a selection (kind 'sink_window'), not a storage scheme")
    return Policy(name, t.middle, s.sink, t.window, t.group, t.feature_group, t.key_axis, s.sink_select, t.low,
                  t.low_share, t.alloc, t.alloc_from, s.heavy, s.heavy_rule, description)


def decompose(policy: Policy) -> tuple[Selection, Storage]:
    """The selection and storage of any policy: ``compose(p.name, *decompose(p), p.description) == p``."""
    p = policy
    if p.evicts:
        return (Selection("sink_window", p.sink, p.sink_select, p.window, p.heavy, p.heavy_rule),
                Storage("float32", 0, p.group, p.feature_group, p.key_axis))
    return (Selection("all", p.sink, p.sink_select, 0, p.heavy, p.heavy_rule),
            Storage(p.middle, p.window, p.group, p.feature_group, p.key_axis, p.low, p.low_share, p.alloc, p.alloc_from))


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
        if key == "low_share":  # a share; 1/2 may be written 0.5
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


def declared(entry: dict, *, window: int, group: int, evict_window: int, where: str = "policy") -> Policy:
    """The policy a protocol declares by its fields (the module's docstring): ``name``,
    ``selection`` and ``storage`` objects, an optional ``description``; unset fields take the
    protocol's ``window`` (R), ``group`` (G) and ``evict_window`` (W). Raises ``ValueError`` naming
    the offending field."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a preset name or an object, got {entry!r}")
    unknown = sorted(set(entry) - {"name", "selection", "storage", "description"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; a declared policy has name, selection, storage and "
                         "description")
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
    kind = sel.get("kind", "all")
    if kind == "sink_window":
        sel.setdefault("window", evict_window)
    elif sto.get("middle", "float32") != "drop":
        sto.setdefault("window", window)
    sto.setdefault("group", group)
    try:
        return compose(name, Selection(**sel), Storage(**sto), description)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} ({name}): {e}") from None


def policies_from(entries, *, window: int, group: int, evict_window: int, sink: int,
                  where: str = "policies") -> list[Policy]:
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
            pol = declared(entry, window=window, group=group, evict_window=evict_window, where=f"{where}[{i}]")
        if pol.name in seen:
            raise ValueError(f"{where}[{i}]: the arm {pol.name!r} is listed twice (also at index {seen[pol.name]})")
        seen[pol.name] = i
        out.append(pol)
    return out
