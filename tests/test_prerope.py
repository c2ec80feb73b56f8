"""Pre-RoPE keys in the live cache (issue #46, step 1): ``Policy.key_rope = "pre"``.

Tiny random models built from configs (no download): Llama (every layer full) and Gemma-3 (sliding
and full layers, Q/K norms, a global rotary embedding on full layers and a local one on sliding
ones). At float32 storage the pre-RoPE cache gives the post-RoPE cache's log-probabilities within
1e-5, one token per forward and in chunks, also after eviction (each kept token rotated with its
own original position); the stored keys are the model's own keys before the rotation; quantized,
the option changes the codes and the log-probabilities at exactly the same bytes; a model whose
attention takes no rotary embedding is refused, naming the layer and its class.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from testbed.live import chunk_schedule  # noqa: E402
from testbed.policies.cache import PolicyCache  # noqa: E402
from testbed.policies.hook import policy_attention  # noqa: E402
from testbed.policies.layers import PolicyLayer  # noqa: E402
from testbed.policies.compose import Selection, Storage, compose, declared, decompose  # noqa: E402
from testbed.policies.policy import Policy  # noqa: E402

PREFILL, STEPS = 40, 40
TOL = 1e-5
F, S = "full_attention", "sliding_attention"
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2,
             max_position_embeddings=256, attn_implementation="sdpa")
# the full layers' rotary base, written here and given to the config (not read back from the model)
THETA = {"llama": 10000.0, "gemma3": 1000000.0}


def _config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=2, head_dim=32,
                              rope_parameters={"rope_type": "default", "rope_theta": THETA["llama"]})
    if arch == "gemma3":  # a sliding window of 16 < the context; local rotary base 10k, global 1M
        return tf.Gemma3TextConfig(**SMALL, num_hidden_layers=4, num_key_value_heads=1, head_dim=64, sliding_window=16,
                                   layer_types=[S, F, S, F],
                                   rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                                                    F: {"rope_type": "default", "rope_theta": THETA["gemma3"]}})
    raise KeyError(arch)


@functools.lru_cache(maxsize=None)
def _model(arch: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32).eval()


def _ids(arch: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, arch)))
    return torch.randint(0, 256, (2, PREFILL + STEPS + 1), generator=g)


def _run(model, ids, policy, schedule):
    """Prefill, then ``schedule`` tokens per forward; the float32 log-softmax of every decode
    position ``[B, STEPS, V]``, the cache and its bytes after every forward."""
    cache = PolicyCache.for_model(policy, model.config)
    out, nbytes, pos = [], [], PREFILL
    with policy_attention(model), torch.no_grad():
        model(input_ids=ids[:, :PREFILL], use_cache=True, past_key_values=cache)
        nbytes.append(cache.stored_bytes())
        for c in schedule:
            logits = model(input_ids=ids[:, pos:pos + c], use_cache=True, past_key_values=cache).logits
            out.append(torch.log_softmax(logits.float(), dim=-1))
            nbytes.append(cache.stored_bytes())
            pos += c
    assert pos == PREFILL + STEPS
    return torch.cat(out, dim=1), cache, nbytes


def _schedule(policy, mode):
    return chunk_schedule(policy, PREFILL, STEPS, mode, 16)


# float32 storage (no quantization): every token float32; and eviction (a sink of 4 and the newest 12),
# where the kept window's tokens are rotated with their original positions, not their places in the cache
FLOAT_POLICIES = {"float32": dict(middle="float32"), "evict": dict(middle="drop", sink=4, window=12)}


@pytest.mark.parametrize("mode", ["step", "chunked"])
@pytest.mark.parametrize("which", sorted(FLOAT_POLICIES))
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_float32_pre_rope_gives_the_post_rope_log_probs(arch, which, mode):
    model, ids = _model(arch), _ids(arch)
    post = Policy("post", **FLOAT_POLICIES[which])
    pre = post.with_(name="pre", key_rope="pre")
    want, _, bytes_post = _run(model, ids, post, [1] * STEPS)  # the post-RoPE cache, one token per forward
    schedule = _schedule(pre, mode)
    if mode == "chunked":
        assert max(schedule) > 1  # the chunked feeding really feeds several tokens per forward
    got, cache, bytes_pre = _run(model, ids, pre, schedule)
    assert (got - want).abs().max().item() <= TOL
    if mode == "step":
        assert bytes_pre == bytes_post  # the same bytes after every forward
    # the path was taken: the full layers hold keys that are not the post-RoPE ones
    held = [layer for layer in cache.layers if isinstance(layer, PolicyLayer)]
    assert held and all(layer.pre_rope for layer in held)


def _pre_rope_keys(model, arch, ids) -> dict[int, torch.Tensor]:
    """Each full layer's keys before the rotary embedding, taken from the model itself: the output of
    ``k_proj`` (Llama) or of ``k_norm`` (Gemma-3, whose keys are normalized before RoPE), ``[B, H, n, D]``."""
    got: dict[int, list] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        d = attn.head_dim
        if arch == "llama":
            hooks.append(attn.k_proj.register_forward_hook(
                lambda m, a, out, i=i, d=d: got.setdefault(i, []).append(out.view(*out.shape[:2], -1, d).transpose(1, 2))))
        else:
            hooks.append(attn.k_norm.register_forward_hook(lambda m, a, out, i=i: got.setdefault(i, []).append(out)))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return {i: torch.cat(v, dim=-2) for i, v in got.items()}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_stored_keys_are_the_models_keys_before_rope_with_each_layers_own_rotation(arch):
    model, ids = _model(arch), _ids(arch)
    n = PREFILL + STEPS
    _, cache, _ = _run(model, ids, Policy("pre", "float32", key_rope="pre"), [1] * STEPS)
    want = _pre_rope_keys(model, arch, ids[:, :n])
    # RoPE of the full layers, written from its definition with the base given to the config
    d = want[next(iter(want))].shape[-1]
    inv = 1.0 / (THETA[arch] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    full = [i for i, layer in enumerate(cache.layers) if isinstance(layer, PolicyLayer)]
    assert full == ([0, 1] if arch == "llama" else [1, 3])
    for i in full:
        layer = cache.layers[i]
        assert layer.tail_k.shape[-2] == n
        assert (layer.tail_k - want[i]).abs().max().item() <= 1e-5 * max(1.0, want[i].abs().max().item())
        # the rotation the layer rotates with is its own rotary embedding at each token's position
        assert torch.allclose(layer.rope_cos[0].double(), cos, atol=1e-5)  # float32 angles up to 80 rad
        assert torch.allclose(layer.rope_sin[0].double(), sin, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_quantized_pre_rope_keys_differ_at_equal_bytes(arch):
    model, ids = _model(arch), _ids(arch)
    post = Policy("post", "int2", 0, 8, 8)
    pre = post.with_(name="pre", key_rope="pre")
    a, cache_a, bytes_a = _run(model, ids, post, [1] * STEPS)
    b, cache_b, bytes_b = _run(model, ids, pre, [1] * STEPS)
    assert bytes_a == bytes_b  # every forward's stored bytes
    la = next(x for x in cache_a.layers if isinstance(x, PolicyLayer))
    lb = next(x for x in cache_b.layers if isinstance(x, PolicyLayer))
    assert la.mid_k.tokens == lb.mid_k.tokens > 0
    assert la.mid_k.used_bytes() == lb.mid_k.used_bytes()
    assert not torch.equal(la.mid_k.buffers["codes"].view(), lb.mid_k.buffers["codes"].view())
    assert (a - b).abs().max().item() > 1e-3  # the option changes what the model predicts



@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_quantized_pre_rope_is_schedule_exact(arch):
    """Chunked feeding (up to the next flush per forward) gives one token per forward's log-probs, as
    for post-RoPE keys (within test_policy_models' 1e-4: at int4, float rounding of a chunked forward
    can flip a code at a rounding boundary; at int2 on Gemma-3 it does so for post-RoPE keys too)."""
    model, ids = _model(arch), _ids(arch)
    pre = Policy("pre", "int4", 0, 8, 8, key_rope="pre")
    b, _, bytes_b = _run(model, ids, pre, [1] * STEPS)
    schedule = _schedule(pre, "chunked")
    assert max(schedule) > 1
    c, _, bytes_c = _run(model, ids, pre, schedule)
    assert (c - b).abs().max().item() <= 1e-4
    assert bytes_c[-1] == bytes_b[-1]


# -- refusals -----------------------------------------------------------------------------------------

def test_a_model_without_a_rotary_embedding_is_refused_naming_the_layer_and_class():
    import transformers as tf

    cfg = tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=2, n_positions=128, attn_implementation="sdpa",
                        bos_token_id=0, eos_token_id=0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 12))
    ok = PolicyCache.for_model(Policy("post", "int4", 0, 4, 4), model.config)
    with policy_attention(model), torch.no_grad():
        model(input_ids=ids, use_cache=True, past_key_values=ok)  # post-RoPE keys need nothing of the model
        cache = PolicyCache.for_model(Policy("pre", "int4", 0, 4, 4, key_rope="pre"), model.config)
        with pytest.raises(ValueError, match=r"layer 0 \(GPT2Attention\).*pre-RoPE key cannot be obtained"):
            model(input_ids=ids, use_cache=True, past_key_values=cache)
    assert cache.layers[0].seen == 0  # refused before any layer stored anything


def test_a_partial_or_missing_rotary_embedding_is_refused_at_the_layer():
    layer = PolicyLayer(Policy("pre", "float32", key_rope="pre"), layer_idx=3)
    k = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="layer 3: .*needs the prefill's rotary cos / sin"):
        layer.load_prefill(k, k)
    cos = torch.ones(1, 5, 4)  # a rotary embedding over half the head only
    with pytest.raises(ValueError, match=r"layer 3 \(load_prefill\).*partial rotary"):
        PolicyLayer(Policy("pre", "float32", key_rope="pre"), layer_idx=3).load_prefill(k, k, rope=(cos, 0 * cos))
    interleaved = torch.randn(1, 5, 4).repeat_interleave(2, dim=-1)  # one frequency on channels 2i, 2i + 1
    with pytest.raises(ValueError, match="rotate_half's layout"):
        PolicyLayer(Policy("pre", "float32", key_rope="pre"), layer_idx=3).load_prefill(k, k, rope=(interleaved, interleaved))
    with pytest.raises(RuntimeError, match="policy_attention"):  # outside policy_attention no rotation is captured
        PolicyLayer(Policy("pre", "float32", key_rope="pre"), layer_idx=3).update(k, k)


def test_key_rope_is_validated_and_flows_through_compose():
    with pytest.raises(ValueError, match="key_rope must be one of"):
        Policy("x", "int4", key_rope="before")
    for bad in (dict(sink=4, sink_select="mass"), dict(heavy=2), dict(low="int2", low_share=0.5, alloc="random")):
        with pytest.raises(ValueError, match="key_rope 'pre' is served for"):
            Policy("x", "int4", window=8, group=8, key_rope="pre", **bad)
    with pytest.raises(ValueError, match="direct attention"):
        PolicyLayer(Policy("x", "int4", window=8, group=8, key_rope="pre"), layer_idx=0, direct=True)
    p = compose("x", Selection("all", sink=4), Storage("int2", 16, 8, key_rope="pre"))
    assert p.key_rope == "pre" and compose("x", *decompose(p)) == p
    assert p.config()["key_rope"] == "pre"
    assert "key_rope" not in p.with_(key_rope="post").config()  # the default serializes as before
    q = declared({"name": "w", "selection": {"kind": "sink_window", "sink": 4}, "storage": {"key_rope": "pre"}},
                 window=16, group=8, evict_window=12)
    assert q.evicts and q.key_rope == "pre"
    with pytest.raises(ValueError, match=r"storage.key_rope: expected a string"):
        declared({"name": "w", "storage": {"key_rope": 1}}, window=16, group=8, evict_window=12)
    with pytest.raises(ValueError, match="key_rope must be one of"):
        declared({"name": "w", "storage": {"key_rope": "both"}}, window=16, group=8, evict_window=12)
    with pytest.raises(ValueError, match="scored selection keeps its tokens float32"):
        compose("s", Selection("knorm", keep=8), Storage(key_rope="pre"))


def test_the_audit_maps_a_declared_key_rope():
    from testbed.audit_checks.live_policies import declared_policy

    live = {"window": 16, "group": 8, "evict_window": 12}
    entry = {"name": "p", "selection": {"kind": "all"}, "storage": {"middle": "int4", "key_rope": "pre"}}
    assert declared_policy(entry, live)["key_rope"] == "pre"
    assert "key_rope" not in declared_policy({**entry, "storage": {"middle": "int4"}}, live)
    with pytest.raises(ValueError, match="key_rope 'sideways'"):
        declared_policy({**entry, "storage": {"key_rope": "sideways"}}, live)


def test_the_audit_rotation_matches_the_runs():
    from testbed.audit_checks.live_evidence import rope_rotate as audit_rotate
    from testbed.policies.rope import rope_rotate, rope_unrotate

    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 3, 7, 8, generator=g)
    ang = torch.rand(7, 4, generator=g) * 6.3
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[None], torch.cat([ang.sin(), ang.sin()], -1)[None]
    post = rope_rotate(k, cos, sin)
    assert torch.allclose(rope_unrotate(post, cos, sin), k, atol=1e-6)  # the inverse
    assert not torch.allclose(post, k, atol=1e-2)  # and a real rotation
    # the norm of each channel pair (i, i + 4) is kept: an orthogonal rotation of pairs
    pair = lambda x: x[..., :4] ** 2 + x[..., 4:] ** 2  # noqa: E731
    assert torch.allclose(pair(post), pair(k), atol=1e-5)
    assert abs(audit_rotate(k[0].numpy(), cos[0].numpy(), sin[0].numpy()) - post[0].numpy()).max() < 1e-5


# -- a live run with declared pre-RoPE arms, and its audit ------------------------------------------------

@pytest.fixture(scope="module")
def pre_run(tmp_path_factory):
    import json
    from pathlib import Path

    from testbed.run import main as run_main
    from testbed.sources import models

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}; install with: {models.INSTALL_HINT}")
    tmp = tmp_path_factory.mktemp("prerope")
    proto = json.loads((Path(__file__).resolve().parent.parent / "protocols" / "smollm2_quality.json").read_text())
    proto["name"], proto["default"] = "live_prerope", False
    proto["live"].update({"evidence_layer": 2, "segments": 1, "prefill": 32, "steps": 40, "batch": 1, "window": 16,
                          "group": 16, "evict_window": 16, "peers": [], "policies": [
                              "int4",
                              {"name": "int4_pre", "storage": {"middle": "int4", "key_rope": "pre"}},
                              {"name": "stream_pre", "selection": {"kind": "sink_window", "sink": 4},
                               "storage": {"key_rope": "pre"}}]})
    (tmp / "p.json").write_text(json.dumps(proto))
    assert run_main(["--quiet", "--out", str(tmp / "run"), "--protocol", str(tmp / "p.json")]) == 0
    return tmp / "run"


@pytest.mark.slow
def test_a_live_run_with_pre_rope_arms_passes_its_audit_and_a_forged_rotation_fails(pre_run, tmp_path):
    import json
    import shutil

    from testbed.audit import audit
    from tests import _arrays
    from tests.test_live import _rehash

    ok, failures, _ = audit(pre_run)
    assert ok, failures
    rows = {r["arm"]: r for r in json.loads((pre_run / "results.json").read_text())["rows"] if r.get("kind") == "policy"}
    assert rows["int4_pre"]["policy"]["key_rope"] == "pre" and "key_rope" not in rows["int4"]["policy"]
    assert rows["int4_pre"]["bytes_final"] == rows["int4"]["bytes_final"]  # the same bytes
    assert rows["int4_pre"]["nll"] != rows["int4"]["nll"]  # and an effect
    # forged: the stored keys claimed to be the post-RoPE inputs themselves (input.k_pre := input.k)
    run = tmp_path / "copy"
    shutil.copytree(pre_run, run)
    arrays = rows["int4_pre"]["evidence"]["arrays"]
    post = _arrays.load(run, arrays["input.k"])
    _arrays.save(run, arrays["input.k_pre"], post.copy())
    _rehash(run, arrays["input.k_pre"])
    ok, failures, _ = audit(run)
    assert not ok
    assert any("int4_pre" in f and "input.k_pre rotated by the recorded cos / sin is not input.k" in f for f in failures)
