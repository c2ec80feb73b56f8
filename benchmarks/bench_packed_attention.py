"""Attention over one layer's packed int middle: the numba kernel against the definition and a torch
formulation of the same folds, in one process on the same inputs.

    python benchmarks/bench_packed_attention.py                          # 2 threads
    python benchmarks/bench_packed_attention.py --threads 1 --contexts 1024 8064 --rows 1 4 16

SmolLM2-135M's attention shape (3 KV heads, head dim 64; 9 query heads, so 3 query rows per KV
head and new token), random K (with an outlier channel) and V packed by a KIVI int4 / int2
PolicyLayer (K per channel in groups of 32, V per token in feature groups of 32), batch ``--batch``.
Arms, each returning the softmax parts (numerator, max, sum) of the packed keys:

* ``definition`` -- ``packed_part_reference``: decode K and V to float32, then two matmuls (torch);
* ``kernel`` -- ``packed_part(kernel=True)``: the numba kernel reading the codes (scales and
  zero-points of K folded into the query, one token's V row decoded into scratch at a time);
* ``torch fold`` -- the folds written with torch ops (codes unpacked to float32 per group, the
  folded query per group batched through one matmul, V's scale folded into P): the formulation
  that would also run on CUDA. It is here, not in the package, because it lost on the CPU.

Every arm is checked against the definition before timing (relative 1e-4). Times are medians of
``--repeats`` calls per arm, arms shuffled per round. Ratios are against the definition.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testbed.policies import packed_attention as pa  # noqa: E402
from testbed.policies import preset  # noqa: E402
from testbed.quant.packing import unpack_codes  # noqa: E402


def torch_fold(query, layer, scaling):
    """The folds in torch: scores per K group ``(q * s_g) @ codes_g^T + q . z_g``; values
    ``(P * s_t,f) @ codes + P @ z``."""
    pk, pv = layer.mid_k.packed(), layer.mid_v.packed()
    kq, vq = layer.mid_k.q, layer.mid_v.q
    b, hq, tq, d = query.shape
    hkv, n = pk.shape[-3], pk.shape[-2]
    q = query.to(torch.float32).reshape(b, hkv, (hq // hkv) * tq, d)
    r, g = q.shape[2], kq.group_size
    ks, kz = pk.tensors["scale"].to(torch.float32), pk.tensors["zero"].to(torch.float32)  # [B, H, ng, D]
    ng = ks.shape[-2]
    kc = unpack_codes(pk.tensors["codes"], kq.bits, d).reshape(b, hkv, ng, g, d).to(torch.float32)
    qs = q[:, :, None] * ks[:, :, :, None, :]  # [B, H, ng, R, D]
    s = torch.matmul(qs, kc.transpose(-1, -2)) + torch.matmul(kz, q.transpose(-1, -2))[..., None]
    s = s.transpose(2, 3).reshape(b, hkv, r, ng * g)[..., :n] * scaling
    m = s.amax(-1)
    p = torch.exp(s - m[..., None])
    vs, vz = pv.tensors["scale"].to(torch.float32), pv.tensors["zero"].to(torch.float32)  # [B, H, n, nf]
    nf, f = vs.shape[-1], vq.group_size
    vc = unpack_codes(pv.tensors["codes"], vq.bits, nf * f).reshape(b, hkv, n, nf, f).to(torch.float32)
    pw = (p[..., None] * vs[:, :, None]).permute(0, 1, 4, 2, 3)  # [B, H, nf, R, n]
    num = torch.matmul(pw, vc.permute(0, 1, 3, 2, 4)) + torch.matmul(p, vz).permute(0, 1, 3, 2)[..., None]
    num = num.permute(0, 1, 3, 2, 4).reshape(b, hkv, r, nf * f)[..., :d]
    return num.reshape(b, hq, tq, d), m.reshape(b, hq, tq), p.sum(-1).reshape(b, hq, tq)


def _layer(policy, n, batch, seed=0):
    from testbed.policies.layers import PolicyLayer

    layer = PolicyLayer(policy, layer_idx=0)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, 3, n + policy.window, 64, generator=g) * 2.0
    k[..., 5] += 8.0
    v = torch.randn(batch, 3, n + policy.window, 64, generator=g)
    layer.update(k, v)
    assert layer.mid_k.tokens == n, (layer.mid_k.tokens, n)
    return layer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 8064], help="packed tokens (whole groups)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32], help="new tokens per call (x3 query rows)")
    ap.add_argument("--bits", nargs="+", default=["int4"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true", help="leave out the torch fold arm")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    arms = {"definition": lambda q, layer: pa.packed_part_reference(q, layer, 0.125),
            "kernel": lambda q, layer: pa.packed_part(q, layer, 0.125, kernel=True)}
    if not args.no_torch:
        arms["torch fold"] = lambda q, layer: torch_fold(q, layer, 0.125)
    print(f"# bench_packed_attention: batch {args.batch}, 3 KV heads x 64, {args.threads} threads, median of "
          f"{args.repeats} calls (ms per layer)\n")
    print("| middle | packed tokens | new tokens | " + " | ".join(arms) + " | " +
          " | ".join(f"{a} / definition" for a in arms if a != "definition") + " |")
    print("|---" * (3 + 2 * len(arms) - 1) + "|")
    for bits in args.bits:
        pol = preset(bits, window=128, group=32)
        for n in args.contexts:
            layer = _layer(pol, n, args.batch)
            for tq in args.rows:
                q = torch.randn(args.batch, 9, tq, 64, generator=torch.Generator().manual_seed(tq))
                want = arms["definition"](q, layer)
                for name, fn in arms.items():  # each arm right (and compiled) before timing
                    got = fn(q, layer)
                    a, b = want[0] / want[2][..., None], got[0] / got[2][..., None]
                    assert ((a - b).abs() <= 1e-4 * a.abs().max()).all(), name
                times = {a: [] for a in arms}
                for _ in range(args.repeats):
                    order = list(arms)
                    rng.shuffle(order)
                    for name in order:
                        t0 = time.perf_counter()
                        arms[name](q, layer)
                        times[name].append(time.perf_counter() - t0)
                med = {a: 1e3 * statistics.median(t) for a, t in times.items()}
                print(f"| {bits} | {n} | {tq} | " + " | ".join(f"{m:.2f}" for m in med.values()) + " | " +
                      " | ".join(f"{med[a] / med['definition']:.2f}" for a in arms if a != "definition") + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
