"""The selective rule in the ablation harness (analysis ``selective``): its classification, its
equal kept keys across the rule and its controls, the reversed rule as the complement, its rel-L2
against an independent masked softmax, and an audit that fails a forged class."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from testbed.analyses.selective import arm_units, classify, sparse_count
from testbed.audit import audit
from testbed.case import Case, Region
from testbed.sources.traces import save_trace

from . import _arrays
from ._helpers import copy_run, forge_array, forge_results, run_main

D, TK, TQ = 32, 32, 8


def _case(case_id: str, heads: list[str], seed: int = 0) -> Case:
    """One query head per entry of ``heads`` (each its own KV head), orthonormal keys: "onehot"
    queries point at one key with a large norm, "uniform" queries are zero, "mixed" random."""
    g = torch.Generator().manual_seed(seed)
    h = len(heads)
    k = torch.eye(TK, D).expand(h, TK, D).contiguous()
    v = torch.randn(h, TK, D, generator=g)
    q = torch.zeros(h, TQ, D)
    for i, kind in enumerate(heads):
        if kind == "onehot":
            for t in range(TQ):
                q[i, t, (3 * t + i) % TK] = 200.0
        elif kind == "mixed":
            q[i] = 3.0 * torch.randn(TQ, D, generator=g)
    return Case(case_id, q, k, v, torch.arange(TQ) + (TK - TQ), True,
                (Region("middle", 0, TK - TQ), Region("current", TK - TQ, TK)), meta={"seed": seed})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("selective")
    cases = [_case(f"c{s}", ["onehot", "uniform", "mixed", "onehot"], seed=s) for s in range(3)]
    save_trace(base / "cases.safetensors", cases)
    proto = {"name": "selective_test", "source": {"kind": "trace", "files": ["cases.safetensors"]},
             "analyses": {"selective": {"unit": "kv_head", "keep_percent": 25, "budget": 0.6, "random_draws": 3}},
             "timing": {"repeats": 0}}
    (base / "p.json").write_text(json.dumps(proto))
    assert run_main(["--quiet", "--out", str(base / "run"), "--protocol", str(base / "p.json")]) == 0
    return base / "run", {c.id: c for c in cases}


def _rows(run_dir):
    return json.loads((run_dir / "results.json").read_text())["rows"]


def test_one_hot_head_is_concentrated_and_uniform_head_diffuse(run):
    for r in _rows(run[0]):
        assert r["classes"][0] == r["classes"][3] == "concentrated"
        assert r["classes"][1] == "diffuse"
        assert r["support_medians"][1] == pytest.approx(1.0, abs=1e-12)   # uniform over its visible keys
        assert r["support_medians"][0] < 2.0 / (TK - TQ + 1)                # about one key of >= 25 visible


def test_classify_at_the_threshold():
    assert classify([0.1, 0.1000001, 0.0, 1.0], 0.1) == ["concentrated", "diffuse", "concentrated", "diffuse"]


def test_equal_kept_keys_across_rule_and_controls(run):
    run_dir, cases = run
    rows = _rows(run_dir)
    for cid, case in cases.items():
        sel = [r for r in rows if r["case"] == cid]
        assert {r["arm"] for r in sel} == {"rule", "random", "reversed"} and len(sel) == 5
        top = np.unpackbits(_arrays.load(run_dir, sel[0]["arrays"]["topk"]), axis=-1, count=TK).astype(bool)
        vis = np.arange(TK)[None, :] <= case.query_positions.numpy()[:, None]
        counted = set()
        for r in sel:
            assert len(r["sparse_units"]) == r["sparse"] > 0
            keep = np.broadcast_to(vis, top.shape).copy()
            keep[r["sparse_units"]] = top[r["sparse_units"]]
            counted.add(int(keep.sum()))
            assert int(keep.sum()) == r["kept_keys"]
        assert len(counted) == 1                               # the same keys in number, whichever heads
        assert abs(next(iter(counted)) / vis.sum() / 4 - 0.6) < 0.15


def test_reversed_rule_is_the_complement():
    medians = [0.02, 0.9, 0.5, 0.05, 0.3, 0.7]
    rule = arm_units("rule", medians, 3, "x")
    rev = arm_units("reversed", medians, 3, "x")
    assert rule == [0, 3, 4] and sorted(rule + rev) == list(range(6))
    for n in range(4):  # disjoint whenever 2n <= units
        assert not set(arm_units("rule", medians, n, "x")) & set(arm_units("reversed", medians, n, "x"))
    draws = {tuple(arm_units("random", medians, 3, "x", 0, d)) for d in range(20)}
    assert len(draws) > 1 and all(len(d) == 3 for d in draws)
    assert list(draws)[0] in {tuple(sorted(random.Random(f"selective:0:x:{d}").sample(range(6), 3))) for d in range(20)}


def test_sparse_count_is_nearest_the_budget():
    # 4 units, 100 visible and 10 top-k keys per head: shares 1, 0.775, 0.55, 0.325, 0.1
    assert [sparse_count(4, 100, 10, b) for b in (1.0, 0.8, 0.6, 0.3, 0.0)] == [0, 1, 2, 3, 4]


def test_rel_l2_against_an_independent_masked_softmax(run):
    run_dir, cases = run
    for r in _rows(run_dir):
        case = cases[r["case"]]
        s = torch.einsum("hqd,hkd->hqk", case.q.double(), case.k.double()) / math.sqrt(D)
        vis = torch.arange(TK)[None, :] <= case.query_positions[:, None]
        s = s.masked_fill(~vis, float("-inf"))
        p = torch.softmax(s, dim=-1)
        full = p @ case.v.double()
        k = torch.clamp((r["keep_percent"] * vis.sum(-1) + 99) // 100, min=1)
        out = full.clone()
        for hh in r["sparse_units"]:
            order = torch.argsort(-p[hh], dim=-1, stable=True)
            keep = torch.zeros_like(vis)
            for t in range(TQ):
                keep[t, order[t, :k[t]]] = True
            pk = torch.where(keep, p[hh], torch.zeros_like(p[hh]))
            out[hh] = (pk / pk.sum(-1, keepdim=True)) @ case.v[hh].double()
        want = float((out - full).norm() / full.norm())
        assert r["rel_l2"] == pytest.approx(want, rel=1e-9, abs=1e-14)
    # the rule sparsifies the one-hot heads: almost no damage; the reversed rule the uniform one
    for cid in cases:
        rule = next(r for r in _rows(run_dir) if r["case"] == cid and r["arm"] == "rule")
        rev = next(r for r in _rows(run_dir) if r["case"] == cid and r["arm"] == "reversed")
        assert rule["sparse_units"] == [0, 3] and 1 in rev["sparse_units"]
        assert rule["rel_l2"] < 1e-6 < rev["rel_l2"]


def test_the_run_passes_its_audit(run):
    ok, fails, _ = audit(run[0], check_sources=False)
    assert ok, fails[:5]


def test_a_forged_class_fails_the_audit(run, tmp_path):
    """A forger calls the uniform head concentrated and the rule's choice follows it: classes,
    counts, sparse units and the rel-L2 of the arm that sparsifies those units, all consistent."""
    run_dir = copy_run(run[0], tmp_path / "r")
    res = json.loads((run_dir / "results.json").read_text())
    i = next(i for i, r in enumerate(res["rows"]) if r["arm"] == "rule")
    row = res["rows"][i]
    rev = next(r for r in res["rows"] if r["case"] == row["case"] and r["arm"] == "reversed")
    row["classes"] = ["concentrated"] * 4
    row["concentrated"] = 4
    row["sparse_units"] = rev["sparse_units"]
    row["sparse_concentrated"] = len(rev["sparse_units"])
    row["rel_l2"], row["rel_l2_heads"] = rev["rel_l2"], rev["rel_l2_heads"]
    forge_results(run_dir, res)
    ok, fails, _ = audit(run_dir, check_sources=False)
    assert not ok
    assert any(f"row {i} " in f and "classes" in f for f in fails), fails[:5]
    assert any(f"row {i} " in f and "sparse_units" in f for f in fails), fails[:5]


def test_a_forged_top_k_set_fails_the_audit(run, tmp_path):
    """The stored top-k set of one query swaps its heaviest kept key for a lighter key it left out
    (the array re-hashed in the manifest): the audit finds a set that is not a top-k set."""
    run_dir = copy_run(run[0], tmp_path / "r")
    rows = _rows(run_dir)
    rel = rows[0]["arrays"]["topk"]
    case = run[1][rows[0]["case"]]
    s = case.q[2, 0].double() @ case.k[2].double().T
    vis = np.arange(TK) <= int(case.query_positions[0])

    def edit(x):
        bits = np.unpackbits(x[2, 0], count=TK).astype(bool)
        kept = np.flatnonzero(bits)
        out = np.flatnonzero(vis & ~bits)
        heavy = kept[np.argmax(s.numpy()[kept])]
        light = out[np.argmin(s.numpy()[out])]
        bits[heavy], bits[light] = False, True
        x[2, 0] = np.packbits(bits)

    forge_array(run_dir, rel, edit)
    ok, fails, _ = audit(run_dir, check_sources=False)
    assert not ok and any("arrays.topk" in f and "not a top-k set" in f for f in fails), fails[:5]
