"""The mass-matched selection of a control (`select_mass_matched`): a different key set per row,
chosen on the reference attention by the seeded first-fit rule, in a compiled loop (numba) or a
vectorized numpy path (`TESTBED_FAST=0`, or where numba is missing), tested equal bit for bit."""

from __future__ import annotations

import os

import numpy as np
import torch

try:  # numba is a declared dependency; the numpy path serves where a platform lacks a wheel
    import numba
except ImportError:  # pragma: no cover - exercised only where numba is missing
    numba = None

from .ablations import MASS_TOLERANCE

__all__ = ["select_mass_matched"]

def select_mass_matched(p: torch.Tensor, target: torch.Tensor, orders: list[list[int]], vis: torch.Tensor | None,
                        tol: float = MASS_TOLERANCE):
    """Seeded first-fit selection of a mass-matched control, every row at once.

    ``p [..., c, Tk]``: the rows' reference attention probabilities (float64); ``target [Tk]``
    bool: the target region; ``orders``: the seeded orders of the eligible keys
    (`MassControl.orders`, all of one length); ``vis [c, Tk]`` or None: the causal mask. Per row,
    ``tau`` is its mass on the target, ``lo = (1 - tol) tau``, ``hi = (1 + tol) tau``. One attempt
    with an order: ``acc = 0``, no key taken; for each key ``t`` of the order, a key the row cannot
    see is skipped, else it is taken iff ``acc + P_t <= hi`` (then ``acc += P_t``), and the attempt
    stops, *reached*, once ``acc >= lo``. A row keeps the keys of the first attempt (in the order
    of ``orders``) that reached; a row none reached, or with ``tau`` 0 or NaN, is *unmatched* and
    drops nothing.

    The attempts of a row are independent, and so are the rows: a compiled loop (numba, one row
    and one attempt at a time, stopping at the first attempt that reaches) runs the rule as
    written, in the same float64 additions and comparisons as the vectorized numpy path
    (`_select_numpy`: one loop over order positions on ``[attempts, rows]``), which serves where
    numba is missing or ``TESTBED_FAST=0``; the tests hold the two equal bit for bit. Rows whose
    whole eligible visible mass is below ``lo`` cannot match and are left out from the start (a
    shortcut only, with a 1e-9 relative margin so that it never changes an outcome).

    Returns torch ``(selected [..., c, Tk] bool, False on unmatched rows; tau; acc, the selected
    keys' mass, 0 on unmatched rows; matched bool)``.
    """
    if not 0.0 <= tol < 1.0:  # lo = (1 - tol) tau must stay positive: a row that took nothing is no match
        raise ValueError(f"mass tolerance must lie in [0, 1), got {tol!r}")
    shape, tk = p.shape[:-1], p.shape[-1]
    pn = np.ascontiguousarray(p.detach().to(torch.float64).reshape(-1, tk).numpy())
    rows = pn.shape[0]
    order = np.ascontiguousarray(np.asarray(orders, dtype=np.int64).reshape(len(orders), -1))     # [A, E]
    tau = pn[:, target.numpy()].sum(axis=1)
    hi = tau * (1.0 + tol)
    lo = tau * (1.0 - tol)
    with np.errstate(invalid="ignore"):
        hopeless = ~(tau > 0) | (pn[:, order[0]].sum(axis=1) < lo * (1.0 - 1e-9))
    if _select_rows is not None and os.environ.get("TESTBED_FAST", "1") != "0":
        c = shape[-1] if len(shape) else 1
        visn = (np.ones((1, tk), dtype=bool) if vis is None
                else np.ascontiguousarray(vis.expand(c, tk).numpy()))
        sel = np.zeros((rows, tk), dtype=bool)
        achieved = np.zeros(rows)
        matched = np.zeros(rows, dtype=bool)
        _select_rows(pn, visn, 0 if vis is None else c, order, lo, hi, hopeless, sel, achieved, matched)
    else:
        visn = (np.ones((rows, tk), dtype=bool) if vis is None
                else vis.expand(*shape, tk).reshape(-1, tk).numpy())
        sel, achieved, matched = _select_numpy(pn, visn, order, lo, hi, hopeless)
    return (torch.from_numpy(sel).reshape(*shape, tk), torch.from_numpy(tau).reshape(shape),
            torch.from_numpy(achieved).reshape(shape), torch.from_numpy(matched).reshape(shape))


def _select_numpy(pn, visn, order, lo, hi, hopeless):
    """The selection of `select_mass_matched` vectorized over ``[attempts, rows]`` (``pn``, ``visn``
    ``[rows, Tk]``): ``(sel [rows, Tk], achieved [rows], matched [rows])``."""
    rows, tk = pn.shape
    attempts, e = order.shape
    acc = np.zeros((attempts, rows))
    done = np.broadcast_to(hopeless, (attempts, rows)).copy()
    took = np.zeros((attempts, rows, e), dtype=bool)
    with np.errstate(invalid="ignore"):
        for i in range(e):
            if done.all():
                break
            keys_i = order[:, i]
            nxt = acc + pn[:, keys_i].T
            take = ~done & (nxt <= hi) & visn[:, keys_i].T
            acc = np.where(take, nxt, acc)
            took[:, :, i] = take
            done |= take & (acc >= lo)
        hit = (acc >= lo) & ~hopeless
    matched = hit.any(axis=0)
    first = np.argmax(hit, axis=0)
    ar = np.arange(rows)
    sel = np.zeros((rows, tk), dtype=bool)
    sel[ar[:, None], order[first]] = took[first, ar] & matched[:, None]
    achieved = np.where(matched, acc[first, ar], 0.0)
    return sel, achieved, matched


def _select_rows_py(pn, visn, c, order, lo, hi, hopeless, sel, achieved, matched):  # pragma: no cover - compiled
    """The rule of `select_mass_matched`, one row and one attempt at a time (compiled by numba):
    fills ``sel [rows, Tk]``, ``achieved`` and ``matched`` (zero-initialized) in place. Row ``r``
    reads the visibility row ``r % c`` of ``visn`` (row 0 when ``c`` is 0: no causal mask)."""
    rows = pn.shape[0]
    attempts, e = order.shape
    taken = np.empty(e, dtype=np.int64)
    for r in range(rows):
        if hopeless[r]:
            continue
        vr = r % c if c > 0 else 0
        for a in range(attempts):
            acc = 0.0
            n = 0
            reached = False
            for i in range(e):
                t = order[a, i]
                if not visn[vr, t]:
                    continue
                nxt = acc + pn[r, t]
                if nxt <= hi[r]:
                    acc = nxt
                    taken[n] = t
                    n += 1
                    if acc >= lo[r]:
                        reached = True
                        break
            if reached:
                for m in range(n):
                    sel[r, taken[m]] = True
                achieved[r] = acc
                matched[r] = True
                break


_select_rows = None if numba is None else numba.njit(cache=True)(_select_rows_py)
