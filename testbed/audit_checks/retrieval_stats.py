"""The audit's own statistics and trial check for needle retrieval (issue #32); numpy and stdlib only.

Written again from the definitions, not from :mod:`testbed.retrieval`:

- :func:`wilson_bounds`: the Wilson score interval is the set of rates ``p`` whose score test
  does not reject the observed rate ``q = k/n``: ``(q - p)^2 <= z^2 p (1 - p) / n``. Its bounds are
  the two roots of the quadratic ``(1 + z^2/n) p^2 - (2q + z^2/n) p + q^2 = 0``, solved here.
- :func:`mcnemar_p`: under the null, each of the ``b + c`` discordant pairs falls either way with
  probability 1/2; the exact two-sided p is the probability, summed in exact integer arithmetic
  (``math.comb``), of every split of the discordant pairs no more likely than the observed one.
  (Binomial(n, 1/2) is symmetric, so this is twice the smaller tail, capped at 1.)
- :func:`trial_problems`: a stored trial's asked needle ids sit at ``[needle_start, needle_end)``
  of its prefill, and its question and answer ids are non-empty integer ids.

Used by ``audit_checks/retrieval.py`` (the rows and trials) and ``audit_checks/report_md.py`` (the tables).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

__all__ = ["Z95", "wilson_bounds", "mcnemar_p", "trial_problems"]

# the 0.975 quantile of the standard normal distribution (two-sided 95 %), to 16 significant digits
Z95 = 1.959963984540054


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


def _ids(value, name: str, problems: list[str]) -> np.ndarray | None:
    arr = np.asarray(value)
    if arr.dtype == object or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        problems.append(f"{name}: expected a 1-D list of integer token ids, got dtype {arr.dtype}, shape {arr.shape}")
        return None
    if arr.size and arr.min() < 0:
        problems.append(f"{name}: negative token id {int(arr.min())}")
        return None
    return arr.astype(np.int64)


def trial_problems(trial: dict) -> list[str]:
    """What is wrong with one stored trial (an empty list when nothing is): ``prefill_ids``,
    ``needle_ids``, ``needle_start``, ``needle_end``, ``question_ids``, ``answer_ids`` and, when
    ``meta.length`` is given, the prefill's length."""
    problems: list[str] = []
    arrays = {name: _ids(trial.get(name, []), name, problems)
              for name in ("prefill_ids", "needle_ids", "question_ids", "answer_ids")}
    for name in ("needle_ids", "question_ids", "answer_ids"):
        if arrays[name] is not None and arrays[name].size == 0:
            problems.append(f"{name}: empty")
    start, end = trial.get("needle_start"), trial.get("needle_end")
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in (start, end)):
        problems.append(f"needle_start, needle_end: expected integers, got {start!r}, {end!r}")
        return problems
    prefill, needle = arrays["prefill_ids"], arrays["needle_ids"]
    if prefill is None or needle is None:
        return problems
    if not 0 <= start < end <= prefill.size:
        problems.append(f"needle span [{start}, {end}) is not inside the prefill of {prefill.size} tokens")
    elif end - start != needle.size:
        problems.append(f"needle span [{start}, {end}) holds {end - start} tokens, the stored needle {needle.size}")
    elif not np.array_equal(prefill[start:end], needle):
        first = int(np.flatnonzero(prefill[start:end] != needle)[0])
        problems.append(f"prefill_ids[{start + first}] = {int(prefill[start + first])}, the needle's token {first} "
                        f"is {int(needle[first])}")
    length = (trial.get("meta") or {}).get("length")
    if length is not None and prefill.size != length:
        problems.append(f"prefill_ids: {prefill.size} tokens, meta.length {length}")
    return problems
