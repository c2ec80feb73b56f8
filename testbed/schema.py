"""Schema checks for protocol objects: the leaf every source, analysis and study validates with.

It imports nothing of the testbed, so :mod:`testbed.protocol` (which imports the source, analysis
and study registries) and the modules it registers never import each other in a cycle.
"""

from __future__ import annotations

import copy
import json
from typing import Any

__all__ = ["ProtocolError", "check_value", "check_object", "key_name", "Key", "Spec", "REQUIRED", "spec_type",
           "spec_allowed"]


class ProtocolError(ValueError):
    """A protocol that cannot be run; the message names the key."""


def _type_name(t) -> str:
    if isinstance(t, tuple):
        return " or ".join(_type_name(x) for x in t)
    return {int: "integer", float: "number", str: "string", bool: "boolean", list: "list", dict: "object"}.get(t, str(t))


def key_name(key: str) -> str:
    """A key as it appears in an error path: plain when it is a printable word, else quoted (so a key
    holding a newline cannot split the one-line error)."""
    return key if key and key.isprintable() and not any(c in key for c in " .[]'\"") else repr(key)


def check_value(value: Any, spec, where: str) -> Any:
    """Check one value against ``spec``: a type, ``("list", spec, min_len)``, ``("range", type, lo, hi)``
    or ``("choice", options)``."""
    if isinstance(spec, tuple) and spec and spec[0] == "list":
        _, inner, min_len = spec
        if not isinstance(value, list) or len(value) < min_len:
            raise ProtocolError(f"{where}: expected a list of at least {min_len} item(s), got {value!r}")
        out = [check_value(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
        # Protocol lists are the axes of a study grid: a repeated item would repeat cases, arms and
        # array names (and fail mid-run), so it is refused here by its index.
        seen: dict[str, int] = {}
        for i, v in enumerate(out):
            key = json.dumps(v, sort_keys=True, default=repr)
            if key in seen:
                raise ProtocolError(f"{where}[{i}]: {v!r} is listed twice (also at index {seen[key]})")
            seen[key] = i
        return out
    if isinstance(spec, tuple) and spec and spec[0] == "range":
        _, typ, lo, hi = spec
        check_value(value, typ, where)
        if not (lo <= value <= hi):
            raise ProtocolError(f"{where}: {value!r} is outside [{lo}, {hi}]")
        return value
    if isinstance(spec, tuple) and spec and spec[0] == "choice":
        if value not in spec[1]:
            raise ProtocolError(f"{where}: {value!r} is not one of {list(spec[1])}")
        return value
    if spec is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object, got {type(value).__name__}")
        return value
    types = spec if isinstance(spec, tuple) else (spec,)
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ProtocolError(f"{where}: expected {_type_name(spec)}, got {type(value).__name__} {value!r}")
    return value


def check_object(obj: Any, where: str, required: dict, optional: dict | None = None) -> dict:
    """Check that ``obj`` has exactly the ``required`` keys plus any of ``optional`` (name -> (spec, default))."""
    optional = optional or {}
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where}: expected an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        raise ProtocolError(f"{where}.{key_name(unknown[0])}: unknown key "
                            f"(allowed: {', '.join(sorted(set(required) | set(optional)))})")
    out = {}
    for key, spec in required.items():
        if key not in obj:
            raise ProtocolError(f"{where}.{key}: missing required key")
        out[key] = check_value(obj[key], spec, f"{where}.{key}")
    for key, (spec, default) in optional.items():
        out[key] = check_value(obj[key], spec, f"{where}.{key}") if key in obj else default
    return out


# -- declarative specs: one table per object, used to validate it and to describe it -------------

REQUIRED = object()  # the default of a key that must be given


class Key:
    """One key of a protocol object: its spec (as :func:`check_value` takes it), its default
    (``REQUIRED`` for none) and what it means. ``see`` names a nested :class:`Spec` that describes
    the object (or each object of the list) the key holds."""

    __slots__ = ("spec", "default", "doc", "see")

    def __init__(self, spec, doc: str, default=REQUIRED, see: "Spec | None" = None):
        self.spec, self.default, self.doc, self.see = spec, default, doc, see

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


class Spec:
    """The keys of one protocol object, in the order they are checked, plus the rules between
    keys that a table cannot hold (``rules``: one sentence each; the code that enforces them sits
    next to the spec, in the module's ``validate``)."""

    def __init__(self, title: str, doc: str, keys: dict[str, Key], rules: tuple[str, ...] = ()):
        self.title, self.doc, self.keys, self.rules = title, doc, keys, tuple(rules)

    @property
    def required(self) -> dict:
        return {k: key.spec for k, key in self.keys.items() if key.required}

    @property
    def optional(self) -> dict:
        # a fresh copy of each default per call: a validated protocol never shares a list with another
        return {k: (key.spec, copy.deepcopy(key.default)) for k, key in self.keys.items() if not key.required}

    def check(self, obj: Any, where: str) -> dict:
        """Validate ``obj`` against the table (unknown and missing keys, types, ranges, choices)."""
        return check_object(obj, where, self.required, self.optional)


def spec_type(spec) -> str:
    """The type of a value spec in words: ``integer``, ``list of string``, ``integer or null``."""
    if isinstance(spec, tuple) and spec and spec[0] == "list":
        return f"list of {spec_type(spec[1])}"
    if isinstance(spec, tuple) and spec and spec[0] == "range":
        return spec_type(spec[1])
    if isinstance(spec, tuple) and spec and spec[0] == "choice":
        kinds = sorted({spec_type(type(o)) for o in spec[1]})
        return " or ".join(kinds)
    if isinstance(spec, tuple):
        return " or ".join(spec_type(t) for t in spec)
    if spec is type(None):
        return "null"
    return _type_name(spec)


def spec_allowed(spec) -> str:
    """The values a spec allows beyond its type, in words ("" when any value of the type)."""
    if isinstance(spec, tuple) and spec and spec[0] == "list":
        inner = spec_allowed(spec[1])
        return f"at least {spec[2]} item(s), none repeated" + (f"; each {inner}" if inner else "")
    if isinstance(spec, tuple) and spec and spec[0] == "range":
        return f"{spec[2]!r} to {spec[3]!r}"
    if isinstance(spec, tuple) and spec and spec[0] == "choice":
        return "one of " + ", ".join(json.dumps(o) for o in spec[1])
    return ""
