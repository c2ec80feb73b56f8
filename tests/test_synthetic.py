"""The synthetic generator: one base array, distributions differing only in channel 0 of Q/K."""

import pytest
import torch

from testbed.attention import probabilities
from testbed.sources.synthetic import make_case


@pytest.mark.parametrize("n", [128, 512])
def test_distributions_share_base_and_differ_only_in_first_channel(n):
    cases = {d: make_case(d, 7, n) for d in ("clean", "early_focus", "recent_focus")}
    for d, c in cases.items():
        assert torch.equal(c.v, cases["clean"].v), d
        assert torch.equal(c.q[..., 1:], cases["clean"].q[..., 1:]), d
        assert torch.equal(c.k[..., 1:], cases["clean"].k[..., 1:]), d
    assert not torch.equal(cases["early_focus"].k[..., 0], cases["clean"].k[..., 0])


def _mass(case, a, b):
    p = probabilities(case.q, case.k, case.query_positions, case.causal)
    return float(p[..., a:b].sum(-1).mean()), p


@pytest.mark.parametrize("seed", [7, 19])
def test_focus_moves_mass_but_is_not_one_hot(seed):
    n = 128
    clean, _ = _mass(make_case("clean", seed, n), n - 16, n)
    recent, p = _mass(make_case("recent_focus", seed, n), n - 16, n)
    early, _ = _mass(make_case("early_focus", seed, n), 0, 16)
    assert recent > 3 * clean and early > 3 * clean
    assert float(p.max()) < 0.5  # other channels keep their random differences


def test_same_seed_same_arrays_other_seed_differs():
    a, b, c = make_case("clean", 7, 128), make_case("clean", 7, 128), make_case("clean", 8, 128)
    assert torch.equal(a.k, b.k) and not torch.equal(a.k, c.k)


def test_layout_covers_keys_and_queries_see_everything():
    c = make_case("early_focus", 41, 512)
    assert [r.name for r in c.layout] == ["sink", "middle", "recent"]
    assert c.layout[-1].stop == 512 and not c.causal
    assert c.meta["focus_span"] == [0, 16]


def test_bad_distribution_refused():
    with pytest.raises(ValueError, match="distribution"):
        make_case("middle_focus", 7, 128)
