"""The selective rule with its dense pairs stored quantized (storage ``middle`` on a selective
selection: ``Policy.dense``; issue 45's int4 variant).

- inside a tiny random Llama: every pair dense at int4 is uniform KIVI int4 (no sink, the same window
  and groups) to float32 rounding, and its bytes are KIVI's plus one class byte per pair; at share 1/2
  the bytes after every forward are the closed form stated here, a dense pair's share read off a
  uniform int4 cache run beside it; the dense pairs attend their tokens decoded (the log-probs move
  from the float32-dense rule's);
- a declared arm: the dense fields in the config only when set, the window the protocol's, the
  budget's share of sparse pairs the audit's own; bad input refused;
- end to end on SmolLM2 (slow): the rule and its random control with int4 dense pairs pass the audit
  at equal bytes, and a forged dense payload or float32 K/V left in a dense pair's slots fail it.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from testbed.policies.budget import selective_budget
from testbed.policies.compose import declared
from testbed.policies.policy import Policy
from tests import _arrays
from tests._helpers import audited_rows, rows_by_arm, tiny_live_run
from tests.test_selective_live import _ids, _llama, _rewrite, _run, _sel

SMOL = dict(layers=30, kv_heads=3, head_dim=64)


def test_every_pair_dense_at_int4_is_uniform_kivi_int4():
    model = _llama()  # 4 layers, 2 KV heads, head dim 16
    P, T = 48, 6
    ids = _ids(2, P, T)
    lp, _, nbytes = _run(model, _sel(share=0.0, dense="int4", dense_window=8, group=16), ids, P, step=True)
    ref, _, ref_bytes = _run(model, Policy("kivi", "int4", 0, 8, 16), ids, P, step=True)
    assert torch.allclose(lp, ref, atol=1e-5, rtol=0)
    assert [a - b for a, b in zip(nbytes, ref_bytes)] == [4 * 2] * len(nbytes)  # one class byte per pair
    flat, _, _ = _run(model, _sel(share=0.0), ids, P, step=True)  # float32 dense pairs: not the same numbers
    assert not torch.allclose(lp, flat, atol=1e-3, rtol=0)


def test_half_the_pairs_sparse_with_int4_dense_pairs_costs_the_closed_form():
    model = _llama()
    P, T, keep = 48, 5, 7
    ids = _ids(3, P, T)
    pol = _sel(keep=keep, share=0.5, dense="int4", dense_window=8, group=16)
    lp, cache, nbytes = _run(model, pol, ids, P, step=True)
    _, _, kivi = _run(model, Policy("kivi", "int4", 0, 8, 16), ids, P, step=True)
    sparse = cache.sel_sparse[0]  # [L, H]
    m, pairs = int(sparse.sum()), sparse.numel()
    assert m == 4
    for n, got, whole in zip(range(P, P + T + 1), nbytes, kivi):
        per_dense = (whole - 4 * 16) // pairs  # a KIVI int4 cache's bytes less its headers, per (layer, KV head)
        assert (whole - 4 * 16) % pairs == 0
        want = 4 * 16 + pairs + m * (keep + n - P) * (8 * 16 + 8) + (pairs - m) * per_dense
        assert got == want, n
        assert got == pol.cache_bytes(n, 4, 2, 16, P)
    flat, _, _ = _run(model, _sel(keep=keep, share=0.5), ids, P, step=True)
    assert torch.equal(cache.sel_sparse, _run(model, _sel(keep=keep, share=0.5), ids, P)[1].sel_sparse)
    assert not torch.allclose(lp, flat, atol=1e-4, rtol=0)  # the dense pairs read int4, the classes the same


def test_a_declared_dense_storage_and_its_budget():
    from testbed.audit_checks.live_policies import declared_policy, policy_bytes

    P, T = 1792, 256
    budget = dict(prefill=P, steps=T, **SMOL, tolerance=0.01)
    entry = {"name": "sel", "selection": {"kind": "snapkv", "mode": "prefill", "keep": 128, "heads": "selective",
                                          "alloc": "concentrated"},
             "storage": {"middle": "int4"}, "budget": {"fp16_fraction": 0.4}}
    pol = declared(entry, window=128, group=32, evict_window=256, budget=budget)
    cfg = pol.config()
    assert (cfg["dense"], cfg["dense_window"], cfg["group"]) == ("int4", 128, 32) and "store" not in cfg
    live = {"model": "SmolLM2-135M-Instruct.Q4_1", "prefill": P, "steps": T, "window": 128, "group": 32,
            "evict_window": 256}
    mine = declared_policy(entry, live)
    assert {k: v for k, v in mine.items() if not k.startswith("_")} == \
        {k: v for k, v in cfg.items() if k not in ("name", "description")}
    n = P + T
    target = 0.4 * n * 30 * 2 * 3 * 64 * 2
    got = pol.cache_bytes(n, 30, 3, 64, P)
    assert got == policy_bytes(mine, n, SMOL) and got <= target and (target - got) / target <= 0.01
    m = pol.sparse_count(90)
    assert 0 < m < 90  # int4 dense pairs alone are over 0.4 of float16's, every pair sparse under it
    assert pol.with_(sparse_share=(m - 1) / 90).cache_bytes(n, 30, 3, 64, P) > target  # the fewest that fit
    # float32 dense pairs at the same budget need nearly every pair sparse
    flat, _ = selective_budget({"fp16_fraction": 0.4}, 128, prefill=P, steps=T, **SMOL)
    assert flat > pol.sparse_share and round(flat * 90) >= 88
    # no dense storage on a selection that is not selective; no window without a dense storage
    with pytest.raises(ValueError, match="dense .* on a selective selection"):
        Policy("x", "drop", scorer="knorm", scorer_mode="prefill", keep=4, dense="int4")
    with pytest.raises(ValueError, match="dense_window belongs to a stored dense class"):
        _sel(dense_window=8)
    with pytest.raises(ValueError, match="dense .* must be one of"):
        _sel(dense="int5")
    with pytest.raises(ValueError, match="dense_window must be a non-negative integer"):
        _sel(dense="int4", dense_window=-1)
    with pytest.raises(ValueError, match="belong to a scored selection"):
        Policy("x", "int4", 0, 8, 16, dense="int4")


ARMS = [{"name": n, "selection": {"kind": "knorm", "mode": "prefill", "keep": 20, "heads": "selective", "alloc": a},
         "storage": {"middle": "int4"}, "budget": {"fp16_fraction": 0.45}}
        for n, a in (("dense_conc", "concentrated"), ("dense_rand", "random"))]


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    # evidence at layer 4, where the rule makes some pairs sparse and some dense
    return tiny_live_run(tmp_path_factory, "selective_dense_tiny", ARMS, prefill=160, steps=16, budget_tolerance=0.1,
                         evidence_layer=4)


@pytest.mark.slow
def test_int4_dense_arms_pass_the_audit_at_equal_bytes(dense_run):
    rows = audited_rows(dense_run)
    assert rows["dense_conc"]["bytes_final"] == rows["dense_rand"]["bytes_final"]
    sparse = _arrays.load(dense_run, rows["dense_conc"]["arrays"]["select_sparse"])
    assert 0 < int(sparse.sum()) < sparse.size
    ev = {k: _arrays.load(dense_run, v) for k, v in rows["dense_conc"]["evidence"]["arrays"].items()}
    dense = ev["kept.sparse"] == 0
    assert 0 < int(dense.sum()) < dense.size, "the evidence layer does not hold both classes"
    assert not np.any(ev["float.k"][dense]) and ev["dense.key.codes"].shape[0] == int(dense.sum())


def _forge(dense_run, tmp_path, name, change):
    from testbed.audit import audit

    run = tmp_path / "copy"
    shutil.copytree(dense_run, run)
    ev = rows_by_arm(run)["dense_conc"]["evidence"]["arrays"]
    x = _arrays.load(run, ev[name]).copy()
    change(x, {k: _arrays.load(run, v) for k, v in ev.items()})
    _rewrite(run, ev[name], x)
    ok, failures, _ = audit(run)
    return ok, " ".join(failures)


@pytest.mark.slow
def test_a_forged_dense_payload_fails_the_audit(dense_run, tmp_path):
    def flip(x, ev):
        x.flat[0] ^= 0x11

    ok, text = _forge(dense_run, tmp_path, "dense.key.codes", flip)
    assert not ok and "dense_conc" in text and "dense heads" in text


@pytest.mark.slow
def test_float32_tokens_in_a_stored_dense_pair_fail_the_audit(dense_run, tmp_path):
    def fill(x, ev):  # the dense head's float32 K written into its slots: more than the bytes say
        hh = int(np.flatnonzero(ev["kept.sparse"] == 0)[0])
        x[hh] = ev["input.k"][hh, : x.shape[1]]

    ok, text = _forge(dense_run, tmp_path, "float.k", fill)
    assert not ok and "stored dense head" in text
