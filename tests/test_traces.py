"""Trace files: a saved trace loads back identically; malformed ones are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from testbed.audit import audit
from testbed.case import Case, Region
from testbed.run import run_protocols
from testbed.protocol import validate_protocol
from testbed.sources import SOURCES
from testbed.sources.traces import METADATA_KEY, TraceError, load_trace, save_trace


def video_case(case_id="clip-L23-c07-s3", frames=(4, 6, 6), tpf=12, heads=4, kv_heads=2, d=16, seed=0):
    """A video-DiT-like record: [sink, recent, current] frames, queries in the current chunk, bidirectional."""
    g = torch.Generator().manual_seed(seed)
    tk = sum(frames) * tpf
    cur = frames[2] * tpf
    q = torch.randn(heads, 10, d, generator=g)
    k = torch.randn(kv_heads, tk, d, generator=g)
    v = torch.randn(kv_heads, tk, d, generator=g)
    qpos = torch.sort(torch.randperm(cur, generator=g)[:10]).values + (tk - cur)
    edges = [0, frames[0] * tpf, (frames[0] + frames[1]) * tpf, tk]
    layout = tuple(Region(n, a, b) for n, a, b in zip(("sink", "recent", "current"), edges, edges[1:]))
    return Case(id=case_id, q=q, k=k, v=v, query_positions=qpos, causal=False, layout=layout, tokens_per_frame=tpf,
                meta={"source": "capture", "model": "toy-dit", "prompt": "calm_static", "layer": 23, "chunk": 7,
                      "step": 3, "scale": 0.125, "nested": {"a": [1, 2.5, None]}})


def llm_case(case_id="prose-L05-c03"):
    g = torch.Generator().manual_seed(1)
    tk = 40
    q = torch.randn(6, 8, 8, generator=g)
    k = torch.randn(2, tk, 8, generator=g)
    v = torch.randn(2, tk, 8, generator=g)
    layout = (Region("sink", 0, 2), Region("middle", 2, 24), Region("recent", 24, 32), Region("current", 32, 40))
    return Case(id=case_id, q=q, k=k, v=v, query_positions=torch.arange(32, 40), causal=True, layout=layout,
                meta={"source": "capture", "model": "toy-llm", "layer": 5, "chunk": 3, "step": 0})


def assert_same(a: Case, b: Case):
    assert a.id == b.id and a.causal == b.causal and a.layout == b.layout
    assert a.tokens_per_frame == b.tokens_per_frame and a.meta == b.meta
    for name in ("q", "k", "v", "query_positions"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


def test_saved_trace_loads_back_identically(tmp_path):
    cases = [video_case(), llm_case()]
    path = save_trace(tmp_path / "t.safetensors", cases)
    back = load_trace(path)
    assert [c.id for c in back] == [c.id for c in cases]
    for a, b in zip(cases, back):
        assert_same(a, b)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary file left behind"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_traces_load_as_exact_float32(tmp_path, dtype):
    c = llm_case()
    tensors = {f"{c.id}/{n}": getattr(c, n).to(dtype) for n in ("q", "k", "v")}
    tensors[f"{c.id}/query_positions"] = c.query_positions.to(torch.int32)
    header = {"version": 1, "records": [{"id": c.id, "causal": True, "layout": c.layout_json(), "tokens_per_frame": None,
                                         "meta": c.meta}]}
    save_file(tensors, str(tmp_path / "h.safetensors"), metadata={METADATA_KEY: json.dumps(header)})
    (back,) = load_trace(tmp_path / "h.safetensors")
    assert back.q.dtype == torch.float32 and back.query_positions.dtype == torch.int64
    assert torch.equal(back.k, c.k.to(dtype).to(torch.float32))
    assert torch.equal(back.query_positions, c.query_positions)


def _write(tmp_path, tensors, header, name="bad.safetensors"):
    path = tmp_path / name
    meta = {METADATA_KEY: header if isinstance(header, str) else json.dumps(header)} if header is not None else None
    save_file(tensors, str(path), metadata=meta)
    return path


def _good(case=None):
    c = case or llm_case()
    tensors = {f"{c.id}/{n}": getattr(c, n).clone() for n in ("q", "k", "v", "query_positions")}
    header = {"version": 1, "records": [{"id": c.id, "causal": c.causal, "layout": c.layout_json(),
                                         "tokens_per_frame": c.tokens_per_frame, "meta": c.meta}]}
    return c, tensors, header


def _refused(path, *fragments):
    with pytest.raises(TraceError) as info:
        load_trace(path)
    msg = str(info.value)
    assert msg.startswith(path.name + ":"), msg
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


def test_refuses_a_layout_that_does_not_cover_the_key_axis(tmp_path):
    c, t, h = _good()
    h["records"][0]["layout"][-1]["stop"] = 39
    _refused(_write(tmp_path, t, h), c.id, "layout covers [0, 39)", "40 keys")


def test_refuses_a_gap_in_the_layout(tmp_path):
    c, t, h = _good()
    h["records"][0]["layout"][1]["start"] = 3
    _refused(_write(tmp_path, t, h), c.id, "not contiguous", "middle")


def test_refuses_non_finite_values_and_names_the_index(tmp_path):
    c, t, h = _good()
    t[f"{c.id}/k"][1, 7, 3] = float("nan")
    _refused(_write(tmp_path, t, h), c.id, ".k", "non-finite", "(1, 7, 3)")


def test_refuses_integer_q(tmp_path):
    c, t, h = _good()
    t[f"{c.id}/q"] = t[f"{c.id}/q"].to(torch.int32)
    _refused(_write(tmp_path, t, h), c.id, "q has dtype int32")


def test_refuses_float64(tmp_path):
    c, t, h = _good()
    t[f"{c.id}/v"] = t[f"{c.id}/v"].to(torch.float64)
    _refused(_write(tmp_path, t, h), "v has dtype float64", "float32")


def test_refuses_mismatched_shapes(tmp_path):
    c, t, h = _good()
    t[f"{c.id}/v"] = t[f"{c.id}/v"][:, :-1].clone()
    _refused(_write(tmp_path, t, h), c.id, "differ in shape")


def test_refuses_query_positions_outside_the_key_axis(tmp_path):
    c, t, h = _good()
    t[f"{c.id}/query_positions"][-1] = 40
    _refused(_write(tmp_path, t, h), c.id, "query_positions must lie in [0, 40)")


def test_refuses_float_query_positions(tmp_path):
    c, t, h = _good()
    t[f"{c.id}/query_positions"] = t[f"{c.id}/query_positions"].float()
    _refused(_write(tmp_path, t, h), "query_positions must be a 1-D int64/int32 tensor")


def test_refuses_gqa_head_counts_that_do_not_divide(tmp_path):
    c, t, h = _good()
    t[f"{c.id}/q"] = t[f"{c.id}/q"][:5].clone()
    _refused(_write(tmp_path, t, h), "5 query heads are not a multiple of 2 KV heads")


def test_refuses_a_missing_tensor_and_a_stray_one(tmp_path):
    c, t, h = _good()
    del t[f"{c.id}/v"]
    _refused(_write(tmp_path, t, h, "a.safetensors"), f"tensor '{c.id}/v' is missing")
    c, t, h = _good()
    t["other/q"] = torch.zeros(1)
    _refused(_write(tmp_path, t, h, "b.safetensors"), "belong to no record", "other/q")


@pytest.mark.parametrize("header, fragment", [
    (None, "has no 'testbed.trace' entry"),
    ("{not json", "is not valid JSON"),
    ({"version": 2, "records": []}, "version 2 is not the supported 1"),
    ({"version": 1, "records": []}, "non-empty list"),
])
def test_refuses_bad_metadata(tmp_path, header, fragment):
    _, t, _ = _good()
    _refused(_write(tmp_path, t, header), fragment)


def test_refuses_bad_record_fields(tmp_path):
    c, t, h = _good()
    h["records"][0]["causal"] = "yes"
    _refused(_write(tmp_path, t, h, "a.safetensors"), "causal must be true or false")
    c, t, h = _good()
    h["records"][0]["layout"][0] = {"name": "sink", "start": 0}
    _refused(_write(tmp_path, t, h, "b.safetensors"), "layout[0] must be an object with exactly name, start, stop")
    c, t, h = _good()
    h["records"][0]["colour"] = "red"
    _refused(_write(tmp_path, t, h, "c.safetensors"), "unknown key(s) ['colour']")


def test_refuses_a_file_that_is_not_safetensors(tmp_path):
    p = tmp_path / "junk.safetensors"
    p.write_bytes(b"\x00" * 64)
    _refused(p, "not a readable safetensors file")
    _refused(tmp_path / "absent.safetensors", "no such trace file")


def test_save_refuses_non_json_meta(tmp_path):
    c = llm_case()
    c.meta["tensor"] = torch.zeros(1)
    with pytest.raises(TraceError, match="meta is not plain JSON"):
        save_trace(tmp_path / "x.safetensors", [c])


def test_trace_source_runs_a_protocol_and_the_audit_rederives_it(tmp_path):
    """A trace made elsewhere (video-like, bidirectional, frames) goes through the same pipeline."""
    trace = save_trace(tmp_path / "video.safetensors", [video_case("clip-a", seed=1), video_case("clip-b", seed=2)])
    raw = {"name": "trace_demo", "source": {"kind": "trace", "files": [str(trace)]},
           "analyses": {"residual_window": {"bits": 4, "group_size": 16, "residuals": [0, 24], "early_window": 0}},
           "timing": {"repeats": 0}}
    proto = validate_protocol(raw)
    out = tmp_path / "run"
    out.mkdir()
    manifest = run_protocols(out, [(tmp_path / "p.json", proto, json.dumps(raw).encode())], progress=lambda m: None)
    results = json.loads((out / "results.json").read_text())
    assert set(results["cases"]["trace_demo"]) == {"clip-a", "clip-b"}
    assert results["cases"]["trace_demo"]["clip-a"]["meta"]["trace_file"] == "video.safetensors"
    assert "trace_demo/trace_manifest.json" in manifest["files"]
    ok, failures, _ = audit(out, check_sources=False)
    assert ok, failures


def test_trace_source_validation_names_the_key():
    from testbed.protocol import ProtocolError

    with pytest.raises(ProtocolError, match=r"source.files: expected a list"):
        SOURCES["trace"].validate({"kind": "trace", "files": "a.safetensors"}, "p.source")


def test_trace_source_selects_records_and_refuses_unknown_ones(tmp_path):
    from testbed.sources import traces

    trace = save_trace(tmp_path / "v.safetensors", [video_case("clip-a", seed=1), video_case("clip-b", seed=2)])
    got = list(traces.cases({"kind": "trace", "files": [str(trace)], "records": ["clip-b"]}))
    assert [c.id for c in got] == ["clip-b"] and got[0].meta["trace_file"] == "v.safetensors"
    with pytest.raises(ValueError, match=r"trace records \['clip-z'\] were not found"):
        list(traces.cases({"kind": "trace", "files": [str(trace)], "records": ["clip-z"]}))
    assert traces.estimate_bytes({"files": [str(trace)]}) > 0
