"""The replay's per-array comparison (testbed.replay._diff) on its own: no model needed."""

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
