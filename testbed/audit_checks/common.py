"""numpy-only building blocks of the audit: spec constants, tolerances, strict JSON, float64
attention, metrics. The quantizer kinds (what a stored payload means) are in ``schemes.py``.

Written independently of ``testbed.quant`` and ``testbed.attention`` on purpose: the audit is a
second implementation that must agree with the first.
"""

from __future__ import annotations

import json

import numpy as np

# The audit's own spec constants, written from the specs here (never imported from testbed.quant,
# whose copies live in testbed/quant/constants.py): the audit's every use reads these names.
HEADER_BYTES = 16   # testbed's payload header: (N tokens, D features) as two little-endian int64
MX_BLOCK_SIZE = 32  # OCP MX v1.0: elements sharing one scale in every concrete MX format (k = 32)
E8M0_BIAS = 127     # OCP MX v1.0, E8M0 scale: code c is 2**(c - 127); unbiased exponents -127..127
E8M0_NAN = 255      # OCP MX v1.0, E8M0 scale: the NaN code
FP16_MAX = 65504.0  # IEEE 754 binary16: the largest finite magnitude (a scale, zero or outlier value)

# The audit's tolerances, one per kind of number (docs/audit.md). They are the audit's: nothing a
# run wrote (its protocol copies included) can loosen them; a protocol may only tighten "derived".
TOLERANCES = {
    # the selective rule's top-k sets: a key left out may outweigh a kept one by this much (float64
    # rounding of the run's and the audit's softmax), so a near tie may fall either way
    "selective_tie": {"rtol": 1e-9, "atol": 1e-15},
    # counts, bytes, shapes, codes, indices, token ids: exact
    "integer": {"rtol": 0.0, "atol": 0.0},
    # a number the run and the audit both compute in float64 from the same stored arrays
    "derived": {"rtol": 1e-6, "atol": 1e-9},
    # rates of strict float32 zeros: an entry at the float32 underflow edge may land either side in
    # two softmax implementations, so the rate is compared with this absolute tolerance
    "float32_zero_rate": {"rtol": 0.0, "atol": 1e-3},
    # a float32 softmax statistic of the run (a chosen sink's attention shares) against the
    # audit's float64 recomputation from the stored float32 queries and keys
    "float32_softmax": {"rtol": 1e-4, "atol": 1e-6},
    # a pre-RoPE cache's recorded keys as stored (un-rotated in float32), rotated again by the audit in
    # float64 with the recorded cos / sin, against the recorded post-RoPE float32 keys: float32 rounding
    # of an orthogonal 2 x 2 rotation and its inverse, a few ulps of the key's scale
    "rope_roundtrip": {"rtol": 1e-5, "atol": 1e-5},
    # KL of two float32 softmaxes summed in float64 may dip this far below zero
    "kl_floor": {"rtol": 0.0, "atol": 1e-6},
    # a scorer's float32 score against the audit's own (a float64 norm of the same float32 key may round
    # to the neighbouring float32): kept and dropped tokens this close count as a near tie
    "score_near_tie": {"rtol": 1e-6, "atol": 0.0},
    # a scorer's float32 attention score (a softmax share) against the audit's float64 one: measured within
    # 1.5e-7 relative on SmolLM2; relative, so a near tie at small boundary scores stays a rounding-level one
    "score_attention": {"rtol": 1e-5, "atol": 1e-12},
    # a rotary schedule's log-frequencies a straight line: steps equal within float32 rounding of the log
    "rope_schedule": {"rtol": 0.0, "atol": 1e-5},
    # the probabilities of one float32 log-softmax (exp of the stored log-probs) sum to 1 within
    # this: a float32 sum of a ~50k-token vocabulary, accumulated in a few lanes, drifts ~1e-4 at
    # worst (measured: under 2e-5 on random logits of 49,152 tokens). The live audit's bounds that
    # need no model (log-prob vs argmax, KL vs the target token's probabilities) give this much slack
    # to a mass they do not see
    "float32_log_softmax": {"rtol": 0.0, "atol": 1e-3},
    # a float32 cache holds the reference's own float32 K/V and runs the reference's chunks: its
    # per-token KL can differ from zero only by float32 rounding of the same forward (logits 1e-5
    # apart give a KL near 1e-10; the archived runs are bit-identical, a quantized arm's mean KL is
    # 5e-4..3 per token)
    "float32_same_cache": {"rtol": 0.0, "atol": 1e-4},
    # a calibrated codebook's level (in [-1, 1]) re-derived by the audit's own Lloyd's k-means from the stored
    # calibration input: float64 sums in another order may move a centre across a float16 rounding edge;
    # two float16 steps at magnitude 1 (2^-9)
    "codebook_lloyd": {"rtol": 0.0, "atol": 2.0 ** -9},
    # the coverage threshold of effective support (a sum of float64 masses against coverage x total)
    "coverage": {"rtol": 0.0, "atol": 1e-9},
    # a number of report.md, re-derived from the same float64 row values the run's report read (only
    # the summation order differs, ~1e-15): a value this close to a rounding boundary of its printed
    # digits may print either way; "derived" would be as coarse as a 6-decimal print near 1
    "report": {"rtol": 1e-12, "atol": 1e-12},
}

__all__ = ["HEADER_BYTES", "MX_BLOCK_SIZE", "E8M0_BIAS", "E8M0_NAN", "FP16_MAX", "TOLERANCES", "no_duplicate_keys",
           "strict_json", "MAX_ROW_SCORES", "row_tiles", "expand_heads", "visible", "softmax_attention", "rel_l2",
           "cosine", "max_abs"]


def no_duplicate_keys(pairs):
    """``object_pairs_hook`` refusing an object that names a key twice: two readers (one keeping
    the first, one the last) could see two different values, so a forged copy could hide before
    the real one."""
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def strict_json(text, **kwargs):
    """``json.loads`` refusing duplicate keys (a ``ValueError`` naming the key)."""
    return json.loads(text, object_pairs_hook=no_duplicate_keys, **kwargs)

# float64 scores per tile of one query head's rows in the observation and ablation re-derivations
# (16 MiB a score array; a tile's temporaries are a few times that): the per-head work never holds
# [Tq, Tk]. Read at call time, so a test may lower it.
MAX_ROW_SCORES = 1 << 21


def row_tiles(queries: int, keys: int, max_scores: int | None = None) -> list[slice]:
    """Slices of ``queries`` rows, each of at most ``max_scores`` (default ``MAX_ROW_SCORES``) scores
    against ``keys`` keys, and at least one row; the last may be partial."""
    budget = MAX_ROW_SCORES if max_scores is None else int(max_scores)
    step = max(1, budget // max(1, keys))
    return [slice(a, min(queries, a + step)) for a in range(0, queries, step)]


def expand_heads(x: np.ndarray, heads: int) -> np.ndarray:
    return np.repeat(x, heads // x.shape[0], axis=0)


def visible(query_positions: np.ndarray, keys: int, causal: bool) -> np.ndarray:
    """[Tq, Tk] visibility (all True when not causal)."""
    if not causal:
        return np.ones((len(query_positions), keys), dtype=bool)
    return np.arange(keys)[None, :] <= query_positions[:, None]


def softmax_attention(q, k, v, query_positions, causal, dtype=np.float64):
    """Probabilities [H, Tq, Tk] and output [H, Tq, D] computed in ``dtype``."""
    h = q.shape[0]
    qd = q.astype(dtype)
    kd = expand_heads(k, h).astype(dtype)
    vd = expand_heads(v, h).astype(dtype)
    s = qd @ kd.transpose(0, 2, 1) / np.sqrt(dtype(q.shape[-1]))
    vis = visible(query_positions, k.shape[1], causal)
    s = np.where(vis[None], s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    p = e / e.sum(axis=-1, keepdims=True)
    return p, p @ vd


def rel_l2(x, ref) -> float:
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    den = np.linalg.norm(ref.ravel())
    num = np.linalg.norm((x - ref).ravel())
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / den)


def cosine(x, ref) -> float:
    x = np.asarray(x, np.float64).ravel()
    ref = np.asarray(ref, np.float64).ravel()
    den = np.linalg.norm(x) * np.linalg.norm(ref)
    if den == 0:
        return 1.0 if np.array_equal(x, ref) else 0.0
    return float(x @ ref / den)


def max_abs(x, ref) -> float:
    return float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(ref, np.float64))))
