"""Is the most recent window worth keeping in float32?

For each Case: K and V packed with grouped integer quantization (K per channel, V per token)
and a float32 window of the most recent R tokens, for every R of the protocol; plus an arm that
keeps the *first* ``early_window`` tokens float32 instead, and an unquantized float32 arm. The
attention output on the dequantized K/V is compared with the float64 reference attention on the
original K/V (relative L2, cosine, max-abs); the reference attention mass on the protected
tokens explains the result (it is an oracle quantity, not something a cache gets for free).
Follows the synthetic residual-window study (docs/studies.md) and KIVI's residual design.
"""

from __future__ import annotations

import torch
from tabulate import tabulate

from ..attention import attention_case, probabilities
from ..context import case_fields
from ..metrics import cosine, max_abs, rel_l2
from ..schema import Key, Spec
from ..quant import IntGrouped, ResidualWindow

__all__ = ["validate", "evaluate", "report", "arms", "SPEC"]


SPEC = Spec("analysis: residual_window", "Is the most recent window worth float32? K per channel / V per token "
            "grouped integer quantization with a float32 window of the last R tokens, against the float64 "
            "reference attention.", {
    "bits": Key(("choice", (2, 4, 8)), "bits per quantized K/V element"),
    "group_size": Key(("choice", (2, 4, 8, 16, 32, 64, 128, 256)), "elements sharing one scale and zero point"),
    "residuals": Key(("list", ("range", int, 0, 1 << 20), 1), "float32 window sizes R to try (one arm each)"),
    "early_window": Key(("range", int, 0, 1 << 20), "an arm that keeps the first this many tokens float32 instead "
                                                    "(0: no such arm)", 16),
    "float32_arm": Key(bool, "also run the unquantized float32 arm", True),
    "recent_mass_window": Key(("range", int, 1, 1 << 20), "tokens counted as recent for the reference-mass column",
                              16),
})


def validate(params, where):
    return SPEC.check(params, where)


def arms(params) -> list[tuple[str, ResidualWindow | None]]:
    """(arm name, packer) in protocol order; ``None`` is the float32 arm."""
    key = IntGrouped(params["bits"], params["group_size"], "channel")
    value = IntGrouped(params["bits"], params["group_size"], "token")
    out: list[tuple[str, ResidualWindow | None]] = []
    if params["float32_arm"]:
        out.append(("float32", None))
    for r in params["residuals"]:
        out.append((f"R={r}", ResidualWindow(key, value, recent=r)))
    if params["early_window"]:
        out.append((f"first{params['early_window']}", ResidualWindow(key, value, recent=0, sink=params["early_window"])))
    return out


def _protected_span(packer: ResidualWindow | None, n: int) -> list[tuple[int, int]]:
    if packer is None:
        return [(0, n)]
    start, stop = packer.spans(n)
    return [(0, start), (stop, n)]


def evaluate(case, params, ctx) -> list[dict]:
    n = case.keys
    ref = attention_case(case)
    probs = probabilities(case.q, case.k, case.query_positions, case.causal)
    baseline_bytes = 2 * case.k.numel() * 4
    focus = case.meta.get("focus_span")
    focus_mass = float(probs[..., focus[0]:focus[1]].sum(-1).mean()) if focus else None
    rows = []
    plan = arms(params)
    for arm, packer in plan:
        if packer is None:
            out = attention_case(case, dtype=torch.float32)
            payload, packed_paths, quant = baseline_bytes, {}, None
        else:
            packed = packer.pack(case.k, case.v)
            k_hat, v_hat = packer.unpack(packed)
            out = attention_case(case, k_hat, v_hat)
            payload = packed.nbytes
            packed_paths = ctx.store.save_packed(f"{ctx.study}/{case.id}/{arm}", packed)
            quant = packer.config()
        r = packer.recent if packer is not None else n
        window = r if r > 0 else params["recent_mass_window"]
        recent_mass = float(probs[..., n - min(window, n):].sum(-1).mean())
        protected = sum(float(probs[..., a:b].sum(-1).mean()) for a, b in _protected_span(packer, n) if b > a)
        rows.append({
            "study": ctx.study,
            "analysis": "residual_window",
            **case_fields(case),
            "arm": arm,
            "scheme": "float32" if packer is None else f"int{params['bits']}_grouped_g{params['group_size']}+residual",
            "residual": r if packer is not None else None,
            "sink_window": packer.sink if packer is not None else None,
            "rel_l2": rel_l2(out, ref),
            "cosine": cosine(out, ref),
            "max_abs": max_abs(out, ref),
            "payload_bytes": int(payload),
            "baseline_bytes": int(baseline_bytes),
            "reduction": 1.0 - payload / baseline_bytes,
            "recent_mass": recent_mass,
            "recent_mass_window": window,
            "protected_mass": protected,
            "focus_mass": focus_mass,
            "quant": quant,
            # outputs are not stored: the audit recomputes them from q and the packed K/V
            "arrays": {"packed": packed_paths},
        })
    # ctx.timed calls each lambda at once, so the loop variables it reads are the current ones (B023)
    for repeat in range(ctx.timing_repeats):
        for arm, packer in ctx.shuffled(plan):
            if packer is None:
                continue
            packed = ctx.timed(case.id, arm, "pack", repeat, lambda: packer.pack(case.k, case.v))  # noqa: B023
            ctx.timed(case.id, arm, "unpack", repeat, lambda: packer.unpack(packed))  # noqa: B023
    return rows


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def report(rows, params) -> str:
    arm_names = list(dict.fromkeys(r["arm"] for r in rows))
    dists = list(dict.fromkeys(r.get("distribution", r["case"]) for r in rows))
    out = []
    table = []
    for d in dists:
        sel = [r for r in rows if r.get("distribution", r["case"]) == d]
        line = [d, len({r["case"] for r in sel})]
        for a in arm_names:
            line.append(f"{100 * _mean([r['rel_l2'] for r in sel if r['arm'] == a]):.3f}%")
        for a in arm_names:
            if a.startswith("R=") and a != "R=0":
                line.append(f"{100 * _mean([r['protected_mass'] for r in sel if r['arm'] == a]):.2f}%")
        first = [a for a in arm_names if a.startswith("first")]
        for a in first:
            line.append(f"{100 * _mean([r['protected_mass'] for r in sel if r['arm'] == a]):.2f}%")
        focus = _mean([r["focus_mass"] for r in sel if r["arm"] == arm_names[0]])
        line.append("-" if focus != focus else f"{100 * focus:.2f}%")
        table.append(line)
    headers = ["distribution", "inputs"] + [f"rel-L2 {a}" for a in arm_names]
    headers += [f"mass kept fp32 {a}" for a in arm_names if a.startswith("R=") and a != "R=0"]
    headers += [f"mass kept fp32 {a}" for a in arm_names if a.startswith("first")]
    headers += ["focus mass"]
    out.append("Mean attention-output relative L2 per input against the float64 reference (mean over inputs), "
               "and the reference attention mass on the tokens each arm keeps in float32.\n")
    out.append(tabulate(table, headers=headers, tablefmt="github"))
    sizes = sorted({r["n"] for r in rows if "n" in r})
    if sizes:
        btab = []
        for n in sizes:
            for a in arm_names:
                sel = [r for r in rows if r.get("n") == n and r["arm"] == a]
                if not sel:
                    continue
                r0 = sel[0]
                half = r0["baseline_bytes"] // 2
                btab.append([n, a, f"{r0['payload_bytes']:,}", f"{r0['baseline_bytes']:,}", f"{100 * r0['reduction']:.1f}%",
                             f"{half:,}", f"{100 * (1 - r0['payload_bytes'] / half):.1f}%"])
        out.append("\nPayload bytes of K+V (every stored array counted: codes, float16 scales and zero-points, "
                   "group padding, float32 windows, the 16-byte header), against the same K+V in float32 and in a "
                   "16-bit format (float16 or bfloat16, half the bytes; a negative reduction is a payload larger "
                   "than the 16-bit cache, as a float32 window can make it).\n")
        out.append(tabulate(btab, headers=["N", "arm", "payload B", "float32 K+V B", "reduction", "16-bit K+V B",
                                           "reduction vs 16-bit"], tablefmt="github"))
    return "\n".join(out)
