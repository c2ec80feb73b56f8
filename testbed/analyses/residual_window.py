"""Is the most recent window worth keeping in float32?

For each Case: K and V packed with grouped integer quantization (K per channel, V per token)
and a float32 window of the most recent R tokens, for every R of the protocol; plus an arm that
keeps the *first* ``early_window`` tokens float32 instead, and an unquantized float32 arm. The
attention output on the dequantized K/V is compared with the float64 reference attention on the
original K/V (relative L2, cosine, max-abs); the reference attention mass on the protected
tokens explains the result (it is an oracle quantity, not something a cache gets for free).
Probabilities and attention passes go over tiles of queries holding about ``max_scores`` float64
scores (`testbed.attention.query_tiles`), never ``[H, Tq, Tk]``; the outputs ``[H, Tq, D]`` are kept
whole. A Case that fits one tile (every default protocol's) gives the untiled numbers bit for bit;
other tilings agree to rounding, except that the float32 arm, whose own float32 rounding is the
measurement, moves within float32 rounding when its passes take fewer queries at once.
Follows the synthetic residual-window study (docs/studies.md) and KIVI's residual design.
"""

from __future__ import annotations

import json

import torch
from tabulate import tabulate

from ..attention import DEFAULT_CHUNK, DEFAULT_MAX_SCORES, attention_case, probability_tiles, query_tiles
from ..context import case_fields
from ..metrics import cosine, max_abs, rel_l2
from ..schema import Key, ProtocolError, Spec
from ..quant import IntGrouped, ResidualWindow, from_config

__all__ = ["validate", "evaluate", "report", "arms", "SPEC"]


SPEC = Spec("analysis: residual_window", "Is the most recent window worth float32? K per channel / V per token "
            "grouped integer quantization with a float32 window of the last R tokens, against the float64 "
            "reference attention.", {
    "bits": Key((int, type(None)), "bits per quantized K/V element of the KIVI layout (2, 3, 4 or 8: K per channel, "
                                   "V per token); null with key and value", None),
    "group_size": Key((int, type(None)), "elements sharing one scale and zero point (a power of two, 2 to 256); "
                                         "null with key and value", None),
    "key": Key((dict, type(None)), "instead of bits and group_size: the quantizer config of K, every parameter spelled out (e.g. "
                     "{\"kind\": \"mx\", \"element\": \"e4m3\", \"block_size\": 32, \"rotation\": null, \"seed\": 0, "
                     "\"scale_rule\": \"floor\"})", None),
    "value": Key((dict, type(None)), "the quantizer config of V (with key)", None),
    "residuals": Key(("list", ("range", int, 0, 1 << 20), 1), "float32 window sizes R to try (one arm each)"),
    "early_window": Key(("range", int, 0, 1 << 20), "an arm that keeps the first this many tokens float32 instead "
                                                    "(0: no such arm)", 16),
    "float32_arm": Key(bool, "also run the unquantized float32 arm", True),
    "recent_mass_window": Key(("range", int, 1, 1 << 20), "tokens counted as recent for the reference-mass column",
                              16),
    "max_scores": Key(("range", int, 1, 1 << 30), "float64 scores per tile of queries (memory bound; a tile holds "
                      "at least one query of every head)", DEFAULT_MAX_SCORES),
}, rules=("either bits and group_size (K per channel, V per token, as KIVI) or key and value quantizer configs, "
          "each spelled out in full",))


def validate(params, where):
    p = SPEC.check(params, where)
    kivi = p["bits"] is not None or p["group_size"] is not None
    given = p["key"] is not None or p["value"] is not None
    if kivi == given or (kivi and (p["bits"] is None or p["group_size"] is None)) or \
            (given and (p["key"] is None or p["value"] is None)):
        raise ProtocolError(f"{where}: give either bits and group_size, or key and value quantizer configs")
    if kivi:
        try:
            IntGrouped(p["bits"], p["group_size"], "channel")
        except ValueError as e:
            raise ProtocolError(f"{where}: {e}") from None
        if p["group_size"] > 256:
            raise ProtocolError(f"{where}.group_size: {p['group_size']} is above 256")
        return p
    for part in ("key", "value"):
        try:
            full = from_config(p[part]).config()
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"{where}.{part}: {e}") from None
        if full != p[part]:
            raise ProtocolError(f"{where}.{part}: spell out every parameter of the quantizer (the row records them): "
                                f"{json.dumps(full)}")
    return p


def quantizers(params) -> tuple:
    """The K and V quantizers of the protocol: from bits and group_size (K per channel, V per token)
    or from the key and value configs."""
    if params.get("key") is not None:
        return from_config(params["key"]), from_config(params["value"])
    return IntGrouped(params["bits"], params["group_size"], "channel"), IntGrouped(params["bits"], params["group_size"], "token")


def scheme_label(key_cfg: dict, value_cfg: dict) -> str:
    """The row's scheme: ``int4_grouped_g32+residual`` when K and V share bits and group size (the
    axis is the layout's), else the K scheme with the V scheme in parentheses. Each part is its
    quantizer's ``label`` (a property of every registered kind; an unknown kind or a kind without a
    label raises, never a bare kind that would lose the scheme's parameters)."""
    k, v = from_config(key_cfg).label, from_config(value_cfg).label
    if key_cfg["kind"] == value_cfg["kind"] == "int_grouped":
        if (key_cfg["bits"], key_cfg["group_size"]) == (value_cfg["bits"], value_cfg["group_size"]):
            return f"{k}+residual"
        return f"{k}+residual(value {value_cfg['bits']}-bit g{value_cfg['group_size']})"
    return f"{k}+residual" if k == v else f"{k}+residual(value {v})"


def arms(params) -> list[tuple[str, ResidualWindow | None]]:
    """(arm name, packer) in protocol order; ``None`` is the float32 arm."""
    key, value = quantizers(params)
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


def _span_masses(case, spans: list[tuple[int, int]], tiles: list[slice]) -> dict[tuple[int, int], float]:
    """{(start, stop): the reference attention mass on keys [start, stop), mean over (head, query)
    rows}, from the probabilities of one tile of queries at a time (per-row masses written into
    ``[H, Tq]`` tensors, then averaged: over one tile, the untiled mean bit for bit)."""
    per_row = {sp: torch.empty(case.heads, case.q.shape[1], dtype=torch.float64) for sp in spans}
    for sl, p in probability_tiles(case.q, case.k, case.query_positions, case.causal, tiles):
        for a, b in spans:
            per_row[(a, b)][:, sl] = p[..., a:b].sum(-1)
    return {sp: float(rows.mean()) for sp, rows in per_row.items()}


def evaluate(case, params, ctx) -> list[dict]:
    n = case.keys
    tiles = query_tiles(case.heads, case.q.shape[1], n, params["max_scores"])
    chunk = min(DEFAULT_CHUNK, tiles[0].stop - tiles[0].start)  # attention passes within one tile's scores
    ref = attention_case(case, chunk=chunk)
    baseline_bytes = 2 * case.k.numel() * 4
    focus = case.meta.get("focus_span")
    plan = arms(params)
    spans = []
    for _, packer in plan:
        window = packer.recent if packer is not None else n
        window = window if window > 0 else params["recent_mass_window"]
        spans.append((n - min(window, n), n))
        spans += [(a, b) for a, b in _protected_span(packer, n) if b > a]
    if focus:
        spans.append((focus[0], focus[1]))
    masses = _span_masses(case, list(dict.fromkeys(spans)), tiles)
    focus_mass = masses[(focus[0], focus[1])] if focus else None
    rows = []
    for arm, packer in plan:
        if packer is None:
            out = attention_case(case, dtype=torch.float32, chunk=chunk)
            payload, packed_paths, quant = baseline_bytes, {}, None
        else:
            packed = packer.pack(case.k, case.v)
            k_hat, v_hat = packer.unpack(packed)
            out = attention_case(case, k_hat, v_hat, chunk=chunk)
            payload = packed.nbytes
            packed_paths = ctx.store.save_packed(f"{ctx.study}/{case.id}/{arm}", packed)
            quant = packer.config()
        r = packer.recent if packer is not None else n
        window = r if r > 0 else params["recent_mass_window"]
        recent_mass = masses[(n - min(window, n), n)]
        protected = sum(masses[(a, b)] for a, b in _protected_span(packer, n) if b > a)
        rows.append({
            "study": ctx.study,
            "analysis": "residual_window",
            **case_fields(case),
            "arm": arm,
            "scheme": "float32" if packer is None else scheme_label(packer.key.config(), packer.value.config()),
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
