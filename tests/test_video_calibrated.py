"""The seed-calibrated video preset: per-head sink and current logits of testbed.sources.video, and
protocols/ablation_calibrated.json as fitted by tools/calibrate_video.py (docs/calibration.md)."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from testbed.metrics import observe
from testbed.protocol import ProtocolError
from testbed.sources.video import cases, make_video_case, validate
from tests._arrays import read
from tests._helpers import REPO

HAND_SET = REPO / "protocols" / "ablation.json"
CALIBRATED = REPO / "protocols" / "ablation_calibrated.json"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("calibrate_video", REPO / "tools" / "calibrate_video.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _logits(case) -> torch.Tensor:
    k = case.k.double().repeat_interleave(case.heads // case.k.shape[0], dim=0)
    return case.q.double() @ k.transpose(-1, -2) / math.sqrt(case.q.shape[-1])


# -- the hand-set generator is untouched ---------------------------------------------------------

def test_hand_set_preset_reproduces_the_archived_arrays_bit_for_bit():
    """protocols/ablation.json's video cases, with the new keys absent and given empty, are the q, k, v
    archived in evidence/ (made by the generator before sink_logits / current_logits existed)."""
    src = json.loads(HAND_SET.read_text())["source"]
    assert "sink_logits" not in src and "current_logits" not in src
    omitted = [c for c in cases(validate({**src, "layouts": ["video"]}, "src"))]
    empty = [c for c in cases(validate({**src, "layouts": ["video"], "sink_logits": [], "current_logits": []}, "src"))]
    assert [c.id for c in omitted] == [f"video-s{s}-c3" for s in src["seeds"]]
    for a, b in zip(omitted, empty):
        assert "sink_logits" not in a.meta and "current_logits" not in a.meta
        for name in ("q", "k", "v"):
            import io
            stored = np.load(io.BytesIO(read(REPO / "evidence", f"arrays/ablation/{a.id}/{name}.npy")), allow_pickle=False)
            assert torch.equal(getattr(a, name), torch.from_numpy(stored)), (a.id, name)
            assert torch.equal(getattr(a, name), getattr(b, name)), (a.id, name)


# -- what the per-head knobs do --------------------------------------------------------------------

def test_one_sink_logit_per_head_equal_to_the_global_one_gives_the_same_attention():
    a = make_video_case(4, heads=4, kv_heads=2, sink_logit=2.0)
    b = make_video_case(4, heads=4, kv_heads=2, sink_logit=0.0, sink_logits=[2.0] * 4)
    assert torch.equal(a.k[..., 1:], b.k[..., 1:]) and torch.equal(a.v, b.v) and torch.equal(a.q[..., 1:], b.q[..., 1:])
    assert torch.allclose(_logits(a), _logits(b), rtol=0, atol=1e-5)


def test_current_logits_add_their_bonus_to_the_current_keys_of_their_head_only():
    bonus = [-1.5, 0.0, 0.7, 3.0]
    a = make_video_case(6, heads=4, kv_heads=2, current_logits=[0.0] * 4)
    b = make_video_case(6, heads=4, kv_heads=2, current_logits=bonus)
    cur = a.region("current")
    want = torch.zeros(4, 1, a.keys, dtype=torch.float64)
    want[:, :, cur.start:cur.stop] = torch.tensor(bonus, dtype=torch.float64).view(4, 1, 1)
    assert torch.allclose(_logits(b) - _logits(a), want.expand_as(_logits(a)), rtol=0, atol=1e-5)
    assert b.meta["current_logits"] == bonus and "current_logits" not in make_video_case(6).meta


@pytest.mark.parametrize("knob,region", [("sink_logits", "sink"), ("current_logits", "current")])
def test_a_larger_bonus_on_one_head_raises_that_heads_region_mass_and_leaves_the_others(knob, region):
    base = [0.5, 0.5, 0.5, 0.5]
    masses, others = [], []
    for value in (0.0, 0.5, 1.0, 2.0, 4.0):
        knobs = {"sink_logits": list(base), "current_logits": list(base)}
        knobs[knob][2] = value
        rows = observe(make_video_case(3, heads=4, kv_heads=2, **knobs)).rows
        masses.append(float(rows[f"{region}_mass"][2].mean()))
        others.append(rows[f"{region}_mass"][[0, 1, 3]])
    assert all(x < y for x, y in zip(masses, masses[1:])), masses
    assert all(torch.equal(others[0], o) for o in others[1:])


# -- validation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("over,msg", [
    ({"sink_logits": [1.0, 2.0, 3.0]}, r"src\.sink_logits: 3 values for 4 heads"),
    ({"current_logits": [0.0] * 5}, r"src\.current_logits: 5 values for 4 heads"),
    ({"sink_logits": [1.0, "2", 3.0, 4.0]}, r"src\.sink_logits\[1\]: expected a number, got str"),
    ({"current_logits": [0.0, 0.0, True, 0.0]}, r"src\.current_logits\[2\]: expected a number, got bool"),
    ({"sink_logits": [1.0, -0.5, 1.0, 1.0]}, r"src\.sink_logits\[1\]: -0\.5 is outside \[0\.0, 100\.0\]"),
    ({"current_logits": [0.0, 0.0, 0.0, 101.0]}, r"src\.current_logits\[3\]: 101\.0 is outside \[-100\.0, 100\.0\]"),
    ({"current_logits": [0.0, float("nan"), 0.0, 0.0]}, r"src\.current_logits\[1\]: expected a number"),
    ({"sink_logits": 1.0}, r"src\.sink_logits: expected list"),
    ({"current_logits": [1.0, 1.0], "heads": 2, "kv_heads": 1, "llm_kv_heads": 1, "head_dim": 2},
     r"src\.head_dim: current_logits need head_dim >= 3"),
])
def test_bad_per_head_logits_are_refused_by_key(over, msg):
    with pytest.raises(ProtocolError, match=msg):
        validate({"kind": "synthetic_video", "seeds": [1], "layouts": ["video"], "heads": 4, "kv_heads": 2, **over}, "src")


def test_repeated_values_are_allowed_and_the_generator_refuses_bad_lengths_too():
    p = validate({"kind": "synthetic_video", "seeds": [1], "layouts": ["video"], "heads": 2, "kv_heads": 1,
                  "sink_logits": [1, 1], "current_logits": [-2.0, -2.0]}, "src")
    assert list(cases(p))[0].meta["sink_logits"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="sink_logits: 1 values for 2 heads"):
        make_video_case(1, heads=2, kv_heads=1, sink_logits=[1.0])


# -- the calibrated preset -------------------------------------------------------------------------

def test_targets_are_the_seed_studys_figures(tool):
    """The tool's transcription of the record table reproduces the study's own headline means."""
    assert len(tool.RECORDS) == 42 and len({r[0] for r in tool.RECORDS}) == 42
    for rec in tool.RECORDS:
        assert abs(sum(rec[5:8]) - 100.0) <= 0.02, rec
    # the study's headline region masses (13.98 / 26.03 / 59.99 %) and row-level support figures
    assert [tool.TARGETS[f"{r} mass"] for r in ("sink", "recent", "current")] == [13.98, 26.03, 59.99]
    assert [tool.TARGETS[q] for q in ("support<=10%", "support<=25%", "support>=75%", "median support")] == \
        [53.85, 65.23, 17.84, 6.76]


def _pooled(cases_) -> dict:
    """The calibrated quantities, from a float64 softmax written here (not testbed.metrics)."""
    sink, recent, current, support = [], [], [], []
    for case in cases_:
        p = torch.softmax(_logits(case), dim=-1)
        support.append(torch.exp(-(p * torch.log(p)).sum(-1)).flatten() / case.keys)
        for name, out in (("sink", sink), ("recent", recent), ("current", current)):
            r = case.region(name)
            out.append(p[..., r.start:r.stop].sum(-1).flatten())
    s = torch.cat(support)
    return {"sink mass": 100 * float(torch.cat(sink).mean()), "recent mass": 100 * float(torch.cat(recent).mean()),
            "current mass": 100 * float(torch.cat(current).mean()),
            "support<=10%": 100 * float((s <= 0.10).double().mean()), "support<=25%": 100 * float((s <= 0.25).double().mean()),
            "support>=75%": 100 * float((s >= 0.75).double().mean()), "median support": 100 * float(s.median())}


# percentage points: the held-out error of 8 seeds (3,072 rows) is within these on the fitted knobs,
# while the hand-set preset misses every quantity by more
TOLERANCE = {"sink mass": 1.5, "recent mass": 1.5, "current mass": 1.5, "support<=10%": 3.0, "support<=25%": 3.0,
             "support>=75%": 3.0, "median support": 1.5}


def test_calibrated_protocol_matches_the_seed_targets_on_held_out_seeds(tool):
    proto = json.loads(CALIBRATED.read_text())
    src = proto["source"]
    held = tool.HELD_OUT_SEEDS[:8]
    assert not set(held) & set(tool.FIT_SEEDS) and not set(src["seeds"]) & set(tool.FIT_SEEDS)
    got = _pooled(cases(validate({**src, "seeds": held}, "src")))
    off = {q: round(got[q] - tool.TARGETS[q], 2) for q in TOLERANCE if abs(got[q] - tool.TARGETS[q]) > TOLERANCE[q]}
    assert not off, f"held-out error beyond tolerance (points): {off}"
    # the test can fail: the hand-set preset, on the same seeds, is outside the tolerance on every quantity
    hand = json.loads(HAND_SET.read_text())["source"]
    base = _pooled(cases(validate({**hand, "layouts": ["video"], "seeds": held}, "src")))
    assert all(abs(base[q] - tool.TARGETS[q]) > TOLERANCE[q] for q in TOLERANCE), base


def test_calibrated_protocol_is_the_hand_set_video_study_with_the_fitted_generator(tool):
    proto, hand = json.loads(CALIBRATED.read_text()), json.loads(HAND_SET.read_text())
    src = proto["source"]
    assert proto["default"] is False and src["layouts"] == ["video"] and src["seeds"] == tool.PROTOCOL_SEEDS
    assert {k: src[k] for k in tool.GENERATOR} == tool.GENERATOR
    assert {k: hand["source"][k] for k in ("tokens_per_frame", "sink_frames", "recent_frames", "current_frames", "rho",
                                             "chunks")} == {k: src[k] for k in ("tokens_per_frame", "sink_frames",
                                                                                "recent_frames", "current_frames", "rho",
                                                                                "chunks")}
    assert all(len(src[k]) == src["heads"] for k in ("concentrations", "sink_logits", "current_logits"))
    want = json.loads(json.dumps(hand["analyses"]))
    want["ablation"]["ablations"].remove("drop_middle")  # the video layout has no middle
    assert proto["analyses"] == want and proto["audit"] == hand["audit"]
    assert "hand-set" in proto["description"] and "hand-set preset" in hand["description"]
