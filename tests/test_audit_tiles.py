"""The observation and ablation re-derivations of the audit work over tiles of each head's queries
(`audit_checks.common.row_tiles`, `MAX_ROW_SCORES` float64 scores a tile): the same numbers whatever
the tile, the last partial tile included, and memory bounded by the tile, not by the head."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from testbed.audit import audit
from testbed.audit_checks import ablation_audit, common, observation

from ._helpers import copy_run, forge_array, run_main


def _case(causal: bool, h=4, hk=2, tq=23, tk=70, d=16, seed=1) -> dict:
    """A case in the audit's own form (numpy arrays, layout dicts): sink | middle | recent | current."""
    g = np.random.default_rng(seed)
    cur = tk - tq
    return {"q": (2.5 * g.standard_normal((h, tq, d))).astype(np.float32),
            "k": g.standard_normal((hk, tk, d)).astype(np.float32),
            "v": g.standard_normal((hk, tk, d)).astype(np.float32),
            "query_positions": np.arange(cur, tk), "causal": causal,
            "layout": [{"name": "sink", "start": 0, "stop": 6}, {"name": "middle", "start": 6, "stop": 30},
                       {"name": "recent", "start": 30, "stop": cur}, {"name": "current", "start": cur, "stop": tk}]}


def _leaves(x, pre=""):
    if isinstance(x, dict):
        for key, val in x.items():
            yield from _leaves(val, f"{pre}.{key}")
    elif isinstance(x, (tuple, list)) and x and isinstance(x[0], (dict, np.ndarray)):
        for i, val in enumerate(x):
            yield from _leaves(val, f"{pre}[{i}]")
    else:
        yield pre, x


def _same(a, b) -> list[str]:
    """The leaves where ``a`` and ``b`` differ: discrete ones (bool, int, lists of block ids) exactly,
    floats within 1e-12 relative (a smaller tile changes a BLAS call's rows and a per-head sum's
    order, nothing else: every quantity is per row), NaN where NaN."""
    la, lb = dict(_leaves(a)), dict(_leaves(b))
    assert la.keys() == lb.keys()
    bad = []
    for key, x in la.items():
        y = lb[key]
        if x is None or y is None:
            if not (x is None and y is None):
                bad.append(key)
            continue
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype.kind != y.dtype.kind:
            bad.append(key)
        elif x.dtype.kind == "f":
            if not np.allclose(x, y, rtol=1e-12, atol=1e-14, equal_nan=True):
                bad.append(key)
        elif not np.array_equal(x, y):
            bad.append(key)
    return bad


def _derive_all(c: dict) -> dict:
    """Every tiled piece of the two re-derivations on case ``c``."""
    spans = {n: ablation_audit.expected_spans(c, "t", n, 0)
             for n in ("none", "drop_sink", "control_sink", "drop_recent", "drop_history")}
    derived, masses, out = ablation_audit._derive(c, c["k"], c["v"], spans, None, want_out=True)
    target = (0, 6)
    sel = ablation_audit._select_case(c, target, ablation_audit.mass_orders(c, "t", "sink", 0))
    # a quantized arm's form: another K/V against the float32 arm's outputs as the reference
    k2, v2 = (c["k"] + np.float32(0.05)), (c["v"] * np.float32(0.9))
    mass = ablation_audit._derive_mass(c, k2, v2, sel, target, out)
    arm = ablation_audit._derive(c, k2, v2, spans, out)[:2]
    obs = observation.derive(c, 10, 0.9, "t", 5)
    return {"derived": derived, "masses": masses, "out": out, "sel": sel, "mass": mass, "arm": arm, "obs": obs}


@pytest.mark.parametrize("causal", [False, True])
def test_tiles_of_one_row_a_few_rows_and_the_whole_head_give_the_same_numbers(monkeypatch, causal):
    c = _case(causal)
    tq, tk = c["q"].shape[1], c["k"].shape[1]
    monkeypatch.setattr(common, "MAX_ROW_SCORES", tq * tk)            # one tile: the whole head
    whole = _derive_all(c)
    assert len(common.row_tiles(tq, tk)) == 1
    # the selection is not trivial: some rows matched, some keys dropped, never one of the target
    assert whole["sel"]["matched"].any() and whole["sel"]["keys"].sum() > 0 and not whole["sel"]["in_target"]
    for rows in (1, 4, 7):                                           # 23 rows: the last tile is partial
        monkeypatch.setattr(common, "MAX_ROW_SCORES", rows * tk)
        tiles = common.row_tiles(tq, tk)
        assert [t.stop - t.start for t in tiles][-1] == (tq % rows or rows) and tiles[-1].stop == tq
        assert _same(whole, _derive_all(c)) == [], rows


def test_row_tiles_cover_the_queries_once_within_the_budget():
    for queries, keys, budget in ((23, 70, 70 * 4), (2340, 6240, 1 << 21), (5, 1000, 10), (1, 3, 1 << 21)):
        tiles = common.row_tiles(queries, keys, budget)
        rows = [i for t in tiles for i in range(t.start, t.stop)]
        assert rows == list(range(queries))
        assert all(t.stop > t.start and ((t.stop - t.start) * keys <= budget or t.stop - t.start == 1) for t in tiles)


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_peak_memory_of_the_per_head_work_is_bounded_by_the_tile(monkeypatch):
    """tracemalloc sees numpy's buffers: with a tile of 16 rows the re-derivations of a head of 800
    queries x 2,400 keys stay within a few tiles of scores (plus their [H, Tq]-sized outputs), far
    below one [Tq, Tk] float64 array; with one tile the same code needs several of those."""
    c = _case(False, h=2, hk=1, tq=800, tk=2400, d=16, seed=3)
    c["layout"] = [{"name": "sink", "start": 0, "stop": 16}, {"name": "middle", "start": 16, "stop": 1200},
                   {"name": "recent", "start": 1200, "stop": 1600}, {"name": "current", "start": 1600, "stop": 2400}]
    h, tq = c["q"].shape[:2]
    tk = c["k"].shape[1]
    head = tq * tk * 8                                                # one head's float64 scores: 15.4 MB
    spans = {n: ablation_audit.expected_spans(c, "t", n, 0) for n in ("drop_sink", "drop_recent")}
    target = (0, 16)
    orders = ablation_audit.mass_orders(c, "t", "sink", 0)[:2]
    rows = 16
    tile = rows * tk * 8                                              # one tile's float64 scores: 307 KB
    # what the outputs themselves hold: per-row float64 statistics and the selection's bits
    outputs = 40 * h * tq * 8 + h * tq * (tk // 8 + 1)

    def work(sel):
        return {
            "observation": lambda: observation.derive(c, 400, 0.9, "t", 200),
            "ablation": lambda: ablation_audit._derive(c, c["k"], c["v"], spans, None),
            "selection": lambda: ablation_audit._select_case(c, target, orders),
            "mass": lambda: ablation_audit._derive_mass(c, c["k"], c["v"], sel, target, None),
        }

    monkeypatch.setattr(common, "MAX_ROW_SCORES", rows * tk)
    sel = ablation_audit._select_case(c, target, orders)
    assert sel["matched"].any()
    small = {name: _peak(fn) for name, fn in work(sel).items()}
    monkeypatch.setattr(common, "MAX_ROW_SCORES", tq * tk)
    large = {name: _peak(fn) for name, fn in work(sel).items()}
    for name in small:
        # a tile's temporaries: scores, probabilities, a masked copy, their float32 / bool siblings, ...
        assert small[name] < 16 * tile + outputs + 2 * tk * 16 * 8, (name, small[name])
        assert small[name] < head / 2, (name, small[name])
        assert large[name] > 2 * head, (name, large[name])             # the measure sees whole-head arrays


# ---------------------------------------------------------------------------------------------
# a finished run audited with tiles of a few rows (the last one partial in both cases)
# ---------------------------------------------------------------------------------------------

ROWS = 7  # 7 rows of the video case (24 queries x 64 keys), 5 of the llm one (32 x 80)


@pytest.fixture(scope="module")
def tile_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("audit_tiles")
    int4 = {"kind": "int_grouped", "bits": 4, "group_size": 16}
    proto = {"name": "tiles", "source": {"kind": "synthetic_video", "seeds": [1], "layouts": ["video", "llm"],
                                         "heads": 4, "kv_heads": 2},
             "analyses": {"observation": {"spatial_tiles": 2},
                          "ablation": {"ablations": ["none", "drop_sink", "control_sink", "mass_control_sink",
                                                     "drop_recent", "drop_history"],
                                       "kv_arms": [{"name": "float32"},
                                                   {"name": "int4", "key": {**int4, "axis": "channel"},
                                                    "value": {**int4, "axis": "token"}, "window": 0}]}},
             "timing": {"repeats": 0}}
    (base / "p.json").write_text(json.dumps(proto))
    assert run_main(["--quiet", "--out", str(base / "run"), "--protocol", str(base / "p.json")]) == 0
    return base / "run"


def _small_tiles(monkeypatch, run):
    """Tiles of ``ROWS`` query rows for every case of the run; returns the video case's record."""
    m = json.loads((run / "manifest.json").read_text())
    res = json.loads((run / "results.json").read_text())
    keys = {r["keys"] for r in res["rows"] if r.get("analysis") == "observation"}
    monkeypatch.setattr(common, "MAX_ROW_SCORES", ROWS * min(keys))
    return m, res


def test_the_run_passes_with_tiles_of_a_few_rows(tile_run, monkeypatch):
    _, res = _small_tiles(monkeypatch, tile_run)
    shapes = {(r["queries"], r["keys"]) for r in res["rows"] if r.get("analysis") == "observation"}
    assert len(shapes) == 2
    for queries, keys in shapes:                                      # a partial last tile in every case
        assert 1 < len(common.row_tiles(queries, keys)) and queries % (common.MAX_ROW_SCORES // keys), shapes
    ok, fails, _ = audit(tile_run, check_sources=False)
    assert ok, fails[:5]


def test_a_forged_statistic_of_the_last_query_fails(tile_run, tmp_path, monkeypatch):
    """The stored per-row statistics of the last query of the last head (the last partial tile)."""
    run = copy_run(tile_run, tmp_path / "r")
    _, res = _small_tiles(monkeypatch, run)
    i, row = next((i, r) for i, r in enumerate(res["rows"])
                  if r.get("analysis") == "observation" and r["scope"] == "case" and "rows" in r["arrays"])
    f = row["row_fields"].index("support")

    def edit(x):
        x[f, -1, -1] = x[f, -1, -1] * 0.9

    forge_array(run, row["arrays"]["rows"], edit)
    ok, fails, _ = audit(run, check_sources=False)
    assert not ok and any(f"row {i} " in x and "arrays.rows[support]" in x for x in fails), fails[:5]


def test_a_forged_query_in_the_last_partial_tile_fails_observation_and_ablation(tile_run, tmp_path, monkeypatch):
    """A consistent forger who changes the last query of the last head of a case (its hash re-recorded):
    every re-derived number that row enters disagrees with the rows as written, in both analyses."""
    run = copy_run(tile_run, tmp_path / "r")
    m, res = _small_tiles(monkeypatch, run)
    case = next(r for r in res["rows"] if r.get("analysis") == "ablation" and r["distribution"] == "video")["case"]
    rel = next(a for a in m["arrays"] if a.endswith(f"/{case}/q.npy"))

    def edit(x):
        x[-1, -1] = x[-1, -1] * 3.0

    forge_array(run, rel, edit)
    ok, fails, _ = audit(run, check_sources=False)
    assert not ok
    assert any(" observation " in x and case in x for x in fails), fails[:5]
    assert any(" ablation " in x and case in x and "arm=float32" in x for x in fails), fails[:5]
    assert any(" ablation " in x and case in x and "ablation=mass_control_sink" in x for x in fails), fails[:5]


def test_the_ablation_holds_one_arms_kv_and_releases_a_case_after_its_last_row(tile_run, monkeypatch):
    """While an arm's rows are checked the audit holds that arm's decoded K/V only; after a case's
    last ablation row none of its ablation arrays (reference outputs, selections, K/V) stay held."""
    from testbed.audit import Audit

    held = []
    real = ablation_audit._check_row

    def spy(row, ctx):
        real(row, ctx)
        held.append((row["case"], row["arm"], sorted(k[3] for k in ctx.cache
                                                      if isinstance(k, tuple) and k[0] == "ablation-kv")))

    monkeypatch.setattr(ablation_audit, "_check_row", spy)
    a = Audit(tile_run)
    a.run(False)
    assert not a.failures, a.failures[:5]
    quantized = [(arm, kv) for _, arm, kv in held if arm != "float32"]
    assert len({c for c, _, _ in held}) == 2 and quantized
    assert all(kv == [arm] for arm, kv in quantized), quantized       # never two arms', never two cases'
    assert not [k for k in a.cache if isinstance(k, tuple) and k[0] in ablation_audit._CASE_CACHES]
