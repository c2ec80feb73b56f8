"""The audit re-encodes every integer payload and float32 window from the stored input, byte for byte.

Each forgery here is consistent: the forger edits a payload .npy, records its new sha256, and
re-derives every reported number of the run from the forged payload with the audit's own arithmetic
(and redraws report.html and report.md). A control proves the forgery consistent: with the audit's
payload comparison switched off, the forged run passes. With it on, the audit FAILs with a line naming the
array. The last tests show that the audit's numpy encoder equals the run's ``IntGrouped`` byte for
byte, on both sides of the numba fast path's size threshold.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import testbed.audit as audit_mod
from testbed.audit import audit
from testbed.audit_checks import live_evidence, live_scored
from testbed.audit_checks import residual_window as rw_check
from testbed.audit_checks.schemes import encode_int_grouped, pack_bits, unpack_bits
from testbed.quant import IntGrouped, kernels
from testbed.run import main as run_main
from tests import _arrays
from tests._helpers import REPO
from tests.test_tamper import rehash, results, small_protocol, write_results
from tests._reliability import record_audit_verdicts

CASE = "clean-s7-n128"
PAYLOAD_LINE = "stored payload differs from the audit's re-encoding of"


# -- runs --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rw_finished(tmp_path_factory) -> Path:
    """The residual-window protocol on one seed and one length (N = 128, G = 32, R in 0/16/64, first16)."""
    base = tmp_path_factory.mktemp("reencode_rw")
    proto = base / "residual_window.json"
    proto.write_text(json.dumps(small_protocol(), indent=1))
    out = base / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(proto)]) == 0
    return out


@pytest.fixture(autouse=True)
def _recorded(reliability, request, monkeypatch):
    """Each test's audit verdict goes to the generated reliability table (docs/reliability.md)."""
    yield from record_audit_verdicts(reliability, request, monkeypatch, "tamper: re-encode")


@pytest.fixture(scope="module")
def ablation_finished(tmp_path_factory) -> Path:
    """The ablation protocol cut to one seed of the LLM layout, the float32 arm and int4 with the recent
    region float32 (history 48 tokens: [0, 32) packed in one group of 32, [32, 48) float32)."""
    base = tmp_path_factory.mktemp("reencode_ablation")
    proto = json.loads((REPO / "protocols" / "ablation.json").read_text())
    proto["source"].update(seeds=[1], layouts=["llm"])
    proto["analyses"] = {"ablation": dict(proto["analyses"]["ablation"], kv_arms=[
        a for a in proto["analyses"]["ablation"]["kv_arms"] if a["name"] in ("float32", "int4_window")])}
    proto.update(default=False, timing={"repeats": 0, "seed": 0})
    path = base / "ablation.json"
    path.write_text(json.dumps(proto, indent=1))
    out = base / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(path)]) == 0
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(src, dst, symlinks=True)
    return dst


# -- the consistent forger ----------------------------------------------------------------------

@contextlib.contextmanager
def payload_check_off():
    """The audit with its payload re-encoding comparison switched off (and nothing else)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rw_check, "payload_differences", lambda *a, **k: [])
        mp.setattr(live_evidence, "payload_differences", lambda *a, **k: [])
        mp.setattr(live_scored, "payload_differences", lambda *a, **k: [])
        yield


def _json_like(derived, reported):
    if isinstance(derived, (list, tuple, np.ndarray)):
        return [None if (x is None or (isinstance(x, float) and np.isnan(x))) else float(x)
                for x in np.asarray(derived, dtype=np.float64).tolist()]
    if isinstance(reported, int) and not isinstance(reported, bool) and float(derived).is_integer():
        return int(derived)
    return None if derived is None else float(derived)


def rederive(run: Path) -> int:
    """Rewrite every reported number the audit derives differently from the (forged) arrays, with the
    audit's own arithmetic, then redraw report.html and report.md: what a consistent forger does.
    Returns how many numbers it rewrote."""
    edits: dict[tuple[int, str], tuple] = {}
    orig_close, orig_equal = audit_mod.Audit.close, audit_mod.Audit.equal

    def close(self, row, name, reported, derived):
        ok = orig_close(self, row, name, reported, derived)
        if not ok and isinstance(row, dict) and "_index" in row:
            edits[(row["_index"], name)] = (derived, reported)
        return ok

    def equal(self, row, name, reported, derived):
        ok = orig_equal(self, row, name, reported, derived)
        if not ok and isinstance(row, dict) and "_index" in row:
            edits[(row["_index"], name)] = (derived, reported)
        return ok

    with payload_check_off(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(audit_mod.Audit, "close", close)
        mp.setattr(audit_mod.Audit, "equal", equal)
        audit(run, check_sources=False)
    res = results(run)
    for (i, name), (derived, reported) in edits.items():
        assert name in res["rows"][i], f"the forger cannot rewrite {name!r} of row {i}"
        res["rows"][i][name] = _json_like(derived, reported)
    write_results(run, res, forge=True)  # report.html and report.md redrawn too
    return len(edits)


def forge_and_audit(run: Path, moved_numbers: bool = True) -> list[str]:
    """Re-derive the run's numbers, prove the forgery consistent (the audit passes without its payload
    comparison), then return the FAIL lines of the full audit (which must fail)."""
    n = rederive(run)
    if moved_numbers:
        assert n > 0, "the forged payload moved no reported number: the forgery tests nothing"
    with payload_check_off():
        ok, failures, _ = audit(run, check_sources=False)
    assert ok, f"the forgery is not consistent: {failures[:3]}"
    ok, failures, _ = audit(run, check_sources=False)
    assert not ok
    assert all(f.startswith("FAIL: ") and "\n" not in f for f in failures)
    return failures


def _payload(run: Path, row_pred) -> tuple[dict, dict]:
    res = results(run)
    row = next(r for r in res["rows"] if row_pred(r))
    return row, row["arrays"]["packed"]


def _save(run: Path, rel: str, x: np.ndarray) -> None:
    _arrays.save(run, rel, x)
    rehash(run, rel)


def _line(failures, name, where=None):
    hit = [f for f in failures if f": {name}: {PAYLOAD_LINE}" in f and (where is None or where in f)]
    assert hit, f"no FAIL line names {name}: {failures[:5]}"
    print(hit[0])
    return hit[0]


# -- the forgeries -------------------------------------------------------------------------------

def _better_int4(x: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """K [H, T, D] per channel in groups of g tokens (a partial last group padded with its edge token),
    each group's range shrunk by the factor in 0.80..1.00 that minimizes its squared error over its
    real tokens: (codes, scale16, zero16, error of this encoding, error of min-max)."""
    h, t, d = x.shape
    pad = (-t) % g
    xp = np.concatenate([x, np.repeat(x[:, -1:], pad, axis=1)], axis=1) if pad else x
    grp = xp.reshape(h, -1, g, d).astype(np.float32)
    real = (np.arange(t + pad) < t).reshape(-1, g)[None, :, :, None]
    mn, mx = grp.min(2), grp.max(2)
    best = None
    for f in np.linspace(0.80, 1.0, 21, dtype=np.float32):
        rng_ = (mx - mn) * f
        s16 = (rng_ / np.float32(15)).astype(np.float16)
        z16 = (mn + (mx - mn - rng_) / np.float32(2)).astype(np.float16)
        s, z = s16.astype(np.float32)[:, :, None], z16.astype(np.float32)[:, :, None]
        c = np.clip(np.rint((grp - z) / np.where(s > 0, s, 1)), 0, 15)
        err = (((c * s + z - grp) ** 2) * real).sum(2)
        if best is None:
            best, base_err = (err, c, s16, z16), err.sum()
            continue
        take = err < best[0]
        best = (np.where(take, err, best[0]), np.where(take[:, :, None], c, best[1]),
                np.where(take, s16, best[2]), np.where(take, z16, best[3]))
    err, c, s16, z16 = best
    codes = pack_bits(c.astype(np.uint8).reshape(h, -1, d), 4)
    return codes, s16.astype(np.float16), z16.astype(np.float16), float(err.sum()), float(base_err)


def test_untouched_runs_pass(rw_finished, ablation_finished):
    for run in (rw_finished, ablation_finished):
        ok, failures, _ = audit(run, check_sources=False)
        assert ok, failures[:5]


def test_better_than_min_max_int4_key_encoding_fails(rw_finished, tmp_path):
    """(a) The R=16 arm's K span (112 tokens, groups of 32, the last padded) re-encoded with a
    per-group range chosen to minimize the error: a better payload, consistent numbers, one FAIL."""
    run = _copy(rw_finished, tmp_path)
    row, packed = _payload(run, lambda r: r["case"] == CASE and r["arm"] == "R=16")
    case = results(run)["cases"]["residual_window"][CASE]["arrays"]
    k = _arrays.load(run, case["k"])
    codes, s16, z16, err, base_err = _better_int4(k[:, :112], 32)
    assert err < base_err  # it is a better encoding than min-max
    for name, x in (("key.codes", codes), ("key.scale", s16), ("key.zero", z16)):
        assert x.shape == _arrays.load(run, packed[name]).shape
        _save(run, packed[name], x)
    failures = forge_and_audit(run)
    _line(failures, "key.codes", "arm=R=16")
    _line(failures, "key.scale", "arm=R=16")


def _bump_code(run: Path, rel: str, bits: int, index: tuple, width: int) -> int:
    """Code ``index`` of a packed array (``width`` codes per row) moved by one; returns the byte's
    flat index in the packed array."""
    packed = _arrays.load(run, rel)
    c = unpack_bits(packed, bits, width).copy()
    c[index] = c[index] + 1 if c[index] < (1 << bits) - 1 else c[index] - 1
    _save(run, rel, pack_bits(c, bits))
    per = 8 // bits
    byte = (*index[:-1], index[-1] // per)
    return int(np.ravel_multi_index(byte, packed.shape))


def test_one_code_moved_by_one_fails_at_its_element(rw_finished, tmp_path):
    """(b) One int4 key code of R=16 (token 40, channel 7) moved by +-1."""
    run = _copy(rw_finished, tmp_path)
    _, packed = _payload(run, lambda r: r["case"] == CASE and r["arm"] == "R=16")
    d = _arrays.load(run, packed["key.scale"]).shape[-1]
    at = _bump_code(run, packed["key.codes"], 4, (0, 40, 7), d)
    line = _line(forge_and_audit(run), "key.codes", "arm=R=16")
    assert f"at element {at} " in line, line


@pytest.mark.parametrize("name", ["key.scale", "key.zero", "value.scale", "value.zero"])
def test_scale_or_zero_point_one_float16_ulp_fails(rw_finished, tmp_path, name):
    """(c) One float16 scale or zero-point of R=16 moved by one ulp (its bit pattern + 1)."""
    run = _copy(rw_finished, tmp_path)
    _, packed = _payload(run, lambda r: r["case"] == CASE and r["arm"] == "R=16")
    x = _arrays.load(run, packed[name])
    scale = _arrays.load(run, packed[name.split(".")[0] + ".scale"])
    i = int(np.flatnonzero(scale.ravel() > 0)[3])  # a group with a live scale: its codes are decoded
    bits = x.view(np.uint16).copy().ravel()
    bits[i] += 1
    _save(run, packed[name], bits.view(np.float16).reshape(x.shape))
    line = _line(forge_and_audit(run), name, "arm=R=16")
    assert f"at element {i} " in line, line


@pytest.mark.parametrize("arm,r", [("R=16", 16), ("R=64", 64)])
def test_float32_window_shifted_by_one_token_fails(rw_finished, tmp_path, arm, r):
    """(d) The off-by-one window: recent.k / recent.v taken from tokens [n-R-1, n-1) instead of [n-R, n)."""
    run = _copy(rw_finished, tmp_path)
    _, packed = _payload(run, lambda row: row["case"] == CASE and row["arm"] == arm)
    case = results(run)["cases"]["residual_window"][CASE]["arrays"]
    for part in ("k", "v"):
        x = _arrays.load(run, case[part])
        n = x.shape[1]
        _save(run, packed[f"recent.{part}"], np.ascontiguousarray(x[:, n - r - 1:n - 1]))
    failures = forge_and_audit(run)
    _line(failures, "recent.k", f"arm={arm}")
    _line(failures, "recent.v", f"arm={arm}")


def test_padding_code_of_a_partial_group_fails(rw_finished, tmp_path):
    """A padding code (tokens 112..127 of R=16's 112-token span padded to 128) is never decoded, so
    no number moves; the re-encoding still catches it."""
    run = _copy(rw_finished, tmp_path)
    _, packed = _payload(run, lambda r: r["case"] == CASE and r["arm"] == "R=16")
    d = _arrays.load(run, packed["key.scale"]).shape[-1]
    at = _bump_code(run, packed["key.codes"], 4, (0, 127, 0), d)
    line = _line(forge_and_audit(run, moved_numbers=False), "key.codes", "arm=R=16")
    assert f"at element {at} " in line, line


# -- the same on an ablation quantized arm -----------------------------------------------------------

def _ablation_none(run: Path):
    return _payload(run, lambda r: r["analysis"] == "ablation" and r["arm"] == "int4_window" and r["ablation"] == "none")


def test_ablation_quantized_arm_code_moved_by_one_fails(ablation_finished, tmp_path):
    run = _copy(ablation_finished, tmp_path)
    row, packed = _ablation_none(run)
    d = _arrays.load(run, packed["value.scale"]).shape[-1] * 32
    at = _bump_code(run, packed["value.codes"], 4, (1, 5, 9), d)
    line = _line(forge_and_audit(run), "value.codes", "arm=int4_window ablation=none")
    assert f"at element {at} " in line, line


def test_ablation_quantized_arm_scale_one_ulp_fails(ablation_finished, tmp_path):
    run = _copy(ablation_finished, tmp_path)
    _, packed = _ablation_none(run)
    x = _arrays.load(run, packed["key.scale"])
    bits = x.view(np.uint16).copy()
    bits[0, 0, 3] += 1
    _save(run, packed["key.scale"], bits.view(np.float16))
    line = _line(forge_and_audit(run), "key.scale", "arm=int4_window ablation=none")
    assert f"at element {int(np.ravel_multi_index((0, 0, 3), x.shape))} " in line, line


def test_ablation_quantized_arm_window_shifted_by_one_token_fails(ablation_finished, tmp_path):
    run = _copy(ablation_finished, tmp_path)
    row, packed = _ablation_none(run)
    stop = row["quantized_tokens"]
    case = results(run)["cases"][row["study"]][row["case"]]["arrays"]
    for part in ("k", "v"):
        w = _arrays.load(run, packed[f"recent.{part}"])
        x = _arrays.load(run, case[part])[:, :stop]
        r = w.shape[1]
        assert np.array_equal(w, x[:, stop - r:])  # the window is the history's last R tokens
        _save(run, packed[f"recent.{part}"], np.ascontiguousarray(x[:, stop - r - 1:stop - 1]))
    failures = forge_and_audit(run)
    _line(failures, "recent.k", "arm=int4_window ablation=none")


# -- the live study's evidence layer (needs the SmolLM2 model) --------------------------------------

@pytest.fixture(scope="module")
def live_finished(live_tiny_run):
    return live_tiny_run  # tests/conftest.py: the tiny live protocol's run, shared with test_live


def _evidence(run: Path, arm: str) -> dict:
    row = next(r for r in results(run)["rows"] if r.get("arm") == arm and r.get("case") == "seg000")
    return row["evidence"]["arrays"]


@pytest.mark.capture
@pytest.mark.slow
@pytest.mark.parametrize("what", ["int4_scale_ulp", "int2_ktoken_code", "int4_window_shift"])
def test_live_evidence_layer_forgeries_fail(live_finished, tmp_path, what):
    """The evidence layer's arrays feed no reported number (only its byte total, unchanged here), so a
    re-hashed edit is a consistent forgery."""
    run = _copy(live_finished, tmp_path)
    if what == "int4_scale_ulp":
        ev = _evidence(run, "int4")
        x = _arrays.load(run, ev["key.scale"])
        bits = x.view(np.uint16).copy()
        bits.flat[5] += 1
        _save(run, ev["key.scale"], bits.view(np.float16))
        name, arm, at = "key.scale", "int4", 5
    elif what == "int2_ktoken_code":
        ev = _evidence(run, "int2_ktoken")
        d = _arrays.load(run, ev["key.scale"]).shape[-1] * 32
        at = _bump_code(run, ev["key.codes"], 2, (2, 3, 17), d)
        name, arm = "key.codes", "int2_ktoken"
    else:
        ev = _evidence(run, "int4")
        for part in ("k", "v"):
            x = _arrays.load(run, ev[f"input.{part}"])
            w = _arrays.load(run, ev[f"float.{part}"])
            n, f = x.shape[1], w.shape[1]
            assert np.array_equal(w, x[:, n - f:])
            _save(run, ev[f"float.{part}"], np.ascontiguousarray(x[:, n - f - 1:n - 1]))
        name, arm, at = "float.k", "int4", None
    line = _line(forge_and_audit(run, moved_numbers=False), name, f"arm={arm}")
    if at is not None:
        assert f"at element {at} " in line, line


@pytest.mark.capture
@pytest.mark.slow
@pytest.mark.parametrize("what", ["index", "index_and_scores", "score", "query", "sink_k", "nan_scores"])
def test_live_chosen_sink_forgeries_fail(live_finished, tmp_path, what):
    """The sink a policy chose from attention: its indices, its scores, the queries the scores come
    from and the sink's K are each re-derived; an edit of any of them, re-hashed, fails the row."""
    run = _copy(live_finished, tmp_path)
    ev = _evidence(run, "int2_sinkmass4")
    idx = _arrays.load(run, ev["sink.index"]).copy()
    score = _arrays.load(run, ev["sink.score"]).copy()
    other = next(j for j in range(score.shape[1]) if j not in idx[1])
    if what == "index":  # another token named in head 1's sink, nothing else changed
        idx[1, -1] = other
        _save(run, ev["sink.index"], np.sort(idx, axis=-1))
        expect = "sink.index is not the top-S"
    elif what == "index_and_scores":  # and the scores rewritten so that the rule picks it
        score[1, other] = score[1].max() + 1.0
        idx[1] = np.sort(np.argsort(-score[1], kind="stable")[:idx.shape[1]])
        _save(run, ev["sink.index"], idx)
        _save(run, ev["sink.score"], score)
        expect = "sink.score differs at (1, "
    elif what == "score":
        score[0, 1] *= 1.01
        _save(run, ev["sink.score"], score)
        expect = "sink.score differs at (0, 1)"
    elif what == "query":  # the recorded queries scaled: the shares they give are not the stored ones
        _save(run, ev["input.q"], _arrays.load(run, ev["input.q"]) * 1.5)
        expect = "sink.score differs"
    elif what == "nan_scores":  # the true choice's scores made NaN (they compare as neither equal nor unequal)
        score[1, idx[1]] = np.nan
        idx[1] = np.sort(np.argsort(-score[1], kind="stable")[:idx.shape[1]])
        _save(run, ev["sink.score"], score)
        _save(run, ev["sink.index"], idx)
        expect = "must be finite"
    else:  # the sink's first key of head 0 replaced by the first token's, the sink no longer the chosen one
        k = _arrays.load(run, ev["sink.k"]).copy()
        k[0, 0] = _arrays.load(run, ev["input.k"])[0, other]
        _save(run, ev["sink.k"], k)
        expect = "sink.k"
    ok, failures, _ = audit(run, check_sources=False)
    assert not ok
    assert any("arm=int2_sinkmass4" in f and expect in f for f in failures), failures[:5]


@pytest.mark.capture
@pytest.mark.slow
@pytest.mark.parametrize("what", ["swap_bits", "swap_bits_and_scores", "one_more_low", "low_head_code", "oracle_query",
                                  "share"])
def test_live_allocation_forgeries_fail(live_finished, tmp_path, what):
    """A per-head precision row's allocation: the bits of its pairs follow the rule from the stored
    scores, in exactly the protocol's share; the evidence layer's scores are recomputed from the
    recorded queries (the prefill's, or the oracle pass's) and its heads re-encoded at their own
    bits. Each edit below, re-hashed, fails the row."""
    run = _copy(live_finished, tmp_path)
    # the evidence layer (2) of the SHA-256 order holds int4 and int2 heads: the low width is re-encoded
    arm = {"oracle_query": "mix28_oracle_diffuse", "low_head_code": "mix24_random"}.get(what, "mix24_concentrated")
    row = next(r for r in results(run)["rows"] if r.get("arm") == arm and r.get("case") == "seg000")
    bits = _arrays.load(run, row["arrays"]["alloc_bits"]).copy()
    score = _arrays.load(run, row["arrays"]["alloc_score"]).copy()
    lo_at, hi_at = np.argwhere(bits == 2)[0], np.argwhere(bits != 2)[0]
    if what == "swap_bits":  # one int2 pair and one int4 pair exchanged: the count and bytes unchanged
        bits[tuple(lo_at)], bits[tuple(hi_at)] = bits[tuple(hi_at)], bits[tuple(lo_at)]
        _save(run, row["arrays"]["alloc_bits"], bits)
        expect = "not the concentrated rule's choice"
    elif what == "swap_bits_and_scores":  # and their scores too, so the rule holds: the evidence layer's fail
        ev = row["evidence"]["layer"]  # a pair of the evidence layer, whose scores the audit recomputes
        other = tuple(np.argwhere((bits != bits[ev, 0]) & (np.arange(bits.shape[0]) != ev)[:, None])[0])
        bits[ev, 0], bits[other] = bits[other], bits[ev, 0]
        score[ev, 0], score[other] = score[other], score[ev, 0]
        _save(run, row["arrays"]["alloc_bits"], bits)
        _save(run, row["arrays"]["alloc_score"], score)
        expect = "the audit's float64 concentration"
    elif what == "one_more_low":
        bits[tuple(hi_at)] = 2
        _save(run, row["arrays"]["alloc_bits"], bits)
        expect = "pairs at the low bits"
    elif what == "low_head_code":
        ev = row["evidence"]["arrays"]
        name = "int2.key.codes"  # the low width's heads of the evidence layer
        assert name in ev, sorted(ev)
        at = _bump_code(run, ev[name], int(name[3]), (0, 3, 17), 64)
        expect = name
    elif what == "share":  # the row claims another share of low pairs (the bits and bytes left as they are)
        from tests._helpers import forge_results

        res = results(run)
        forged = next(r for r in res["rows"] if r.get("arm") == arm and r.get("case") == "seg000")
        forged["policy"]["low_share"] = 0.25
        forge_results(run, res)
        expect = "policy.low_share"
    else:  # the oracle pass's queries scaled: the concentration they give is not the stored one
        ev = row["evidence"]["arrays"]
        _save(run, ev["oracle.q"], _arrays.load(run, ev["oracle.q"]) * 1.5)
        expect = "the audit's float64 concentration"
    ok, failures, _ = audit(run, check_sources=False)
    assert not ok
    assert any(f"arm={arm}" in f and expect in f for f in failures), failures[:5]
    if what == "low_head_code":
        assert any(f"at element {at} " in f for f in failures), failures[:5]


# -- the audit's encoder equals the run's, byte for byte ------------------------------------------------

@st.composite
def grouped_inputs(draw, side):
    """float32 [H, T, D] below or at/above the fast path's size threshold, of one of several kinds:
    gaussian at any scale, exact rounding ties, constant groups, signed zeros, tiny (subnormal
    float16 scales) and offset values."""
    limit = kernels.MIN_FAST_ELEMENTS
    d = draw(st.integers(1, 160))
    n = draw(st.integers(1, 700))
    lead = draw(st.integers(1, 4))
    if side == "above":
        lead = max(lead, -(-limit // (n * d)))
        if lead > 64:
            n = -(-limit // (d * 4))
            lead = 4
    else:
        while lead * n * d >= limit:
            n = max(1, n // 2)
            lead = 1
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    kind = draw(st.sampled_from(["gauss", "ties", "constant", "zeros", "tiny", "offset"]))
    shape = (lead, n, d)
    if kind == "gauss":
        x = rng.standard_normal(shape) * 10.0 ** draw(st.integers(-6, 3))
    elif kind == "ties":  # zero + (k + 1/2) scale with float16 scale and zero: quotients exactly halfway
        s = float(np.float16(2.0 ** draw(st.integers(-10, 2))))
        x = np.float16(rng.standard_normal()).astype(np.float64) + (rng.integers(0, 15, shape) + 0.5) * s
    elif kind == "constant":
        x = np.repeat(rng.standard_normal((lead, 1, d)), n, axis=1)
    elif kind == "zeros":
        x = np.where(rng.random(shape) < 0.5, -0.0, 0.0) + (rng.random(shape) < 0.05) * rng.standard_normal(shape)
    elif kind == "tiny":
        x = rng.standard_normal(shape) * 1e-6
    else:
        x = 300.0 + rng.standard_normal(shape) * 0.01
    return np.ascontiguousarray(x, dtype=np.float32)


@pytest.mark.parametrize("side", ["below", "above"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), bits=st.sampled_from([2, 4, 8]), g=st.sampled_from([2, 4, 8, 16, 32, 64, 128]),
       axis=st.sampled_from(["channel", "token"]))
def test_audit_encoder_equals_run_encoder(side, data, bits, g, axis):
    if side == "above" and not kernels.available():
        pytest.skip("numba is missing: the fast path does not exist here")
    x = data.draw(grouped_inputs(side))
    t = torch.from_numpy(x)
    assert kernels.use_fast(t) == (side == "above")  # the side of the threshold this example is on
    q = IntGrouped(bits, g, axis)
    want = encode_int_grouped(x, q.config())
    for packed in (q.quantize(t), q.quantize_reference(t)):  # the path a run takes, and the definition
        got = packed.arrays
        assert set(got) == set(want)
        for name in got:
            assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
            assert got[name].tobytes() == want[name].tobytes(), (name, bits, g, axis, x.shape)


@pytest.mark.capture
@pytest.mark.slow
def test_arms_that_share_one_prefill_must_record_one_prefill(live_finished, tmp_path):
    """With a shared float32 prefill every arm's recorded prefill keys are one array: one arm's,
    changed and re-hashed, fails naming the disagreement (beside whatever else it breaks)."""
    run = _copy(live_finished, tmp_path)
    ev = _evidence(run, "int4")
    k = _arrays.load(run, ev["input.k"]).copy()
    k[0, 1, 3] = np.nextafter(k[0, 1, 3], np.float32(np.inf))
    _save(run, ev["input.k"], k)
    ok, failures, _ = audit(run, check_sources=False)
    assert not ok
    assert any("input.k[:, :P] differs between arms that share one float32 prefill" in f and "int4" in f
               for f in failures), failures[:5]
