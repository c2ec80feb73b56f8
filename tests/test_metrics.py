"""Observational attention metrics: closed cases, invariances, and the tiled driver `observe`."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed import metrics as M
from testbed.case import Case, Region
from testbed.sources.video import make_llm_case, make_video_case

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_existing_output_metrics_kept():
    x = torch.tensor([3.0, 4.0])
    assert M.rel_l2(x, x) == 0.0
    assert M.rel_l2(torch.zeros(2), x) == pytest.approx(1.0)
    assert M.cosine(2 * x, x) == pytest.approx(1.0)
    assert M.max_abs(x, torch.zeros(2)) == 4.0
    p = torch.tensor([[0.5, 0.5, 0.0]])
    assert float(M.total_variation(p, torch.tensor([[1.0, 0.0, 0.0]]))[0]) == pytest.approx(0.5)
    assert float(M.region_mass(p, 1, 3)[0]) == pytest.approx(0.5)


@pytest.mark.parametrize("sk", [1, 7, 100])
def test_support_is_one_for_uniform_and_one_over_sk_for_one_hot(sk):
    tk = sk + 5
    uni = torch.zeros(1, tk, dtype=torch.float64)
    uni[0, :sk] = 1.0 / sk
    hot = torch.zeros(1, tk, dtype=torch.float64)
    hot[0, 2 % sk] = 1.0
    vis = torch.tensor([float(sk)])
    assert float(M.effective_support(uni, vis)[0]) == pytest.approx(1.0)
    assert float(M.effective_support(hot, vis)[0]) == pytest.approx(1.0 / sk)


@SETTINGS
@given(st.lists(st.floats(0.0, 10.0), min_size=2, max_size=60), st.integers(1, 100))
def test_top_mass_is_the_sum_of_the_largest_ceil_share(weights, pct):
    w = torch.tensor(weights, dtype=torch.float64) + 1e-3
    p = (w / w.sum()).unsqueeze(0)
    sk = p.shape[-1]
    n = max(1, math.ceil(pct * sk / 100 - 1e-12))
    expect = sorted(p[0].tolist(), reverse=True)[:n]
    got = M.top_mass(p, torch.tensor([sk]), percents=(pct,))[pct]
    assert float(got[0]) == pytest.approx(sum(expect), rel=1e-12)
    assert 0 < float(got[0]) <= 1 + 1e-12
    # mass on the top share is at least the share itself (largest first) -- a uniform row is the floor
    assert float(got[0]) >= n / sk - 1e-12


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(1, 90), st.booleans())
def test_top_mass_equals_the_running_sum_of_a_full_descending_sort_bit_for_bit(seed, tk, ties):
    """Rows of different visible counts (causal: hidden keys are 0) and, with ``ties``, tied
    probabilities: each percent's mass is the full descending sort's running sum at the count,
    exactly (the order of the additions is the definition's)."""
    g = torch.Generator().manual_seed(seed)
    rows = 6
    s = 2.0 * torch.randn(rows, tk, generator=g, dtype=torch.float64)
    if ties:
        s = s.round()
    nvis = torch.randint(1, tk + 1, (rows,), generator=g)
    s = s.masked_fill(torch.arange(tk)[None, :] >= nvis[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    csum = torch.cumsum(torch.sort(p, dim=-1, descending=True).values, dim=-1)
    got = M.top_mass(p, nvis, percents=(1, 5, 10, 50, 100))
    for pc, mass in got.items():
        for r in range(rows):
            n = max(1, (pc * int(nvis[r]) + 99) // 100)
            assert float(mass[r]) == float(csum[r, n - 1])


def test_strict_zero_rate_counts_visible_zeros_only():
    p = torch.tensor([[0.5, 0.0, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]])
    vis = torch.tensor([[True, True, True, False], [True, True, False, False]])
    assert M.strict_zero_rate(p, vis).tolist() == pytest.approx([1 / 3, 1 / 2])
    assert M.strict_zero_rate(p, None).tolist() == pytest.approx([0.5, 0.75])


def test_top_blocks_fewest_blocks_reaching_coverage_and_jaccard():
    m = torch.tensor([[0.1, 0.5, 0.3, 0.1]], dtype=torch.float64)
    assert M.top_blocks(m, 0.5).tolist() == [[False, True, False, False]]
    assert M.top_blocks(m, 0.8).tolist() == [[False, True, True, False]]
    assert M.top_blocks(m, 0.9).sum() == 3
    assert M.top_blocks(m, 1.0).sum() == 4
    a = torch.tensor([[True, True, False, False]])
    b = torch.tensor([[False, True, True, False]])
    assert float(M.jaccard(a, b)[0]) == pytest.approx(1 / 3)
    assert float(M.jaccard(a, a)[0]) == 1.0


def test_block_masses_sum_to_row_mass_with_a_short_last_block():
    p = torch.softmax(torch.randn(3, 10, dtype=torch.float64), -1)
    bm = M.block_masses(p, 4)
    assert bm.shape == (3, 3)
    torch.testing.assert_close(bm.sum(-1), torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(bm[:, 2], p[:, 8:].sum(-1))


def test_paired_wilcoxon_uses_units_and_refuses_degenerate_pairs():
    # six units, every one worse under the ablation: the exact two-sided p is 2 / 2^6
    r = M.paired_wilcoxon([2, 3, 4, 5, 6, 7.5], [1, 1, 1, 1, 1, 1])
    assert r["n"] == 6 and r["p"] == pytest.approx(2 / 64)
    assert r["median_diff"] == pytest.approx(3.5)  # differences 1, 2, 3, 4, 5, 6.5
    assert M.paired_wilcoxon([1, 2], [1, 2])["p"] is None
    with pytest.raises(ValueError):
        M.paired_wilcoxon([1, 2], [1])


def _direct_probs(case):
    heads, tq, d = case.q.shape
    k = case.k.double().repeat_interleave(heads // case.kv_heads, 0)
    s = case.q.double() @ k.transpose(1, 2) / math.sqrt(d)
    vis = torch.arange(case.keys)[None, :] <= case.query_positions[:, None] if case.causal else \
        torch.ones(tq, case.keys, dtype=torch.bool)
    return torch.softmax(s.masked_fill(~vis, -math.inf), -1), vis


@pytest.mark.parametrize("make", [lambda: make_video_case(4, tokens_per_frame=3), lambda: make_llm_case(4)])
def test_observe_matches_a_direct_computation_and_its_invariants(make):
    case = make()
    obs = M.observe(case, block_tokens=8)
    p, vis = _direct_probs(case)
    sk = vis.sum(-1).double()
    ent = -(p * torch.log(torch.where(p > 0, p, torch.ones_like(p)))).sum(-1)
    torch.testing.assert_close(obs.rows["support"], torch.exp(ent) / sk)
    torch.testing.assert_close(obs.rows["visible_keys"], sk.expand_as(obs.rows["support"]))
    # region masses partition the row; history + current = 1
    total = sum(obs.rows[f"{r.name}_mass"] for r in case.layout)
    torch.testing.assert_close(total, torch.ones_like(total))
    torch.testing.assert_close(obs.rows["history_mass"] + obs.rows["current_mass"], torch.ones_like(total))
    # the temporal heatmap rows sum to 1
    torch.testing.assert_close(obs.heatmap.sum(-1), torch.ones(obs.heatmap.shape[:-1], dtype=torch.float64))
    # top-k mass is monotone in k and support lies in (0, 1]
    assert (obs.rows["top1"] <= obs.rows["top5"] + 1e-12).all() and (obs.rows["top5"] <= obs.rows["top10"] + 1e-12).all()
    assert ((obs.rows["support"] > 0) & (obs.rows["support"] <= 1 + 1e-12)).all()
    assert ((obs.jaccard_query >= 0) & (obs.jaccard_query <= 1)).all()


def test_observe_is_the_same_whatever_the_tile_size():
    case = make_llm_case(7, heads=4, kv_heads=2)
    a = M.observe(case, max_scores=1)
    b = M.observe(case, max_scores=1 << 30)
    for key in a.rows:
        torch.testing.assert_close(a.rows[key], b.rows[key], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(a.heatmap, b.heatmap, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(a.jaccard_query, b.jaccard_query)
    torch.testing.assert_close(a.jaccard_block, b.jaccard_block)


def test_float32_underflow_shows_as_strict_zeros():
    # one key far below the others: exp(-200) underflows float32 to exactly 0 (not float64)
    q = torch.zeros(1, 1, 4)
    q[0, 0, 0] = 20.0
    k = torch.zeros(1, 3, 4)
    k[0, 0, 0] = 10.0
    k[0, 1, 0] = -10.0  # logit gap (10 - (-10)) * 20 / sqrt(4) = 200
    k[0, 2, 0] = -5.0  # gap 150; both far beyond float32's smallest subnormal (exp(-103.3))
    case = Case(id="z", q=q, k=k, v=torch.randn(1, 3, 4), query_positions=torch.tensor([2]), causal=False,
                layout=(Region("sink", 0, 1), Region("current", 1, 3)))
    obs = M.observe(case)
    assert float(obs.rows["zero_rate"][0, 0]) == pytest.approx(2 / 3)
    p, _ = _direct_probs(case)
    assert (p > 0).all()  # float64 has no zero: the zeros are numerical, not structural


@pytest.mark.parametrize("a,a0,b,n", [(3, 3, 2, 6), (4, 2, 3, 5), (1, 1, 1, 1), (5, 5, 5, 8), (2, 0, 3, 4)])
def test_shuffled_jaccard_null_is_the_expectation_over_random_sets(a, a0, b, n):
    """The closed form against an exhaustive average over every b-subset of the n blocks (A has a0
    blocks among them and a - a0 outside)."""
    import itertools

    A = set(range(a0)) | set(range(n, n + a - a0))
    vals = []
    for B in itertools.combinations(range(n), b):
        inter = len(A & set(B))
        union = len(A | set(B))
        vals.append(inter / union if union else 1.0)
    assert M._expected_jaccard(a, a0, b, n) == pytest.approx(sum(vals) / len(vals), rel=1e-12)


def test_random_pair_null_pairs_non_neighbours_that_see_the_same_blocks():
    """Every drawn partner is a query of the same head, not the query or its neighbour, seeing as
    many key blocks; with identical queries every set is the same, so every null is 1."""
    case = make_llm_case(4)
    obs = M.observe(case, block_tokens=8)
    frame = obs.frame
    vb = [-(-int(x) // frame) for x in obs.rows["visible_keys"][0].tolist()]
    sets = torch.zeros(case.heads, case.q.shape[1], -(-case.keys // frame), dtype=torch.bool)
    sets[..., 0] = True
    pair, shuffled = M.jaccard_nulls(sets, vb, "same")
    assert torch.equal(pair[torch.isfinite(pair)], torch.ones_like(pair[torch.isfinite(pair)]))
    assert bool(torch.isfinite(pair).any())
    # reproducible, and a different case id draws other partners (random sets tell the partners apart)
    g = torch.Generator().manual_seed(0)
    rnd = torch.rand(sets.shape, generator=g) < 0.5
    p1, _ = M.jaccard_nulls(rnd, vb, "x")
    p2, _ = M.jaccard_nulls(rnd, vb, "x")
    p3, _ = M.jaccard_nulls(rnd, vb, "y")
    assert torch.equal(torch.nan_to_num(p1, nan=-1), torch.nan_to_num(p2, nan=-1))
    assert not torch.equal(torch.nan_to_num(p1, nan=-1), torch.nan_to_num(p3, nan=-1))
    # the partner rule itself: never the query or a neighbour, always one of the same visible blocks
    import random as _r
    for i in range(1, len(vb)):
        bucket = [j for j in range(len(vb)) if vb[j] == vb[i]]
        for seed in range(5):
            j = M._partner(bucket, i, _r.Random(seed))
            cands = [x for x in bucket if abs(x - i) > 1]
            assert (j is None) == (not cands) and (j is None or j in cands)
            if cands:
                assert j == cands[_r.Random(seed).randrange(len(cands))]   # the documented draw
    assert ((obs.null_pair[torch.isfinite(obs.null_pair)] >= 0) & (obs.null_pair[torch.isfinite(obs.null_pair)] <= 1)).all()
    assert ((obs.null_shuffled >= 0) & (obs.null_shuffled <= 1)).all()
    # queries with no same-block non-neighbour get NaN, never a made-up partner
    lonely = [i for i in range(1, len(vb)) if not [j for j in range(len(vb)) if abs(j - i) > 1 and vb[j] == vb[i]]]
    for i in lonely:
        assert bool(torch.isnan(obs.null_pair[:, i - 1]).all())


# -- head-level block predictability ----------------------------------------------------------

def _head_fit(bm, vb, coverage=0.9):
    bm = torch.as_tensor(bm, dtype=torch.float64)
    return M.head_set_fit(bm, M.top_blocks(bm, coverage), vb, coverage)


def test_head_set_predicts_queries_that_share_a_pattern_and_misses_the_odd_one():
    """Leave-one-out: nine queries with their mass on block 0 predict each other exactly; the
    tenth puts its mass on block 3, which its head's other queries never look at, so the head's
    set (built from the others only) misses it: Jaccard 0, almost none of its mass kept."""
    rows = [[0.95, 0.05 / 3, 0.05 / 3, 0.05 / 3]] * 9 + [[0.02, 0.02, 0.01, 0.95]]
    fit = _head_fit([rows], [4] * 10, coverage=0.8)
    assert fit["jaccard"][0, :9].tolist() == [1.0] * 9
    assert fit["jaccard"][0, 9].item() == 0.0 and fit["mass"][0, 9].item() == pytest.approx(0.02)
    assert fit["size"][0].tolist() == [1.0] * 10
    assert fit["mass_null"][0].tolist() == [0.25] * 10         # one random block of four: a quarter of the mass


@SETTINGS
@given(st.integers(2, 6), st.integers(1, 5), st.integers(0, 10 ** 6))
def test_head_set_nulls_are_a_random_set_of_as_many_visible_blocks(tq, extra, seed):
    """mass_null is the expected mass of a uniformly random set of the head set's size among the
    blocks the query sees (exhaustively averaged here), and jaccard_null the expected Jaccard; the
    head set never holds a block the query cannot see."""
    import itertools

    g = torch.Generator().manual_seed(seed)
    nb = extra + 1
    vb = [int(x) for x in torch.randint(1, nb + 1, (tq,), generator=g)]
    bm = torch.rand(1, tq, nb, generator=g, dtype=torch.float64)
    for i, n in enumerate(vb):
        bm[0, i, n:] = 0
    bm = bm / bm.sum(dim=-1, keepdim=True)
    sets = M.top_blocks(bm, 0.9)
    fit = M.head_set_fit(bm, sets, vb, 0.9)
    for i, n in enumerate(vb):
        b = int(fit["size"][0, i])
        assert 1 <= b <= n
        subsets = list(itertools.combinations(range(n), b))
        mine = {j for j in range(nb) if sets[0, i, j]}
        mass = sum(float(bm[0, i, list(c)].sum()) for c in subsets) / len(subsets)
        jac = sum(len(mine & set(c)) / len(mine | set(c)) for c in subsets) / len(subsets)
        assert fit["mass_null"][0, i].item() == pytest.approx(mass, rel=1e-9)
        assert fit["jaccard_null"][0, i].item() == pytest.approx(jac, rel=1e-9)
        assert 0.0 <= fit["mass"][0, i].item() <= 1.0 + 1e-12


def test_spatial_tiles_split_each_frame_into_blocks_of_consecutive_tokens():
    case = make_video_case(1)
    tpf = case.tokens_per_frame
    assert M.block_size(case, 16, 1) == tpf and M.block_size(case, 16, 2) == tpf // 2
    with pytest.raises(ValueError, match="does not divide"):
        M.block_size(case, 16, 3)
    llm = make_llm_case(1)
    assert M.block_size(llm, 16, 2) == 16            # no frames: block_tokens, tiles do not apply
    whole, tiles = M.observe(case, spatial_tiles=1), M.observe(case, spatial_tiles=2)
    assert tiles.block == tpf // 2 and tiles.frame == whole.frame == tpf
    assert torch.equal(tiles.heatmap, whole.heatmap)  # the heatmap stays per frame
    # a tile set covers at most what the frame set covers: twice as many blocks, each half a frame
    assert (tiles.block_set_size <= 2 * whole.block_set_size).all()


# -- Holm's step-down adjustment ----------------------------------------------------------------

def test_holm_worked_example():
    # m = 4 (None is not a test): sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04,
    # made monotone: 0.02, 0.03, 0.06, 0.06.
    got = M.holm([0.01, 0.04, 0.03, None, 0.005])
    assert got[3] is None
    assert got[0] == pytest.approx(0.03) and got[1] == pytest.approx(0.06)
    assert got[2] == pytest.approx(0.06) and got[4] == pytest.approx(0.02)
    assert M.holm([0.6, 0.7]) == [1.0, 1.0]  # capped at 1
    assert M.holm([]) == [] and M.holm([None]) == [None]


def _holm_rejects(ps, alpha):
    """The textbook sequential procedure: reject the i-th smallest p while p_(i) <= alpha / (m - i + 1)
    (written as a product, so that a p exactly on a boundary rounds as in the adjusted form)."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    rejected = set()
    for rank, i in enumerate(order):
        if ps[i] * (len(ps) - rank) > alpha:
            break
        rejected.add(i)
    return rejected


@SETTINGS
@given(st.lists(st.floats(min_value=1e-6, max_value=1.0), min_size=1, max_size=12),
       st.sampled_from([0.01, 0.05, 0.1]))
def test_holm_adjusted_p_rejects_what_the_sequential_procedure_rejects(ps, alpha):
    from testbed.audit_checks.stats import holm as audit_holm

    adj = M.holm(ps)
    assert all(a >= p and a <= 1.0 for a, p in zip(adj, ps))
    assert {i for i, a in enumerate(adj) if a <= alpha} == _holm_rejects(ps, alpha)
    # the audit's own implementation gives the same numbers
    assert audit_holm(ps) == pytest.approx(adj, rel=1e-12)
