"""Audit of ablation rows: rebuild each ablation from the layout, re-encode the quantized arm's
history from the case's K/V and require its stored payload byte for byte, decode it, and recompute
the masked renormalized softmax directly (key by key, one head at a time, over tiles of its queries:
`common.row_tiles`, never the head's whole [Tq, Tk]) in float64. The per-head sums accumulate tile by
tile; one arm's decoded K/V are held at a time (an arm's rows come together), and the float32 arm's
outputs once per case, as the quantized arms' reference.

Independent of ``testbed.ablation``: the dropped spans are derived here from the layout and the
ablation's name (the same-size control is redrawn with stdlib ``random``), the kept set is applied
as a mask on the scores (no atoms, no merging), and every reported number is recomputed.

Mass-matched controls (``mass_control_<region>``) store no key sets: the audit re-selects every
row's keys itself from the documented rule (`mass_orders`, `select_mass`: the seeded orders
redrawn with stdlib ``random.random()`` and sorted with numpy, the first-fit attempts run one
after another per head, with its own exact pruning of attempts that can no longer reach the band),
from the float64 softmax of the case's own K; requires every matched row within 1 % of its tau;
and recomputes every number of the row on the arm's K/V with a per-row mask.
"""

from __future__ import annotations

import random

import numpy as np

from .common import row_tiles
from .residual_window import check_reencoded
from .report_format import P, T, fixed, holm_cells, label, ordered, pct, pvalue, spread, text
from .schemes import decode_residual_window, encode_residual_window
from .stats import median, per_unit, wilcoxon_p

REGION_FIELDS = ("sink", "middle", "recent", "current", "history")
MASS_TOLERANCE = 0.01  # the documented band: |achieved - tau| <= 1 % of tau
MASS_ATTEMPTS = 16     # the documented number of seeded orders a row tries
MASS_PREFIX = "mass_control_"


def case_keys(case) -> int:
    """The case's key count (from its full shapes: a partly archived case keeps some K or none)."""
    return int(case["shapes"]["k"][1]) if "shapes" in case else int(case["k"].shape[1])


def _regions(case) -> dict:
    return {r["name"]: (int(r["start"]), int(r["stop"])) for r in case["layout"]}


def _history(case):
    cur = _regions(case).get("current")
    return None if cur is None else (0, cur[0])


def _control(case, case_id, target, seed):
    """(spans, kind) of the same-size control of ``target``, or None: a block of the middle region
    where one fits, else a block of the history outside the target, else that many single keys
    drawn from it, never a key of the target; None when fewer keys lie outside it."""
    regions = _regions(case)
    keys = case_keys(case)
    if target not in regions or regions[target][1] == regions[target][0]:
        return None
    r0, r1 = regions[target]
    size = r1 - r0
    h0, h1 = _history(case) or (0, keys)
    tpf = case.get("tokens_per_frame")
    step = tpf if tpf and size % tpf == 0 else 1
    rng = random.Random(f"control:{seed}:{case_id}:{target}")
    mid = regions.get("middle")
    if mid is not None and mid[1] - mid[0] >= size and target != "middle":
        cands = [a for a in range(mid[0], mid[1] - size + 1) if a % step == 0]
        if cands:
            a = cands[rng.randrange(len(cands))]
            return [(a, a + size)], "middle"
    outside = [t for t in range(h0, h1) if not r0 <= t < r1]
    cands = [a for a in range(h0, h1 - size + 1) if a % step == 0 and (a + size <= r0 or a >= r1)]
    if cands:
        a = cands[rng.randrange(len(cands))]
        return [(a, a + size)], "contiguous"
    if len(outside) < size:
        return None
    picked = sorted(rng.sample(outside, size))
    spans = []
    for t in picked:
        if spans and spans[-1][1] == t:
            spans[-1][1] = t + 1
        else:
            spans.append([t, t + 1])
    return [tuple(x) for x in spans], "scattered"


def expected_spans(case, case_id, name, seed):
    """The dropped spans of ablation ``name`` for this case, or None when not applicable."""
    regions = _regions(case)
    keys = case_keys(case)
    if name == "none":
        return []
    if name == "drop_history":
        hist = _history(case)
        return None if hist is None or hist[1] == 0 else [hist]
    if name == "keep_current_only":
        cur = regions.get("current")
        if cur is None:
            return None
        spans = [s for s in ((0, cur[0]), (cur[1], keys)) if s[1] > s[0]]
        return spans or None
    if name.startswith(MASS_PREFIX):
        raise ValueError(f"{name!r} drops a different key set per row (see mass_orders)")
    if name.startswith("control_"):
        blk = _control(case, case_id, name[len("control_"):], seed)
        return None if blk is None else blk[0]
    if name.startswith("drop_"):
        r = regions.get(name[len("drop_"):])
        return None if r is None or r[1] == r[0] else [r]
    raise ValueError(f"unknown ablation {name!r}")


def mass_orders(case, case_id, target, seed):
    """The ``MASS_ATTEMPTS`` seeded orders of the keys a mass-matched control of ``target`` may
    drop (the history outside the target), or None when the target is missing or empty or no key
    lies outside it. Order ``a``: each eligible key, ascending, draws ``random()`` from
    ``random.Random(f"mass_control:{seed}:{case_id}:{target}:{a}")``; keys by increasing draw."""
    regions = _regions(case)
    keys = case_keys(case)
    if target not in regions or regions[target][1] == regions[target][0]:
        return None
    r0, r1 = regions[target]
    h0, h1 = _history(case) or (0, keys)
    eligible = np.asarray([t for t in range(h0, h1) if not r0 <= t < r1], dtype=np.int64)
    if eligible.size == 0:
        return None
    out = []
    for a in range(MASS_ATTEMPTS):
        rng = random.Random(f"mass_control:{seed}:{case_id}:{target}:{a}")
        draws = np.asarray([rng.random() for _ in range(eligible.size)])
        out.append(eligible[np.argsort(draws, kind="stable")])
    return out


def select_mass(p, vis, target, orders):
    """One head's mass-matched selection: ``p [Tq, Tk]`` reference probabilities, ``vis [Tq, Tk]``,
    ``target (start, stop)``. Per row ``tau = sum P[target]``, band ``[(1 - 0.01) tau, (1 + 0.01) tau]``;
    attempt after attempt (until the row is matched), a first-fit pass over the order: a visible
    key is taken iff the running sum stays <= the band's top, and the pass stops once the sum
    reaches its bottom. Rows with tau <= 0 (or NaN) are unmatched. Returns (chosen [Tq, Tk] bool,
    tau, achieved (0 where unmatched), matched)."""
    tq, tk = p.shape
    tau = p[:, target[0]:target[1]].sum(axis=1)
    lo, hi = tau * (1.0 - MASS_TOLERANCE), tau * (1.0 + MASS_TOLERANCE)
    floor = lo * (1.0 - 1e-9)
    chosen = np.zeros((tq, tk), dtype=bool)
    achieved = np.zeros(tq)
    matched = np.zeros(tq, dtype=bool)
    with np.errstate(invalid="ignore"):
        live0 = tau > 0
    for order in orders:
        pending = live0 & ~matched
        if not pending.any():
            break
        # position-major [E, Tq]: the pass reads one contiguous vector of rows per position
        vis_o = np.ascontiguousarray(vis[:, order].T)
        pv = np.where(vis_o, p[:, order].T, 0.0)                 # the order's visible masses
        after = np.cumsum(pv[::-1], axis=0)[::-1]                # mass at this position and after it
        acc = np.zeros(tq)
        taken = np.zeros((len(order), tq), dtype=bool)
        active = pending.copy()
        for i in range(len(order)):
            if not active.any():
                break
            # exact pruning: an attempt that cannot reach the band's bottom any more has failed
            active &= acc + after[i] >= floor
            step = acc + pv[i]                                   # p itself wherever the key is visible
            take = active & vis_o[i] & (step <= hi)
            acc[take] = step[take]
            taken[i] = take
            active &= ~(take & (acc >= lo))
        del pv, after, vis_o
        reached = pending & (acc >= lo)
        rows = np.flatnonzero(reached)
        if rows.size:
            picked = np.zeros((rows.size, tk), dtype=bool)
            picked[:, order] = taken[:, rows].T
            chosen[rows] = picked
        achieved[reached] = acc[reached]
        matched |= reached
    return chosen, tau, achieved, matched


def _select_case(case, target, orders):
    """The mass-matched selection of every head, from the float64 softmax of the case's own K."""
    q, k = case["q"], case["k"]
    h, tq, d = q.shape
    group = h // k.shape[0]
    tk = k.shape[1]
    qp, causal = case["query_positions"], bool(case["causal"])
    # the selected keys as one bit per key (np.packbits along the keys): [H, Tq, Tk] booleans would be
    # 467 MB per control at the seed's scale (protocols/seed_scale.json), the bits an eighth of that
    out = {"chosen": np.zeros((h, tq, -(-tk // 8)), dtype=np.uint8), "tau": np.zeros((h, tq)),
           "achieved": np.zeros((h, tq)), "matched": np.zeros((h, tq), dtype=bool), "keys": np.zeros((h, tq), np.int64),
           "in_target": False}
    tiles = row_tiles(tq, tk)
    for hh in range(h):
        kk = k[hh // group].astype(np.float64)
        for sl in tiles:                     # a tile of the head's queries: never [Tq, Tk]
            vis = _visible(qp[sl], tk, causal)
            p = _softmax(np.where(vis, q[hh, sl].astype(np.float64) @ kk.T / np.sqrt(np.float64(d)), -np.inf))
            c, t, a, m = select_mass(p, vis, target, orders)
            del p
            out["chosen"][hh, sl], out["tau"][hh, sl], out["achieved"][hh, sl], out["matched"][hh, sl] = \
                np.packbits(c, axis=-1), t, a, m
            out["keys"][hh, sl] = c.sum(axis=-1)
            out["in_target"] = out["in_target"] or bool(c[:, target[0]:target[1]].any())
    return out


def chosen_keys(sel: dict, hh: int, keys: int, rows: slice = slice(None)) -> np.ndarray:
    """The selected keys ``[Tq, Tk]`` (bool) of head ``hh`` (of its queries ``rows``) from their bits
    (`_select_case`)."""
    return np.unpackbits(sel["chosen"][hh, rows], axis=-1, count=keys).astype(bool)


def _visible(qp, keys: int, causal: bool) -> np.ndarray:
    """``[c, Tk]`` visibility of the queries at positions ``qp`` (all True when not causal)."""
    return (np.arange(keys)[None, :] <= qp[:, None]) if causal else np.ones((len(qp), keys), dtype=bool)


def _softmax(s):
    """Row softmax of masked scores ``s`` (-inf where not visible), float64."""
    e = np.exp(s - s.max(axis=1, keepdims=True))
    e /= e.sum(axis=1, keepdims=True)
    return e


def _masked_exp(s, allowed):
    """``exp(s - the row's max over allowed)`` where ``allowed``, exactly 0 elsewhere (``[c, Tk]``
    float64, in one buffer), and the rows with an allowed key. ``s`` is -inf wherever a key is not
    visible and ``allowed`` lies within the visible keys, so every allowed score is finite."""
    ok = allowed.any(axis=1)
    e = np.where(allowed, s, -np.inf)
    e -= np.where(ok, e.max(axis=1, initial=-np.inf), 0.0)[:, None]
    np.exp(e, out=e)                                   # exp(-inf) = 0: the keys outside ``allowed``
    return e, ok


def _masked(s, allowed, vv):
    """Softmax of ``s`` over ``allowed`` per row, its output, and where it is defined."""
    pa, ok = _masked_exp(s, allowed)
    pa /= np.where(ok, pa.sum(axis=1), 1.0)[:, None]
    return pa, pa @ vv, ok


def _cols(keys: np.ndarray):
    """An index of the key columns ``keys`` (sorted int): a slice when they are one run (a view of
    the scores, no copy), else the indices."""
    if keys.size and keys[-1] - keys[0] + 1 == keys.size:
        return slice(int(keys[0]), int(keys[-1]) + 1)
    return keys


def _masked_on(s, allowed, vv, keys: np.ndarray):
    """`_masked` over the key columns ``keys`` only, every other key being outside ``allowed``
    (it weighs exactly 0 there): ``(pa [c, len(keys)], output, ok)``."""
    c = _cols(keys)
    return _masked(s[:, c], allowed[:, c], vv[c])


def _tv(p, pa):
    """Per row ``0.5 * sum |p - pa|``."""
    d = p - pa
    np.abs(d, out=d)
    return 0.5 * d.sum(axis=1)


def _add_output_sums(r, hh, oa, o_ref, o_full, rows):
    """Add one tile's output sums of head ``hh`` over the ``rows`` it defines: the arm's output
    ``oa`` against the reference ``o_ref`` (err2, ref2, dot, out2) and against its own full
    attention ``o_full`` (own_err2, own_ref2)."""
    r["err2"][hh] += ((oa - o_ref)[rows] ** 2).sum()
    r["ref2"][hh] += (o_ref[rows] ** 2).sum()
    r["dot"][hh] += (oa[rows] * o_ref[rows]).sum()
    r["out2"][hh] += (oa[rows] ** 2).sum()
    r["own_err2"][hh] += ((oa - o_full)[rows] ** 2).sum()
    r["own_ref2"][hh] += (o_full[rows] ** 2).sum()


def _derive_mass(case, k, v, sel, target, ref):
    """Per-row-mask ablation of the selected keys (and of the target, on the same rows) on this arm,
    over tiles of each head's queries; the per-head sums accumulate tile by tile."""
    q = case["q"]
    h, tq, d = q.shape
    tk = k.shape[1]
    group = h // k.shape[0]
    qp, causal = case["query_positions"], bool(case["causal"])
    tmask = np.zeros(tk, dtype=bool)
    tmask[target[0]:target[1]] = True
    outside = np.flatnonzero(~tmask)         # the keys the target's own ablation keeps
    r = {key: np.full((h, tq), np.nan) for key in ("tau", "tv", "shift")}
    r.update({key: np.zeros(h) for key in ("err2", "ref2", "dot", "out2", "own_err2", "own_ref2", "t_err2", "t_ref2")})
    r["undefined"] = np.zeros(h, np.int64)
    tiles = row_tiles(tq, tk)
    for hh in range(h):
        kk = k[hh // group].astype(np.float64)
        vv = v[hh // group].astype(np.float64)
        for sl in tiles:                     # a tile of the head's queries: never [Tq, Tk]
            vis = _visible(qp[sl], tk, causal)
            s = np.where(vis, q[hh, sl].astype(np.float64) @ kk.T / np.sqrt(np.float64(d)), -np.inf)
            p = _softmax(s)
            o_full = p @ vv
            o_ref = o_full if ref is None else ref[hh, sl]
            drop = chosen_keys(sel, hh, tk, sl)
            m = sel["matched"][hh, sl]
            pa, oa, ok = _masked(s, vis & ~drop, vv)
            use = m & ok
            r["undefined"][hh] += int((m & ~ok).sum())
            r["tau"][hh, sl] = np.where(use, np.where(drop, p, 0.0).sum(axis=1), np.nan)
            r["tv"][hh, sl] = np.where(use, _tv(p, pa), np.nan)
            del p, pa
            _add_output_sums(r, hh, oa, o_ref, o_full, use)
            dropped = vis & drop
            has = dropped.any(axis=1)
            _, mu_d, _ = _masked_on(s, dropped, vv, np.flatnonzero(dropped.any(axis=0)))  # the dropped keys' own softmax
            del dropped, drop
            norm_o = np.linalg.norm(o_full, axis=1)
            good = use & has & (norm_o > 0)
            r["shift"][hh, sl] = np.where(good, np.linalg.norm(oa - mu_d, axis=1) / np.where(good, norm_o, 1.0), np.nan)
            _, ot, ok_t = _masked_on(s, vis, vv, outside)               # the target itself, on the same rows
            both = use & ok_t
            r["t_err2"][hh] += ((ot - o_ref)[both] ** 2).sum()
            r["t_ref2"][hh] += (o_ref[both] ** 2).sum()
    return r


def _check_mass(row, ctx, case, k, v, ref, orders, seed):
    """The audit's own selection of a mass-matched control: its band and its keys, then every number
    of the row from the per-head sums of its re-derived ablation (`_check_numbers`)."""
    name = row["ablation"]
    target = _regions(case)[name[len(MASS_PREFIX):]]
    sel = ctx.cached(("ablation-mass-select", row["study"], row["case"], name, seed),
                     lambda: _select_case(case, target, orders))
    m = sel["matched"]
    mism = np.abs(sel["achieved"][m] - sel["tau"][m]) / sel["tau"][m]
    # the band, row by row, on the audit's own selection (and the keys never touch the target)
    if m.any() and not bool(np.all(mism <= MASS_TOLERANCE * (1 + 1e-12))):
        ctx.fail(row, f"audit's own selection: {int((mism > MASS_TOLERANCE).sum())} matched rows outside the 1 % band")
    if sel["in_target"]:
        ctx.fail(row, "audit's own selection: a selected key lies in the target")
    reported_max = row.get("mass_mismatch_max")
    if isinstance(reported_max, (int, float)) and not isinstance(reported_max, bool) \
            and reported_max > MASS_TOLERANCE * (1 + 1e-9):
        ctx.fail(row, f"mass_mismatch_max: reported {reported_max!r}, outside the documented 1 % band")
    d = ctx.cached(("ablation-mass", row["study"], row["case"], row["arm"], name, seed),
                   lambda: _derive_mass(case, k, v, sel, target, ref))
    tau, hd = _head_sums(d, sel)
    _check_numbers(row, ctx, case, None, seed, tau, hd)


def _kv(row, ctx, case):
    """The arm's K and V (history decoded from the packed arrays, current chunk exact), checking
    this row's byte counts and array references."""
    k, v = case.get("k"), case.get("v")
    keys = case_keys(case)
    hist = _history(case)
    stop = hist[1] if hist is not None else keys
    if row["arm"] == "float32":
        stats = "archive" in case
        want = ({"stats"} if row["ablation"] == "none" else {"stats_in"}) if stats else set()
        if row.get("quant") is not None or set(row["arrays"]) != want:
            raise ValueError("the float32 arm has no quantizer and no packed arrays" + (
                "; its 'none' row names its statistics (arrays.stats), the others point to it (stats_in)" if stats else ""))
        if stats and row["ablation"] != "none" and row["arrays"]["stats_in"] != "none":
            raise ValueError("arrays.stats_in must be 'none' (the row naming the arm's statistics)")
        full = int(np.prod(case["shapes"]["k"]))
        ctx.equal(row, "baseline_bytes", row["baseline_bytes"], 2 * full * 4)
        ctx.equal(row, "payload_bytes", row["payload_bytes"], 2 * full * 4)
        return (None, None) if stats else (k, v)
    if "archive" in case:
        raise ValueError("a case that keeps only part of its K/V has only the float32 arm (a payload is re-encoded from K/V)")
    ctx.equal(row, "quantized_tokens", row["quantized_tokens"], stop)
    owner = row
    if row["ablation"] == "none":
        if "packed" not in row["arrays"] or not isinstance(row.get("quant"), dict):
            raise ValueError("the 'none' row of a quantized arm must name its packed arrays and quantizer config")
    else:
        if row["arrays"] != {"packed_in": "none"} or "quant" in row:
            raise ValueError("a quantized row other than 'none' must point to the 'none' row (packed_in: none)")
        owners = [r for r in _siblings(ctx, row) if r.get("ablation") == "none"]
        if len(owners) != 1:
            raise ValueError(f"expected one 'none' row of arm {row['arm']} naming the packed arrays, found {len(owners)}")
        owner = owners[0]
    arrays = {name: ctx.load(path) for name, path in owner["arrays"]["packed"].items()}
    if owner is row:  # the payload is the 'none' row's: re-encoded once, from the case's history
        check_reencoded(row, ctx, arrays, encode_residual_window(k[:, :stop], v[:, :stop], row["quant"]),
                        f"the case's K/V history [0, {stop})")
    ctx.equal(row, "payload_bytes", row["payload_bytes"], int(sum(a.nbytes for a in arrays.values())))
    ctx.equal(row, "baseline_bytes", row["baseline_bytes"], 2 * k.shape[0] * stop * k.shape[2] * 4)

    def build():
        kh, vh = decode_residual_window(arrays, owner["quant"], (k.shape[0], stop, k.shape[2]))
        return np.concatenate([kh, k[:, stop:]], axis=1), np.concatenate([vh, v[:, stop:]], axis=1)

    return _arm_cached(ctx, ("ablation-kv", row["study"], row["case"], row["arm"]), build)


def _arm_cached(ctx, key, fn):
    """``ctx.cached`` for one arm's value (``key = (kind, study, case, arm)``), holding one arm's at a
    time: the results list an arm's rows together, so the previous arm's decoded K/V are dropped when
    the next arm's are built (a row of an arm met again later re-derives them, with the same numbers)."""
    for other in [c for c in ctx.cache if isinstance(c, tuple) and len(c) == 4 and c[:3] == key[:3] and c != key]:
        del ctx.cache[other]
    return ctx.cached(key, fn)


def _derive(case, k, v, spans: dict, ref, want_out: bool = False):
    """Per ablation: per-row tau and TV [H, Tq] (NaN where undefined), per-head sums (accumulated
    over tiles of each head's queries, never holding [Tq, Tk]); the region masses [H, Tq]; and,
    with ``want_out``, the outputs [H, Tq, D] (the reference of the quantized arms), else None."""
    q = case["q"]
    h, tq, d = q.shape
    keys = k.shape[1]
    group = h // k.shape[0]
    qp, causal = case["query_positions"], bool(case["causal"])
    regions = dict(_regions(case))
    if _history(case) is not None:
        regions["history"] = _history(case)
    out = {name: {"tau": np.full((h, tq), np.nan), "tv": np.full((h, tq), np.nan), "undefined": np.zeros(h, np.int64),
                  "err2": np.zeros(h), "ref2": np.zeros(h), "dot": np.zeros(h), "out2": np.zeros(h),
                  "own_err2": np.zeros(h), "own_ref2": np.zeros(h), "shift": np.full((h, tq), np.nan)} for name in spans}
    keeps = {}
    for name, sp in spans.items():
        keep = np.ones(keys, dtype=bool)
        for a, b in sp:
            keep[a:b] = False
        keeps[name] = keep
    kept = {name: np.flatnonzero(keep) for name, keep in keeps.items()}
    dropped_keys = {name: np.flatnonzero(~keep) for name, keep in keeps.items()}
    masses = {name: np.zeros((h, tq)) for name in regions}
    full_out = np.zeros((h, tq, d)) if want_out else None
    tiles = row_tiles(tq, keys)
    for hh in range(h):
        kk = k[hh // group].astype(np.float64)
        vv = v[hh // group].astype(np.float64)
        for sl in tiles:                     # a tile of the head's queries: never [Tq, Tk]
            vis = _visible(qp[sl], keys, causal)
            s = np.where(vis, q[hh, sl].astype(np.float64) @ kk.T / np.sqrt(np.float64(d)), -np.inf)
            p = _softmax(s)
            o_full = p @ vv
            if full_out is not None:
                full_out[hh, sl] = o_full
            o_ref = o_full if ref is None else ref[hh, sl]
            for name, (a, b) in regions.items():
                masses[name][hh, sl] = p[:, a:b].sum(axis=1)
            norm_o = np.linalg.norm(o_full, axis=1)
            for name, keep in keeps.items():
                r = out[name]
                tau = p[:, ~keep].sum(axis=1)
                if keep.all():               # "none": the kept softmax is the full one, no key dropped
                    ok = vis.any(axis=1)
                    pa, oa = p, o_full
                    tv = _tv(p, pa)
                else:                        # over the kept keys only: pa is 0 on the dropped ones, so
                    pa, oa, ok = _masked_on(s, vis, vv, kept[name])   # TV = (tau + sum over the kept keys of |p - pa|) / 2
                    tv = 0.5 * (tau + np.abs(p[:, _cols(kept[name])] - pa).sum(axis=1))
                r["tau"][hh, sl] = np.where(ok, tau, np.nan)
                r["tv"][hh, sl] = np.where(ok, tv, np.nan)
                del pa
                r["undefined"][hh] += int((~ok).sum())
                _add_output_sums(r, hh, oa, o_ref, o_full, ok)
                if keep.all():
                    continue                 # no dropped key: no row has a shift (NaN, as initialized)
                # ||mu_kept - mu_dropped|| / ||O|| from the two P-weighted means themselves
                dc = _cols(dropped_keys[name])
                ed, has = _masked_exp(s[:, dc], vis[:, dc])                # the dropped keys' own softmax:
                mu_d = (ed @ vv[dc]) / np.where(has, ed.sum(axis=1), 1.0)[:, None]  # stable however small their mass
                del ed
                mu_k = oa
                good = ok & has & (norm_o > 0)
                r["shift"][hh, sl] = np.where(good, np.linalg.norm(mu_k - mu_d, axis=1) / np.where(good, norm_o, 1.0),
                                              np.nan)
    return out, masses, full_out


def _finite_mean(x):
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else None


def _finite_median(x):
    x = x[np.isfinite(x)]
    return float(np.median(x)) if x.size else None


def _ratio(num, den):
    return None if den == 0 else float(np.sqrt(num / den))


def _siblings(ctx, row):
    return [r for r in ctx.results["rows"] if isinstance(r, dict) and r.get("analysis") == "ablation"
            and r.get("study") == row["study"] and r.get("case") == row["case"] and r.get("arm") == row["arm"]]


# what the audit keeps while a case's ablation rows are checked: the float32 arm's outputs, the
# mass-matched selections (as bits), one arm's decoded K/V and the per-row results; dropped after
# the case's last ablation row, so that later rows (MX paths, other cases) do not hold them
_CASE_CACHES = ("ablation-ref", "ablation-mass-select", "ablation-mass", "ablation-kv", "ablation-arm")


def check(row: dict, ctx) -> None:
    try:
        _check_row(row, ctx)
    finally:
        # the audit checks a copy of each row carrying its position in results.json (``_index``)
        rows = [i for i, r in enumerate(ctx.results["rows"]) if isinstance(r, dict) and r.get("analysis") == "ablation"
                and r.get("study") == row.get("study") and r.get("case") == row.get("case")]
        if rows and row.get("_index") == rows[-1]:
            for key in [c for c in ctx.cache if isinstance(c, tuple) and len(c) >= 3 and c[0] in _CASE_CACHES
                        and c[1:3] == (row.get("study"), row.get("case"))]:
                del ctx.cache[key]


def _check_row(row: dict, ctx) -> None:
    case = ctx.case(row)
    seed = row.get("control_seed", 0)
    mass = row["ablation"].startswith(MASS_PREFIX)
    if mass:
        orders = mass_orders(case, row["case"], row["ablation"][len(MASS_PREFIX):], seed)
        spans = None
        applicable = orders is not None
    else:
        spans = expected_spans(case, row["case"], row["ablation"], seed)
        applicable = spans is not None
    ctx.numbers += 1
    if row["applicable"] is not applicable:
        ctx.fail(row, f"applicable: reported {row['applicable']!r}, audit derives {applicable!r}")
        return
    h, tq = case["shapes"]["q"][0], case["shapes"]["q"][1]
    ctx.equal(row, "rows", row.get("rows"), h * tq)
    ctx.equal(row, "heads", row.get("heads"), h)
    if row["arm"] == "float32":
        ctx.equal(row, "quantized_tokens", row.get("quantized_tokens"), 0)
    k, v = _kv(row, ctx, case)
    if "archive" in case:
        _check_from_stats(row, ctx, case, spans, applicable, seed)
        return
    ref = None
    ref_key = ("ablation-ref", row["study"], row["case"])
    if row["arm"] != "float32":
        ref = ctx.cached(ref_key, lambda: _derive(case, case["k"], case["v"], {}, None, want_out=True)[2])

    def derive_arm():
        names = {}
        for r in _siblings(ctx, row):
            if str(r.get("ablation")).startswith(MASS_PREFIX):
                continue  # per-row key sets: derived by _check_mass
            sp = expected_spans(case, r["case"], r["ablation"], r.get("control_seed", 0))
            if sp is not None:
                names[r["ablation"]] = sp
        if row["arm"] != "float32":
            return _derive(case, k, v, names, ref)[:2]
        # the float32 arm's outputs are the quantized arms' reference: kept once per case, not per arm
        derived, masses, full_out = _derive(case, k, v, names, None, want_out=True)
        ctx.cache.setdefault(ref_key, full_out)
        return derived, masses

    derived, masses = _arm_cached(ctx, ("ablation-arm", row["study"], row["case"], row["arm"]), derive_arm)
    for name in REGION_FIELDS:
        ctx.close(row, f"{name}_mass", row.get(f"{name}_mass"), float(masses[name].mean()) if name in masses else None)
    if mass and applicable:
        _check_mass(row, ctx, case, k, v, ref, orders, seed)
        return
    if spans is None:
        for key in NOT_APPLICABLE_NULL:
            ctx.equal(row, key, row.get(key), None)
        return
    tau, hd = _head_sums(derived[row["ablation"]])
    _check_numbers(row, ctx, case, spans, seed, tau, hd)


def _head_sums(d: dict, sel: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One ablation's per-row tau ``[H, Tq]`` and its per-head sums ``[H, F]`` in the layout of the
    stored statistics (`STAT_FIELDS`), from the audit's own per-row derivation (``_derive`` or, with
    the selection ``sel``, ``_derive_mass``): the one form every row's numbers are checked from."""
    out = np.zeros((d["tau"].shape[0], len(STAT_FIELDS)))
    if sel is not None:
        m = sel["matched"]
        tm = np.where(m, sel["tau"], 0.0)
        ach = np.where(m, sel["achieved"], 0.0)
        mism = np.where(m, np.abs(ach - tm) / np.where(m, tm, 1.0), 0.0)
        out[:, _F["matched"]] = m.sum(axis=1)
        out[:, _F["target_sum"]] = tm.sum(axis=1)
        out[:, _F["achieved_sum"]] = ach.sum(axis=1)
        out[:, _F["mismatch_sum"]] = mism.sum(axis=1)
        out[:, _F["mismatch_max"]] = mism.max(axis=1)
        out[:, _F["keys_sum"]] = np.where(m, sel["keys"], 0).sum(axis=1)
        out[:, _F["target_err2"]], out[:, _F["target_ref2"]] = d["t_err2"], d["t_ref2"]
    out[:, _F["undefined"]] = d["undefined"]
    for f in ("err2", "ref2", "dot", "out2", "own_err2", "own_ref2"):
        out[:, _F[f]] = d[f]
    for f, x in (("tau", d["tau"]), ("tv", d["tv"]), ("shift", d["shift"])):
        ok = np.isfinite(x)
        out[:, _F[f + "_sum"]] = np.where(ok, x, 0.0).sum(axis=1)
        out[:, _F[f + "_rows"]] = ok.sum(axis=1)
    return d["tau"], out


def _check_numbers(row, ctx, case, spans, seed, tau, hd) -> None:
    """Every number of an applicable ablation row from one ablation's per-row tau and per-head sums
    (`_head_sums`, or the stored statistics of a partly archived case): means as sums over counts,
    rel-L2 and cosine from the summed squares and dots, the median tau from the rows, the spans and
    labels of a region or size-matched ablation (``spans``), the fields of a mass-matched control."""
    def tot(f):
        return float(hd[:, _F[f]].sum())

    def mean(f):
        return tot(f + "_sum") / tot(f + "_rows") if tot(f + "_rows") else None

    ctx.equal(row, "undefined_rows", row.get("undefined_rows"), int(round(tot("undefined"))))
    ctx.close(row, "dropped_mass", row.get("dropped_mass"), mean("tau"))
    ctx.close(row, "dropped_mass_median", row.get("dropped_mass_median"), _finite_median(tau))
    ctx.close(row, "tv", row.get("tv"), mean("tv"))
    rel = _ratio(tot("err2"), tot("ref2"))
    ctx.close(row, "rel_l2", row.get("rel_l2"), rel)
    ctx.close(row, "rel_l2_own", row.get("rel_l2_own"), _ratio(tot("own_err2"), tot("own_ref2")))
    tmean = mean("tau")
    ctx.close(row, "rel_l2_per_mass", row.get("rel_l2_per_mass"), None if rel is None or not tmean else rel / tmean)
    ctx.close(row, "mean_shift", row.get("mean_shift"), mean("shift"))
    den = float(np.sqrt(tot("out2") * tot("ref2")))
    ctx.close(row, "cosine", row.get("cosine"), None if den == 0 else tot("dot") / den)
    heads = [np.nan if x is None else x for x in row["rel_l2_heads"]]
    ctx.close(row, "rel_l2_heads", heads, [np.nan if r == 0 else np.sqrt(e / r)
                                           for e, r in zip(hd[:, _F["err2"]], hd[:, _F["ref2"]])])
    if not row["ablation"].startswith(MASS_PREFIX):
        ctx.equal(row, "dropped_spans", [list(x) for x in row["dropped_spans"]], [list(x) for x in spans])
        ctx.equal(row, "dropped_keys", row["dropped_keys"], sum(b - a for a, b in spans))
        if row["ablation"].startswith("control_"):
            blk = _control(case, row["case"], row["ablation"][len("control_"):], seed)
            ctx.equal(row, "control_of", row["control_of"], row["ablation"][len("control_"):])
            ctx.equal(row, "control_kind", row.get("control_kind"), blk[1])
        return
    target_name = row["ablation"][len(MASS_PREFIX):]
    for key, want in (("control_of", target_name), ("control_kind", "mass_matched"), ("mass_tolerance", MASS_TOLERANCE),
                      ("mass_attempts", MASS_ATTEMPTS), ("dropped_spans", None), ("dropped_keys", None)):
        ctx.equal(row, key, row.get(key), want)
    nm = int(round(tot("matched")))
    ctx.equal(row, "matched_rows", row.get("matched_rows"), nm)
    ctx.equal(row, "unmatched_rows", row.get("unmatched_rows"), int(tau.size) - nm)

    def per(f):
        return tot(f) / nm if nm else None

    ctx.close(row, "dropped_keys_mean", row.get("dropped_keys_mean"), per("keys_sum"))
    ctx.close(row, "target_mass", row.get("target_mass"), per("target_sum"))
    ctx.close(row, "control_mass", row.get("control_mass"), per("achieved_sum"))
    ctx.close(row, "mass_mismatch_mean", row.get("mass_mismatch_mean"), per("mismatch_sum"))
    with_rows = hd[:, _F["matched"]] > 0
    mmax = float(hd[with_rows, _F["mismatch_max"]].max()) if with_rows.any() else None
    ctx.close(row, "mass_mismatch_max", row.get("mass_mismatch_max"), mmax)
    if mmax is not None and mmax > MASS_TOLERANCE * (1 + 1e-9):
        ctx.fail(row, f"statistics: a matched row's mass mismatch {mmax!r} lies outside the documented 1 % band")
    ctx.close(row, "target_rel_l2_matched", row.get("target_rel_l2_matched"), _ratio(tot("target_err2"), tot("target_ref2")))


# ---------------------------------------------------------------------------------------------
# cases that keep only part of their Q/K/V: the rows from the per-row statistics
# ---------------------------------------------------------------------------------------------

# The documented layout of ``heads [A, H, F]`` (docs/audit.md), written again here.
STAT_FIELDS = ("undefined", "err2", "ref2", "dot", "out2", "own_err2", "own_ref2", "tau_sum", "tau_rows", "tv_sum",
               "tv_rows", "shift_sum", "shift_rows", "matched", "target_sum", "achieved_sum", "mismatch_sum",
               "mismatch_max", "keys_sum", "target_err2", "target_ref2")
_F = {f: j for j, f in enumerate(STAT_FIELDS)}
# what a row that is not applicable says about its damage: nothing
NOT_APPLICABLE_NULL = ("dropped_spans", "dropped_keys", "dropped_mass", "tv", "rel_l2", "cosine", "undefined_rows",
                       "rel_l2_per_mass", "mean_shift")


def _applicable_names(ctx, row, case) -> list[str]:
    """The arm's ablations the audit finds applicable, in the order of the arm's rows."""
    out = []
    for r in _siblings(ctx, row):
        name = str(r.get("ablation"))
        seed = r.get("control_seed", 0)
        if name.startswith(MASS_PREFIX):
            ok = mass_orders(case, r["case"], name[len(MASS_PREFIX):], seed) is not None
        else:
            ok = expected_spans(case, r["case"], name, seed) is not None
        if ok:
            out.append(name)
    return out


def _load_stats(ctx, row, case) -> dict:
    """The arm's statistics, named by its 'none' row, with their layout checked."""
    owners = [r for r in _siblings(ctx, row) if r.get("ablation") == "none"]
    if len(owners) != 1:
        raise ValueError(f"expected one 'none' row of arm {row['arm']} naming the statistics, found {len(owners)}")
    owner = owners[0]
    paths = owner["arrays"].get("stats")
    if not isinstance(paths, dict) or set(paths) != {"tau", "heads", "regions"}:
        raise ValueError("arrays.stats of the 'none' row must name the arrays tau, heads and regions")
    names = _applicable_names(ctx, row, case)
    regions = [r for r in REGION_FIELDS if r in _regions(case) or (r == "history" and _history(case) is not None)]
    layout = owner.get("stats_layout")
    if layout != {"ablations": names, "regions": regions}:
        raise ValueError(f"stats_layout {layout!r} is not the applicable ablations {names} and regions {regions}")
    h, tq = case["shapes"]["q"][0], case["shapes"]["q"][1]
    tau, heads, reg = (ctx.load(paths[n]) for n in ("tau", "heads", "regions"))
    want = {"tau": (tau, "<f4", (len(names), h, tq)), "heads": (heads, "<f8", (len(names), h, len(STAT_FIELDS))),
            "regions": (reg, "<f8", (len(regions), h))}
    for n, (x, dt, shape) in want.items():
        if x.dtype.str != dt or x.shape != shape:
            raise ValueError(f"statistics {n}: {x.dtype.str} {list(x.shape)}, the layout gives {dt} {list(shape)}")
    if not (np.isfinite(heads).all() and np.isfinite(reg).all()):
        raise ValueError("statistics heads or regions hold NaN or Inf")
    t = tau[np.isfinite(tau)]
    if np.isinf(tau).any() or (t.size and (t.min() < 0 or t.max() > 1 + 1e-6)):
        raise ValueError("statistics tau: a row's dropped mass outside [0, 1]")
    st = {"names": names, "regions": regions, "tau": tau.astype(np.float64), "heads": heads, "reg": reg,
          "rows": h * tq, "owner": owner}
    _check_identities(ctx, owner, case, st, row.get("control_seed", 0))
    return st


def _kept_undefined(case, spans) -> int:
    """Queries left with no visible key once ``spans`` are dropped (the same for every head)."""
    keys = case_keys(case)
    keep = np.ones(keys, dtype=bool)
    for a, b in spans:
        keep[a:b] = False
    qp = case["query_positions"].astype(np.int64)
    vis = (np.arange(keys)[None, :] <= qp[:, None]) if case["causal"] else np.ones((qp.size, keys), dtype=bool)
    return int((~(vis & keep[None, :]).any(axis=1)).sum())


def _check_identities(ctx, owner, case, st, seed) -> None:
    """What the statistics must satisfy whatever the Q/K/V were: whole counts, the per-head split
    of the per-row tau, ||O' - O||^2 = ||O'||^2 + ||O||^2 - 2 <O', O>, the own errors equal to the
    errors on the float32 arm, undefined rows from the layout alone, a dropped region's tau equal to
    its mass, a mass-matched control's achieved mass equal to its tau and within 1 % of the
    target's, the regions partitioning each row's mass. A forger who keeps every one of them still
    passes (docs/audit.md); one who edits a sum alone does not."""
    h, tq = case["shapes"]["q"][0], case["shapes"]["q"][1]
    regions = dict(_regions(case))
    reg = dict(zip(st["regions"], st["reg"]))
    for a, name in enumerate(st["names"]):
        hd = st["heads"][a]

        def f(key, hd=hd):
            return hd[:, _F[key]]

        where = f"stats.heads[{name}]"
        for key in ("undefined", "tau_rows", "tv_rows", "shift_rows", "matched"):
            x = f(key)
            if not (np.all(x == np.round(x)) and np.all(x >= 0) and np.all(x <= tq)):
                ctx.fail(owner, f"{where}.{key}: not a count of rows in [0, {tq}]")
        for key in ("err2", "ref2", "out2", "own_err2", "own_ref2", "target_err2", "target_ref2"):
            if np.any(f(key) < 0):
                ctx.fail(owner, f"{where}.{key}: a negative sum of squares")
        tau = st["tau"][a]
        ok = np.isfinite(tau)
        ctx.equal(owner, f"{where}.tau_rows per head", f("tau_rows").astype(np.int64).tolist(), ok.sum(axis=1).tolist())
        ctx.close(owner, f"{where}.tau_sum per head", f("tau_sum"), np.where(ok, tau, 0.0).sum(axis=1))
        ctx.close(owner, f"{where}.err2 = out2 + ref2 - 2 dot", f("err2"), f("out2") + f("ref2") - 2 * f("dot"))
        ctx.close(owner, f"{where}.own_err2 (float32 arm: the errors themselves)", f("own_err2"), f("err2"))
        ctx.close(owner, f"{where}.own_ref2 (float32 arm)", f("own_ref2"), f("ref2"))
        if name.startswith(MASS_PREFIX):
            ctx.close(owner, f"{where}.tau_sum = achieved_sum (float32 arm)", f("tau_sum"), f("achieved_sum"))
            if np.any(np.abs(f("achieved_sum") - f("target_sum")) > MASS_TOLERANCE * f("target_sum") * (1 + 1e-9) + 1e-12):
                ctx.fail(owner, f"{where}: achieved mass outside 1 % of the target's")
            if np.any(f("undefined") > f("matched")):
                ctx.fail(owner, f"{where}: more undefined rows than matched ones")
            continue
        spans = expected_spans(case, owner["case"], name, seed)
        und = _kept_undefined(case, spans)
        ctx.equal(owner, f"{where}.undefined per head", f("undefined").astype(np.int64).tolist(), [und] * h)
        ctx.equal(owner, f"{where}.tv_rows per head", f("tv_rows").astype(np.int64).tolist(), [tq - und] * h)
        region = name[len("drop_"):] if name.startswith("drop_") else None
        if region in reg and und == 0:
            ctx.close(owner, f"{where}.tau_sum = the {region} mass", f("tau_sum"), reg[region])
    layout = [r for r in st["regions"] if r in regions]
    if layout:
        ctx.close(owner, "stats.regions: the regions partition each row's mass", sum(reg[r] for r in layout),
                  np.full(h, float(tq)))
    if "history" in reg and "current" in regions:
        before = [r for r in layout if regions[r][1] <= regions["current"][0]]
        ctx.close(owner, "stats.regions[history] = the regions before current", reg["history"], sum(reg[r] for r in before))


def _own_stats(case, case_id, names, regions, seed) -> dict:
    """The statistics of the archived heads, re-derived from their Q/K/V (float32 arm)."""
    spans = {n: expected_spans(case, case_id, n, seed) for n in names if not n.startswith(MASS_PREFIX)}
    derived, masses, _ = _derive(case, case["k"], case["v"], spans, None)
    h, tq = case["q"].shape[:2]
    tau = np.full((len(names), h, tq), np.nan)
    heads = np.zeros((len(names), h, len(STAT_FIELDS)))
    for a, name in enumerate(names):
        if name.startswith(MASS_PREFIX):
            target = _regions(case)[name[len(MASS_PREFIX):]]
            sel = _select_case(case, target, mass_orders(case, case_id, name[len(MASS_PREFIX):], seed))
            tau[a], heads[a] = _head_sums(_derive_mass(case, case["k"], case["v"], sel, target, None), sel)
        else:
            tau[a], heads[a] = _head_sums(derived[name])
    reg = np.stack([masses[r].sum(axis=1) for r in regions]) if regions else np.zeros((0, h))
    return {"tau": tau, "heads": heads, "reg": reg}


def _check_archived_heads(ctx, row, case, st, seed) -> None:
    """Once per case: the archived heads' statistics equal the audit's own from their Q/K/V."""
    key = ("ablation-stats-heads", row["study"], row["case"], row["arm"])
    if key in ctx.cache:
        return
    ctx.cache[key] = True
    qh = case["archive"]["q_heads"]
    if not qh:
        return
    own = _own_stats(case, row["case"], st["names"], st["regions"], seed)
    owner = st["owner"]
    for a, name in enumerate(st["names"]):
        ctx.close(owner, f"stats.tau[{name}] of the archived heads", st["tau"][a][qh], own["tau"][a])
        for f in STAT_FIELDS:
            ctx.close(owner, f"stats.heads[{name}].{f} of the archived heads", st["heads"][a][qh, _F[f]],
                      own["heads"][a][:, _F[f]])
    for i, r in enumerate(st["regions"]):
        ctx.close(owner, f"stats.regions[{r}] of the archived heads", st["reg"][i][qh], own["reg"][i])


def _check_from_stats(row, ctx, case, spans, applicable, seed) -> None:
    """Every number of an ablation row of a partly archived case, from the arm's statistics."""
    st = ctx.cached(("ablation-stats", row["study"], row["case"], row["arm"]), lambda: _load_stats(ctx, row, case))
    _check_archived_heads(ctx, row, case, st, seed)
    n = st["rows"]
    for i, r in enumerate(st["regions"]):
        ctx.close(row, f"{r}_mass", row.get(f"{r}_mass"), float(st["reg"][i].sum()) / n)
    for r in REGION_FIELDS:
        if r not in st["regions"]:
            ctx.equal(row, f"{r}_mass", row.get(f"{r}_mass"), None)
    if not applicable:
        for key in NOT_APPLICABLE_NULL:
            ctx.equal(row, key, row.get(key), None)
        return
    a = st["names"].index(row["ablation"])
    hd, tau = st["heads"][a], st["tau"][a]
    ok = np.isfinite(tau)
    ctx.equal(row, "stats tau_rows", int(round(float(hd[:, _F["tau_rows"]].sum()))), int(ok.sum()))
    ctx.close(row, "stats tau_sum", float(hd[:, _F["tau_sum"]].sum()), float(tau[ok].sum()) if ok.any() else 0.0)
    _check_numbers(row, ctx, case, spans, seed, tau, hd)

# ---------------------------------------------------------------------------------------------
# report.md: the expected blocks of this analysis's section (audit_checks/report_md.py compares them)
# ---------------------------------------------------------------------------------------------

def report_tables(rows, params) -> list:
    arms = ordered(r["arm"] for r in rows)
    names = ordered(r["ablation"] for r in rows)
    dists = ordered(label(r) for r in rows)
    first = arms[0]
    trs = []
    for dist in dists:
        sel = [r for r in rows if label(r) == dist and r["arm"] == first]
        for name in names:
            rs = [r for r in sel if r["ablation"] == name]
            app = [r for r in rs if r["applicable"]]
            if not app:
                trs.append([text(dist), text(name), text(f"0/{len(rs)}"), ("n/a",), ("n/a",), ("n/a",), ("n/a",), ("-",)])
                continue
            cos = list(per_unit(app, "cosine").values())
            trs.append([text(dist), text(name), text(f"{len(app)}/{len(rs)}"),
                        spread(list(per_unit(app, "dropped_mass").values())), spread(list(per_unit(app, "tv").values())),
                        spread(list(per_unit(app, "rel_l2").values())), fixed(median(cos), 5) if cos else ("n/a",),
                        text(f"{sum(r['undefined_rows'] for r in app)}/{sum(r['rows'] for r in app)}")])
    out = [P("damage", "Output damage of each ablation on the float32 cache"),
           T("ablation damage", ["distribution", "ablation", "applicable", "tau (dropped mass)", "TV(P,P')", "rel-L2",
                                 "cosine (median)", "undefined rows"], 2, trs)]
    pairs = []
    for dist in dists:
        sel = [r for r in rows if label(r) == dist and r["arm"] == first and r["applicable"]]
        for ctrl in [n for n in names if n.startswith("control_")]:
            target = "drop_" + ctrl[len("control_"):]
            tgt = [r for r in sel if r["ablation"] == target]
            con = [r for r in sel if r["ablation"] == ctrl]
            a, b = per_unit(tgt, "rel_l2"), per_unit(con, "rel_l2")
            units = sorted(set(a) & set(b))
            if not units:
                if a:  # the ablation ran, no valid control: the run says so in a row of its own
                    pairs.append([text(dist), text(target), pct(median(list(a.values())), 3), text(ctrl), ("n/a",),
                                  ("n/a",), ("n/a",), ("n/a",), ("n/a",), text("0/0"), ("n/a",), (None, True),
                                  text("none valid")])
                continue
            ta, tb = per_unit(tgt, "dropped_mass"), per_unit(con, "dropped_mass")
            pa, pb = per_unit(tgt, "rel_l2_per_mass"), per_unit(con, "rel_l2_per_mass")
            kinds = sorted({r["control_kind"] for r in con})
            p, exact = wilcoxon_p([a[u] for u in units], [b[u] for u in units])
            pairs.append([text(dist), text(target), pct(median([a[u] for u in units]), 3), text(ctrl),
                          pct(median([b[u] for u in units]), 3), pct(median([ta.get(u) for u in units])),
                          pct(median([tb.get(u) for u in units])), fixed(median([pa.get(u) for u in units]), 3),
                          fixed(median([pb.get(u) for u in units]), 3),
                          text(f"{sum(1 for u in units if a[u] > b[u])}/{len(units)}"), pvalue(p, exact=exact),
                          (p, exact), text(", ".join(kinds))])
    holm_cells(pairs, 11)
    if pairs:
        out += [P("controls", "Each ablation next to its same-size control"),
                T("ablation vs control", ["distribution", "ablation", "rel-L2", "control", "control rel-L2", "tau",
                                          "control tau", "rel-L2 / tau", "control rel-L2 / tau", "ablation worse",
                                          "Wilcoxon p", "Holm p", "control keys"], 2, pairs)]
    mass = []
    for dist in dists:
        sel = [r for r in rows if label(r) == dist and r["arm"] == first and r["applicable"]]
        for mc in [n for n in names if n.startswith("mass_control_")]:
            region = mc[len("mass_control_"):]
            tgt = [r for r in sel if r["ablation"] == "drop_" + region]
            con = [r for r in sel if r["ablation"] == mc]
            if not tgt or not con:
                continue
            size = per_unit([r for r in sel if r["ablation"] == "control_" + region], "rel_l2")
            whole = per_unit(tgt, "rel_l2")
            a, b = per_unit(con, "target_rel_l2_matched"), per_unit(con, "rel_l2")
            units = sorted(set(a) & set(b))
            n_match = sum(r["matched_rows"] for r in con)
            n_rows = sum(r["rows"] for r in con)
            with_rows = [r for r in con if r["matched_rows"]]
            mean = (sum(r["mass_mismatch_mean"] * r["matched_rows"] for r in with_rows) / n_match) if n_match else None
            worst = max((r["mass_mismatch_max"] for r in with_rows), default=None)
            line = [text(dist), text("drop_" + region), pct(median(list(whole.values())), 3),
                    pct(median(list(size.values())), 3) if size else ("n/a",)]
            if units:
                ta, tb = per_unit(con, "target_mass"), per_unit(con, "dropped_mass")
                p, exact = wilcoxon_p([a[u] for u in units], [b[u] for u in units])
                line += [pct(median([a[u] for u in units]), 3), pct(median([b[u] for u in units]), 3),
                         pct(median([ta.get(u) for u in units])), pct(median([tb.get(u) for u in units]))]
            else:
                p, exact = None, True
                line += [("n/a",), ("n/a",), ("n/a",), ("n/a",)]
            line += [text(f"{n_match}/{n_rows}"), pct(mean, 3) + (" / ",) + pct(worst, 3),
                     text(f"{sum(1 for u in units if a[u] > b[u])}/{len(units)}"), pvalue(p, exact=exact), (p, exact)]
            mass.append(line)
    holm_cells(mass, 12)
    if mass:
        out += [P("mass controls", "Each ablation next to its size-matched and its mass-matched control"),
                T("ablation vs mass-matched control", ["distribution", "ablation", "rel-L2", "size-matched rel-L2",
                                                       "rel-L2 (matched rows)", "mass-matched rel-L2",
                                                       "tau (matched rows)", "mass-matched tau", "matched rows",
                                                       "mass mismatch mean / max", "ablation worse", "Wilcoxon p",
                                                       "Holm p"], 2, mass)]
    if len(arms) > 1:
        out.append(P("quantization", "Quantization meets ablation"))
        for dist in dists:
            trs = []
            for name in names:
                line = [text(dist), text(name)]
                for arm in arms:
                    app = [r for r in rows if label(r) == dist and r["arm"] == arm and r["ablation"] == name
                           and r["applicable"]]
                    line.append(pct(median(list(per_unit(app, "rel_l2").values())), 3) if app else ("n/a",))
                trs.append(line)
            line = [text(dist), text("cache payload / float32")]
            half = [text(dist), text("cache payload / float16 or bfloat16")]
            for arm in arms:
                rs = [r for r in rows if label(r) == dist and r["arm"] == arm]
                ratio = sum(r["payload_bytes"] for r in rs) / max(1, sum(r["baseline_bytes"] for r in rs))
                line.append(fixed(ratio, 3, exact=True))  # integers and one division, as the run
                half.append(fixed(2 * ratio, 3, exact=True))  # a 16-bit cache holds half the float32 bytes
            trs.append(line)
            trs.append(half)
            out.append(T(f"quantization {dist}", ["distribution", "ablation"] + arms, 2, trs))
    return out
