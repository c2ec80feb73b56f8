"""Trace files: captured attention saved by one machine and analysed by another.

A trace file is a `safetensors <https://huggingface.co/docs/safetensors>`_ file (no pickle) that
holds one or more records, each one `Case`:

- tensors ``<id>/q [H, Tq, D]``, ``<id>/k [H_kv, Tk, D]``, ``<id>/v [H_kv, Tk, D]`` in float32,
  float16 or bfloat16 (loaded as float32; ``H % H_kv == 0``, consecutive query heads share a KV
  head), and ``<id>/query_positions [Tq]`` int64 or int32: the key-axis index of each query;
- one metadata entry ``"testbed.trace"``, a JSON object::

    {"version": 1,
     "records": [{"id": "calm_static-L23-c07-s3",        # letters, digits, - _ . (no '/')
                  "causal": false,                       # true: query i sees keys 0..query_positions[i]
                  "layout": [{"name": "sink", "start": 0, "stop": 1560},
                             {"name": "recent", "start": 1560, "stop": 3900},
                             {"name": "current", "start": 3900, "stop": 6240}],
                  "tokens_per_frame": 390,               # or null
                  "meta": {"model": "...", "prompt": "...", "layer": 23, "chunk": 7, "step": 3, ...}}]}

``layout`` names contiguous spans that cover the key axis in physical order (an LLM stream:
``sink | middle | recent | current``; a video-diffusion cache: ``sink | recent | current`` frames).
``meta`` is free JSON; ``model``, ``prompt``, ``layer``, ``chunk`` and ``step`` are the keys the
reports group by (``step``: the denoising step of a diffusion model, 0 for an LLM prefill).

`load_trace` validates everything (tensor names, dtypes, shapes, finite values, a layout that
covers the key axis) and raises `TraceError` naming the file, the record and the field. The source
kind ``"trace"`` runs a protocol over trace files.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ..evidence import sha256_file
from ..case import Case, Region
from ..resources import attention_chain_bytes
from ..schema import Key, ProtocolError, Spec

__all__ = ["TraceError", "METADATA_KEY", "VERSION", "save_trace", "load_trace", "iter_trace", "validate", "cases",
           "estimate_bytes", "SPEC"]

METADATA_KEY = "testbed.trace"
VERSION = 1
FIELDS = ("q", "k", "v", "query_positions")
_ID = re.compile(r"^[A-Za-z0-9_.\-]+$")


class TraceError(ValueError):
    """A trace file that cannot be turned into Cases; the message names file, record and field."""


def save_trace(path: str | Path, cases: Iterable[Case]) -> Path:
    """Write ``cases`` to one trace file (atomically: a temporary sibling renamed into place)."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    records = []
    for case in cases:
        if not _ID.match(case.id) or case.id in {r["id"] for r in records}:
            raise TraceError(f"{path.name}: record id {case.id!r} is not a unique name of letters, digits, '-', '_', '.'")
        for name in FIELDS:
            t = getattr(case, name).detach().cpu().contiguous()
            tensors[f"{case.id}/{name}"] = t.to(torch.int64) if name == "query_positions" else t
        try:
            meta = json.loads(json.dumps(case.meta, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise TraceError(f"{path.name}: record {case.id!r}: meta is not plain JSON ({e})") from None
        records.append({"id": case.id, "causal": bool(case.causal), "layout": case.layout_json(),
                        "tokens_per_frame": case.tokens_per_frame, "meta": meta})
    if not records:
        raise TraceError(f"{path.name}: no cases to save")
    header = json.dumps({"version": VERSION, "records": records}, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={METADATA_KEY: header})
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates it 0600; a trace is data to share, like any file
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _umask() -> int:
    """The process umask (read from /proc where it can be, so it is never changed, even briefly)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fail(path: Path, msg: str) -> TraceError:
    return TraceError(f"{path.name}: {msg}")


# safetensors dtype codes accepted for each field, with the names the errors use.
_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_FLOAT_CODES = ("F32", "F16", "BF16")
_INT_CODES = ("I64", "I32")


def _open(path: Path):
    from safetensors import safe_open

    if not path.is_file():
        raise _fail(path, f"no such trace file ({path})")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise _fail(path, f"not a readable safetensors file ({type(e).__name__}: {e})") from None


def _check_layout(path: Path, rid: str, layout) -> tuple[Region, ...]:
    where = f"record {rid!r}: layout"
    if not isinstance(layout, list) or not layout:
        raise _fail(path, f"{where} must be a non-empty list of {{name, start, stop}}")
    out = []
    for i, r in enumerate(layout):
        if not isinstance(r, dict) or set(r) != {"name", "start", "stop"}:
            raise _fail(path, f"{where}[{i}] must be an object with exactly name, start, stop; got {r!r}")
        if not isinstance(r["name"], str) or not r["name"]:
            raise _fail(path, f"{where}[{i}].name must be a non-empty string")
        for key in ("start", "stop"):
            if not isinstance(r[key], int) or isinstance(r[key], bool) or r[key] < 0:
                raise _fail(path, f"{where}[{i}].{key} must be a non-negative integer, got {r[key]!r}")
        out.append(Region(r["name"], r["start"], r["stop"]))
    return tuple(out)


def _records(path: Path, f) -> list[dict]:
    """Validate the header and every record's tensor names, dtypes and ranks; nothing is read yet."""
    meta = f.metadata() or {}
    if METADATA_KEY not in meta:
        raise _fail(path, f"metadata has no {METADATA_KEY!r} entry (not a testbed trace; see testbed/sources/traces.py)")
    try:
        header = json.loads(meta[METADATA_KEY])
    except json.JSONDecodeError as e:
        raise _fail(path, f"metadata {METADATA_KEY!r} is not valid JSON ({e})") from None
    if not isinstance(header, dict) or header.get("version") != VERSION:
        got = header.get("version") if isinstance(header, dict) else type(header).__name__
        raise _fail(path, f"trace version {got!r} is not the supported {VERSION}")
    records = header.get("records")
    if not isinstance(records, list) or not records:
        raise _fail(path, "metadata 'records' must be a non-empty list")
    keys = set(f.keys())
    used, ids, out = set(), set(), []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise _fail(path, f"records[{i}] must be an object")
        unknown = set(rec) - {"id", "causal", "layout", "tokens_per_frame", "meta"}
        if unknown:
            raise _fail(path, f"records[{i}] has unknown key(s) {sorted(unknown)}")
        rid = rec.get("id")
        if not isinstance(rid, str) or not _ID.match(rid) or rid in ids:
            raise _fail(path, f"records[{i}].id {rid!r} must be a unique name of letters, digits, '-', '_', '.'")
        ids.add(rid)
        if not isinstance(rec.get("causal"), bool):
            raise _fail(path, f"record {rid!r}: causal must be true or false, got {rec.get('causal')!r}")
        tpf = rec.get("tokens_per_frame")
        if tpf is not None and (not isinstance(tpf, int) or isinstance(tpf, bool)):
            raise _fail(path, f"record {rid!r}: tokens_per_frame must be an integer or null, got {tpf!r}")
        rmeta = rec.get("meta", {})
        if not isinstance(rmeta, dict):
            raise _fail(path, f"record {rid!r}: meta must be an object")
        layout = _check_layout(path, rid, rec.get("layout"))
        for name in FIELDS:
            key = f"{rid}/{name}"
            if key not in keys:
                raise _fail(path, f"record {rid!r}: tensor {key!r} is missing")
            used.add(key)
            sl = f.get_slice(key)
            code, rank = sl.get_dtype(), len(sl.get_shape())
            dname = _DTYPE_NAMES.get(code, code)
            if name == "query_positions":
                if code not in _INT_CODES or rank != 1:
                    raise _fail(path, f"record {rid!r}: {name} must be a 1-D int64/int32 tensor, got {dname} "
                                      f"{tuple(sl.get_shape())}")
            elif code not in _FLOAT_CODES:
                raise _fail(path, f"record {rid!r}: {name} has dtype {dname}; expected float32, float16 or bfloat16")
        out.append({"id": rid, "causal": rec["causal"], "layout": layout, "tokens_per_frame": tpf, "meta": rmeta})
    extra = sorted(keys - used)
    if extra:
        raise _fail(path, f"tensor(s) {extra[:3]} belong to no record")
    return out


def iter_trace(path: str | Path) -> Iterator[Case]:
    """Validate a trace file's header and tensor table, then read and validate one record at a time
    (so a large trace never has to fit in memory at once). Yields Cases with float32 q, k, v."""
    path = Path(path)
    with _open(path) as f:
        for rec in _records(path, f):
            rid = rec["id"]
            fields = {}
            for name in FIELDS:
                t = f.get_tensor(f"{rid}/{name}")
                fields[name] = t.to(torch.int64) if name == "query_positions" else t.to(torch.float32)
            try:
                yield Case(**rec, **fields)
            except ValueError as e:
                raise _fail(path, f"record {rid!r}: {e}") from None


def load_trace(path: str | Path) -> list[Case]:
    """Read and validate a whole trace file; returns its Cases (q, k, v as float32) in file order."""
    return list(iter_trace(path))


# -- the source ---------------------------------------------------------------------------



def _resolve(p: str, base: Path | None) -> Path:
    """A trace path as the protocol wrote it, resolved against the protocol file's folder ``base``
    (the current folder when there is no protocol file)."""
    path = Path(p).expanduser()
    return path if path.is_absolute() or base is None else Path(base) / path


SPEC = Spec("source: trace", "Cases from trace files (safetensors, module docstring of testbed/sources/traces.py), "
            "e.g. written by examples/capture_any_model.py on another machine.", {
    "kind": Key(("choice", ("trace",)), "the source kind"),
    "files": Key(("list", str, 1), "trace files; a relative path is relative to the folder of the protocol file "
                                   "(not the current folder), ~ is expanded"),
    "records": Key(("list", str, 1), "record ids to keep (each must exist); omitted: every record", None),
}, rules=("no file path is empty",))


def validate(params: dict, where: str) -> dict:
    p = SPEC.check(params, where)
    for i, f in enumerate(p["files"]):
        if not f:
            raise ProtocolError(f"{where}.files[{i}]: empty path")
    return p


def estimate_bytes(params: dict, base: Path | None = None, p_payload: bool = True) -> int:
    """Peak bytes of the largest record, from the safetensors headers alone (nothing is loaded);
    ``base``: the protocol file's folder.

    A file that cannot be read counts 0 here; loading it then fails with its own clear error."""
    from safetensors import safe_open

    best = 0
    for f in params["files"]:
        try:
            with safe_open(str(_resolve(f, base)), framework="pt") as fh:
                shapes = {key: fh.get_slice(key).get_shape() for key in fh.keys()}
        except Exception:  # noqa: BLE001 - reported properly by load_trace
            continue
        for key, shape in shapes.items():
            if key.endswith("/q") and len(shape) == 3:
                k = shapes.get(key[:-2] + "/k")
                if k is not None and len(k) == 3:
                    best = max(best, attention_chain_bytes(shape[0], k[0], shape[1], k[1], shape[2],
                                                                   p_payload=p_payload))
    return best


def cases(params: dict, ctx=None) -> Iterator[Case]:
    """Cases from trace files (relative paths against ``ctx.base``, the protocol file's folder); each
    case's meta gains ``trace_file`` and ``trace_sha256``."""
    wanted = None if params.get("records") is None else set(params["records"])
    seen, listing = set(), []
    base = getattr(ctx, "base", None)
    for f in params["files"]:
        path = _resolve(f, base)
        digest = sha256_file(path) if path.is_file() else None
        entry = {"file": f, "sha256": digest, "records": []}
        listing.append(entry)
        for case in iter_trace(path):
            entry["records"].append(case.id)
            if wanted is not None and case.id not in wanted:
                continue
            seen.add(case.id)
            case.meta = {**case.meta, "trace_file": path.name, "trace_sha256": digest}
            yield case
    if wanted is not None and wanted - seen:
        raise ValueError(f"trace records {sorted(wanted - seen)} were not found in {params['files']}")
    if ctx is not None:
        ctx.extra_files[f"{ctx.study}/trace_manifest.json"] = (json.dumps({"files": listing}, indent=1) + "\n").encode()
