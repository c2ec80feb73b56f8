"""kvpress (NVIDIA's collection of KV-cache presses, 0.5.5) as the peer of testbed's scorers.

kvpress pins transformers < 5.3, so its model hooks do not run beside this project's transformers;
its press classes import (with ``datasets``, ``fire``, ``termcolor``, ``peft`` and ``cachetools``
present: ``scripts/install.sh`` installs them and kvpress itself with ``--no-deps``). The tests call
a press's own ``score`` and ``compress`` on the same post-RoPE keys testbed's scorer sees and
compare the kept sets: on random keys of a tiny shape and on SmolLM2's keys of three layers.

Ties: kvpress takes ``topk`` of its scores (computed in float32), testbed the top ``keep`` of a
float64 norm rounded to float32, ties to the earlier token. The sets may differ only where the two
scores of a swapped pair are within float32 rounding of the boundary; the test counts such swaps
and requires none beyond them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from testbed.policies import scorers

kvpress = pytest.importorskip("kvpress", reason="the kvpress peer: bash scripts/install.sh installs it (--no-deps)")


def _kvpress_kept(press, keys: torch.Tensor, keep: int) -> torch.Tensor:
    """The positions kvpress's ``compress`` keeps, sorted, per (batch, head): recovered by tagging each
    token's value with its position."""
    b, h, t, d = keys.shape
    values = torch.arange(t, dtype=keys.dtype).view(1, 1, t, 1).expand(b, h, t, d).contiguous()
    press.compression_ratio = 1.0 - keep / t
    module = SimpleNamespace(head_dim=d)
    k2, v2 = press.compress(module, torch.zeros(b, t, 8), keys, values, None, {})
    assert k2.shape[2] == keep, "kvpress kept another count than asked"
    return torch.sort(v2[..., 0].round().long(), dim=-1).values


def _compare(keys: torch.Tensor, keep: int) -> int:
    """Swaps between kvpress's KnormPress and testbed's knorm kept sets, each a near tie (asserted)."""
    theirs = _kvpress_kept(kvpress.KnormPress(), keys, keep)
    own_score = scorers.get("knorm").score(keys, torch.arange(keys.shape[2]), 0)
    mine = scorers.keep_top(own_score, keep)
    swaps = 0
    for bi in range(keys.shape[0]):
        for hi in range(keys.shape[1]):
            a, b = set(theirs[bi, hi].tolist()), set(mine[bi, hi].tolist())
            if a == b:
                continue
            s = own_score[bi, hi].double()
            for x, y in zip(sorted(a - b), sorted(b - a)):
                swaps += 1
                assert abs(s[x] - s[y]) <= 1e-6 * abs(s[y]), f"kvpress kept {x}, testbed {y}: not a near tie"
    return swaps


@pytest.mark.parametrize("keep", [1, 5, 17, 31])
def test_knorm_keeps_what_kvpress_knormpress_keeps_on_random_keys(keep):
    g = torch.Generator().manual_seed(keep)
    keys = torch.randn(2, 3, 32, 16, generator=g)
    assert _compare(keys, keep) == 0  # continuous random norms: no ties at all


@pytest.mark.slow
def test_knorm_keeps_what_kvpress_knormpress_keeps_on_smollm2_keys(smollm2):
    from transformers import DynamicCache

    model, tok, _ = smollm2
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics)[:20])
    ids = tok(text, return_tensors="pt").input_ids[:, :384]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    swaps = kept = 0
    for layer in (0, 14, 29):
        keys = cache.layers[layer].keys.float()
        for keep in (48, 192):
            swaps += _compare(keys, keep)  # each swap asserted a near tie inside
            kept += keys.shape[1] * keep
    # measured: 2 near-tie swaps among the 2,160 kept tokens (float32 vs float64-rounded norms)
    assert swaps <= 0.01 * kept


def _smollm2_prefill(smollm2, n: int = 256):
    """SmolLM2's post-RoPE queries and keys of every layer over ``n`` tokens of the stdlib corpus, from
    the live study's shared prefill (its recorded query tails: here every query)."""
    from pydoc_data.topics import topics

    from testbed.live import shared_prefill
    from testbed.sources.models import forward_kwargs

    model, tok, _ = smollm2
    text = " ".join(topics[k] for k in sorted(topics)[20:40])
    ids = tok(text, return_tensors="pt").input_ids[:, :n]
    shared, _ = shared_prefill(model, forward_kwargs(model), ids, query_tail=n)
    return shared, model.config


def _full_attention(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``[B, H_q, n, n]`` float32 causal softmax, the attention matrix kvpress's presses accept."""
    g = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(g, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, kk) * scale
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1, dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["snapkv", "tova"])
def test_attention_scorers_keep_what_kvpress_keeps_on_smollm2(smollm2, name):
    """testbed's ``snapkv`` / ``tova`` against kvpress's ``SnapKVPress`` / ``TOVAPress`` (their scores
    from the same attention matrix, handed as ``attentions``) on SmolLM2 layers 0, 14 and 29: the same
    kept sets, up to near ties (each swap asserted one, and at most 1 % of the kept tokens)."""
    shared, cfg = _smollm2_prefill(smollm2)
    press = kvpress.SnapKVPress() if name == "snapkv" else kvpress.TOVAPress()
    mine_scorer = scorers.get(name)
    swaps = kept = 0
    for layer in (0, 14, 29):
        q, k, scale = shared.tails[layer], shared.keys[layer].float(), shared.scales[layer]
        b, h, n, d = k.shape
        module = SimpleNamespace(head_dim=d, config=SimpleNamespace(num_attention_heads=cfg.num_attention_heads,
                                                                    num_key_value_heads=cfg.num_key_value_heads))
        attn = _full_attention(q, k, scale)
        theirs_score = press.score(module, torch.zeros(b, n, 8), k, k, attn, {})
        mine_score = mine_scorer.attention_score(q, k, scale, torch.zeros(b, h, n), None)
        for keep in (96, 160):
            theirs = torch.sort(theirs_score.topk(keep, dim=-1).indices, dim=-1).values
            mine = scorers.keep_top(mine_score, keep)
            for bi in range(b):
                for hi in range(h):
                    a, c = set(theirs[bi, hi].tolist()), set(mine[bi, hi].tolist())
                    for x, y in zip(sorted(a - c), sorted(c - a)):
                        swaps += 1
                        s = mine_score[bi, hi].double()
                        assert abs(s[x] - s[y]) <= 1e-5 * max(abs(s[x]), abs(s[y])), \
                            f"layer {layer} head {hi}: kvpress kept {x}, testbed {y}: not a near tie"
            kept += b * h * keep
    assert swaps <= 0.01 * kept
