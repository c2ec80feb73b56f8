"""``expected_attention`` and the RoPE it reads (testbed.policies.rope).

- the rotary angles read from a config are the model's own (Llama's default schedule, Gemma-3's
  per-kind schedules with a linear scaling on its full layers), and rotating back a post-RoPE
  query gives the query before RoPE;
- with every prefill query the same before RoPE (no covariance) and one future position, the
  expected attention is exactly the attention a query at the next position pays, times the value
  norm: the definition, written out;
- kvpress's ``ExpectedAttentionPress`` (its own pre-RoPE queries from ``q_proj``) keeps the same
  tokens on a tiny random Llama and on SmolLM2 layers, up to near ties;
- a cache built without the model's config, a partial rotary embedding and a dynamic rope are refused.
"""

from __future__ import annotations


import pytest
import torch

from testbed.policies import scorers
from testbed.policies.rope import rotary, rotate_half


def _llama(layers=2, heads=4, kv=2, d=16, seed=0):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=heads * d, intermediate_size=96, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=d, num_hidden_layers=layers, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def test_the_rotary_angles_are_the_models_own():
    import transformers as tf

    pos = torch.arange(0, 3000, 7)
    m = _llama()
    cos, sin = m.model.rotary_emb(torch.zeros(1), pos[None])
    r = rotary(m.config)
    c, s = r.cos_sin(pos)
    assert torch.equal(cos[0].double(), c * r.scaling) and torch.equal(sin[0].double(), s * r.scaling)
    cfg = tf.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1e6}})
    g = tf.AutoModelForCausalLM.from_config(cfg).eval()
    for kind in ("full_attention", "sliding_attention"):
        cos, sin = g.model.rotary_emb(torch.zeros(1), pos[None], kind)
        r = rotary(cfg, kind)
        c, s = r.cos_sin(pos)
        assert torch.equal(cos[0].double(), c * r.scaling) and torch.equal(sin[0].double(), s * r.scaling), kind
    full, sliding = rotary(cfg, "full_attention"), rotary(cfg, "sliding_attention")
    assert not torch.equal(full.inv_freq, sliding.inv_freq)  # each kind its own schedule


def test_rotating_back_recovers_the_query_before_rope():
    r = rotary(_llama().config)
    q = torch.randn(2, 3, 50, 16, dtype=torch.float64)
    pos = torch.arange(100, 150)
    cos, sin = r.cos_sin(pos)
    post = q * cos + rotate_half(q) * sin  # RoPE as the model applies it (scaling 1)
    assert torch.allclose(r.unrotate(post, pos), q, atol=1e-12)
    # the mean rotation over one position is that position's rotation
    one = r.mean_rotation(pos[:1])
    assert torch.allclose(q[..., 0, :] @ one.T, post[..., 0, :], atol=1e-12)


def test_rope_that_cannot_be_modelled_is_refused():
    import transformers as tf

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                num_hidden_layers=1)
    with pytest.raises(ValueError, match="dynamic"):
        rotary(tf.LlamaConfig(**base, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        rotary(tf.LlamaConfig(**base, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                       "partial_rotary_factor": 0.5}))


def test_with_one_query_and_one_future_position_it_is_the_next_querys_attention():
    r = rotary(_llama(d=16).config)
    b, hkv, g, n, d = 1, 2, 3, 40, 16
    q0 = torch.randn(b, hkv * g, 1, d, dtype=torch.float64)
    pos = torch.arange(n)
    cos, sin = r.cos_sin(pos)
    queries = q0 * cos + rotate_half(q0) * sin  # the same query before RoPE at every prefill position
    keys = torch.randn(b, hkv, n, d)
    values = torch.randn(b, hkv, n, d)
    sc = scorers.get("expected_attention")
    sc.bind_rope(r)
    sc.FUTURE = 1
    scale = d ** -0.5
    got = sc.attention_score(queries.float(), keys, scale, torch.zeros(b, hkv, n), None, values=values).double()
    cn, sn = r.cos_sin(torch.tensor([n]))
    nxt = (q0 * cn + rotate_half(q0) * sn)[:, :, 0]  # [B, H_q, D]: the query at position n
    k = keys[:, :, 4:].double().repeat_interleave(g, dim=1)
    p = torch.softmax(scale * torch.einsum("bhkd,bhd->bhk", k, nxt), -1).reshape(b, hkv, g, n - 4).mean(2)
    want = p * values[:, :, 4:].double().norm(dim=-1)
    assert torch.allclose(got[..., 4:], want, rtol=1e-5, atol=1e-9)
    assert (got[..., :4] > got[..., 4:].amax(-1, keepdim=True)).all()  # the sink is kept first


def test_a_cache_without_the_models_rope_is_refused():
    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention
    from testbed.policies.policy import Policy

    m = _llama()
    pol = Policy("ea", "drop", scorer="expected_attention", scorer_mode="prefill", keep=20)
    cache = PolicyCache(pol, 2)  # every layer full attention, no config: no rotary embedding
    ids = torch.randint(0, 256, (1, 30))
    with torch.no_grad(), policy_attention(m), pytest.raises(ValueError, match="PolicyCache.for_model"):
        m(input_ids=ids, cache=cache, use_cache=True)


# -- kvpress's ExpectedAttentionPress as the peer ----------------------------------------------------


def _prefill_with_hidden(model, ids):
    """Per layer: the attention's input hidden states, its post-RoPE queries, keys and values."""
    from testbed.live import shared_prefill
    from testbed.sources.models import forward_kwargs

    hidden = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kw, i=i: hidden.__setitem__(i, kw["hidden_states"].detach().clone()), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    try:
        shared, _ = shared_prefill(model, forward_kwargs(model), ids, query_tail=ids.shape[1])
    finally:
        for h in hooks:
            h.remove()
    return hidden, shared


def _swaps_against_kvpress(model, ids, layers, keeps, rtol):
    kvpress = pytest.importorskip("kvpress", reason="the kvpress peer: bash scripts/install.sh installs it")
    hidden, shared = _prefill_with_hidden(model, ids)
    press = kvpress.ExpectedAttentionPress()
    mine = scorers.get("expected_attention")
    mine.bind_rope(rotary(model.config))
    swaps = kept = 0
    for layer in layers:
        attn = model.model.layers[layer].self_attn
        attn.rotary_emb = model.model.rotary_emb  # kvpress's pipeline attaches it so
        k, v = shared.keys[layer].float(), shared.values[layer].float()
        with torch.no_grad():
            theirs_score = press.score(attn, hidden[layer], k, v, None, {})
        mine_score = mine.attention_score(shared.tails[layer], k, shared.scales[layer], torch.zeros(k.shape[:3]),
                                          None, values=v)
        for keep in keeps:
            theirs = torch.sort(theirs_score.topk(keep, dim=-1).indices, dim=-1).values
            ours = scorers.keep_top(mine_score, keep)
            for bi in range(k.shape[0]):
                for hi in range(k.shape[1]):
                    a, c = set(theirs[bi, hi].tolist()), set(ours[bi, hi].tolist())
                    for x, y in zip(sorted(a - c), sorted(c - a)):
                        swaps += 1
                        s = mine_score[bi, hi].double()
                        assert abs(s[x] - s[y]) <= rtol * max(abs(s[x]), abs(s[y])), \
                            f"layer {layer} head {hi}: kvpress kept {x}, testbed {y}: not a near tie"
            kept += k.shape[0] * k.shape[1] * keep
    return swaps, kept


def test_expected_attention_keeps_what_kvpress_keeps_on_a_tiny_llama():
    model = _llama(layers=2, heads=4, kv=2, d=16, seed=1)
    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(2))
    swaps, kept = _swaps_against_kvpress(model, ids, (0, 1), (24, 60), rtol=1e-4)
    assert swaps <= 0.01 * kept  # measured: no swap among the 672 kept tokens


@pytest.mark.slow
def test_expected_attention_keeps_what_kvpress_keeps_on_smollm2(smollm2):
    from pydoc_data.topics import topics

    model, tok, _ = smollm2
    text = " ".join(topics[k] for k in sorted(topics)[20:40])
    ids = tok(text, return_tensors="pt").input_ids[:, :256]
    swaps, kept = _swaps_against_kvpress(model, ids, (0, 14, 29), (96, 160), rtol=1e-4)
    assert swaps <= 0.01 * kept  # measured: no swap among the 2,304 kept tokens
