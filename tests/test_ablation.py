"""Causal ablation harness: closed forms, causal mask, undefined rows, controls, chunking, audit.

The reference quantities here are computed directly in the test (a full float64 softmax with a
mask), never taken from the harness: the harness merges per-atom partial sums, so agreement is
a real check of two different computations.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.ablation import (ABLATION_NAMES, Control, DropHistory, DropRegion, KeepCurrentOnly, ablate_case,
                              control_block, kept_mask, make_ablation)
from testbed.case import Case, Region
from testbed.metrics import score_tiles
from testbed.sources.synthetic import make_case as make_decode_case
from testbed.sources.video import make_llm_case, make_video_case

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_case(seed, heads=4, kv_heads=2, d=8, sizes=(3, 9, 5, 7), causal=True, scale=2.0, queries=None):
    """A Case with layout sink|middle|recent|current; queries are the current tokens (causal) or
    ``queries`` arbitrary positions."""
    g = torch.Generator().manual_seed(seed)
    tk = sum(sizes)
    bounds = np.cumsum((0,) + tuple(sizes)).tolist()
    names = ("sink", "middle", "recent", "current")
    layout = tuple(Region(n, a, b) for n, a, b in zip(names, bounds[:-1], bounds[1:]))
    pos = torch.arange(bounds[3], tk) if queries is None else torch.tensor(queries)
    q = scale * torch.randn(heads, len(pos), d, generator=g)
    k = torch.randn(kv_heads, tk, d, generator=g)
    v = torch.randn(kv_heads, tk, d, generator=g)
    return Case(id=f"rand{seed}", q=q, k=k, v=v, query_positions=pos.to(torch.int64), causal=causal, layout=layout)


def direct(case, dropped):
    """Test-side float64 P (full), P' (masked renormalized), outputs, per-row tau; NaN rows undefined."""
    heads, tq, d = case.q.shape
    group = heads // case.kv_heads
    k = case.k.double().repeat_interleave(group, 0)
    v = case.v.double().repeat_interleave(group, 0)
    s = case.q.double() @ k.transpose(1, 2) / math.sqrt(d)
    tk = case.keys
    vis = torch.arange(tk)[None, :] <= case.query_positions[:, None] if case.causal else torch.ones(tq, tk, dtype=torch.bool)
    p = torch.softmax(s.masked_fill(~vis, -math.inf), -1)
    keep = torch.ones(tk, dtype=torch.bool)
    for a, b in dropped:
        keep[a:b] = False
    allowed = vis & keep
    p2 = torch.softmax(s.masked_fill(~allowed, -math.inf), -1)  # NaN where nothing is allowed
    tau = p[..., ~keep].sum(-1)
    return p, p2, p @ v, p2 @ v, tau, keep, v


ABLS = ["drop_sink", "drop_recent", "drop_middle", "drop_history", "keep_current_only", "control_sink", "control_recent"]


@SETTINGS
@given(seed=st.integers(0, 10_000), causal=st.booleans(), scale=st.floats(0.1, 6.0), kv=st.sampled_from([1, 2, 4]))
def test_closed_forms_tv_equals_tau_and_output_shift(seed, causal, scale, kv):
    case = random_case(seed, kv_heads=kv, causal=causal, scale=scale)
    spans = {n: make_ablation(n, seed).dropped(case) for n in ABLS}
    res = ablate_case(case, spans)
    for i, name in enumerate(ABLS):
        p, p2, o, o2, tau, keep, v = direct(case, spans[name])
        ok = torch.isfinite(p2).all(-1)
        assert ok.all()  # queries are in the current chunk: they always keep themselves
        # TV(P, P') = tau, with P' taken from an independent masked softmax
        tv_direct = 0.5 * (p - p2).abs().sum(-1)
        torch.testing.assert_close(tv_direct, tau, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(res.tv[i], tau, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(res.dropped_mass[i], tau, rtol=1e-9, atol=1e-12)
        # O' - O = tau (mu_kept - mu_dropped), mu the P-weighted value means of each side
        # (each side's own total as the denominator: 1 - tau would cancel catastrophically when tau -> 1)
        mu_kept = (p[..., keep].unsqueeze(-1) * v[:, keep].unsqueeze(1)).sum(-2) / p[..., keep].sum(-1).unsqueeze(-1)
        pd = p[..., ~keep]
        mu_drop = torch.where(tau.unsqueeze(-1) > 0,
                              (pd.unsqueeze(-1) * v[:, ~keep].unsqueeze(1)).sum(-2) / tau.clamp(min=1e-300).unsqueeze(-1),
                              torch.zeros_like(mu_kept))
        shift = tau.unsqueeze(-1) * (mu_kept - mu_drop)
        torch.testing.assert_close(o2 - o, shift, rtol=1e-7, atol=1e-9)
        # the harness's mean shift is ||mu_kept - mu_dropped|| / ||O|| per row (NaN where tau is 0)
        rel_shift = torch.linalg.vector_norm(mu_kept - mu_drop, dim=-1) / torch.linalg.vector_norm(o, dim=-1)
        has = tau > 0
        assert torch.equal(torch.isfinite(res.mean_shift[i]), has)
        torch.testing.assert_close(res.mean_shift[i][has], rel_shift[has], rtol=1e-9, atol=1e-12)
        # the harness's ablated output matches the direct one: rel-L2 against the full output
        expect = float(torch.linalg.vector_norm(o2 - o) / torch.linalg.vector_norm(o))
        assert res.rel_l2(name) == pytest.approx(expect, rel=1e-9, abs=1e-12)
        cos = float((o2 * o).sum() / (torch.linalg.vector_norm(o2) * torch.linalg.vector_norm(o)))
        assert res.cosine(name) == pytest.approx(cos, rel=1e-9, abs=1e-12)
        assert int(res.undefined[i].sum()) == 0


def test_causal_mask_future_keys_do_not_matter():
    case = random_case(3, sizes=(2, 6, 4, 8))
    spans = {n: make_ablation(n).dropped(case) for n in ("none", "drop_sink", "drop_recent", "control_recent")}
    base = ablate_case(case, spans)
    # scramble every key and value after the first query's position: that query must not change
    first = int(case.query_positions[0])
    k2, v2 = case.k.clone(), case.v.clone()
    k2[:, first + 1:] = 50 * torch.randn_like(k2[:, first + 1:])
    v2[:, first + 1:] = -7.0
    other = ablate_case(case, spans, k2, v2)
    torch.testing.assert_close(other.output[:, 0], base.output[:, 0], rtol=0, atol=1e-12)
    for i in range(len(spans)):
        torch.testing.assert_close(other.dropped_mass[i][:, 0], base.dropped_mass[i][:, 0], rtol=0, atol=1e-12)
    # and a later query does change (the scrambled keys are visible to it)
    assert not torch.allclose(other.output[:, -1], base.output[:, -1])


def test_empty_kept_set_is_nan_counted_never_zero():
    # queries at positions 0..4 of a causal case; sink = keys 0..2. Dropping the sink leaves
    # queries 0, 1, 2 with no visible key: undefined.
    case = random_case(5, heads=2, kv_heads=1, sizes=(3, 4, 3, 4), queries=[0, 1, 2, 3, 4, 12])
    spans = {"none": [], "drop_sink": make_ablation("drop_sink").dropped(case)}
    res = ablate_case(case, spans)
    i = res.index("drop_sink")
    assert res.undefined[i].tolist() == [3, 3]
    assert torch.isnan(res.dropped_mass[i][:, :3]).all() and torch.isnan(res.tv[i][:, :3]).all()
    assert torch.isfinite(res.dropped_mass[i][:, 3:]).all()
    # the error is over the defined rows only, and equals the direct computation there
    p, p2, o, o2, tau, keep, v = direct(case, spans["drop_sink"])
    assert torch.isnan(p2[:, :3]).all()
    defined = (slice(None), slice(3, None))
    expect = float(torch.linalg.vector_norm(o2[defined] - o[defined]) / torch.linalg.vector_norm(o[defined]))
    assert res.rel_l2("drop_sink") == pytest.approx(expect, rel=1e-9)
    torch.testing.assert_close(res.dropped_mass[i][defined], tau[defined])


def test_chunked_computation_matches_one_tile():
    case = make_video_case(2, tokens_per_frame=3, heads=4, kv_heads=2)
    spans = {n: make_ablation(n).dropped(case) for n in ("none", "drop_sink", "control_sink", "drop_history")}
    big = ablate_case(case, spans, max_scores=1 << 30)
    small = ablate_case(case, spans, max_scores=1)  # one query per tile
    torch.testing.assert_close(small.output, big.output, rtol=1e-12, atol=1e-13)
    for attr in ("dropped_mass", "tv", "err2", "ref2", "dot", "out2", "mean_shift"):
        torch.testing.assert_close(getattr(small, attr), getattr(big, attr), rtol=1e-10, atol=1e-12, equal_nan=True)


def test_score_tiles_stay_within_budget_and_cover_everything():
    q = torch.randn(6, 50, 4)
    k = torch.randn(3, 40, 4)
    seen = torch.zeros(6, 50, dtype=torch.int64)
    for j, heads, qs, s, _vis in score_tiles(q, k, torch.arange(50) % 40, True, max_scores=2 * 40 * 7):
        assert s.numel() <= 2 * 40 * 7
        assert heads == slice(2 * j, 2 * j + 2)
        seen[heads, qs] += 1
    assert (seen == 1).all()


def test_ablation_spans_follow_the_layout():
    case = random_case(1, sizes=(3, 9, 5, 7))
    assert DropRegion("sink").dropped(case) == [(0, 3)]
    assert DropRegion("recent").dropped(case) == [(12, 17)]
    assert DropHistory().dropped(case) == [(0, 17)]
    assert KeepCurrentOnly().dropped(case) == [(0, 17)]
    assert make_ablation("none").dropped(case) == []
    assert kept_mask(24, [(0, 3), (12, 17)]).sum() == 24 - 8
    with pytest.raises(ValueError, match="unknown ablation"):
        make_ablation("drop")


@pytest.mark.parametrize("seed", range(6))
def test_control_block_same_size_from_the_middle(seed):
    case = random_case(seed, sizes=(3, 12, 5, 7))
    for target in ("sink", "recent"):
        spans, kind = control_block(case, target, seed)
        r = case.region(target)
        mid = case.region("middle")
        assert kind == "middle" and len(spans) == 1
        a, b = spans[0]
        assert b - a == r.size and mid.start <= a and b <= mid.stop
        assert control_block(case, target, seed) == (spans, kind)  # seeded: reproducible
        assert Control(target, seed).dropped(case) == spans


def test_control_block_seed_moves_it():
    case = random_case(0, sizes=(3, 40, 5, 7))
    starts = {control_block(case, "sink", s)[0][0][0] for s in range(20)}
    assert len(starts) > 3


@pytest.mark.parametrize("sizes", [(3, 12, 5, 7), (4, 2, 6, 5), (3, 5, 4, 7), (6, 0, 9, 4), (2, 1, 2, 3), (8, 3, 8, 8)])
@pytest.mark.parametrize("seed", range(4))
def test_a_control_never_overlaps_its_target_and_drops_as_many_keys(sizes, seed):
    """Whatever the layout: the control's keys lie in the history, outside the target, and are as
    many as the target's; it is None exactly when fewer keys than that lie outside the target."""
    case = random_case(seed, sizes=sizes)
    hist = case.region("current").start
    for target in ("sink", "middle", "recent"):
        r = case.region(target)
        got = control_block(case, target, seed)
        outside = hist - r.size
        if r.size == 0 or outside < r.size:
            assert got is None, (sizes, target, got)
            continue
        spans, kind = got
        keys = [t for a, b in spans for t in range(a, b)]
        assert len(keys) == len(set(keys)) == r.size
        assert all(0 <= t < hist and not r.start <= t < r.stop for t in keys), (sizes, target, spans)
        assert kind in ("middle", "contiguous", "scattered") and (len(spans) == 1 or kind == "scattered")
        if kind == "middle":
            mid = case.region("middle")
            assert mid.start <= spans[0][0] and spans[0][1] <= mid.stop
        assert Control(target, seed).dropped(case) == spans


def test_scattered_when_no_block_fits_beside_the_target():
    """middle (5 keys) between a 3-key sink and a 4-key recent window: no 5-key block avoids it,
    but 7 keys lie outside it: the control is 5 single keys from the sink and the recent window."""
    case = random_case(0, sizes=(3, 5, 4, 7))
    spans, kind = control_block(case, "middle", 0)
    keys = [t for a, b in spans for t in range(a, b)]
    assert kind == "scattered" and len(keys) == 5 and not set(keys) & set(range(3, 8))


def test_video_controls_are_frame_aligned_and_never_overlap():
    """sink 4 | recent 6 | current 6 frames: the sink's control is 4 frames of the recent window;
    the recent window (6 frames) has only the 4 sink frames beside it: no valid control."""
    case = make_video_case(1, tokens_per_frame=5)
    tpf = 5
    spans, kind = control_block(case, "sink", 0)
    (a, b), = spans
    assert (b - a) == 4 * tpf and a % tpf == 0 and kind == "contiguous"
    assert case.region("recent").start <= a and b <= case.region("recent").stop  # no middle: inside recent
    assert control_block(case, "recent", 0) is None
    assert Control("recent", 0).dropped(case) is None


def test_not_applicable_without_regions():
    case = make_decode_case("early_focus", 1, 128)  # sink | middle | recent, no current chunk
    assert DropHistory().dropped(case) is None
    assert KeepCurrentOnly().dropped(case) is None
    assert DropRegion("current").dropped(case) is None
    assert Control("current").dropped(case) is None
    assert DropRegion("sink").dropped(case) == [(0, 16)]


class _Ctx:
    def __init__(self, root):
        from testbed.evidence import ArrayStore

        self.store = ArrayStore(root)
        self.study = "t"
        self.timings = []
        self.messages = []

    def timed(self, case_id, arm, op, repeat, fn):
        return fn()

    def progress(self, msg):
        self.messages.append(msg)


def test_analysis_rows_and_not_applicable_arms(tmp_path):
    from testbed.analyses import ablation_analysis as an

    params = an.validate({"kv_arms": [{"name": "float32"}, {"name": "q4", "window": "recent",
                                       "key": {"kind": "int_grouped", "bits": 4, "group_size": 32, "axis": "channel"},
                                       "value": {"kind": "int_grouped", "bits": 4, "group_size": 32, "axis": "token"}}]},
                         "p")
    decode = make_decode_case("clean", 2, 64, queries=4)
    rows = an.evaluate(decode, params, _Ctx(tmp_path))
    by = {(r["arm"], r["ablation"]): r for r in rows}
    assert by[("float32", "drop_history")]["applicable"] is False and by[("float32", "drop_history")]["rel_l2"] is None
    assert by[("float32", "drop_sink")]["applicable"] is True and by[("float32", "drop_sink")]["rel_l2"] > 0
    assert by[("float32", "none")]["rel_l2"] == 0.0
    assert by[("q4", "none")]["rel_l2"] > 0  # quantization error alone
    assert by[("q4", "none")]["payload_bytes"] < by[("float32", "none")]["payload_bytes"]
    case = make_llm_case(3)
    rows = an.evaluate(case, params, _Ctx(tmp_path / "b"))
    none = [r for r in rows if r["arm"] == "q4" and r["ablation"] == "none"][0]
    # the current chunk is not cached: only the history is quantized
    assert none["quantized_tokens"] == case.region("current").start
    hist = [r for r in rows if r["ablation"] == "drop_history"]
    assert hist[0]["rel_l2"] == pytest.approx(hist[1]["rel_l2"], rel=1e-12)


def test_protocol_validation_names_the_key():
    from testbed.analyses import ablation_analysis as an
    from testbed.protocol import ProtocolError

    with pytest.raises(ProtocolError, match=r"p\.ablations\[1\]"):
        an.validate({"ablations": ["none", "drop"]}, "p")
    with pytest.raises(ProtocolError, match="float32 arm is required"):
        an.validate({"kv_arms": [{"name": "q", "key": {"kind": "int_grouped"}, "value": {"kind": "int_grouped"}}]}, "p")
    with pytest.raises(ProtocolError, match=r"p\.kv_arms\[1\]\.key"):
        an.validate({"kv_arms": [{"name": "float32"},
                                 {"name": "q", "key": {"kind": "nope"}, "value": {"kind": "int_grouped"}}]}, "p")
    assert set(an.validate({}, "p")["ablations"]) == set(ABLATION_NAMES)


def _tiny_protocol(tmp_path):
    proto = json.loads(open("protocols/ablation.json", encoding="utf-8").read())
    proto["source"].update(seeds=[1, 2], tokens_per_frame=2, llm_middle=20, llm_current=8)
    path = tmp_path / "abl.json"
    path.write_text(json.dumps(proto), encoding="utf-8")
    return path


def test_end_to_end_run_is_audited(tmp_path):
    from testbed.audit import audit
    from testbed.protocol import load_protocol
    from testbed.run import run_protocols

    path = _tiny_protocol(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    run_protocols(out, [(path, *load_protocol(path))], progress=lambda m: None)
    ok, failures, summary = audit(out, check_sources=False)
    assert ok, failures[:5]
    rows = json.loads((out / "results.json").read_text())["rows"]
    abl = [r for r in rows if r["analysis"] == "ablation" and r["applicable"]]
    assert {"dropped_mass", "tv", "rel_l2", "cosine", "sink_mass", "recent_mass", "current_mass", "history_mass"} <= set(abl[0])
    # tamper with one reported number (and keep results.json's hash consistent): the audit must notice
    data = json.loads((out / "results.json").read_text())
    target = next(r for r in data["rows"] if r["analysis"] == "ablation" and r["ablation"] == "drop_sink")
    target["rel_l2"] *= 1.01
    from tests._helpers import forge_results

    forge_results(out, data)
    ok, failures, _ = audit(out, check_sources=False)
    assert not ok and any("rel_l2" in f and f.startswith("FAIL: results.json row") for f in failures)
