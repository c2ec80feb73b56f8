"""Frozen study protocols: loading and schema validation.

A protocol is a JSON object::

    {"name": "residual_window", "default": true, "description": "...",
     "source": {"kind": "synthetic", ...},            # which Cases to make
     "analyses": {"residual_window": {...}, ...},     # what to measure on each Case
     "timing": {"repeats": 3, "seed": 0},             # raw timings, arm order shuffled per repeat
     "audit": {"rtol": 1e-6, "atol": 1e-9}}           # tolerances the audit applies

Every key is checked before anything runs; an error names the offending key by its path
(``source.seeds[2]``), so a malformed protocol is one clear line and nothing is written. Lists are
the axes of a study grid, so a repeated item is refused too. The JSON
itself is read strictly: UTF-8, no duplicate keys (``json`` would silently keep the last one),
no NaN/Infinity literals, no absurd nesting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ProtocolError", "load_protocol", "validate_protocol", "check_object", "PROTOCOL_DIR", "default_protocols",
           "parse_json"]

PROTOCOL_DIR = Path(__file__).resolve().parent.parent / "protocols"


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


def validate_protocol(raw: Any, where: str = "protocol") -> dict:
    from .analyses import ANALYSES
    from .sources import SOURCES

    proto = check_object(
        raw, where,
        required={"name": str, "source": dict, "analyses": dict},
        optional={
            "description": (str, ""),
            "default": (bool, False),
            "timing": (dict, {}),
            "audit": (dict, {}),
        },
    )
    if not proto["name"].replace("_", "").isalnum():
        raise ProtocolError(f"{where}.name: {proto['name']!r} must be letters, digits and underscores")
    kind = proto["source"].get("kind")
    if not isinstance(kind, str) or kind not in SOURCES:
        raise ProtocolError(f"{where}.source.kind: {kind!r} is not one of {sorted(SOURCES)}")
    proto["source"] = SOURCES[kind].validate(proto["source"], f"{where}.source")
    if not proto["analyses"]:
        raise ProtocolError(f"{where}.analyses: at least one analysis is required")
    analyses = {}
    for name, params in proto["analyses"].items():
        if name not in ANALYSES:
            raise ProtocolError(f"{where}.analyses.{key_name(name)}: unknown analysis (known: {', '.join(sorted(ANALYSES))})")
        analyses[name] = ANALYSES[name].validate(params, f"{where}.analyses.{name}")
    proto["analyses"] = analyses
    proto["timing"] = check_object(proto["timing"], f"{where}.timing", {}, {
        "repeats": (("range", int, 0, 100), 3), "seed": (int, 0)})
    proto["audit"] = check_object(proto["audit"], f"{where}.audit", {}, {
        "rtol": (("range", float, 0.0, 1.0), 1e-6), "atol": (("range", float, 0.0, 1.0), 1e-9)})
    return proto


def _strict_pairs(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _no_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes, where: str):
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity; errors are one ProtocolError line."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_strict_pairs, parse_constant=_no_constant)
    except RecursionError:
        raise ProtocolError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ProtocolError(f"{where}: not valid JSON ({e})") from None


def load_protocol(path: str | Path) -> tuple[dict, bytes]:
    """Read and validate a protocol file; returns (validated protocol, raw bytes)."""
    path = Path(path)
    if path.is_dir():
        raise ProtocolError(f"{path}: is a folder, not a protocol file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ProtocolError(f"{path}: cannot read protocol ({e.strerror})") from None
    data = parse_json(raw, str(path))
    return validate_protocol(data, where=path.name), raw


def default_protocols() -> list[Path]:
    """Every protocol in ``protocols/`` marked ``"default": true``, in name order."""
    out = []
    for p in sorted(PROTOCOL_DIR.glob("*.json")):
        try:
            data = parse_json(p.read_bytes(), str(p))
        except OSError as e:
            raise ProtocolError(f"{p}: cannot read protocol ({e.strerror})") from None
        if isinstance(data, dict) and data.get("default") is True:
            out.append(p)
    return out
