"""The video-like and LLM-like synthetic layouts (testbed.sources.video)."""

from __future__ import annotations

import pytest
import torch

from testbed.metrics import observe
from testbed.protocol import ProtocolError
from testbed.sources import SOURCES
from testbed.sources.video import cases, make_llm_case, make_video_case, validate


@pytest.mark.parametrize("tpf", [1, 4, 390])
def test_video_layout_is_sink_recent_current_in_frames(tpf):
    case = make_video_case(1, tokens_per_frame=tpf, heads=2, kv_heads=1, head_dim=8)
    names = [(r.name, r.size) for r in case.layout]
    assert names == [("sink", 4 * tpf), ("recent", 6 * tpf), ("current", 6 * tpf)]
    assert case.keys == 16 * tpf and case.tokens_per_frame == tpf
    # queries are the current chunk's tokens, bidirectional: every query sees every key
    assert case.causal is False
    assert case.query_positions.tolist() == list(range(10 * tpf, 16 * tpf))
    # sink = the first frames of the video, recent = the frames just before the chunk (chunk 3 of 6 frames)
    assert case.meta["key_frames"] == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]


def test_study_size_option_390_tokens_per_frame():
    case = make_video_case(0, tokens_per_frame=390, heads=1, kv_heads=1, head_dim=8)
    assert case.keys == 6240 and case.q.shape[1] == 2340


def test_llm_layout_is_causal_with_a_current_chunk():
    case = make_llm_case(2, sink=4, middle=20, recent=8, current=12, heads=4, kv_heads=2)
    assert [(r.name, r.size) for r in case.layout] == [("sink", 4), ("middle", 20), ("recent", 8), ("current", 12)]
    assert case.causal is True and case.head_map == [0, 0, 1, 1]
    obs = observe(case)
    assert obs.rows["visible_keys"][0].tolist() == [float(p + 1) for p in case.query_positions.tolist()]


def test_deterministic_per_seed_and_different_across_seeds():
    a, b, c = make_video_case(5), make_video_case(5), make_video_case(6)
    assert torch.equal(a.q, b.q) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert not torch.equal(a.k, c.k)
    assert not torch.equal(make_video_case(5, chunk=3).k, make_video_case(5, chunk=4).k)


def test_heads_range_from_sharp_to_near_uniform():
    supports = torch.stack([observe(make_video_case(s)).rows["support"].median(dim=1).values for s in range(4)])
    conc = make_video_case(0).meta["head_concentration"]
    order = sorted(range(len(conc)), key=lambda h: -conc[h])
    med = supports.median(dim=0).values
    # the sharpest head is concentrated, the flattest near uniform, and support rises as concentration falls
    assert med[order[0]] < 0.10 and med[order[-1]] > 0.75
    assert all(med[order[i]] < med[order[i + 1]] for i in range(len(order) - 1))


def test_nearby_frames_draw_more_mass_than_far_ones():
    # for a moderately sharp head, the query frame's own frame and its neighbours beat distant recent frames
    heat = torch.stack([observe(make_video_case(s)).heatmap[1] for s in range(4)]).mean(0)  # [6 query, 16 key frames]
    for qf in range(6):
        own = 10 + qf
        assert heat[qf, own] == heat[qf].max()
    assert heat[0, 9] > heat[0, 4]  # the last recent frame (adjacent to the chunk) beats the first one


def test_sink_bonus_raises_sink_mass_over_its_content():
    without = observe(make_video_case(2, sink_logit=0.0)).rows["sink_mass"].mean()
    with_bonus = observe(make_video_case(2, sink_logit=2.0)).rows["sink_mass"].mean()
    assert with_bonus > without


def test_source_is_registered_and_validates_with_key_paths():
    assert SOURCES["synthetic_video"].validate is validate
    p = validate({"kind": "synthetic_video", "seeds": [1], "layouts": ["video", "llm"]}, "src")
    got = list(cases(p))
    assert [c.id for c in got] == ["video-s1-c3", "llm-s1"]
    with pytest.raises(ProtocolError, match=r"src\.chunks\[0\]"):
        validate({"kind": "synthetic_video", "seeds": [1], "layouts": ["video"], "chunks": [1]}, "src")
    with pytest.raises(ProtocolError, match=r"src\.layouts\[0\]"):
        validate({"kind": "synthetic_video", "seeds": [1], "layouts": ["film"]}, "src")
    with pytest.raises(ProtocolError, match=r"src\.kv_heads"):
        validate({"kind": "synthetic_video", "seeds": [1], "layouts": ["video"], "heads": 4, "kv_heads": 3}, "src")
