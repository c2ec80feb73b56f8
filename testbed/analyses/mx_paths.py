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

Each path runs once per block-scale rule of the protocol (``scale_rules``): ``floor`` (OCP MX
v1.0: the block maximum lands in ``[2**emax, 2**(emax+1))`` and what exceeds the element maximum
is clamped) and ``rceil`` (the smallest power of two that needs no clamping, as cuBLAS and
torchao's ``RCEIL`` compute it); the share of quantized blocks that clamp is reported per row.

Per row (query head x query): total variation ``TV = 1/2 sum |P̂ - P|``, argmax agreement, told
apart into a strict agreement (the first maximal index of ``P̂`` is the reference's) and a tie
(it is not, but the reference argmax is among ``P̂``'s tied maxima: quantization made two keys
equal, it did not prefer another key), and for the P path the numerical-zero rate (keys with
``p > 0`` in the reference that decode to exactly 0) and the row sum of ``P̂``. Per Case: the
attention-output relative L2 ``||Ô - O|| / ||O||``. A row of results.json is one (case, path,
rotation, scale rule); its per-row values are kept so that the report can pool rows over cases.
Everything is computed over tiles of queries holding about ``max_scores`` float64 scores
(`testbed.attention.query_tiles`), never ``[H, Tq, Tk]``: per-row values are joined across tiles,
the output error accumulates (`testbed.metrics.OutputError`), and the P path's 32-key blocks lie
within one query row, so a tile never splits one; the stored P payload (1 byte per score for 8-bit
elements) is the one whole-case array. A Case that fits one tile (every default protocol's) gives
the untiled numbers bit for bit. With ``store_p`` false (protocols/seed_scale.json: 467 MB of codes
at the seed's shape) the P path's payload is not kept at all, only its byte count; the audit then
re-quantizes the probabilities itself (testbed/audit_checks/mx_paths.py says what it can and cannot
check then).
Follows the Q/K and P-path measurements of the video KV-cache attention study (docs/studies.md:
median Q/K TV 1.52 %, argmax agreement 94.33 %, P-path numerical-zero rate median 0 and mean 2.45 %,
P̂ row-sum median 0.999392) and OCP MX v1.0 (see ``testbed.quant.mx``).
"""

from __future__ import annotations

import numpy as np
import torch
from tabulate import tabulate

from ..attention import DEFAULT_MAX_SCORES, expand_kv, probability_tiles, query_tiles
from ..context import case_fields
from ..metrics import OutputError, numerical_zero_rate, total_variation
from ..schema import Key, ProtocolError, Spec
from ..quant.base import Packed, make_header
from ..quant.mx import ELEMENTS, MX, SCALE_RULES, saturated_blocks

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
    "scale_rules": Key(("list", ("choice", SCALE_RULES), 1), "E8M0 block-scale rules, each a variant of every path "
                       "(floor: OCP MX v1.0; rceil: the smallest scale that needs no clamping)", ["floor"]),
    "max_scores": Key(("range", int, 1, 1 << 30), "float64 scores per tile of queries (memory bound; a tile holds "
                      "at least one query of every head)", DEFAULT_MAX_SCORES),
    "store_p": Key(bool, "store the P path's payload (one byte per score for 8-bit elements); false: the row records "
                   "its bytes (payload_bytes) and no array, and the audit re-quantizes the probabilities itself", True),
})


def validate(params, where):
    p = SPEC.check(params, where)
    if len(set(p["rotations"])) != len(p["rotations"]):
        raise ProtocolError(f"{where}.rotations: {p['rotations']!r} names a rotation twice")
    if len(set(p["scale_rules"])) != len(p["scale_rules"]):
        raise ProtocolError(f"{where}.scale_rules: {p['scale_rules']!r} names a rule twice")
    return p


def _stats(tv: torch.Tensor, agree: tuple[torch.Tensor, torch.Tensor], zero: torch.Tensor | None,
           row_sum: torch.Tensor | None, saturated: float) -> dict:
    tv_np = tv.reshape(-1).numpy()
    strict, tie = agree
    out = {
        "rows": int(tv_np.size),
        "tv_median": float(np.median(tv_np)),
        "tv_mean": float(np.mean(tv_np)),
        "tv_p95": float(np.percentile(tv_np, 95)),
        "tv_max": float(np.max(tv_np)),
        "tv_over_5pct": float(np.mean(tv_np > TV_HIGH)),
        "argmax_agreement": float(strict.to(torch.float64).mean()),
        "argmax_tie": float(tie.to(torch.float64).mean()),
        "block_saturation": saturated,
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


def _argmax_agree(p_hat: torch.Tensor, p_ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(strict, tie) per row: the first maximal index of ``p_hat`` is the reference's (first) argmax;
    or it is not, but ``p_hat`` at the reference argmax equals its maximum (a tie made by rounding)."""
    ref = p_ref.argmax(dim=-1, keepdim=True)
    strict = p_hat.argmax(dim=-1) == ref.squeeze(-1)
    at_ref = p_hat.gather(-1, ref).squeeze(-1)
    tie = ~strict & (at_ref == p_hat.amax(dim=-1))
    return strict, tie


def _saturated(mx: MX, parts) -> tuple[int, int]:
    """(clamped, total) quantized blocks of ``parts`` ((input, packed) pairs, input as quantized:
    rotated when the scheme rotates): blocks in which some element was clamped to the element maximum."""
    hit = total = 0
    for x, packed in parts:
        sat = saturated_blocks(x, packed.tensors["scales"], mx.fmt, mx.block_size)
        hit += int(sat.sum())
        total += sat.numel()
    return hit, total


def _saturation(mx: MX, parts) -> float:
    """Share of the quantized blocks of ``parts`` in which some element was clamped (`_saturated`)."""
    hit, total = _saturated(mx, parts)
    return hit / total


class _Rows:
    """Per-row statistics of one path written tile by tile into ``[H, Tq]`` tensors allocated once
    (no per-tile survivors between the tiles' large temporaries), and the attention-output error
    accumulated over the tiles (`OutputError`)."""

    def __init__(self, heads: int, queries: int, zeros: bool):
        def empty(dtype=torch.float64):
            return torch.empty(heads, queries, dtype=dtype)
        self.tv, self.strict, self.tie = empty(), empty(torch.bool), empty(torch.bool)
        self.zero, self.row_sum = (empty(), empty()) if zeros else (None, None)
        self.out = OutputError()
        self.hit = self.blocks = 0

    def add(self, sl: slice, p_hat, p_ref, v64, o_ref):
        """One tile: ``p_hat`` against ``p_ref`` (``[H, c, Tk]``), ``o_ref = p_ref @ v64``."""
        self.tv[:, sl] = total_variation(p_hat, p_ref)
        self.strict[:, sl], self.tie[:, sl] = _argmax_agree(p_hat, p_ref)
        if self.zero is not None:
            self.zero[:, sl] = numerical_zero_rate(p_hat, p_ref)
            self.row_sum[:, sl] = p_hat.sum(dim=-1)
        self.out.add(p_hat @ v64, o_ref)

    def stats(self, saturated: float) -> dict:
        return {**_stats(self.tv, (self.strict, self.tie), self.zero, self.row_sum, saturated),
                "rel_l2": self.out.rel_l2}


class _PackedRows:
    """One `Packed` of the whole ``[H, Tq, Tk]`` built from the packed tiles of queries in turn:
    codes and scales copied into place along the query axis (the blocks run along the keys, so a
    tile never splits one) and the header of the whole; a single tile is kept as it is."""

    def __init__(self, shape: tuple, tiles: int):
        self.shape, self.tiles = tuple(shape), tiles
        self.packed: Packed | None = None
        self.at = 0

    def add(self, part: Packed) -> None:
        if self.tiles == 1:
            self.packed = part
            return
        if self.packed is None:
            if set(part.tensors) != {"codes", "scales", "header"}:
                raise ValueError(f"P payload arrays {sorted(part.tensors)} are not codes, scales and header")
            tensors = {name: torch.empty((*part.tensors[name].shape[:-2], self.shape[-2], part.tensors[name].shape[-1]),
                                         dtype=part.tensors[name].dtype, device=part.tensors[name].device)
                       for name in ("codes", "scales")}
            tensors["header"] = make_header(self.shape[-2], self.shape[-1], part.tensors["header"].device)
            self.packed = Packed(part.scheme, self.shape, part.dtype, tensors, part.config)
        rows = part.tensors["codes"].shape[-2]
        for name in ("codes", "scales"):
            self.packed.tensors[name][..., self.at:self.at + rows, :] = part.tensors[name]
        self.at += rows


def evaluate(case, params, ctx) -> list[dict]:
    element, block = params["element"], params["block_size"]
    tq, tk = case.q.shape[1], case.keys
    tiles = query_tiles(case.heads, tq, tk, params["max_scores"])

    def reference():
        """The float64 reference probabilities, one tile of queries at a time."""
        return probability_tiles(case.q, case.k, case.query_positions, case.causal, tiles)

    v64 = expand_kv(case.v, case.heads).to(torch.float64)
    prefix = f"{ctx.study}/{case.id}"
    float32_qk = 4 * (case.q.numel() + case.k.numel())
    rows = []
    base = {"study": ctx.study, "analysis": "mx_paths", **case_fields(case), "element": element, "block_size": block}

    quantizers = {(rot, rule): MX(element, block, None if rot == "none" else rot, params["rotation_seed"], rule)
                  for rule in params["scale_rules"] for rot in params["rotations"]}
    p_quantizers = {rule: MX(element, block, scale_rule=rule) for rule in params["scale_rules"]} if params["p_path"] else {}
    # One pass over the tiles of queries per Q/K path (one decoded K expanded to every head held at a
    # time, beside the reference's). The P path rides on the last Q/K pass when it keeps no payload;
    # with its payload stored, each scale rule has a pass of its own after them, so that one whole
    # payload is held at a time, as the memory guard counts. Each tile's reference probabilities and
    # output are computed once per pass and read by the paths of that pass (the same operations on
    # the same tiles as a pass per path, so the same values; rows and arrays in the same order).
    qk_keys = list(quantizers)
    if params["store_p"]:
        passes = [(key, []) for key in qk_keys] + [(None, [rule]) for rule in p_quantizers]
    else:
        passes = [(key, []) for key in qk_keys[:-1]] + [(qk_keys[-1] if qk_keys else None, list(p_quantizers))]
    for key, p_rules in passes:
        if key is None and not p_rules:
            continue
        if key is not None:
            (rot, rule), mx = key, quantizers[key]
            pq = mx.quantize(case.q, name=f"{case.id}.q")
            pk = mx.quantize(case.k, name=f"{case.id}.k")
            tiles_hat = probability_tiles(mx.decode_rotated(pq), mx.decode_rotated(pk), case.query_positions,
                                          case.causal, tiles)
            acc = _Rows(case.heads, tq, zeros=False)
        pp_acc = {prule: _Rows(case.heads, tq, zeros=True) for prule in p_rules}
        whole = {prule: _PackedRows((case.heads, tq, tk), len(tiles)) if params["store_p"] else None for prule in p_rules}
        nbytes = dict.fromkeys(p_rules, 0)  # of the whole payload: every tile's codes and scales, one header
        for sl, p_ref in reference():
            o_ref = p_ref @ v64
            if key is not None:
                _, p_hat = next(tiles_hat)
                acc.add(sl, p_hat, p_ref, v64, o_ref)
                del p_hat
            for prule in p_rules:
                mxp = p_quantizers[prule]
                p32 = p_ref.to(torch.float32)
                pp = mxp.quantize(p32, name=f"{case.id}.p")
                hit, blocks = _saturated(mxp, [(p32, pp)])
                pacc = pp_acc[prule]
                pacc.hit, pacc.blocks = pacc.hit + hit, pacc.blocks + blocks
                pacc.add(sl, mxp.dequantize(pp).to(torch.float64), p_ref, v64, o_ref)
                header = pp.tensors["header"]
                nbytes[prule] += pp.nbytes - (header.numel() * header.element_size() if nbytes[prule] else 0)
                if whole[prule] is not None:
                    whole[prule].add(pp)
                del pp, p32
            del p_ref, o_ref
        if key is not None:
            del tiles_hat
            tag = f"qk_{rot}" + ("" if rule == "floor" else f"_{rule}")
            arrays = {"q": ctx.store.save_packed(f"{prefix}/{tag}/q", pq),
                      "k": ctx.store.save_packed(f"{prefix}/{tag}/k", pk)}
            rotation = mx.rotation_for(case.q.shape[-1])
            if rotation is not None:
                arrays["signs"] = ctx.store.save(f"{prefix}/{tag}/signs", rotation.signs)
            sat = _saturation(mx, [(mx.rotated(case.q), pq), (mx.rotated(case.k), pk)])
            rows.append({**base, "scheme": mx.name, "rotation": rot, "scale_rule": rule, "path": "qk",
                         **acc.stats(sat),
                         "payload_bytes": pq.nbytes + pk.nbytes, "float32_bytes": float32_qk,
                         "quant": mx.config(), "arrays": arrays})
            del pq, pk
        for prule in p_rules:
            mxp, pacc, w = p_quantizers[prule], pp_acc[prule], whole.pop(prule)
            tag = "p" + ("" if prule == "floor" else f"_{prule}")
            arrays = {"p": ctx.store.save_packed(f"{prefix}/{tag}/p", w.packed)} if w is not None else {}
            rows.append({**base, "scheme": mxp.name, "rotation": "none", "scale_rule": prule, "path": "p",
                         **pacc.stats(pacc.hit / pacc.blocks),
                         "payload_bytes": w.packed.nbytes if w is not None else nbytes[prule],
                         "float32_bytes": 4 * case.heads * tq * tk, "quant": mxp.config(), "arrays": arrays})
            del w

    # ctx.timed calls each lambda at once, so the loop variables it reads are the current ones (B023).
    # quantize_p / decode_p time the first tile of queries' probabilities: the whole P when the Case
    # fits one tile (every default protocol's), else one tile's worth of P, as the analysis quantizes it.
    p32_first = next(reference())[1].to(torch.float32) if p_quantizers and ctx.timing_repeats else None
    for repeat in range(ctx.timing_repeats):
        for (rot, rule), mx in ctx.shuffled(list(quantizers.items())):
            tag = f"qk_{rot}" + ("" if rule == "floor" else f"_{rule}")
            packed = ctx.timed(case.id, tag, "quantize_k", repeat, lambda: mx.quantize(case.k))  # noqa: B023
            ctx.timed(case.id, tag, "decode_k", repeat, lambda: mx.decode_rotated(packed))  # noqa: B023
        for rule, mxp in p_quantizers.items():
            tag = "p" + ("" if rule == "floor" else f"_{rule}")
            packed = ctx.timed(case.id, tag, "quantize_p", repeat, lambda: mxp.quantize(p32_first))  # noqa: B023
            ctx.timed(case.id, tag, "decode_p", repeat, lambda: mxp.dequantize(packed))  # noqa: B023
    return rows


def _pct(x, digits=2) -> str:
    return "-" if x is None or x != x else f"{100 * x:.{digits}f}%"


def _pooled(sel: list[dict], key: str) -> np.ndarray | None:
    parts = [r["per_row"][key] for r in sel if r["per_row"].get(key) is not None]
    return np.asarray([x for part in parts for x in part], dtype=np.float64) if parts else None


def _arm(r: dict) -> tuple:
    return r["path"], r["rotation"], r.get("scale_rule", "floor"), r["scheme"]


def report(rows, params) -> str:
    out = []
    arms = list(dict.fromkeys(_arm(r) for r in rows))
    table = []
    for arm in arms:
        path, rot, rule, scheme = arm
        sel = [r for r in rows if _arm(r) == arm]
        tv = _pooled(sel, "tv")
        n_rows = sum(r["rows"] for r in sel)
        agree = sum(r["argmax_agreement"] * r["rows"] for r in sel) / n_rows
        tie = sum(r["argmax_tie"] * r["rows"] for r in sel) / n_rows
        z = _pooled(sel, "numerical_zero_rate")
        s = _pooled(sel, "row_sum")
        table.append([path, rot, rule, scheme, len(sel), n_rows, _pct(float(np.median(tv))), _pct(float(np.mean(tv))),
                      _pct(float(np.percentile(tv, 95))), _pct(float(np.mean(tv > TV_HIGH))), _pct(agree), _pct(tie),
                      "-" if z is None else _pct(float(np.median(z))), "-" if z is None else _pct(float(np.mean(z))),
                      "-" if z is None else _pct(float(np.mean(z > 0))),
                      "-" if s is None else f"{float(np.median(s)):.6f}",
                      _pct(float(np.mean([r["block_saturation"] for r in sel]))),
                      _pct(float(np.mean([r["rel_l2"] for r in sel])), 3)])
    out.append("Pooled over every (query head, query) row of every input: TV of each softmax row against the "
               "float64 reference, argmax agreement (strict: the first maximal key is the reference's; tie: it "
               "is not, but the reference's argmax is among the decoded row's tied maxima), and for the P path "
               "the numerical-zero rate (reference p > 0, decoded 0) and the row sum of the decoded P; blocks "
               "clamped is the mean over inputs of the share of quantized blocks in which an element exceeded "
               "the element maximum and was clamped; output relative L2 is the mean over inputs.\n")
    out.append(tabulate(table, headers=["path", "rotation", "scale rule", "scheme", "inputs", "rows", "median TV",
                                        "mean TV", "p95 TV", "rows TV>5%", "argmax agree", "argmax tie",
                                        "zero-rate median", "zero-rate mean", "rows with a zero", "row-sum median",
                                        "blocks clamped", "mean rel-L2"],
                        tablefmt="github"))
    dists = list(dict.fromkeys(r.get("distribution", "-") for r in rows))
    dtab = []
    for d in dists:
        line = [d]
        for arm in arms:
            sel = [r for r in rows if r.get("distribution", "-") == d and _arm(r) == arm]
            tv = _pooled(sel, "tv")
            line.append(_pct(float(np.median(tv))) if tv is not None else "-")
        dtab.append(line)
    rules = {a[2] for a in arms}
    out.append("\nMedian TV per distribution.\n")
    out.append(tabulate(dtab, headers=["distribution"] + [f"{p} {r}" + (f" {rule}" if len(rules) > 1 else "")
                                                          for p, r, rule, _ in arms], tablefmt="github"))
    s = SEED_STUDY
    out.append(f"\nSeed study for comparison (a real video DiT, one prompt and seed, so not the same inputs): "
               f"Q/K median TV {_pct(s['qk_tv_median'])}, argmax agreement {_pct(s['qk_argmax'])} (signed-H128); "
               f"P path median TV {_pct(s['p_tv_median'])}, numerical-zero rate median {_pct(s['p_zero_median'])} "
               f"and mean {_pct(s['p_zero_mean'])}, {_pct(s['p_rows_with_zero'])} rows with a zero, row-sum median "
               f"{s['p_row_sum_median']}. Synthetic Gaussian attention is far more diffuse than a trained model's, "
               "so the absolute figures are not expected to match; the comparison is of the measurement, not the model.")
    return "\n".join(out)
