"""Per-row statistics: what the audit re-derives a case's ablation rows from when its K/V are not
archived (`row_statistics`; the fields `STAT_FIELDS`)."""

from __future__ import annotations

import torch

from .results import ArmResult, MassResult

__all__ = ["STAT_FIELDS", "row_statistics"]

STAT_FIELDS = ("undefined", "err2", "ref2", "dot", "out2", "own_err2", "own_ref2", "tau_sum", "tau_rows", "tv_sum",
               "tv_rows", "shift_sum", "shift_rows", "matched", "target_sum", "achieved_sum", "mismatch_sum",
               "mismatch_max", "keys_sum", "target_err2", "target_ref2")


def _sum_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head: the sum of the finite entries of ``x [H, Tq]`` and how many there are."""
    ok = torch.isfinite(x)
    return torch.where(ok, x, torch.zeros_like(x)).sum(dim=-1), ok.sum(dim=-1).to(torch.float64)


def row_statistics(names: list[str], res: ArmResult, mres: MassResult | None, regions: list[str]) -> dict:
    """The statistics of one K/V arm from which every number of its ablation rows follows.

    ``tau [A, H, Tq]`` float32: each row's dropped mass (NaN where undefined or unmatched), for the
    medians; ``heads [A, H, F]`` float64 (F = `STAT_FIELDS`): per head, the sums the row's means,
    ratios and counts are made of (squared errors, dot products, sums and counts of the per-row
    tau, TV and mean shift; for a mass-matched control also its matched rows, their target and
    achieved mass, relative mismatch sum and max, selected keys, the target's own errors on those
    rows); ``regions [R, H]`` float64: the full attention's mass on each region of ``regions``,
    summed over queries. ``A`` follows ``names`` (each in ``res`` or ``mres``)."""
    h, tq = res.dropped_mass.shape[1:]
    tau = torch.full((len(names), h, tq), float("nan"), dtype=torch.float64)
    heads = torch.zeros(len(names), h, len(STAT_FIELDS), dtype=torch.float64)
    col = {f: j for j, f in enumerate(STAT_FIELDS)}
    for a, name in enumerate(names):
        r = res if name in res.names else mres
        i = r.index(name)
        tau[a] = r.dropped_mass[i]
        out = heads[a]
        out[:, col["undefined"]] = r.undefined[i].to(torch.float64)
        for f in ("err2", "ref2", "dot", "out2", "own_err2", "own_ref2"):
            out[:, col[f]] = getattr(r, f)[i]
        for f, x in (("tau", r.dropped_mass[i]), ("tv", r.tv[i]), ("shift", r.mean_shift[i])):
            out[:, col[f"{f}_sum"]], out[:, col[f"{f}_rows"]] = _sum_rows(x)
        if r is mres:
            m = mres.matched[i]
            tm = torch.where(m, mres.target_mass[i], torch.zeros_like(mres.target_mass[i]))
            ach = torch.where(m, mres.achieved[i], torch.zeros_like(tm))
            mism = torch.where(m, (ach - tm).abs() / torch.where(m, tm, torch.ones_like(tm)), torch.zeros_like(tm))
            out[:, col["matched"]] = m.sum(dim=-1).to(torch.float64)
            out[:, col["target_sum"]] = tm.sum(dim=-1)
            out[:, col["achieved_sum"]] = ach.sum(dim=-1)
            out[:, col["mismatch_sum"]] = mism.sum(dim=-1)
            out[:, col["mismatch_max"]] = mism.amax(dim=-1)
            out[:, col["keys_sum"]] = torch.where(m, mres.keys[i], torch.zeros_like(mres.keys[i])).sum(dim=-1).double()
            out[:, col["target_err2"]] = mres.target_err2[i]
            out[:, col["target_ref2"]] = mres.target_ref2[i]
    reg = torch.stack([res.region_mass[n].sum(dim=-1) for n in regions]) if regions else torch.zeros(0, h, dtype=torch.float64)
    return {"tau": tau.to(torch.float32), "heads": heads, "regions": reg}

