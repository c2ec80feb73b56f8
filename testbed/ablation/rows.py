"""The per-row masked renormalized softmax (`drop_rows`): a different dropped key set per row, on
one tile's scores (the mass-matched controls' path, and the selective analysis's kept sets)."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["drop_rows", "spans_of"]

def _scratch(buf: torch.Tensor | None, shape, dtype=torch.float64) -> torch.Tensor:
    """A contiguous ``shape`` tensor in ``buf``'s memory when it holds enough (a tile's scratch,
    reused from tile to tile instead of allocated per operation), else a new one."""
    n = 1
    for x in shape:
        n *= int(x)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        return torch.empty(shape, dtype=dtype)
    return buf.view(-1)[:n].view(shape)


_NINF = torch.tensor(float("-inf"), dtype=torch.float64)
_ZERO = torch.tensor(0.0, dtype=torch.float64)


def spans_of(keys: np.ndarray) -> list[tuple[int, int]]:
    """The sorted key indices ``keys`` as maximal runs ``[(start, stop), ...]``."""
    keys = np.asarray(keys, dtype=np.int64)
    if keys.size == 0:
        return []
    cut = np.flatnonzero(np.diff(keys) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(keys, cut)]


def _columns(x: torch.Tensor, spans: list[tuple[int, int]], dim: int = -1) -> torch.Tensor:
    """``x`` restricted to the key runs ``spans`` along ``dim``: a view for one run, a copy for several."""
    parts = [x.narrow(dim, a, b - a) for a, b in spans]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def drop_rows(s: torch.Tensor, vis: torch.Tensor | None, p: torch.Tensor, drop: torch.Tensor, vj: torch.Tensor,
               work: torch.Tensor | None = None, work2: torch.Tensor | None = None, outputs_only: bool = False,
               within: list[tuple[int, int]] | None = None):
    """One masked renormalized softmax per row, dropping ``drop [g, c, Tk]`` (a per-row mask: the
    mass-matched controls' selections, the selective analysis's kept sets).

    Returns ``(out [g, c, D], ok, tau, tv, mu_dropped [g, c, D], has)``: ``ok`` where the kept
    visible set is not empty, ``tau`` the dropped mass of ``p``, ``tv = 0.5 sum |p - p'|`` key by
    key, ``mu_dropped`` the value mean under the dropped keys' own softmax, ``has`` where a visible
    key is dropped; ``(out, ok)`` only with ``outputs_only``. ``work`` / ``work2``: float64 scratch
    of at least the tile's size (`_scratch`; None allocates): the softmaxes are computed in place
    there, the same operations on the same shapes as out of place, so the same values.
    ``within``: key runs that hold every dropped key (a mass-matched control's eligible keys;
    checked): ``mu_dropped`` is then summed over those keys only, the others weighing exactly 0
    (the same value summed in another order: the last bits may differ from the sum over ``Tk``).
    """
    allowed = ~drop if vis is None else vis.unsqueeze(0) & ~drop
    ok = allowed.any(dim=-1)
    ea = torch.where(allowed, s, _NINF, out=_scratch(work, s.shape))              # s on the kept keys, else -inf
    mx = torch.where(ok, ea.amax(dim=-1), torch.zeros_like(ok, dtype=s.dtype))
    ea.sub_(mx.unsqueeze(-1)).exp_()
    za = ea.sum(dim=-1)
    pa = ea.div_(torch.where(ok, za, torch.ones_like(za)).unsqueeze(-1))
    out = torch.matmul(pa, vj)
    if outputs_only:
        return out, ok
    w2 = _scratch(work2, s.shape)
    tau = torch.where(drop, p, _ZERO, out=w2).sum(dim=-1)
    tv = 0.5 * torch.sub(p, pa, out=w2).abs_().sum(dim=-1)
    dv = drop if vis is None else vis.unsqueeze(0) & drop
    has = dv.any(dim=-1)
    if within is None:
        ed = torch.where(dv, s, _NINF, out=pa)                                      # s on the dropped keys, else -inf
        vd = vj
    else:
        inside = torch.zeros(s.shape[-1], dtype=torch.bool)
        for a, b in within:
            inside[a:b] = True
        if bool(drop[..., ~inside].any()):
            raise ValueError("a dropped key lies outside the runs `within` said hold every dropped key")
        dv = _columns(dv, within)
        ed = torch.where(dv, _columns(s, within), _NINF, out=_scratch(w2, dv.shape))
        vd = _columns(vj, within, dim=0)
    md = torch.where(has, ed.amax(dim=-1), torch.zeros_like(has, dtype=s.dtype))
    ed.sub_(md.unsqueeze(-1)).exp_()
    zd = ed.sum(dim=-1)
    mu_d = torch.matmul(ed, vd) / torch.where(has, zd, torch.ones_like(zd)).unsqueeze(-1)
    return out, ok, tau, tv, mu_d, has
