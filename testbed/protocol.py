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

from . import live, retrieval, retrieval_study
from .analyses import ANALYSES
from .resources import stores_p_payload
from .schema import Key, ProtocolError, Spec, check_object, check_value, key_name
from .sources import SOURCES

__all__ = ["ProtocolError", "load_protocol", "validate_protocol", "check_object", "check_value", "PROTOCOL_DIR",
           "default_protocols", "parse_json", "estimate_protocol"]

PROTOCOL_DIR = Path(__file__).resolve().parent.parent / "protocols"


TIMING = Spec("protocol timing", "Raw wall-time measurements (timings.json); never part of a result.", {
    "repeats": Key(("range", int, 0, 100), "timed repeats per arm, arm order shuffled per repeat", 3),
    "seed": Key(int, "seed of the shuffle", 0),
})
AUDIT = Spec("protocol audit", "The tolerances the audit re-derives this study's numbers with: "
             "|reported - derived| <= atol + rtol * |derived|.", {
    "rtol": Key(("range", float, 0.0, 1.0), "relative tolerance", 1e-6),
    "atol": Key(("range", float, 0.0, 1.0), "absolute tolerance", 1e-9),
})
_COMMON = {
    "description": Key(str, "what the study asks, for the report", ""),
    "default": Key(bool, "run it when python -m testbed.run has no --protocol", False),
    "timing": Key(dict, "timings", {}, see=TIMING),
    "audit": Key(dict, "audit tolerances", {}, see=AUDIT),
}
NAME_RULE = "name is letters, digits and underscores (it names the study's folders)"
ATTENTION = Spec("protocol (attention study)", "A protocol file: a JSON object. Every key is checked before "
                 "anything runs; relative paths inside it resolve against the folder of the protocol file.", {
    "name": Key(str, "the study's name"),
    "source": Key(dict, "which Cases to make: an object whose \"kind\" is one of the sources below"),
    "analyses": Key(dict, "what to measure on each Case: {analysis name: its parameters object}, at least one"),
    "kind": Key(("choice", ("attention", "live", "retrieval")), "attention (the default; the keys of this table), live "
                "(see the live study) or retrieval (see the retrieval study): the other kinds have their own tables",
                "attention"),
    **_COMMON,
}, rules=(NAME_RULE,))
LIVE = Spec("protocol (live study)", "A protocol with \"kind\": \"live\": policies inside the model.", {
    "name": Key(str, "the study's name"),
    "kind": Key(("choice", ("live",)), "live"),
    "live": Key(dict, "the study", see=live.SPEC),
    **_COMMON,
}, rules=(NAME_RULE,))
RETRIEVAL = Spec("protocol (retrieval study)", "A protocol with \"kind\": \"retrieval\": needle retrieval through the "
                 "cache policies inside the model.", {
    "name": Key(str, "the study's name"),
    "kind": Key(("choice", ("retrieval",)), "retrieval"),
    "retrieval": Key(dict, "the study", see=retrieval.SPEC),
    **_COMMON,
}, rules=(NAME_RULE,))


def validate_protocol(raw: Any, where: str = "protocol") -> dict:
    if isinstance(raw, dict) and raw.get("kind") == "live":
        return _validate_live(raw, where)
    if isinstance(raw, dict) and raw.get("kind") == "retrieval":
        return _validate_retrieval(raw, where)
    proto = ATTENTION.check(raw, where)
    _check_name(proto, where)
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
    _check_archive(proto, where)
    return _common(proto, where)


def _check_archive(proto: dict, where: str) -> None:
    """A source that keeps only part of its arrays (``archive``) needs analyses whose rows the audit
    can re-derive from per-row statistics: today the ablation analysis on the float32 arm."""
    if proto["source"].get("archive") is None:
        return
    others = sorted(set(proto["analyses"]) - {"ablation"})
    if others:
        raise ProtocolError(f"{where}.source.archive: keeps only part of the arrays, which the analyses {others} need "
                            "(only the ablation analysis stores per-row statistics instead)")
    arms = [a["name"] for a in proto["analyses"]["ablation"]["kv_arms"]]
    if arms != ["float32"]:
        raise ProtocolError(f"{where}.source.archive: keeps only part of the arrays; the ablation's kv_arms must be "
                            f"the float32 arm alone (a quantized arm's payload is re-encoded from K/V), got {arms}")


def _check_name(proto: dict, where: str) -> None:
    if not proto["name"].replace("_", "").isalnum():
        raise ProtocolError(f"{where}.name: {proto['name']!r} must be letters, digits and underscores")


def _common(proto: dict, where: str) -> dict:
    proto["timing"] = TIMING.check(proto["timing"], f"{where}.timing")
    proto["audit"] = AUDIT.check(proto["audit"], f"{where}.audit")
    return proto


def _validate_live(raw: dict, where: str) -> dict:
    """A live study (``"kind": "live"``): policies inside a model, see :mod:`testbed.live`."""
    proto = LIVE.check(raw, where)
    _check_name(proto, where)
    proto["live"] = live.validate(proto["live"], f"{where}.live")
    return _common(proto, where)


def _validate_retrieval(raw: dict, where: str) -> dict:
    """A retrieval study (``"kind": "retrieval"``): see :mod:`testbed.retrieval_study`."""
    proto = RETRIEVAL.check(raw, where)
    _check_name(proto, where)
    proto["retrieval"] = retrieval.validate(proto["retrieval"], f"{where}.retrieval")
    return _common(proto, where)


def estimate_protocol(proto: dict, base: Path | None = None) -> int | None:
    """Peak bytes of a validated protocol's largest unit (a Case, or a live study's batch), or None
    when its source has no ``estimate_bytes`` hook (see :mod:`testbed.resources`). ``base``: the
    protocol file's folder, for a source that reads files named in the protocol (traces, a model
    given by path)."""
    if proto.get("kind") == "live":
        return int(live.estimate_bytes(proto["live"], base))
    if proto.get("kind") == "retrieval":
        return int(retrieval_study.estimate_bytes(proto["retrieval"]))
    kind = proto["source"]["kind"]
    hook = getattr(SOURCES.get(kind), "estimate_bytes", None)
    if hook is None:
        return None
    p_payload = stores_p_payload(proto.get("analyses"))
    return int(hook(proto["source"], base, p_payload=p_payload) if kind in ("trace", "capture")
               else hook(proto["source"], p_payload=p_payload))


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
