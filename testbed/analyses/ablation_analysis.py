"""Causal ablation of the cache, on float32 and on quantized K/V, in one table.

For every Case and every K/V arm (the cache as stored in float32, or its history quantized --
4-bit grouped with and without a residual window, MXFP8 -- with the current chunk, which is not
cached yet, left exact), every ablation of `testbed.ablation` is run: drop the sink, the recent
window, all history, keep the current chunk only, and the same-size controls. One row per
(case, arm, ablation) carries the dropped mass ``tau``, ``TV(P, P')``, the attention-output
relative L2 and cosine against the float64 full attention on the original K/V (so ``none`` on a
quantized arm is the quantization error alone, and "drop the sink" sits next to "quantize the
history"), the same against the arm's own full output, per-head relative L2, undefined rows,
and the region masses of the arm's full attention. Ablations whose regions the Case lacks are
reported with ``applicable: false``. The report pairs each ablation with its same-size control
across seeds or prompts (Wilcoxon signed-rank on per-unit values, never on rows), and, where the
protocol asks for ``mass_control_<region>``, with its mass-matched control: per row, keys of the
history outside the region whose reference mass is within 1 % of the region's (a different set
per row; rows without one are counted as unmatched and left out, the target's own rel-L2 is
also given on the matched rows alone).

Follows the "local output ablation" recommended by the video KV-cache attention study (docs/studies.md).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from tabulate import tabulate

from ..ablation import (ABLATION_NAMES, MASS_ATTEMPTS, MASS_TOLERANCE, MassControl, MassSelections, ablate_arm_case,
                        control_block, make_ablation, row_statistics)
from ..attention import DEFAULT_MAX_SCORES
from ..context import case_fields
from ..metrics import history_span, holm, paired_wilcoxon
from ..schema import Key, ProtocolError, Spec
from ..quant import ResidualWindow, from_config

__all__ = ["validate", "evaluate", "report", "build_arms", "REGION_FIELDS", "SPEC", "ARM"]

REGION_FIELDS = ("sink", "middle", "recent", "current", "history")
DEFAULT_ARMS = [
    {"name": "float32"},
    {"name": "int4", "key": {"kind": "int_grouped", "bits": 4, "group_size": 32, "axis": "channel"},
     "value": {"kind": "int_grouped", "bits": 4, "group_size": 32, "axis": "token"}, "window": 0},
]


def _check_ablation_name(name, where):
    try:
        make_ablation(name)
    except ValueError as e:
        raise ProtocolError(f"{where}: {e}") from None
    return name


ARM = Spec("ablation K/V arm", "One way the cache is stored: float32, or its history quantized.", {
    "name": Key(str, "arm name (float32 is the unquantized arm, required in every list)"),
    "key": Key(dict, "quantizer config of K, e.g. {\"kind\": \"int_grouped\", \"bits\": 4, \"group_size\": 32, "
                     "\"axis\": \"channel\"} or {\"kind\": \"mx\", \"element\": \"e4m3\", \"block_size\": 32, "
                     "\"rotation\": null, \"seed\": 0}; none for float32", None),
    "value": Key(dict, "quantizer config of V (as key)", None),
    "window": Key((int, str), "recent tokens kept float32: a count >= 0, or \"recent\" (the recent region's size)", 0),
}, rules=("the float32 arm takes no quantizers; every other arm needs key and value, each a valid quantizer "
          "config",))


def _check_arm(arm, where):
    a = ARM.check(arm, where)
    if a["name"] == "float32":
        if a["key"] is not None or a["value"] is not None:
            raise ProtocolError(f"{where}: the float32 arm takes no quantizers")
        return a
    for part in ("key", "value"):
        if a[part] is None:
            raise ProtocolError(f"{where}.{part}: a quantized arm needs a {part} quantizer config")
        try:
            from_config(a[part])
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"{where}.{part}: {e}") from None
    w = a["window"]
    if isinstance(w, str) and w != "recent":
        raise ProtocolError(f"{where}.window: {w!r} must be a token count or \"recent\" (the recent region's size)")
    if isinstance(w, int) and (isinstance(w, bool) or w < 0):
        raise ProtocolError(f"{where}.window: {w!r} must be >= 0")
    return a


SPEC = Spec("analysis: ablation", "Causal ablation of the cache (drop the sink, recent window, middle, history; "
            "same-size seeded controls) on float32 and on quantized K/V, each a masked renormalized softmax.", {
    "ablations": Key(("list", str, 1), "ablations to run: none, drop_<region>, control_<region> (same size), "
                                       "mass_control_<region> (same reference mass per row, within 1 %), "
                                       "drop_history, keep_current_only", list(ABLATION_NAMES)),
    "control_seed": Key(int, "seed that places the same-size control blocks and orders the mass-matched "
                             "controls' keys", 0),
    "kv_arms": Key(("list", dict, 1), "how the cache is stored", DEFAULT_ARMS, see=ARM),
    "max_scores": Key(("range", int, 1, 1 << 30), "float64 scores per tile (memory bound)", DEFAULT_MAX_SCORES),
}, rules=("\"none\" is in ablations, and no ablation is listed twice",
          "kv_arms has the float32 arm and distinct names"))


def validate(params, where):
    p = SPEC.check(params, where)
    p["ablations"] = [_check_ablation_name(n, f"{where}.ablations[{i}]") for i, n in enumerate(p["ablations"])]
    if "none" not in p["ablations"]:
        raise ProtocolError(f"{where}.ablations: \"none\" is required (each arm's baseline; its rows name the arm's arrays)")
    if len(set(p["ablations"])) != len(p["ablations"]):
        raise ProtocolError(f"{where}.ablations: names repeat")
    p["kv_arms"] = [_check_arm(a, f"{where}.kv_arms[{i}]") for i, a in enumerate(p["kv_arms"])]
    names = [a["name"] for a in p["kv_arms"]]
    if len(set(names)) != len(names):
        raise ProtocolError(f"{where}.kv_arms: arm names repeat")
    if "float32" not in names:
        raise ProtocolError(f"{where}.kv_arms: the float32 arm is required (it is the reference every arm is measured against)")
    return p


def build_arms(case, params) -> list[tuple[str, ResidualWindow | None, int, str | None]]:
    """(arm, packer or None for float32, quantized history length, reason when not applicable)."""
    hist = history_span(case.layout)
    stop = hist[1] if hist is not None else case.keys
    out = []
    for a in sorted(params["kv_arms"], key=lambda a: a["name"] != "float32"):
        if a["name"] == "float32":
            out.append((a["name"], None, 0, None))
            continue
        w = a["window"]
        reason = None
        if w == "recent":
            r = case.region("recent")
            w = r.size if r is not None else 0
            if r is None:
                reason = "no recent region for the residual window"
        if stop == 0:
            reason = "no cached history to quantize"
        packer = ResidualWindow(from_config(a["key"]), from_config(a["value"]), recent=int(w), sink=0)
        out.append((a["name"], packer, stop, reason))
    return out


def _mean(x: torch.Tensor) -> float | None:
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else None


def _median(x: torch.Tensor) -> float | None:
    x = x[torch.isfinite(x)]
    return float(torch.quantile(x, 0.5)) if x.numel() else None


def _per_mass(rel: float, tau: float | None) -> float | None:
    """rel-L2 per unit of mean dropped mass: what an ablation does beyond how much mass it removes."""
    return None if tau is None or tau <= 0 or rel != rel else rel / tau


def _finite_or_none(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _arrays(name: str, packed_paths: dict | None, stats_paths: dict | None = None) -> dict:
    """The arm's packed arrays (and quantizer config) and its per-row statistics (a case whose K/V
    are not all archived) are named once, by its ``none`` row (the quantization-only baseline
    every arm has); the arm's other rows point to that row, which keeps results.json small."""
    out = {}
    if packed_paths is not None:
        out.update({"packed": packed_paths} if name == "none" else {"packed_in": "none"})
    if stats_paths is not None:
        out.update({"stats": stats_paths} if name == "none" else {"stats_in": "none"})
    return out


def evaluate(case, params, ctx) -> list[dict]:
    spans, info, mass = {}, {}, {}
    for name in params["ablations"]:
        abl = make_ablation(name, params["control_seed"])
        if isinstance(abl, MassControl):
            orders = abl.orders(case)
            info[name] = {"applicable": orders is not None}
            if orders is not None:
                mass[name] = (abl.target_spans(case), orders)
                info[name].update(control_of=abl.target, control_seed=params["control_seed"], control_kind="mass_matched")
            continue
        sp = abl.dropped(case)
        info[name] = {"applicable": sp is not None}
        if sp is None:
            continue
        spans[name] = sp
        if name.startswith("control_"):
            target = name[len("control_"):]
            _, kind = control_block(case, target, params["control_seed"])
            info[name].update(control_of=target, control_seed=params["control_seed"], control_kind=kind)
    rows = []
    ref = None
    selections = MassSelections(case.k)  # every arm selects the same keys per row: the first arm's pass stores them
    hkv, d = case.kv_heads, case.k.shape[-1]
    base = case_fields(case)
    for arm, packer, stop, reason in build_arms(case, params):
        if reason is not None:
            ctx.progress(f"[{ctx.study}] {case.id}: arm {arm} not applicable ({reason})")
            continue
        packed_paths, quant = None, None
        baseline = 2 * hkv * (stop if packer is not None else case.keys) * d * 4
        payload = baseline
        k, v = case.k, case.v
        if packer is not None:
            packed = packer.pack(case.k[:, :stop], case.v[:, :stop])
            kh, vh = packer.unpack(packed)
            k = torch.cat([kh.to(case.k.dtype), case.k[:, stop:]], dim=1)
            v = torch.cat([vh.to(case.v.dtype), case.v[:, stop:]], dim=1)
            packed_paths = ctx.store.save_packed(f"{ctx.study}/{case.id}/ablation/{arm}", packed)
            payload = packed.nbytes
            quant = packer.config()
        # ctx.timed calls each lambda at once, so the loop variables it reads are the current ones (B023)
        # the region ablations and the mass-matched controls in one pass over the arm's score tiles
        res, mres = ctx.timed(case.id, arm, "ablate", 0,
                              lambda: ablate_arm_case(case, spans, mass, k, v, ref=ref,  # noqa: B023
                                                      max_scores=params["max_scores"], selections=selections))
        if packer is None:
            ref = res.output
        stats_paths, stats_layout = None, None
        if case.archive_kv_heads is not None:
            # the case's K/V are not all archived: the rows' statistics are, for the audit
            names = [n for n in params["ablations"] if n in spans or n in mass]
            regions = [r for r in REGION_FIELDS if r in res.region_mass]
            st = row_statistics(names, res, mres, regions)
            stats_paths = {key: ctx.store.save(f"{ctx.study}/{case.id}/ablation/{arm}/stats/{key}", t) for key, t in st.items()}
            stats_layout = {"ablations": names, "regions": regions}  # the fields: testbed.ablation.STAT_FIELDS
        region = {f"{r}_mass": (_mean(res.region_mass[r]) if r in res.region_mass else None) for r in REGION_FIELDS}
        for name in params["ablations"]:
            row = {"study": ctx.study, "analysis": "ablation", **base, "arm": arm, "ablation": name,
                   "applicable": info[name]["applicable"], "quantized_tokens": stop if packer else 0,
                   "payload_bytes": int(payload), "baseline_bytes": int(baseline),
                   "rows": case.heads * case.q.shape[1], "heads": case.heads}
            if name == "none":
                row["quant"] = quant
                if stats_layout is not None:
                    row["stats_layout"] = stats_layout
            row.update({k2: v2 for k2, v2 in info[name].items() if k2 != "applicable"})
            if name in mass:
                row.update(_mass_fields(mres, name, row["rows"]))
                row.update(region)
                row["arrays"] = _arrays(name, packed_paths, stats_paths)
                rows.append(row)
                continue
            if name not in spans:
                row.update({"dropped_spans": None, "dropped_keys": None, "dropped_mass": None, "tv": None,
                            "rel_l2": None, "cosine": None, "undefined_rows": None, "rel_l2_per_mass": None,
                            "mean_shift": None})
                row.update(region)
                row["arrays"] = _arrays(name, packed_paths, stats_paths)
                rows.append(row)
                continue
            row.update({
                "dropped_spans": [list(s) for s in spans[name]],
                "dropped_keys": sum(b - a for a, b in spans[name]),
                **_damage_fields(res, name),
                **region,
                "arrays": _arrays(name, packed_paths, stats_paths),
            })
            rows.append(row)
    return rows


def _damage_fields(res, name: str) -> dict:
    """The damage metrics of one ablation (or control) row of an `ArmResult`."""
    i = res.index(name)
    return {
        "dropped_mass": _mean(res.dropped_mass[i]),
        "dropped_mass_median": _median(res.dropped_mass[i]),
        "tv": _mean(res.tv[i]),
        "rel_l2": _finite_or_none(res.rel_l2(name)),
        "cosine": _finite_or_none(res.cosine(name)),
        "rel_l2_own": _finite_or_none(res.rel_l2(name, own=True)),
        "rel_l2_per_mass": _per_mass(res.rel_l2(name), _mean(res.dropped_mass[i])),
        "mean_shift": _mean(res.mean_shift[i]),
        "rel_l2_heads": [_finite_or_none(x) for x in res.rel_l2_heads(name)],
        "undefined_rows": int(res.undefined[i].sum()),
    }


def _mass_fields(res, name: str, nrows: int) -> dict:
    """The numbers of a mass-matched control row: the same damage metrics as any ablation (over
    the matched rows), and how well the mass was matched."""
    i = res.index(name)
    m = res.matched[i]
    nm = int(m.sum())
    tm, ach = res.target_mass[i][m], res.achieved[i][m]
    mism = (ach - tm).abs() / tm
    return {
        "dropped_spans": None,  # a different key set per row: re-derived from the case, never stored
        "dropped_keys": None,
        "dropped_keys_mean": float(res.keys[i][m].double().mean()) if nm else None,
        **_damage_fields(res, name),
        "mass_tolerance": MASS_TOLERANCE,
        "mass_attempts": MASS_ATTEMPTS,
        "matched_rows": nm,
        "unmatched_rows": nrows - nm,
        "target_mass": float(tm.mean()) if nm else None,
        "control_mass": float(ach.mean()) if nm else None,
        "mass_mismatch_mean": float(mism.mean()) if nm else None,
        "mass_mismatch_max": float(mism.max()) if nm else None,
        "target_rel_l2_matched": _finite_or_none(res.target_rel_l2(name)),
    }


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def _unit(row) -> str:
    """The independent unit of a row: the prompt, else the seed, else the case."""
    for key in ("prompt", "seed"):
        if row.get(key) is not None:
            return f"{key}={row[key]}"
    return f"case={row['case']}"


def _per_unit(rows, field) -> dict[str, float]:
    """Mean of ``field`` per unit (cases of one prompt or seed, e.g. layers, averaged first)."""
    acc = defaultdict(list)
    for r in rows:
        if r.get(field) is not None:
            acc[_unit(r)].append(r[field])
    return {u: sum(v) / len(v) for u, v in acc.items()}


def _fmt_pct(x, digits=2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}%"


def _fmt_p(x) -> str:
    """A p-value at four decimals, or in two significant digits below 0.0001 (16 prompts reach
    3.1e-05: a printed 0.0000 would claim p = 0)."""
    return "n/a" if x is None else f"{x:.4f}" if x >= 1e-4 else f"{x:.1e}"


def _fmt_ratio(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _median_list(xs):
    xs = sorted(x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x)))
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])


def _range(xs) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    return f"{_fmt_pct(_median_list(xs))} [{_fmt_pct(min(xs))}-{_fmt_pct(max(xs))}]"


def paired_controls(rows, arm="float32") -> list[dict]:
    """Per distribution: each ablation with a same-size control, paired across units."""
    out = []
    dists = list(dict.fromkeys(r.get("distribution", r["case"]) for r in rows))
    names = list(dict.fromkeys(r["ablation"] for r in rows))
    for dist in dists:
        sel = [r for r in rows if r.get("distribution", r["case"]) == dist and r["arm"] == arm and r["applicable"]]
        for ctrl in [n for n in names if n.startswith("control_")]:
            target = "drop_" + ctrl[len("control_"):]
            a = _per_unit([r for r in sel if r["ablation"] == target], "rel_l2")
            b = _per_unit([r for r in sel if r["ablation"] == ctrl], "rel_l2")
            units = sorted(set(a) & set(b))
            if not units:
                if a:  # the ablation ran but no valid control exists in this layout: said, not hidden
                    out.append({"distribution": dist, "ablation": target, "control": ctrl, "units": 0,
                                "rel_l2": _median_list(a.values()), "rel_l2_control": None, "tau": None,
                                "tau_control": None, "per_mass": None, "per_mass_control": None,
                                "ablation_worse": 0, "p": None, "median_diff": None, "control_kind": "none valid"})
                continue
            test = paired_wilcoxon([a[u] for u in units], [b[u] for u in units])
            ta = _per_unit([r for r in sel if r["ablation"] == target], "dropped_mass")
            tb = _per_unit([r for r in sel if r["ablation"] == ctrl], "dropped_mass")
            pa = _per_unit([r for r in sel if r["ablation"] == target], "rel_l2_per_mass")
            pb = _per_unit([r for r in sel if r["ablation"] == ctrl], "rel_l2_per_mass")
            kinds = sorted({r["control_kind"] for r in sel if r["ablation"] == ctrl})
            wins = sum(1 for u in units if a[u] > b[u])
            out.append({"distribution": dist, "ablation": target, "control": ctrl, "units": len(units),
                        "rel_l2": _median_list(a[u] for u in units), "rel_l2_control": _median_list(b[u] for u in units),
                        "tau": _median_list(ta.get(u) for u in units), "tau_control": _median_list(tb.get(u) for u in units),
                        "per_mass": _median_list(pa.get(u) for u in units),
                        "per_mass_control": _median_list(pb.get(u) for u in units),
                        "ablation_worse": wins, "p": test["p"], "median_diff": test["median_diff"],
                        "control_kind": ", ".join(kinds)})
    return _with_holm(out)


def paired_mass_controls(rows, arm="float32") -> list[dict]:
    """Per distribution: each ablation with a mass-matched control, next to its size-matched one."""
    out = []
    dists = list(dict.fromkeys(r.get("distribution", r["case"]) for r in rows))
    names = list(dict.fromkeys(r["ablation"] for r in rows))
    for dist in dists:
        sel = [r for r in rows if r.get("distribution", r["case"]) == dist and r["arm"] == arm and r["applicable"]]
        for mc in [n for n in names if n.startswith("mass_control_")]:
            region = mc[len("mass_control_"):]
            target, size = "drop_" + region, "control_" + region
            tgt = [r for r in sel if r["ablation"] == target]
            con = [r for r in sel if r["ablation"] == mc]
            if not tgt or not con:
                continue
            a = _per_unit(tgt, "rel_l2")
            sz = _per_unit([r for r in sel if r["ablation"] == size], "rel_l2")
            am = _per_unit(con, "target_rel_l2_matched")
            b = _per_unit(con, "rel_l2")
            units = sorted(set(am) & set(b))
            matched = sum(r["matched_rows"] for r in con)
            total = sum(r["rows"] for r in con)
            mism = (sum(r["mass_mismatch_mean"] * r["matched_rows"] for r in con if r["matched_rows"]) / matched
                    if matched else None)
            mmax = max((r["mass_mismatch_max"] for r in con if r["matched_rows"]), default=None)
            line = {"distribution": dist, "ablation": target, "control": mc, "units": len(units),
                    "rel_l2": _median_list(a.values()), "rel_l2_size": _median_list(sz.values()) if sz else None,
                    "matched": matched, "rows": total, "mismatch_mean": mism, "mismatch_max": mmax}
            if not units:
                line.update(rel_l2_matched=None, rel_l2_mass=None, tau=None, tau_mass=None, ablation_worse=0, p=None)
            else:
                test = paired_wilcoxon([am[u] for u in units], [b[u] for u in units])
                ta = _per_unit(con, "target_mass")
                tb = _per_unit(con, "dropped_mass")
                line.update(rel_l2_matched=_median_list(am[u] for u in units),
                            rel_l2_mass=_median_list(b[u] for u in units),
                            tau=_median_list(ta.get(u) for u in units), tau_mass=_median_list(tb.get(u) for u in units),
                            ablation_worse=sum(1 for u in units if am[u] > b[u]), p=test["p"])
            out.append(line)
    return _with_holm(out)


def _with_holm(lines: list[dict]) -> list[dict]:
    """Each line's ``p_holm``: its p adjusted by Holm over the family of every test of the table
    (all distributions and ablations of one study and arm), so that the table as a whole keeps a
    family-wise error rate of alpha."""
    for line, adj in zip(lines, holm([line["p"] for line in lines])):
        line["p_holm"] = adj
    return lines


def report(rows, params) -> str:
    out = []
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    names = list(dict.fromkeys(r["ablation"] for r in rows))
    dists = list(dict.fromkeys(r.get("distribution", r["case"]) for r in rows))
    out.append("Output damage of each ablation on the float32 cache: per-unit values (seed or prompt; cases of one "
               "unit averaged first), median [min-max] across units. rel-L2 and cosine are against the float64 "
               "full attention; tau is the full attention's mass on the dropped keys (= TV(P, P')).\n")
    tab = []
    for dist in dists:
        sel = [r for r in rows if r.get("distribution", r["case"]) == dist and r["arm"] == arms[0]]
        for name in names:
            rs = [r for r in sel if r["ablation"] == name]
            app = [r for r in rs if r["applicable"]]
            if not app:
                tab.append([dist, name, f"0/{len(rs)}", "n/a", "n/a", "n/a", "n/a", "-"])
                continue
            u_l2 = _per_unit(app, "rel_l2")
            u_tau = _per_unit(app, "dropped_mass")
            u_tv = _per_unit(app, "tv")
            u_cos = _per_unit(app, "cosine")
            undef = sum(r["undefined_rows"] for r in app)
            tab.append([dist, name, f"{len(app)}/{len(rs)}", _range(list(u_tau.values())), _range(list(u_tv.values())),
                        _range(list(u_l2.values())),
                        "n/a" if not u_cos else f"{_median_list(list(u_cos.values())):.5f}",
                        f"{undef}/{sum(r['rows'] for r in app)}"])
    out.append(tabulate(tab, headers=["distribution", "ablation", "applicable", "tau (dropped mass)", "TV(P,P')",
                                      "rel-L2", "cosine (median)", "undefined rows"], tablefmt="github"))
    pairs = paired_controls(rows, arms[0])
    if pairs:
        out.append("\nEach ablation next to its same-size control: as many keys as the target holds, drawn (seeded) from "
                   "the history outside it, never overlapping it (control keys: 'middle' = a block of the middle region, "
                   "'contiguous' = a block elsewhere beside the target, 'scattered' = single keys where no block fits; "
                   "'none valid' = the history outside the target is smaller than the target, so there is no "
                   "comparison). Median per-unit rel-L2, how many units the ablation hurt more than its control, and "
                   "a two-sided Wilcoxon signed-rank test on the per-unit pairs (with n units the smallest possible p "
                   "is 2/2^n; rows inside a unit are never treated as independent). 'Holm p' is that p adjusted by Holm's "
                   "step-down method over the family of every test in this table (all its distributions and "
                   "ablations): the one to read when any row of the table is taken as evidence. Since O' - O = tau (mu_kept - "
                   "mu_dropped), a size-matched control that removes less mass does less damage for that reason "
                   "alone: rel-L2 / tau is the damage per unit of dropped mass, what the region does beyond its mass.\n")
        ptab = [[p["distribution"], p["ablation"], _fmt_pct(p["rel_l2"], 3), p["control"], _fmt_pct(p["rel_l2_control"], 3),
                 _fmt_pct(p["tau"]), _fmt_pct(p["tau_control"]), _fmt_ratio(p["per_mass"]),
                 _fmt_ratio(p["per_mass_control"]), f"{p['ablation_worse']}/{p['units']}",
                 _fmt_p(p["p"]), _fmt_p(p["p_holm"]), p["control_kind"]] for p in pairs]
        out.append(tabulate(ptab, headers=["distribution", "ablation", "rel-L2", "control", "control rel-L2", "tau",
                                           "control tau", "rel-L2 / tau", "control rel-L2 / tau", "ablation worse",
                                           "Wilcoxon p", "Holm p", "control keys"], tablefmt="github"))
    mpairs = paired_mass_controls(rows, arms[0])
    if mpairs:
        out.append("\nEach ablation next to its size-matched and its mass-matched control. The mass-matched control "
                   "drops, per row (head x query), keys of the history outside the target (the size-matched "
                   f"control's pool) whose reference attention mass is within {100 * MASS_TOLERANCE:g} % of the "
                   "target's tau on that row: a first-fit pass over the eligible keys in a seeded order (a key is "
                   "taken while the running mass stays within the band's top, the pass stops once it reaches the "
                   f"band), up to {MASS_ATTEMPTS} seeded orders, the first that lands in [{1 - MASS_TOLERANCE:g} tau, "
                   f"{1 + MASS_TOLERANCE:g} tau] kept. It controls how much mass is removed, not where it sits nor "
                   "how many keys carry it, and its keys differ from row to row (unlike the size-matched block, one "
                   "per case). A row where no order lands in the band (tau 0, or more mass in the target than "
                   "outside it, or no subset found) is unmatched: it is left out, and counted. 'rel-L2 (matched "
                   "rows)' is the target's own ablation on the same matched rows, the like-for-like comparison "
                   "('ablation worse' and the Wilcoxon test pair it with the mass-matched control per unit); 'tau "
                   "(matched rows)' is the target's reference mass there, 'mass mismatch' the mean and the largest "
                   "|achieved - tau| / tau over matched rows; 'Holm p' adjusts the Wilcoxon p over every test of this "
                   "table.\n")
        mtab = [[p["distribution"], p["ablation"], _fmt_pct(p["rel_l2"], 3), _fmt_pct(p["rel_l2_size"], 3),
                 _fmt_pct(p["rel_l2_matched"], 3), _fmt_pct(p["rel_l2_mass"], 3), _fmt_pct(p["tau"]),
                 _fmt_pct(p["tau_mass"]), f"{p['matched']}/{p['rows']}",
                 f"{_fmt_pct(p['mismatch_mean'], 3)} / {_fmt_pct(p['mismatch_max'], 3)}",
                 f"{p['ablation_worse']}/{p['units']}", _fmt_p(p["p"]), _fmt_p(p["p_holm"])] for p in mpairs]
        out.append(tabulate(mtab, headers=["distribution", "ablation", "rel-L2", "size-matched rel-L2",
                                           "rel-L2 (matched rows)", "mass-matched rel-L2", "tau (matched rows)",
                                           "mass-matched tau", "matched rows", "mass mismatch mean / max",
                                           "ablation worse", "Wilcoxon p", "Holm p"], tablefmt="github"))
    if len(arms) > 1:
        out.append("\nQuantization meets ablation: median per-unit rel-L2 against the float64 full attention on the "
                   "original K/V. Row `none` is the quantization of the cached history alone (the current chunk stays "
                   "exact); the other rows combine it with the ablation.\n")
        for dist in dists:
            qtab = []
            for name in names:
                line = [dist, name]
                for arm in arms:
                    app = [r for r in rows if r.get("distribution", r["case"]) == dist and r["arm"] == arm
                           and r["ablation"] == name and r["applicable"]]
                    line.append(_fmt_pct(_median_list(list(_per_unit(app, "rel_l2").values())), 3) if app else "n/a")
                qtab.append(line)
            bytes_line = [dist, "cache payload / float32"]
            half_line = [dist, "cache payload / float16 or bfloat16"]
            for arm in arms:
                rs = [r for r in rows if r.get("distribution", r["case"]) == dist and r["arm"] == arm]
                ratio = sum(r['payload_bytes'] for r in rs) / max(1, sum(r['baseline_bytes'] for r in rs))
                bytes_line.append(f"{ratio:.3f}")
                half_line.append(f"{2 * ratio:.3f}")   # a 16-bit cache holds half the float32 bytes
            qtab.append(bytes_line)
            qtab.append(half_line)
            out.append(tabulate(qtab, headers=["distribution", "ablation"] + arms, tablefmt="github"))
            out.append("")
    return "\n".join(out).rstrip()
