"""A live study split over several runs by ``segment_range``, and ``python -m testbed.pool``: a part
decodes exactly the segments the whole study would (same starts, same ids, the same numbers), the
audit holds a part to its range, and the pooled table of the parts is the whole study's table."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from tests._helpers import forge_report_html, forge_report_md, heavy_imports, rows_by_arm, tiny_live_run
from testbed import pool
from testbed.audit import audit
from testbed.protocol import validate_protocol
from testbed.schema import ProtocolError

ARMS = ["int4", "int2"]
SMALL = {"segments": 3, "prefill": 48, "steps": 16}


def _rehash_results(run) -> None:
    import hashlib

    m = json.loads((run / "manifest.json").read_text())
    m["files"]["results.json"] = hashlib.sha256((run / "results.json").read_bytes()).hexdigest()
    (run / "manifest.json").write_text(json.dumps(m, indent=1))
    forge_report_md(run)
    forge_report_html(run)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The whole 3-segment study, and its two parts (segments 0 and 1..2)."""
    whole = tiny_live_run(tmp_path_factory, "whole", ARMS, **SMALL)
    head = tiny_live_run(tmp_path_factory, "part_a", ARMS, segment_range=[0, 1], **SMALL)
    tail = tiny_live_run(tmp_path_factory, "part_b", ARMS, segment_range=[1, 3], **SMALL)
    return whole, head, tail


def _rows(run):
    return {(r["case"], r["arm"]): r for r in json.loads((run / "results.json").read_text())["rows"]}


def _cases(run):
    return json.loads((run / "results.json").read_text())["cases"]


@pytest.mark.slow
def test_a_part_decodes_the_whole_studys_segments(runs):
    whole, head, tail = runs
    full, cases = _rows(whole), next(iter(_cases(whole).values()))
    got = {}
    for part in (head, tail):
        got.update(_rows(part))
        for sid, rec in next(iter(_cases(part).values())).items():
            assert rec["meta"]["start_token"] == cases[sid]["meta"]["start_token"]
            assert rec["meta"]["token_ids_sha256"] == cases[sid]["meta"]["token_ids_sha256"]
    assert sorted(got) == sorted(full)
    assert sorted({c for c, _ in _rows(tail)}) == ["seg001", "seg002"]
    for k, r in full.items():  # batch 1, one thread: the same computation, the same bits
        assert got[k]["nll"] == r["nll"] and got[k]["bytes_per_token"] == r["bytes_per_token"], k


@pytest.mark.slow
def test_the_pool_of_the_parts_is_the_whole_study(runs, tmp_path, capsys):
    whole, head, tail = runs
    parts = pool.pool([(str(r), *pool.part_of(r)) for r in (head, tail)])
    alone = pool.pool([(str(whole), *pool.part_of(whole))])
    assert parts["segments"] == alone["segments"] == ["seg000", "seg001", "seg002"]
    assert parts["arms"] == alone["arms"]
    rows = rows_by_arm(whole)  # one segment's worth of names; the Δ recomputed here from every segment
    full = _rows(whole)
    for e in parts["arms"]:
        if e["arm"] == "dynamic_cache":
            continue
        d = [full[(s, e["arm"])]["nll"] - full[(s, "dynamic_cache")]["nll"] for s in ("seg000", "seg001", "seg002")]
        assert e["delta_pct"] == pytest.approx(100 * math.expm1(float(np.mean(d))), rel=1e-12)
        assert e["delta_ci"] is None  # 3 segments: below the bootstrap's minimum
        assert e["worse"] == sum(x > 0 for x in d)
        assert e["arm"] in rows
    out = tmp_path / "pooled.json"
    assert pool.main(["--quiet", "--json", str(out), str(head), str(tail)]) == 0
    assert json.loads(out.read_text())["arms"] == json.loads(json.dumps(parts["arms"]))
    assert "3 of the protocol's 3 segments" in capsys.readouterr().out


@pytest.mark.slow
def test_the_pool_refuses_overlapping_or_foreign_parts(runs, tmp_path, capsys):
    whole, head, tail = runs
    assert pool.main(["--quiet", str(whole), str(tail)]) == 2
    assert "segment seg001 is also in" in capsys.readouterr().err
    proto, rows, identity = pool.part_of(tail)
    foreign = json.loads(json.dumps(proto))
    foreign["live"]["steps"] = 17
    with pytest.raises(pool.BadInput, match="differs in live.steps"):
        pool.pool([("a", pool.part_of(head)[0], [], identity), ("b", foreign, [], identity)])
    other = {**identity, "corpus_tokens": identity["corpus_tokens"] + 1}  # another corpus or tokenizer
    with pytest.raises(pool.BadInput, match="another corpus or model"):
        pool.pool([("a", *pool.part_of(head)), ("b", proto, rows, other)])
    with pytest.raises(pool.BadInput, match="its rows hold segments"):  # a part missing a segment of its range
        pool.pool([("a", *pool.part_of(head)), ("b", proto, [r for r in rows if r["case"] != "seg002"], identity)])


@pytest.mark.slow
def test_a_part_that_fails_its_audit_is_not_pooled(runs, tmp_path, capsys):
    _, head, tail = runs
    bad = tmp_path / "bad"
    shutil.copytree(tail, bad)
    res = json.loads((bad / "results.json").read_text())
    res["rows"][1]["nll"] += 0.01
    (bad / "results.json").write_text(json.dumps(res))
    _rehash_results(bad)
    assert pool.main(["--quiet", str(head), str(bad)]) == 1
    assert "fails its audit" in capsys.readouterr().out


@pytest.mark.slow
def test_the_audit_holds_a_part_to_its_range(runs, tmp_path):
    _, head, tail = runs
    ok, failures, _ = audit(tail)
    assert ok, failures[:3]
    # a run whose rows and cases lack one of its range's segments fails, naming the grid
    cut = tmp_path / "cut"
    shutil.copytree(tail, cut)
    res = json.loads((cut / "results.json").read_text())
    res["rows"] = [r for r in res["rows"] if r.get("case") != "seg002"]
    for study in res["cases"].values():
        study.pop("seg002", None)
    (cut / "results.json").write_text(json.dumps(res))
    _rehash_results(cut)
    ok, failures, _ = audit(cut)
    assert not ok and any("segments" in f for f in failures), failures[:5]


@pytest.mark.parametrize("rng, says", [([2, 1], "0 <= first < stop"), ([0, 4], "0 <= first < stop"),
                                       ([1], "at least 2"), ([0, 1, 2], "0 <= first < stop"), ("0:2", "segment_range")])
def test_bad_segment_ranges_are_refused(rng, says):
    proto = json.loads(open("protocols/smollm2_quality.json").read())
    proto["live"].update(segments=3, segment_range=rng)
    with pytest.raises(ProtocolError, match=says):
        validate_protocol(proto, where="p.json")


@pytest.mark.slow
def test_pool_imports_neither_torch_nor_testbed_numerics(runs):
    """Like the audit and compare, the pool reads runs with numpy and the standard library only."""
    call = ("import pathlib, testbed.pool as p\n"
            "ok = p.pool([('t', *p.part_of(pathlib.Path(sys.argv[1])))])['segments'] == ['seg001', 'seg002']")
    assert heavy_imports(call, runs[2]) == ("True", [])


@pytest.mark.slow
def test_a_part_cannot_claim_other_positions(runs, tmp_path):
    """A consistent forger moves a part's segments to other evenly spaced starts (results.json's
    cases and the live manifest's map alike): the corpus's token count fixes the stride, so the
    audit names the starts."""
    import hashlib

    _, _, tail = runs
    bad = tmp_path / "moved"
    shutil.copytree(tail, bad)
    res = json.loads((bad / "results.json").read_text())
    study = next(iter(res["cases"]))
    rel = f"{study}/live_manifest.json"
    man = json.loads((bad / rel).read_text())
    stride = man["corpus_tokens"] // 3
    for sid, i in (("seg001", 1), ("seg002", 2)):  # half the true stride: still disjoint, evenly spaced
        res["cases"][study][sid]["meta"]["start_token"] = i * (stride // 2)
        man["segments"][sid] = i * (stride // 2)
    (bad / "results.json").write_text(json.dumps(res))
    (bad / rel).write_text(json.dumps(man, indent=1))
    m = json.loads((bad / "manifest.json").read_text())
    m["files"][rel] = hashlib.sha256((bad / rel).read_bytes()).hexdigest()
    (bad / "manifest.json").write_text(json.dumps(m, indent=1))
    _rehash_results(bad)
    ok, failures, _ = audit(bad)
    assert not ok and any("are not disjoint, evenly spaced" in f for f in failures), failures[:5]
