"""The selective rule with its dense pairs stored quantized (storage ``middle`` on a selective
selection: ``Policy.dense``; issue 45's int4 variant).

- inside a tiny random Llama: every pair dense at int4 is uniform KIVI int4 (no sink, the same window
  and groups) to float32 rounding, and its bytes are KIVI's plus one class byte per pair; the decode
  cut at the dense storage's flushes (``next_change``) is one token per forward; a sequence with no
  dense pair at the evidence layer stores no dense payload while another sequence's is stored; at share 1/2
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


def _chunked(model, pol, ids, prefill):
    """Log-probs through ``pol``'s cache with the decode cut where the live study cuts it: each forward as
    many tokens as ``Policy.next_change`` allows (the append that flushes a group ends a forward)."""
    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention

    cache = PolicyCache.for_model(pol, model.config)
    out, n, forwards = [], prefill, 0
    with torch.no_grad(), policy_attention(model):
        out.append(model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits[:, -1:])
        cache.finish_prefill()
        while n < ids.shape[1]:
            c = int(min(pol.next_change(n), ids.shape[1] - n))
            out.append(model(input_ids=ids[:, n:n + c], cache=cache, use_cache=True).logits)
            n, forwards = n + c, forwards + 1
    return torch.log_softmax(torch.cat(out, 1), -1), forwards


def test_a_chunk_cut_at_the_dense_storages_flushes_is_one_token_per_forward():
    # 30 decode tokens after a 48-token prefill, R 8, G 16: the dense storage flushes at 56, 72 and 88 tokens
    model = _llama()
    P, T = 48, 30
    ids = _ids(5, P, T)
    for share in (0.0, 0.5):
        pol = _sel(keep=7, share=share, dense="int4", dense_window=8, group=16)
        chunked, forwards = _chunked(model, pol, ids, P)
        step, _, _ = _run(model, pol, ids, P, step=True)
        assert forwards == 3  # 48 -> 56 -> 72 -> 78 (the last forward ends the segment): cut at every flush
        assert torch.allclose(chunked, step, atol=1e-5, rtol=0), share
    kivi, _, _ = _run(model, Policy("kivi", "int4", 0, 8, 16), ids, P, step=True)
    assert torch.allclose(_chunked(model, _sel(share=0.0, dense="int4", dense_window=8, group=16), ids, P)[0], kivi,
                          atol=1e-5, rtol=0)
    # one chunk for all 30 tokens attends tokens a flush would have packed as float32: not the same numbers
    whole, _, _ = _run(model, _sel(share=0.0, dense="int4", dense_window=8, group=16), ids, P)
    assert not torch.allclose(whole, kivi, atol=1e-4, rtol=0)


def test_a_sequence_without_a_dense_pair_at_the_evidence_layer_stores_no_dense_payload():
    # a batch of 4: find a layer where row 0 has every pair sparse and another row a dense one
    model = _llama()
    P, T = 48, 3
    pol = _sel(keep=7, share=0.5, dense="int4", dense_window=8, group=16)
    found = 0
    for seed in range(8):
        _, cache, _ = _run(model, pol, _ids(seed, P, T, b=4), P)
        sparse = cache.sel_sparse  # [B, L, H]
        for layer in range(sparse.shape[1]):
            if bool(sparse[0, layer].all()) and not bool(sparse[1:, layer].all()):
                assert cache.layers[layer].dense_store is not None  # another sequence's dense pair is stored
                ev = cache.layers[layer].evidence()
                assert not [k for k in ev if k.startswith("dense.")], "row 0 has no dense pair at this layer"
                found += 1
            elif not bool(sparse[0, layer].all()):
                ev = cache.layers[layer].evidence()
                assert ev["dense.key.codes"].shape[0] == int((~sparse[0, layer]).sum())
    assert found, "no layer of these batches has row 0 all sparse beside a dense pair elsewhere"


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
    # int2 dense pairs at 2k cost less than a sparse pair keeping 128 and the 256 decode tokens float32:
    # no share of sparse pairs saves anything, and both sides say so
    from testbed.audit_checks.live_policies import selective_budget as audit_budget

    cheap = {**entry, "storage": {"middle": "int2"}}
    with pytest.raises(ValueError, match="making pairs sparse saves nothing"):
        declared(cheap, window=128, group=32, evict_window=256, budget=budget)
    with pytest.raises(ValueError, match="cannot meet a budget by making pairs sparse"):
        declared_policy(cheap, live)
    with pytest.raises(ValueError, match="cannot meet a budget by making pairs sparse"):
        audit_budget({"fp16_fraction": 0.3}, 128, live, {**mine, "dense": "int2"})


ARMS = [{"name": n, "selection": {"kind": "knorm", "mode": "prefill", "keep": 8, "heads": "selective", "alloc": a},
         "storage": {"middle": "int4"}, "budget": {"fp16_fraction": 0.51}}
        for n, a in (("dense_conc", "concentrated"), ("dense_rand", "random"))]


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    # evidence at layer 4, where the rule makes some pairs sparse and some dense
    # 40 steps: the dense storage (R 16, G 16) flushes at 176 and 192 tokens, so the decode is cut there
    return tiny_live_run(tmp_path_factory, "selective_dense_tiny", ARMS, prefill=160, steps=40, budget_tolerance=0.1,
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
