"""The audit's own statistics, written again from their definitions (not from the run side's
``testbed.live``, ``testbed.retrieval`` or scipy); numpy and stdlib only. The units are seeds, prompts
or segments, never rows (``unit_of``, ``per_unit``).

- :func:`wilcoxon_p`: the exact two-sided Wilcoxon signed-rank p of paired values (the normal
  approximation only where scipy's ``method="auto"`` takes it), with whether it is an exact count;
- :func:`holm`: Holm's step-down adjustment of a family of p-values;
- :func:`bootstrap`: the live table's 95 % percentile interval of a mean over segments, resampled on
  numpy's ``default_rng(0)``;
- :func:`wilson_bounds`: the Wilson score interval is the set of rates ``p`` whose score test
  does not reject the observed rate ``q = k/n``: ``(q - p)^2 <= z^2 p (1 - p) / n``. Its bounds are
  the two roots of the quadratic ``(1 + z^2/n) p^2 - (2q + z^2/n) p + q^2 = 0``, solved here.
- :func:`mcnemar_p`: under the null, each of the ``b + c`` discordant pairs falls either way with
  probability 1/2; the exact two-sided p is the probability, summed in exact integer arithmetic
  (``math.comb``), of every split of the discordant pairs no more likely than the observed one.
  (Binomial(n, 1/2) is symmetric, so this is twice the smaller tail, capped at 1.)
- ``median``, ``mean``, ``pooled`` (row-weighted over cases): the small reductions of the report's tables.

Used by ``report_md.py``, ``report_format.py`` and the analyses' ``report_tables`` (the tables), and by
``retrieval.py``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

__all__ = ["Z95", "MIN_CI_SEGMENTS", "BOOTSTRAP_RESAMPLES", "BOOTSTRAP_SEED", "bootstrap", "holm", "mcnemar_p", "mean",
           "median", "per_unit", "pooled", "unit_of", "wilcoxon_p", "wilson_bounds"]

# the 0.975 quantile of the standard normal distribution (two-sided 95 %), to 16 significant digits
Z95 = 1.959963984540054
MIN_CI_SEGMENTS = 5  # the live bootstrap interval is given from this many segments on
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 2000, 0


def wilson_bounds(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The two roots of ``(1 + z²/n) p² - (2k/n + z²/n) p + (k/n)² = 0``, low then high."""
    k, n = int(successes), int(n)
    if n <= 0 or k < 0 or k > n:
        raise ValueError(f"Wilson interval of {successes} successes in {n} trials")
    q = Fraction(k, n)
    a = 1.0 + z * z / n
    b = -(2.0 * float(q) + z * z / n)
    c = float(q * q)
    root = math.sqrt(max(b * b - 4.0 * a * c, 0.0))
    # the larger root directly; the smaller through the product of the roots (c / a), which has no
    # cancellation when q is near 0 (and is exactly 0 at k = 0)
    high = (-b + root) / (2.0 * a)
    low = c / (a * high) if high > 0 else 0.0
    return low, min(high, 1.0)


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p: the Binomial(b + c, 1/2) mass of the splits at most as likely as
    ``(b, c)``; 1 when there is no discordant pair."""
    b, c = int(b), int(c)
    if b < 0 or c < 0:
        raise ValueError(f"McNemar test of discordant counts {b}, {c}")
    n = b + c
    if n == 0:
        return 1.0
    ways = [math.comb(n, i) for i in range(n + 1)]  # exact integers: equal likelihoods compare equal
    mass = sum(w for w in ways if w <= ways[b])
    return float(min(Fraction(mass, 2 ** n), Fraction(1)))


def median(xs):
    xs = sorted(x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x)))
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def mean(xs):
    xs = [x for x in xs if x is not None]
    return math.fsum(xs) / len(xs) if xs else float("nan")


def pooled(rows, key):
    """Row-weighted mean over cases of the rows that have ``key``."""
    rs = [r for r in rows if r.get(key) is not None]
    n = sum(r["rows"] for r in rs)
    return None if not n else math.fsum(r[key] * r["rows"] for r in rs) / n


def unit_of(r) -> str:
    """The independent unit of a row: its prompt, else its seed, else its case."""
    for key in ("prompt", "seed"):
        if r.get(key) is not None:
            return f"{key}={r[key]}"
    return f"case={r['case']}"


def per_unit(rows, field) -> dict:
    acc: dict = {}
    for r in rows:
        if r.get(field) is not None:
            acc.setdefault(unit_of(r), []).append(r[field])
    return {u: math.fsum(v) / len(v) for u, v in acc.items()}


def wilcoxon_p(x, y) -> tuple:
    """``(p, exact)``: the two-sided Wilcoxon signed-rank p of paired values (None with fewer than
    two non-zero differences) and whether it is an exact count (a ratio of integers, printed with
    no tolerance: p = 2/2^6 = 0.03125 sits exactly on a rounding boundary of 4 decimals).

    Zero differences are dropped (Wilcox); |d| is ranked with average ranks for ties.
    Exact: the positive-rank sum's null distribution over all 2^m sign flips, counted with doubled
    (integer) ranks, p = min(1, 2 min(P(T <= t), P(T >= t))). Where scipy's ``method="auto"`` falls
    back to the normal approximation (over 50 pairs; ties or zeros and over 13 pairs), that one,
    without continuity correction and with the tie correction of the variance."""
    pairs = [(float(a), float(b)) for a, b in zip(x, y) if math.isfinite(float(a)) and math.isfinite(float(b))]
    d = [a - b for a, b in pairs]
    nz = [v for v in d if v != 0]
    if len(nz) < 2:
        return None, True
    order = sorted(range(len(nz)), key=lambda i: abs(nz[i]))
    rank2 = [0] * len(nz)  # twice the average rank: an integer
    ties = []
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and abs(nz[order[j + 1]]) == abs(nz[order[i]]):
            j += 1
        for k in range(i, j + 1):
            rank2[order[k]] = i + j + 2
        ties.append(j - i + 1)
        i = j + 1
    t2 = sum(r for r, v in zip(rank2, nz) if v > 0)
    m = len(nz)
    has_ties = any(t > 1 for t in ties)
    n_zero = len(d) - m
    if len(d) > 50 or ((has_ties or n_zero) and len(d) > 13):
        mean = m * (m + 1) / 4
        var = (m * (m + 1) * (2 * m + 1) - sum(t ** 3 - t for t in ties) / 2) / 24
        z = (t2 / 2 - mean) / math.sqrt(var)
        return math.erfc(abs(z) / math.sqrt(2)), False
    counts = {0: 1}
    for r in rank2:
        nxt = dict(counts)
        for s, c in counts.items():
            nxt[s + r] = nxt.get(s + r, 0) + c
        counts = nxt
    total = 2 ** m
    le = sum(c for s, c in counts.items() if s <= t2)
    ge = sum(c for s, c in counts.items() if s >= t2)
    return min(1.0, 2 * min(le, ge) / total), True


def bootstrap(x: np.ndarray):
    """95 % percentile interval of the mean of ``x`` over its units, resampled with replacement
    (numpy's default_rng(0), 2,000 resamples); None below MIN_CI_SEGMENTS units."""
    if x.size < MIN_CI_SEGMENTS:
        return None
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    draws = rng.integers(0, x.size, size=(BOOTSTRAP_RESAMPLES, x.size))
    means = x[draws].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def holm(ps) -> list:
    """Holm's step-down adjustment, the audit's own: of the m p-values that are not None, the i-th
    smallest becomes the largest of min(1, (m - j + 1) p_(j)) over j <= i; None stays None."""
    order = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])
    adjusted = [None] * len(ps)
    top = 0.0
    for rank, i in enumerate(order):
        top = max(top, min(1.0, (len(order) - rank) * ps[i]))
        adjusted[i] = top
    return adjusted
