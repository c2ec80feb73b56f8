"""The ablation's fast paths (issue #35, the seed-scale time target) against their definitions.

The mass-matched selection has two implementations, a compiled per-row loop (numba) and a numpy
loop vectorized over attempts and rows; both must give, bit for bit, what the rule in
`select_mass_matched`'s docstring gives when it is written again here as a plain Python loop over
one row at a time, on random rows with ties, hidden keys, rows whose target mass is 0 or NaN, and
rows that match only on a later attempt or not at all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from testbed import ablation_core as ac
from testbed.ablation_core import MASS_TOLERANCE, select_mass_matched

PATHS = ["numpy"] + (["numba"] if ac._select_rows is not None else [])


def rule_row(p_row, vis_row, target_keys, orders, tol=MASS_TOLERANCE):
    """The documented rule for one row: (attempt, keys taken in order, acc) or None (unmatched).

    ``tau`` is the row's target mass (numpy's sum of the target's values, the definition's sum);
    the accumulation is the rule's own: start at 0.0, add each taken key's mass in order."""
    tau = float(np.sum(np.asarray([p_row[t] for t in target_keys], dtype=np.float64)))
    if not tau > 0:
        return None
    lo, hi = tau * (1.0 - tol), tau * (1.0 + tol)
    for a, order in enumerate(orders):
        acc, taken = 0.0, []
        for t in order:
            if not vis_row[t]:
                continue
            if acc + p_row[t] <= hi:
                acc += p_row[t]
                taken.append(t)
                if acc >= lo:
                    return a, taken, acc
    return None


def random_tile(rng, kind):
    """``(p [g, c, Tk] float64, vis [c, Tk] or None, target [Tk] bool, orders)``."""
    g, c, tk = int(rng.integers(1, 4)), int(rng.integers(1, 12)), int(rng.integers(6, 48))
    a = int(rng.integers(0, tk - 2))
    b = int(rng.integers(a + 1, tk - 1))
    target = torch.zeros(tk, dtype=torch.bool)
    target[a:b] = True
    eligible = [t for t in range(tk) if not target[t]]
    orders = [[int(x) for x in rng.permutation(eligible)] for _ in range(int(rng.integers(1, 6)))]
    logits = rng.normal(size=(g, c, tk)) * rng.uniform(0.2, 6.0)
    if kind == "ties":
        logits = np.round(logits)          # many keys of exactly equal mass
    elif kind == "uniform":
        logits = np.zeros((g, c, tk))      # every key the same mass: a count of keys matches or none does
    elif kind == "peaked":
        logits[..., a] += 12.0             # the target holds nearly all mass: most rows cannot match
    vis = None
    if kind != "uniform" and rng.random() < 0.7:
        vis = torch.from_numpy(rng.random((c, tk)) < 0.75)
        vis[:, int(rng.integers(0, tk))] = True
    s = torch.from_numpy(logits)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
        if c > 1:
            s[0, 0] = float("-inf")        # a row that sees nothing: NaN probabilities, tau NaN
    p = torch.softmax(s, dim=-1)
    if kind == "ties" and c > 1:
        p[-1, -1, target] = 0.0            # a row whose target mass is exactly 0
    return p, vis, target, orders


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["normal", "ties", "uniform", "peaked"])
def test_selection_equals_the_documented_rule_row_by_row(path, kind, monkeypatch):
    monkeypatch.setenv("TESTBED_FAST", "1" if path == "numba" else "0")
    rng = np.random.default_rng({"normal": 1, "ties": 2, "uniform": 3, "peaked": 4}[kind])
    seen = {"matched": 0, "unmatched": 0, "later": 0}
    for _ in range(40):
        p, vis, target, orders = random_tile(rng, kind)
        sel, tau, acc, matched = select_mass_matched(p, target, orders, vis)
        g, c, tk = p.shape
        assert sel.shape == (g, c, tk) and tau.shape == acc.shape == matched.shape == (g, c)
        tkeys = torch.nonzero(target).flatten().tolist()
        for h in range(g):
            for i in range(c):
                row = p[h, i].tolist()
                vrow = [True] * tk if vis is None else vis[i].tolist()
                want = rule_row(row, vrow, tkeys, orders)
                if want is None:
                    seen["unmatched"] += 1
                    assert not matched[h, i] and not sel[h, i].any() and acc[h, i].item() == 0.0
                    continue
                attempt, taken, mass = want
                seen["matched"] += 1
                seen["later"] += attempt > 0
                assert matched[h, i]
                assert sorted(torch.nonzero(sel[h, i]).flatten().tolist()) == sorted(taken)
                assert acc[h, i].item() == mass   # the same additions in the same order: exactly equal
        # tau is the row's target mass whatever the match (NaN where the row sees nothing)
        want_tau = p[..., target].sum(-1)
        assert torch.equal(torch.isnan(tau), torch.isnan(want_tau))
        ok = ~torch.isnan(want_tau)
        torch.testing.assert_close(tau[ok], want_tau[ok], rtol=1e-15, atol=0)
    assert seen["matched"] > 0 and seen["unmatched"] > 0
    if kind in ("normal", "ties"):
        assert seen["later"] > 0   # some rows match only on a later attempt


@pytest.mark.skipif(ac._select_rows is None, reason="numba is not installed")
def test_compiled_and_vectorized_selection_agree_bit_for_bit(monkeypatch):
    rng = np.random.default_rng(7)
    for t in range(60):
        p, vis, target, orders = random_tile(rng, ("normal", "ties", "uniform", "peaked")[t % 4])
        monkeypatch.setenv("TESTBED_FAST", "1")
        fast = select_mass_matched(p, target, orders, vis)
        monkeypatch.setenv("TESTBED_FAST", "0")
        slow = select_mass_matched(p, target, orders, vis)
        for x, y in zip(fast, slow):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert np.array_equal(x.numpy(), y.numpy(), equal_nan=x.dtype == torch.float64)
