"""Audit of residual-window rows: decode the stored payload, recompute attention and every number."""

from __future__ import annotations

import numpy as np

from .common import cosine, decode_residual_window, max_abs, rel_l2, softmax_attention


def check(row: dict, ctx) -> None:
    case = ctx.case(row)
    q, k, v = case["q"], case["k"], case["v"]
    n = k.shape[1]
    probs, ref = ctx.cached(("ref", row["study"], row["case"]),
                            lambda: softmax_attention(q, k, v, case["query_positions"], case["causal"]))
    ctx.close(row, "reference_output", ctx.load(row["arrays"]["reference_output"]), ref)
    stored = ctx.load(row["arrays"]["output"])
    baseline = 2 * k.size * 4
    ctx.equal(row, "baseline_bytes", row["baseline_bytes"], baseline)
    if row["quant"] is None:
        _, out32 = softmax_attention(q, k, v, case["query_positions"], case["causal"], dtype=np.float32)
        if rel_l2(stored, out32) > 1e-5:
            ctx.fail(row, f"float32 arm output differs from the audit's float32 attention (rel-L2 {rel_l2(stored, out32):.2e})")
        out = stored
        ctx.equal(row, "payload_bytes", row["payload_bytes"], baseline)
        spans = [(0, n)]
    else:
        cfg = row["quant"]
        arrays = {name: ctx.load(path) for name, path in row["arrays"]["packed"].items()}
        k_hat, v_hat = decode_residual_window(arrays, cfg, k.shape)
        _, out = softmax_attention(q, k_hat, v_hat, case["query_positions"], case["causal"])
        ctx.close(row, "output", stored, out)
        ctx.equal(row, "payload_bytes", row["payload_bytes"], int(sum(a.nbytes for a in arrays.values())))
        start = min(cfg["sink"], n)
        stop = max(start, n - cfg["recent"])
        spans = [(0, start), (stop, n)]
        ctx.equal(row, "residual", row["residual"], cfg["recent"])
    ctx.close(row, "rel_l2", row["rel_l2"], rel_l2(out, ref))
    ctx.close(row, "cosine", row["cosine"], cosine(out, ref))
    ctx.close(row, "max_abs", row["max_abs"], max_abs(out, ref))
    ctx.close(row, "reduction", row["reduction"], 1.0 - row["payload_bytes"] / baseline)
    window = min(row["recent_mass_window"], n)
    ctx.close(row, "recent_mass", row["recent_mass"], float(probs[..., n - window:].sum(-1).mean()))
    ctx.close(row, "protected_mass", row["protected_mass"],
              sum(float(probs[..., a:b].sum(-1).mean()) for a, b in spans if b > a))
    focus = case["meta"].get("focus_span")
    if focus:
        ctx.close(row, "focus_mass", row["focus_mass"], float(probs[..., focus[0]:focus[1]].sum(-1).mean()))
