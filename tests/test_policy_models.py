"""Policies inside models whose layers differ (issue #33): sliding-window layers, Q/K norms, MQA.

Tiny random models built from configs (no download): Llama, Qwen3 (Q/K norm), Qwen2 with full and
sliding layers, Mistral (every layer sliding), Gemma-3 (sliding and full layers, one KV head). At a
context three times the sliding window (16): the float32 policy through ``PolicyCache.for_model``
gives DynamicCache's log-probabilities one token per forward and in chunks; every preset gives the
same log-probabilities chunked as step by step (or is refused before any forward); the bytes of
every layer are the closed forms: on a sliding layer what DynamicCache holds there, on a full layer
``Policy.layer_bytes``.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from testbed.live import chunk_schedule  # noqa: E402  (after the importorskip: live needs transformers)
from testbed.policies import PRESETS, preset  # noqa: E402
from testbed.policies.presets import HEAVY_PRESETS  # noqa: E402
from testbed.policies.cache import PolicyCache, layer_kinds  # noqa: E402
from testbed.policies.hook import policy_attention  # noqa: E402
from testbed.policies.layers import PolicyLayer, SlidingLayer  # noqa: E402
from testbed.sources.models import forward_kwargs  # noqa: E402
from tests._helpers import oracle_kwargs  # noqa: E402

WINDOW = 16          # the models' sliding window
PREFILL, STEPS = 48, 40
CHUNK = 16           # the largest chunk of the chunked schedules: a whole sliding window per forward
TOL = 1e-4
F, S = "full_attention", "sliding_attention"
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2,
             max_position_embeddings=256, attn_implementation="sdpa")


def _config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=2, head_dim=32)
    if arch == "qwen3":  # Q/K RMS norms before RoPE; every layer full
        return tf.Qwen3Config(**SMALL, num_hidden_layers=2, num_key_value_heads=1, head_dim=32)
    if arch == "qwen2_mixed":  # layers >= max_window_layers slide
        return tf.Qwen2Config(**SMALL, num_hidden_layers=3, num_key_value_heads=2, use_sliding_window=True,
                              sliding_window=WINDOW, max_window_layers=1)
    if arch == "mistral":  # no layer_types: every layer slides
        return tf.MistralConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=1, head_dim=32,
                                sliding_window=WINDOW)
    if arch == "gemma3":  # MQA, head_dim 64, Q/K norms, sliding and full layers
        return tf.Gemma3TextConfig(**SMALL, num_hidden_layers=4, num_key_value_heads=1, head_dim=64,
                                   sliding_window=WINDOW, layer_types=[S, S, F, S])
    raise KeyError(arch)


ARCHS = ("llama", "qwen3", "qwen2_mixed", "mistral", "gemma3")
# written from the configs above (not read back from the code under test)
EXPECTED_KINDS = {"llama": [F, F], "qwen3": [F, F], "qwen2_mixed": [F, S, S], "mistral": [S, S],
                  "gemma3": [S, S, F, S]}


@functools.lru_cache(maxsize=None)
def _model(arch: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32).eval()
    assert model.config._attn_implementation == "sdpa"
    return model


def _ids(arch: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, arch)))
    return torch.randint(0, 256, (2, PREFILL + STEPS + 1), generator=g)


def _policy(name: str):
    # a heavy-hitter preset pays for its float32 heavy hitters with one group of its window: R = 2 G
    return preset(name, window=16 if name in HEAVY_PRESETS else 8, group=8, evict_window=20, sink=4)


def _run(model, ids, cache, schedule, after=None):
    """Prefill, then ``schedule`` tokens per forward; float32 log-softmax of every decode position
    ``[B, STEPS, V]``. ``after(cache, seen)`` is called after every forward (the prefill's too)."""
    kw = forward_kwargs(model)
    out, pos = [], PREFILL
    with torch.no_grad():
        model(input_ids=ids[:, :PREFILL], use_cache=True, **{kw["cache"]: cache})
        if after is not None:
            after(cache, PREFILL)
        for c in schedule:
            logits = model(input_ids=ids[:, pos:pos + c], use_cache=True, **{kw["cache"]: cache}).logits
            out.append(torch.log_softmax(logits.float(), dim=-1))
            pos += c
            if after is not None:
                after(cache, pos)
    assert pos == PREFILL + STEPS
    return torch.cat(out, dim=1)


def _dims(model):
    cfg = model.config
    return int(cfg.num_key_value_heads), int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _tensor_bytes(layer) -> int:
    """What a DynamicCache layer holds for one sequence (its K and V tensors)."""
    if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
        return 0
    return (layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()) \
        // layer.keys.shape[0]


# -- layer kinds ------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_layer_kinds_follow_the_config_and_dynamic_cache(arch):
    from transformers import DynamicCache

    cfg = _model(arch).config
    kinds = [k for k, _ in layer_kinds(cfg)]
    assert kinds == EXPECTED_KINDS[arch]
    assert all(w == (WINDOW if k == S else None) for k, w in layer_kinds(cfg))
    cache = PolicyCache.for_model(_policy("float32"), cfg)
    assert cache.kinds == kinds
    assert [type(x) for x in cache.layers] == [SlidingLayer if k == S else PolicyLayer for k in kinds]
    # transformers' masks choose the layer they size against from is_sliding: the same as DynamicCache's
    assert cache.is_sliding == DynamicCache(config=cfg).is_sliding == [k == S for k in kinds]


# -- (a) the float32 policy is DynamicCache, step by step and in chunks ------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode", ["step", "chunked"])
@pytest.mark.parametrize("arch", ARCHS)
def test_float32_policy_matches_dynamic_cache(arch, mode):
    from transformers import DynamicCache

    model, ids = _model(arch), _ids(arch)
    pol = _policy("float32")
    schedule = chunk_schedule(pol, PREFILL, STEPS, mode, CHUNK)
    assert (max(schedule) == CHUNK) == (mode == "chunked")
    ref = _run(model, ids, DynamicCache(config=model.config), [1] * STEPS)
    mine = {}  # the reference's bytes per layer, in its own chunking, at every context

    def held(cache, seen):
        mine[seen] = [_tensor_bytes(x) for x in cache.layers]

    ref_chunked = _run(model, ids, DynamicCache(config=model.config), schedule, held)
    assert (ref_chunked - ref).abs().max().item() <= TOL  # the reference itself is exact in chunks

    kinds = [k for k, _ in layer_kinds(model.config)]
    kv, d = _dims(model)

    def check(cache, seen):
        for i, (kind, layer) in enumerate(zip(kinds, cache.layers)):
            if kind == S:  # exactly what DynamicCache holds on that layer
                assert layer.stored_bytes() == mine[seen][i], (i, seen)
            else:  # every token float32, plus the 16-byte header
                assert layer.stored_bytes() == pol.layer_bytes(seen, kv, d) == mine[seen][i] + 16, (i, seen)

    with policy_attention(model):
        got = _run(model, ids, PolicyCache.for_model(pol, model.config), schedule, check)
    diff = (got - ref).abs().max().item()
    assert diff <= TOL, f"{arch} {mode}: max |Δ log-softmax| {diff:.3g}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


# -- (b) every preset: chunked equals step by step, or refused before any forward -------------------

UNIFORM = [n for n in PRESETS if not preset(n).mixed]  # per-head precision: tests/test_mixed_precision.py


@pytest.mark.slow
@pytest.mark.parametrize("name", UNIFORM)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_preset_chunked_equals_step(arch, name):
    model, ids = _model(arch), _ids(arch)
    pol = _policy(name)
    kinds = EXPECTED_KINDS[arch]
    if F not in kinds and pol.middle != "float32":
        with pytest.raises(ValueError, match=rf"policy {name}: layers 0\.\.{len(kinds) - 1} are all sliding_attention"):
            PolicyCache.for_model(pol, model.config)
        return
    kv, d = _dims(model)
    seen_bytes = []

    def check(cache, seen):  # (c) on every forward of the step run: each layer's closed form
        per = {}
        for i, (kind, layer) in enumerate(zip(kinds, cache.layers)):
            want = 2 * kv * d * 4 * min(seen, WINDOW - 1) if kind == S else pol.layer_bytes(seen, kv, d)
            assert layer.stored_bytes() == want, (i, kind, seen)
            per[kind] = per.get(kind, 0) + want
        assert cache.stored_bytes_by_kind() == per
        assert cache.stored_bytes() == sum(per.values())
        seen_bytes.append(seen)

    schedule = chunk_schedule(pol, PREFILL, STEPS, "chunked", CHUNK)
    assert len(schedule) < STEPS  # several tokens per forward
    with policy_attention(model):
        oracle = oracle_kwargs(pol, model.config, ids.shape[0], ids.shape[1])  # the same for both runs
        step = _run(model, ids, PolicyCache.for_model(pol, model.config, **oracle), [1] * STEPS, check)
        chunked = _run(model, ids, PolicyCache.for_model(pol, model.config, **oracle), schedule)
    assert seen_bytes == list(range(PREFILL, PREFILL + STEPS + 1))
    diff = (chunked - step).abs().max().item()
    assert diff <= TOL, f"{arch} {name}: chunked vs step max |Δ log-softmax| {diff:.3g}"
    if pol.middle != "float32":  # the policy is applied: it changes the model's predictions
        from transformers import DynamicCache

        ref = _run(model, ids, DynamicCache(config=model.config), [1] * STEPS)
        assert (step - ref).abs().max().item() > 10 * TOL, f"{arch} {name}: no effect on the model"


# -- (c) the bytes per layer kind against a DynamicCache, after the window filled --------------------

@pytest.mark.slow
def test_gemma3_sliding_layers_bounded_full_layers_policy():
    """The regression of Gemma-3-270M: the float32 policy kept every token on sliding layers. Here
    a sliding layer holds WINDOW - 1 tokens however long the context, a full layer every token."""
    from transformers import DynamicCache

    model, ids = _model("gemma3"), _ids("gemma3")
    kv, d = _dims(model)
    ours, ref = PolicyCache.for_model(_policy("float32"), model.config), DynamicCache(config=model.config)
    with policy_attention(model):
        _run(model, ids, ours, [1] * STEPS)
    _run(model, ids, ref, [1] * STEPS)
    n = PREFILL + STEPS
    token = 2 * kv * d * 4
    assert ours.stored_bytes_by_kind() == {S: 3 * (WINDOW - 1) * token, F: n * token + 16}
    assert ours.stored_bytes() == sum(_tensor_bytes(x) for x in ref.layers) + 16
    assert ours.get_seq_length() == n and all(x.get_seq_length() == n for x in ours.layers)


# -- refusals ---------------------------------------------------------------------------------------

def test_unknown_layer_types_are_refused_naming_the_layer():
    from transformers import Qwen2Config

    for bad in ("chunked_attention", "linear_attention", "moe"):
        cfg = Qwen2Config(**SMALL, num_hidden_layers=3, sliding_window=WINDOW, layer_types=[F, bad, S])
        with pytest.raises(ValueError, match=rf"layer 1 \({bad}\): layer type '{bad}' is not served"):
            PolicyCache.for_model(_policy("int4"), cfg)


def test_shared_kv_layers_are_refused_naming_the_layer():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(**SMALL, num_hidden_layers=4, num_key_value_heads=1, head_dim=64,
                           sliding_window=WINDOW, layer_types=[S, F, S, F])
    cfg.num_kv_shared_layers = 2  # Gemma-3n's: the last 2 layers read earlier layers' K/V
    with pytest.raises(ValueError, match=r"layer 2 \(sliding_attention\): the config sets num_kv_shared_layers = 2"):
        PolicyCache.for_model(_policy("float32"), cfg)
    cfg.num_kv_shared_layers = 0
    assert [k for k, _ in layer_kinds(cfg)] == [S, F, S, F]
    cfg.kv_sharing_modes = [None, "store", None, "reuse"]
    with pytest.raises(ValueError, match=r"layer 1 \(full_attention\): kv_sharing_modes\[1\] = 'store'"):
        PolicyCache.for_model(_policy("float32"), cfg)
    cfg.kv_sharing_modes = [None, "store", None, None]  # a producer nobody reuses shares nothing
    assert [k for k, _ in layer_kinds(cfg)] == [S, F, S, F]


def test_what_a_sliding_layer_cannot_serve_is_refused():
    cfg = _model("gemma3").config
    with pytest.raises(ValueError, match=r"sliding='policy': only 'native' is served"):
        PolicyCache.for_model(_policy("int4"), cfg, sliding="policy")
    with pytest.raises(ValueError, match=r"record_layer 0 \(sliding_attention\)"):
        PolicyCache.for_model(_policy("int4"), cfg, record_layer=0)
    assert PolicyCache.for_model(_policy("int4"), cfg, record_layer=2).layers[2].record
    with pytest.raises(ValueError, match=r"record_layer 4: the model has layers 0\.\.3"):
        PolicyCache.for_model(_policy("int4"), cfg, record_layer=4)
    mistral = _model("mistral").config
    with pytest.raises(ValueError, match="would apply nowhere"):
        PolicyCache.for_model(_policy("streaming"), mistral)
    one = _config("mistral")
    one.sliding_window = 1  # transformers' sliding layer would keep every token (a [-0:] slice)
    with pytest.raises(ValueError, match=r"layer 0 \(sliding_attention\): sliding_window 1"):
        PolicyCache.for_model(_policy("float32"), one)


def test_the_old_constructor_is_unchanged():
    cache = PolicyCache(_policy("int4"), 3, record_layer=1)
    assert [type(x) for x in cache.layers] == [PolicyLayer] * 3 and cache.kinds == [F] * 3
    assert [x.record for x in cache.layers] == [False, True, False]


@pytest.mark.parametrize("arch, first", [("mistral", 0), ("qwen2_mixed", 1), ("gemma3", 0)])
def test_a_cache_whose_layer_kinds_are_not_the_models_is_refused(arch, first, reliability):
    """Issue #48's trap: ``PolicyCache(policy, num_layers)`` serves every layer as full attention; on
    a model with sliding layers that cache keeps what those layers never read again and its
    chunked and one-token log-probabilities differ. ``policy_attention`` refuses it at the first
    forward, naming the first mismatched layer (written from the configs: EXPECTED_KINDS) and
    pointing to ``PolicyCache.for_model``; the cache ``for_model`` builds runs."""
    assert EXPECTED_KINDS[arch].index(S) == first
    model = _model(arch)
    n = len(EXPECTED_KINDS[arch])
    wrong = PolicyCache(_policy("streaming"), n)
    with policy_attention(model), pytest.raises(ValueError) as e:
        _run(model, _ids(arch), wrong, [1] * STEPS)
    reliability("bad input: API", f"PolicyCache(policy, num_layers) on a tiny {arch} with sliding layers",
                "ValueError naming the first mismatched layer and PolicyCache.for_model", str(e.value))
    assert str(e.value).startswith(f"layer {first}: the cache serves it as full_attention, the model's config makes it "
                                   f"sliding_attention (window {WINDOW})")
    assert "PolicyCache.for_model" in str(e.value)
    right = PolicyCache.for_model(_policy("float32"), model.config)
    with policy_attention(model):
        assert _run(model, _ids(arch), right, [CHUNK] + [1] * (STEPS - CHUNK)).shape[1] == STEPS
