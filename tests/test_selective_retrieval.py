"""The seed's selective rule in the retrieval study (issue 45): one prefill, its pairs classed by the
prefill's own concentration, then the question and answer through the compressed cache.

Stated from the definition (docs/live.md), not read back from the code: at the budget, the rule makes
sparse exactly as many pairs as its random and reversed controls; the rule's sparse pairs are the most
concentrated ones (the lowest effective support, exp(entropy) / visible keys, of the prefill's
attention), the reversed rule's the least; a sparse pair holds its top keep prefill tokens and every
later token, a dense pair every token; and the audit passes such a run and fails a class swapped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests import _arrays
from tests._helpers import forge_array, tiny_retrieval_run

SEL = {"kind": "knorm", "mode": "prefill", "keep": 64, "heads": "selective", "alloc_from": "prefill"}
ARMS = [{"name": f"sel_{rule}", "selection": {**SEL, "alloc": rule}, "budget": {"fp16_fraction": 0.5}}
        for rule in ("concentrated", "random", "diffuse")]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_retrieval_run(tmp_path_factory, "selretr", ARMS, tasks=["passkey"], lengths=[384], depths=[0.5],
                              trials=2, budget_tolerance=0.05)


def _rows(run: Path) -> list[dict]:
    return json.loads((run / "results.json").read_text())["rows"]


@pytest.mark.capture
@pytest.mark.slow
def test_the_rule_and_its_controls_class_pairs_as_defined(run):
    from testbed.audit import audit

    ok, failures, _ = audit(run)
    assert ok, failures[:5]
    rows = _rows(run)
    for question in ("after", "inside"):
        got = {}
        for rule in ("concentrated", "random", "diffuse"):
            r = next(x for x in rows if x["arm"] == f"sel_{rule}" and x["question"] == question and x["case"] == "t0000")
            got[rule] = {k: _arrays.load(run, r["arrays"][f"select_{k}"]) for k in ("sparse", "score", "count")}
        m = {rule: int(a["sparse"].sum()) for rule, a in got.items()}
        assert len(set(m.values())) == 1 and 0 < m["concentrated"] < got["concentrated"]["sparse"].size, m
        for rule, pick in (("concentrated", np.max), ("diffuse", np.min)):
            a = got[rule]
            sparse, dense = a["score"][a["sparse"] == 1], a["score"][a["sparse"] == 0]
            assert np.all((0 < a["score"]) & (a["score"] <= 1))  # effective support
            if rule == "concentrated":  # the lowest supports are the sparse ones
                assert pick(sparse) <= np.min(dense)
            else:
                assert pick(sparse) >= np.max(dense)
        assert np.all(got["random"]["score"] == 0)  # content-blind: nothing measured
        c = got["concentrated"]
        assert len(np.unique(c["count"][c["sparse"] == 1])) == 1 and len(np.unique(c["count"][c["sparse"] == 0])) == 1
        assert c["count"][c["sparse"] == 1][0] < c["count"][c["sparse"] == 0][0]  # sparse pairs hold fewer tokens


@pytest.mark.capture
@pytest.mark.slow
def test_a_swapped_class_fails_the_audit(run, tmp_path):
    from testbed.audit import audit

    bad = Path(shutil.copytree(run, tmp_path / "bad"))
    r = next(x for x in _rows(bad) if x["arm"] == "sel_concentrated")

    def swap(a):  # one sparse pair made dense and one dense pair sparse: the count stays
        flat = a.reshape(-1)
        i, j = int(np.flatnonzero(flat == 1)[0]), int(np.flatnonzero(flat == 0)[0])
        flat[i], flat[j] = 0, 1

    forge_array(bad, r["arrays"]["select_sparse"], swap)
    ok, failures, _ = audit(bad)
    assert not ok and any("select_sparse is not the concentrated rule's choice" in f for f in failures), failures[:3]
