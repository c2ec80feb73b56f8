"""A study as a list of independent units: planned in one order, run anywhere, merged in that order.

A unit is what one worker does without looking at any other: a case (or a capture prompt) with
every analysis of the protocol, or one arm of the live study on one batch of segments (an arm
needs its batch's reference, the unit named by ``needs``). The serial run and the Ray backend run
the same `run_unit`; the serial run hands it the run's own store, a remote worker a
`RecordingStore`, whose saves the driver replays in plan order (`absorb`). So the arrays, their
paths and the rows are the serial run's whichever order the units finished in.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import live, retrieval_study
from .context import RunContext
from .evidence import REPO_ROOT, sha256_bytes
from .progress import Progress
from .protocol import ProtocolError

__all__ = ["Unit", "plan", "unit_word", "dependents", "run_unit", "unit_context", "absorb", "run_serial",
           "pinned_torch", "study_entry", "study_result", "study_context", "COST_PRIOR", "cost_of"]


@contextlib.contextmanager
def pinned_torch(threads: int | None):
    """Pin torch's intra-op threads and turn on deterministic algorithms; restore both afterwards.

    Large reductions (a sum over millions of elements) split their work by thread count, so their
    last bits depend on it; one fixed count makes a run's bytes independent of the machine's cores."""
    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    old_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    if threads:
        torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det, warn_only=old_warn)


def study_entry(root: Path, path, proto: dict, raw: bytes) -> dict:
    """Freeze the protocol's bytes into the run; its manifest entry."""
    rel = f"protocols/{proto['name']}.json"
    (root / rel).write_bytes(raw)
    return {"name": proto["name"], "path": _display_path(path), "sha256": sha256_bytes(raw), "copy": rel}


def study_result(root: Path, entry: dict, ctx: RunContext, cases: dict, rows: list) -> dict:
    """Write the study's extra files into ``root``; what `run._finish` merges for the manifest."""
    files = {}
    for rel_extra, data in ctx.extra_files.items():
        (root / rel_extra).parent.mkdir(parents=True, exist_ok=True)
        (root / rel_extra).write_bytes(data)
        files[rel_extra] = sha256_bytes(data)
    return {"entry": entry, "cases": cases, "rows": rows, "timings": ctx.timings,
            "gates": {f"{ctx.study}.{k}": v for k, v in ctx.gates.items()}, "excluded": ctx.excluded,
            "files": files, "arrays": ctx.store.entries}


def study_context(store, proto: dict, protocol_path, progress) -> RunContext:
    """The context of one study on the driver (relative paths in the protocol resolve against its folder)."""
    return RunContext(store, study=proto["name"], timing_repeats=proto["timing"]["repeats"],
                      timing_seed=proto["timing"]["seed"], progress=progress,
                      base=Path(protocol_path).resolve().parent)


def _display_path(path) -> str:
    try:
        return Path(path).resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


@dataclass(frozen=True)
class Unit:
    index: int
    label: str
    kind: str  # "cases" (source parameters of a slice of the source) or "live" (batch x arm)
    spec: dict  # plain JSON data: what the worker needs besides the protocol
    needs: int | None = None  # the unit whose output this one takes (the live reference of its batch)
    resources: dict = field(default_factory=lambda: {"num_cpus": 1})
    weight: int = 1  # a rough cost (forward calls of a live arm): a backend starts the heaviest first


def _source(proto):
    from .sources import SOURCES

    return SOURCES[proto["source"]["kind"]]


def _analysis(name):
    from .analyses import ANALYSES

    return ANALYSES[name]


def plan(proto: dict, ctx: RunContext, protocol_path=None) -> tuple[dict, list[Unit]]:
    """The case records made before any unit runs and the units of one study, in the order a
    serial run takes them. The live study's shared part (model, corpus, the segments' token ids
    and its manifest) is done here, into ``ctx``; its segments are those case records."""
    cpu = {"num_cpus": 1}  # every unit runs on the CPU with one torch thread (run.pinned_torch)
    if proto.get("kind") == "live":
        cases, specs = live.plan(proto, ctx, protocol_path)
        return cases, [Unit(i, u["label"], "live", u, u["needs"], cpu, u["forwards"]) for i, u in enumerate(specs)]
    if proto.get("kind") == "retrieval":
        cases, specs = retrieval_study.plan(proto, ctx, protocol_path)
        return cases, [Unit(i, u["label"], "retrieval", u, u["needs"], cpu, u["forwards"]) for i, u in enumerate(specs)]
    source = _source(proto)
    slices = source.units(proto["source"]) if hasattr(source, "units") else [proto["source"]]
    word = unit_word(proto)
    return {}, [Unit(i, f"{word} {i + 1}/{len(slices)}", "cases", {"source": sub}, None, cpu)
                for i, sub in enumerate(slices)]


# Relative cost of one unit per cost class, for the progress estimate until the run has timed units
# of a class (then their own mean is used): a quanto peer's batch took 8 times a testbed policy's in
# the archived evidence (smollm2_quality, timings.json: 8.1 s against 0.6-1.3 s), one token per forward.
COST_PRIOR = {"unit": 1.0, "reference": 1.0, "testbed": 1.0, "quanto": 8.0}


def cost_of(unit: Unit) -> str:
    """A unit's cost class (testbed.live.cost_kind for a live or retrieval arm, else "unit")."""
    return unit.spec.get("cost", "unit") if isinstance(unit.spec, dict) else "unit"


def unit_word(proto: dict) -> str:
    """What one unit of this study is, for progress lines: a case, a capture prompt, a live batch x arm."""
    return "batch x arm" if proto.get("kind") in ("live", "retrieval") else getattr(_source(proto), "UNIT", "unit")


def dependents(units: list[Unit]) -> dict[int, list[int]]:
    """{unit index: the indices of the units that take its output} (only units something needs)."""
    out: dict[int, list[int]] = {}
    for u in units:
        if u.needs is not None:
            out.setdefault(u.needs, []).append(u.index)
    return out


def unit_context(ctx_or_store, study: str, proto: dict, unit: Unit, progress, base=None) -> RunContext:
    """A fresh context for one unit: its own timings, gates, exclusions and files; timing order
    shuffled by a generator seeded from the protocol's timing seed and the unit's index, so it
    does not depend on which units ran before it in the same process."""
    c = RunContext(ctx_or_store, study=study, timing_repeats=proto["timing"]["repeats"],
                   timing_seed=proto["timing"]["seed"], progress=progress, base=base)
    c.rng = random.Random(f"{proto['timing']['seed']}:{unit.index}")
    return c


def run_unit(proto: dict, unit: Unit, ctx: RunContext, dep=None) -> dict:
    """Run one unit into ``ctx``; returns ``{"cases", "rows", "out"}`` (``out``: what a dependent
    unit needs, the live reference's log-probabilities; None otherwise)."""
    if unit.kind == "live":
        rows, out, note = live.run_unit(proto, unit.spec, ctx, dep)
        return {"cases": {}, "rows": rows, "out": out, "note": note}
    if unit.kind == "retrieval":
        rows, out, note = retrieval_study.run_unit(proto, unit.spec, ctx, dep)
        return {"cases": {}, "rows": rows, "out": out, "note": note}
    cases, rows = {}, []
    source = _source(proto)
    it = iter(source.cases(unit.spec["source"], ctx))
    i = 0
    while True:
        i += 1
        try:
            case = next(it)
        except StopIteration:
            break
        except (ValueError, TypeError, OverflowError, RuntimeError, IndexError) as e:
            # Values that pass the schema but cannot make a Case (a seed beyond the generator's
            # 64 bits, focus_tokens longer than half a length): a ProtocolError naming the case.
            what = unit.label if unit.label.startswith("case ") else f"case {i} of {unit.label}"
            raise ProtocolError(f"protocol {proto['name']}: source {proto['source']['kind']!r} cannot build {what} "
                                f"from source parameters: {type(e).__name__}: {e}") from e
        if case.id in cases:
            raise ProtocolError(f"{ctx.study}: two cases are named {case.id!r}")
        cases[case.id] = _save_case(case, ctx)
        for name, params in proto["analyses"].items():
            rows.extend(_analysis(name).evaluate(case, params, ctx))
    note = f"{', '.join(cases) if len(cases) <= 2 else f'{len(cases)} cases'}, {len(rows)} rows"
    return {"cases": cases, "rows": rows, "out": None, "note": note}


def _save_case(case, ctx: RunContext) -> dict:
    prefix = f"{ctx.study}/{case.id}"
    kept = {"q": case.q, "k": case.k, "v": case.v}
    archive = None
    if case.archive_kv_heads is not None:
        # A partial archive: only the listed KV heads (and their query heads) are kept; the
        # analyses store per-row statistics of every head (see Case.archive_kv_heads).
        kvs = case.archive_kv_heads
        q_heads = [h for h, g in enumerate(case.head_map) if g in kvs]
        archive = {"kv_heads": list(kvs), "q_heads": q_heads,
                   "shapes": {name: list(t.shape) for name, t in kept.items()}}
        kept = {} if not kvs else {"q": case.q[q_heads], "k": case.k[kvs], "v": case.v[kvs]}
    arrays = {name: ctx.store.save(f"{prefix}/{name}", t) for name, t in kept.items()}
    arrays["query_positions"] = ctx.store.save(f"{prefix}/query_positions", case.query_positions)
    if case.token_ids is not None:  # one file per prompt: the store is content-addressed within a study
        arrays["token_ids"] = ctx.store.save(f"{prefix}/token_ids", case.token_ids.to(torch.int32))
    out = {
        "id": case.id,
        "causal": case.causal,
        "layout": case.layout_json(),
        "tokens_per_frame": case.tokens_per_frame,
        "head_map": case.head_map,
        "meta": case.meta,
        "arrays": arrays,
    }
    if archive is not None:
        out["archive"] = archive
    return out


def _moved(obj, moved: dict):
    """``obj`` with every string that is a recorded array path replaced by where it was stored."""
    if isinstance(obj, str):
        return moved.get(obj, obj)
    if isinstance(obj, list):
        return [_moved(x, moved) for x in obj]
    if isinstance(obj, dict):
        return {k: _moved(v, moved) for k, v in obj.items()}
    return obj


def absorb(ctx: RunContext, proto: dict, result: dict, unit_ctx: dict, cases: dict, rows: list,
           moved: dict | None = None) -> None:
    """Merge one unit's output (``result`` from `run_unit`, ``unit_ctx`` its context's timings,
    gates, exclusions and files) into the study: cases, rows, ``ctx``'s lists and files."""
    new_cases, new_rows = result["cases"], result["rows"]
    if moved:
        new_cases, new_rows = _moved(new_cases, moved), _moved(new_rows, moved)
    for cid, rec in new_cases.items():
        if cid in cases:
            raise ProtocolError(f"{ctx.study}: two cases are named {cid!r}")
        cases[cid] = rec
    rows.extend(new_rows)
    ctx.timings.extend(unit_ctx["timings"])
    for k, v in unit_ctx["gates"].items():
        if k in ctx.gates and ctx.gates[k] != v:
            raise ValueError(f"{ctx.study}: two units report gate {k!r} differently")
        ctx.gates[k] = v
    for e in unit_ctx["excluded"]:
        if e not in ctx.excluded:  # a model that cannot load is excluded once, not once per unit
            ctx.excluded.append(e)
    for name, data in unit_ctx["extra_files"].items():
        old = ctx.extra_files.get(name)
        if old is None or old == data:
            ctx.extra_files[name] = data
            continue
        source = None if proto.get("kind") in ("live", "retrieval") else _source(proto)
        if source is None or not hasattr(source, "merge_file"):
            raise ValueError(f"{ctx.study}: two units wrote {name} with different contents")
        ctx.extra_files[name] = source.merge_file(old, data)


def lists_of(c: RunContext) -> dict:
    return {"timings": c.timings, "gates": c.gates, "excluded": c.excluded, "extra_files": c.extra_files}


def run_serial(proto: dict, ctx: RunContext, protocol_path=None) -> tuple[dict, list]:
    """Every unit of the study, one after the other, in this process."""
    cases, units = plan(proto, ctx, protocol_path)
    rows, outs = [], {}
    last_use = {i: max(users) for i, users in dependents(units).items()}
    bar = Progress(len(units), ctx.study, ctx.progress, unit=unit_word(proto), kinds=[cost_of(u) for u in units],
                   prior=COST_PRIOR)
    for u in units:
        uc = unit_context(ctx.store, ctx.study, proto, u, ctx.progress, ctx.base)
        result = run_unit(proto, u, uc, outs.get(u.needs))
        bar.step(result["note"], kind=cost_of(u), one_off=uc.one_off)
        absorb(ctx, proto, result, lists_of(uc), cases, rows)
        if u.index in last_use:
            outs[u.index] = result["out"]
        if last_use.get(u.needs) == u.index:
            del outs[u.needs]  # no later unit needs it: free the reference's log-probabilities
    return cases, rows
