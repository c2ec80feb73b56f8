"""The mx_paths study end to end: it runs, the audit re-derives it from the stored codes, and the
audit catches codes or numbers that do not follow from the inputs."""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from testbed.analyses import mx_paths
from testbed.attention import probabilities
from testbed.audit import audit
from testbed.audit_checks.mx_paths import encode_mx, rotation_matrix
from testbed.case import Case, Region
from testbed.context import RunContext
from testbed.evidence import ArrayStore
from testbed.protocol import ProtocolError, load_protocol, validate_protocol
from testbed.quant.rotation import SignedHadamard
from tests import _arrays
from tests._helpers import finished_run as run_once, forge_results

REPO = Path(__file__).resolve().parent.parent
PROTOCOL = REPO / "protocols" / "mx_paths.json"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    return run_once(tmp_path_factory, "mx_paths.json", "mx")


def _rows(run):
    return json.loads((run / "results.json").read_text())["rows"]


def _forge(copy: Path, rel: str) -> None:
    """Re-hash a changed file or array in the manifest, so only the re-derivation can notice."""
    man = json.loads((copy / "manifest.json").read_text())
    if rel in man["files"]:
        man["files"][rel] = hashlib.sha256((copy / rel).read_bytes()).hexdigest()
    else:
        man["arrays"][rel]["sha256"] = _arrays.sha(copy, rel)
    (copy / "manifest.json").write_text(json.dumps(man))


def test_protocol_is_default_and_covers_every_arm(finished_run):
    proto, _ = load_protocol(PROTOCOL)
    assert json.loads(PROTOCOL.read_text())["default"] is True
    rows = _rows(finished_run)
    n_inputs = len(proto["source"]["seeds"]) * len(proto["source"]["lengths"]) * len(proto["source"]["distributions"])
    rules = proto["analyses"]["mx_paths"]["scale_rules"]
    assert rules == ["floor", "rceil"]
    assert len(rows) == 3 * n_inputs * len(rules)
    assert {(r["path"], r["rotation"], r["scale_rule"]) for r in rows} == {
        (path, rot, rule) for rule in rules for path, rot in (("qk", "none"), ("qk", "signed_hadamard"), ("p", "none"))}
    for r in rows:
        for key in ("scheme", "rotation", "path", "tv_median", "tv_mean", "argmax_agreement", "numerical_zero_rate_median",
                    "numerical_zero_rate_mean", "row_sum_median", "rel_l2", "payload_bytes", "arrays"):
            assert key in r
        assert r["rows"] == proto["source"]["heads"] * proto["source"]["queries"]
        assert 0 <= r["tv_median"] <= r["tv_max"] <= 1 and 0 <= r["argmax_agreement"] <= 1
        if r["path"] == "p":
            assert abs(r["row_sum_median"] - 1) < 0.02
            assert r["payload_bytes"] == r["rows"] * r["n"] * 33 / 32 + 16       # 8.25 bits per probability
        else:
            assert r["numerical_zero_rate_median"] is None and r["row_sum_median"] is None
            d, hkv = proto["source"]["head_dim"], proto["source"]["kv_heads"]
            assert r["payload_bytes"] == (r["rows"] + hkv * r["n"]) * d * 33 / 32 + 32
            assert ("signs" in r["arrays"]) == (r["rotation"] == "signed_hadamard")


def test_rceil_never_clamps_where_floor_does(finished_run):
    """FLOOR leaves the block maximum in [256, 512) for E4M3 and clamps what lands above 448; RCEIL
    takes the smallest scale that needs no clamping. On the same inputs: RCEIL rows clamp no block,
    FLOOR rows of the Q/K path clamp some, and RCEIL's TV is never far from FLOOR's."""
    rows = _rows(finished_run)
    by = {(r["case"], r["path"], r["rotation"], r["scale_rule"]): r for r in rows}
    assert all(r["block_saturation"] == 0.0 for r in rows if r["scale_rule"] == "rceil")
    floor_qk = [r["block_saturation"] for r in rows if r["scale_rule"] == "floor" and r["path"] == "qk"]
    assert np.mean(floor_qk) > 0.05
    for (case, path, rot, rule), r in by.items():
        if rule == "floor":
            other = by[(case, path, rot, "rceil")]
            assert other["tv_median"] < 3 * r["tv_median"] + 1e-3
            assert other["quant"]["scale_rule"] == "rceil" and r["quant"]["scale_rule"] == "floor"


def test_argmax_ties_are_counted_apart():
    """A decoded row whose maximum is shared by the reference argmax and an earlier key is a tie,
    not a disagreement; a row whose maximum is elsewhere is neither."""
    from testbed.analyses.mx_paths import _argmax_agree

    p_ref = torch.tensor([[0.1, 0.2, 0.7], [0.1, 0.2, 0.7], [0.1, 0.2, 0.7], [0.5, 0.3, 0.2]], dtype=torch.float64)
    p_hat = torch.tensor([[0.1, 0.2, 0.7], [0.45, 0.1, 0.45], [0.5, 0.4, 0.1], [0.4, 0.4, 0.2]], dtype=torch.float64)
    strict, tie = _argmax_agree(p_hat, p_ref)
    assert strict.tolist() == [True, False, False, True]     # row 3: the first maximal index is the reference's
    assert tie.tolist() == [False, True, False, False]


def test_mx_paths_evidence_is_small(finished_run):
    total = sum(p.stat().st_size for p in (finished_run / "arrays" / "mx_paths").rglob("*") if p.is_file())
    assert total < 5 * 2 ** 20


def test_audit_passes(finished_run):
    ok, failures, summary = audit(finished_run)
    assert ok, failures[:5]


def test_audit_catches_one_changed_element_code(finished_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    row = next(r for r in _rows(copy) if r["path"] == "qk" and r["rotation"] == "signed_hadamard")
    rel = row["arrays"]["k"]["codes"]
    arr = _arrays.load(copy, rel)
    arr[0, 3, 5] ^= 0x01                                     # one ulp of one E4M3 code
    _arrays.save(copy, rel, arr)
    _forge(copy, rel)
    ok, failures, _ = audit(copy)
    assert not ok
    assert any("k: stored e4m3 element codes differ" in f and "(0, 3, 5)" in f for f in failures)


def test_audit_catches_a_changed_scale_and_a_changed_number(finished_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    rows = _rows(copy)
    prow = next(r for r in rows if r["path"] == "p")
    rel = prow["arrays"]["p"]["scales"]
    arr = _arrays.load(copy, rel)
    arr[0, 0, 0] += 1
    _arrays.save(copy, rel, arr)
    _forge(copy, rel)
    res = json.loads((copy / "results.json").read_text())
    i = next(i for i, r in enumerate(res["rows"]) if r["path"] == "qk" and r["rotation"] == "none")
    res["rows"][i]["tv_median"] *= 1.01
    forge_results(copy, res)
    ok, failures, _ = audit(copy)
    assert not ok
    assert any("p: stored E8M0 scale codes differ" in f for f in failures)
    assert any(f.startswith("FAIL: results.json row") and "tv_median" in f and "rotation=none" in f for f in failures)


def test_rotation_reduces_qk_error_under_a_focus_channel(finished_run):
    """The focus distributions put a shared large value in channel 0 of Q and of the focus keys; its
    E4M3 rounding shifts every focus logit together. Rotation spreads it over all 64 channels."""
    rows = _rows(finished_run)

    def med(dist, rot):
        return float(np.median([r["tv_median"] for r in rows if r["path"] == "qk" and r["rotation"] == rot
                                and r["distribution"] == dist]))

    for dist in ("early_focus", "recent_focus"):
        assert med(dist, "signed_hadamard") < 0.75 * med(dist, "none")


def _causal_case(n=100):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, 6, 64, generator=g) * 2.0
    k = torch.randn(2, n, 64, generator=g) * 2.0
    v = torch.randn(2, n, 64, generator=g)
    return Case(id="causal", q=q, k=k, v=v, query_positions=torch.tensor([3, 20, 40, 60, 80, n - 1]), causal=True,
                layout=(Region("all", 0, n),), meta={"source": "test"})


def test_p_path_on_a_causal_case_with_a_ragged_key_axis(tmp_path):
    case = _causal_case()
    params = mx_paths.validate({}, "analyses.mx_paths")
    ctx = RunContext(ArrayStore(tmp_path), study="t", timing_repeats=0)
    rows = mx_paths.evaluate(case, params, ctx)
    prow = next(r for r in rows if r["path"] == "p")
    p_ref = probabilities(case.q, case.k, case.query_positions, case.causal).numpy()
    codes, scales = encode_mx(p_ref.astype(np.float32), "e4m3", 32)      # the audit's own encoder
    stored = _arrays.load(tmp_path, prow["arrays"]["p"]["codes"])
    assert stored.shape == (4, 6, 128) and np.array_equal(stored, codes)
    assert np.array_equal(_arrays.load(tmp_path, prow["arrays"]["p"]["scales"]), scales)
    # zero rate only over keys the query can see: masked keys are 0 in both and never counted
    visible = np.arange(100)[None, :] <= case.query_positions.numpy()[:, None]
    table = np.array([float(x) for x in torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()])
    p_hat = table[codes[..., :100]] * np.ldexp(1.0, scales.astype(int) - 127).repeat(32, -1)[..., :100]
    assert np.all(p_hat[:, ~visible] == 0)
    zero = ((p_hat == 0) & visible).sum(-1) / visible.sum(-1)
    assert np.allclose(prow["per_row"]["numerical_zero_rate"], zero.ravel())
    assert np.allclose(prow["per_row"]["row_sum"], p_hat.sum(-1).ravel())


def test_stored_signs_rebuild_the_rotation():
    rot = SignedHadamard(64, seed=9)
    assert np.allclose(rotation_matrix(rot.signs.numpy()), rot.matrix().numpy(), atol=1e-15)
    with pytest.raises(ValueError):
        rotation_matrix(np.ones(72, dtype=np.int8))


def test_protocol_errors_name_the_key():
    raw = json.loads(PROTOCOL.read_text())
    raw["analyses"]["mx_paths"]["rotations"] = ["none", "hadamard"]
    with pytest.raises(ProtocolError, match=r"analyses\.mx_paths\.rotations\[1\]"):
        validate_protocol(raw)
    raw["analyses"]["mx_paths"] = {"element": "e4m3", "blocks": 32}
    with pytest.raises(ProtocolError, match=r"analyses\.mx_paths\.blocks: unknown key"):
        validate_protocol(raw)
    raw["analyses"]["mx_paths"] = {"rotations": ["none", "none"]}
    with pytest.raises(ProtocolError, match="twice"):
        validate_protocol(raw)


def test_rotation_on_an_unrotatable_head_dim_is_a_clear_error(tmp_path):
    g = torch.Generator().manual_seed(0)
    case = Case(id="d72", q=torch.randn(1, 2, 72, generator=g), k=torch.randn(1, 64, 72, generator=g),
                v=torch.randn(1, 64, 72, generator=g), query_positions=torch.tensor([63, 63]), causal=False,
                layout=(Region("all", 0, 64),))
    params = mx_paths.validate({"rotations": ["signed_hadamard"]}, "analyses.mx_paths")
    with pytest.raises(ValueError, match="signed_hadamard rotation needs .* got 72"):
        mx_paths.evaluate(case, params, RunContext(ArrayStore(tmp_path), study="t", timing_repeats=0))


@pytest.mark.parametrize("module", ["testbed/audit_checks/mx_paths.py", "testbed/audit_checks/common.py",
                                    "testbed/audit_checks/schemes.py",
                                    "testbed/audit_checks/safe_io.py", "testbed/audit_checks/stats.py",
                                    "testbed/audit_checks/report_format.py", "testbed/audit_checks/report_parse.py",
                                    "testbed/audit_checks/selective.py", "testbed/audit_checks/report_html.py",
                                    "testbed/audit_checks/report_html_parse.py",
                                    "testbed/audit_checks/report_html_figures.py", "testbed/audit_checks/live_policies.py",
                                    "testbed/audit_checks/live_scored.py", "testbed/audit_checks/live_evidence.py",
                                    "testbed/audit_checks/live_quality.py"])
def test_audit_side_imports_only_numpy_and_stdlib(module):
    tree = ast.parse((REPO / module).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [] if node.level else [node.module.split(".")[0]]
        else:
            continue
        assert not set(names) & {"torch", "testbed", "scipy", "torchao", "tabulate"}, names


# -- the P payload not stored (store_p false, protocols/seed_scale.json) ------------------------

def _small_protocol(tmp: Path, name: str, **mx) -> Path:
    proto = json.loads(PROTOCOL.read_text())
    proto.update(name=name, default=False, timing={"repeats": 0, "seed": 0})
    proto["source"].update(seeds=[7], lengths=[256], distributions=["early_focus", "clean"])
    proto["analyses"]["mx_paths"].update(mx)
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(proto))
    return path


@pytest.fixture(scope="module")
def p_runs(tmp_path_factory):
    """The same small protocol with the P payload stored and not stored, each over several tiles of
    queries (4 heads x 256 keys: 4 queries per tile of 4,096 scores)."""
    from testbed.run import main as run_main

    tmp = tmp_path_factory.mktemp("store_p")
    runs = {}
    for store in (True, False):
        folder = tmp / ("stored" if store else "unstored")
        folder.mkdir()
        proto = _small_protocol(folder, "mx_paths_small", store_p=store, max_scores=4096)
        assert run_main(["--quiet", "--out", str(folder / "run"), "--protocol", str(proto)]) == 0
        runs[store] = folder / "run"
    return runs


def test_unstored_p_payload_changes_nothing_but_the_stored_arrays(p_runs):
    stored, unstored = _rows(p_runs[True]), _rows(p_runs[False])
    assert len(stored) == len(unstored) == 2 * 2 * 3
    for a, b in zip(stored, unstored):
        if a["path"] == "p":
            assert set(a["arrays"]) == {"p"} and b["arrays"] == {}
            assert b["payload_bytes"] == a["payload_bytes"]  # the byte count of the codes that were not written
        else:
            assert b["arrays"].keys() == a["arrays"].keys()
        assert {k: v for k, v in a.items() if k != "arrays"} == {k: v for k, v in b.items() if k != "arrays"}


@pytest.mark.parametrize("audit_scores", [None, 3000], ids=["one-audit-tile", "audit-tiles"])
def test_both_p_payloads_audit_over_tiles(p_runs, monkeypatch, audit_scores):
    from testbed.audit_checks import mx_paths as mx_audit

    if audit_scores:
        monkeypatch.setattr(mx_audit, "MAX_SCORES", audit_scores)  # 2 queries of 4 heads x 256 keys per tile
    for run in p_runs.values():
        ok, failures, _ = audit(run, check_sources=False)
        assert ok, failures[:5]


@pytest.mark.parametrize("field", ["numerical_zero_rate_mean", "row_sum_median", "tv_median", "payload_bytes"])
def test_unstored_p_path_forged_statistic_fails(p_runs, tmp_path, monkeypatch, field):
    """With no codes to compare, the audit re-quantizes P itself: a P-path number that does not
    follow from the Case still FAILs, named, whether the audit works over one tile or several."""
    from testbed.audit_checks import mx_paths as mx_audit

    monkeypatch.setattr(mx_audit, "MAX_SCORES", 3000)
    copy = tmp_path / "copy"
    shutil.copytree(p_runs[False], copy)
    res = json.loads((copy / "results.json").read_text())
    i = next(i for i, r in enumerate(res["rows"]) if r["path"] == "p" and r["distribution"] == "early_focus")
    res["rows"][i][field] = res["rows"][i][field] + 1 if field == "payload_bytes" else res["rows"][i][field] * 1.01 + 1e-6
    forge_results(copy, res)
    ok, failures, _ = audit(copy, check_sources=False)
    assert not ok
    assert any(f.startswith("FAIL: results.json row") and field in f and "path=p" in f for f in failures), failures[:5]


def test_a_p_payload_the_protocol_stores_cannot_be_dropped(p_runs, tmp_path):
    """Dropping a stored payload from its row (to escape the byte-for-byte check) is caught: the
    protocol's store_p says the row must name it."""
    copy = tmp_path / "copy"
    shutil.copytree(p_runs[True], copy)
    res = json.loads((copy / "results.json").read_text())
    i = next(i for i, r in enumerate(res["rows"]) if r["path"] == "p")
    res["rows"][i]["arrays"] = {}
    forge_results(copy, res)
    ok, failures, _ = audit(copy, check_sources=False)
    assert not ok
    assert any("arrays.p" in f for f in failures), failures[:5]
