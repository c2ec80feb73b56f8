"""Calibrated codebooks in the live cache: one table per layer from corpus text the study never scores.

Stated here from the definition (docs/live.md), not read back from the code: (1) a codec whose
int_codebook levels are "calibrated" has no quantizer until the study hands it one table per layer,
and then layer i's middle is layer i's codebook; (2) it stores the same payloads as NF levels of the
same grouping, plus each layer's float16 table once (D x 2**bits for keys per channel, 2**bits for
values): bytes exact; (3) the calibration windows lie in the gaps between the scored segments and
are refused where they do not fit; (4) end to end on SmolLM2, the audit passes a calibrated arm, the
stored tables fit their calibration input better than the NormalFloat levels (Lloyd's objective), and
a forged table or a window moved onto a scored segment fails the audit.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from testbed.live.calibration import windows
from testbed.policies import Policy
from testbed.quant import Codebook
from testbed.schema import ProtocolError
from tests._helpers import audited_rows, forge_array, tiny_live_run

CAL = {"k": {"kind": "int_codebook", "bits": 3, "group_size": 16, "axis": "channel", "levels": "calibrated"},
       "v": {"kind": "int_codebook", "bits": 3, "group_size": 32, "axis": "token", "levels": "calibrated"}}
NF = {"k": {**CAL["k"], "levels": "nf"}, "v": {**CAL["v"], "levels": "nf"}}


def _tables(layers: int, d: int, seed: int = 0) -> dict:
    """Distinct strictly increasing float16 tables per layer: K per channel [D][8], V shared [8]."""
    rng = np.random.default_rng(seed)

    def one(shape):
        t = np.sort(rng.uniform(-1, 1, shape + (8,)), axis=-1)
        t[..., 0], t[..., -1] = -1.0, 1.0
        return np.round(t * 64) / 64 + np.arange(8) * 1e-3  # well apart after float16 rounding

    return {"k": [one((d,)).clip(-1, 1).tolist() for _ in range(layers)],
            "v": [one(()).clip(-1, 1).tolist() for _ in range(layers)]}


def test_calibrated_levels_need_the_layers_tables():
    pol = Policy("cb3", "codec", 0, 16, 16, codec=CAL)
    assert pol.calibrated == ("k", "v")
    with pytest.raises(ValueError, match="calibration"):
        pol.quantizers(0)
    tabs = _tables(3, 16)
    with_t = pol.with_(tables=tabs)
    for i in range(3):
        qk, qv = with_t.quantizers(i)
        assert isinstance(qk, Codebook) and np.array_equal(qk.table, np.asarray(tabs["k"][i], np.float16))
        assert np.array_equal(qv.table, np.asarray(tabs["v"][i], np.float16))
    assert with_t.quantizers(0)[0].table.tobytes() != with_t.quantizers(1)[0].table.tobytes()
    with pytest.raises(ValueError, match="layer 3"):
        with_t.quantizers(3)
    with pytest.raises(ValueError, match="tables are given"):
        Policy("cb3", "codec", 0, 16, 16, codec=CAL, tables={"k": tabs["k"]})
    # the row states the codec as written, never the tables (they are arrays of the row)
    assert with_t.config()["codec"] == CAL and "tables" not in with_t.config()


def test_bytes_are_nf_payloads_plus_one_table_per_layer():
    cal = Policy("cb3", "codec", 4, 16, 16, codec=CAL)
    nf = Policy("nf3", "codec", 4, 16, 16, codec=NF)
    layers, heads, d = 5, 2, 16
    for n in (0, 20, 37, 100):
        # K per channel: a [D, 8] float16 table; V: one [8] table; once per layer
        assert cal.cache_bytes(n, layers, heads, d) == nf.cache_bytes(n, layers, heads, d) + layers * 2 * (d * 8 + 8)


def test_a_table_given_in_the_config_is_still_refused():
    table = np.linspace(-1, 1, 8).tolist()
    with pytest.raises(ValueError, match="nf.*calibrated"):
        Policy("t", "codec", 0, 16, 16, codec={"k": NF["k"], "v": {**NF["v"], "levels": table}})


def test_windows_lie_between_the_segments():
    n, segments, length, prefill = 10_000, 4, 1_000, 600
    starts = windows(n, segments, length, prefill, 3)
    stride = n // segments
    for s in starts:
        for i in range(segments):
            a = i * stride
            assert s + prefill <= a or s >= a + length  # disjoint from every scored segment
        assert 0 <= s and s + prefill <= n
    assert len(set(starts)) == 3
    with pytest.raises(ProtocolError, match="gaps"):
        windows(n, segments, 2_000, prefill, 1)  # stride 2,500 < 2,000 + 600
    assert windows(n, segments, 2_000, 400, 1) == [2_100]  # a shorter window fits the same gap: [2100, 2500)
    with pytest.raises(ProtocolError, match="1..4"):
        windows(n, segments, length, prefill, 5)


def test_the_protocol_names_its_calibration():
    from testbed.live.spec import validate

    base = {"model": "SmolLM2-135M-Instruct.Q4_1", "corpus": {"builtin": "pydoc_topics"}, "segments": 2,
            "prefill": 64, "steps": 8, "window": 16, "group": 16}
    arm = {"name": "cb3", "storage": {"middle": "codec", "codec": CAL}}
    with pytest.raises(ProtocolError, match="calibration"):
        validate({**base, "policies": [arm]}, "live")
    with pytest.raises(ProtocolError, match="no policy"):
        validate({**base, "policies": ["int3"], "calibration": {"windows": 1}}, "live")
    with pytest.raises(ProtocolError, match="windows"):
        validate({**base, "policies": [arm], "calibration": {"windows": 3}}, "live")
    assert validate({**base, "policies": [arm], "calibration": {"windows": 2}}, "live")["calibration"] == {"windows": 2}
    with pytest.raises(ProtocolError, match="tokens"):
        validate({**base, "policies": [arm], "calibration": {"windows": 1, "tokens": 0}}, "live")
    with pytest.raises(ProtocolError, match="optionally"):
        validate({**base, "policies": [arm], "calibration": {"windows": 1, "seed": 3}}, "live")


# -- end to end on SmolLM2 ---------------------------------------------------------------------------

ARMS = ["int3", {"name": "nf3", "storage": {"middle": "codec", "codec": NF}},
        {"name": "cb3", "storage": {"middle": "codec", "codec": CAL}},
        {"name": "cb3_pre", "storage": {"middle": "codec", "codec": CAL, "key_rope": "pre"}}]


@pytest.fixture(scope="module")
def cal_run(tmp_path_factory):
    return tiny_live_run(tmp_path_factory, "cal_tiny", ARMS, prefill=160, steps=16,
                         calibration={"windows": 1, "tokens": 120})


def _weighted_error(x: np.ndarray, cfg: dict) -> float:
    """Squared error of x quantized with cfg, summed (the objective Lloyd's k-means lowers)."""
    q = Codebook(cfg["bits"], cfg["group_size"], cfg["axis"], cfg["levels"])
    t = torch.from_numpy(x)
    return float(((q.dequantize(q.quantize(t)) - t) ** 2).sum())


@pytest.mark.slow
def test_a_calibrated_arm_passes_the_audit(cal_run):
    from tests import _arrays

    rows = audited_rows(cal_run)
    # 30 layers, each one [64, 8] K table and one [8] V table, float16
    assert rows["cb3"]["bytes_final"] == rows["nf3"]["bytes_final"] + 30 * 2 * (64 * 8 + 8)
    assert rows["cb3"]["policy"]["codec"] == CAL
    tk = _arrays.load(cal_run, rows["cb3"]["arrays"]["codebook.k"])
    assert tk.shape == (30, 64, 8) and tk.dtype == np.float16
    assert not np.array_equal(tk[0], tk[1])  # one table per layer
    man = json.loads((cal_run / "cal_tiny" / "live_manifest.json").read_text())
    seg = man["segments"]["seg000"]
    (s,) = man["calibration"]["starts"]
    assert s >= seg + 160 + 16 + 1 and man["calibration"]["tokens"] == 120  # after the scored segment, never inside it
    assert _arrays.load(cal_run, rows["cb3"]["arrays"]["calibration.k"]).shape == (1, 3, 120, 64)
    for part, cfg in CAL.items():  # the stored table fits its calibration input better than NF levels
        x = _arrays.load(cal_run, rows["cb3"]["arrays"][f"calibration.{part}"])
        t = _arrays.load(cal_run, rows["cb3"]["arrays"][f"codebook.{part}"])[7]
        assert _weighted_error(x, {**cfg, "levels": t.astype(float).tolist()}) < _weighted_error(x, {**cfg, "levels": "nf"})
    assert rows["cb3_pre"]["nll"] != rows["cb3"]["nll"]


@pytest.mark.slow
@pytest.mark.parametrize("part", ["k", "v"])
def test_a_forged_table_fails_the_audit(cal_run, tmp_path, part):
    from testbed.audit import audit

    run = Path(shutil.copytree(cal_run, tmp_path / "run"))
    row = next(r for r in json.loads((run / "results.json").read_text())["rows"] if r["arm"] == "cb3")

    def shift(t):
        t[7, ..., 3] = np.float16((float(t[7, ..., 3].ravel()[0]) + float(t[7, ..., 4].ravel()[0])) / 2)

    forge_array(run, row["arrays"][f"codebook.{part}"], shift)
    ok, failures, _ = audit(run)
    assert not ok and any(f"codebook.{part}" in f and "k-means" in f for f in failures), failures[:3]


@pytest.mark.slow
def test_a_window_moved_onto_a_scored_segment_fails_the_audit(cal_run, tmp_path):
    from testbed.audit import audit

    run = Path(shutil.copytree(cal_run, tmp_path / "run"))
    rel = "cal_tiny/live_manifest.json"
    man = json.loads((run / rel).read_text())
    man["calibration"]["starts"] = [man["segments"]["seg000"] + 50]
    (run / rel).write_text(json.dumps(man, indent=1))
    m = json.loads((run / "manifest.json").read_text())
    m["files"][rel] = hashlib.sha256((run / rel).read_bytes()).hexdigest()
    (run / "manifest.json").write_text(json.dumps(m, indent=1))
    ok, failures, _ = audit(run)
    assert not ok and any("overlaps the scored segment" in f for f in failures), failures[:3]


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="the audit re-derives the evidence layer's table only: another layer's table is "
                                       "checked for shape and order, and its calibration input is not stored")
def test_a_forged_table_of_another_layer_fails_the_audit(cal_run, tmp_path):
    from testbed.audit import audit

    run = Path(shutil.copytree(cal_run, tmp_path / "run"))
    row = next(r for r in json.loads((run / "results.json").read_text())["rows"] if r["arm"] == "cb3")

    def shift(t):
        t[3, 0, 3] = np.float16((float(t[3, 0, 3]) + float(t[3, 0, 4])) / 2)

    forge_array(run, row["arrays"]["codebook.k"], shift)
    ok, _, _ = audit(run)
    assert not ok


def test_the_retrieval_study_refuses_calibrated_codebooks():
    from testbed.retrieval import validate

    arm = {"name": "cb3", "storage": {"middle": "codec", "codec": CAL}}
    with pytest.raises(ProtocolError, match="cb3 run in the live study only"):
        validate({"tasks": ["passkey"], "lengths": [512], "depths": [0.5], "trials": 1, "policies": [arm]}, "retrieval")


@pytest.mark.slow
def test_replay_refuses_a_calibrated_study_by_name(cal_run, capsys):
    from testbed.replay import main

    assert main([str(cal_run)]) != 0
    err = capsys.readouterr().err
    assert "calibrated codebooks" in err and "cal_tiny" in err


@pytest.mark.slow
def test_the_parts_of_a_split_study_calibrate_the_same_tables(tmp_path_factory):
    from testbed.pool import part_of

    ids = []
    for rng in ([0, 1], [1, 2]):
        run = tiny_live_run(tmp_path_factory, f"cal_part{rng[0]}", ARMS[2:3], prefill=96, steps=8, segments=2,
                            segment_range=rng, calibration={"windows": 1, "tokens": 64})
        ids.append(part_of(run)[2])
    # the windows lie in the gap after segment 0 for both parts: the same text, the same tables
    assert ids[0]["calibration"] == ids[1]["calibration"] and ids[0]["calibration"]["tables"]
