"""report.html's equal-bytes figure (per-head precision arms at the bytes of int4 or of a 3-bit
layout): its data from the rows, the audit's own derivation of it, a forged number failing, and
its drawing read at the page's width (arms named on the y axis, no floating labels). The forged
number in a finished run's report.html is tests/test_report_html.py's
``test_equal_bytes_value_changed`` (a reliability suite)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from testbed import report_html as rh
from testbed.report_html import data as rh_data
from testbed.report_html import page as rh_page
from testbed.audit_checks import report_html as audit_side
from testbed.audit_checks import report_html_figures as audit_figures
from tests.test_report_html import EVIDENCE_REPORT, unreadable

RULES = ("concentrated", "diffuse", "late", "random", "oracle_concentrated", "oracle_diffuse")
# made-up per-segment NLL shifts against the reference (nats): int4 +0.3 %, int2 +22 %, the mix arms between
SHIFT = {"int4": 0.003, "int2": 0.2, "float32": 0.0, "mix24_random": 0.03, "mix28_random": 0.16}
SHIFT.update({f"mix28_{r}": s for r, s in zip(RULES, (0.19, 0.05, 0.2, 0.16, 0.185, 0.049))})
SHIFT.update({f"mix24_{r}": s for r, s in zip(RULES, (0.12, 0.025, 0.125, 0.03, 0.11, 0.028))})


def made_up_rows(arms=None, segments=8, contexts=("",), study="q"):
    """Live rows of a reference and ``arms`` (default: every arm of SHIFT), ``segments`` per context."""
    rng = np.random.default_rng(3)
    rows = []
    for ctx in contexts:
        for arm in ["dynamic_cache"] + list(arms or SHIFT):
            for i in range(segments):
                case = f"{ctx}-seg{i:03d}" if ctx else f"seg{i:03d}"
                shift = SHIFT.get(arm, EXTRA_SHIFT.get(arm, 0.0))
                nll = 2.2 + 0.05 * i + (shift + rng.normal(0, 0.01) if shift else 0.0)
                bpt = 46080.0 if arm in ("dynamic_cache", "float32") else 11088.0 if arm.startswith(("mix28", "int4")) \
                    else 9792.0 if arm.startswith("mix24") else 8000.0
                rows.append({"study": study, "analysis": "live_quality", "arm": arm,
                             "kind": "reference" if arm == "dynamic_cache" else "policy", "case": case, "nll": nll,
                             "mean_kl": shift, "bytes_per_token": bpt, "arrays": {"argmax": f"{arm}/{case}"}})
    return rows


# the uniform 3-bit arm and heavy hitters at int2's bytes (named in the rows only where a test asks)
EXTRA_SHIFT = {"int3": 0.02, "int2_hh": 0.1, "int2_hh_first": 0.115, "int2_hh_oracle": 0.09, "int2_sink4": 0.15}


def load(rel):
    return np.zeros(16, dtype=np.int64)


class _Ctx:
    load = staticmethod(load)


def equal_bytes_data(rows):
    return next((d for d in rh.figure_data(rows, load) if d["kind"] == "equal_bytes"), None)


def test_figure_data_from_the_rows():
    """One panel per budget: every mix arm but the compared one, sorted by Δ perplexity against the
    reference (exp of the mean per-segment NLL difference, minus 1, computed here), oracle arms
    flagged; the compared arm and the uniform arms as lines."""
    rows = made_up_rows()
    d = equal_bytes_data(rows)
    assert d["key"] == "equal_bytes/q"
    budgets = {b["budget"]: b for b in d["budgets"]}
    assert set(budgets) == {"mix28", "mix24"}
    assert budgets["mix28"]["versus"]["arm"] == "int4" and budgets["mix24"]["versus"]["arm"] == "mix24_random"
    assert [u["arm"] for u in budgets["mix28"]["uniform"]] == ["int2"]
    assert [u["arm"] for u in budgets["mix24"]["uniform"]] == ["int2", "int4"]
    assert {e["arm"] for e in budgets["mix28"]["arms"]} == {f"mix28_{r}" for r in RULES}
    assert {e["arm"] for e in budgets["mix24"]["arms"]} == {f"mix24_{r}" for r in RULES if r != "random"}
    ref = {r["case"]: r["nll"] for r in rows if r["arm"] == "dynamic_cache"}
    for b in d["budgets"]:
        deltas = [e["delta_pct"] for e in b["arms"]]
        assert deltas == sorted(deltas)
        for e in b["arms"] + [b["versus"]] + b["uniform"]:
            d_nll = np.array([r["nll"] - ref[r["case"]] for r in rows if r["arm"] == e["arm"]])
            assert e["delta_pct"] == pytest.approx(100 * (np.exp(d_nll.mean()) - 1), rel=1e-8)
        assert [e["oracle"] for e in b["arms"]] == ["oracle" in e["arm"] for e in b["arms"]]
    assert rh_page._caption(d).endswith("or an interval: 8 segments.")
    assert "impossible online" in rh_page._caption(d) and "does not show" in rh_page._caption(d)


def test_no_figure_without_a_compared_arm():
    """mix arms whose arm of the same bytes is absent (no int4, no mix24_random) draw nothing, on
    both sides; with int4 only the mix28 panel is drawn."""
    rows = made_up_rows(["int2", "mix28_concentrated", "mix24_concentrated", "mix24_diffuse"])
    assert equal_bytes_data(rows) is None
    assert "equal_bytes/q" not in audit_figures.derive_figures(rows, _Ctx())
    rows = made_up_rows(["int4", "mix28_concentrated", "mix24_concentrated"])
    assert [b["budget"] for b in equal_bytes_data(rows)["budgets"]] == ["mix28"]


@pytest.mark.parametrize("contexts", [("",), ("c96", "c160")])
def test_the_audit_derives_the_same_data_and_a_changed_number_fails(contexts):
    rows = made_up_rows(contexts=contexts)
    built = {d["key"]: d for d in rh.figure_data(rows, load)}
    derived = audit_figures.derive_figures(rows, _Ctx())
    assert list(derived) == list(built)  # same figures in the same order (the figure numbers)
    got = json.loads(rh_page._json_block(built["equal_bytes/q"]))
    assert audit_figures.first_difference("", got, derived["equal_bytes/q"]) is None
    assert audit_side.caption(got) == rh_page._caption(got)
    assert len(got["budgets"]) == 2 * len(contexts)
    forged = json.loads(json.dumps(got))
    forged["budgets"][0]["arms"][2]["delta_pct"] *= 1.01
    diff = audit_figures.first_difference("", forged, derived["equal_bytes/q"])
    assert diff and diff.startswith("budgets[0].arms[2].delta_pct")
    forged = json.loads(json.dumps(got))  # two arms swapped: the order is the plotted ranking
    arms = forged["budgets"][1]["arms"]
    arms[0], arms[1] = arms[1], arms[0]
    assert audit_figures.first_difference("", forged, derived["equal_bytes/q"])
    forged = json.loads(json.dumps(got))  # an oracle arm drawn as an online one
    e = next(e for e in forged["budgets"][0]["arms"] if e["oracle"])
    e["oracle"] = False
    assert "oracle" in audit_figures.first_difference("", forged, derived["equal_bytes/q"])


def test_int3_is_the_3_bit_budgets_uniform_arm_and_heavy_hitters_get_an_int2_panel():
    """With uniform int3 in the run, the mix24 panel is drawn against it (mix24_random then one of its
    arms); the heavy-hitter arms get a panel at int2's bytes against int2, with only int2_hh_oracle
    hollow, and int2_sink4 (more bytes than int2) in no panel. The audit derives the same data and
    the drawing reads at the page's width."""
    arms = list(SHIFT) + list(EXTRA_SHIFT)
    rows = made_up_rows(arms)
    d = equal_bytes_data(rows)
    budgets = {b["budget"]: b for b in d["budgets"]}
    assert list(budgets) == ["mix28", "mix24", "int2_hh"]
    assert budgets["mix24"]["versus"]["arm"] == "int3" and budgets["int2_hh"]["versus"]["arm"] == "int2"
    assert "mix24_random" in {e["arm"] for e in budgets["mix24"]["arms"]}
    assert {e["arm"]: e["oracle"] for e in budgets["int2_hh"]["arms"]} == {
        "int2_hh": False, "int2_hh_first": False, "int2_hh_oracle": True}
    assert not any(e["arm"] == "int2_sink4" for b in d["budgets"] for e in b["arms"])
    assert [u["arm"] for u in budgets["int2_hh"]["uniform"]] == ["int3", "int4"]
    ref = {r["case"]: r["nll"] for r in rows if r["arm"] == "dynamic_cache"}
    d_nll = np.array([r["nll"] - ref[r["case"]] for r in rows if r["arm"] == "int3"])
    assert budgets["mix24"]["versus"]["delta_pct"] == pytest.approx(100 * (np.exp(d_nll.mean()) - 1), rel=1e-8)
    derived = audit_figures.derive_figures(rows, _Ctx())
    got = json.loads(rh_page._json_block({"key": "equal_bytes/q", **d}))
    assert audit_figures.first_difference("", got, derived["equal_bytes/q"]) is None
    assert unreadable(rh.figure_layout(d), rh.PAGE_PX) == []


@pytest.mark.parametrize("contexts", [("",), ("c96", "c160")])
def test_figure_reads_at_page_width(contexts):
    """Every arm named on its panel's y axis (no floating label), text at least 11 px at the page's
    width, no overlaps, the legend off the panels; two contexts give four panels."""
    d = equal_bytes_data(made_up_rows(contexts=contexts))
    layout = rh.figure_layout(d)
    assert unreadable(layout, rh.PAGE_PX) == []
    assert layout["size"][0] <= rh.PAGE_PX
    ticks = [t["text"] for t in layout["texts"] if t["role"] == "tick"]
    for b in d["budgets"]:
        assert all(e["arm"] in ticks for e in b["arms"])
    assert not [t for t in layout["texts"] if t["role"] == "label"]
    legend = " ".join(t["text"] for t in layout["texts"] if t["role"] == "legend")
    assert "uniform int2" in legend and "impossible online" in legend


def test_figure_with_arms_better_than_the_reference_reads():
    """A Δ below zero (the symlog axis) draws as legibly."""
    rows = made_up_rows()
    for r in rows:
        if r["arm"] == "mix24_diffuse":
            r["nll"] -= 0.05
    d = equal_bytes_data(rows)
    assert min(e["delta_pct"] for b in d["budgets"] for e in b["arms"]) < 0
    assert unreadable(rh.figure_layout(d), rh.PAGE_PX) == []


def test_evidence_rows_give_a_readable_figure():
    """The archived default run's live rows (mix28_concentrated, mix28_random,
    mix28_oracle_concentrated against int4) call for the figure, and it reads; after evidence/ is
    regenerated its report.html carries it (test_report_html's evidence test then draws it too)."""
    results = EVIDENCE_REPORT.parent / "results.json"
    if not results.is_file():
        pytest.skip("no evidence/results.json")
    rows = [r for r in json.loads(results.read_text())["rows"] if r.get("analysis") == "live_quality"
            and r["study"] == "smollm2_quality"]
    d = rh_data._equal_bytes("smollm2_quality", rows, load)
    assert [b["budget"] for b in d["budgets"]] == ["mix28"]
    assert {e["arm"] for e in d["budgets"][0]["arms"]} == {"mix28_concentrated", "mix28_random",
                                                            "mix28_oracle_concentrated"}
    d = rh_data._rounded({"key": "equal_bytes/smollm2_quality", "kind": "equal_bytes", "study": "smollm2_quality", **d})
    assert unreadable(rh.figure_layout(d), rh.PAGE_PX) == []
