"""The replay (testbed.replay) without a model: its per-array comparison (_diff) and its refusal of malformed runs."""

from __future__ import annotations

import warnings

import numpy as np

from testbed.replay import TOLERANCES, _diff


def test_equal_infinities_are_equal_and_the_worst_difference_is_a_finite_one():
    """An infinity both runs hold at the same place is no difference: the worst difference is the
    finite one beside it (within tolerance), not inf - inf = NaN reported as beyond it."""
    stored = np.array([-np.inf, 1.0, 2.0, np.inf], dtype=np.float32)
    replayed = np.array([-np.inf, 1.0, 2.000001, np.inf], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "invalid value encountered in subtract"
        d = _diff("logprob", stored, replayed, TOLERANCES["same"])
    assert d is not None and d["ok"] and d["index"] == 2, d
    assert np.isfinite(d["ratio"]) and "nan" not in d["text"], d


def test_an_infinity_in_one_run_only_or_of_the_other_sign_is_beyond_any_tolerance():
    for a, b in (([np.inf, 1.0], [1.0, 1.0]), ([np.inf, 1.0], [-np.inf, 1.0]), ([np.nan, 1.0], [0.0, 1.0])):
        d = _diff("kl", np.array(a), np.array(b), TOLERANCES["cross"])
        assert d is not None and not d["ok"] and d["index"] == 0, (a, b, d)


def test_nan_in_both_runs_at_the_same_place_is_equal():
    stored = np.array([np.nan, 1.0, 2.0])
    replayed = np.array([np.nan, 1.0, 2.0 + 1e-7])
    d = _diff("kl", stored, replayed, TOLERANCES["same"])
    assert d is not None and d["ok"] and d["index"] == 2, d


# -- a malformed run is bad input (exit 2, one line), never a traceback -----------------------------

def _evidence_copy(tmp_path):
    import shutil
    from pathlib import Path

    src = Path(__file__).resolve().parent.parent / "evidence"
    if not (src / "results.json").is_file():
        import pytest

        pytest.skip("no evidence/ run in this checkout")
    return Path(shutil.copytree(src, tmp_path / "run"))


def _edit(path, edit):
    import json

    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def test_malformed_cases_or_protocol_copy_is_bad_input(tmp_path, capsys):
    import hashlib
    import json

    from testbed.replay import main

    run = _evidence_copy(tmp_path)
    res, man = run / "results.json", run / "manifest.json"
    original_res, original_man = res.read_text(encoding="utf-8"), man.read_text(encoding="utf-8")
    outside = tmp_path / "outside.json"
    live = next(e for e in json.loads(original_man)["protocols"] if e["name"] == "smollm2_quality")
    outside.write_bytes((run / live["copy"]).read_bytes())

    def to_outside(m):
        e = next(e for e in m["protocols"] if e["name"] == "smollm2_quality")
        e["copy"] = str(outside)  # absolute: outside the run folder
        e["sha256"] = hashlib.sha256(outside.read_bytes()).hexdigest()

    edits = [
        (res, lambda r: r.__setitem__("cases", list(r["cases"])), "cases"),
        (res, lambda r: r["cases"].__setitem__("smollm2_quality", list(r["cases"]["smollm2_quality"])),
         "smollm2_quality"),
        (man, to_outside, "frozen copy"),
    ]
    for path, edit, says in edits:
        res.write_text(original_res, encoding="utf-8")
        man.write_text(original_man, encoding="utf-8")
        _edit(path, edit)
        capsys.readouterr()
        code = main(["--quiet", str(run)])
        err = capsys.readouterr().err.splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and says in err[0], (says, code, err)


def test_cross_tolerance_is_compares_per_token_rule():
    """Across machines the replay judges per-token arrays as testbed.compare does: within 5e-2 of the
    array's largest magnitude, a few outliers (6 %, at least one) beyond but none past half of it;
    integer arrays may differ in 2 % of elements, at least one. What one instruction-set level
    down did to quanto int2 (docs/compare.md) passes; a forged token moved by more than half the
    scale, or too many moved tokens, or two flipped argmaxes in 20, do not."""
    stored = -np.linspace(0.5, 12.0, 100)
    few = stored.copy()
    few[[3, 40, 77]] -= 1.0  # 3 of 100 tokens moved by 1 nat (> 5e-2 x 12 = 0.6, < 0.5 x 12)
    assert _diff("logprob", stored, few, TOLERANCES["cross"])["ok"]
    far = stored.copy()
    far[5] -= 7.0  # past half the scale
    assert not _diff("logprob", stored, far, TOLERANCES["cross"])["ok"]
    many = stored.copy()
    many[::10] -= 1.0  # 10 of 100 beyond rtol: more than 6 %
    assert not _diff("logprob", stored, many, TOLERANCES["cross"])["ok"]
    same_rule = TOLERANCES["same"]
    assert not _diff("logprob", stored, few, same_rule)["ok"]
    argmax = np.arange(20)
    one, two = argmax.copy(), argmax.copy()
    one[4] = 99
    two[[4, 9]] = 99
    assert _diff("argmax", argmax, one, TOLERANCES["cross"])["ok"]
    assert not _diff("argmax", argmax, two, TOLERANCES["cross"])["ok"]
