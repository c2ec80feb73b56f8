"""Budget arithmetic of a declared policy: a budget (bytes per token, a fraction of a float16 cache's,
kept tokens, or ``{"as": preset}``) turned into what a selection keeps.

- :func:`as_bytes`: ``{"as": preset}`` as that preset's bytes per token at the segment's end;
- :func:`budget_keep`: a scored (or sink_window) selection's kept count per (layer, KV head), the
  largest whose bytes at the segment's end do not exceed the budget; a pyramid's mean count and a
  kept set stored quantized (or a quantized rest) through their own searches;
- :func:`selective_budget`: the selective rule's share of sparse pairs and their kept count;
- :func:`scored_bytes`, :func:`stored_bytes`: the closed-form whole-cache bytes those searches price.

:func:`~testbed.policies.compose.declared` calls them; the audit states the same arithmetic on its own
(``audit_checks/live_policies.py``: ``as_bytes``, ``pyramid``, ``selective_budget``).
"""

from __future__ import annotations

from .policy import (HEADER_BYTES, SCORED_TOKEN_EXTRA, Policy, dense_pair_bytes, pyramid_keep, scored_held,
                     selective_bytes)
from .presets import preset

__all__ = ["BUDGET_KINDS", "as_bytes", "scored_bytes", "budget_keep", "selective_budget", "stored_bytes"]


# a budget names one of these: bytes per token of the whole cache, that as a fraction of a float16
# cache's, or the kept tokens per (layer, KV head) directly
BUDGET_KINDS = ("bytes_per_token", "fp16_fraction", "tokens")
# {"as": preset}: the bytes per token of that preset (at the protocol's R, G, W, S) at the segment's end


def as_bytes(given, budget: dict, *, window: int, group: int, evict_window: int, where: str = "budget"):
    """A budget ``{"as": name}`` as ``{"bytes_per_token": b}``: b the whole-cache bytes per token of the
    preset ``name`` (a policy of every token: a uniform, mixed or heavy-hitter middle, at the protocol's
    R and G) at the end of the segment (``prefill + steps`` tokens), for the study's model; any other
    budget unchanged."""
    if not (isinstance(given, dict) and len(given) == 1 and "as" in given):
        return given
    arm = given["as"]
    try:
        pol = preset(arm, window=window, group=group, evict_window=evict_window) if isinstance(arm, str) else None
    except ValueError:
        pol = None
    if pol is None or pol.scored or pol.evicts or pol.oracle:
        raise ValueError(f"{where}.as: expected the name of a preset that keeps every token (a uniform, mixed or "
                         f"heavy-hitter middle), got {arm!r}")
    if budget.get("layers") is None:
        raise ValueError(f"{where}.as: a budget in bytes is derived for a model of the study's known models without "
                         "sliding layers (their bytes are the audit's); give {\"tokens\": K} for this one")
    n = budget["prefill"] + budget["steps"]
    return {"bytes_per_token": pol.cache_bytes(n, budget["layers"], budget["kv_heads"], budget["head_dim"]) / n}


def scored_bytes(keep: int, mode: str, prefill: int, steps: int, layers: int, kv_heads: int, head_dim: int,
                 extra: int = SCORED_TOKEN_EXTRA, layer_keep: tuple = ()) -> int:
    """Whole-cache bytes of a scored selection at the end of a segment (``prefill + steps`` tokens):
    per layer the header and, per KV head and held token, float32 K and V and ``extra`` bytes (an
    int32 index and a float32 score; 0 for a sink_window selection, which stores neither); with
    ``layer_keep``, each layer holding its own kept count."""
    per = layer_keep if layer_keep else (keep,) * layers
    if len(per) != layers:
        raise ValueError(f"layer_keep has {len(per)} counts for {layers} layers")
    return sum(HEADER_BYTES + kv_heads * scored_held(k, mode, prefill + steps, prefill) * (2 * head_dim * 4 + extra)
               for k in per)


def budget_keep(budget, *, mode: str, prefill: int, steps: int, layers: int, kv_heads: int, head_dim: int,
                tolerance: float = 0.01, where: str = "budget", extra: int = SCORED_TOKEN_EXTRA,
                pyramid_beta: int | None = None, pyramid_window: int = 0, store: Policy | None = None,
                rest: Policy | None = None) -> int:
    """The kept count per (layer, KV head) that lands a scored selection within ``tolerance`` below
    ``budget`` at the end of the segment: the largest whose bytes do not exceed it. ``ValueError``
    when no count does (the budget is below one token, above every token, or between two counts).

    With ``pyramid_beta`` (a pyramid, prefill mode): the largest mean ``keep`` whose per-layer counts
    (:func:`~testbed.policies.policy.pyramid_keep` at ``pyramid_beta`` and ``pyramid_window``)
    summed over the layers, with every decode token at every layer, do not exceed the budget: the
    budget is the whole cache's, however its layers share it.

    With ``store`` (a prefill-mode selection whose kept tokens that uniform policy stores): the
    largest count whose held tokens at the end, stored so (:meth:`Policy.layer_bytes` of ``store``)
    with ``extra`` bytes each beside, do not exceed it."""
    if not isinstance(budget, dict) or len(budget) != 1 or next(iter(budget)) not in BUDGET_KINDS:
        raise ValueError(f"{where}: give exactly one of {list(BUDGET_KINDS)}, got {budget!r}")
    (kind, value), = budget.items()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{where}.{kind}: expected a positive number, got {value!r}")
    n = prefill + steps
    per_token = 2 * head_dim * 4 + extra
    if kind == "tokens":
        if not isinstance(value, int):
            raise ValueError(f"{where}.tokens: expected an integer, got {value!r}")
        return value
    if layers is None:
        raise ValueError(f"{where}.{kind}: a budget in bytes is derived for a model of the study's known models "
                         "without sliding layers (their bytes are the audit's); give {\"tokens\": K} for this one")
    target = value * n if kind == "bytes_per_token" else value * n * layers * 2 * kv_heads * head_dim * 2
    if store is not None or rest is not None:
        return _stored_budget_keep(target, store, prefill=prefill, steps=steps, layers=layers, kv_heads=kv_heads,
                                   head_dim=head_dim, tolerance=tolerance, where=where, extra=extra, rest=rest)
    if pyramid_beta is not None:
        return _pyramid_budget_keep(target, prefill=prefill, steps=steps, layers=layers, kv_heads=kv_heads,
                                    head_dim=head_dim, tolerance=tolerance, where=where, extra=extra,
                                    beta=pyramid_beta, window=pyramid_window)
    held = int((target / layers - HEADER_BYTES) // (kv_heads * per_token))  # tokens per (layer, KV head) at the end
    keep = held if mode == "online" else held - steps
    if held < 1 or keep < 1 or (mode == "prefill" and keep > prefill) or held > n:
        fp16 = layers * 2 * kv_heads * head_dim * 2
        raise ValueError(f"{where}: {target / n:,.1f} bytes per token ({target / n / fp16:.4f} of float16's) is out of "
                         f"reach of a {mode} scored selection at {n} tokens: it would hold {held} tokens per (layer, KV "
                         f"head) of {per_token} B each"
                         + (f", {steps} of them the decode steps it keeps" if mode == "prefill" else ""))
    got = scored_bytes(keep, mode, prefill, steps, layers, kv_heads, head_dim, extra)
    if (target - got) / target > tolerance:
        raise ValueError(f"{where}: the nearest kept count ({keep}) lands {(target - got) / target:.2%} below the "
                         f"budget at {n} tokens, more than the tolerance {tolerance:.2%}")
    return keep


def selective_budget(budget, keep: int, *, prefill: int, steps: int, layers: int, kv_heads: int, head_dim: int,
                     tolerance: float = 0.01, where: str = "budget", dense: Policy | None = None) -> tuple[float, int]:
    """``(sparse_share, keep)`` of a selective selection (prefill mode) whose sparse pairs keep at least
    ``keep`` prefill tokens, within ``tolerance`` below ``budget`` (bytes per token or a fraction of
    float16's) at the segment's end (``n = prefill + steps`` tokens).

    Its bytes with m of the ``pairs = layers x kv_heads`` pairs sparse are
    :func:`~testbed.policies.policy.selective_bytes`: a dense pair holds n tokens of 8 D bytes, a sparse
    one ``h = min(keep, prefill) + steps`` tokens of 8 D + 8 (its index and score), and each pair has a
    class byte. In tokens alone (a budget f of a float32 cache's, a sparse pair keeping rho = h / n of
    its tokens) the share is s = (1 - f) / (1 - rho); here m is the fewest sparse pairs whose bytes fit,
    ``m = ceil((pairs n 8D + layers header + pairs - B) / (n 8D - h (8D + 8)))``. With ``dense`` (the
    dense pairs' uniform storage, e.g. KIVI int4) a dense pair costs that storage's bytes for its n
    tokens instead of n 8D (:func:`~testbed.policies.policy.dense_pair_bytes`). The slack left by
    rounding m up goes back to the sparse pairs: ``keep`` is raised to the largest count (at most the
    prefill) that still fits. ``sparse_share = m / pairs`` (``Policy.sparse_count`` rounds it back to m).
    ``ValueError`` when the budget is out of reach (below every pair sparse, at or above every pair
    dense) or lands more than ``tolerance`` below it."""
    if not isinstance(budget, dict) or len(budget) != 1 or next(iter(budget)) not in ("bytes_per_token", "fp16_fraction"):
        raise ValueError(f"{where}: the selective rule's budget is bytes_per_token, fp16_fraction or as, got {budget!r}")
    (kind, value), = budget.items()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{where}.{kind}: expected a positive number, got {value!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= prefill:
        raise ValueError(f"{where}: the sparse pairs' keep must be an integer in [1, {prefill}], got {keep!r}")
    n, pairs = prefill + steps, layers * kv_heads
    target = value * n if kind == "bytes_per_token" else value * n * layers * 2 * kv_heads * head_dim * 2

    def cost(m: int, k: int) -> int:
        return selective_bytes(m, k, n, prefill, layers, kv_heads, head_dim, dense)

    sparse_pair = scored_held(keep, "prefill", n, prefill) * (2 * head_dim * 4 + SCORED_TOKEN_EXTRA)
    dense_pair = dense_pair_bytes(dense, n, head_dim)
    if sparse_pair >= dense_pair:
        raise ValueError(f"{where}: at keep {keep} a sparse pair costs {sparse_pair:,} bytes at {n} tokens, a dense pair "
                         f"{dense_pair:,}: making pairs sparse saves nothing, so no share of sparse pairs meets a budget "
                         "(give a smaller keep, or store the dense pairs wider)")
    m = next((m for m in range(pairs + 1) if cost(m, keep) <= target), None)
    if m is None or m == 0:
        fp16 = layers * 2 * kv_heads * head_dim * 2
        raise ValueError(f"{where}: {target / n:,.1f} bytes per token ({target / n / fp16:.4f} of float16's) is out of "
                         f"reach of the selective rule at keep {keep} over {pairs} pairs: every pair sparse costs "
                         f"{cost(pairs, keep) / n:,.1f}, every pair dense {cost(0, keep) / n:,.1f} per token")
    k = max(x for x in range(keep, prefill + 1) if cost(m, x) <= target)
    got = cost(m, k)
    if (target - got) / target > tolerance:
        raise ValueError(f"{where}: {m} sparse pairs keeping {k} land {(target - got) / target:.2%} below the budget at "
                         f"{n} tokens, more than the tolerance {tolerance:.2%}")
    share = m / pairs
    if round(share * pairs) != m:
        raise RuntimeError(f"{where}: the share {share!r} of {pairs} pairs does not round back to {m}")
    return share, k


def stored_bytes(keep: int, store: Policy | None, *, prefill: int, steps: int, layers: int, kv_heads: int,
                 head_dim: int, extra: int = SCORED_TOKEN_EXTRA, rest: Policy | None = None) -> int:
    """Whole-cache bytes at the end of a segment of a prefill-mode selection keeping ``keep`` prefill
    tokens whose held tokens ``store`` stores (one header per layer; None: float32), with ``extra`` bytes
    per held token and KV head beside (index and score); with ``rest``, the prefill tokens not kept
    stored by that policy as a sequence of their own (MiKV), its header not counted."""
    held = scored_held(keep, "prefill", prefill + steps, prefill)
    kept = (store.layer_bytes(held, kv_heads, head_dim) if store is not None
            else HEADER_BYTES + kv_heads * held * 2 * head_dim * 4)
    other = rest.layer_bytes(max(0, prefill - keep), kv_heads, head_dim) - HEADER_BYTES if rest is not None else 0
    return layers * (kept + kv_heads * held * extra + other)


def _stored_budget_keep(target: float, store: Policy | None, *, prefill: int, steps: int, layers: int, kv_heads: int,
                        head_dim: int, tolerance: float, where: str, extra: int, rest: Policy | None = None) -> int:
    """:func:`budget_keep` of a kept set stored by ``store`` (or a quantized ``rest``): the largest count of at
    most the prefill whose bytes fit ``target``."""
    n = prefill + steps

    def cost(k: int) -> int:
        return stored_bytes(k, store, prefill=prefill, steps=steps, layers=layers, kv_heads=kv_heads,
                            head_dim=head_dim, extra=extra, rest=rest)

    # the bytes are not monotone in the count: a storage's flush packs G float32 tokens, and a rest's
    # float32 remainder (fewer than G tokens) comes and goes with the count: every count is tried
    lo = next((k for k in range(prefill, 0, -1) if cost(k) <= target), 0)
    if lo < 1 or (lo == prefill and (target - cost(prefill)) / target > tolerance):
        fp16 = layers * 2 * kv_heads * head_dim * 2
        raise ValueError(f"{where}: {target / n:,.1f} bytes per token ({target / n / fp16:.4f} of float16's) is out of "
                         f"reach of a prefill selection stored as {(store or rest).middle} at {n} tokens (keeping 1 to {prefill} "
                         f"prefill tokens costs {cost(1) / n:,.1f} to {cost(prefill) / n:,.1f} per token)")
    got = cost(lo)
    if (target - got) / target > tolerance:
        raise ValueError(f"{where}: the nearest kept count ({lo}) lands {(target - got) / target:.2%} below the "
                         f"budget at {n} tokens, more than the tolerance {tolerance:.2%}")
    return lo


def _pyramid_budget_keep(target: float, *, prefill: int, steps: int, layers: int, kv_heads: int, head_dim: int,
                         tolerance: float, where: str, extra: int, beta: int, window: int) -> int:
    """:func:`budget_keep` of a pyramid: the largest mean kept count whose per-layer counts fit the
    whole-cache ``target`` bytes (a prefill-mode selection: every decode token kept at every layer)."""
    n = prefill + steps
    per_token = 2 * head_dim * 4 + extra
    # kept prefill tokens summed over the layers, per KV head, that the bytes pay for
    total = int((target - layers * HEADER_BYTES) // (kv_heads * per_token)) - layers * steps

    def spent(k: int) -> int:
        return sum(pyramid_keep(k, prefill, layers, beta, window))

    # each layer's count is within one half of its unrounded value, which sums to layers x keep: a mean
    # above total / layers + 1/2 never fits, and one below total / layers - 1/2 always does
    fits = [k for k in range(max(1, total // layers - layers - 2), min(prefill, total // layers + layers + 2) + 1)
            if spent(k) <= total]
    keep = max(fits, default=0)
    if keep < 1:
        fp16 = layers * 2 * kv_heads * head_dim * 2
        raise ValueError(f"{where}: {target / n:,.1f} bytes per token ({target / n / fp16:.4f} of float16's) is out of "
                         f"reach of a prefill pyramid at {n} tokens: it would hold {total} prefill tokens per KV head "
                         f"over {layers} layers of {per_token} B each, beside the {steps} decode steps each layer keeps")
    got = scored_bytes(keep, "prefill", prefill, steps, layers, kv_heads, head_dim, extra,
                       layer_keep=pyramid_keep(keep, prefill, layers, beta, window))
    if (target - got) / target > tolerance:
        raise ValueError(f"{where}: the nearest pyramid (mean kept count {keep}) lands {(target - got) / target:.2%} "
                         f"below the budget at {n} tokens, more than the tolerance {tolerance:.2%}")
    return keep
