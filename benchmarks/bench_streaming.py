"""Streaming analysis at the seed study's scale against the bare matmuls on the same shapes.

    .venv/bin/python benchmarks/bench_streaming.py [--small] [--threads 2] [--repeats 3]
        [--kv-heads 32] [--rotations signed_hadamard] [--max-scores N] [--with-reference]

One record of the video-like synthetic layout (`testbed.sources.video`: sink 4 | recent 6 |
current 6 frames of 15 x 26 = 390 tokens: 6,240 keys, 2,340 queries), 32 heads of D = 128, is built
here and saved as .npy; a fresh subprocess loads it (so that its peak RSS is the analysis's own)
and, alternating ``--repeats`` times, times in float32:

- ``bare``: ``Q Kᵀ`` and ``P·V`` with torch.matmul over the same tiles as the analysis (one KV
  head's query-head group x ``max_scores // (group * keys)`` queries: ``[R, 128] x [128, 6240]``
  then ``[R, 6240] x [6240, 128]``), nothing else;
- ``fused``: `testbed.streaming.analyze` -- every observational metric, the MX Q/K path (the
  rotations given; the seed study's production path is signed Hadamard) and the P path, and the
  drop_sink / drop_recent / drop_history ablations.

It reports wall and CPU time, their ratio (target <= 3), the time per stage, peak RSS (target
< 2 GiB) and the load average, and compares float32 with the float64 reference on a sample of
heads (the reported medians and means). JSON goes to target/bench/streaming.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RATIO_TARGET = 3.0
RSS_TARGET_GIB = 2.0


def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024          # Linux: KiB


def build(args, folder: Path) -> dict:
    import numpy as np
    from testbed.sources.video import make_video_case

    tpf = 26 if args.small else 390
    heads = 4 if args.small else 32
    kv = min(args.kv_heads, heads)
    case = make_video_case(0, 3, tokens_per_frame=tpf, heads=heads, kv_heads=kv, head_dim=128)
    for name in ("q", "k", "v", "query_positions"):
        np.save(folder / f"{name}.npy", getattr(case, name).numpy(), allow_pickle=False)
    meta = {"id": case.id, "causal": case.causal, "tokens_per_frame": tpf, "meta": case.meta,
            "layout": case.layout_json(), "q": list(case.q.shape), "k": list(case.k.shape)}
    (folder / "case.json").write_text(json.dumps(meta))
    return meta


def load(folder: Path):
    import numpy as np
    import torch
    from testbed.case import Case, Region

    meta = json.loads((folder / "case.json").read_text())
    arr = {n: torch.from_numpy(np.load(folder / f"{n}.npy", allow_pickle=False))
           for n in ("q", "k", "v", "query_positions")}
    return Case(id=meta["id"], q=arr["q"], k=arr["k"], v=arr["v"], query_positions=arr["query_positions"],
                causal=meta["causal"], layout=tuple(Region(**r) for r in meta["layout"]),
                tokens_per_frame=meta["tokens_per_frame"], meta=meta["meta"])


def bare_matmuls(case, max_scores: int) -> None:
    """Q Kᵀ then P·V in the analysis's tiles (float32), the scores fed to P·V as they are."""
    import torch

    h, tq, d = case.q.shape
    hkv, tk, _ = case.k.shape
    g = h // hkv
    step = max(1, int(max_scores) // (g * tk))
    rmax = g * min(step, tq)
    s = torch.empty(rmax, tk)
    o = torch.empty(rmax, d)
    q = case.q * (1.0 / math.sqrt(d))
    for j in range(hkv):
        for s0 in range(0, tq, step):
            c = min(tq, s0 + step) - s0
            r = g * c
            torch.matmul(q[j * g:(j + 1) * g, s0:s0 + c].reshape(r, d), case.k[j].T, out=s[:r])
            torch.matmul(s[:r], case.v[j], out=o[:r])


def summaries(res) -> dict:
    """The medians and means a report quotes, from one StreamResult."""
    import torch

    out = {}
    for key, v in res.observation.rows.items():
        if key == "visible_keys":
            continue
        out[f"observe/{key}/median"] = float(v.median())
        out[f"observe/{key}/mean"] = float(v.mean())
    out["observe/heatmap/max_abs"] = float(res.observation.heatmap.abs().max())
    out["observe/jaccard_query/mean"] = float(res.observation.jaccard_query.mean())
    a = res.ablation
    for name in a.names:
        i = a.index(name)
        out[f"ablation/{name}/rel_l2"] = a.rel_l2(name)
        out[f"ablation/{name}/cosine"] = a.cosine(name)
        out[f"ablation/{name}/dropped_mass_mean"] = float(torch.nanmean(a.dropped_mass[i]))
        out[f"ablation/{name}/tv_mean"] = float(torch.nanmean(a.tv[i]))
    for rot, p in res.qk.items():
        out[f"qk_{rot}/tv_median"] = float(p.tv.median())
        out[f"qk_{rot}/tv_mean"] = float(p.tv.mean())
        out[f"qk_{rot}/argmax_agreement"] = float(p.argmax_agree.double().mean())
        out[f"qk_{rot}/rel_l2"] = p.rel_l2
    if res.p is not None:
        out["p/tv_median"] = float(res.p.tv.median())
        out["p/tv_mean"] = float(res.p.tv.mean())
        out["p/zero_rate_mean"] = float(res.p.zero_rate.mean())
        out["p/rows_with_zero"] = float((res.p.zero_rate > 0).double().mean())
        out["p/row_sum_median"] = float(res.p.row_sum.median())
        out["p/argmax_agreement"] = float(res.p.argmax_agree.double().mean())
        out["p/rel_l2"] = res.p.rel_l2
    return out


def child(args) -> None:
    import numba
    import torch

    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    from testbed import streaming as st
    from testbed.case import Case
    from testbed.sources.video import make_video_case

    rots = tuple(r for r in args.rotations.split(",") if r)
    info = {"rss_start_mib": _rss_mib()}
    case = load(Path(args.child))
    info["rss_after_load_mib"] = _rss_mib()
    # compile (or load from numba's cache) on a tiny record first: not part of any timing
    st.analyze(make_video_case(0, 3, tokens_per_frame=4, heads=2, kv_heads=2, head_dim=case.q.shape[-1]),
               rotations=rots)
    bare_matmuls(case, args.max_scores)
    info["peak_before_analysis_mib"] = _peak_mib()
    bare_w, bare_c, fused_w, fused_c, stages, stages_cpu = [], [], [], [], [], []
    tilings = sorted({1 << 20, 1 << 21, 1 << 22, 1 << 23} - {args.max_scores})
    bare_other = {str(ms): [] for ms in tilings}       # the bare matmuls at other tilings, same repeats
    load_avg = [os.getloadavg()]
    res = None
    for _ in range(args.repeats):
        t, c = time.perf_counter(), time.process_time()
        bare_matmuls(case, args.max_scores)
        bare_w.append(time.perf_counter() - t)
        bare_c.append(time.process_time() - c)
        for ms in tilings:
            t = time.perf_counter()
            bare_matmuls(case, ms)
            bare_other[str(ms)].append(time.perf_counter() - t)
        t, c = time.perf_counter(), time.process_time()
        res = st.analyze(case, rotations=rots, max_scores=args.max_scores)
        fused_w.append(time.perf_counter() - t)
        fused_c.append(time.process_time() - c)
        stages.append(res.seconds)
        stages_cpu.append(res.cpu_seconds)
        load_avg.append(os.getloadavg())
    info["peak_rss_mib"] = _peak_mib()
    bare_tilings = bare_other
    out = {"bare_tilings": bare_tilings, "bare_wall": bare_w, "bare_cpu": bare_c, "fused_wall": fused_w, "fused_cpu": fused_c,
           "stages_wall": stages, "stages_cpu": stages_cpu, "load_avg": load_avg, "tiles": res.tiles,
           "fallback_rows": res.fallback_rows, "memory": info, "float32": summaries(res)}

    # float32 against the float64 reference on a sample of heads (a sub-record, same layout)
    hs = min(args.sample_heads, case.kv_heads)
    g = case.heads // case.kv_heads
    out["sample_heads"] = hs * g
    out["float32_vs_float64"] = {}
    if hs > 0:
        sub = Case(id=case.id + "-sample", q=case.q[: hs * g].clone(), k=case.k[:hs].clone(), v=case.v[:hs].clone(),
                   query_positions=case.query_positions, causal=case.causal, layout=case.layout,
                   tokens_per_frame=case.tokens_per_frame, meta=case.meta)
        a32 = summaries(st.analyze(sub, rotations=rots, max_scores=args.max_scores))
        t = time.perf_counter()
        a64 = summaries(st.analyze(sub, dtype=torch.float64, rotations=rots, max_scores=args.max_scores))
        out["float64_sample_seconds"] = time.perf_counter() - t
        out["float32_vs_float64"] = {k: {"float32": a32[k], "float64": a64[k], "abs_diff": abs(a32[k] - a64[k])}
                                     for k in a64}

    if args.with_reference:
        from testbed.ablation_core import ablate_case, make_ablation
        from testbed.metrics import observe

        spans = {n: make_ablation(n).dropped(case) for n in st.DEFAULT_ABLATIONS}
        t = time.perf_counter()
        observe(case)
        out["reference_observe_seconds"] = time.perf_counter() - t
        t = time.perf_counter()
        ablate_case(case, spans)
        out["reference_ablate_seconds"] = time.perf_counter() - t
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="4 heads, 26 tokens per frame: a quick smoke run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-heads", type=int, default=32, help="32: multi-head (a video DiT); 8: GQA groups of 4")
    ap.add_argument("--rotations", default="signed_hadamard", help="comma list of none, signed_hadamard")
    ap.add_argument("--max-scores", type=int, default=None, help="scores per tile (default: the analysis's)")
    ap.add_argument("--sample-heads", type=int, default=2, help="KV heads of the float32 vs float64 sample (0: none)")
    ap.add_argument("--with-reference", action="store_true", help="also time observe() and ablate() (minutes)")
    ap.add_argument("--gomp-spincount", type=int, default=None,
                    help="GOMP_SPINCOUNT for the measuring process (bare and fused alike); default: unset")
    ap.add_argument("--json", default=str(ROOT / "target" / "bench" / "streaming.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sample_heads < 0 or args.repeats < 1 or args.threads < 1:
        ap.error("--sample-heads must be >= 0, --repeats and --threads >= 1")
    if args.max_scores is None:
        from testbed.streaming import DEFAULT_MAX_SCORES

        args.max_scores = DEFAULT_MAX_SCORES
    if args.child:
        child(args)
        return

    with tempfile.TemporaryDirectory(dir=ROOT / "target") as tmp:
        folder = Path(tmp)
        t = time.perf_counter()
        meta = build(args, folder)
        build_s = time.perf_counter() - t
        cmd = [sys.executable, __file__, "--child", str(folder), "--threads", str(args.threads),
               "--repeats", str(args.repeats), "--rotations", args.rotations, "--max-scores", str(args.max_scores),
               "--sample-heads", str(args.sample_heads)] + (["--with-reference"] if args.with_reference else [])
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                   NUMBA_NUM_THREADS=str(args.threads))
        if args.gomp_spincount is not None:      # both OpenMP runtimes (torch's and numba's) read it
            env["GOMP_SPINCOUNT"] = str(args.gomp_spincount)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            raise SystemExit(f"benchmark child failed ({proc.returncode})")
        res = json.loads(proc.stdout.strip().splitlines()[-1])

    bw, fw, bc, fc = res["bare_wall"], res["fused_wall"], res["bare_cpu"], res["fused_cpu"]
    ratios = [f / b for f, b in zip(fw, bw)]
    best_ratio = min(fw) / min(bw)
    # strict: against the fastest tiling of the bare matmuls in the same repeat
    bare_any = [min([b] + [v[i] for v in res["bare_tilings"].values()]) for i, b in enumerate(bw)]
    strict = [f / b for f, b in zip(fw, bare_any)]
    strict_ratio = min(fw) / min(bare_any)
    peak_gib = res["memory"]["peak_rss_mib"] / 1024
    n = len(fw)
    stage_names = list(res["stages_wall"][0])
    stages = {k: {"wall_best": min(s[k] for s in res["stages_wall"]), "cpu_best": min(s[k] for s in res["stages_cpu"])}
              for k in stage_names}
    diffs = res["float32_vs_float64"]
    worst = max(diffs.items(), key=lambda kv: kv[1]["abs_diff"]) if diffs else (None, {"abs_diff": None})
    report = {
        "record": {"heads": meta["q"][0], "kv_heads": meta["k"][0], "queries": meta["q"][1], "keys": meta["k"][1],
                   "head_dim": meta["q"][2], "tokens_per_frame": meta["tokens_per_frame"], "layout": meta["layout"],
                   "scores_per_path": meta["q"][0] * meta["q"][1] * meta["k"][1]},
        "config": {"small": args.small, "threads": args.threads, "repeats": n, "rotations": args.rotations,
                   "max_scores": args.max_scores, "gomp_spincount": args.gomp_spincount,
                   "dtype": "float32", "tiles": res["tiles"], "build_seconds": build_s},
        "environment": {"python": platform.python_version(), "platform": platform.platform(),
                        "cpu_count": os.cpu_count(), "load_avg": res["load_avg"]},
        "seconds": {"bare_wall": bw, "fused_wall": fw, "bare_cpu": bc, "fused_cpu": fc},
        "ratio": {"best_wall": best_ratio, "per_repeat_wall": ratios, "median_wall": statistics.median(ratios),
                  "best_cpu": min(fc) / min(bc), "target": RATIO_TARGET,
                  "met": None if args.small else best_ratio <= RATIO_TARGET,
                  "strict_best_wall": strict_ratio, "strict_per_repeat_wall": strict,
                  "strict_median_wall": statistics.median(strict), "bare_other_tilings_wall": res["bare_tilings"]},
        "stages": stages,
        "memory": {**res["memory"], "peak_rss_gib": peak_gib, "target_gib": RSS_TARGET_GIB,
                   "met": None if args.small else peak_gib < RSS_TARGET_GIB},
        "fallback_rows": res["fallback_rows"],
        "float32_vs_float64": {"sample_query_heads": res["sample_heads"], "max_abs_diff": worst[1]["abs_diff"],
                               "worst_metric": worst[0], "metrics": diffs},
        "float32_summaries": res["float32"],
    }
    for key in ("reference_observe_seconds", "reference_ablate_seconds"):
        if key in res:
            report.setdefault("reference", {})[key] = res[key]
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))

    r = report["record"]

    def verdict(ok: bool) -> str:  # the targets are stated for the seed-scale record, not the smoke run
        return "not judged (--small is a smoke run)" if args.small else ("met" if ok else "NOT met")

    print(f"record: {r['heads']} heads ({r['kv_heads']} KV) x {r['queries']} queries x {r['keys']} keys, D={r['head_dim']}"
          f" ({r['scores_per_path'] / 1e6:.0f} M scores per path); float32, {args.threads} threads, {res['tiles']} tiles,"
          f" Q/K rotations: {args.rotations}"
          + (f", GOMP_SPINCOUNT={args.gomp_spincount}" if args.gomp_spincount is not None else ""))
    print(f"load average during the run: {', '.join(f'{la[0]:.2f}' for la in res['load_avg'])}")
    print(f"{'':24s}{'best':>9s}{'median':>9s}{'worst':>9s}   (wall s; CPU s best)")
    for name, w, c in (("bare QK^T + P.V", bw, bc), ("fused analysis", fw, fc)):
        print(f"{name:24s}{min(w):9.2f}{statistics.median(w):9.2f}{max(w):9.2f}   ({min(c):.2f})")
    print(f"ratio fused / bare (same tiles): best {best_ratio:.2f} (per repeat {', '.join(f'{x:.2f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.2f}; CPU {min(fc) / min(bc):.2f}); target <= {RATIO_TARGET}: "
          f"{verdict(best_ratio <= RATIO_TARGET)}")
    print("bare matmuls at other tilings (best, wall s): " + ", ".join(f"{int(k) / 2**20:g} M scores {min(v):.2f}"
                                                                      for k, v in res["bare_tilings"].items()))
    print(f"strict ratio, fused / fastest bare tiling of the same repeat: best {strict_ratio:.2f} (per repeat "
          f"{', '.join(f'{x:.2f}' for x in strict)}; median {statistics.median(strict):.2f})")
    print(f"peak RSS of the analysis process: {res['memory']['peak_rss_mib']:.0f} MiB (after loading the record "
          f"{res['memory']['rss_after_load_mib']:.0f} MiB); target < {RSS_TARGET_GIB} GiB: "
          f"{verdict(peak_gib < RSS_TARGET_GIB)}")
    print("time per stage (best of the repeats, x best bare wall):")
    for k, v in sorted(stages.items(), key=lambda kv: -kv[1]["wall_best"]):
        print(f"   {k:36s}{v['wall_best']:8.2f} s  {v['wall_best'] / min(bw):5.2f}x")
    if diffs:
        print(f"float32 vs float64 on {res['sample_heads']} query heads: largest |difference| of a reported median/mean "
              f"{worst[1]['abs_diff']:.2e} ({worst[0]})")
    else:
        print("float32 vs float64: not sampled (--sample-heads 0)")
    if "reference" in report:
        print(f"non-fused reference on the same record: observe {report['reference']['reference_observe_seconds']:.1f} s,"
              f" ablate {report['reference']['reference_ablate_seconds']:.1f} s")
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
