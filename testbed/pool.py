"""Pool the parts of one live study into one table: ``python -m testbed.pool RUN [RUN ...]``.

A live study too long for one run is split over several runs by its ``segment_range`` (each part a
protocol that differs from the others only in its name, description and ``live.segment_range``;
``protocols/frontier_long_seg*.json`` are the 8k frontier's four). This command puts the parts back
together. Imports only the standard library, numpy and the audit:

- each part is audited first (``python -m testbed.audit``); a part that fails refuses the pool;
- each part holds one live study; their frozen protocol copies are equal key for key apart from
  ``name``, ``description`` and ``live.segment_range``, and their segments are disjoint;
- then, per arm over the union of the parts' segments, as a live study's own report does over its
  segments: perplexity (exp of the mean NLL), Δ perplexity against ``dynamic_cache`` (exp of the
  mean per-segment NLL difference, minus 1) with the audit's 95 % bootstrap interval over segments
  (given from 5 segments on), the segments where the arm is worse, and bytes per token as a
  fraction of a float16 cache's (half the float32 reference's).

The units are segments. The table says how many of the protocol's segments the parts cover; a part
left out is stated, not filled in. Prints the table as Markdown (``--json FILE`` also writes it as
JSON); exit 0 when pooled, 1 when a part fails its audit, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from ._cli import entry
from .audit import audit
from .audit_checks.safe_io import AuditError, BadInput, load_json, safe_relpath
from .audit_checks.stats import MIN_CI_SEGMENTS, bootstrap

__all__ = ["REFERENCE", "PART_KEYS", "pool", "part_of", "main"]

REFERENCE = "dynamic_cache"
PART_KEYS = ("name", "description")  # top-level keys the parts of one study may differ in (and live.segment_range)


def part_of(run: Path) -> tuple[dict, list[dict], dict]:
    """The one live study of a finished run: its frozen protocol copy, its rows, and what it ran on
    (the live manifest's corpus, corpus token count and model identity)."""
    manifest = load_json(safe_relpath(run, "manifest.json"))
    results = load_json(safe_relpath(run, "results.json"))
    protos = {}
    for e in manifest.get("protocols", []) if isinstance(manifest, dict) else []:
        proto = load_json(safe_relpath(run, e["copy"]))
        if isinstance(proto, dict) and proto.get("kind") == "live":
            protos[proto["name"]] = proto
    if len(protos) != 1:
        raise BadInput(f"{run}: holds {len(protos)} live studies ({', '.join(sorted(protos)) or 'none'}); a part of a "
                       "pooled study is a run of one live protocol")
    (name, proto), = protos.items()
    rows = [r for r in results.get("rows", []) if r.get("study") == name and r.get("analysis") == "live_quality"]
    live_manifest = load_json(safe_relpath(run, f"{name}/live_manifest.json"))
    model = live_manifest.get("model", {}) if isinstance(live_manifest, dict) else {}
    identity = {"corpus": live_manifest.get("corpus"), "corpus_tokens": live_manifest.get("corpus_tokens"),
                "model": {k: model.get(k) for k in ("model", "gguf_sha256")}}
    if isinstance(live_manifest, dict) and live_manifest.get("calibration") is not None:
        # calibrated codebooks: the parts pool only if they calibrated on the same windows to the same tables
        arrays = manifest.get("arrays", {}) if isinstance(manifest, dict) else {}
        tables = {}
        for r in rows:
            for k, rel in (r.get("arrays") or {}).items():
                if k.startswith("codebook."):
                    tables[f"{r['arm']}.{k}"] = (arrays.get(rel) or {}).get("sha256")
        cal = live_manifest["calibration"]
        identity["calibration"] = {"starts": cal.get("starts"), "tokens": cal.get("tokens"),
                                   "token_ids_sha256": cal.get("token_ids_sha256"), "tables": tables}
    return proto, rows, identity


def _study_key(proto: dict) -> dict:
    """What the parts of one study share: the protocol without its name, description and segment range."""
    live = {k: v for k, v in proto["live"].items() if k != "segment_range"}
    return {**{k: v for k, v in proto.items() if k not in PART_KEYS}, "live": live}


def pool(parts: list[tuple]) -> dict:
    """Pool ``(label, frozen protocol, rows, identity)`` of each audited part (:func:`part_of`): the
    per-arm table over the union of their segments. Raises BadInput when the parts are not one study
    (protocol, corpus or model), a part lacks a segment of its range, or two share a segment."""
    key = _study_key(parts[0][1])
    if key["live"].get("contexts"):
        raise BadInput(f"{parts[0][0]}: a study of several contexts is pooled per context; pool handles one")
    for label, proto, _, identity in parts[1:]:
        if identity != parts[0][3]:
            raise BadInput(f"{label}: ran on another corpus or model than {parts[0][0]} ({identity} against "
                           f"{parts[0][3]})")
        if _study_key(proto) != key:
            diff = sorted(k for k in set(key["live"]) | set(proto["live"])
                          if k != "segment_range" and key["live"].get(k) != proto["live"].get(k))
            raise BadInput(f"{label}: not a part of the same study as {parts[0][0]} (its protocol differs "
                           f"{'in live.' + ', live.'.join(diff) if diff else 'outside live'})")
    seen: dict[str, str] = {}
    by_arm: dict[str, dict[str, dict]] = {}
    for label, proto, rows, _ in parts:
        cases = {r["case"] for r in rows}
        first, stop = proto["live"].get("segment_range") or (0, proto["live"]["segments"])
        want = {f"seg{i:03d}" for i in range(first, stop)}
        if cases != want:
            raise BadInput(f"{label}: its rows hold segments {sorted(cases)}, its range {sorted(want)}")
        for c in sorted(cases):
            if c in seen:
                raise BadInput(f"{label}: segment {c} is also in {seen[c]}; the parts of a study are disjoint")
            seen[c] = label
        for r in rows:
            by_arm.setdefault(r["arm"], {})[r["case"]] = r
    ref = by_arm.get(REFERENCE)
    if not ref:
        raise BadInput(f"no {REFERENCE} rows: a live study's reference arm is missing")
    segs = sorted(ref)
    ref_bpt = float(np.mean([ref[s]["bytes_per_token"] for s in segs]))
    arms = []
    for arm, rows in by_arm.items():
        if sorted(rows) != segs:
            raise BadInput(f"arm {arm} has segments {sorted(rows)}, the reference {segs}")
        nll = np.array([rows[s]["nll"] for s in segs], dtype=np.float64)
        bpt = float(np.mean([rows[s]["bytes_per_token"] for s in segs]))
        entry_ = {"arm": arm, "perplexity": math.exp(float(nll.mean())), "bytes_per_token": bpt,
                  "fp16_fraction": bpt / (ref_bpt / 2.0)}
        if arm != REFERENCE:
            d = nll - np.array([ref[s]["nll"] for s in segs], dtype=np.float64)
            ci = bootstrap(d)
            entry_.update(delta_pct=100.0 * math.expm1(float(d.mean())),
                          delta_ci=None if ci is None else [100.0 * math.expm1(ci[0]), 100.0 * math.expm1(ci[1])],
                          worse=int((d > 0).sum()))
        arms.append(entry_)
    arms.sort(key=lambda e: (e["arm"] != REFERENCE, -round(e["fp16_fraction"], 3), e.get("delta_pct", 0.0), e["arm"]))
    return {"studies": [p[1]["name"] for p in parts], "segments": segs, "of": int(key["live"]["segments"]),
            "arms": arms}


def _pct(x: float) -> str:
    return f"{x:+.3g} %" if abs(x) < 100 else f"{x:+,.0f} %"


def markdown(table: dict, checked: str = "each part passed its audit") -> str:
    n = len(table["segments"])
    lines = [f"Pooled {', '.join(table['studies'])}: {n} of the protocol's {table['of']} segments "
             f"({', '.join(table['segments'])}); {checked}. Δ against {REFERENCE}, paired per "
             f"segment; the interval is a bootstrap over segments" +
             (f" (none below {MIN_CI_SEGMENTS} segments)." if n < MIN_CI_SEGMENTS else "."), "",
             "| arm | ÷ float16 bytes | perplexity | Δ perplexity [95 % CI] | segments worse |",
             "|---|---:|---:|---:|---:|"]
    for e in table["arms"]:
        if e["arm"] == REFERENCE:
            lines.append(f"| {e['arm']} | {e['fp16_fraction']:.2f} | {e['perplexity']:.4g} | | |")
            continue
        ci = "" if e["delta_ci"] is None else f" [{_pct(e['delta_ci'][0])}, {_pct(e['delta_ci'][1])}]"
        lines.append(f"| {e['arm']} | {e['fp16_fraction']:.3f} | {e['perplexity']:.4g} | {_pct(e['delta_pct'])}{ci} "
                     f"| {e['worse']}/{n} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.pool", description=__doc__.split("\n\n")[0],
                                 epilog="Each RUN is a finished run folder of one part (e.g. of "
                                        "protocols/frontier_long_seg01.json).")
    ap.add_argument("runs", nargs="+", metavar="RUN", help="the parts' run folders")
    ap.add_argument("--json", metavar="FILE", help="also write the pooled table as JSON")
    ap.add_argument("--no-sources", action="store_true",
                    help="audit the parts without comparing their recorded source hashes with this checkout (parts "
                         "made by another version of the code)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    parts = []
    try:
        for run in args.runs:
            root = Path(run)
            if not root.is_dir():
                raise BadInput(f"{run} is not a folder")
            if not args.quiet:
                print(f"auditing {run} ...", file=sys.stderr, flush=True)
            ok, failures, _ = audit(root, check_sources=not args.no_sources)
            if not ok:
                for line in failures[:10]:
                    print(line)
                print(f"{run}: fails its audit ({len(failures)} problem(s)); nothing pooled")
                return 1
            parts.append((run, *part_of(root)))
        table = pool(parts)
    except (BadInput, AuditError, KeyError, TypeError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    text = markdown(table, "each part passed its audit" + (" (source hashes not checked)" if args.no_sources else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    print(text, end="")
    return 0


def cli(argv=None) -> int:
    return entry(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
