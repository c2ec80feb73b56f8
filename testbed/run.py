"""Run frozen protocols end to end and write an evidence folder.

    python -m testbed.run --out target/x                      # every protocol marked default
    python -m testbed.run --out target/x --protocol protocols/residual_window.json
    python -m testbed.run --describe [NAME]                   # every protocol key, or NAME's (docs/protocols.md)

The run writes into a hidden sibling folder ``.NAME.partial-PID`` and renames it to ``--out``
only when complete, so an interrupted run leaves nothing at ``--out``. An existing ``--out`` is
refused and left untouched. Ctrl-C (SIGINT) and SIGTERM remove the partial folder; a SIGKILL
cannot, so each run first removes the partial folders beside ``--out`` whose process is gone
(``.gitignore`` ignores them meanwhile, and the audit never takes one for a run: it has no
manifest until the very end).

Before allocating anything, the largest Case of each protocol is estimated
(:mod:`testbed.resources`) and a protocol that cannot fit in the available memory is refused.

Determinism: the run pins torch to ``--threads`` intra-op threads (default 1) and turns on
torch's deterministic algorithms, and records both in the manifest's environment; the same
protocol on the same machine then gives the same array bytes (docs/reliability.md says what
still varies across CPUs).

Exit codes: 0 done, 1 a backend failure (a Ray task that failed beyond its retries), 2 bad input (protocol,
paths, memory), 130 interrupted, 143 terminated.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from ._cli import entry, interrupted

try:  # torch and the model code take a second or more to import: Ctrl-C then is one line, not a traceback
    from . import ray_backend
    from .evidence import ArrayStore, SCHEMA_VERSION, environment, sha256_file, source_hashes, write_json
    from .protocol import ProtocolError, default_protocols, estimate_protocol, load_protocol
    from .report import build_report
    from .report_html import build_html
    from .resources import ResourceError, check_memory
    from .tables import results_csv
    from .units import pinned_torch, run_serial, study_context, study_entry, study_result
except KeyboardInterrupt:
    if __name__ != "__main__":
        raise
    sys.exit(interrupted("nothing was written"))

__all__ = ["main", "run_protocols", "sweep_stale_partials", "partial_dir"]

_PARTIAL = re.compile(r"\.(?P<name>.+)\.partial-(?P<pid>\d+)")


class Terminated(BaseException):
    """Raised by the SIGTERM handler so that the partial folder is cleaned up like on Ctrl-C."""


def run_protocols(root: Path, protocols: list[tuple[Path, dict, bytes]], progress=None, *, threads: int | None = 1,
                  memory: dict | None = None, jobs: int = 1, quiet: bool = False, backend: str = "local",
                  address: str | None = None) -> dict:
    """Run each (path, protocol, raw bytes) into ``root`` (which must exist and be empty).

    ``threads``: torch intra-op threads for the run (None keeps the current setting); ``memory``:
    the memory guard's estimates, recorded in the manifest; ``jobs``: protocols run in that many
    worker processes at once (each study is a cell: its arrays, rows and timings depend on
    nothing else, so the merged result is the serial one, byte for byte); ``backend="ray"``: every
    unit of every protocol is a Ray task (:mod:`testbed.ray_backend`; ``address`` of a running
    cluster, or a local Ray with ``jobs`` CPUs, all cores when ``jobs`` is 1), with the same result."""
    progress = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    names = [proto["name"] for _, proto, _ in protocols]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ProtocolError(f"two protocols are named {dup[0]!r}")
    (root / "protocols").mkdir()
    # Hashed before the run (the code and protocols it imports and copies now), compared after it.
    sources = source_hashes()
    t_run = time.perf_counter()
    with pinned_torch(threads):  # also while the manifest records the environment
        if backend == "ray":
            studies = ray_backend.run_studies(root, protocols, threads, progress, address=address,
                                              cpus=jobs if jobs > 1 else None,
                                              fault_dir=os.environ.get("TESTBED_RAY_FAULT_DIR"))
        elif jobs > 1 and len(protocols) > 1:
            studies = _run_parallel(root, protocols, threads, jobs, progress, quiet)
        else:
            studies = [_run_study(root, path, proto, raw, progress) for path, proto, raw in protocols]
        return _finish(root, protocols, studies, sources, memory, t_run)


def _run_study(root: Path, path, proto: dict, raw: bytes, progress) -> dict:
    """One protocol (a cell), its units one after the other: cases, rows, timings, gates and extra
    files, all inside ``root``."""
    entry = study_entry(root, path, proto, raw)
    ctx = study_context(ArrayStore(root), proto, path, progress)
    cases, rows = run_serial(proto, ctx, path)
    return study_result(root, entry, ctx, cases, rows)


def _study_worker(root: str, path: str, proto: dict, raw: bytes, threads, quiet: bool) -> str:
    """Worker-process entry: run one study, hand the result back as JSON text (no pickled objects
    cross back: floats round-trip exactly through JSON, so the merged rows equal a serial run's)."""
    progress = (lambda m: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    with pinned_torch(threads):
        result = _run_study(Path(root), Path(path), proto, raw, progress)
    return json.dumps(result, allow_nan=True)


def _run_parallel(root, protocols, threads, jobs, progress, quiet=False) -> list[dict]:
    import concurrent.futures as cf
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fresh interpreter per worker: no forked torch thread pools
    with cf.ProcessPoolExecutor(max_workers=min(jobs, len(protocols)), mp_context=ctx) as pool:
        futures = [pool.submit(_study_worker, str(root), str(path), proto, raw, threads, quiet)
                   for path, proto, raw in protocols]
        try:
            results = [json.loads(f.result()) for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    for r in results:
        progress(f"[{r['entry']['name']}] done in a worker: {len(r['rows'])} rows")
    return results


def _finish(root, protocols, studies, sources, memory, t_run) -> dict:
    rows, cases, timings, gates, excluded, files, arrays = [], {}, [], {}, [], {}, {}
    for st in studies:
        cases[st["entry"]["name"]] = st["cases"]
        rows.extend(st["rows"])
        timings.extend(st["timings"])
        gates.update(st["gates"])
        excluded.extend(st["excluded"])
        files.update(st["files"])
        arrays.update(st["arrays"])
    proto_entries = [st["entry"] for st in studies]
    failed = [k for k, g in gates.items() if g.get("expected") != g.get("actual")]
    if failed:
        raise RuntimeError(f"capture gate(s) failed: {', '.join(failed)}")
    after = source_hashes()
    changed = sorted(k for k in set(sources) | set(after) if sources.get(k) != after.get(k))
    if changed:
        raise ValueError(f"source files changed while the run was going ({', '.join(changed[:5])}"
                            f"{', ...' if len(changed) > 5 else ''}); its evidence would match no one version: run again")
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "protocols": proto_entries,
        "sources": sources,
        "environment": environment(),
        "wall_seconds": None,
        "memory_guard": memory,
        "arrays": {},
        "files": {},
        "gates": gates,
        "excluded": excluded,
    }
    write_json(root / "results.json", {"schema_version": SCHEMA_VERSION, "cases": cases, "rows": rows})
    (root / "results.csv").write_bytes(results_csv(rows))
    write_json(root / "timings.json", timings)
    (root / "report.md").write_text(build_report([p for _, p, _ in protocols], rows, manifest, timings), encoding="utf-8")
    (root / "report.html").write_text(build_html([p for _, p, _ in protocols], rows, root), encoding="utf-8")
    for rel in ("results.json", "results.csv", "timings.json", "report.md", "report.html"):
        files[rel] = sha256_file(root / rel)
    for e in proto_entries:
        files[e["copy"]] = e["sha256"]
    manifest["arrays"] = dict(sorted(arrays.items()))
    manifest["files"] = dict(sorted(files.items()))
    manifest["wall_seconds"] = round(time.perf_counter() - t_run, 3)
    write_json(root / "manifest.json", manifest)
    return manifest


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m testbed.run", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="With no --protocol, every protocols/*.json marked \"default\": true is run.")
    ap.add_argument("--out", help="output folder; must not exist yet (required unless --describe)")
    ap.add_argument("--protocol", action="append", default=[], metavar="FILE",
                    help="protocol JSON to run (repeatable); default: all default protocols")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--threads", type=int, default=1, metavar="N",
                    help="torch intra-op threads for the run (default 1: the same bytes on any number of cores)")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="run up to N protocols at once in worker processes (results identical to a serial run)")
    ap.add_argument("--backend", choices=("local", "ray"), default="local",
                    help="local (this process, or --jobs worker processes) or ray: every unit of every protocol "
                         "(a case with its analyses, a capture prompt, a live arm on a batch of segments) is a Ray "
                         "task; needs the [ray] extra; results identical to a serial run")
    ap.add_argument("--address", metavar="ADDR",
                    help="with --backend ray: a running Ray cluster (e.g. ray://head:10001 or auto); without it a "
                         "local Ray with --jobs CPUs (default: all cores) starts and stops with the run")
    ap.add_argument("--no-memory-guard", action="store_true",
                    help="run even when the largest case's estimated memory exceeds the available memory")
    ap.add_argument("--describe", nargs="?", const="", metavar="NAME",
                    help="print every protocol key (type, default, allowed values, meaning) of every source, analysis "
                         "and the live study, or of NAME only, and exit")
    ap.add_argument("--markdown", action="store_true", help="with --describe: the whole reference as Markdown "
                                                            "(docs/protocols.md)")
    return ap


def _describe(args) -> int:
    from .describe import describe, markdown

    try:
        text = markdown() if args.markdown else describe(args.describe or None)
    except ValueError as e:  # an unknown NAME: one line that lists the valid ones
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


def partial_dir(out: Path, pid: int | None = None) -> Path:
    """The temporary sibling a run writes into before renaming it to ``out``."""
    return out.parent / f".{out.name}.partial-{os.getpid() if pid is None else pid}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    try:  # a killed child not yet reaped by its parent is a zombie: it will never finish the run
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return True


def sweep_stale_partials(parent: Path) -> list[Path]:
    """Remove the ``.NAME.partial-PID`` folders in ``parent`` whose process is gone (a SIGKILLed run).

    A folder whose PID is alive (another run writing now) is left alone; so is anything that is
    not a real directory named exactly like a partial run."""
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _PARTIAL.fullmatch(p.name)
        if not m or p.is_symlink() or not p.is_dir():
            continue
        pid = int(m.group("pid"))
        if pid != os.getpid() and _pid_alive(pid):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _one_line(e) -> str:
    """An error message as exactly one line, whatever a protocol value or key held."""
    return " ".join(str(e).splitlines()) or type(e).__name__


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.describe is not None:
        return _describe(args)
    if args.out is None:
        ap.error("the following arguments are required: --out")
    out = Path(args.out)
    if out.exists() or out.is_symlink():
        print(f"error: --out {out} already exists; refusing to touch it (choose a new folder)", file=sys.stderr)
        return 2
    if _PARTIAL.fullmatch(out.name):
        print(f"error: --out {out} is named like a partial run folder; choose another name", file=sys.stderr)
        return 2
    if not 1 <= args.jobs <= 64:
        print(f"error: --jobs {args.jobs} must be between 1 and 64", file=sys.stderr)
        return 2
    if args.address and args.backend != "ray":
        print("error: --address needs --backend ray", file=sys.stderr)
        return 2
    if args.threads is not None and not 1 <= args.threads <= 1024:
        print(f"error: --threads {args.threads} must be between 1 and 1024", file=sys.stderr)
        return 2
    try:
        paths = [Path(p) for p in args.protocol] or default_protocols()
        if not paths:
            raise ProtocolError("no --protocol given and no protocol in protocols/ is marked default")
        protocols = [(p, *load_protocol(p)) for p in paths]
        memory = None if args.no_memory_guard else check_memory(
            {proto["name"]: estimate_protocol(proto, p.resolve().parent) for p, proto, _ in protocols})
    except (ProtocolError, ResourceError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    progress = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    if memory is not None:
        for name in [n for n, est in memory["estimated_peak_bytes"].items() if est is None]:
            progress(f"note: source of protocol {name} has no estimate_bytes(); memory guard skipped for it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for stale in sweep_stale_partials(out.parent):
            progress(f"removed {stale}: partial folder of a run that no longer exists")
        tmp = partial_dir(out)
        tmp.mkdir()
    except OSError as e:
        print(f"error: cannot create the run folder beside {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    old_term = signal.signal(signal.SIGTERM, _on_sigterm) if threading.current_thread() is threading.main_thread() else None
    renamed = False
    try:
        manifest = run_protocols(tmp, protocols, progress, threads=args.threads, memory=memory, jobs=args.jobs,
                                 quiet=args.quiet, backend=args.backend, address=args.address)
        if out.exists() or out.is_symlink():
            raise FileExistsError(f"--out {out} appeared while the run was going; results left unwritten")
        os.rename(tmp, out)
        renamed = True
    except (KeyboardInterrupt, Terminated) as e:
        word, code = ("interrupted", 130) if isinstance(e, KeyboardInterrupt) else ("terminated", 143)
        if renamed:  # the signal came after the atomic rename: the run is complete and stays
            print(f"{word} after the run was complete: {out} is a finished run", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"{word}: nothing was written to {out}", file=sys.stderr)
        return code
    except (ProtocolError, ValueError, FileExistsError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except ray_backend.BackendError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"error: {_one_line(e)}; nothing was written to {out}", file=sys.stderr)
        return 1
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    print(f"wrote {out} ({len(manifest['arrays'])} arrays, {manifest['wall_seconds']:.1f} s); "
          f"check it with: python -m testbed.audit {out}")
    return 0


def cli(argv=None) -> int:
    """The ``testbed-run`` console script: :func:`main` with Ctrl-C and a closed pipe handled."""
    return entry(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
