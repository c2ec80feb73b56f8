"""Metrics of attention outputs and attention probabilities.

Output error (relative L2, cosine, max-abs) follows the convention of the seed studies: one
number per input over the flattened output, ``||O' - O|| / ||O||``. Probability metrics are per
query row: total variation ``TV(P, P') = 1/2 sum |P - P'|``, argmax agreement, region mass (the
probability a row puts on a span of keys) and the numerical-zero rate (keys with ``p > 0`` in
the reference that are exactly 0 after quantization).

The second half holds the attention-topology metrics of the video KV-cache attention study
(docs/studies.md) (docs/studies.md) -- effective support ``exp(H)/Sk``, top-k % mass, strict zeros of the float32
softmax, region and history mass, key-block masses, top-block sets and their Jaccard overlap --
and `observe`, which applies them to a whole Case one tile of queries at a time (`score_tiles`),
so that no more than one tile of scores is ever alive. `paired_wilcoxon` compares two arms
across independent units (seeds, prompts), never across rows of one unit.
"""

from __future__ import annotations

import bisect as _bisect
import math as _math
import random as _random

import torch

__all__ = ["rel_l2", "cosine", "max_abs", "OutputError", "total_variation", "argmax_agreement", "region_mass",
           "numerical_zero_rate"]


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float64)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref||_2 / ||ref||_2`` over all elements (0 when both are zero)."""
    x, ref = _f64(x), _f64(ref)
    den = torch.linalg.vector_norm(ref)
    num = torch.linalg.vector_norm(x - ref)
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / den)


def cosine(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors (1 when both are zero)."""
    x, ref = _f64(x).flatten(), _f64(ref).flatten()
    den = torch.linalg.vector_norm(x) * torch.linalg.vector_norm(ref)
    if den == 0:
        return 1.0 if torch.equal(x, ref) else 0.0
    return float(torch.dot(x, ref) / den)


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((_f64(x) - _f64(ref)).abs().max())


class OutputError:
    """`rel_l2`, `cosine` and `max_abs` of an output against its reference, accumulated over tiles
    of rows (``add`` each tile's pair in turn): the norms combine as ``hypot`` of the tiles' norms
    (a sum of squares without overflow) and the dot product as a sum, so that one tile gives the
    whole-tensor functions' values bit for bit and any tiling the same values to rounding."""

    def __init__(self):
        self._num: list[float] = []
        self._den: list[float] = []
        self._nx: list[float] = []
        self._dot = 0.0
        self._max = 0.0
        self._equal = True

    def add(self, x: torch.Tensor, ref: torch.Tensor) -> None:
        x, ref = _f64(x), _f64(ref)
        self._num.append(float(torch.linalg.vector_norm(x - ref)))
        self._den.append(float(torch.linalg.vector_norm(ref)))
        self._nx.append(float(torch.linalg.vector_norm(x)))
        self._dot += float(torch.dot(x.flatten(), ref.flatten()))
        m = float((x - ref).abs().max())
        self._max = m if (m != m or m > self._max) else self._max  # a NaN stays, as in max_abs
        self._equal = self._equal and torch.equal(x, ref)

    @property
    def rel_l2(self) -> float:
        num, den = _math.hypot(*self._num), _math.hypot(*self._den)
        if den == 0:
            return 0.0 if num == 0 else float("inf")
        return num / den

    @property
    def cosine(self) -> float:
        den = _math.hypot(*self._nx) * _math.hypot(*self._den)
        if den == 0:
            return 1.0 if self._equal else 0.0
        return self._dot / den

    @property
    def max_abs(self) -> float:
        return self._max


def total_variation(p: torch.Tensor, p_ref: torch.Tensor) -> torch.Tensor:
    """Per-row TV over the last axis."""
    return 0.5 * (_f64(p) - _f64(p_ref)).abs().sum(dim=-1)


def argmax_agreement(p: torch.Tensor, p_ref: torch.Tensor) -> torch.Tensor:
    """Per-row boolean: the largest key is the same (first index on ties)."""
    return p.argmax(dim=-1) == p_ref.argmax(dim=-1)


def region_mass(p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Per-row probability mass on keys ``[start, stop)``."""
    return _f64(p)[..., start:stop].sum(dim=-1)


def numerical_zero_rate(p_hat: torch.Tensor, p_ref: torch.Tensor) -> torch.Tensor:
    """Per-row share of reference-positive keys that are exactly zero after quantization."""
    pos = p_ref > 0
    zeros = pos & (p_hat == 0)
    return zeros.sum(dim=-1).to(torch.float64) / pos.sum(dim=-1).clamp(min=1).to(torch.float64)


# --------------------------------------------------------------------------------------------
# Attention topology (observational metrics of the video KV-cache attention study,
# docs/studies.md): effective support, top-k mass, strict zeros, region mass, block predictability.
#
# Row functions take probabilities ``p [..., Tk]`` (each row summing to 1 over its visible keys,
# 0 elsewhere) and, where the row's visible-key count matters, ``visible [..., Tk]`` or
# ``visible_keys [...]``. `observe` drives them over a whole Case one tile of queries at a time.
# --------------------------------------------------------------------------------------------

__all__ += ["holm", "entropy", "effective_support", "top_mass", "strict_zero_rate", "block_masses", "top_blocks",
            "block_size", "head_set_fit",
            "jaccard", "jaccard_nulls", "history_span", "region_masses", "quantiles", "summary", "paired_wilcoxon",
            "frame_size", "score_tiles", "observe", "Observation", "TOP_PERCENTS"]

TOP_PERCENTS = (1, 5, 10)
# A cumulative mass counts as reaching the coverage target when it is within this of it, so that
# float64 summation order cannot flip the membership of a top-block set (the audit uses the same).
COVERAGE_EPS = 1e-9


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) per row; ``0 log 0 = 0``."""
    p = _f64(p)
    logp = torch.where(p > 0, torch.log(torch.where(p > 0, p, torch.ones_like(p))), torch.zeros_like(p))
    return -(p * logp).sum(dim=-1)


def effective_support(p: torch.Tensor, visible_keys: torch.Tensor) -> torch.Tensor:
    """Entropy-equivalent support ``exp(H) / Sk`` per row: 1 for a uniform row over its ``Sk``
    visible keys, ``1 / Sk`` for a one-hot row."""
    return torch.exp(entropy(p)) / _f64(visible_keys)


def top_counts(visible_keys: torch.Tensor, percent: int) -> torch.Tensor:
    """``ceil(percent * Sk / 100)`` keys (at least 1), in integer arithmetic."""
    sk = visible_keys.to(torch.int64)
    return torch.clamp((percent * sk + 99) // 100, min=1)


def top_mass(p: torch.Tensor, visible_keys: torch.Tensor, percents=TOP_PERCENTS) -> dict[int, torch.Tensor]:
    """Mass carried by the top ``percent`` % of each row's visible keys, per percent: the running sum
    of the row's probabilities in descending order, read at the count. Only the largest counts'
    worth of each row is ordered (``topk``: the same values in the same order as the first ones of
    a full descending sort, and a running sum reads only what precedes it, so the same sums)."""
    idx = {pc: (top_counts(visible_keys, pc) - 1).clamp(max=p.shape[-1] - 1) for pc in percents}
    k = int(max((int(i.max()) for i in idx.values()), default=-1)) + 1 if p.numel() else p.shape[-1]
    srt = torch.topk(_f64(p), k, dim=-1, largest=True, sorted=True).values
    csum = torch.cumsum(srt, dim=-1)
    return {pc: torch.gather(csum, -1, i.unsqueeze(-1)).squeeze(-1) for pc, i in idx.items()}


def strict_zero_rate(p: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """Share of each row's visible keys whose probability is exactly 0 (structural zeros)."""
    zero = p == 0
    if visible is None:
        return zero.sum(dim=-1).to(torch.float64) / p.shape[-1]
    vis = visible.expand_as(zero)
    return (zero & vis).sum(dim=-1).to(torch.float64) / vis.sum(dim=-1).clamp(min=1).to(torch.float64)


def block_masses(p: torch.Tensor, block: int) -> torch.Tensor:
    """Row mass per contiguous key block of ``block`` keys (the last block may be shorter)."""
    p = _f64(p)
    tk = p.shape[-1]
    pad = (-tk) % block
    if pad:
        p = torch.cat([p, p.new_zeros(*p.shape[:-1], pad)], dim=-1)
    return p.reshape(*p.shape[:-1], -1, block).sum(dim=-1)


def top_blocks(masses: torch.Tensor, coverage: float) -> torch.Tensor:
    """Boolean set per row: the fewest blocks, largest first (ties: lower index first), whose
    mass reaches ``coverage`` of the row's total -- the blocks a block-sparse kernel would keep."""
    m = _f64(masses)
    order = torch.sort(m, dim=-1, descending=True, stable=True)
    csum = torch.cumsum(order.values, dim=-1)
    target = coverage * m.sum(dim=-1, keepdim=True) - COVERAGE_EPS
    needed = (csum < target).sum(dim=-1, keepdim=True) + 1
    rank_in = torch.arange(m.shape[-1], device=m.device).expand_as(m) < needed.clamp(max=m.shape[-1])
    out = torch.zeros_like(rank_in)
    out.scatter_(-1, order.indices, rank_in)
    return out


def jaccard(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row Jaccard overlap ``|a & b| / |a | b|`` of boolean sets (1 for two empty sets)."""
    inter = (a & b).sum(dim=-1).to(torch.float64)
    union = (a | b).sum(dim=-1).to(torch.float64)
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


def history_span(layout) -> tuple[int, int] | None:
    """Keys before the ``current`` region (the cached history), or None without a current region."""
    for r in layout:
        if r.name == "current":
            return (0, r.start)
    return None


def region_masses(p: torch.Tensor, layout) -> dict[str, torch.Tensor]:
    """Per-row mass of every region of the layout, plus ``history`` when there is a current region."""
    out = {r.name: region_mass(p, r.start, r.stop) for r in layout}
    hist = history_span(layout)
    if hist is not None:
        out["history"] = region_mass(p, *hist)
    return out


def quantiles(x, qs=(0.1, 0.25, 0.5, 0.75, 0.9)) -> dict[str, float]:
    """Named quantiles (linear interpolation) of the finite values of ``x``."""
    t = _f64(torch.as_tensor(x)).flatten()
    t = t[torch.isfinite(t)]
    if t.numel() == 0:
        return {f"q{round(100 * q):02d}": float("nan") for q in qs}
    vals = torch.quantile(t, torch.tensor(qs, dtype=torch.float64))
    return {f"q{round(100 * q):02d}": float(v) for q, v in zip(qs, vals)}


def summary(x) -> dict[str, float]:
    """Mean, median and the 10/25/75/90 % quantiles of the finite values of ``x``."""
    t = _f64(torch.as_tensor(x)).flatten()
    t = t[torch.isfinite(t)]
    out = {"mean": float(t.mean()) if t.numel() else float("nan")}
    q = quantiles(t)
    out["median"] = q.pop("q50")
    out.update(q)
    return out


def paired_wilcoxon(x, y) -> dict:
    """Two-sided Wilcoxon signed-rank test of paired per-unit values (units: seeds or prompts,
    never rows within one of them). Returns n, the median of ``x - y``, the statistic and p
    (None when fewer than two non-zero differences make the test meaningless)."""
    from scipy import stats

    a = [float(v) for v in x]
    b = [float(v) for v in y]
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length ({len(a)} vs {len(b)})")
    pairs = [(u, w) for u, w in zip(a, b) if _math.isfinite(u) and _math.isfinite(w)]
    diffs = [u - w for u, w in pairs]
    nonzero = [d for d in diffs if d != 0]
    med = float(torch.quantile(torch.tensor(diffs, dtype=torch.float64), 0.5)) if diffs else float("nan")
    if len(nonzero) < 2:
        return {"n": len(pairs), "median_diff": med, "statistic": None, "p": None}
    res = stats.wilcoxon([u for u, _ in pairs], [w for _, w in pairs], alternative="two-sided", zero_method="wilcox")
    return {"n": len(pairs), "median_diff": med, "statistic": float(res.statistic), "p": float(res.pvalue)}


def holm(ps) -> list:
    """Holm's step-down adjustment of a family of p-values (None stays None and is not counted in
    the family): the i-th smallest of m becomes max over j <= i of min(1, (m - j + 1) p_(j)). It
    controls the family-wise error rate with no assumption about how the tests depend on each other."""
    idx = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])
    m = len(idx)
    out = [None] * len(ps)
    running = 0.0
    for j, i in enumerate(idx):
        running = max(running, min(1.0, (m - j) * float(ps[i])))
        out[i] = running
    return out


def frame_size(case, block_tokens: int) -> int:
    """Key/query block used for heatmaps and block predictability: the latent frame when the
    Case has ``tokens_per_frame``, else ``block_tokens`` tokens."""
    return int(case.tokens_per_frame) if case.tokens_per_frame else int(block_tokens)


def score_tiles(q: torch.Tensor, k: torch.Tensor, query_positions: torch.Tensor, causal: bool, max_scores: int):
    """Yield ``(kv_head, heads, queries, scores, visible)`` tiles of scaled float64 logits.

    One KV head at a time (GQA: its group of query heads) and a slice of queries, so that a tile
    holds at most about ``max_scores`` scores: memory stays bounded for any record size.
    ``scores [g, c, Tk]`` are unmasked; ``visible [c, Tk]`` is the causal mask or None.
    """
    h, tq, d = q.shape
    hkv, tk, _ = k.shape
    g = h // hkv
    step = max(1, int(max_scores) // (g * tk))
    scale = 1.0 / _math.sqrt(d)
    ar = torch.arange(tk, device=q.device)
    for j in range(hkv):
        kj = k[j].to(torch.float64)
        heads = slice(j * g, (j + 1) * g)
        for s in range(0, tq, step):
            qs = slice(s, min(tq, s + step))
            sc = torch.matmul(q[heads, qs].to(torch.float64), kj.transpose(0, 1)) * scale
            vis = (ar.unsqueeze(0) <= query_positions[qs].to(q.device).unsqueeze(1)) if causal else None
            yield j, heads, qs, sc, vis


def _masked_softmax(s: torch.Tensor, vis: torch.Tensor | None) -> torch.Tensor:
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    return torch.softmax(s, dim=-1)


class Observation:
    """Per-row metrics of one Case (``[H, Tq]`` float64 tensors in ``rows``), per-head temporal
    heatmaps ``heatmap [H, query blocks, key blocks]`` (each row sums to 1) and the top-block sets'
    Jaccard overlaps between neighbouring queries and neighbouring query blocks."""

    def __init__(self, rows: dict, heatmap: torch.Tensor, query_blocks: list[int], frame: int,
                 jaccard_query: torch.Tensor, jaccard_block: torch.Tensor, block_set_size: torch.Tensor,
                 null_pair: torch.Tensor | None = None, null_shuffled: torch.Tensor | None = None,
                 block: int | None = None, head_set: dict | None = None):
        self.null_pair = null_pair          # [H, Tq-1]: J(query i, a random same-head query), NaN where none
        self.null_shuffled = null_shuffled  # [H, Tq-1]: E[J(query i, a random block set of query i-1's size)]
        self.block = frame if block is None else block  # key block of the top-block sets (a frame or a tile of one)
        self.head_set = head_set            # {name: [H, Tq]}: the head's other queries' block set (`head_set_fit`)
        self.rows = rows
        self.heatmap = heatmap
        self.query_blocks = query_blocks
        self.frame = frame
        self.jaccard_query = jaccard_query
        self.jaccard_block = jaccard_block
        self.block_set_size = block_set_size


def block_size(case, block_tokens: int, spatial_tiles: int = 1) -> int:
    """Key block of the top-block sets: a latent frame split into ``spatial_tiles`` tiles of
    consecutive tokens (frame x spatial tile, as the seed study's LF x spatial blocks) when the
    Case has ``tokens_per_frame``, else ``block_tokens`` tokens."""
    frame = frame_size(case, block_tokens)
    if not case.tokens_per_frame or spatial_tiles == 1:
        return frame
    if frame % spatial_tiles:
        raise ValueError(f"{case.id}: spatial_tiles={spatial_tiles} does not divide {frame} tokens per frame")
    return frame // spatial_tiles


def head_set_fit(bm: torch.Tensor, sets: torch.Tensor, visible_blocks: list[int], coverage: float) -> dict:
    """How well a head's block set predicts each query's: per head ``h`` and query ``i``, the head
    set is the top-block set (``coverage``) of the mean block mass of the head's *other* queries,
    over the blocks query ``i`` sees (leave-one-out, so a query never predicts itself). Returns
    ``{name: [H, Tq]}``: ``jaccard`` J(query's set, head set) and ``mass`` (the query's mass on the
    head set: what a block-sparse kernel keeping the head set keeps), each beside its null for a
    uniformly random set of as many of the visible blocks (``jaccard_null`` in closed form,
    ``mass_null`` = size / visible blocks), and ``size`` of the head set. NaN with one query."""
    h, tq, nb = bm.shape
    out = {k: torch.full((h, tq), float("nan"), dtype=torch.float64)
           for k in ("jaccard", "jaccard_null", "mass", "mass_null", "size")}
    if tq < 2:
        return out
    nvb = torch.tensor(visible_blocks, dtype=torch.int64)
    seen = torch.arange(nb).unsqueeze(0) < nvb.unsqueeze(1)                   # [Tq, NB]
    for hh in range(h):
        loo = (bm[hh].sum(dim=0, keepdim=True) - bm[hh]) / (tq - 1)             # [Tq, NB]
        hs = top_blocks(torch.where(seen, loo, torch.zeros_like(loo)), coverage) & seen
        out["jaccard"][hh] = jaccard(sets[hh], hs)
        out["mass"][hh] = torch.where(hs, bm[hh], torch.zeros_like(bm[hh])).sum(dim=-1)
        size = hs.sum(dim=-1)
        out["size"][hh] = size.to(torch.float64)
        out["mass_null"][hh] = size.to(torch.float64) / nvb.to(torch.float64)
        a = sets[hh].sum(dim=-1).tolist()
        out["jaccard_null"][hh] = torch.tensor([_expected_jaccard(a[i], a[i], int(size[i]), int(nvb[i]))
                                                for i in range(tq)], dtype=torch.float64)
    return out


def observe(case, *, block_tokens: int = 16, coverage: float = 0.9, percents=TOP_PERCENTS,
            max_scores: int = 1 << 21, spatial_tiles: int = 1) -> Observation:
    """Observational metrics of a Case's float64 reference attention, computed tile by tile.

    Per row (query x head): ``visible_keys``; ``support = exp(H)/Sk``; ``top{1,5,10}`` mass;
    ``zero_rate`` of the float32 softmax (logits rounded to float32, softmax in float32);
    ``{region}_mass`` for every region and ``history_mass`` (keys before ``current``); the mass on
    each key block accumulated into the temporal heatmap (query block x key block, where a query's
    block is ``query_position // frame``). Block predictability: the top-block set of each row
    (fewest blocks carrying ``coverage`` of its mass) against the previous query of the same head
    (``jaccard_query [H, Tq-1]``), and the set of each query block's mean block mass against the
    previous query block (``jaccard_block [H, QB-1]``). The top-block sets of rows use key blocks
    of `block_size` (a frame, or a spatial tile of one); the heatmap and the query blocks use frames.
    ``head_set``: `head_set_fit`.
    """
    h, tq = case.heads, case.q.shape[1]
    tk = case.keys
    frame = frame_size(case, block_tokens)
    block = block_size(case, block_tokens, spatial_tiles)
    nkb = -(-tk // frame)
    nbb = -(-tk // block)
    qblock = (case.query_positions.to(torch.int64) // frame)
    qblocks = sorted(set(qblock.tolist()))
    qb_index = torch.tensor([qblocks.index(b) for b in qblock.tolist()], dtype=torch.int64)
    names = [f"top{pc}" for pc in percents]
    regions = [r.name for r in case.layout]
    hist = history_span(case.layout)
    keys = ["visible_keys", "support", *names, "zero_rate", *[f"{r}_mass" for r in regions]]
    if hist is not None:
        keys.append("history_mass")
    rows = {key: torch.empty(h, tq, dtype=torch.float64) for key in keys}
    heat = torch.zeros(h, len(qblocks), nkb, dtype=torch.float64)
    counts = torch.bincount(qb_index, minlength=len(qblocks)).to(torch.float64)
    jq = torch.empty(h, max(tq - 1, 0), dtype=torch.float64)
    set_size = torch.empty(h, tq, dtype=torch.float64)
    all_sets = torch.zeros(h, tq, nbb, dtype=torch.bool)
    all_bm = torch.zeros(h, tq, nbb, dtype=torch.float64)
    prev = {}
    for _, heads, qs, s, vis in score_tiles(case.q, case.k, case.query_positions, case.causal, max_scores):
        p = _masked_softmax(s, vis)
        nvis = vis.sum(dim=-1).to(torch.float64).expand(p.shape[:-1]) if vis is not None else \
            torch.full(p.shape[:-1], float(tk), dtype=torch.float64)
        rows["visible_keys"][heads, qs] = nvis
        rows["support"][heads, qs] = effective_support(p, nvis)
        for pc, m in top_mass(p, nvis, percents).items():
            rows[f"top{pc}"][heads, qs] = m
        p32 = _masked_softmax(s.to(torch.float32), vis)
        rows["zero_rate"][heads, qs] = strict_zero_rate(p32, vis)
        for name, m in region_masses(p, case.layout).items():
            rows[f"{name}_mass"][heads, qs] = m
        fm = block_masses(p, frame)
        heat[heads].index_add_(1, qb_index[qs], fm)
        bm = fm if block == frame else block_masses(p, block)
        sets = top_blocks(bm, coverage)
        set_size[heads, qs] = sets.sum(dim=-1).to(torch.float64)
        all_sets[heads, qs] = sets
        all_bm[heads, qs] = bm
        for gi, hh in enumerate(range(heads.start, heads.stop)):
            cur = sets[gi]
            if qs.start > 0:
                cur_prev = torch.cat([prev[hh].unsqueeze(0), cur], dim=0)
                jq[hh, qs.start - 1:qs.stop - 1] = jaccard(cur_prev[1:], cur_prev[:-1])
            elif cur.shape[0] > 1:
                jq[hh, : qs.stop - 1] = jaccard(cur[1:], cur[:-1])
            prev[hh] = cur[-1]
    heat = heat / counts.view(1, -1, 1)
    bsets = top_blocks(heat, coverage)
    jb = jaccard(bsets[:, 1:], bsets[:, :-1]) if len(qblocks) > 1 else torch.empty(h, 0, dtype=torch.float64)
    visible_blocks = [-(-int(n) // block) for n in rows["visible_keys"][0].tolist()]
    pair, shuffled = jaccard_nulls(all_sets, visible_blocks, case.id)
    fit = head_set_fit(all_bm, all_sets, visible_blocks, coverage)
    return Observation(rows, heat, qblocks, frame, jq, jb, set_size, pair, shuffled, block, fit)


def jaccard_nulls(sets: torch.Tensor, visible_blocks: list[int], case_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two nulls for the neighbouring-query Jaccard ``J(set_i, set_{i-1})`` (``sets [H, Tq, B]``).

    - pair: ``J(set_i, set_j)`` with ``j`` a random query of the same head that sees the same key
      blocks as ``i`` and is not ``i`` or a neighbour of it, drawn with
      ``random.Random(f"jaccard-null:{case_id}:{head}")`` one query after another (stdlib, so the
      audit can redraw it); NaN where no such query exists. What any two queries of the head share.
    - shuffled: the expected ``J(set_i, B)`` for ``B`` a uniformly random set of ``|set_{i-1}|`` of the
      blocks query ``i-1`` sees, in closed form (hypergeometric): what neighbours would share if the
      previous query's blocks sat at random positions.
    """
    h, tq, _ = sets.shape
    pair = torch.full((h, max(tq - 1, 0)), float("nan"), dtype=torch.float64)
    shuffled = torch.full((h, max(tq - 1, 0)), float("nan"), dtype=torch.float64)
    sizes = sets.sum(dim=-1).tolist()
    buckets: dict[int, list[int]] = {}
    for j, vb in enumerate(visible_blocks):
        buckets.setdefault(vb, []).append(j)        # ascending query indices per visible-block count
    for hh in range(h):
        rng = _random.Random(f"jaccard-null:{case_id}:{hh}")
        for i in range(1, tq):
            j = _partner(buckets[visible_blocks[i]], i, rng)
            if j is not None:
                pair[hh, i - 1] = float(jaccard(sets[hh, i], sets[hh, j]))
            n = visible_blocks[i - 1]
            a = sizes[hh][i]
            a0 = int(sets[hh, i, :n].sum())
            b = sizes[hh][i - 1]
            shuffled[hh, i - 1] = _expected_jaccard(a, a0, b, n)
    return pair, shuffled


def _partner(bucket: list[int], i: int, rng) -> int | None:
    """``cands[rng.randrange(len(cands))]`` for ``cands`` the queries of ``bucket`` (ascending) other
    than ``i - 1, i, i + 1``, without building ``cands``: the draw, then a step past each excluded one."""
    lo = _bisect.bisect_left(bucket, i - 1)
    excluded = [k for k in range(lo, min(lo + 3, len(bucket))) if abs(bucket[k] - i) <= 1]
    n = len(bucket) - len(excluded)
    if n <= 0:
        return None
    r = rng.randrange(n)
    for k in excluded:
        if k <= r:
            r += 1
    return bucket[r]


def _expected_jaccard(a: int, a0: int, b: int, n: int) -> float:
    """E[|A & B| / |A | B|] for a fixed set A of ``a`` blocks, ``a0`` of them among the ``n`` blocks
    B is drawn from, and B a uniformly random ``b``-subset of those ``n``."""
    total = _math.comb(n, b)
    e = 0.0
    for k in range(max(0, b - (n - a0)), min(a0, b) + 1):
        union = a + b - k
        e += _math.comb(a0, k) * _math.comb(n - a0, b - k) / total * (k / union if union else 1.0)
    return e
