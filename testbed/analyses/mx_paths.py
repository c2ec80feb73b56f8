"""How much does MXFP8 on Q/K, or on the probability path, change attention?

Two paths, each against the float64 reference ``P = softmax(Q Kᵀ / sqrt(D))``, ``O = P V`` on the
Case's own (float32) Q, K, V:

- ``qk``: Q and K are each quantized MX (E4M3 elements, E8M0 scales, 32-element blocks along the
  head dimension, the contraction axis of ``Q Kᵀ``), without rotation and with the signed
  Hadamard rotation (``R = diag(s) H_n / sqrt(n)``, n = 128 or the head dimension) applied to both
  first. Scores are ``Q̂ K̂ᵀ / sqrt(D)`` in the rotated domain, as a kernel computes them
  (``(QR)(KR)ᵀ = QKᵀ`` in exact arithmetic); softmax and ``P̂ V`` in float64 with V unquantized.
- ``p``: the reference probabilities, rounded to float32, are quantized MX in blocks of 32 keys
  along the key axis (the contraction axis of ``P V``; a key count that is not a multiple of 32
  is zero-padded) and ``P̂ V`` is formed without renormalizing, as in the seed study's
  "P-path proxy".

Per row (query head x query): total variation ``TV = 1/2 sum |P̂ - P|``, argmax agreement (first
index on ties, so quantization ties count against it), and for the P path the numerical-zero
rate (keys with ``p > 0`` in the reference that decode to exactly 0) and the row sum of ``P̂``.
Per Case: the attention-output relative L2 ``||Ô - O|| / ||O||``. A row of results.json is one
(case, path, rotation); its per-row values are kept so that the report can pool rows over cases.
Follows the Q/K and P-path measurements of the Catnip week-10 KV-cache attention study (seed
000: median Q/K TV 1.52 %, argmax agreement 94.33 %, P-path numerical-zero rate median 0 and
mean 2.45 %, P̂ row-sum median 0.999392) and OCP MX v1.0 (see ``testbed.quant.mx``).
"""

from __future__ import annotations

import numpy as np
import torch
from tabulate import tabulate

from ..attention import expand_kv, probabilities
from ..context import case_fields
from ..metrics import numerical_zero_rate, rel_l2, total_variation
from ..schema import Key, ProtocolError, Spec
from ..quant.mx import ELEMENTS, MX

__all__ = ["validate", "evaluate", "report", "ROTATION_NAMES", "SPEC"]

ROTATION_NAMES = ("none", "signed_hadamard")
TV_HIGH = 0.05

# The seed study's headline figures (a real video DiT, one prompt and seed; production
# signed-H128 E4M3/E8M0 K32 Q/K and a per-K32 P path), quoted in the report for comparison.
SEED_STUDY = {"qk_tv_median": 0.0152, "qk_argmax": 0.9433, "p_tv_median": 0.0106, "p_zero_median": 0.0,
              "p_zero_mean": 0.0245, "p_row_sum_median": 0.999392, "p_rows_with_zero": 0.3663}


SPEC = Spec("analysis: mx_paths", "MX quantization on the Q/K path (with and without a signed Hadamard rotation) "
            "and on the probability path, against the float64 reference: TV, argmax agreement, zeros, row sums.", {
    "element": Key(("choice", tuple(ELEMENTS)), "MX element format", "e4m3"),
    "block_size": Key(("choice", (2, 4, 8, 16, 32, 64, 128)), "elements per shared E8M0 scale", 32),
    "rotations": Key(("list", ("choice", ROTATION_NAMES), 1), "Q/K path variants", list(ROTATION_NAMES)),
    "rotation_seed": Key(("range", int, 0, 2**31 - 1), "seed of the rotation's random signs", 0),
    "p_path": Key(bool, "also quantize the probabilities (the P path)", True),
})


def validate(params, where):
    p = SPEC.check(params, where)
    if len(set(p["rotations"])) != len(p["rotations"]):
        raise ProtocolError(f"{where}.rotations: {p['rotations']!r} names a rotation twice")
    return p


def _stats(tv: torch.Tensor, agree: torch.Tensor, zero: torch.Tensor | None, row_sum: torch.Tensor | None) -> dict:
    tv_np = tv.reshape(-1).numpy()
    out = {
        "rows": int(tv_np.size),
        "tv_median": float(np.median(tv_np)),
        "tv_mean": float(np.mean(tv_np)),
        "tv_p95": float(np.percentile(tv_np, 95)),
        "tv_max": float(np.max(tv_np)),
        "tv_over_5pct": float(np.mean(tv_np > TV_HIGH)),
        "argmax_agreement": float(agree.to(torch.float64).mean()),
        "numerical_zero_rate_median": None,
        "numerical_zero_rate_mean": None,
        "rows_with_zero": None,
        "row_sum_median": None,
        "row_sum_min": None,
        "row_sum_max": None,
    }
    per_row = {"tv": tv_np.tolist(), "numerical_zero_rate": None, "row_sum": None}
    if zero is not None:
        z = zero.reshape(-1).numpy()
        s = row_sum.reshape(-1).numpy()
        out.update({
            "numerical_zero_rate_median": float(np.median(z)),
            "numerical_zero_rate_mean": float(np.mean(z)),
            "rows_with_zero": float(np.mean(z > 0)),
            "row_sum_median": float(np.median(s)),
            "row_sum_min": float(np.min(s)),
            "row_sum_max": float(np.max(s)),
        })
        per_row["numerical_zero_rate"] = z.tolist()
        per_row["row_sum"] = s.tolist()
    out["per_row"] = per_row
    return out


def _argmax_agree(p_hat: torch.Tensor, p_ref: torch.Tensor) -> torch.Tensor:
    return p_hat.argmax(dim=-1) == p_ref.argmax(dim=-1)


def evaluate(case, params, ctx) -> list[dict]:
    element, block = params["element"], params["block_size"]
    p_ref = probabilities(case.q, case.k, case.query_positions, case.causal)        # float64 [H, Tq, Tk]
    v64 = expand_kv(case.v, case.heads).to(torch.float64)
    o_ref = p_ref @ v64
    prefix = f"{ctx.study}/{case.id}"
    float32_qk = 4 * (case.q.numel() + case.k.numel())
    rows = []
    base = {"study": ctx.study, "analysis": "mx_paths", **case_fields(case), "element": element, "block_size": block}

    quantizers = {rot: MX(element, block, None if rot == "none" else rot, params["rotation_seed"])
                  for rot in params["rotations"]}
    for rot, mx in quantizers.items():
        pq = mx.quantize(case.q, name=f"{case.id}.q")
        pk = mx.quantize(case.k, name=f"{case.id}.k")
        q_hat = mx.decode_rotated(pq)
        k_hat = mx.decode_rotated(pk)
        p_hat = probabilities(q_hat, k_hat, case.query_positions, case.causal)
        o_hat = p_hat @ v64
        arrays = {"q": ctx.store.save_packed(f"{prefix}/qk_{rot}/q", pq),
                  "k": ctx.store.save_packed(f"{prefix}/qk_{rot}/k", pk)}
        rotation = mx.rotation_for(case.q.shape[-1])
        if rotation is not None:
            arrays["signs"] = ctx.store.save(f"{prefix}/qk_{rot}/signs", rotation.signs)
        rows.append({**base, "scheme": mx.name, "rotation": rot, "path": "qk",
                     **_stats(total_variation(p_hat, p_ref), _argmax_agree(p_hat, p_ref), None, None),
                     "rel_l2": rel_l2(o_hat, o_ref),
                     "payload_bytes": pq.nbytes + pk.nbytes, "float32_bytes": float32_qk,
                     "quant": mx.config(), "arrays": arrays})

    if params["p_path"]:
        mx = MX(element, block)
        p32 = p_ref.to(torch.float32)
        pp = mx.quantize(p32, name=f"{case.id}.p")
        p_hat = mx.dequantize(pp).to(torch.float64)
        o_hat = p_hat @ v64
        rows.append({**base, "scheme": mx.name, "rotation": "none", "path": "p",
                     **_stats(total_variation(p_hat, p_ref), _argmax_agree(p_hat, p_ref),
                              numerical_zero_rate(p_hat, p_ref), p_hat.sum(dim=-1)),
                     "rel_l2": rel_l2(o_hat, o_ref),
                     "payload_bytes": pp.nbytes, "float32_bytes": 4 * p_ref.numel(),
                     "quant": mx.config(), "arrays": {"p": ctx.store.save_packed(f"{prefix}/p/p", pp)}})

    for repeat in range(ctx.timing_repeats):
        for rot, mx in ctx.shuffled(list(quantizers.items())):
            packed = ctx.timed(case.id, f"qk_{rot}", "quantize_k", repeat, lambda: mx.quantize(case.k))
            ctx.timed(case.id, f"qk_{rot}", "decode_k", repeat, lambda: mx.decode_rotated(packed))
        if params["p_path"]:
            mxp = MX(element, block)
            p32 = p_ref.to(torch.float32)
            packed = ctx.timed(case.id, "p", "quantize_p", repeat, lambda: mxp.quantize(p32))
            ctx.timed(case.id, "p", "decode_p", repeat, lambda: mxp.dequantize(packed))
    return rows


def _pct(x, digits=2) -> str:
    return "-" if x is None or x != x else f"{100 * x:.{digits}f}%"


def _pooled(sel: list[dict], key: str) -> np.ndarray | None:
    parts = [r["per_row"][key] for r in sel if r["per_row"].get(key) is not None]
    return np.asarray([x for part in parts for x in part], dtype=np.float64) if parts else None


def report(rows, params) -> str:
    out = []
    arms = list(dict.fromkeys((r["path"], r["rotation"], r["scheme"]) for r in rows))
    table = []
    for path, rot, scheme in arms:
        sel = [r for r in rows if (r["path"], r["rotation"], r["scheme"]) == (path, rot, scheme)]
        tv = _pooled(sel, "tv")
        n_rows = sum(r["rows"] for r in sel)
        agree = sum(r["argmax_agreement"] * r["rows"] for r in sel) / n_rows
        z = _pooled(sel, "numerical_zero_rate")
        s = _pooled(sel, "row_sum")
        table.append([path, rot, scheme, len(sel), n_rows, _pct(float(np.median(tv))), _pct(float(np.mean(tv))),
                      _pct(float(np.percentile(tv, 95))), _pct(float(np.mean(tv > TV_HIGH))), _pct(agree),
                      "-" if z is None else _pct(float(np.median(z))), "-" if z is None else _pct(float(np.mean(z))),
                      "-" if z is None else _pct(float(np.mean(z > 0))),
                      "-" if s is None else f"{float(np.median(s)):.6f}",
                      _pct(float(np.mean([r["rel_l2"] for r in sel])), 3)])
    out.append("Pooled over every (query head, query) row of every input: TV of each softmax row against the "
               "float64 reference, argmax agreement, and for the P path the numerical-zero rate (reference "
               "p > 0, decoded 0) and the row sum of the decoded P; output relative L2 is the mean over inputs.\n")
    out.append(tabulate(table, headers=["path", "rotation", "scheme", "inputs", "rows", "median TV", "mean TV",
                                        "p95 TV", "rows TV>5%", "argmax agree", "zero-rate median",
                                        "zero-rate mean", "rows with a zero", "row-sum median", "mean rel-L2"],
                        tablefmt="github"))
    dists = list(dict.fromkeys(r.get("distribution", "-") for r in rows))
    dtab = []
    for d in dists:
        line = [d]
        for path, rot, scheme in arms:
            sel = [r for r in rows if r.get("distribution", "-") == d and (r["path"], r["rotation"], r["scheme"]) == (path, rot, scheme)]
            tv = _pooled(sel, "tv")
            line.append(_pct(float(np.median(tv))) if tv is not None else "-")
        dtab.append(line)
    out.append("\nMedian TV per distribution.\n")
    out.append(tabulate(dtab, headers=["distribution"] + [f"{p} {r}" for p, r, _ in arms], tablefmt="github"))
    s = SEED_STUDY
    out.append(f"\nSeed study for comparison (a real video DiT, one prompt and seed, so not the same inputs): "
               f"Q/K median TV {_pct(s['qk_tv_median'])}, argmax agreement {_pct(s['qk_argmax'])} (signed-H128); "
               f"P path median TV {_pct(s['p_tv_median'])}, numerical-zero rate median {_pct(s['p_zero_median'])} "
               f"and mean {_pct(s['p_zero_mean'])}, {_pct(s['p_rows_with_zero'])} rows with a zero, row-sum median "
               f"{s['p_row_sum_median']}. Synthetic Gaussian attention is far more diffuse than a trained model's, "
               "so the absolute figures are not expected to match; the comparison is of the measurement, not the model.")
    return "\n".join(out)
