"""The fused streaming analysis against the audited, non-fused implementations.

float64 (the reference precision) must reproduce `metrics.observe`, `ablation_core.ablate` and the
``mx_paths`` analysis to rounding; float32 (the fast path) must stay within the stated bounds.
The kernels it is built from are checked on their own: exact top-k sums, MX fake quantization
bit-identical to `testbed.quant.mx.MX`, and the recomputation of rows near underflow.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from testbed import streaming as st
from testbed.ablation_core import ablate_case, make_ablation
from testbed.analyses import mx_paths
from testbed.context import RunContext
from testbed.metrics import observe
from testbed.quant.mx import ELEMENTS, MX
from testbed.sources.video import make_llm_case, make_video_case

ABLATIONS = ("drop_sink", "drop_recent", "drop_history", "drop_middle", "keep_current_only")


class _Store:
    def save_packed(self, path, packed):
        return {"path": path}

    def save(self, path, array):
        return path


def _cases():
    return [make_video_case(0, 3, tokens_per_frame=8, heads=4, kv_heads=2, head_dim=32),   # GQA, bidirectional
            make_llm_case(1, heads=4, kv_heads=2, head_dim=32)]                              # causal


@pytest.fixture(scope="module")
def runs():
    out = []
    for case in _cases():
        spans = {n: make_ablation(n).dropped(case) for n in ABLATIONS}
        spans = {n: sp for n, sp in spans.items() if sp is not None}
        ref = {
            "obs": observe(case, max_scores=3000),
            "abl": ablate_case(case, spans),
            "mx": mx_paths.evaluate(case, mx_paths.validate({}, "p"), RunContext(store=_Store(), study="s", timing_repeats=0)),
        }
        # small tiles, so that every case spans several tiles (and the Jaccard links between them)
        got = {dt: st.analyze(case, dtype=dt, ablations=ABLATIONS, max_scores=2500, keep_output=True)
               for dt in (torch.float64, torch.float32)}
        out.append((case, ref, got))
    return out


def _per_row(row, key, case):
    return torch.tensor(row["per_row"][key], dtype=torch.float64).view(case.heads, -1)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_observation_matches_observe(runs, dtype, atol):
    for case, ref, got in runs:
        obs, o = ref["obs"], got[dtype].observation
        assert got[dtype].tiles > case.kv_heads
        assert set(o.rows) == set(obs.rows)
        for key, v in obs.rows.items():
            torch.testing.assert_close(o.rows[key], v, rtol=0, atol=atol, msg=f"{case.id} {key}")
        torch.testing.assert_close(o.heatmap, obs.heatmap, rtol=0, atol=atol)
        assert o.query_blocks == obs.query_blocks and o.frame == obs.frame
        if dtype == torch.float64:       # block sets are discrete: identical at the reference precision
            assert torch.equal(o.jaccard_query, obs.jaccard_query)
            assert torch.equal(o.jaccard_block, obs.jaccard_block)
            assert torch.equal(o.block_set_size, obs.block_set_size)


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float64, 1e-12, 1e-10), (torch.float32, 2e-6, 1e-4)])
def test_ablations_match_ablate(runs, dtype, atol, rtol):
    for _case, ref, got in runs:
        a, b = ref["abl"], got[dtype].ablation
        assert sorted(b.names) == sorted(a.names)
        for name in a.names:
            i, k = a.index(name), b.index(name)
            torch.testing.assert_close(b.dropped_mass[k], a.dropped_mass[i], rtol=0, atol=atol, equal_nan=True)
            torch.testing.assert_close(b.tv[k], a.tv[i], rtol=0, atol=atol, equal_nan=True)
            assert torch.equal(b.undefined[k], a.undefined[i])
            assert b.rel_l2(name) == pytest.approx(a.rel_l2(name), rel=rtol)
            assert b.cosine(name) == pytest.approx(a.cosine(name), rel=rtol)
            assert np.allclose(b.rel_l2_heads(name), a.rel_l2_heads(name), rtol=rtol, atol=0)
        for name, v in a.region_mass.items():
            torch.testing.assert_close(b.region_mass[name], v, rtol=0, atol=atol)
        torch.testing.assert_close(b.output, a.output, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-4)


# float32 forms the paths' output errors from (P-hat - P) V in bfloat16 (see the module): on these
# few-key records that moves rel-L2 by a few 1e-4 relative (on the 6,240-key record, by < 1e-4)
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float64, 1e-12, 1e-10), (torch.float32, 2e-6, 2e-3)])
def test_mx_paths_match(runs, dtype, atol, rtol):
    for case, ref, got in runs:
        res = got[dtype]
        rows = ref["mx"]
        assert {r["rotation"] for r in rows if r["path"] == "qk"} == set(res.qk)
        for r in rows:
            path = res.qk[r["rotation"]] if r["path"] == "qk" else res.p
            assert path.scheme == r["scheme"]
            torch.testing.assert_close(path.tv, _per_row(r, "tv", case), rtol=0, atol=atol)
            assert path.rel_l2 == pytest.approx(r["rel_l2"], rel=rtol)
            agree = float(path.argmax_agree.double().mean())
            if dtype == torch.float64:
                assert agree == r["argmax_agreement"]
            else:                        # a float32 near-tie may flip one row
                assert abs(agree - r["argmax_agreement"]) <= 1.5 / path.tv.numel()
            if r["path"] == "p":
                zero, rsum = _per_row(r, "numerical_zero_rate", case), _per_row(r, "row_sum", case)
                if dtype == torch.float64:
                    assert torch.equal(res.p.zero_rate, zero)
                    torch.testing.assert_close(res.p.row_sum, rsum, rtol=0, atol=1e-12)
                else:                    # one float32 rounding of P may move one element by a quantum
                    torch.testing.assert_close(res.p.zero_rate, zero, rtol=0, atol=0.05)
                    torch.testing.assert_close(res.p.row_sum, rsum, rtol=0, atol=1e-4)


def test_one_rotation_and_no_p_path():
    case = _cases()[0]
    res = st.analyze(case, dtype=torch.float64, rotations=("signed_hadamard",), p_path=False, ablations=())
    assert list(res.qk) == ["signed_hadamard"] and res.p is None and res.ablation.names == []
    full = st.analyze(case, dtype=torch.float64)
    assert torch.equal(res.qk["signed_hadamard"].tv, full.qk["signed_hadamard"].tv)
    for key, v in full.observation.rows.items():
        assert torch.equal(res.observation.rows[key], v)


# ---- kernels ------------------------------------------------------------------------------------

def _rows_for_topk(rng):
    """Rows of e = exp(s - max) in (0, 1] with a 1 somewhere: wide, narrow, tied, constant, and a
    boundary bucket too large for the gather scratch."""
    n = 3000
    yield np.exp(-rng.random(n) * 30)
    yield np.exp(-rng.random(n) * 1e-6)                    # nearly constant: every key in few buckets
    yield np.exp(-rng.integers(0, 4, n).astype(float))     # heavy ties
    yield np.ones(n)                                        # all equal
    yield np.exp(-np.abs(rng.standard_normal(n)) * 40)
    yield np.exp(-rng.random(7) * 3)                        # short row
    yield np.r_[np.ones(1), np.full(n - 1, 0.5)]            # one bucket holds n-1 keys
    yield np.exp(-rng.random(n) * 200)                      # beyond the float32 range: clamped values


@pytest.mark.parametrize("np_dt,int_dt", [(np.float32, np.int32), (np.float64, np.int64)])
def test_top_sums_exact(np_dt, int_dt):
    rng = np.random.default_rng(3)
    bone = int(np.array(1.0, np_dt).view(int_dt))
    for x in _rows_for_topk(rng):
        x = np.maximum(x, 1e-37).astype(np_dt)
        x[rng.integers(x.size)] = 1.0
        n = x.size
        ks = np.unique(np.r_[1, rng.integers(1, n + 1, 3), n]).astype(np.int64)
        out = np.empty(ks.size)
        st._top_sums(x, x.view(int_dt), ks, bone, out, np.empty(n, np.uint16), np.empty(4 * st._NB, np.int32),
                     np.empty((2, st._GCAP), np.int64), np.empty(n + 8, np.uint8), np.empty(6, int_dt))
        want = np.cumsum(np.sort(x.astype(np.float64))[::-1])[ks - 1]
        np.testing.assert_allclose(out, want, rtol=1e-13, atol=0)


@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("np_dt", [np.float32, np.float64])
def test_p_path_bit_identical_to_mx(element, np_dt):
    fmt = ELEMENTS[element]
    rng = np.random.default_rng(5)
    for keys, block in ((6240, 32), (77, 32), (100, 16)):
        rows = 24
        s = rng.standard_normal((rows, keys)) * rng.choice([0.1, 3.0, 30.0, 300.0], size=(rows, 1))
        e = np.exp(s - s.max(axis=1, keepdims=True))
        e[1, : keys // 2] *= 1e-36                          # a half of tiny blocks (the float64 route)
        nvis = rng.integers(1, keys + 1, rows)
        nvis[:4] = keys
        for r in range(rows):                               # causal rows: 0 beyond the visible keys
            e[r, nvis[r]:] = 0
            e[r, : nvis[r]] /= e[r, : nvis[r]].max()
        e = e.astype(np_dt)
        inv = 1.0 / e.astype(np.float64).sum(axis=1)
        ph = np.empty_like(e)
        tv, rsum, zr, arg = np.empty(rows), np.empty(rows), np.empty(rows), np.empty(rows, np.int64)
        diff = np.empty((rows, keys), np.uint16)
        nbk = -(-keys // block)
        bm, scs, downs, ups = np.empty(nbk, np_dt), np.empty(nbk, np.int64), np.empty(nbk, np.float32), np.empty(nbk, np.float32)
        for r in range(rows):
            tv[r], rsum[r], zr[r], arg[r] = st._p_row(e[r], nvis[r], inv[r], block, fmt.emax, fmt.emin, fmt.mbits,
                                                      fmt.max, ph[r], diff[r], bm, scs, downs, ups)
        if np_dt == np.float64:                             # the reference quantizes float32(P)
            p32 = torch.from_numpy((e * inv[:, None]).astype(np.float32))
        else:
            p32 = torch.from_numpy(e * inv.astype(np.float32)[:, None])
        mx = MX(element, block)
        want = mx.dequantize(mx.quantize_reference(p32))
        assert torch.equal(torch.from_numpy(ph.astype(np.float32)).view(torch.int32), want.view(torch.int32))
        assert np.array_equal(arg, want.argmax(dim=-1).numpy())
        p = torch.from_numpy(e.astype(np.float64) * inv[:, None])
        np.testing.assert_allclose(tv, 0.5 * (want.double() - p).abs().sum(-1).numpy(), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(rsum, want.double().sum(-1).numpy(), rtol=1e-12)
        d16 = (torch.from_numpy(ph).double() - p).float()
        for r in range(rows):
            d16[r, nvis[r]:] = 0
        assert torch.equal(torch.from_numpy(diff).view(torch.bfloat16), d16.to(torch.bfloat16))


@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("rotation", [None, "signed_hadamard"])
def test_qk_quantization_bit_identical_to_mx(element, rotation):
    torch.manual_seed(0)
    fmt = ELEMENTS[element]
    xs = [torch.randn(3, 50, 128) * 3, torch.randn(2, 40, 64) * 1e-3, torch.randn(2, 30, 32),
          torch.randn(2, 20, 128) * torch.logspace(-30, 5, 128), make_video_case(2, 3, head_dim=128).k]
    xs[0][0, 0, :5] = 0.0
    xs[0][0, 1, :32] = 0.0
    xs[0][0, 2, 3] = -0.0
    for x in xs:
        mx = MX(element, 32, rotation, 11)
        want = mx.decode_rotated(mx.quantize_reference(x))
        rot = mx.rotation_for(x.shape[-1])
        signs = rot.signs.to(torch.float64).numpy() if rot is not None else np.empty(0)
        flat = x.reshape(-1, x.shape[-1]).contiguous().numpy()
        got = np.empty_like(flat)
        st._mx_rows(flat, signs, rot.block if rot is not None else 1, 32, fmt.emax, fmt.emin, fmt.mbits, fmt.max, got)
        assert torch.equal(torch.from_numpy(got).view(x.shape).view(torch.int32), want.view(torch.int32))


def test_rows_near_underflow_are_recomputed_by_the_reference():
    """A sink 80 nats above the rest: float32 softmax has exact zeros and dropping the sink leaves
    keys far below the max. Those rows go through `strict_zero_rate` and `ablate` themselves."""
    case = make_video_case(1, 3, tokens_per_frame=8, heads=4, kv_heads=4, head_dim=32, sink_logit=80.0,
                           concentrations=[16.0, 30.0, 3.0, 60.0])
    obs = observe(case, max_scores=3000)
    assert float(obs.rows["zero_rate"].max()) > 0
    spans = {n: make_ablation(n).dropped(case) for n in st.DEFAULT_ABLATIONS}
    abl = ablate_case(case, spans)
    for dtype in (torch.float32, torch.float64):
        res = st.analyze(case, dtype=dtype, rotations=(), p_path=False, max_scores=3000)
        torch.testing.assert_close(res.observation.rows["zero_rate"], obs.rows["zero_rate"], rtol=0, atol=0)
        i = abl.index("drop_sink")
        if dtype == torch.float32:
            assert res.fallback_rows["zero_rate"] > 0 and res.fallback_rows["ablation"] > 0
        k = res.ablation.index("drop_sink")
        torch.testing.assert_close(res.ablation.tv[k], abl.tv[i], rtol=0, atol=1e-6, equal_nan=True)
        assert res.ablation.rel_l2("drop_sink") == pytest.approx(abl.rel_l2("drop_sink"), rel=1e-4)


def test_gqa_tiles_do_not_change_results():
    case = make_llm_case(4, heads=6, kv_heads=3, head_dim=32, current=40)
    a = st.analyze(case, dtype=torch.float64, max_scores=500)
    b = st.analyze(case, dtype=torch.float64, max_scores=1 << 20)
    assert a.tiles > b.tiles
    for key, v in b.observation.rows.items():
        torch.testing.assert_close(a.observation.rows[key], v, rtol=0, atol=1e-13)
    assert torch.equal(a.observation.jaccard_query, b.observation.jaccard_query)
    torch.testing.assert_close(a.ablation.err2, b.ablation.err2, rtol=1e-12, atol=0)


def test_refuses_bad_arguments():
    case = _cases()[0]
    with pytest.raises(ValueError):
        st.analyze(case, dtype=torch.float16)
    with pytest.raises(ValueError):
        st.analyze(case, rotations=("random",))
    with pytest.raises(ValueError):
        st.analyze(case, element="e3m4")


def test_bfloat16_difference_is_the_difference_rounded_once():
    rng = np.random.default_rng(9)
    for dt in (np.float32, np.float64):
        e = np.exp(-rng.random(500) * 8).astype(dt)
        eh = np.exp(-rng.random(500) * 8).astype(dt)
        inv, invh = 1.0 / float(e.sum()), 1.0 / float(eh.sum())
        dh = np.empty(500, np.uint16)
        tv = st._tv_diff_row(eh, invh, e, inv, dh)
        d = eh.astype(np.float64) * invh - e.astype(np.float64) * inv
        assert tv == pytest.approx(0.5 * np.abs(d).sum(), rel=1e-12)
        got = torch.from_numpy(dh).view(torch.bfloat16)
        # torch's own float32 -> bfloat16 rounding (to nearest even) of the same difference
        assert torch.equal(got.view(torch.int16), torch.from_numpy(d.astype(np.float32)).bfloat16().view(torch.int16))
        assert np.all(np.abs(got.double().numpy() - d) <= 2.0 ** -8 * np.abs(d) + 1e-45)
