"""``--backend ray``: every unit of every protocol (:mod:`testbed.units`) is a Ray task.

Workers compute; the driver alone writes. A task returns its rows and case records as JSON text,
its arrays as the ``.npy`` bytes it would have written (in the order it saved them) and its
timings, gates, exclusions and files; the driver replays the saves of every unit in the order a
serial run takes the units, so the run folder is the serial run's, array for array and row for
row, whichever order the tasks finished in (results are collected with ``ray.wait`` as they
finish, for the progress line). Between driver and workers Ray's own serialization carries plain
data (str, bytes, numbers and the live reference's numpy arrays): a Ray cluster is one trust
domain. Nothing the run folder holds is ever loaded with pickle.

Faults: a task whose worker dies is retried up to ``RETRIES`` times (Ray's ``max_retries``); an
exception inside a task is the protocol's own error (the same on every retry), is not retried and
ends the run, which then writes nothing to ``--out``. Ctrl-C ends every task still pending (a Ray
this run started is shut down; one the caller started gets its pending tasks cancelled).

Every task reports the SHA-256 of the testbed sources it imported and its torch CPU capability;
a worker running other sources than the driver is an error, one of another instruction set a
warning (float kernels round differently there, docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .progress import Progress
from .evidence import ArrayStore, RecordingStore, environment, replay, sha256_bytes, source_hashes
from .units import (COST_PRIOR, Unit, absorb, cost_of, dependents, lists_of, pinned_torch, plan, run_unit,
                    study_context, study_entry, study_result, unit_context)

__all__ = ["run_studies", "BackendError", "RETRIES", "INSTALL_HINT"]

RETRIES = 2
INSTALL_HINT = "pip install -e '.[ray]' (Ray 2.x) on the driver and on every node of the cluster"
_IDENTITY = []  # this process's (testbed sources digest, torch CPU capability, CPU name), computed once


class BackendError(RuntimeError):
    """The backend could not finish the run (Ray missing, a task failed beyond its retries)."""


def _identity() -> dict:
    """What a task reports of its process: the hash of the testbed sources it imported, its torch
    CPU capability and CPU (once per process: neither changes while it lives)."""
    if not _IDENTITY:
        env = environment()
        _IDENTITY.append({"sources": sha256_bytes(json.dumps(source_hashes(), sort_keys=True).encode()),
                          "cpu_capability": env["torch_cpu_capability"], "node": env["cpu"]})
    return _IDENTITY[0]


def _import_ray():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves the machine
    try:
        import ray
    except ImportError as e:
        raise BackendError(f"--backend ray needs Ray: {INSTALL_HINT} ({e})") from None
    return ray


def _task(proto: dict, unit_json: str, threads, dep, fault_dir, base):
    """Worker side: one unit, recorded. Returns (result JSON text, saves, files, dependency output)."""
    unit = Unit(**json.loads(unit_json))
    _maybe_fault(fault_dir, unit.index)
    store = RecordingStore()
    uc = unit_context(store, proto["name"], proto, unit, lambda m: None, None if base is None else Path(base))
    if dep is not None:  # the live reference: numpy arrays from its task, as torch tensors again
        import torch

        dep = tuple(None if x is None else x.as_torch() if hasattr(x, "as_torch") else torch.from_numpy(x.copy())
                    for x in dep)
    with pinned_torch(threads):
        result = run_unit(proto, unit, uc, dep)
    out = result.pop("out")
    if out is not None:
        out = tuple(None if x is None else x.as_numpy() if hasattr(x, "as_numpy") else x.numpy() for x in out)
    lists = lists_of(uc)
    files = lists.pop("extra_files")
    text = json.dumps({"result": result, "lists": lists, **_identity()}, allow_nan=True)
    return text, store.saves, files, out


def _maybe_fault(fault_dir, index: int) -> None:
    """Fault injection for the tests: with TESTBED_RAY_FAULT=INDEX set in the worker's environment,
    the first attempt at unit INDEX (per ``fault_dir`` marker) kills its worker process; with
    TESTBED_RAY_FAULT=INDEX:always, every attempt does."""
    spec = os.environ.get("TESTBED_RAY_FAULT")
    if not spec or fault_dir is None:
        return
    target, _, how = spec.partition(":")
    if int(target) != index:
        return
    marker = os.path.join(fault_dir, f"fault-{index}")
    if how == "always" or not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(17)


def run_studies(root, protocols, threads, progress, *, address: str | None = None, cpus: int | None = None,
                fault_dir: str | None = None) -> list[dict]:
    """Run every protocol's units as Ray tasks; returns the per-study results `run._finish` merges."""
    ray = _import_ray()
    started = False
    if not ray.is_initialized():
        t0 = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if k.startswith("TESTBED_")}
        kwargs = dict(include_dashboard=False, log_to_driver=False, configure_logging=False,
                      runtime_env={"env_vars": env} if env else None)
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(num_cpus=cpus or os.cpu_count() or 1, **kwargs)
        started = True
        where = address or f"a local Ray with {int(ray.cluster_resources().get('CPU', 0))} CPUs"
        progress(f"ray: connected to {where} in {time.perf_counter() - t0:.1f} s")
    try:
        return _run(ray, root, protocols, threads, progress, fault_dir, owns_ray=started)
    finally:
        if started:
            ray.shutdown()


def _get(ray, refs, where: str):
    """``ray.get`` with a task's failure as the error a serial run gives (the unit's own exception,
    the same on every retry) or a one-line `BackendError` (a worker or node lost beyond RETRIES)."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise BackendError(f"{where}: {_first_line(e)}") from None
    except ray.exceptions.RayError as e:
        raise BackendError(f"{where} failed after {RETRIES} retries: {type(e).__name__}: {_first_line(e)}") from None


def _first_line(e) -> str:
    lines = [x for x in str(e).splitlines() if x.strip()]
    return lines[-1].strip() if lines else type(e).__name__


def _run(ray, root, protocols, threads, progress, fault_dir, *, owns_ray: bool) -> list[dict]:
    remote = ray.remote(max_retries=RETRIES, retry_exceptions=False, num_returns=4)(_task)
    driver_sources, driver_cpu = _identity()["sources"], _identity()["cpu_capability"]
    studies = []
    for path, proto, raw in protocols:  # plan on the driver (cheap: the live study tokenizes its corpus)
        entry = study_entry(root, path, proto, raw)
        ctx = study_context(ArrayStore(root), proto, path, progress)
        cases, units = plan(proto, ctx, path)
        studies.append({"proto": proto, "entry": entry, "ctx": ctx, "cases": cases, "units": units,
                        "users": dependents(units), "refs": {}, "done": {}})
    pending = {}  # ObjectRef of the result text -> (study index, unit)
    total = sum(len(s["units"]) for s in studies)

    def submit(si, u):
        st = studies[si]
        dep = None
        if u.needs is not None:
            dep = st["refs"][u.needs][3]  # the reference's output ObjectRef: Ray passes it on when ready
        opts = {k: v for k, v in u.resources.items() if k in ("num_cpus", "num_gpus")}
        refs = remote.options(**opts).remote(st["proto"], json.dumps(u.__dict__), threads, dep, fault_dir,
                                             str(st["ctx"].base))
        st["refs"][u.index] = refs
        pending[refs[0]] = (si, u)

    order = [(si, u) for si, st in enumerate(studies) for u in st["units"]]
    # Units that need nothing first (a live reference must be submitted before the arms that take
    # its output), each group heaviest first: quanto's one token per forward does not end the run alone.
    for si, u in sorted(order, key=lambda x: (x[1].needs is not None, -x[1].weight)):
        submit(si, u)
    # units finish in parallel, so the gaps between them are not their costs: the prior weighs them
    bar = Progress(total, "ray", progress, unit="unit", kinds=[cost_of(u) for _, u in order], prior=COST_PRIOR,
                   learn=False)
    # A failing unit does not end the run at once: every unit before it in the serial order is awaited
    # first, and the earliest failure is the one raised, so the error is the serial run's whichever
    # task failed first.
    failed = None  # ((study index, unit index), exception)
    try:
        while pending and not (failed and not any((si, u.index) < failed[0] for si, u in pending.values())):
            ready, _ = ray.wait(list(pending), num_returns=1)
            si, u = pending.pop(ready[0])
            st = studies[si]
            try:
                text, saves, files = _get(ray, st["refs"][u.index][:3], f"{st['proto']['name']} {u.label}")
            except Exception as e:  # noqa: BLE001 - kept until the earlier units are known
                if failed is None or (si, u.index) < failed[0]:
                    failed = ((si, u.index), e)
                continue
            got = json.loads(text)
            if got["sources"] != driver_sources:
                raise BackendError(f"{st['proto']['name']} {u.label}: the worker ({got['node']}) imported other "
                                   "testbed sources than the driver; install the same commit on every node")
            if got["cpu_capability"] != driver_cpu:
                progress(f"warning: {u.label} ran on {got['cpu_capability']} (the driver: {driver_cpu}); "
                         "float results may differ in their last bits from a serial run here")
            st["done"][u.index] = (got, saves, files)
            for i in {u.index, u.needs} - {None}:  # drop outputs (the reference's log-probs) nobody waits for
                if all(j in st["done"] for j in st["users"].get(i, ())):
                    st["refs"][i] = None
            bar.step(f"{st['proto']['name']} {u.label} done", kind=cost_of(u))
        if failed is not None:
            raise failed[1]
    except BaseException:
        # Ray 2.60 aborts the driver ("Tried to complete task that was not pending", a failed internal
        # check) when a cancelled task's reply arrives, with force=True and, in a later CI run, with
        # force=False too. So a Ray this run started is not asked to cancel anything: ray.shutdown()
        # disconnects the driver, and Ray ends a job's tasks when its driver goes. Only a Ray the
        # caller started (and keeps) gets a plain cancel of what is still pending.
        if not owns_ray:
            for ref in pending:
                try:
                    ray.cancel(ref, force=False)
                except Exception:  # noqa: BLE001 - a task that just finished cannot be cancelled: fine
                    pass
        raise
    results = []
    for st in studies:
        ctx, cases, rows = st["ctx"], st["cases"], []
        for u in st["units"]:  # the serial order, whatever order they finished in
            got, saves, files = st["done"][u.index]
            moved = replay(ctx.store, saves)
            absorb(ctx, st["proto"], got["result"], got["lists"] | {"extra_files": files}, cases, rows, moved)
        results.append(study_result(root, st["entry"], ctx, cases, rows))
    return results
