"""Structured blocks (selection ``block`` B): a prefill cut to its top ``keep / B`` blocks of B tokens.

Stated here from the definition, not read back from the code: blocks are B consecutive prefill
tokens from position 0; a block's score is the sum of its tokens' scores (the policy's newest
``window`` tokens ranked above every score); the ``keep / B`` blocks of largest sum are kept (ties
to the earlier block) and every later token; the cache stores every held token's float32 K and V and
one int32 index and one float32 score per block of B held tokens (rounded up). So (1) the kept set is
the test's own top blocks of knorm's scores (minus each key's norm); (2) the bytes follow that
closed form after every token; (3) bad declarations are refused by name; (4) end to end on SmolLM2
the audit passes block arms and fails a kept set that is not whole blocks, or not the top blocks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.policies import Policy
from testbed.policies.compose import declared
from testbed.policies.scorers import keep_blocks
from tests import _arrays
from tests._helpers import forge_array, tiny_llama, audited_rows, tiny_live_run


def _brute(score: np.ndarray, keep: int, b: int) -> np.ndarray:
    """Every row's kept positions by the definition: block sums, the largest keep / b, ties to the earlier block."""
    out = []
    for row in score.reshape(-1, score.shape[-1]):
        sums = [(float(np.sum(row[i:i + b], dtype=np.float64)), i // b) for i in range(0, row.size, b)]
        top = sorted(sorted(sums, key=lambda s: (-s[0], s[1]))[:keep // b], key=lambda s: s[1])
        out.append([j * b + t for _, j in top for t in range(b)])
    return np.array(out).reshape(*score.shape[:-1], -1)


@settings(max_examples=60, deadline=None)
@given(b=st.sampled_from([2, 4, 8]), blocks=st.integers(2, 12), k=st.integers(1, 11), heads=st.integers(1, 3),
       seed=st.integers(0, 2**31 - 1), ties=st.booleans())
def test_keep_blocks_is_the_top_summed_blocks(b, blocks, k, heads, seed, ties):
    rng = np.random.default_rng(seed)
    k = min(k, blocks - 1)
    score = rng.integers(-3, 4, size=(heads, blocks * b)) if ties else rng.standard_normal((heads, blocks * b))
    got = keep_blocks(torch.tensor(score, dtype=torch.float32), k * b, b)
    assert np.array_equal(got.numpy(), _brute(score.astype(np.float32), k * b, b))
    with pytest.raises(ValueError, match="whole blocks"):
        keep_blocks(torch.zeros(heads, blocks * b + 1), k * b, b)


def _llama(layers=2, heads=4, kv=2, d=16, seed=1):
    return tiny_llama(layers, heads, kv, d, seed)


@pytest.mark.parametrize("block, keep, window", [(8, 48, 0), (16, 64, 5)])
def test_the_kept_set_and_the_bytes_follow_the_definition(block, keep, window):
    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention

    model = _llama()
    P, T, L, H, D = 128, 21, 2, 2, 16
    ids = torch.randint(0, 256, (2, P + T), generator=torch.Generator().manual_seed(5))
    pol = Policy("kb", "drop", 0, window, scorer="knorm", scorer_mode="prefill", keep=keep, block=block)
    cache = PolicyCache.for_model(pol, model.config)
    rec = PolicyCache.for_model(Policy("f", "float32"), model.config)
    with torch.no_grad(), policy_attention(model):
        model(input_ids=ids[:, :P], cache=cache, use_cache=True)
        model(input_ids=ids[:, :P], cache=rec, use_cache=True)
        for i in range(P, P + T):
            held = keep + i - P
            want = L * (16 + H * (held * 2 * D * 4 + -(-held // block) * 8))
            assert cache.stored_bytes() == want == pol.cache_bytes(i, L, H, D, prefill=P)
            model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True)
    # layer 0's keys are the embeddings' in both runs: knorm's score is minus each key's norm
    k = rec.layers[0].tail_k[..., :P, :]
    score = -k.norm(dim=-1)
    if window:
        score[..., P - window:] = float("inf")
    want = _brute(score.numpy(), keep, block)
    kept = cache.layers[0].kept_index
    assert np.array_equal(kept[..., :keep].numpy(), want)
    assert torch.equal(kept[..., keep:], torch.arange(P, P + T).expand(2, H, T))
    # a block of B tokens is kept whole or not at all, and the per-token top differs (the structure binds)
    from testbed.policies.scorers import keep_top

    assert not torch.equal(keep_top(score, keep), torch.from_numpy(want))


@pytest.mark.parametrize("sel, match", [
    ({"kind": "knorm", "mode": "prefill", "keep": 40, "block": 16}, "multiple of block"),
    ({"kind": "knorm", "mode": "prefill", "keep": 48, "block": 12}, "power of two"),
    ({"kind": "knorm", "mode": "online", "keep": 48, "block": 16}, "prefill cut"),
    ({"kind": "knorm", "mode": "prefill", "keep": 48, "block": 16, "heads": "adaptive"}, "prefill cut"),
    ({"kind": "sink_window", "sink": 4, "block": 16}, "belong to a scored selection"),
])
def test_bad_block_selections_are_refused(sel, match):
    with pytest.raises(ValueError, match=match):
        declared({"name": "b", "selection": sel}, window=16, group=16, evict_window=16)


def test_a_block_selection_takes_keep_not_a_budget():
    budget = dict(prefill=160, steps=16, layers=30, kv_heads=3, head_dim=64)
    with pytest.raises(ValueError, match="keeps whole blocks"):
        declared({"name": "b", "selection": {"kind": "knorm", "mode": "prefill", "block": 16},
                  "budget": {"fp16_fraction": 0.5}}, window=16, group=16, evict_window=16, budget=budget)


# -- end to end on SmolLM2 ---------------------------------------------------------------------------

ARMS = [{"name": "knorm_b16", "selection": {"kind": "knorm", "mode": "prefill", "keep": 64, "block": 16}},
        {"name": "snapkv_b32", "selection": {"kind": "snapkv", "mode": "prefill", "keep": 96, "block": 32}},
        {"name": "ea_b16", "selection": {"kind": "expected_attention", "mode": "prefill", "keep": 64, "block": 16}},
        {"name": "knorm_tok", "selection": {"kind": "knorm", "mode": "prefill", "keep": 64}}]


@pytest.fixture(scope="module")
def block_run(tmp_path_factory):
    return tiny_live_run(tmp_path_factory, "blocks_tiny", ARMS, prefill=160, steps=16)


@pytest.mark.slow
def test_block_arms_pass_the_audit(block_run):
    rows = audited_rows(block_run)
    for arm, keep, b in (("knorm_b16", 64, 16), ("snapkv_b32", 96, 32), ("ea_b16", 64, 16)):
        assert rows[arm]["policy"]["block"] == b
        held = keep + 16
        assert rows[arm]["bytes_final"] == 30 * (16 + 3 * (held * 512 + -(-held // b) * 8))
    # the same kept count per token pays an index and a score per token: more bytes
    assert rows["knorm_tok"]["bytes_final"] == 30 * (16 + 3 * 80 * 520) > rows["knorm_b16"]["bytes_final"]
    assert "block" not in rows["knorm_tok"]["policy"]
    from testbed.report_html import policy_family

    # each block size its own family on the frontier figure (the audit's own rule re-derives it: passed above)
    assert [policy_family(rows[a]) for a in ("knorm_b16", "snapkv_b32", "knorm_tok")] == \
        ["knorm (prefill, blocks of 16)", "snapkv (prefill, blocks of 32)", "knorm (prefill)"]


@pytest.mark.slow
@pytest.mark.parametrize("forgery", ["worst_block", "split_block"])
def test_a_forged_block_set_fails(block_run, tmp_path, forgery):
    """A consistent forger: head 0's kept set changed, and its kept K/V and scores rewritten from the recorded
    inputs at the new indices (``worst_block``: its best kept block swapped for its worst dropped one;
    ``split_block``: one token of a kept block swapped for the next dropped token)."""
    from testbed.audit import audit

    run = Path(shutil.copytree(block_run, tmp_path / "run"))
    row = next(r for r in json.loads((run / "results.json").read_text())["rows"] if r["arm"] == "knorm_b16"
               and "evidence" in r)
    ev = row["evidence"]["arrays"]
    idx = _arrays.load(run, ev["kept.index"]).copy()
    k, v = _arrays.load(run, ev["input.k"]), _arrays.load(run, ev["input.v"])
    score = -np.linalg.norm(k.astype(np.float64), axis=-1).astype(np.float32)
    pre = idx[0][idx[0] < 160]
    kept_blocks = np.unique(pre // 16)
    dropped = np.setdiff1d(np.arange(10), kept_blocks)
    sums = score[0, :160].reshape(10, 16).sum(1)
    if forgery == "worst_block":
        best, worst = kept_blocks[np.argmax(sums[kept_blocks])], dropped[np.argmin(sums[dropped])]
        new = np.sort(np.concatenate([pre[pre // 16 != best], worst * 16 + np.arange(16)]))
    else:
        out_tok = pre[0]
        in_tok = next(t for t in range(160) if t not in pre)
        new = np.sort(np.concatenate([pre[pre != out_tok], [in_tok]]))
    idx[0, :64] = new
    forge_array(run, ev["kept.index"], lambda y: np.copyto(y, idx))
    at = idx.astype(np.int64)[..., None]
    forge_array(run, ev["float.k"], lambda y: np.copyto(y, np.take_along_axis(k, at, axis=1)))
    forge_array(run, ev["float.v"], lambda y: np.copyto(y, np.take_along_axis(v, at, axis=1)))
    sc = _arrays.load(run, ev["kept.score"]).copy()
    sc[0] = score[0][idx[0]]
    forge_array(run, ev["kept.score"], lambda y: np.copyto(y, sc))
    ok, failures, _ = audit(run)
    assert not ok and any("knorm_b16" in f and "block" in f for f in failures), failures[:3]
