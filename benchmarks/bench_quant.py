"""Quantizer throughput against peers, in one process, on the same arrays.

    .venv/bin/python benchmarks/bench_quant.py [--threads 2] [--repeats 7] [--json FILE]

Times, on one 32 x 8192 x 128 float32 tensor (128 MiB; a K/V pair of that size for the
residual window):

- a memory copy of the same bytes into a fresh array (numpy, which gets huge pages; the K/V pair
  for the residual window): the physical limit; torch's clone and a copy into a preallocated
  buffer beside it;
- torchao's ``to_mx`` (E4M3, block 32, FLOOR scale) and its dequantization;
- optimum-quanto as transformers' ``QuantoQuantizedCache`` calls it (``MaxOptimizer`` +
  ``quantize_weight``, qint4, group 32, axis 0) and ``dequantize()``;
- a plain torch implementation (testbed's own reference path, eager torch);
- testbed's Int4Grouped (K per channel, V per token), ResidualWindow (R=128) and MXFP8.

Each op runs ``--repeats`` times after a warm-up, the order of ops shuffled every repeat; the
median is reported as GB/s of float32 input, with ratios against the peers and the targets of
issue #7. Raw times go to the JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

TARGETS = [
    # (op, peer, minimum ratio)
    ("int4 channel quantize", "torchao to_mx", 3.0),
    ("int4 token quantize", "torchao to_mx", 3.0),
    ("mxfp8 quantize", "torchao to_mx", 3.0),
    ("int4 channel quantize", "quanto quantize", 5.0),
    ("int4 token quantize", "quanto quantize", 5.0),
    ("mxfp8 quantize", "quanto quantize", 5.0),
    ("int4 channel dequantize", "quanto dequantize", 3.0),
    ("int4 token dequantize", "quanto dequantize", 3.0),
    ("mxfp8 dequantize", "quanto dequantize", 3.0),
]


def build_ops(x: torch.Tensor, v: torch.Tensor) -> dict:
    from testbed.quant import Int4Grouped, MXFP8, ResidualWindow

    ops = {}
    dst = torch.empty_like(x)
    xn = x.numpy()
    # every quantizer allocates its output, so the limit is an allocating copy: the faster of a
    # numpy copy (huge pages) and torch's clone; the copy into a preallocated buffer beside it
    vn = v.numpy()
    ops["memory copy"] = lambda: np.array(xn, copy=True)
    ops["memory copy (K+V)"] = lambda: (np.array(xn, copy=True), np.array(vn, copy=True))
    ops["memory copy (torch clone)"] = lambda: x.clone()
    ops["memory copy (preallocated)"] = lambda: dst.copy_(x)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.mx_tensor import to_mx, to_dtype
        ops["torchao to_mx"] = lambda: to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)
        scale_e8m0, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)
        ops["torchao dequantize"] = lambda: to_dtype(data, scale_e8m0, torch.float8_e4m3fn, 32, torch.float32)
    except Exception as e:  # peer missing: say so, keep going
        print(f"torchao unavailable: {e}", file=sys.stderr)

    try:
        from optimum.quanto import MaxOptimizer, qint4, quantize_weight

        opt = MaxOptimizer()

        def quanto_q():
            scale, zero = opt(x, qint4, 0, 32)
            return quantize_weight(x, qint4, 0, scale, zero, 32)

        qt = quanto_q()
        ops["quanto quantize"] = quanto_q
        ops["quanto dequantize"] = lambda: qt.dequantize()
    except Exception as e:
        print(f"optimum-quanto unavailable: {e}", file=sys.stderr)

    kq, vq = Int4Grouped(32, "channel"), Int4Grouped(32, "token")
    pk, pv = kq.quantize(x), vq.quantize(x)
    ops["plain torch int4 channel quantize"] = lambda: kq.quantize_reference(x)
    ops["plain torch int4 channel dequantize"] = lambda: kq.dequantize_reference(pk)
    ops["int4 channel quantize"] = lambda: kq.quantize(x)
    ops["int4 channel dequantize"] = lambda: kq.dequantize(pk)
    ops["int4 token quantize"] = lambda: vq.quantize(x)
    ops["int4 token dequantize"] = lambda: vq.dequantize(pv)
    rw = ResidualWindow(kq, vq, recent=128)
    prw = rw.pack(x, v)
    ops["residual window pack (K+V)"] = lambda: rw.pack(x, v)
    ops["residual window unpack (K+V)"] = lambda: rw.unpack(prw)
    mx = MXFP8()
    pmx = mx.quantize(x)
    ops["mxfp8 quantize"] = lambda: mx.quantize(x)
    ops["mxfp8 dequantize"] = lambda: mx.dequantize(pmx)
    if hasattr(mx, "quantize_reference"):
        ops["plain torch mxfp8 quantize"] = lambda: mx.quantize_reference(x)
    return ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--shape", default="32,8192,128")
    ap.add_argument("--json", default="target/bench/quant.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = tuple(int(s) for s in args.shape.split(","))
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(*shape, generator=g)
    v = torch.randn(*shape, generator=g)
    ops = build_ops(x, v)
    for fn in ops.values():  # warm-up (and numba compilation, cached on disk)
        fn()
    times = {name: [] for name in ops}
    rng = random.Random(args.seed)
    for _ in range(args.repeats):
        order = list(ops)
        rng.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            ops[name]()
            times[name].append(time.perf_counter() - t0)
    gb = x.numel() * 4 / 1e9
    rate = {}
    for name, ts in times.items():
        data = 2 * gb if "(K+V)" in name else gb
        rate[name] = data / statistics.median(ts)
    def copy_peer(name):  # the K/V ops against a copy of the same two arrays
        return "memory copy (K+V)" if "(K+V)" in name and "memory copy (K+V)" in rate else "memory copy"

    print(f"shape {shape} float32, {args.threads} threads, median of {args.repeats}; GB/s of float32 input\n")
    print(f"{'op':40s} {'GB/s':>7s} {'x copy':>7s}")
    for name in ops:
        print(f"{name:40s} {rate[name]:7.2f} {rate[name] / rate[copy_peer(name)]:7.2f}")
    print("\ntargets (issue #7):")
    verdicts = []
    for op, peer, need in TARGETS:
        if op in rate and peer in rate:
            r = rate[op] / rate[peer]
            ok = r >= need
            verdicts.append({"op": op, "peer": peer, "ratio": r, "target": need, "met": ok})
            print(f"  {op:28s} vs {peer:18s} {r:6.2f}x (target >= {need:.0f}x) {'met' if ok else 'MISSED'}")
    for name in ops:
        if name.startswith(("int4", "mxfp8", "residual")):
            peer = copy_peer(name)
            r = rate[peer] / rate[name]
            verdicts.append({"op": name, "peer": peer, "ratio": 1 / r, "target": 0.25, "met": r <= 4})
            print(f"  {name:28s} within {r:4.2f}x of the {peer} (target <= 4x) {'met' if r <= 4 else 'MISSED'}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "shape": shape, "threads": args.threads, "repeats": args.repeats,
        "torch": torch.__version__, "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "seconds": times, "gb_per_s": rate, "targets": verdicts,
    }, indent=1))
    print(f"\nraw timings: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
