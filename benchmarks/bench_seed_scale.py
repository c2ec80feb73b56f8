"""The seed-scale record through ``testbed.run`` against the bare matmuls of its shape.

    .venv/bin/python benchmarks/bench_seed_scale.py [--threads 1] [--repeats 3] [--flops] [--run]

Builds the Case of ``protocols/seed_scale.json`` (the calibrated video preset at 32 heads / 8 KV
heads, 2,340 queries x 6,240 keys, D = 128) with its own source and times the bare ``Q Kᵀ`` and
``P·V`` of that shape over the analyses' tiles (one KV head's query-head group x
``DEFAULT_MAX_SCORES // (group * keys)`` queries, the scores fed to ``P·V`` as they are, nothing
else), in float64 (as the analyses compute) and in float32, at ``--threads`` torch threads (the
run's default is 1). With ``--run`` it then runs ``python -m testbed.run --protocol
protocols/seed_scale.json`` and ``python -m testbed.audit`` on its output, each under
``/usr/bin/time -v`` in its own process, and records their wall and CPU time and peak RSS. With
``--flops`` it counts every matmul flop of a run of the protocol cut to 4 heads / 1 KV head: the
work the protocol's own definitions need, as a multiple of the bare matmuls. JSON goes to
target/bench/seed_scale.json; benchmarks/README.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROTOCOL = ROOT / "protocols" / "seed_scale.json"


def seed_case():
    from testbed.protocol import load_protocol
    from testbed.sources import video

    proto, _ = load_protocol(PROTOCOL)
    return next(video.cases(proto["source"]))


def bare_matmuls(q, k, v, max_scores: int) -> None:
    """Q Kᵀ then P·V over the analyses' tiles, in the dtype of ``q, k, v``."""
    import torch

    h, tq, d = q.shape
    hkv, tk, _ = k.shape
    g = h // hkv
    step = max(1, int(max_scores) // (g * tk))
    rmax = g * min(step, tq)
    s = torch.empty(rmax, tk, dtype=q.dtype)
    o = torch.empty(rmax, d, dtype=q.dtype)
    q = q * (1.0 / math.sqrt(d))
    for j in range(hkv):
        for s0 in range(0, tq, step):
            c = min(tq, s0 + step) - s0
            r = g * c
            torch.matmul(q[j * g:(j + 1) * g, s0:s0 + c].reshape(r, d), k[j].T, out=s[:r])
            torch.matmul(s[:r], v[j], out=o[:r])


def cut_protocol(heads: int, kv_heads: int, path: Path) -> Path:
    """protocols/seed_scale.json with its source cut to ``heads`` query heads sharing ``kv_heads``
    KV heads (the per-head lists cut to their first ``heads``), the same 2,340 x 6,240, D = 128."""
    proto = json.loads(PROTOCOL.read_text())
    src = proto["source"]
    src["heads"], src["kv_heads"] = heads, kv_heads
    for key in ("concentrations", "sink_logits", "current_logits"):
        src[key] = src[key][:heads]
    proto["name"] = f"seed_scale_h{heads}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(proto, indent=1))
    return path


def matmul_flops(heads: int, kv_heads: int) -> dict:
    """The matmul work of the whole run of a cut seed-scale protocol (`cut_protocol`), counted in
    this process by torch's FlopCounterMode (every matmul of every analysis, 2 flops per
    multiply-add), against the bare ``Q Kᵀ`` + ``P·V`` of the same shape: the matmul floor of the
    protocol's own definitions, as a multiple of the bare matmuls (the ratio does not depend on
    the head count: every analysis works one KV head's group at a time)."""
    from torch.utils.flop_counter import FlopCounterMode

    from testbed.run import main as run_main

    path = cut_protocol(heads, kv_heads, ROOT / "target" / "bench" / f"seed_scale_h{heads}.json")
    out = ROOT / "target" / "bench" / f"seed_scale_h{heads}_flops"
    shutil.rmtree(out, ignore_errors=True)
    with FlopCounterMode(display=False) as counter:
        rc = run_main(["--quiet", "--protocol", str(path), "--out", str(out)])
    if rc != 0:
        raise SystemExit(f"the cut protocol's run failed ({rc})")
    src = json.loads(path.read_text())["source"]
    tq = src["current_frames"] * src["tokens_per_frame"]
    tk = (src["sink_frames"] + src["recent_frames"] + src["current_frames"]) * src["tokens_per_frame"]
    bare = 2 * (2 * heads * tq * tk * src["head_dim"])
    total = counter.get_total_flops()
    return {"heads": heads, "kv_heads": kv_heads, "run_flops": total, "bare_flops": bare, "floor_over_bare": total / bare}


def timed_process(cmd: list[str]) -> dict:
    """Wall time and peak RSS of ``cmd`` in its own process (``/usr/bin/time -v``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    cpu = [re.search(rf"{what} time \(seconds\): ([0-9.]+)", r.stderr) for what in ("User", "System")]
    return {"command": " ".join(cmd), "returncode": r.returncode, "wall_s": wall,
            "cpu_s": sum(float(m.group(1)) for m in cpu) if all(cpu) else None,
            "peak_rss_mib": int(peak.group(1)) / 1024 if peak else None, "tail": r.stdout[-400:] + r.stderr[-1200:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the bare matmuls (the run's default: 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--run", action="store_true", help="also run the protocol and its audit (about 15 min on 1 core)")
    ap.add_argument("--flops", action="store_true",
                    help="also count the matmul work of a run of the protocol cut to 4 heads / 1 KV head, in this process "
                         "(the floor its definitions set, as a multiple of the bare matmuls; about a minute)")
    ap.add_argument("--out", default=str(ROOT / "target" / "seed_scale_bench"), help="run folder (replaced)")
    ap.add_argument("--json", default=str(ROOT / "target" / "bench" / "seed_scale.json"))
    args = ap.parse_args()

    import torch
    from testbed.resources import DEFAULT_MAX_SCORES

    torch.set_num_threads(args.threads)
    case = seed_case()
    res = {"shape": {"q": list(case.q.shape), "k": list(case.k.shape)}, "threads": args.threads,
           "load_average": os.getloadavg(), "bare": {}}
    for name, dtype in (("float64", torch.float64), ("float32", torch.float32)):
        q, k, v = (x.to(dtype) for x in (case.q, case.k, case.v))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            bare_matmuls(q, k, v, DEFAULT_MAX_SCORES)
            times.append(time.perf_counter() - t0)
        res["bare"][name] = {"best_s": min(times), "times_s": times}
        print(f"bare QKᵀ + P·V {name}, {args.threads} thread(s): best {min(times):.2f} s of {times}", flush=True)
    if args.flops:
        res["flops"] = matmul_flops(4, 1)
        print(f"matmul work of the protocol's run: {res['flops']['floor_over_bare']:.1f} x the bare QKᵀ + P·V "
              f"({res['flops']['run_flops']:.3g} flops, 4 heads / 1 KV head)", flush=True)
    if args.run:
        out = Path(args.out)
        shutil.rmtree(out, ignore_errors=True)
        py = sys.executable
        res["run"] = timed_process([py, "-m", "testbed.run", "--quiet", "--protocol", str(PROTOCOL), "--out", str(out)])
        print(f"run: {res['run']['wall_s']:.0f} s wall, {res['run']['cpu_s']:.0f} s CPU, "
              f"peak {res['run']['peak_rss_mib']:.0f} MiB", flush=True)
        res["audit"] = timed_process([py, "-m", "testbed.audit", "--quiet", str(out)])
        print(f"audit: {res['audit']['wall_s']:.0f} s wall, {res['audit']['cpu_s']:.0f} s CPU, "
              f"peak {res['audit']['peak_rss_mib']:.0f} MiB", flush=True)
        for key in ("float64", "float32"):
            res[f"run_over_bare_{key}"] = res["run"]["wall_s"] / res["bare"][key]["best_s"]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1))
    print(f"-> {args.json}")


if __name__ == "__main__":
    main()
