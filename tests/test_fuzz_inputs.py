"""Bad-input fuzzing (hypothesis): one clear error, never a traceback from deep inside numpy or torch,
never a partial output.

- malformed tensors (NaN, Inf, empty, wrong rank, wrong type or dtype, huge values) into every
  registered quantizer, the residual window and Case: a ``ValueError`` naming the tensor, or --
  for a finite input within range -- a finite decoded tensor of the same shape;
- malformed protocols (keys deleted or added, values replaced by wrong types, negative or absurd
  numbers): the CLI exits 2 with exactly one ``error:`` line and writes nothing, or the protocol is
  valid, runs, and its run passes the audit;
- malformed manifests and results (any subtree replaced by any JSON value, hashes re-computed):
  the audit answers with ``FAIL:`` lines, never an exception, and passes only when what changed
  is descriptive.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from testbed import quant, resources
from testbed.audit import audit
from testbed.case import Case, Region
from testbed.protocol import ProtocolError, validate_protocol
from testbed.quant import IntGrouped, ResidualWindow
from testbed.run import main as run_main

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])
SCHEMES = quant.names()
FLOAT32_MAX = float(torch.finfo(torch.float32).max)

# -- tensors -------------------------------------------------------------------------------------

TENSOR_KINDS = ["nan", "inf", "-inf", "empty", "rank0", "rank1", "int", "bool", "complex", "huge64"]
NOT_TENSORS = ["numpy", "list", "none"]
BAD_KINDS = TENSOR_KINDS + NOT_TENSORS


def bad_tensor(kind: str, shape: tuple, pos: int) -> object:
    x = torch.randn(*shape)
    flat = x.view(-1)
    i = pos % flat.numel()
    if kind in ("nan", "inf", "-inf"):
        flat[i] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[kind]
        return x
    if kind == "empty":
        return torch.empty(*shape[:-2], 0, shape[-1])
    if kind == "rank0":
        return torch.tensor(1.0)
    if kind == "rank1":
        return torch.randn(shape[-1])
    if kind == "int":
        return torch.randint(0, 5, shape)
    if kind == "bool":
        return torch.ones(shape, dtype=torch.bool)
    if kind == "complex":
        return torch.randn(shape, dtype=torch.complex64)
    if kind == "numpy":
        return x.numpy()
    if kind == "list":
        return x.tolist()
    if kind == "none":
        return None
    y = x.to(torch.float64)  # "huge64": finite in float64, beyond float32
    y.view(-1)[i] = 1e300
    return y


shapes = st.tuples(st.integers(1, 2), st.integers(1, 70), st.integers(1, 40))


@FAST
@given(scheme=st.sampled_from(SCHEMES), kind=st.sampled_from(TENSOR_KINDS), shape=shapes, pos=st.integers(0, 10 ** 6))
def test_quantizers_refuse_malformed_tensors(scheme, kind, shape, pos, reliability):
    reliability("bad input: tensors", f"every registered quantizer ({len(SCHEMES)}): {', '.join(TENSOR_KINDS)} (hypothesis)",
                "ValueError naming the tensor")
    x = bad_tensor(kind, shape, pos)
    with pytest.raises(ValueError) as e:
        quant.get(scheme).quantize(x, name="probe")
    assert "probe" in str(e.value)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", NOT_TENSORS)
def test_quantizers_refuse_non_tensors(scheme, kind, reliability):
    reliability("bad input: tensors", "every registered quantizer given a numpy array, a list or None",
                "ValueError naming the tensor")
    with pytest.raises(ValueError) as e:
        quant.get(scheme).quantize(bad_tensor(kind, (2, 8, 8), 0), name="probe")
    assert "probe" in str(e.value)


@FAST
@given(scheme=st.sampled_from(SCHEMES), shape=shapes, scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 6e4, 1e30, 3e38]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_quantizers_on_extreme_but_finite_values(scheme, shape, scale, dtype, reliability):
    """Finite input: either refused with a ValueError naming it, or decoded to a finite tensor of the same shape."""
    reliability("bad input: tensors", "every registered quantizer: finite values from 1e-30 to 3e38 in float32/64/16 "
                "and bfloat16 (hypothesis)", "ValueError naming the tensor, or a finite decode of the same shape")
    x = (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype)
    assume(bool(torch.isfinite(x).all()))
    q = quant.get(scheme)
    try:
        p = q.quantize(x, name="probe")
    except ValueError as e:
        assert "probe" in str(e)
        return
    y = q.dequantize(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert bool(torch.isfinite(y).all())


@FAST
@given(which=st.sampled_from(["k", "v"]), kind=st.sampled_from(BAD_KINDS), shape=shapes, pos=st.integers(0, 10 ** 6),
       recent=st.integers(0, 80), sink=st.integers(0, 80))
def test_residual_window_refuses_malformed_tensors(which, kind, shape, pos, recent, sink, reliability):
    reliability("bad input: tensors", f"residual window, K or V: {', '.join(BAD_KINDS)} (hypothesis)",
                "ValueError naming k or v")
    good = torch.randn(*shape)
    bad = bad_tensor(kind, shape, pos)
    k, v = (bad, good) if which == "k" else (good, bad)
    rw = ResidualWindow(IntGrouped(4, 32, "channel"), IntGrouped(4, 32, "token"), recent=recent, sink=sink)
    with pytest.raises(ValueError) as e:
        rw.pack(k, v)
    assert which in str(e.value)


@FAST
@given(field=st.sampled_from(["q", "k", "v"]), kind=st.sampled_from(BAD_KINDS), pos=st.integers(0, 10 ** 6))
def test_case_refuses_malformed_tensors(field, kind, pos, reliability):
    reliability("bad input: tensors", f"Case q, k or v: {', '.join(BAD_KINDS)} (hypothesis)", "ValueError naming the tensor")
    arrays = {"q": torch.randn(2, 3, 8), "k": torch.randn(1, 10, 8), "v": torch.randn(1, 10, 8)}
    shape = tuple(arrays[field].shape)
    arrays[field] = bad_tensor(kind, shape, pos)
    with pytest.raises(ValueError) as e:
        Case("c", **arrays, query_positions=torch.full((3,), 9), causal=True, layout=[Region("all", 0, 10)])
    assert f"c.{field}" in str(e.value) or "c:" in str(e.value)


CASE_BREAKS = {
    "id int": dict(id=5),
    "id with slash": dict(id="a/b"),
    "id with NUL": dict(id="a\x00"),
    "causal str": dict(causal="yes"),
    "meta list": dict(meta=[1]),
    "layout gap": dict(layout=[Region("a", 0, 4), Region("b", 5, 10)]),
    "layout short": dict(layout=[Region("a", 0, 9)]),
    "layout dict": dict(layout=[{"name": "a", "start": 0, "stop": 10}]),
    "layout repeated": dict(layout=[Region("a", 0, 5), Region("a", 5, 10)]),
    "positions float": dict(query_positions=torch.full((3,), 9.0)),
    "positions out of range": dict(query_positions=torch.full((3,), 10)),
    "positions negative": dict(query_positions=torch.full((3,), -1)),
    "positions wrong length": dict(query_positions=torch.full((4,), 9)),
    "gqa mismatch": dict(q=torch.randn(3, 3, 8), k=torch.randn(2, 10, 8), v=torch.randn(2, 10, 8)),
    "head dim mismatch": dict(q=torch.randn(2, 3, 4)),
    "k v shapes differ": dict(v=torch.randn(1, 11, 8)),
    "tokens_per_frame 3": dict(tokens_per_frame=3),
    "tokens_per_frame str": dict(tokens_per_frame="5"),
}


@pytest.mark.parametrize("what", list(CASE_BREAKS))
def test_case_refuses_malformed_fields(what, reliability):
    kw = dict(id="c", q=torch.randn(2, 3, 8), k=torch.randn(1, 10, 8), v=torch.randn(1, 10, 8),
              query_positions=torch.full((3,), 9), causal=True, layout=[Region("all", 0, 10)])
    kw.update(CASE_BREAKS[what])
    with pytest.raises(ValueError) as e:
        Case(**kw)
    reliability("bad input: tensors", f"Case with {what}", "ValueError", str(e.value))


# -- protocols -----------------------------------------------------------------------------------

BASE = {"name": "fuzz", "description": "", "default": False,
        "source": {"kind": "synthetic", "seeds": [1], "lengths": [64], "distributions": ["clean"], "head_dim": 16,
                   "queries": 4, "heads": 1, "kv_heads": 1, "focus_tokens": 8, "focus_logit": 4.0},
        "analyses": {"residual_window": {"bits": 4, "group_size": 16, "residuals": [0, 16], "early_window": 8,
                                         "float32_arm": True, "recent_mass_window": 8}},
        "timing": {"repeats": 0, "seed": 0}, "audit": {"rtol": 1e-6, "atol": 1e-9}}


def key_paths(obj, prefix=()):
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += key_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += key_paths(v, prefix + (i,))
    return out


def get_parent(obj, path):
    for p in path[:-1]:
        obj = obj[p]
    return obj


nasty_scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from([-1, 0, 1, 2, 3, 7, 16, 17, 63, 64, 65, 256, 2 ** 16, 2 ** 20 + 1,
                                                 2 ** 31, 2 ** 63, 2 ** 64, 10 ** 30, -10 ** 30]),
    st.floats(allow_nan=False, allow_infinity=False, width=64) | st.sampled_from([0.5, -0.5, 1e-300, 1e300]),
    st.text(max_size=6), st.sampled_from(["synthetic", "clean", "channel", "residual_window"]))
json_values = st.recursive(nasty_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                           max_leaves=6)


@st.composite
def mutated_protocols(draw):
    proto = json.loads(json.dumps(BASE))
    paths = key_paths(proto)
    op = draw(st.sampled_from(["delete", "replace", "replace", "add"]))
    path = draw(st.sampled_from(paths))
    parent = get_parent(proto, path)
    if op == "delete":
        del parent[path[-1]]
    elif op == "replace":
        parent[path[-1]] = draw(json_values)
    else:
        target = parent if isinstance(parent, dict) else proto
        target[draw(st.text(min_size=1, max_size=8))] = draw(json_values)
    return op, path, proto


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(mutation=mutated_protocols())
def test_mutated_protocols_exit_2_with_one_line_or_run_and_pass_audit(mutation, reliability):
    reliability("bad input: protocol", "one key deleted, added or replaced by any JSON value, through the CLI "
                "(hypothesis, 80)", "exit 2 with one 'error:' line naming the key, nothing written; or a valid "
                "protocol whose run passes the audit")
    op, path, proto = mutation
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        (d / "p.json").write_text(json.dumps(proto))
        out = d / "runs" / "out"
        err, std = io.StringIO(), io.StringIO()
        # Every valid mutation must also fit the memory guard's budget here, so a fuzzed absurd size is
        # refused (exit 2) instead of being run.
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std), _available(256 << 20):
            rc = run_main(["--quiet", "--out", str(out), "--protocol", str(d / "p.json")])
        lines = err.getvalue().strip().splitlines()
        leftovers = [p.name for p in out.parent.iterdir() if ".partial-" in p.name] if out.parent.exists() else []
        assert not leftovers
        if rc == 2:
            assert len(lines) == 1 and lines[0].startswith("error: "), (op, path, lines)
            assert not out.exists()
            if path and path[0] in ("source", "analyses", "timing", "audit", "name") and "cannot build case" not in lines[0] \
                    and "memory" not in lines[0]:
                assert "p.json." in lines[0] or "p.json:" in lines[0], lines[0]  # names the key path
        else:
            assert rc == 0, (op, path, lines)
            ok, failures, _ = audit(out, check_sources=False)
            assert ok, (op, path, failures[:3])


@contextlib.contextmanager
def _available(nbytes):
    old = resources.available_bytes
    resources.available_bytes = lambda: nbytes
    try:
        yield
    finally:
        resources.available_bytes = old


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=mutated_protocols())
def test_validate_protocol_raises_only_protocol_errors(mutation, reliability):
    reliability("bad input: protocol", "same mutations through validate_protocol (hypothesis, 150)",
                "ProtocolError whose message starts with the key path, nothing else")
    _, _, proto = mutation
    try:
        validate_protocol(proto, "p")
    except ProtocolError as e:
        assert str(e).startswith("p"), str(e)


# -- manifests and results -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzzrun")
    (d / "p.json").write_text(json.dumps(BASE))
    out = d / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        assert run_main(["--quiet", "--out", str(out), "--protocol", str(d / "p.json")]) == 0
    return out


DESCRIPTIVE = {"created_utc", "wall_seconds", "environment", "excluded", "memory_guard", "sources"}


@st.composite
def mutated_json(draw, doc):
    doc = json.loads(json.dumps(doc))
    path = draw(st.sampled_from(key_paths(doc)))
    parent = get_parent(doc, path)
    old = parent[path[-1]]
    new = draw(json_values)
    parent[path[-1]] = new
    return path, old, new, doc


def _copy_run(src: Path, dst: Path) -> None:
    import shutil

    shutil.copytree(src, dst)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_manifest_gives_fail_lines_never_an_exception(tiny_run, data, reliability):
    reliability("tamper: fuzz", "any subtree of manifest.json replaced by any JSON value (hypothesis, 40)",
                "FAIL lines, never an exception; PASS only for descriptive fields")
    manifest = json.loads((tiny_run / "manifest.json").read_text())
    path, old, new, doc = data.draw(mutated_json(manifest))
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        _copy_run(tiny_run, run)
        (run / "manifest.json").write_text(json.dumps(doc))
        ok, failures, _ = audit(run, check_sources=False)  # must not raise
    assert all(f.startswith("FAIL: ") for f in failures)
    if ok:
        descriptive = path[0] in DESCRIPTIVE or (path[0] == "protocols" and path[-1] in ("path", "description"))
        assert descriptive or old == new, (path, old, new)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_results_with_rehash_gives_fail_lines_never_an_exception(tiny_run, data, reliability):
    reliability("tamper: fuzz", "any subtree of results.json replaced by any JSON value, sha256 updated (hypothesis, 40)",
                "FAIL lines, never an exception")
    results = json.loads((tiny_run / "results.json").read_text())
    path, old, new, doc = data.draw(mutated_json(results))
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        _copy_run(tiny_run, run)
        raw = (json.dumps(doc) + "\n").encode()
        (run / "results.json").write_bytes(raw)
        m = json.loads((run / "manifest.json").read_text())
        m["files"]["results.json"] = hashlib.sha256(raw).hexdigest()
        (run / "manifest.json").write_text(json.dumps(m))
        ok, failures, _ = audit(run, check_sources=False)  # must not raise
    assert all(f.startswith("FAIL: ") for f in failures)


@pytest.mark.parametrize("gates", [{"": {}}, {"fuzz.p.records": {}}, {"nostudy.p.records": {"expected": 1, "actual": 1}},
                                   {"fuzz.p.records": {"expected": 1, "actual": 1, "note": "x"}}])
def test_a_gate_that_is_not_a_met_gate_of_a_study_of_the_run_fails(tiny_run, tmp_path, gates):
    """What hypothesis found: a manifest whose gates hold an empty object (expected and actual both
    missing, so "equal") passed. A gate is exactly {expected, actual}, met, and named after a study
    of this run."""
    run = tmp_path / "run"
    _copy_run(tiny_run, run)
    m = json.loads((run / "manifest.json").read_text())
    m["gates"] = gates
    (run / "manifest.json").write_text(json.dumps(m))
    ok, failures, _ = audit(run, check_sources=False)
    assert not ok and any("manifest.json gates." in f for f in failures), failures[:3]
