"""Mass-matched ablation controls (issue #14 item 1b): selection rule, band, disjointness, metrics, audit.

The expectations here are computed in the test: the selection rule is re-run as a plain Python
loop over one row at a time (the documented rule, written again), the band is checked with masses
from the test's own softmax, existence is decided by brute force over every subset, and the damage
numbers come from a direct masked softmax with the row's own mask. None of it is taken from the
harness's per-row path.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.ablation import (ABLATION_NAMES, MASS_ATTEMPTS, MASS_TOLERANCE, MassControl, make_ablation,
                              mass_control_case, mass_control_order, select_mass_matched)
from testbed.case import Case, Region
from tests._helpers import REPO, forge_results

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = ("mass_control_sink", "mass_control_middle", "mass_control_recent")


def layout_case(seed, sizes=(3, 9, 5, 7), heads=4, kv_heads=2, d=8, causal=True, scale=2.0, queries=None, q=None):
    """sink | middle | recent | current; queries are the current tokens (or ``queries``)."""
    g = torch.Generator().manual_seed(seed)
    tk = sum(sizes)
    bounds = np.cumsum((0,) + tuple(sizes)).tolist()
    layout = tuple(Region(n, a, b) for n, a, b in zip(("sink", "middle", "recent", "current"), bounds[:-1], bounds[1:]))
    pos = torch.arange(bounds[3], tk) if queries is None else torch.tensor(queries)
    qq = scale * torch.randn(heads, len(pos), d, generator=g) if q is None else q
    k = torch.randn(kv_heads, tk, d, generator=g)
    v = torch.randn(kv_heads, tk, d, generator=g)
    return Case(id=f"mass{seed}", q=qq, k=k, v=v, query_positions=pos.to(torch.int64), causal=causal, layout=layout)


def reference_p(case):
    """Test-side float64 softmax of the case's own K, ``[H, Tq, Tk]``, and the visibility ``[Tq, Tk]``."""
    heads, tq, d = case.q.shape
    k = case.k.double().repeat_interleave(heads // case.kv_heads, 0)
    s = case.q.double() @ k.transpose(1, 2) / math.sqrt(d)
    tk = case.keys
    vis = (torch.arange(tk)[None, :] <= case.query_positions[:, None]) if case.causal else torch.ones(tq, tk, dtype=torch.bool)
    return torch.softmax(s.masked_fill(~vis, -math.inf), -1), vis


def explicit_order(case, target, seed, attempt):
    """The documented order, written again: history keys outside the target, each drawing
    random() in ascending key order, sorted by the draw."""
    r = case.region(target)
    hist = case.region("current").start if case.region("current") is not None else case.keys
    eligible = [t for t in range(hist) if not r.start <= t < r.stop]
    rng = random.Random(f"mass_control:{seed}:{case.id}:{target}:{attempt}")
    draws = {t: rng.random() for t in eligible}
    return sorted(eligible, key=lambda t: (draws[t], t))


def rule_row(p_row, vis_row, target_keys, orders, tol=MASS_TOLERANCE):
    """The documented rule for one row, as a plain loop: (attempt, keys taken in order, acc) or
    None (unmatched). ``tau`` is the row's target mass (numpy's sum of the target's values, the
    definition's sum); the accumulation is the rule's own: start at 0.0, add each taken key's
    mass in order."""
    tau = float(np.sum(np.asarray([p_row[t] for t in target_keys], dtype=np.float64)))
    if not tau > 0:
        return None
    lo, hi = (1.0 - tol) * tau, (1.0 + tol) * tau
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


def explicit_row(p_row, vis_row, target_keys, orders, tol=MASS_TOLERANCE):
    """:func:`rule_row` as (set of keys, mass) or None (unmatched)."""
    got = rule_row(p_row, vis_row, target_keys, orders, tol)
    return None if got is None else (set(got[1]), got[2])


def run_selection(case, name, seed=0):
    abl = make_ablation(name, seed)
    r = case.region(abl.target)
    target = [(r.start, r.stop)]
    orders = abl.orders(case)
    res = mass_control_case(case, {name: (target, orders)})
    return res, orders, r


# -- the order ------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_orders_are_the_documented_seeded_draws(seed):
    case = layout_case(seed)
    for target in ("sink", "middle", "recent"):
        orders = MassControl(target, seed).orders(case)
        assert len(orders) == MASS_ATTEMPTS
        for a, order in enumerate(orders):
            assert order == explicit_order(case, target, seed, a)
            assert mass_control_order(case, target, seed, a) == order
        assert len({tuple(o) for o in orders}) > 1  # the attempts really are different orders


def test_not_applicable_without_eligible_keys():
    case = layout_case(0, sizes=(4, 0, 0, 6))  # the sink is the whole history: nothing outside it
    assert MassControl("sink").orders(case) is None
    assert MassControl("middle").orders(case) is None  # empty region
    assert MassControl("nowhere").orders(case) is None
    with pytest.raises(TypeError, match="per row"):
        MassControl("sink").dropped(case)
    assert {"mass_control_sink", "mass_control_recent"} <= set(ABLATION_NAMES)


# -- the selection: disjoint, in the band, the documented rule ---------------------------------

@SETTINGS
@given(seed=st.integers(0, 10_000), causal=st.booleans(), scale=st.floats(0.1, 6.0),
       sizes=st.sampled_from([(3, 9, 5, 7), (4, 2, 6, 5), (2, 20, 3, 4), (6, 1, 2, 3), (1, 12, 1, 6)]))
def test_selection_is_disjoint_from_the_target_in_the_band_and_the_documented_rule(seed, causal, scale, sizes):
    queries = None if causal else [0, sum(sizes[:3]) - 1, sum(sizes) - 1]
    case = layout_case(seed, sizes=sizes, causal=causal, scale=scale, queries=queries)
    p, vis = reference_p(case)
    hist = case.region("current").start
    for name in NAMES:
        abl = make_ablation(name, seed)
        r = case.region(abl.target)
        orders = abl.orders(case)
        if orders is None:
            continue
        tmask = torch.zeros(case.keys, dtype=torch.bool)
        tmask[r.start:r.stop] = True
        sel, tau, acc, matched = select_mass_matched(p, tmask, orders, vis)
        # never a key of the target, never outside the history, never a key the row cannot see
        assert not sel[..., r.start:r.stop].any()
        assert not sel[..., hist:].any()
        assert not (sel & ~vis).any()
        # unmatched rows drop nothing; matched rows are within 1 % of tau, masses from the test's softmax
        assert not sel[~matched].any()
        got = (p * sel).sum(-1)
        torch.testing.assert_close(tau, p[..., r.start:r.stop].sum(-1), rtol=1e-12, atol=1e-15)
        rel = ((got - tau).abs() / tau)[matched]
        assert (rel <= MASS_TOLERANCE * (1 + 1e-9)).all()
        torch.testing.assert_close(acc[matched], got[matched], rtol=1e-12, atol=1e-15)
        # row by row: the documented rule written as a plain loop chooses exactly these keys
        for hh in range(p.shape[0]):
            for i in range(p.shape[1]):
                want = explicit_row(p[hh, i].tolist(), vis[i].tolist(), range(r.start, r.stop), orders)
                if want is None:
                    assert not matched[hh, i]
                else:
                    assert matched[hh, i]
                    assert set(torch.nonzero(sel[hh, i]).flatten().tolist()) == want[0]


@pytest.mark.parametrize("seed", range(8))
def test_brute_force_no_subset_in_the_band_means_unmatched(seed):
    """With 7 eligible keys, every subset is tried: where none lands in [0.99 tau, 1.01 tau] the row
    must be unmatched; where the selection matched, its subset is one of those that land."""
    case = layout_case(seed, sizes=(3, 4, 3, 5), scale=1.0)
    p, vis = reference_p(case)
    seen_unmatched = seen_matched = 0
    for name in ("mass_control_sink", "mass_control_recent"):
        abl = make_ablation(name, seed)
        r = case.region(abl.target)
        orders = abl.orders(case)
        tmask = torch.zeros(case.keys, dtype=torch.bool)
        tmask[r.start:r.stop] = True
        sel, tau, _, matched = select_mass_matched(p, tmask, orders, vis)
        eligible = orders[0]
        for hh in range(p.shape[0]):
            for i in range(p.shape[1]):
                t = float(tau[hh, i])
                row = p[hh, i].tolist()
                landing = [set(c) for n in range(1, len(eligible) + 1) for c in itertools.combinations(eligible, n)
                           if 0.99 * t <= sum(row[j] for j in c) <= 1.01 * t]
                if not landing:
                    assert not matched[hh, i]
                    seen_unmatched += 1
                if matched[hh, i]:
                    assert set(torch.nonzero(sel[hh, i]).flatten().tolist()) in landing
                    seen_matched += 1
    assert seen_matched > 0 and seen_unmatched > 0  # both branches are exercised


def test_hand_built_rows_select_the_expected_keys():
    """Masses chosen by hand, orders given: the expected keys worked out on paper.

    Target key 0 (tau 0.30, band [0.297, 0.303]); eligible keys 1..5 with masses 0.25, 0.10,
    0.20, 0.05, 0.10 (key 6 holds the rest and is not eligible). Order [3, 1, 4, 2, 5]: takes 3
    (0.20), skips 1 (0.45 > 0.303), takes 4 (0.25), skips 2 and 5 (0.35): 0.25 never reaches the
    band, the attempt fails. Order [1, 4, 3, 2, 5]: takes 1 (0.25), takes 4 (0.30): in the band,
    stop. The row drops {1, 4}. A second row with tau 0 (no mass on the target) is unmatched; a
    third, with 0.9 on the target and 0.1 outside, is unmatched (nothing outside can reach 0.891).
    """
    p = torch.tensor([[[0.30, 0.25, 0.10, 0.20, 0.05, 0.10, 0.00],
                       [0.00, 0.25, 0.10, 0.20, 0.05, 0.10, 0.30],
                       [0.90, 0.02, 0.02, 0.02, 0.02, 0.02, 0.00]]], dtype=torch.float64)
    target = torch.tensor([True] + [False] * 6)
    orders = [[3, 1, 4, 2, 5], [1, 4, 3, 2, 5], [2, 5, 1, 3, 4]]
    sel, tau, acc, matched = select_mass_matched(p, target, orders, None)
    assert matched.tolist() == [[True, False, False]]
    assert torch.nonzero(sel[0, 0]).flatten().tolist() == [1, 4]
    assert not sel[0, 1:].any()
    assert float(acc[0, 0]) == pytest.approx(0.30, abs=1e-15)
    # only the first order's failure made the second one count: with the second order alone, the same
    sel2, *_ = select_mass_matched(p, target, orders[1:], None)
    assert torch.equal(sel2[0, 0], sel[0, 0])
    # a row that cannot see key 1 (causal): [1, 4, 3, ...] takes 4, 3 (0.25), then 2 (0.35 > hi), 5: no
    vis = torch.tensor([[True, False, True, True, True, True, True]] * 3)
    _, _, _, m3 = select_mass_matched(p, target, orders[1:2], vis)
    assert not m3[0, 0]


def test_uniform_attention_drops_exactly_as_many_keys_as_the_target_first_in_order():
    """q = 0: every visible key holds 1/Tk; the target's tau is its size / Tk and first-fit takes
    exactly that many keys, the first ones of the seeded order, on every row (non-causal)."""
    sizes = (3, 9, 5, 7)
    base = layout_case(2, sizes=sizes, causal=False, queries=[20, 21, 22, 23])
    case = Case(id=base.id, q=torch.zeros_like(base.q), k=base.k, v=base.v, query_positions=base.query_positions,
                causal=False, layout=base.layout)
    for name, size in (("mass_control_sink", 3), ("mass_control_recent", 5)):
        res, orders, r = run_selection(case, name)
        i = res.index(name)
        assert res.matched[i].all()
        assert (res.keys[i] == size).all()
        torch.testing.assert_close(res.dropped_mass[i], torch.full_like(res.dropped_mass[i], size / case.keys))
        p, vis = reference_p(case)
        tmask = torch.zeros(case.keys, dtype=torch.bool)
        tmask[r.start:r.stop] = True
        sel, *_ = select_mass_matched(p, tmask, orders, vis)
        want = sorted(orders[0][:size])
        for hh in range(case.heads):
            for qi in range(4):
                assert torch.nonzero(sel[hh, qi]).flatten().tolist() == want


# -- the damage numbers against a direct masked softmax ------------------------------------------

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("quantized", [False, True])
def test_mass_control_metrics_match_a_direct_masked_softmax(seed, quantized):
    case = layout_case(seed, sizes=(3, 12, 5, 7), scale=1.5)
    p_ref, vis = reference_p(case)
    heads, tq, d = case.q.shape
    group = heads // case.kv_heads
    k, v = case.k, case.v
    ref = None
    if quantized:  # a perturbed arm: the selection must still read the case's own K
        g = torch.Generator().manual_seed(100 + seed)
        k = case.k + 0.05 * torch.randn(case.k.shape, generator=g)
        v = case.v + 0.05 * torch.randn(case.v.shape, generator=g)
        ref = (p_ref @ case.v.double().repeat_interleave(group, 0))
    kk = k.double().repeat_interleave(group, 0)
    vv = v.double().repeat_interleave(group, 0)
    s = (case.q.double() @ kk.transpose(1, 2) / math.sqrt(d)).masked_fill(~vis, -math.inf)
    p = torch.softmax(s, -1)
    o = p @ vv
    o_ref = o if ref is None else ref
    for name in ("mass_control_sink", "mass_control_recent"):
        abl = make_ablation(name, seed)
        r = case.region(abl.target)
        orders = abl.orders(case)
        res = mass_control_case(case, {name: ([(r.start, r.stop)], orders)}, k if quantized else None,
                                v if quantized else None, ref=ref)
        i = res.index(name)
        tmask = torch.zeros(case.keys, dtype=torch.bool)
        tmask[r.start:r.stop] = True
        sel, tau, _, matched = select_mass_matched(p_ref, tmask, orders, vis)
        assert torch.equal(res.matched[i], matched)
        assert matched.any()
        p2 = torch.softmax(s.masked_fill(sel, -math.inf), -1)
        o2 = p2 @ vv
        m = matched
        expect = float(torch.linalg.vector_norm(o2[m] - o_ref[m]) / torch.linalg.vector_norm(o_ref[m]))
        assert res.rel_l2(name) == pytest.approx(expect, rel=1e-9)
        own_tau = (p * sel).sum(-1)
        torch.testing.assert_close(res.dropped_mass[i][m], own_tau[m], rtol=1e-9, atol=1e-12)
        assert torch.isnan(res.dropped_mass[i][~m]).all()
        # TV(P, P') = tau holds for a per-row drop as for a block
        torch.testing.assert_close(res.tv[i][m], (0.5 * (p - p2).abs().sum(-1))[m], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(res.tv[i][m], own_tau[m], rtol=1e-9, atol=1e-12)
        # the target's own ablation on the same rows
        pt = torch.softmax(s.masked_fill(tmask, -math.inf), -1)
        ot = pt @ vv
        expect_t = float(torch.linalg.vector_norm(ot[m] - o_ref[m]) / torch.linalg.vector_norm(o_ref[m]))
        assert res.target_rel_l2(name) == pytest.approx(expect_t, rel=1e-9)
        # the selection reads the case's own K on every arm: the same keys dropped as on float32
        if quantized:
            base = mass_control_case(case, {name: ([(r.start, r.stop)], orders)})
            assert torch.equal(base.keys[0], res.keys[i]) and torch.equal(base.matched[0], res.matched[i])


def test_chunked_mass_control_matches_one_tile():
    case = layout_case(5, sizes=(4, 16, 6, 9), heads=4, kv_heads=2)
    ctl = {n: ([(case.region(make_ablation(n).target).start, case.region(make_ablation(n).target).stop)],
               make_ablation(n).orders(case)) for n in ("mass_control_sink", "mass_control_recent")}
    big = mass_control_case(case, ctl, max_scores=1 << 30)
    small = mass_control_case(case, ctl, max_scores=1)
    assert torch.equal(big.matched, small.matched) and torch.equal(big.keys, small.keys)
    for attr in ("dropped_mass", "tv", "err2", "ref2", "dot", "out2", "mean_shift", "target_err2", "achieved"):
        torch.testing.assert_close(getattr(small, attr), getattr(big, attr), rtol=1e-10, atol=1e-12, equal_nan=True)


# -- the analysis rows and the audit ---------------------------------------------------------------

def test_completeness_defaults_list_the_run_side_defaults():
    from testbed.audit_checks.completeness import ANALYSIS_DEFAULTS
    from testbed.audit_checks import ablation_audit as audit_ablation

    assert ANALYSIS_DEFAULTS["ablation"]["ablations"] == list(ABLATION_NAMES)
    assert audit_ablation.MASS_TOLERANCE == MASS_TOLERANCE and audit_ablation.MASS_ATTEMPTS == MASS_ATTEMPTS


@pytest.fixture(scope="module")
def focus_run(tmp_path_factory):
    """protocols/ablation_focus.json as shipped (its mass-matched controls on), run once."""
    from testbed.run import main as run_main

    out = tmp_path_factory.mktemp("mass") / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(REPO / "protocols" / "ablation_focus.json")]) == 0
    return out


def _audit(run):
    from testbed.audit import audit

    ok, failures, _ = audit(run, check_sources=False)
    return ok, failures


def _mass_row(res, case="clean-s1-n128", arm="float32", name="mass_control_sink"):
    return next(i for i, r in enumerate(res["rows"]) if r["analysis"] == "ablation" and r["case"] == case
                and r["arm"] == arm and r["ablation"] == name)


@pytest.mark.slow
def test_untouched_focus_run_passes_and_its_mass_rows_say_what_they_matched(focus_run):
    ok, failures = _audit(focus_run)
    assert ok, failures[:5]
    rows = json.loads((focus_run / "results.json").read_text())["rows"]
    mass = [r for r in rows if r["ablation"].startswith("mass_control_")]
    assert mass and all(r["applicable"] and r["control_kind"] == "mass_matched" for r in mass)
    for r in mass:
        assert r["matched_rows"] + r["unmatched_rows"] == r["rows"]
        assert r["dropped_spans"] is None  # per-row key sets are re-derived, never stored
        if r["matched_rows"]:
            assert 0 <= r["mass_mismatch_mean"] <= r["mass_mismatch_max"] <= MASS_TOLERANCE
    # the early-focus sink holds more mass than everything outside it: no row can be matched
    early = [r for r in mass if r["distribution"] == "early_focus" and r["ablation"] == "mass_control_sink"]
    assert early and all(r["matched_rows"] == 0 and r["rel_l2"] is None for r in early)
    clean = [r for r in mass if r["distribution"] == "clean" and r["arm"] == "float32"]
    assert clean and all(r["matched_rows"] == r["rows"] for r in clean)
    report = (focus_run / "report.md").read_text()
    assert "mass-matched control" in report and "| drop_sink   |" in report


@pytest.mark.parametrize("field,edit,says", [
    ("rel_l2", lambda x: x * 1.01, "rel_l2"),
    ("matched_rows", lambda x: x - 1, "matched_rows"),
    ("mass_mismatch_mean", lambda x: x * 1.5, "mass_mismatch_mean"),
    ("mass_mismatch_max", lambda x: 0.02, "outside the documented 1 % band"),
    ("target_rel_l2_matched", lambda x: x * 0.99, "target_rel_l2_matched"),
])
@pytest.mark.slow
def test_a_forged_mass_matched_number_fails_naming_the_row(focus_run, tmp_path, field, edit, says):
    run = tmp_path / "run"
    shutil.copytree(focus_run, run)
    res = json.loads((run / "results.json").read_text())
    i = _mass_row(res, arm="int4" if field == "rel_l2" else "float32")
    row = res["rows"][i]
    row[field] = edit(row[field])
    forge_results(run, res)  # results.csv, report.md, report.html rewritten to agree, hashes recorded
    ok, failures = _audit(run)
    assert not ok
    label = (f"FAIL: results.json row {i} ablation_focus ablation clean-s1-n128 arm={row['arm']} "
             f"ablation=mass_control_sink: ")
    hit = [f for f in failures if f.startswith(label) and says in f]
    assert hit, failures[:5]


@pytest.mark.slow
def test_a_forged_selection_that_overlaps_the_target_fails(focus_run, tmp_path):
    """A forger who recomputes the row consistently from a selection that may use target keys
    (the mass-matched control redefined as 'any keys of that mass') is caught: the audit selects
    the keys itself, so every re-derived number disagrees."""
    from testbed.ablation import mass_control
    from testbed.sources.synthetic import make_case

    run = tmp_path / "run"
    shutil.copytree(focus_run, run)
    res = json.loads((run / "results.json").read_text())
    i = _mass_row(res, case="clean-s1-n128", name="mass_control_recent")
    case = make_case("clean", 1, 128, queries=8, heads=4, kv_heads=1)
    r = case.region("recent")
    # orders over *every* key but the recent window's last one: the target itself is eligible
    rng = random.Random(0)
    allk = [t for t in range(case.keys) if t != r.stop - 1]
    orders = [rng.sample(allk, len(allk)) for _ in range(MASS_ATTEMPTS)]
    forged = mass_control(case.q, case.k, case.v, case.query_positions, case.causal, case.layout,
                          {"x": ([(r.start, r.stop)], orders)})
    row = res["rows"][i]
    row["rel_l2"] = forged.rel_l2("x")
    row["matched_rows"] = int(forged.matched[0].sum())
    row["unmatched_rows"] = row["rows"] - row["matched_rows"]
    forge_results(run, res)
    ok, failures = _audit(run)
    assert not ok
    assert any(f.startswith(f"FAIL: results.json row {i} ") and "mass_control_recent" in f and "rel_l2" in f
               for f in failures), failures[:5]
