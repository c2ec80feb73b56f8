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

from testbed import ablation as ac
from testbed.ablation import arm, mass_select, rows
from testbed.ablation import select_mass_matched
from tests.test_mass_control import rule_row  # the documented rule as a plain per-row loop

PATHS = ["numpy"] + (["numba"] if mass_select._select_rows is not None else [])


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


@pytest.mark.skipif(mass_select._select_rows is None, reason="numba is not installed")
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


# -- the per-row masked softmax, computed in reused scratch ------------------------------------------

def plain_drop_rows(s, vis, p, drop, vj):
    """The masked renormalized softmax of a per-row drop mask, written out of place."""
    visible = torch.ones_like(drop) if vis is None else vis.unsqueeze(0).expand_as(drop)
    allowed = visible & ~drop
    ok = allowed.any(dim=-1)
    sa = s.masked_fill(~allowed, float("-inf"))
    mx = torch.where(ok, sa.amax(dim=-1), torch.zeros(ok.shape, dtype=s.dtype))
    ea = torch.exp(sa - mx.unsqueeze(-1))
    za = ea.sum(dim=-1)
    pa = ea / torch.where(ok, za, torch.ones_like(za)).unsqueeze(-1)
    out = torch.matmul(pa, vj)
    tau = p.masked_fill(~drop, 0.0).sum(dim=-1)
    tv = 0.5 * (p - pa).abs().sum(dim=-1)
    dv = visible & drop
    has = dv.any(dim=-1)
    sd = s.masked_fill(~dv, float("-inf"))
    md = torch.where(has, sd.amax(dim=-1), torch.zeros(has.shape, dtype=s.dtype))
    ed = torch.exp(sd - md.unsqueeze(-1))
    zd = ed.sum(dim=-1)
    mu_d = torch.matmul(ed, vj) / torch.where(has, zd, torch.ones_like(zd)).unsqueeze(-1)
    return out, ok, tau, tv, mu_d, has


def scores_tile(seed, causal, share, inside=None):
    """A random tile (3 heads x 17 queries x 203 keys, D 16) for `drop_rows`: ``(s, vis, drop, vj,
    p)``, ``drop`` each key with probability ``share`` (only keys ``inside``, when given), row
    ``[1, 1]`` dropping nothing (no dropped mean)."""
    g = torch.Generator().manual_seed(seed)
    heads, c, tk, d = 3, 17, 203, 16
    s = 3.0 * torch.randn(heads, c, tk, generator=g, dtype=torch.float64)
    vis = (torch.arange(tk)[None, :] <= torch.arange(tk - c, tk)[:, None]) if causal else None
    drop = torch.rand(heads, c, tk, generator=g) < share
    if inside is not None:
        drop &= inside
    drop[1, 1] = False
    vj = torch.randn(tk, d, generator=g, dtype=torch.float64)
    p = torch.softmax(s if vis is None else s.masked_fill(~vis, float("-inf")), dim=-1)
    return s, vis, drop, vj, p


@pytest.mark.parametrize("causal", [True, False])
def test_drop_rows_in_scratch_equals_the_plain_masked_softmax_bit_for_bit(causal):
    s, vis, drop, vj, p = scores_tile(3, causal, 0.3)
    drop[0, 0] = True                 # every key dropped: an undefined row
    want = plain_drop_rows(s, vis, p, drop, vj)
    # scratch larger than the tile and full of garbage, as a smaller last tile finds it
    work = torch.full((s.numel() + 99,), 7.0, dtype=torch.float64)
    work2 = torch.full((s.numel() + 5,), -3.0, dtype=torch.float64)
    for w, w2 in ((None, None), (work, work2)):
        got = rows.drop_rows(s, vis, p, drop, vj, w, w2)
        assert not got[1][0, 0] and not got[5][1, 1]
        for x, y in zip(got, want):
            assert x.shape == y.shape and x.dtype == y.dtype
            assert np.array_equal(x.numpy(), y.numpy(), equal_nan=True)
        out, ok = rows.drop_rows(s, vis, p, drop, vj, w, outputs_only=True)
        assert torch.equal(out, want[0]) and torch.equal(ok, want[1])


def _close(x, y):
    """Equal to float64 rounding: the same terms summed in another order (relative 1e-12 of the row)."""
    assert x.shape == y.shape and x.dtype == y.dtype
    assert torch.equal(torch.isnan(x), torch.isnan(y))
    scale = y.nan_to_num(0.0).abs().amax(dim=-1, keepdim=True).clamp_min(1e-300)
    assert bool((((x - y).nan_to_num(0.0)).abs() <= 1e-12 * scale).all())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("runs", [[(40, 120)], [(0, 30), (150, 203)]])
def test_dropped_mean_over_the_runs_that_hold_every_dropped_key_is_the_same_mean(causal, runs):
    """``within``: the dropped keys' mean summed over the runs holding them only (the others weigh
    exactly 0) equals the mean over every key to rounding; the other outputs do not change at all;
    a dropped key outside the runs is refused."""
    inside = torch.zeros(203, dtype=torch.bool)
    for a, b in runs:
        inside[a:b] = True
    s, vis, drop, vj, p = scores_tile(11, causal, 0.4, inside)
    want = plain_drop_rows(s, vis, p, drop, vj)
    work = torch.full((s.numel() + 9,), 7.0, dtype=torch.float64)
    work2 = torch.full((s.numel() + 9,), -3.0, dtype=torch.float64)
    got = rows.drop_rows(s, vis, p, drop, vj, work, work2, within=runs)
    for i in (0, 1, 2, 3, 5):
        assert np.array_equal(got[i].numpy(), want[i].numpy(), equal_nan=True)
    assert not got[5][1, 1]
    _close(got[4], want[4])
    assert got[4].abs().sum() > 0
    outside = drop.clone()
    outside[0, 0, 0 if runs[0][0] > 0 else 35] = True
    with pytest.raises(ValueError, match="outside"):
        rows.drop_rows(s, vis, p, outside, vj, work, work2, within=runs)


def test_spans_of_sorted_keys():
    assert rows.spans_of(np.array([], dtype=np.int64)) == []
    assert rows.spans_of(np.array([3])) == [(3, 4)]
    assert rows.spans_of(np.array([0, 1, 2, 7, 8, 10])) == [(0, 3), (7, 9), (10, 11)]


# -- the selections shared by a Case's arms ---------------------------------------------------------

def video_like_case(seed, heads=4, kv_heads=2):
    from testbed.case import Case, Region
    g = torch.Generator().manual_seed(seed)
    sizes = (12, 40, 30, 33)
    bounds = np.cumsum((0,) + sizes).tolist()
    layout = tuple(Region(n, a, b) for n, a, b in zip(("sink", "middle", "recent", "current"), bounds[:-1], bounds[1:]))
    tk = bounds[-1]
    pos = torch.arange(bounds[3], tk)
    return Case(id=f"fast{seed}", q=3.0 * torch.randn(heads, len(pos), 16, generator=g),
                k=torch.randn(kv_heads, tk, 16, generator=g), v=torch.randn(kv_heads, tk, 16, generator=g),
                query_positions=pos, causal=True, layout=layout)


def controls_of(case):
    out = {}
    for name in ("mass_control_sink", "mass_control_recent"):
        abl = ac.make_ablation(name, 0)
        out[name] = (abl.target_spans(case), abl.orders(case))
    return out


def same_result(a, b):
    import dataclasses
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.shape == y.shape and x.dtype == y.dtype, f.name
            assert np.array_equal(x.numpy(), y.numpy(), equal_nan=x.is_floating_point()), f.name
        else:
            assert x == y, f.name


@pytest.mark.slow
def test_arms_sharing_selections_give_what_each_arm_gives_alone(monkeypatch):
    case = video_like_case(5)
    ctrl = controls_of(case)
    arms = [(None, None), ((case.k * 4).round() / 4, (case.v * 4).round() / 4), ((case.k * 2).round() / 2, case.v)]
    alone, ref = [], None
    for k, v in arms:
        alone.append(ac.mass_control_case(case, ctrl, k, v, ref=ref, max_scores=1500))
        ref = alone[0].output
    shared, ref = ac.MassSelections(case.k), None
    for n, (k, v) in enumerate(arms):
        if n == 1:
            # a later arm reads the first arm's selections: it selects nothing itself
            def refuse(*args, **kw):
                raise AssertionError("a later arm selected again")
            monkeypatch.setattr(arm, "select_mass_matched", refuse)
        got = ac.mass_control_case(case, ctrl, k, v, ref=ref, max_scores=1500, selections=shared)
        ref = got.output if n == 0 else ref
        same_result(got, alone[n])
        assert got.matched.any() and not got.matched.all()


@pytest.mark.slow
def test_selections_of_another_reference_are_not_read():
    case, other = video_like_case(5), video_like_case(6)
    ctrl = controls_of(case)
    shared = ac.MassSelections(case.k)
    ac.mass_control_case(case, ctrl, max_scores=1500, selections=shared)
    assert shared.complete
    # another Case of the same shapes (another reference K): its own selections, not the stored ones
    same_result(ac.mass_control_case(other, ctrl, max_scores=1500, selections=shared),
                ac.mass_control_case(other, ctrl, max_scores=1500))
    # the same reference with another tile size: the tiles differ, so it selects again
    same_result(ac.mass_control_case(case, ctrl, max_scores=900, selections=shared),
                ac.mass_control_case(case, ctrl, max_scores=900))


def test_a_tolerance_outside_zero_to_one_is_refused():
    """At tol >= 1 the band's floor is at or below 0, where a row that took no key would count as
    matched: the selection refuses such a tolerance rather than let its two paths disagree."""
    p = torch.full((1, 4), 0.25, dtype=torch.float64)
    target = torch.tensor([True, False, False, False])
    for tol in (1.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="mass tolerance"):
            select_mass_matched(p, target, [[1, 2, 3]], None, tol)


# -- one pass per arm: edge cases of the shared atoms ------------------------------------------------

def test_a_nan_key_outside_the_target_reaches_the_targets_own_sums():
    """A NaN score on a kept key of the target's own ablation makes its rows NaN, and they stay in
    ``target_err2`` (a row is left out only where no visible key lies outside the target), so the
    heads that see the NaN key report NaN, the others a number."""
    case = video_like_case(7)
    ctrl = {"mass_control_sink": controls_of(case)["mass_control_sink"]}
    k = case.k.clone()
    k[0, 100, 0] = float("nan")          # a current-chunk key, outside the sink: KV head 0 only
    _, mres = ac.ablate_arm_case(case, {}, ctrl, k, case.v)
    t = mres.target_err2[0]
    assert torch.isnan(t[:2]).all()      # query heads 0-1 share KV head 0
    assert torch.isfinite(t[2:]).all() and bool((t[2:] > 0).all())


def test_a_control_without_eligible_keys_matches_no_row():
    """A mass-matched control whose order holds no key (a direct caller's) drops nothing: every row
    is unmatched and undefined nowhere, instead of failing on an empty run of keys."""
    case = video_like_case(8)
    sink = case.region("sink")
    res = ac.mass_control_case(case, {"mass_control_sink": ([(sink.start, sink.stop)], [[]])})
    assert not bool(res.matched.any()) and int(res.undefined.sum()) == 0
    assert torch.isnan(res.dropped_mass).all()
