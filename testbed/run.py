"""Run frozen protocols end to end and write an evidence folder.

    python -m testbed.run --out target/x                      # every protocol marked default
    python -m testbed.run --out target/x --protocol protocols/residual_window.json

The run writes into a hidden sibling folder ``.NAME.partial-PID`` and renames it to ``--out``
only when complete, so an interrupted run leaves nothing at ``--out``. An existing ``--out`` is
refused and left untouched. Exit codes: 0 done, 2 bad input (protocol, paths), 130 interrupted.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shutil
import sys
import time
from pathlib import Path

from .context import RunContext
from .evidence import ArrayStore, SCHEMA_VERSION, environment, sha256_bytes, sha256_file, source_hashes, write_json
from .protocol import ProtocolError, default_protocols, load_protocol
from .report import build_report

__all__ = ["main", "run_protocols"]


def _save_case(case, ctx: RunContext) -> dict:
    prefix = f"{ctx.study}/{case.id}"
    arrays = {name: ctx.store.save(f"{prefix}/{name}", getattr(case, name)) for name in ("q", "k", "v", "query_positions")}
    return {
        "id": case.id,
        "causal": case.causal,
        "layout": case.layout_json(),
        "tokens_per_frame": case.tokens_per_frame,
        "head_map": case.head_map,
        "meta": case.meta,
        "arrays": arrays,
    }


def run_protocols(root: Path, protocols: list[tuple[Path, dict, bytes]], progress=None) -> dict:
    """Run each (path, protocol, raw bytes) into ``root`` (which must exist and be empty)."""
    progress = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    store = ArrayStore(root)
    (root / "protocols").mkdir()
    rows, cases, timings, gates, excluded, files = [], {}, [], {}, [], {}
    proto_entries = []
    t_run = time.perf_counter()
    for path, proto, raw in protocols:
        study = proto["name"]
        if study in cases:
            raise ProtocolError(f"two protocols are named {study!r}")
        rel = f"protocols/{study}.json"
        (root / rel).write_bytes(raw)
        proto_entries.append({"name": study, "path": _display_path(path), "sha256": sha256_bytes(raw), "copy": rel})
        ctx = RunContext(store, study=study, timing_repeats=proto["timing"]["repeats"],
                         timing_seed=proto["timing"]["seed"], progress=progress)
        cases[study] = {}
        source = _source(proto)
        t0 = time.perf_counter()
        for i, case in enumerate(source.cases(proto["source"], ctx), 1):
            if case.id in cases[study]:
                raise ProtocolError(f"{study}: two cases are named {case.id!r}")
            cases[study][case.id] = _save_case(case, ctx)
            for name, params in proto["analyses"].items():
                rows.extend(_analysis(name).evaluate(case, params, ctx))
            progress(f"[{study}] case {i} {case.id}: {len(rows)} rows so far ({time.perf_counter() - t0:.1f} s)")
        timings.extend(ctx.timings)
        gates.update({f"{study}.{k}": v for k, v in ctx.gates.items()})
        excluded.extend(ctx.excluded)
        for rel_extra, data in ctx.extra_files.items():
            (root / rel_extra).parent.mkdir(parents=True, exist_ok=True)
            (root / rel_extra).write_bytes(data)
            files[rel_extra] = sha256_bytes(data)
    failed = [k for k, g in gates.items() if g.get("expected") != g.get("actual")]
    if failed:
        raise RuntimeError(f"capture gate(s) failed: {', '.join(failed)}")
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "protocols": proto_entries,
        "sources": source_hashes(),
        "environment": environment(),
        "wall_seconds": None,
        "arrays": {},
        "files": {},
        "gates": gates,
        "excluded": excluded,
    }
    write_json(root / "results.json", {"schema_version": SCHEMA_VERSION, "cases": cases, "rows": rows})
    write_json(root / "timings.json", timings)
    (root / "report.md").write_text(build_report([p for _, p, _ in protocols], rows, manifest), encoding="utf-8")
    for rel in ("results.json", "timings.json", "report.md"):
        files[rel] = sha256_file(root / rel)
    for e in proto_entries:
        files[e["copy"]] = e["sha256"]
    manifest["arrays"] = dict(sorted(store.entries.items()))
    manifest["files"] = dict(sorted(files.items()))
    manifest["wall_seconds"] = round(time.perf_counter() - t_run, 3)
    write_json(root / "manifest.json", manifest)
    return manifest


def _source(proto):
    from .sources import SOURCES

    return SOURCES[proto["source"]["kind"]]


def _analysis(name):
    from .analyses import ANALYSES

    return ANALYSES[name]


def _display_path(path: Path) -> str:
    from .evidence import REPO_ROOT

    try:
        return Path(path).resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m testbed.run", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="With no --protocol, every protocols/*.json marked \"default\": true is run.")
    ap.add_argument("--out", required=True, help="output folder; must not exist yet")
    ap.add_argument("--protocol", action="append", default=[], metavar="FILE",
                    help="protocol JSON to run (repeatable); default: all default protocols")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    if out.exists() or out.is_symlink():
        print(f"error: --out {out} already exists; refusing to touch it (choose a new folder)", file=sys.stderr)
        return 2
    try:
        paths = [Path(p) for p in args.protocol] or default_protocols()
        if not paths:
            raise ProtocolError("no --protocol given and no protocol in protocols/ is marked default")
        protocols = [(p, *load_protocol(p)) for p in paths]
    except ProtocolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    progress = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    tmp.mkdir()
    try:
        manifest = run_protocols(tmp, protocols, progress)
        if out.exists():
            raise FileExistsError(f"--out {out} appeared while the run was going; results left unwritten")
        os.rename(tmp, out)
    except KeyboardInterrupt:
        shutil.rmtree(tmp, ignore_errors=True)
        print("interrupted: nothing was written to --out", file=sys.stderr)
        return 130
    except (ProtocolError, ValueError, FileExistsError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {out} ({len(manifest['arrays'])} arrays, {manifest['wall_seconds']:.1f} s); "
          f"check it with: python -m testbed.audit {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
