"""Audit of residual-window rows: re-encode the case's K/V and require the stored payload byte for
byte (codes, float16 scales and zero-points, the float32 sink and recent windows, the header),
then decode the stored payload, recompute attention and every number."""

from __future__ import annotations

import numpy as np

from .common import cosine, max_abs, rel_l2, softmax_attention
from .report_format import P, T, Num, label, ordered, pct, text
from .schemes import decode_residual_window, encode_residual_window, payload_differences, quantizer_label
from .stats import mean


def check(row: dict, ctx) -> None:
    case = ctx.case(row)
    q, k, v = case["q"], case["k"], case["v"]
    n = k.shape[1]
    probs, ref = ctx.cached(("ref", row["study"], row["case"]),
                            lambda: softmax_attention(q, k, v, case["query_positions"], case["causal"]))
    baseline = 2 * k.size * 4
    ctx.equal(row, "baseline_bytes", row["baseline_bytes"], baseline)
    _check_labels(row, ctx, n)
    if row["quant"] is None:
        # the float32 arm is float32 arithmetic on the original K/V: the audit computes it in float32
        # too, so its (tiny) error is compared with an absolute tolerance of float32 rounding
        _, out = softmax_attention(q, k, v, case["query_positions"], case["causal"], dtype=np.float32)
        if (abs(row["rel_l2"] - rel_l2(out, ref)) > 1e-6 or abs(row["max_abs"] - max_abs(out, ref)) > 1e-5
                or abs(row["cosine"] - cosine(out, ref)) > 1e-6):
            ctx.fail(row, f"float32 arm: rel_l2 {row['rel_l2']:.3g} / max_abs {row['max_abs']:.3g} not reproduced "
                          f"within float32 rounding ({rel_l2(out, ref):.3g} / {max_abs(out, ref):.3g})")
        ctx.equal(row, "payload_bytes", row["payload_bytes"], baseline)
        ctx.equal(row, "arrays.packed", row["arrays"]["packed"], {})  # float32 stores no payload
        spans = [(0, n)]
    else:
        cfg = row["quant"]
        arrays = {name: ctx.load(path) for name, path in row["arrays"]["packed"].items()}
        check_reencoded(row, ctx, arrays, encode_residual_window(k, v, cfg), "the case's K/V")
        k_hat, v_hat = decode_residual_window(arrays, cfg, k.shape)
        _, out = softmax_attention(q, k_hat, v_hat, case["query_positions"], case["causal"])
        ctx.equal(row, "payload_bytes", row["payload_bytes"], int(sum(a.nbytes for a in arrays.values())))
        start = min(cfg["sink"], n)
        stop = max(start, n - cfg["recent"])
        spans = [(0, start), (stop, n)]
        ctx.equal(row, "residual", row["residual"], cfg["recent"])
    if row["quant"] is not None:
        ctx.close(row, "rel_l2", row["rel_l2"], rel_l2(out, ref))
        ctx.close(row, "cosine", row["cosine"], cosine(out, ref))
        ctx.close(row, "max_abs", row["max_abs"], max_abs(out, ref))
    ctx.close(row, "reduction", row["reduction"], 1.0 - row["payload_bytes"] / baseline)
    window = min(row["recent_mass_window"], n)
    ctx.close(row, "recent_mass", row["recent_mass"], float(probs[..., n - window:].sum(-1).mean()))
    ctx.close(row, "protected_mass", row["protected_mass"],
              sum(float(probs[..., a:b].sum(-1).mean()) for a, b in spans if b > a))
    focus = case["meta"].get("focus_span")
    ctx.close(row, "focus_mass", row.get("focus_mass"),
              float(probs[..., focus[0]:focus[1]].sum(-1).mean()) if focus else None)


def check_reencoded(row: dict, ctx, stored: dict, want: dict, what: str) -> None:
    """Every stored payload array equals the audit's re-encoding of the input, byte for byte."""
    ctx.numbers += len(want)
    for line in payload_differences(stored, want, what):
        ctx.fail(row, line)


def _check_labels(row: dict, ctx, n: int) -> None:
    """The arm, scheme and window labels follow from the recorded quantizer configuration."""
    cfg = row["quant"]
    if cfg is None:
        arm, scheme, sink = "float32", "float32", None
    else:
        scheme = scheme_label(cfg["key"], cfg["value"])
        sink = cfg["sink"]
        arm = f"first{sink}" if sink and not cfg["recent"] else f"R={cfg['recent']}"
        if sink and cfg["recent"]:
            arm = f"first{sink}+R={cfg['recent']}"
    ctx.equal(row, "arm", row["arm"], arm)
    ctx.equal(row, "scheme", row["scheme"], scheme)
    ctx.equal(row, "sink_window", row["sink_window"], sink)
    if not 1 <= row["recent_mass_window"] <= n:
        ctx.fail(row, f"recent_mass_window {row['recent_mass_window']!r} is outside [1, {n}]")


def scheme_label(key: dict, value: dict) -> str:
    """The documented scheme label: the K scheme, and the V scheme in parentheses where it differs
    (for grouped integers: its bits and group size; the axis is the layout's). Each part is the
    audit's label for its kind (``schemes.quantizer_label``); an unknown kind raises, never a bare kind."""
    k, v = quantizer_label(key), quantizer_label(value)
    if key.get("kind") == value.get("kind") == "int_grouped":
        if (key.get("bits"), key.get("group_size")) == (value.get("bits"), value.get("group_size")):
            return f"{k}+residual"
        return f"{k}+residual(value {value.get('bits')}-bit g{value.get('group_size')})"
    return f"{k}+residual" if k == v else f"{k}+residual(value {v})"

# ---------------------------------------------------------------------------------------------
# report.md: the expected blocks of this analysis's section (audit_checks/report_md.py compares them)
# ---------------------------------------------------------------------------------------------

def report_tables(rows, params) -> list:
    arms = ordered(r["arm"] for r in rows)
    kept = [a for a in arms if a.startswith("R=") and a != "R=0"] + [a for a in arms if a.startswith("first")]
    trs = []
    for dist in ordered(label(r) for r in rows):
        sel = [r for r in rows if label(r) == dist]
        line = [text(dist), text(len({r["case"] for r in sel}))]
        line += [pct(mean([r["rel_l2"] for r in sel if r["arm"] == a]), 3, none="nan%") for a in arms]
        line += [pct(mean([r["protected_mass"] for r in sel if r["arm"] == a]), 2, none="nan%") for a in kept]
        line.append(pct(mean([r["focus_mass"] for r in sel if r["arm"] == arms[0]]), 2, none="-"))
        trs.append(line)
    out = [P("rel-L2", "Mean attention-output relative L2 per input"),
           T("rel-L2 per distribution", ["distribution", "inputs"] + [f"rel-L2 {a}" for a in arms]
             + [f"mass kept fp32 {a}" for a in kept] + ["focus mass"], 1, trs)]
    sizes = sorted({r["n"] for r in rows if "n" in r})
    if sizes:
        btrs = []
        for n in sizes:
            for a in arms:
                sel = [r for r in rows if r.get("n") == n and r["arm"] == a]
                if sel:
                    pay, base = sel[0]["payload_bytes"], sel[0]["baseline_bytes"]
                    half = base // 2
                    btrs.append([text(n), text(a), text(f"{pay:,}"), text(f"{base:,}"),
                                 (Num(1.0 - pay / base, lambda v: f"{100 * v:.1f}%", exact=True),), text(f"{half:,}"),
                                 (Num(1.0 - pay / half, lambda v: f"{100 * v:.1f}%", exact=True),)])
        out += [P("payload", "Payload bytes of K+V"),
                T("payload bytes", ["N", "arm", "payload B", "float32 K+V B", "reduction", "16-bit K+V B",
                                    "reduction vs 16-bit"], 2, btrs)]
    return out
