"""One K/V arm's region ablations and mass-matched controls in one pass over its score tiles
(`ablate_arm`; `ablate`, `mass_control` and the ``*_case`` forms on a Case): `_arm_setup`, then per
tile `_merge_tile` (atoms, full output, region ablations) and `_control_tile` (the controls), then
`_arm_results`. The computation is described in the package's docstring."""

from __future__ import annotations

import numpy as np
import torch

from ..attention import DEFAULT_MAX_SCORES
from ..metrics import history_span, score_tiles
from .ablations import MASS_TOLERANCE
from .mass_select import select_mass_matched
from .results import ArmResult, MassResult, MassSelections
from .rows import drop_rows, spans_of

__all__ = ["ablate", "ablate_case", "ablate_arm", "ablate_arm_case", "mass_control", "mass_control_case", "cut_points"]


def cut_points(keys: int, layout, spans: dict[str, list[tuple[int, int]]]) -> list[int]:
    """Sorted key indices where a region or an ablation span starts or stops (0 and ``keys`` included)."""
    cuts = {0, keys}
    for r in layout:
        cuts.update((r.start, r.stop))
    for sp in spans.values():
        for a, b in sp:
            cuts.update((a, b))
    return sorted(c for c in cuts if 0 <= c <= keys)


def _atoms(keys: int, layout, spans: dict[str, list[tuple[int, int]]]) -> list[tuple[int, int]]:
    cuts = cut_points(keys, layout, spans)
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def _inside(atom: tuple[int, int], spans) -> bool:
    return any(a <= atom[0] and atom[1] <= b for a, b in spans)


def _merge(m, z, n, sel):
    """Merge the atoms selected by ``sel`` (bool [A]): returns (shift, Z, N) with shift finite."""
    ms = m[sel]
    big = ms.amax(dim=0) if ms.shape[0] else torch.full(m.shape[1:], float("-inf"), dtype=m.dtype)
    shift = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    w = torch.exp(ms - shift)  # -inf atoms (nothing visible) weigh exactly 0
    zz = (w * z[sel]).sum(dim=0)
    nn = (w.unsqueeze(-1) * n[sel]).sum(dim=0)
    return shift, zz, nn


def _add_error_sums(sums: dict, i: int, heads, ok: torch.Tensor, out, o_ref, full) -> torch.Tensor:
    """Add one tile's rows where ``ok`` to ablation ``i``'s per-head sums (``err2``, ``ref2``, ``dot``,
    ``out2``, ``own_err2``, ``own_ref2``; see `ArmResult`); returns ``out`` with the other rows zeroed."""
    okd = ok.unsqueeze(-1)
    o = torch.where(okd, out, torch.zeros_like(out))
    r = torch.where(okd, o_ref, torch.zeros_like(o_ref))
    f = torch.where(okd, full, torch.zeros_like(full))
    sums["err2"][i, heads] += ((o - r) ** 2).sum(dim=(-1, -2))
    sums["ref2"][i, heads] += (r ** 2).sum(dim=(-1, -2))
    sums["dot"][i, heads] += (o * r).sum(dim=(-1, -2))
    sums["out2"][i, heads] += (o ** 2).sum(dim=(-1, -2))
    sums["own_err2"][i, heads] += ((o - f) ** 2).sum(dim=(-1, -2))
    sums["own_ref2"][i, heads] += (f ** 2).sum(dim=(-1, -2))
    return o


def ablate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor, causal: bool,
           layout, spans: dict[str, list[tuple[int, int]]], *, ref: torch.Tensor | None = None,
           max_scores: int = DEFAULT_MAX_SCORES) -> ArmResult:
    """Run every ablation of ``spans`` ({name: dropped spans}) on one K/V arm, tile by tile
    (`ablate_arm` without mass-matched controls).

    ``ref`` is the output the errors are measured against (the float64 full attention on the
    original K/V); None measures against this arm's own full output.
    """
    return ablate_arm(q, k, v, query_positions, causal, layout, spans, {}, ref=ref, max_scores=max_scores)[0]


def ablate_case(case, spans: dict[str, list[tuple[int, int]]], k=None, v=None, *, ref=None,
                max_scores: int = DEFAULT_MAX_SCORES) -> ArmResult:
    """`ablate` on a Case, optionally with replaced (e.g. dequantized) K and V."""
    return ablate(case.q, case.k if k is None else k, case.v if v is None else v, case.query_positions,
                  case.causal, case.layout, spans, ref=ref, max_scores=max_scores)


def mass_control(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor, causal: bool,
                 layout, controls: dict[str, tuple[list[tuple[int, int]], list[list[int]]]], *, k_ref: torch.Tensor | None = None,
                 ref: torch.Tensor | None = None, max_scores: int = DEFAULT_MAX_SCORES,
                 tol: float = MASS_TOLERANCE, selections: MassSelections | None = None) -> MassResult:
    """Run the mass-matched controls ``controls`` ({name: (target spans, `MassControl.orders`)}) on
    one K/V arm, tile by tile (`ablate_arm` without region ablations; its arguments)."""
    return ablate_arm(q, k, v, query_positions, causal, layout, {}, controls, k_ref=k_ref, ref=ref,
                      max_scores=max_scores, tol=tol, selections=selections)[1]


class _ArmPass:
    """What one `ablate_arm` pass sets up once (`_arm_setup`) and fills tile by tile: the atoms and
    which of them each ablation, control target and region covers, the region ablations'
    accumulators ``[A, H, Tq]`` / ``[A, H]``, the full output and region masses, and the
    mass-matched controls' accumulators, eligible keys and shared selections."""


def _arm_setup(q: torch.Tensor, k: torch.Tensor, layout, spans: dict[str, list[tuple[int, int]]],
               controls: dict[str, tuple[list[tuple[int, int]], list[list[int]]]], k_ref: torch.Tensor | None,
               max_scores: int, tol: float, selections: MassSelections | None) -> _ArmPass:
    """The atoms of the pass (every region, span and control target boundary), their membership
    masks and the zeroed accumulators of `ablate_arm`; with controls, their targets, eligible key
    runs and the `MassSelections` entry this pass reads or fills (``cached``: read)."""
    st = _ArmPass()
    h, tq, d = q.shape
    keys = k.shape[1]
    st.h, st.tq, st.keys = h, tq, keys
    st.spans, st.controls = spans, controls
    st.names, st.cnames = list(spans), list(controls)
    na, nc = len(st.names), len(st.cnames)
    atoms = _atoms(keys, layout, {**spans, **{f"target:{c}": controls[c][0] for c in st.cnames}})
    st.atoms = atoms
    st.drop_atoms = torch.tensor([[_inside(at, spans[nm]) for at in atoms] for nm in st.names],
                                 dtype=torch.bool).reshape(na, len(atoms))
    st.target_atoms = torch.tensor([[_inside(at, controls[nm][0]) for at in atoms] for nm in st.cnames],
                                   dtype=torch.bool).reshape(nc, len(atoms))
    st.region_atoms = {r.name: torch.tensor([_inside(at, [(r.start, r.stop)]) for at in atoms], dtype=torch.bool)
                       for r in layout}
    hist = history_span(layout)
    if hist is not None:
        st.region_atoms["history"] = torch.tensor([_inside(at, [hist]) for at in atoms], dtype=torch.bool)
    f64 = torch.float64
    nan = float("nan")
    st.dropped_mass = torch.full((na, h, tq), nan, dtype=f64)
    st.tv = torch.full((na, h, tq), nan, dtype=f64)
    st.mean_shift = torch.full((na, h, tq), nan, dtype=f64)
    st.undefined = torch.zeros(na, h, dtype=torch.int64)
    st.sums = {key: torch.zeros(na, h, dtype=f64) for key in ("err2", "ref2", "dot", "out2", "own_err2", "own_ref2")}
    st.rmass = {name: torch.empty(h, tq, dtype=f64) for name in st.region_atoms}
    st.output = torch.empty(h, tq, d, dtype=f64)
    st.all_atoms = torch.ones(len(atoms), dtype=torch.bool)

    st.per_row = {key: torch.full((nc, h, tq), nan, dtype=f64)
                  for key in ("dropped_mass", "tv", "mean_shift", "target_mass", "achieved")}
    st.matched_all = torch.zeros(nc, h, tq, dtype=torch.bool)
    st.nkeys = torch.zeros(nc, h, tq, dtype=torch.int64)
    st.c_undefined = torch.zeros(nc, h, dtype=torch.int64)
    st.csums = {key: torch.zeros(nc, h, dtype=f64) for key in ("err2", "ref2", "dot", "out2", "own_err2", "own_ref2",
                                                               "target_err2", "target_ref2")}
    st.targets = []
    for name in st.cnames:
        tmask = torch.zeros(keys, dtype=torch.bool)
        for a, b in controls[name][0]:
            tmask[a:b] = True
        st.targets.append(tmask)
    st.eligible = [np.sort(np.asarray(controls[name][1][0], dtype=np.int64)) for name in st.cnames]
    st.within = [spans_of(e) or None for e in st.eligible]  # the runs of keys a control may drop (None: no such key)
    st.t_defined = [(~t).any() for t in st.targets]  # without a causal mask: whether any key lies outside the target
    st.tol = tol
    sid = cached = None
    if controls:
        sig = (tuple(st.cnames), tuple((tuple(map(tuple, sp)), tuple(map(tuple, od))) for sp, od in controls.values()),
               int(max_scores), float(tol), tuple(q.shape), tuple(k.shape))
        if selections is not None and not selections.usable(k if k_ref is None else k_ref):
            selections = None
        sid = None if selections is None else selections.signature(sig)
        cached = selections is not None and sid in selections.complete
    st.selections, st.sid, st.cached = selections, sid, cached
    st.work = st.work2 = None
    return st


def _merge_tile(st: _ArmPass, heads, qs, s: torch.Tensor, vj: torch.Tensor, ref: torch.Tensor | None):
    """One tile's atoms (max, normalizer and numerator of each atom's masked softmax), merged into
    the full output, the region masses and every region ablation (`_merge`), added to ``st``.
    Returns what the controls read of the tile: ``(m, z, n, full, o_ref, fn_row)``."""
    f64 = torch.float64
    nan = float("nan")
    atoms = st.atoms
    m = torch.stack([s[..., a:b].amax(dim=-1) for a, b in atoms])            # [A_t, g, c]
    z_list, n_list = [], []
    for (a, b), ma in zip(atoms, m):
        shift = torch.where(torch.isfinite(ma), ma, torch.zeros_like(ma))
        e = torch.exp(s[..., a:b] - shift.unsqueeze(-1))
        z_list.append(e.sum(dim=-1))
        n_list.append(torch.matmul(e, vj[a:b]))
        del e
    z = torch.stack(z_list)
    n = torch.stack(n_list)
    fshift, fz, fn = _merge(m, z, n, st.all_atoms)
    full = fn / fz.unsqueeze(-1)
    st.output[heads, qs] = full
    w_full = torch.exp(m - fshift) * z / fz                                    # atom masses of P
    for name, sel in st.region_atoms.items():
        st.rmass[name][heads, qs] = w_full[sel].sum(dim=0)
    o_ref = full if ref is None else ref[heads, qs].to(f64)
    f_full = torch.exp(m - fshift) / fz        # the full softmax's factor per atom (TV below)
    fn_row = full.norm(dim=-1)                 # ||O|| per row (the mean shift's scale)
    for i, _name in enumerate(st.names):
        keep_atoms = ~st.drop_atoms[i]
        shift, zz, nn = _merge(m, z, n, keep_atoms)
        ok = zz > 0
        zs = torch.where(ok, zz, torch.ones_like(zz))
        out = torch.where(ok.unsqueeze(-1), nn / zs.unsqueeze(-1), torch.full_like(nn, nan))
        tau = w_full[st.drop_atoms[i]].sum(dim=0)
        # TV key by key, summed per atom: inside atom a both rows are proportional to the same
        # exp(s - m_a), with factors exp(m_a - shift) / Z (full) and exp(m_a - shift') / Z'
        # (ablated, 0 on dropped atoms), so sum_a |P - P'| = Z_a |factor - factor'|.
        f_abl = torch.where(keep_atoms.view(-1, 1, 1), torch.exp(m - shift) / zs, torch.zeros_like(f_full))
        row_tv = 0.5 * (z * (f_full - f_abl).abs()).sum(dim=0)
        st.dropped_mass[i, heads, qs] = torch.where(ok, tau, torch.full_like(tau, nan))
        st.tv[i, heads, qs] = torch.where(ok, row_tv, torch.full_like(row_tv, nan))
        st.undefined[i, heads] += (~ok).sum(dim=-1)
        o = _add_error_sums(st.sums, i, heads, ok, out, o_ref, full)
        # mu_dropped from the dropped atoms merged on their own (stable however small tau is)
        _, zd, nd = _merge(m, z, n, st.drop_atoms[i])
        shift_ok = ok & (zd > 0) & (fn_row > 0)
        mu_d = nd / torch.where(zd > 0, zd, torch.ones_like(zd)).unsqueeze(-1)
        ms = (o - mu_d).norm(dim=-1) / torch.where(shift_ok, fn_row, torch.ones_like(fn_row))
        st.mean_shift[i, heads, qs] = torch.where(shift_ok, ms, torch.full_like(ms, nan))
    return m, z, n, full, o_ref, fn_row


def _control_tile(st: _ArmPass, heads, qs, s: torch.Tensor, vis: torch.Tensor | None, vj: torch.Tensor,
                  ref_tiles, m, z, n, full, o_ref, fn_row) -> None:
    """The mass-matched controls on one tile's (masked) scores: each row's selection (read from
    ``st.selections`` when cached, else chosen on the reference attention, from ``ref_tiles`` when
    the reference K is not this arm's), its direct masked softmax (`drop_rows`) and the target's
    own ablation merged from the tile's atoms, added to ``st``."""
    f64 = torch.float64
    nan = float("nan")
    if st.work is None or st.work.numel() < s.numel():
        st.work, st.work2 = torch.empty(s.numel(), dtype=f64), torch.empty(s.numel(), dtype=f64)
    p = torch.softmax(s, dim=-1)
    if st.cached:
        p_ref = None
    elif ref_tiles is None:
        p_ref = p
    else:
        s_ref = next(ref_tiles)[3]
        p_ref = torch.softmax(s_ref if vis is None else s_ref.masked_fill(~vis, float("-inf")), dim=-1)
    per_row, csums = st.per_row, st.csums
    for i, name in enumerate(st.cnames):
        if st.cached:
            sel, tau, acc, matched = st.selections.get(st.sid, name, heads, qs, st.keys, st.eligible[i])
        else:
            sel, tau, acc, matched = select_mass_matched(p_ref, st.targets[i], st.controls[name][1], vis, st.tol)
            if st.selections is not None:
                st.selections.put(st.sid, name, heads, qs, (st.h, st.tq), sel, st.eligible[i], tau, acc, matched)
        out, ok, drop_mass, row_tv, mu_d, has = drop_rows(s, vis, p, sel, vj, st.work, st.work2,
                                                           within=st.within[i])
        _, zt, nt = _merge(m, z, n, ~st.target_atoms[i])                             # the target's own ablation
        # defined where a visible key lies outside the target (from the mask, so that a NaN
        # score propagates into the sums instead of leaving its row out)
        t_ok = st.t_defined[i].expand(zt.shape) if vis is None else (vis & ~st.targets[i]).any(dim=-1).expand(zt.shape)
        t_out = nt / torch.where(zt != 0, zt, torch.ones_like(zt)).unsqueeze(-1)
        use = matched & ok
        both = use & t_ok
        per_row["target_mass"][i, heads, qs] = tau
        per_row["achieved"][i, heads, qs] = torch.where(matched, acc, torch.full_like(acc, nan))
        st.matched_all[i, heads, qs] = matched
        st.nkeys[i, heads, qs] = sel.sum(dim=-1)
        per_row["dropped_mass"][i, heads, qs] = torch.where(use, drop_mass, torch.full_like(drop_mass, nan))
        per_row["tv"][i, heads, qs] = torch.where(use, row_tv, torch.full_like(row_tv, nan))
        shift_ok = use & has & (fn_row > 0)
        ms = (out - mu_d).norm(dim=-1) / torch.where(shift_ok, fn_row, torch.ones_like(fn_row))
        per_row["mean_shift"][i, heads, qs] = torch.where(shift_ok, ms, torch.full_like(ms, nan))
        st.c_undefined[i, heads] += (matched & ~ok).sum(dim=-1)
        _add_error_sums(csums, i, heads, use, out, o_ref, full)
        bb = both.unsqueeze(-1)
        to = torch.where(bb, t_out, torch.zeros_like(t_out))
        tr = torch.where(bb, o_ref, torch.zeros_like(o_ref))
        csums["target_err2"][i, heads] += ((to - tr) ** 2).sum(dim=(-1, -2))
        csums["target_ref2"][i, heads] += (tr ** 2).sum(dim=(-1, -2))
    del p, p_ref


def _arm_results(st: _ArmPass) -> tuple[ArmResult, MassResult | None]:
    """The pass's `ArmResult` and, with controls, its `MassResult` (its selections then complete)."""
    sums, csums, per_row = st.sums, st.csums, st.per_row
    res = ArmResult(st.names, st.dropped_mass, st.tv, st.undefined, sums["err2"], sums["ref2"], sums["dot"],
                    sums["out2"], sums["own_err2"], sums["own_ref2"], st.rmass, st.output, st.mean_shift)
    if not st.controls:
        return res, None
    mres = MassResult(st.cnames, per_row["dropped_mass"], per_row["tv"], st.c_undefined, csums["err2"], csums["ref2"],
                      csums["dot"], csums["out2"], csums["own_err2"], csums["own_ref2"], {}, st.output,
                      per_row["mean_shift"], target_mass=per_row["target_mass"], achieved=per_row["achieved"],
                      matched=st.matched_all, keys=st.nkeys, target_err2=csums["target_err2"],
                      target_ref2=csums["target_ref2"])
    if st.selections is not None:
        st.selections.complete.add(st.sid)
    return res, mres


def ablate_arm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor, causal: bool,
               layout, spans: dict[str, list[tuple[int, int]]],
               controls: dict[str, tuple[list[tuple[int, int]], list[list[int]]]], *, k_ref: torch.Tensor | None = None,
               ref: torch.Tensor | None = None, max_scores: int = DEFAULT_MAX_SCORES, tol: float = MASS_TOLERANCE,
               selections: MassSelections | None = None) -> tuple[ArmResult, MassResult | None]:
    """One K/V arm's region ablations ``spans`` ({name: dropped spans}) and mass-matched controls
    ``controls`` ({name: (target spans, `MassControl.orders`)}) in one pass over the tiles (one KV
    head x a slice of queries): ``(ArmResult, MassResult or None without controls)``.

    Region ablations drop the same keys in every row, so each tile's keys are cut into *atoms* at
    every region, span and target boundary; each atom's masked softmax is summed once (its max,
    normalizer and numerator ``exp(s - max) V``) and any union of atoms is a merge of those
    (`_merge`): the full output, every ablation's output and a control's target's own ablation.
    A mass-matched control drops a different key set per row, so each of its rows is a direct
    masked softmax over its own kept keys (`drop_rows`) on the same tile's scores.
    The pass is `_arm_setup`, then per tile `_merge_tile` (atoms, full output, region ablations)
    and `_control_tile` (the controls), then `_arm_results`.

    ``ref``: the output errors are measured against (None: this arm's own full output).
    ``k_ref``: the original K the controls' selection reads (None: ``k`` itself, the float32 arm).
    ``selections``: a `MassSelections` of the reference K, filled by the first pass and read by the
    next ones (None: every pass selects on its own).
    """
    st = _arm_setup(q, k, layout, spans, controls, k_ref, max_scores, tol, selections)
    ref_tiles = None if not controls or k_ref is None or st.cached else score_tiles(q, k_ref, query_positions, causal,
                                                                                    max_scores)
    for j, heads, qs, s, vis in score_tiles(q, k, query_positions, causal, max_scores):
        vj = v[j].to(torch.float64)
        if vis is not None:
            s = s.masked_fill(~vis, float("-inf"))
        m, z, n, full, o_ref, fn_row = _merge_tile(st, heads, qs, s, vj, ref)
        if controls:
            _control_tile(st, heads, qs, s, vis, vj, ref_tiles, m, z, n, full, o_ref, fn_row)
    return _arm_results(st)


def ablate_arm_case(case, spans, controls, k=None, v=None, *, ref=None, max_scores: int = DEFAULT_MAX_SCORES,
                    selections: MassSelections | None = None) -> tuple[ArmResult, MassResult | None]:
    """`ablate_arm` on a Case, optionally with replaced (e.g. dequantized) K and V; the controls'
    selection still reads the Case's own K (the reference attention). ``selections``: a
    `MassSelections` of ``case.k`` shared by the Case's arms."""
    return ablate_arm(case.q, case.k if k is None else k, case.v if v is None else v, case.query_positions,
                      case.causal, case.layout, spans, controls, k_ref=None if k is None or k is case.k else case.k,
                      ref=ref, max_scores=max_scores, selections=selections)


def mass_control_case(case, controls, k=None, v=None, *, ref=None, max_scores: int = DEFAULT_MAX_SCORES,
                      selections: MassSelections | None = None) -> MassResult:
    """`mass_control` on a Case; with replaced (e.g. dequantized) K and V the selection still reads
    the Case's own K (the reference attention). ``selections``: a `MassSelections` of ``case.k``
    shared by the Case's arms (each arm then selects nothing the first one did not)."""
    return mass_control(case.q, case.k if k is None else k, case.v if v is None else v, case.query_positions,
                        case.causal, case.layout, controls, k_ref=None if k is None or k is case.k else case.k, ref=ref,
                        max_scores=max_scores, selections=selections)

