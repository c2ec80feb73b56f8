"""mx_paths and residual_window over tiles of queries (issue #35): any tiling gives the untiled
definition's numbers (per row, and whole-case sums), and a Case whose float64 ``P[H, Tq, Tk]``
would take hundreds of MB runs in a fraction of that."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from testbed.analyses import mx_paths, residual_window
from testbed.attention import attention, expand_kv, probabilities, query_tiles
from testbed.case import Case, Region
from testbed.context import RunContext
from testbed.evidence import ArrayStore
from testbed.metrics import OutputError, cosine, max_abs, rel_l2
from testbed.quant.mx import MX, saturated_blocks
from testbed.resources import attention_chain_bytes
from tests import _arrays

REPO = Path(__file__).resolve().parent.parent
H, HKV, TQ, TK, D = 4, 2, 7, 96, 64


def _case(causal: bool) -> Case:
    g = torch.Generator().manual_seed(11 if causal else 12)
    q = torch.randn(H, TQ, D, generator=g) * 1.5
    k = torch.randn(HKV, TK, D, generator=g) * 1.5
    v = torch.randn(HKV, TK, D, generator=g)
    pos = torch.tensor([5, 17, 30, 44, 60, 81, TK - 1]) if causal else torch.full((TQ,), TK - 1)
    return Case(id="c" if causal else "n", q=q, k=k, v=v, query_positions=pos, causal=causal,
                layout=(Region("sink", 0, 16), Region("middle", 16, TK - 16), Region("recent", TK - 16, TK)),
                meta={"source": "test", "focus_span": [0, 16]})


# max_scores -> tiles: one query per tile, 3 queries per tile (7 = 3 + 3 + 1: does not divide Tq), one tile
TILINGS = {"one_query": H * TK, "three_queries": 3 * H * TK + 5, "one_tile": None}


def _params(module, max_scores, **extra):
    p = dict(extra)
    if max_scores is not None:
        p["max_scores"] = max_scores
    return module.validate(p, "analyses.x")


def test_query_tiles_cover_every_query_once_within_the_budget():
    for tq, heads, tk, budget in [(7, 4, 96, 4 * 96), (7, 4, 96, 3 * 4 * 96 + 5), (7, 4, 96, 1 << 21), (5, 2, 10, 1),
                                  (2340, 32, 6240, 1 << 21)]:
        tiles = query_tiles(heads, tq, tk, budget)
        assert [i for sl in tiles for i in range(sl.start, sl.stop)] == list(range(tq))
        assert all(heads * (sl.stop - sl.start) * tk <= max(budget, heads * tk) for sl in tiles)
        assert len(tiles) == math.ceil(tq / max(1, min(tq, budget // (heads * tk))))
    assert len(query_tiles(4, 7, 96, 1 << 21)) == 1


@pytest.mark.parametrize("parts", [1, 2, 5])
def test_output_error_over_tiles_is_the_whole_tensor_error(parts):
    g = torch.Generator().manual_seed(parts)
    ref = torch.randn(3, 11, 8, generator=g, dtype=torch.float64)
    x = ref + 1e-3 * torch.randn(3, 11, 8, generator=g, dtype=torch.float64)
    acc = OutputError()
    for idx in torch.tensor_split(torch.arange(11), parts):
        acc.add(x[:, idx], ref[:, idx])
    if parts == 1:  # one tile: the whole-tensor functions bit for bit
        assert (acc.rel_l2, acc.cosine, acc.max_abs) == (rel_l2(x, ref), cosine(x, ref), max_abs(x, ref))
    assert acc.rel_l2 == pytest.approx(rel_l2(x, ref), rel=1e-12)
    assert acc.cosine == pytest.approx(cosine(x, ref), rel=1e-12)
    assert acc.max_abs == max_abs(x, ref)
    zero = OutputError()
    zero.add(torch.zeros(2, 3), torch.zeros(2, 3))
    assert (zero.rel_l2, zero.cosine) == (0.0, 1.0)


def _mx_untiled(case: Case, rot: str, path: str) -> dict:
    """The mx_paths definitions over the whole [H, Tq, Tk] at once (the module docstring), written
    here from the quantizer and the float64 reference, not from the analysis."""
    p_ref = probabilities(case.q, case.k, case.query_positions, case.causal)
    v64 = expand_kv(case.v, case.heads).to(torch.float64)
    o_ref = p_ref @ v64
    if path == "qk":
        mx = MX("e4m3", 32, None if rot == "none" else rot, 0, "floor")
        q_hat = mx.decode_rotated(mx.quantize(case.q))
        k_hat = mx.decode_rotated(mx.quantize(case.k))
        p_hat = probabilities(q_hat, k_hat, case.query_positions, case.causal)
        extra = {}
    else:
        mx = MX("e4m3", 32)
        p32 = p_ref.to(torch.float32)
        packed = mx.quantize(p32)
        p_hat = mx.dequantize(packed).to(torch.float64)
        sat = saturated_blocks(p32, packed.tensors["scales"], mx.fmt, mx.block_size)
        vis = p_ref > 0
        extra = {"numerical_zero_rate": ((p_hat == 0) & vis).sum(-1).double() / vis.sum(-1).double(),
                 "row_sum": p_hat.sum(-1),
                 "codes": packed.tensors["codes"].numpy(), "scales": packed.tensors["scales"].numpy(),
                 "block_saturation": float(sat.sum()) / sat.numel()}
    return {"tv": 0.5 * (p_hat - p_ref).abs().sum(-1), "strict": p_hat.argmax(-1) == p_ref.argmax(-1),
            "rel_l2": float(torch.linalg.vector_norm(p_hat @ v64 - o_ref) / torch.linalg.vector_norm(o_ref)), **extra}


@pytest.mark.parametrize("causal", [False, True], ids=["decode", "causal"])
@pytest.mark.parametrize("tiling", list(TILINGS))
def test_mx_paths_tiles_give_the_untiled_definition(tmp_path, causal, tiling):
    case = _case(causal)
    params = _params(mx_paths, TILINGS[tiling])
    ntiles = len(query_tiles(H, TQ, TK, params["max_scores"]))
    assert ntiles == {"one_query": TQ, "three_queries": 3, "one_tile": 1}[tiling]
    rows = mx_paths.evaluate(case, params, RunContext(ArrayStore(tmp_path), study="t", timing_repeats=1))
    assert {(r["path"], r["rotation"]) for r in rows} == {("qk", "none"), ("qk", "signed_hadamard"), ("p", "none")}
    for r in rows:
        want = _mx_untiled(case, r["rotation"], r["path"])
        assert r["rows"] == H * TQ
        np.testing.assert_allclose(r["per_row"]["tv"], want["tv"].reshape(-1).numpy(), rtol=0, atol=1e-12)
        assert r["argmax_agreement"] == pytest.approx(float(want["strict"].double().mean()), abs=1e-12)
        assert r["rel_l2"] == pytest.approx(want["rel_l2"], rel=1e-12)
        if tiling == "one_tile":  # one tile is the untiled computation, operation for operation
            assert r["per_row"]["tv"] == want["tv"].reshape(-1).tolist() and r["rel_l2"] == want["rel_l2"]
        if r["path"] == "p":
            np.testing.assert_allclose(r["per_row"]["numerical_zero_rate"],
                                       want["numerical_zero_rate"].reshape(-1).numpy(), rtol=0, atol=1e-12)
            np.testing.assert_allclose(r["per_row"]["row_sum"], want["row_sum"].reshape(-1).numpy(), rtol=0, atol=1e-12)
            assert r["block_saturation"] == want["block_saturation"]
            # the stored payload of the whole P: joined along the queries, the header of the whole
            assert np.array_equal(_arrays.load(tmp_path, r["arrays"]["p"]["codes"]), want["codes"])
            assert np.array_equal(_arrays.load(tmp_path, r["arrays"]["p"]["scales"]), want["scales"])
            assert _arrays.load(tmp_path, r["arrays"]["p"]["header"]).tolist() == [TQ, TK]
            assert r["payload_bytes"] == want["codes"].nbytes + want["scales"].nbytes + 16
            assert r["float32_bytes"] == 4 * H * TQ * TK


def _rw_untiled(case: Case, packer) -> dict:
    """residual_window's definitions over the whole case: untiled probabilities and one attention pass."""
    p = probabilities(case.q, case.k, case.query_positions, case.causal)
    ref = attention(case.q, case.k, case.v, case.query_positions, case.causal, chunk=None)
    if packer is None:
        out = attention(case.q, case.k, case.v, case.query_positions, case.causal, dtype=torch.float32, chunk=None)
    else:
        k_hat, v_hat = packer.unpack(packer.pack(case.k, case.v))
        out = attention(case.q, k_hat, v_hat, case.query_positions, case.causal, chunk=None)
    return {"p": p, "rel_l2": rel_l2(out, ref), "cosine": cosine(out, ref), "max_abs": max_abs(out, ref)}


@pytest.mark.parametrize("causal", [False, True], ids=["decode", "causal"])
@pytest.mark.parametrize("tiling", list(TILINGS))
def test_residual_window_tiles_give_the_untiled_definition(tmp_path, causal, tiling):
    case = _case(causal)
    params = _params(residual_window, TILINGS[tiling], bits=4, group_size=32, residuals=[0, 16], early_window=16)
    rows = residual_window.evaluate(case, params, RunContext(ArrayStore(tmp_path), study="t", timing_repeats=0))
    plan = dict(residual_window.arms(params))
    assert [r["arm"] for r in rows] == list(plan)
    for r in rows:
        want = _rw_untiled(case, plan[r["arm"]])
        p = want["p"]
        if r["arm"] == "float32":
            # the float32 pass's own rounding is what this arm measures, and a float32 matmul rounds
            # differently over a different number of queries: any tiling stays at float32 rounding
            assert max(r["rel_l2"], want["rel_l2"]) < 2 ** -20 and min(r["cosine"], want["cosine"]) > 1 - 2 ** -40
        else:
            for key in ("rel_l2", "cosine", "max_abs"):
                assert r[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), key
        w = r["recent_mass_window"]
        assert r["recent_mass"] == pytest.approx(float(p[..., TK - w:].sum(-1).mean()), rel=1e-12)
        assert r["focus_mass"] == pytest.approx(float(p[..., :16].sum(-1).mean()), rel=1e-12)
        kept = {"float32": p.sum(-1), "R=0": None, "R=16": p[..., TK - 16:].sum(-1), "first16": p[..., :16].sum(-1)}
        want_kept = kept[r["arm"]]
        assert r["protected_mass"] == pytest.approx(0.0 if want_kept is None else float(want_kept.mean()), rel=1e-12)


MEASURE = r"""
import json, resource, sys, tempfile
from pathlib import Path
import torch
from testbed.analyses import mx_paths, residual_window
from testbed.case import Case, Region
from testbed.context import RunContext
from testbed.evidence import ArrayStore

def case(h, hkv, tq, tk, d):
    g = torch.Generator().manual_seed(3)
    return Case(id="big", q=torch.randn(h, tq, d, generator=g), k=torch.randn(hkv, tk, d, generator=g),
                v=torch.randn(hkv, tk, d, generator=g), query_positions=torch.arange(tk - tq, tk), causal=True,
                layout=(Region("all", 0, tk),), meta={"source": "test"})

def run(c, max_scores, root):
    ctx = RunContext(ArrayStore(Path(root)), study="t", timing_repeats=0)
    if "mx_paths" in analyses:
        mx_paths.evaluate(c, mx_paths.validate({"rotations": ["none"], "max_scores": max_scores}, "m"), ctx)
    residual_window.evaluate(c, residual_window.validate({"bits": 4, "group_size": 32, "residuals": [16], "early_window": 0,
                                                          "float32_arm": False, "max_scores": max_scores}, "r"), ctx)

def status_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)

h, hkv, tq, tk, d = json.loads(sys.argv[1])
max_scores = int(sys.argv[2])
analyses = sys.argv[3].split(",")
run(case(h, hkv, 128, 1024, d), max_scores, tempfile.mkdtemp())  # warm: imports, the fused kernels (large enough)
big = case(h, hkv, tq, tk, d)
try:  # reset the peak (VmHWM) to the current RSS; fall back to ru_maxrss elsewhere
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base, peak_of = status_kb("VmRSS"), (lambda: status_kb("VmHWM"))
except OSError:
    base, peak_of = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, (
        lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
run(big, max_scores, tempfile.mkdtemp())
print(json.dumps({"measured": peak_of() - base}))
"""


@pytest.mark.slow
def test_tiled_analyses_stay_far_below_the_whole_probability_matrix(reliability):
    """8 heads (2 KV heads) x 2,048 causal queries x 4,096 keys: P[H, Tq, Tk] in float64 is 512 MiB.
    With tiles of 2^18 scores (8 queries) mx_paths and residual_window together peak at a fraction
    of it: what remains is the Case, K and V expanded to 8 heads in float64, the outputs, and
    mx_paths' stored P payload (1 byte per score, and its serialized copy while it is written).
    residual_window alone on the same Case in one tile peaks above the whole matrix, so the
    measurement sees a whole matrix when there is one and the bound is the tiling's doing. (Measured
    on 2 cores: tiled 227 MiB, residual_window in one tile 1,076 MiB.)"""
    dims = [8, 2, 2048, 4096, 64]
    full = 8 * 2048 * 4096 * 8

    def peak(max_scores: int, analyses: str) -> int:
        r = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(dims), str(max_scores), analyses], cwd=REPO,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])["measured"]

    tiled, whole = peak(1 << 18, "mx_paths,residual_window"), peak(1 << 30, "residual_window")
    reliability("tiles", "peak RSS growth, 8x2048x4096 causal: mx_paths + residual_window tiled, residual_window "
                "in one tile", "tiled (2^18 scores) < 0.5 x float64 P; one tile > float64 P",
                f"tiled {tiled / 2**20:.0f} MiB, one tile {whole / 2**20:.0f} MiB, float64 P {full / 2**20:.0f} MiB")
    assert tiled < 0.5 * full
    assert whole > full
    assert tiled <= attention_chain_bytes(*dims, max_scores=1 << 18)  # the memory guard's bound holds tiled
