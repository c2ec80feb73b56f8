"""Schema checks for protocol objects: the leaf every source, analysis and study validates with.

It imports nothing of the testbed, so :mod:`testbed.protocol` (which imports the source, analysis
and study registries) and the modules it registers never import each other in a cycle.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["ProtocolError", "check_value", "check_object", "key_name"]


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
