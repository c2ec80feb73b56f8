"""Causal ablations of the KV cache: remove a region, renormalize, measure the damage.

Observation says where attention mass sits; only intervention says what the cache is worth.
An ablation drops a set of contiguous key spans and recomputes the softmax over the keys that
are left (a masked, renormalized softmax), with the causal mask still applied: a query never
sees a later key. This is the "local output ablation" recommended by the video KV-cache
attention study (docs/studies.md): drop the sink, the recent window or all history, and
measure the pre-projection attention-output relative L2 and cosine against the full output.

Ablations (small frozen dataclasses, each ``dropped(case) -> spans | None``; None means the
Case's layout does not have what the ablation needs, and the ablation is reported as not
applicable rather than run on something else):

- ``none``: nothing dropped (the full attention; with quantized K/V it is the quantization error);
- ``drop_sink``, ``drop_recent`` (any ``drop_<region>``): the named region;
- ``drop_history``: every key before the ``current`` region (the whole cache);
- ``keep_current_only``: every key outside the ``current`` region;
- ``control_sink``, ``control_recent`` (any ``control_<region>``): as many keys as the region
  holds, drawn (seeded) from the history outside it — a block of the middle region where one
  fits, else a block elsewhere beside the target, else scattered keys (see `control_block`) —
  so that "the sink matters" can be told apart from "any that many keys matter". Where the
  history outside the region is smaller than the region, there is no valid control and it is
  not applicable;
- ``mass_control_sink``, ``mass_control_recent`` (any ``mass_control_<region>``): per row (head x
  query), keys of the history outside the region whose reference attention mass matches the
  region's within 1 % (see `select_mass_matched`), so that "the sink matters" can be told apart
  from "removing that much mass matters". The key set differs from row to row; a row with no
  such set is *unmatched* (NaN, counted, left out of every mean). Run by `mass_control`, a
  per-row-mask path (the atoms below are shared by all rows).

With dropped mass ``tau = sum_{j dropped} P_j`` the ablated row is ``P' = P / (1 - tau)`` on the
kept keys, so ``TV(P, P') = tau`` and ``O' - O = tau (mu_kept - mu_dropped)`` where ``mu`` are the
P-weighted value means of each side (tests hold both). A row whose kept visible set is empty
has no softmax: it is NaN, counted in ``undefined`` and left out of every mean, never zero.

The computation (`ablate`) runs over tiles of one KV head x a slice of queries (at most about
``max_scores`` scores alive). Keys are cut into *atoms* at every region and span boundary; per
atom the tile keeps its running max ``m_a``, ``Z_a = sum exp(s - m_a)`` and ``N_a = sum exp(s -
m_a) v`` (one P.V product in total, whatever the number of ablations), and every ablation merges
the atoms it keeps the way flash attention merges blocks. TV is summed over the keys atom by
atom from the two normalizers (not set to ``tau``); the tests and the audit recompute both from
an independent masked softmax.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import numpy as np
import torch

try:  # numba is a declared dependency; the numpy path serves where a platform lacks a wheel
    import numba
except ImportError:  # pragma: no cover - exercised only where numba is missing
    numba = None

from .attention import DEFAULT_MAX_SCORES
from .metrics import history_span, score_tiles

__all__ = ["Full", "DropRegion", "DropHistory", "KeepCurrentOnly", "Control", "MassControl", "make_ablation",
           "ABLATION_NAMES", "control_block", "mass_control_order", "select_mass_matched", "mass_control", "MassResult",
           "kept_mask", "ablate", "ArmResult", "DEFAULT_MAX_SCORES", "MASS_TOLERANCE", "MASS_ATTEMPTS"]

MASS_TOLERANCE = 0.01  # a mass-matched control's reference mass is within this relative distance of tau
MASS_ATTEMPTS = 16     # seeded key orders a row tries, in turn, until one matches
ABLATION_NAMES = ("none", "drop_sink", "control_sink", "mass_control_sink", "drop_recent", "control_recent",
                  "mass_control_recent", "drop_middle", "drop_history", "keep_current_only")


@dataclass(frozen=True)
class Full:
    name: str = field(default="none", init=False)

    def dropped(self, case) -> list[tuple[int, int]]:
        return []


@dataclass(frozen=True)
class DropRegion:
    region: str

    @property
    def name(self) -> str:
        return f"drop_{self.region}"

    def dropped(self, case):
        r = case.region(self.region)
        return None if r is None or r.size == 0 else [(r.start, r.stop)]


@dataclass(frozen=True)
class DropHistory:
    name: str = field(default="drop_history", init=False)

    def dropped(self, case):
        hist = history_span(case.layout)
        return None if hist is None or hist[1] == 0 else [hist]


@dataclass(frozen=True)
class KeepCurrentOnly:
    name: str = field(default="keep_current_only", init=False)

    def dropped(self, case):
        cur = case.region("current")
        if cur is None:
            return None
        spans = [(a, b) for a, b in ((0, cur.start), (cur.stop, case.keys)) if b > a]
        return spans or None


def control_block(case, target: str, seed: int) -> tuple[list[tuple[int, int]], str] | None:
    """``(spans, kind)`` of the same-size control for region ``target``, or None.

    The control drops as many keys as the region holds, from the history (keys before
    ``current``, or all keys without a current region) and never from the region itself:

    - ``middle``: a contiguous block inside the ``middle`` region, when the layout has one that
      is large enough (the history proper, away from the sink and the recent window);
    - ``contiguous``: else a contiguous block anywhere in the history outside the target;
    - ``scattered``: else (no block fits beside the target) that many single keys drawn from the
      history outside the target.

    Blocks are aligned to whole frames when the Case has frames and the size is a whole number of
    frames. One draw with ``random.Random(f"control:{seed}:{case.id}:{target}")`` (stdlib, so
    the audit can redraw it). None when the region is missing or empty, or when the history
    outside it holds fewer keys than the region: no valid control exists, and the ablation's
    comparison is reported as not applicable rather than made against an overlapping one.
    """
    r = case.region(target)
    if r is None or r.size == 0:
        return None
    size = r.size
    h0, h1 = history_span(case.layout) or (0, case.keys)
    tpf = case.tokens_per_frame
    step = tpf if tpf and size % tpf == 0 else 1
    rng = random.Random(f"control:{seed}:{case.id}:{target}")
    middle = case.region("middle")
    if middle is not None and middle.size >= size and target != "middle":
        cands = [a for a in range(middle.start, middle.stop - size + 1) if a % step == 0]
        if cands:
            a = cands[rng.randrange(len(cands))]
            return [(a, a + size)], "middle"
    pieces = [(h0, min(r.start, h1)), (max(r.stop, h0), h1)]
    cands = [a for lo, hi in pieces for a in range(lo, hi - size + 1) if a % step == 0]
    if cands:
        a = cands[rng.randrange(len(cands))]
        return [(a, a + size)], "contiguous"
    free = [t for lo, hi in pieces for t in range(lo, hi)]
    if len(free) < size:
        return None
    picked = sorted(rng.sample(free, size))
    spans: list[tuple[int, int]] = []
    for t in picked:
        if spans and spans[-1][1] == t:
            spans[-1] = (spans[-1][0], t + 1)
        else:
            spans.append((t, t + 1))
    return spans, "scattered"


@dataclass(frozen=True)
class Control:
    target: str
    seed: int = 0

    @property
    def name(self) -> str:
        return f"control_{self.target}"

    def dropped(self, case):
        blk = control_block(case, self.target, self.seed)
        return None if blk is None else blk[0]


def mass_control_order(case, target: str, seed: int, attempt: int = 0) -> list[int] | None:
    """The keys a mass-matched control of region ``target`` may drop, in the seeded order of
    attempt ``attempt``; None when the region is missing or empty or no such key exists.

    The eligible keys are the size-matched control's pool: the history (keys before ``current``,
    or all keys without a current region) outside the target. Each of them, in ascending key
    order, draws ``u = rng.random()`` from
    ``random.Random(f"mass_control:{seed}:{case.id}:{target}:{attempt}")`` (stdlib ``random()``,
    whose stream Python keeps fixed for a seed, so the audit can redraw it); the order is
    increasing ``u`` (ties, never seen, by key index). One order per (case, target, attempt),
    shared by every row: the rows' sets differ because their masses do.
    """
    r = case.region(target)
    if r is None or r.size == 0:
        return None
    h0, h1 = history_span(case.layout) or (0, case.keys)
    eligible = [t for t in range(h0, h1) if not r.start <= t < r.stop]
    if not eligible:
        return None
    rng = random.Random(f"mass_control:{seed}:{case.id}:{target}:{attempt}")
    draws = [rng.random() for _ in eligible]
    return [t for _, t in sorted(zip(draws, eligible))]


@dataclass(frozen=True)
class MassControl:
    """Per-row mass-matched control of ``target`` (see `mass_control_order`, `select_mass_matched`)."""

    target: str
    seed: int = 0

    @property
    def name(self) -> str:
        return f"mass_control_{self.target}"

    def target_spans(self, case):
        r = case.region(self.target)
        return None if r is None or r.size == 0 else [(r.start, r.stop)]

    def dropped(self, case):
        raise TypeError(f"{self.name} drops a different key set per row: run it with mass_control, not ablate")

    def orders(self, case) -> list[list[int]] | None:
        """The `MASS_ATTEMPTS` seeded orders of the eligible keys, or None (not applicable)."""
        first = mass_control_order(case, self.target, self.seed, 0)
        if first is None:
            return None
        return [first] + [mass_control_order(case, self.target, self.seed, a) for a in range(1, MASS_ATTEMPTS)]


def make_ablation(name: str, seed: int = 0):
    """The ablation called ``name``: ``none``, ``drop_history``, ``keep_current_only``,
    ``drop_<region>``, ``control_<region>`` or ``mass_control_<region>``."""
    if name.startswith("mass_control_") and len(name) > 13:
        return MassControl(name[13:], seed)
    if name == "none":
        return Full()
    if name == "drop_history":
        return DropHistory()
    if name == "keep_current_only":
        return KeepCurrentOnly()
    if name.startswith("drop_") and len(name) > 5:
        return DropRegion(name[5:])
    if name.startswith("control_") and len(name) > 8:
        return Control(name[8:], seed)
    raise ValueError(f"unknown ablation {name!r} (none, drop_history, keep_current_only, drop_<region>, control_<region>, "
                     "mass_control_<region>)")


def kept_mask(keys: int, dropped: list[tuple[int, int]]) -> torch.Tensor:
    """``[Tk]`` boolean: True for every key outside the dropped spans."""
    keep = torch.ones(keys, dtype=torch.bool)
    for a, b in dropped:
        keep[a:b] = False
    return keep


@dataclass
class ArmResult:
    """Per-ablation results of one K/V arm (``A`` ablations in ``names`` order).

    ``dropped_mass``, ``tv``: ``[A, H, Tq]`` per row, NaN on undefined rows. ``undefined [A, H]``:
    rows with an empty kept visible set. Sums over defined rows per head ``[A, H]``: ``err2`` =
    ``||O' - O_ref||^2``, ``ref2`` = ``||O_ref||^2``, ``dot`` = ``<O', O_ref>``, ``out2`` = ``||O'||^2``,
    ``own_err2`` / ``own_ref2`` against this arm's own full output. ``region_mass``: ``{name: [H, Tq]}``
    of the full P (``history`` included when there is a current region). ``output``: the full
    output ``[H, Tq, D]`` float64. ``mean_shift [A, H, Tq]``: ``||mu_kept - mu_dropped|| / ||O||``
    per row, the P-weighted value means of the kept and the dropped keys of the arm's own
    attention; since ``O' - O = tau (mu_kept - mu_dropped)`` it is what the ablation changes per
    unit of dropped mass. NaN where no visible key is dropped or the row is undefined.
    """

    names: list[str]
    dropped_mass: torch.Tensor
    tv: torch.Tensor
    undefined: torch.Tensor
    err2: torch.Tensor
    ref2: torch.Tensor
    dot: torch.Tensor
    out2: torch.Tensor
    own_err2: torch.Tensor
    own_ref2: torch.Tensor
    region_mass: dict
    output: torch.Tensor
    mean_shift: torch.Tensor | None = None

    def index(self, name: str) -> int:
        return self.names.index(name)

    def rel_l2(self, name: str, own: bool = False) -> float:
        i = self.index(name)
        num, den = (self.own_err2[i], self.own_ref2[i]) if own else (self.err2[i], self.ref2[i])
        den = float(den.sum())
        return float("nan") if den == 0 else (float(num.sum()) / den) ** 0.5

    def rel_l2_heads(self, name: str) -> list[float]:
        i = self.index(name)
        return [float("nan") if d == 0 else float((n / d) ** 0.5) for n, d in zip(self.err2[i], self.ref2[i])]

    def cosine(self, name: str) -> float:
        i = self.index(name)
        den = float((self.out2[i].sum() * self.ref2[i].sum()) ** 0.5)
        return float("nan") if den == 0 else float(self.dot[i].sum()) / den


def cut_points(keys: int, layout, spans: dict[str, list[tuple[int, int]]]) -> list[int]:
    """Sorted key indices where a region or an ablation span starts or stops (0 and ``keys`` included)."""
    cuts = {0, keys}
    for r in layout:
        cuts.update((r.start, r.stop))
    for sp in spans.values():
        for a, b in sp:
            cuts.update((a, b))
    return sorted(c for c in cuts if 0 <= c <= keys)


def _atoms(keys: int, layout, spans: dict[str, list[tuple[int, int]]]) -> list[tuple[int, int]]:
    cuts = cut_points(keys, layout, spans)
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def _inside(atom: tuple[int, int], spans) -> bool:
    return any(a <= atom[0] and atom[1] <= b for a, b in spans)


def _merge(m, z, n, sel):
    """Merge the atoms selected by ``sel`` (bool [A]): returns (shift, Z, N) with shift finite."""
    ms = m[sel]
    big = ms.amax(dim=0) if ms.shape[0] else torch.full(m.shape[1:], float("-inf"), dtype=m.dtype)
    shift = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    w = torch.exp(ms - shift)  # -inf atoms (nothing visible) weigh exactly 0
    zz = (w * z[sel]).sum(dim=0)
    nn = (w.unsqueeze(-1) * n[sel]).sum(dim=0)
    return shift, zz, nn


def _add_error_sums(sums: dict, i: int, heads, ok: torch.Tensor, out, o_ref, full) -> torch.Tensor:
    """Add one tile's rows where ``ok`` to ablation ``i``'s per-head sums (``err2``, ``ref2``, ``dot``,
    ``out2``, ``own_err2``, ``own_ref2``; see `ArmResult`); returns ``out`` with the other rows zeroed."""
    okd = ok.unsqueeze(-1)
    o = torch.where(okd, out, torch.zeros_like(out))
    r = torch.where(okd, o_ref, torch.zeros_like(o_ref))
    f = torch.where(okd, full, torch.zeros_like(full))
    sums["err2"][i, heads] += ((o - r) ** 2).sum(dim=(-1, -2))
    sums["ref2"][i, heads] += (r ** 2).sum(dim=(-1, -2))
    sums["dot"][i, heads] += (o * r).sum(dim=(-1, -2))
    sums["out2"][i, heads] += (o ** 2).sum(dim=(-1, -2))
    sums["own_err2"][i, heads] += ((o - f) ** 2).sum(dim=(-1, -2))
    sums["own_ref2"][i, heads] += (f ** 2).sum(dim=(-1, -2))
    return o


def ablate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor, causal: bool,
           layout, spans: dict[str, list[tuple[int, int]]], *, ref: torch.Tensor | None = None,
           max_scores: int = DEFAULT_MAX_SCORES) -> ArmResult:
    """Run every ablation of ``spans`` ({name: dropped spans}) on one K/V arm, tile by tile
    (`ablate_arm` without mass-matched controls).

    ``ref`` is the output the errors are measured against (the float64 full attention on the
    original K/V); None measures against this arm's own full output.
    """
    return ablate_arm(q, k, v, query_positions, causal, layout, spans, {}, ref=ref, max_scores=max_scores)[0]


def ablate_case(case, spans: dict[str, list[tuple[int, int]]], k=None, v=None, *, ref=None,
                max_scores: int = DEFAULT_MAX_SCORES) -> ArmResult:
    """`ablate` on a Case, optionally with replaced (e.g. dequantized) K and V."""
    return ablate(case.q, case.k if k is None else k, case.v if v is None else v, case.query_positions,
                  case.causal, case.layout, spans, ref=ref, max_scores=max_scores)


__all__.append("ablate_case")


# ---------------------------------------------------------------------------------------------
# mass-matched controls: a different key set per row, so a per-row mask instead of shared atoms
# ---------------------------------------------------------------------------------------------

def select_mass_matched(p: torch.Tensor, target: torch.Tensor, orders: list[list[int]], vis: torch.Tensor | None,
                        tol: float = MASS_TOLERANCE):
    """Seeded first-fit selection of a mass-matched control, every row at once.

    ``p [..., c, Tk]``: the rows' reference attention probabilities (float64); ``target [Tk]``
    bool: the target region; ``orders``: the seeded orders of the eligible keys
    (`MassControl.orders`, all of one length); ``vis [c, Tk]`` or None: the causal mask. Per row,
    ``tau`` is its mass on the target, ``lo = (1 - tol) tau``, ``hi = (1 + tol) tau``. One attempt
    with an order: ``acc = 0``, no key taken; for each key ``t`` of the order, a key the row cannot
    see is skipped, else it is taken iff ``acc + P_t <= hi`` (then ``acc += P_t``), and the attempt
    stops, *reached*, once ``acc >= lo``. A row keeps the keys of the first attempt (in the order
    of ``orders``) that reached; a row none reached, or with ``tau`` 0 or NaN, is *unmatched* and
    drops nothing.

    The attempts of a row are independent, and so are the rows: a compiled loop (numba, one row
    and one attempt at a time, stopping at the first attempt that reaches) runs the rule as
    written, in the same float64 additions and comparisons as the vectorized numpy path
    (`_select_numpy`: one loop over order positions on ``[attempts, rows]``), which serves where
    numba is missing or ``TESTBED_FAST=0``; the tests hold the two equal bit for bit. Rows whose
    whole eligible visible mass is below ``lo`` cannot match and are left out from the start (a
    shortcut only, with a 1e-9 relative margin so that it never changes an outcome).

    Returns torch ``(selected [..., c, Tk] bool, False on unmatched rows; tau; acc, the selected
    keys' mass, 0 on unmatched rows; matched bool)``.
    """
    if not 0.0 <= tol < 1.0:  # lo = (1 - tol) tau must stay positive: a row that took nothing is no match
        raise ValueError(f"mass tolerance must lie in [0, 1), got {tol!r}")
    shape, tk = p.shape[:-1], p.shape[-1]
    pn = np.ascontiguousarray(p.detach().to(torch.float64).reshape(-1, tk).numpy())
    rows = pn.shape[0]
    order = np.ascontiguousarray(np.asarray(orders, dtype=np.int64).reshape(len(orders), -1))     # [A, E]
    tau = pn[:, target.numpy()].sum(axis=1)
    hi = tau * (1.0 + tol)
    lo = tau * (1.0 - tol)
    with np.errstate(invalid="ignore"):
        hopeless = ~(tau > 0) | (pn[:, order[0]].sum(axis=1) < lo * (1.0 - 1e-9))
    if _select_rows is not None and os.environ.get("TESTBED_FAST", "1") != "0":
        c = shape[-1] if len(shape) else 1
        visn = (np.ones((1, tk), dtype=bool) if vis is None
                else np.ascontiguousarray(vis.expand(c, tk).numpy()))
        sel = np.zeros((rows, tk), dtype=bool)
        achieved = np.zeros(rows)
        matched = np.zeros(rows, dtype=bool)
        _select_rows(pn, visn, 0 if vis is None else c, order, lo, hi, hopeless, sel, achieved, matched)
    else:
        visn = (np.ones((rows, tk), dtype=bool) if vis is None
                else vis.expand(*shape, tk).reshape(-1, tk).numpy())
        sel, achieved, matched = _select_numpy(pn, visn, order, lo, hi, hopeless)
    return (torch.from_numpy(sel).reshape(*shape, tk), torch.from_numpy(tau).reshape(shape),
            torch.from_numpy(achieved).reshape(shape), torch.from_numpy(matched).reshape(shape))


def _select_numpy(pn, visn, order, lo, hi, hopeless):
    """The selection of `select_mass_matched` vectorized over ``[attempts, rows]`` (``pn``, ``visn``
    ``[rows, Tk]``): ``(sel [rows, Tk], achieved [rows], matched [rows])``."""
    rows, tk = pn.shape
    attempts, e = order.shape
    acc = np.zeros((attempts, rows))
    done = np.broadcast_to(hopeless, (attempts, rows)).copy()
    took = np.zeros((attempts, rows, e), dtype=bool)
    with np.errstate(invalid="ignore"):
        for i in range(e):
            if done.all():
                break
            keys_i = order[:, i]
            nxt = acc + pn[:, keys_i].T
            take = ~done & (nxt <= hi) & visn[:, keys_i].T
            acc = np.where(take, nxt, acc)
            took[:, :, i] = take
            done |= take & (acc >= lo)
        hit = (acc >= lo) & ~hopeless
    matched = hit.any(axis=0)
    first = np.argmax(hit, axis=0)
    ar = np.arange(rows)
    sel = np.zeros((rows, tk), dtype=bool)
    sel[ar[:, None], order[first]] = took[first, ar] & matched[:, None]
    achieved = np.where(matched, acc[first, ar], 0.0)
    return sel, achieved, matched


def _select_rows_py(pn, visn, c, order, lo, hi, hopeless, sel, achieved, matched):  # pragma: no cover - compiled
    """The rule of `select_mass_matched`, one row and one attempt at a time (compiled by numba):
    fills ``sel [rows, Tk]``, ``achieved`` and ``matched`` (zero-initialized) in place. Row ``r``
    reads the visibility row ``r % c`` of ``visn`` (row 0 when ``c`` is 0: no causal mask)."""
    rows = pn.shape[0]
    attempts, e = order.shape
    taken = np.empty(e, dtype=np.int64)
    for r in range(rows):
        if hopeless[r]:
            continue
        vr = r % c if c > 0 else 0
        for a in range(attempts):
            acc = 0.0
            n = 0
            reached = False
            for i in range(e):
                t = order[a, i]
                if not visn[vr, t]:
                    continue
                nxt = acc + pn[r, t]
                if nxt <= hi[r]:
                    acc = nxt
                    taken[n] = t
                    n += 1
                    if acc >= lo[r]:
                        reached = True
                        break
            if reached:
                for m in range(n):
                    sel[r, taken[m]] = True
                achieved[r] = acc
                matched[r] = True
                break


_select_rows = None if numba is None else numba.njit(cache=True)(_select_rows_py)


def _scratch(buf: torch.Tensor | None, shape, dtype=torch.float64) -> torch.Tensor:
    """A contiguous ``shape`` tensor in ``buf``'s memory when it holds enough (a tile's scratch,
    reused from tile to tile instead of allocated per operation), else a new one."""
    n = 1
    for x in shape:
        n *= int(x)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        return torch.empty(shape, dtype=dtype)
    return buf.view(-1)[:n].view(shape)


_NINF = torch.tensor(float("-inf"), dtype=torch.float64)
_ZERO = torch.tensor(0.0, dtype=torch.float64)


def _spans_of(keys: np.ndarray) -> list[tuple[int, int]]:
    """The sorted key indices ``keys`` as maximal runs ``[(start, stop), ...]``."""
    keys = np.asarray(keys, dtype=np.int64)
    if keys.size == 0:
        return []
    cut = np.flatnonzero(np.diff(keys) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(keys, cut)]


def _columns(x: torch.Tensor, spans: list[tuple[int, int]], dim: int = -1) -> torch.Tensor:
    """``x`` restricted to the key runs ``spans`` along ``dim``: a view for one run, a copy for several."""
    parts = [x.narrow(dim, a, b - a) for a, b in spans]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _drop_rows(s: torch.Tensor, vis: torch.Tensor | None, p: torch.Tensor, drop: torch.Tensor, vj: torch.Tensor,
               work: torch.Tensor | None = None, work2: torch.Tensor | None = None, outputs_only: bool = False,
               within: list[tuple[int, int]] | None = None):
    """One masked renormalized softmax per row, dropping ``drop [g, c, Tk]`` (a per-row mask).

    Returns ``(out [g, c, D], ok, tau, tv, mu_dropped [g, c, D], has)``: ``ok`` where the kept
    visible set is not empty, ``tau`` the dropped mass of ``p``, ``tv = 0.5 sum |p - p'|`` key by
    key, ``mu_dropped`` the value mean under the dropped keys' own softmax, ``has`` where a visible
    key is dropped; ``(out, ok)`` only with ``outputs_only``. ``work`` / ``work2``: float64 scratch
    of at least the tile's size (`_scratch`; None allocates): the softmaxes are computed in place
    there, the same operations on the same shapes as out of place, so the same values.
    ``within``: key runs that hold every dropped key (a mass-matched control's eligible keys;
    checked): ``mu_dropped`` is then summed over those keys only, the others weighing exactly 0
    (the same value summed in another order: the last bits may differ from the sum over ``Tk``).
    """
    allowed = ~drop if vis is None else vis.unsqueeze(0) & ~drop
    ok = allowed.any(dim=-1)
    ea = torch.where(allowed, s, _NINF, out=_scratch(work, s.shape))              # s on the kept keys, else -inf
    mx = torch.where(ok, ea.amax(dim=-1), torch.zeros_like(ok, dtype=s.dtype))
    ea.sub_(mx.unsqueeze(-1)).exp_()
    za = ea.sum(dim=-1)
    pa = ea.div_(torch.where(ok, za, torch.ones_like(za)).unsqueeze(-1))
    out = torch.matmul(pa, vj)
    if outputs_only:
        return out, ok
    w2 = _scratch(work2, s.shape)
    tau = torch.where(drop, p, _ZERO, out=w2).sum(dim=-1)
    tv = 0.5 * torch.sub(p, pa, out=w2).abs_().sum(dim=-1)
    dv = drop if vis is None else vis.unsqueeze(0) & drop
    has = dv.any(dim=-1)
    if within is None:
        ed = torch.where(dv, s, _NINF, out=pa)                                      # s on the dropped keys, else -inf
        vd = vj
    else:
        inside = torch.zeros(s.shape[-1], dtype=torch.bool)
        for a, b in within:
            inside[a:b] = True
        if bool(drop[..., ~inside].any()):
            raise ValueError("a dropped key lies outside the runs `within` said hold every dropped key")
        dv = _columns(dv, within)
        ed = torch.where(dv, _columns(s, within), _NINF, out=_scratch(w2, dv.shape))
        vd = _columns(vj, within, dim=0)
    md = torch.where(has, ed.amax(dim=-1), torch.zeros_like(has, dtype=s.dtype))
    ed.sub_(md.unsqueeze(-1)).exp_()
    zd = ed.sum(dim=-1)
    mu_d = torch.matmul(ed, vd) / torch.where(has, zd, torch.ones_like(zd)).unsqueeze(-1)
    return out, ok, tau, tv, mu_d, has


def drop_rows(s: torch.Tensor, vis: torch.Tensor | None, p: torch.Tensor, drop: torch.Tensor, vj: torch.Tensor,
              outputs_only: bool = False):
    """The per-row masked renormalized softmax of the ablations (`_drop_rows`, without scratch
    buffers): ``drop [g, c, Tk]`` a different key set per row (the selective analysis's kept sets)."""
    return _drop_rows(s, vis, p, drop, vj, outputs_only=outputs_only)


__all__.append("drop_rows")


@dataclass
class MassResult(ArmResult):
    """`ArmResult` of the mass-matched controls of one K/V arm (names ``mass_control_<region>``),
    on the matched rows only (per-row fields NaN elsewhere, sums over matched defined rows).

    Extra per-row fields ``[A, H, Tq]``: ``target_mass`` (the reference mass of the target, the
    tau the selection matches), ``achieved`` (the reference mass of the selected keys; NaN on
    unmatched rows), ``matched`` (bool), ``keys`` (selected keys per row, 0 when unmatched). The
    selection always reads the *reference* attention (the float64 softmax of the original K), so
    a quantized arm drops the same keys per row as the float32 arm; ``dropped_mass`` is the arm's
    own mass of them. ``target_err2`` / ``target_ref2 [A, H]``: the target region's own ablation
    on this arm, summed over the same rows, for a like-for-like rel-L2.
    """

    target_mass: torch.Tensor | None = None
    achieved: torch.Tensor | None = None
    matched: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    target_err2: torch.Tensor | None = None
    target_ref2: torch.Tensor | None = None

    def target_rel_l2(self, name: str) -> float:
        i = self.index(name)
        den = float(self.target_ref2[i].sum())
        return float("nan") if den == 0 else (float(self.target_err2[i].sum()) / den) ** 0.5


class MassSelections:
    """The mass-matched selections of one Case, shared by its K/V arms.

    The selection reads only the reference attention (the float64 softmax of the Case's own K),
    so every arm of a Case selects the same keys per row; the first arm's pass (`ablate_arm`, the
    float32 arm) stores each tile's selection here (the selected keys as bits over the eligible
    keys, with ``tau``, ``acc`` and ``matched``, in arrays of the whole ``[H, Tq]`` allocated
    once, so that nothing small and long-lived is left between a tile's temporaries), and a later
    pass over the same controls, tiles and reference K reads them back instead of re-scoring the
    reference and re-selecting. ``k_ref`` is the reference K the selections were read from: a pass
    with any other reference K (or other controls, tile size or tolerance) neither reads nor
    writes them.
    """

    def __init__(self, k_ref: torch.Tensor):
        self.k_ref = k_ref
        self.complete: set = set()
        self._signatures: list = []
        self._store: dict = {}

    def signature(self, sig) -> int:
        """A small id for a pass's signature (controls, tile size, tolerance, shapes)."""
        if sig not in self._signatures:
            self._signatures.append(sig)
        return self._signatures.index(sig)

    def usable(self, k_ref: torch.Tensor) -> bool:
        return k_ref is self.k_ref

    def put(self, sid: int, name: str, heads: slice, qs: slice, shape: tuple[int, int], sel: torch.Tensor,
            eligible: np.ndarray, tau, acc, matched) -> None:
        """Store one tile's selection of control ``name`` (``shape``: the Case's ``(H, Tq)``)."""
        key = (sid, name)
        if key not in self._store:
            self._store[key] = (np.zeros(shape + ((len(eligible) + 7) // 8,), dtype=np.uint8),
                                torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64),
                                torch.zeros(shape, dtype=torch.bool))
        bits, t, a, m = self._store[key]
        bits[heads, qs] = np.packbits(sel.numpy()[..., eligible], axis=-1)
        t[heads, qs], a[heads, qs], m[heads, qs] = tau, acc, matched

    def get(self, sid: int, name: str, heads: slice, qs: slice, tk: int, eligible: np.ndarray):
        """One tile's ``(sel [g, c, Tk], tau, acc, matched)`` as `select_mass_matched` returned them."""
        bits, t, a, m = self._store[(sid, name)]
        b = bits[heads, qs]
        sel = np.zeros(b.shape[:-1] + (tk,), dtype=bool)
        sel[..., eligible] = np.unpackbits(b, axis=-1, count=len(eligible)).astype(bool)
        return torch.from_numpy(sel), t[heads, qs].clone(), a[heads, qs].clone(), m[heads, qs].clone()


def mass_control(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor, causal: bool,
                 layout, controls: dict[str, tuple[list[tuple[int, int]], list[list[int]]]], *, k_ref: torch.Tensor | None = None,
                 ref: torch.Tensor | None = None, max_scores: int = DEFAULT_MAX_SCORES,
                 tol: float = MASS_TOLERANCE, selections: MassSelections | None = None) -> MassResult:
    """Run the mass-matched controls ``controls`` ({name: (target spans, `MassControl.orders`)}) on
    one K/V arm, tile by tile (`ablate_arm` without region ablations; its arguments)."""
    return ablate_arm(q, k, v, query_positions, causal, layout, {}, controls, k_ref=k_ref, ref=ref,
                      max_scores=max_scores, tol=tol, selections=selections)[1]


class _ArmPass:
    """What one `ablate_arm` pass sets up once (`_arm_setup`) and fills tile by tile: the atoms and
    which of them each ablation, control target and region covers, the region ablations'
    accumulators ``[A, H, Tq]`` / ``[A, H]``, the full output and region masses, and the
    mass-matched controls' accumulators, eligible keys and shared selections."""


def _arm_setup(q: torch.Tensor, k: torch.Tensor, layout, spans: dict[str, list[tuple[int, int]]],
               controls: dict[str, tuple[list[tuple[int, int]], list[list[int]]]], k_ref: torch.Tensor | None,
               max_scores: int, tol: float, selections: MassSelections | None) -> _ArmPass:
    """The atoms of the pass (every region, span and control target boundary), their membership
    masks and the zeroed accumulators of `ablate_arm`; with controls, their targets, eligible key
    runs and the `MassSelections` entry this pass reads or fills (``cached``: read)."""
    st = _ArmPass()
    h, tq, d = q.shape
    keys = k.shape[1]
    st.h, st.tq, st.keys = h, tq, keys
    st.spans, st.controls = spans, controls
    st.names, st.cnames = list(spans), list(controls)
    na, nc = len(st.names), len(st.cnames)
    atoms = _atoms(keys, layout, {**spans, **{f"target:{c}": controls[c][0] for c in st.cnames}})
    st.atoms = atoms
    st.drop_atoms = torch.tensor([[_inside(at, spans[nm]) for at in atoms] for nm in st.names],
                                 dtype=torch.bool).reshape(na, len(atoms))
    st.target_atoms = torch.tensor([[_inside(at, controls[nm][0]) for at in atoms] for nm in st.cnames],
                                   dtype=torch.bool).reshape(nc, len(atoms))
    st.region_atoms = {r.name: torch.tensor([_inside(at, [(r.start, r.stop)]) for at in atoms], dtype=torch.bool)
                       for r in layout}
    hist = history_span(layout)
    if hist is not None:
        st.region_atoms["history"] = torch.tensor([_inside(at, [hist]) for at in atoms], dtype=torch.bool)
    f64 = torch.float64
    nan = float("nan")
    st.dropped_mass = torch.full((na, h, tq), nan, dtype=f64)
    st.tv = torch.full((na, h, tq), nan, dtype=f64)
    st.mean_shift = torch.full((na, h, tq), nan, dtype=f64)
    st.undefined = torch.zeros(na, h, dtype=torch.int64)
    st.sums = {key: torch.zeros(na, h, dtype=f64) for key in ("err2", "ref2", "dot", "out2", "own_err2", "own_ref2")}
    st.rmass = {name: torch.empty(h, tq, dtype=f64) for name in st.region_atoms}
    st.output = torch.empty(h, tq, d, dtype=f64)
    st.all_atoms = torch.ones(len(atoms), dtype=torch.bool)

    st.per_row = {key: torch.full((nc, h, tq), nan, dtype=f64)
                  for key in ("dropped_mass", "tv", "mean_shift", "target_mass", "achieved")}
    st.matched_all = torch.zeros(nc, h, tq, dtype=torch.bool)
    st.nkeys = torch.zeros(nc, h, tq, dtype=torch.int64)
    st.c_undefined = torch.zeros(nc, h, dtype=torch.int64)
    st.csums = {key: torch.zeros(nc, h, dtype=f64) for key in ("err2", "ref2", "dot", "out2", "own_err2", "own_ref2",
                                                               "target_err2", "target_ref2")}
    st.targets = []
    for name in st.cnames:
        tmask = torch.zeros(keys, dtype=torch.bool)
        for a, b in controls[name][0]:
            tmask[a:b] = True
        st.targets.append(tmask)
    st.eligible = [np.sort(np.asarray(controls[name][1][0], dtype=np.int64)) for name in st.cnames]
    st.within = [_spans_of(e) or None for e in st.eligible]  # the runs of keys a control may drop (None: no such key)
    st.t_defined = [(~t).any() for t in st.targets]  # without a causal mask: whether any key lies outside the target
    st.tol = tol
    sid = cached = None
    if controls:
        sig = (tuple(st.cnames), tuple((tuple(map(tuple, sp)), tuple(map(tuple, od))) for sp, od in controls.values()),
               int(max_scores), float(tol), tuple(q.shape), tuple(k.shape))
        if selections is not None and not selections.usable(k if k_ref is None else k_ref):
            selections = None
        sid = None if selections is None else selections.signature(sig)
        cached = selections is not None and sid in selections.complete
    st.selections, st.sid, st.cached = selections, sid, cached
    st.work = st.work2 = None
    return st


def _merge_tile(st: _ArmPass, heads, qs, s: torch.Tensor, vj: torch.Tensor, ref: torch.Tensor | None):
    """One tile's atoms (max, normalizer and numerator of each atom's masked softmax), merged into
    the full output, the region masses and every region ablation (`_merge`), added to ``st``.
    Returns what the controls read of the tile: ``(m, z, n, full, o_ref, fn_row)``."""
    f64 = torch.float64
    nan = float("nan")
    atoms = st.atoms
    m = torch.stack([s[..., a:b].amax(dim=-1) for a, b in atoms])            # [A_t, g, c]
    z_list, n_list = [], []
    for (a, b), ma in zip(atoms, m):
        shift = torch.where(torch.isfinite(ma), ma, torch.zeros_like(ma))
        e = torch.exp(s[..., a:b] - shift.unsqueeze(-1))
        z_list.append(e.sum(dim=-1))
        n_list.append(torch.matmul(e, vj[a:b]))
        del e
    z = torch.stack(z_list)
    n = torch.stack(n_list)
    fshift, fz, fn = _merge(m, z, n, st.all_atoms)
    full = fn / fz.unsqueeze(-1)
    st.output[heads, qs] = full
    w_full = torch.exp(m - fshift) * z / fz                                    # atom masses of P
    for name, sel in st.region_atoms.items():
        st.rmass[name][heads, qs] = w_full[sel].sum(dim=0)
    o_ref = full if ref is None else ref[heads, qs].to(f64)
    f_full = torch.exp(m - fshift) / fz        # the full softmax's factor per atom (TV below)
    fn_row = full.norm(dim=-1)                 # ||O|| per row (the mean shift's scale)
    for i, _name in enumerate(st.names):
        keep_atoms = ~st.drop_atoms[i]
        shift, zz, nn = _merge(m, z, n, keep_atoms)
        ok = zz > 0
        zs = torch.where(ok, zz, torch.ones_like(zz))
        out = torch.where(ok.unsqueeze(-1), nn / zs.unsqueeze(-1), torch.full_like(nn, nan))
        tau = w_full[st.drop_atoms[i]].sum(dim=0)
        # TV key by key, summed per atom: inside atom a both rows are proportional to the same
        # exp(s - m_a), with factors exp(m_a - shift) / Z (full) and exp(m_a - shift') / Z'
        # (ablated, 0 on dropped atoms), so sum_a |P - P'| = Z_a |factor - factor'|.
        f_abl = torch.where(keep_atoms.view(-1, 1, 1), torch.exp(m - shift) / zs, torch.zeros_like(f_full))
        row_tv = 0.5 * (z * (f_full - f_abl).abs()).sum(dim=0)
        st.dropped_mass[i, heads, qs] = torch.where(ok, tau, torch.full_like(tau, nan))
        st.tv[i, heads, qs] = torch.where(ok, row_tv, torch.full_like(row_tv, nan))
        st.undefined[i, heads] += (~ok).sum(dim=-1)
        o = _add_error_sums(st.sums, i, heads, ok, out, o_ref, full)
        # mu_dropped from the dropped atoms merged on their own (stable however small tau is)
        _, zd, nd = _merge(m, z, n, st.drop_atoms[i])
        shift_ok = ok & (zd > 0) & (fn_row > 0)
        mu_d = nd / torch.where(zd > 0, zd, torch.ones_like(zd)).unsqueeze(-1)
        ms = (o - mu_d).norm(dim=-1) / torch.where(shift_ok, fn_row, torch.ones_like(fn_row))
        st.mean_shift[i, heads, qs] = torch.where(shift_ok, ms, torch.full_like(ms, nan))
    return m, z, n, full, o_ref, fn_row


def _control_tile(st: _ArmPass, heads, qs, s: torch.Tensor, vis: torch.Tensor | None, vj: torch.Tensor,
                  ref_tiles, m, z, n, full, o_ref, fn_row) -> None:
    """The mass-matched controls on one tile's (masked) scores: each row's selection (read from
    ``st.selections`` when cached, else chosen on the reference attention, from ``ref_tiles`` when
    the reference K is not this arm's), its direct masked softmax (`_drop_rows`) and the target's
    own ablation merged from the tile's atoms, added to ``st``."""
    f64 = torch.float64
    nan = float("nan")
    if st.work is None or st.work.numel() < s.numel():
        st.work, st.work2 = torch.empty(s.numel(), dtype=f64), torch.empty(s.numel(), dtype=f64)
    p = torch.softmax(s, dim=-1)
    if st.cached:
        p_ref = None
    elif ref_tiles is None:
        p_ref = p
    else:
        s_ref = next(ref_tiles)[3]
        p_ref = torch.softmax(s_ref if vis is None else s_ref.masked_fill(~vis, float("-inf")), dim=-1)
    per_row, csums = st.per_row, st.csums
    for i, name in enumerate(st.cnames):
        if st.cached:
            sel, tau, acc, matched = st.selections.get(st.sid, name, heads, qs, st.keys, st.eligible[i])
        else:
            sel, tau, acc, matched = select_mass_matched(p_ref, st.targets[i], st.controls[name][1], vis, st.tol)
            if st.selections is not None:
                st.selections.put(st.sid, name, heads, qs, (st.h, st.tq), sel, st.eligible[i], tau, acc, matched)
        out, ok, drop_mass, row_tv, mu_d, has = _drop_rows(s, vis, p, sel, vj, st.work, st.work2,
                                                           within=st.within[i])
        _, zt, nt = _merge(m, z, n, ~st.target_atoms[i])                             # the target's own ablation
        # defined where a visible key lies outside the target (from the mask, so that a NaN
        # score propagates into the sums instead of leaving its row out)
        t_ok = st.t_defined[i].expand(zt.shape) if vis is None else (vis & ~st.targets[i]).any(dim=-1).expand(zt.shape)
        t_out = nt / torch.where(zt != 0, zt, torch.ones_like(zt)).unsqueeze(-1)
        use = matched & ok
        both = use & t_ok
        per_row["target_mass"][i, heads, qs] = tau
        per_row["achieved"][i, heads, qs] = torch.where(matched, acc, torch.full_like(acc, nan))
        st.matched_all[i, heads, qs] = matched
        st.nkeys[i, heads, qs] = sel.sum(dim=-1)
        per_row["dropped_mass"][i, heads, qs] = torch.where(use, drop_mass, torch.full_like(drop_mass, nan))
        per_row["tv"][i, heads, qs] = torch.where(use, row_tv, torch.full_like(row_tv, nan))
        shift_ok = use & has & (fn_row > 0)
        ms = (out - mu_d).norm(dim=-1) / torch.where(shift_ok, fn_row, torch.ones_like(fn_row))
        per_row["mean_shift"][i, heads, qs] = torch.where(shift_ok, ms, torch.full_like(ms, nan))
        st.c_undefined[i, heads] += (matched & ~ok).sum(dim=-1)
        _add_error_sums(csums, i, heads, use, out, o_ref, full)
        bb = both.unsqueeze(-1)
        to = torch.where(bb, t_out, torch.zeros_like(t_out))
        tr = torch.where(bb, o_ref, torch.zeros_like(o_ref))
        csums["target_err2"][i, heads] += ((to - tr) ** 2).sum(dim=(-1, -2))
        csums["target_ref2"][i, heads] += (tr ** 2).sum(dim=(-1, -2))
    del p, p_ref


def _arm_results(st: _ArmPass) -> tuple[ArmResult, MassResult | None]:
    """The pass's `ArmResult` and, with controls, its `MassResult` (its selections then complete)."""
    sums, csums, per_row = st.sums, st.csums, st.per_row
    res = ArmResult(st.names, st.dropped_mass, st.tv, st.undefined, sums["err2"], sums["ref2"], sums["dot"],
                    sums["out2"], sums["own_err2"], sums["own_ref2"], st.rmass, st.output, st.mean_shift)
    if not st.controls:
        return res, None
    mres = MassResult(st.cnames, per_row["dropped_mass"], per_row["tv"], st.c_undefined, csums["err2"], csums["ref2"],
                      csums["dot"], csums["out2"], csums["own_err2"], csums["own_ref2"], {}, st.output,
                      per_row["mean_shift"], target_mass=per_row["target_mass"], achieved=per_row["achieved"],
                      matched=st.matched_all, keys=st.nkeys, target_err2=csums["target_err2"],
                      target_ref2=csums["target_ref2"])
    if st.selections is not None:
        st.selections.complete.add(st.sid)
    return res, mres


def ablate_arm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor, causal: bool,
               layout, spans: dict[str, list[tuple[int, int]]],
               controls: dict[str, tuple[list[tuple[int, int]], list[list[int]]]], *, k_ref: torch.Tensor | None = None,
               ref: torch.Tensor | None = None, max_scores: int = DEFAULT_MAX_SCORES, tol: float = MASS_TOLERANCE,
               selections: MassSelections | None = None) -> tuple[ArmResult, MassResult | None]:
    """One K/V arm's region ablations ``spans`` ({name: dropped spans}) and mass-matched controls
    ``controls`` ({name: (target spans, `MassControl.orders`)}) in one pass over the tiles (one KV
    head x a slice of queries): ``(ArmResult, MassResult or None without controls)``.

    Region ablations drop the same keys in every row, so each tile's keys are cut into *atoms* at
    every region, span and target boundary; each atom's masked softmax is summed once (its max,
    normalizer and numerator ``exp(s - max) V``) and any union of atoms is a merge of those
    (`_merge`): the full output, every ablation's output and a control's target's own ablation.
    A mass-matched control drops a different key set per row, so each of its rows is a direct
    masked softmax over its own kept keys (`_drop_rows`) on the same tile's scores.
    The pass is `_arm_setup`, then per tile `_merge_tile` (atoms, full output, region ablations)
    and `_control_tile` (the controls), then `_arm_results`.

    ``ref``: the output errors are measured against (None: this arm's own full output).
    ``k_ref``: the original K the controls' selection reads (None: ``k`` itself, the float32 arm).
    ``selections``: a `MassSelections` of the reference K, filled by the first pass and read by the
    next ones (None: every pass selects on its own).
    """
    st = _arm_setup(q, k, layout, spans, controls, k_ref, max_scores, tol, selections)
    ref_tiles = None if not controls or k_ref is None or st.cached else score_tiles(q, k_ref, query_positions, causal,
                                                                                    max_scores)
    for j, heads, qs, s, vis in score_tiles(q, k, query_positions, causal, max_scores):
        vj = v[j].to(torch.float64)
        if vis is not None:
            s = s.masked_fill(~vis, float("-inf"))
        m, z, n, full, o_ref, fn_row = _merge_tile(st, heads, qs, s, vj, ref)
        if controls:
            _control_tile(st, heads, qs, s, vis, vj, ref_tiles, m, z, n, full, o_ref, fn_row)
    return _arm_results(st)


def ablate_arm_case(case, spans, controls, k=None, v=None, *, ref=None, max_scores: int = DEFAULT_MAX_SCORES,
                    selections: MassSelections | None = None) -> tuple[ArmResult, MassResult | None]:
    """`ablate_arm` on a Case, optionally with replaced (e.g. dequantized) K and V; the controls'
    selection still reads the Case's own K (the reference attention). ``selections``: a
    `MassSelections` of ``case.k`` shared by the Case's arms."""
    return ablate_arm(case.q, case.k if k is None else k, case.v if v is None else v, case.query_positions,
                      case.causal, case.layout, spans, controls, k_ref=None if k is None or k is case.k else case.k,
                      ref=ref, max_scores=max_scores, selections=selections)


def mass_control_case(case, controls, k=None, v=None, *, ref=None, max_scores: int = DEFAULT_MAX_SCORES,
                      selections: MassSelections | None = None) -> MassResult:
    """`mass_control` on a Case; with replaced (e.g. dequantized) K and V the selection still reads
    the Case's own K (the reference attention). ``selections``: a `MassSelections` of ``case.k``
    shared by the Case's arms (each arm then selects nothing the first one did not)."""
    return mass_control(case.q, case.k if k is None else k, case.v if v is None else v, case.query_positions,
                        case.causal, case.layout, controls, k_ref=None if k is None or k is case.k else case.k, ref=ref,
                        max_scores=max_scores, selections=selections)


__all__ += ["mass_control_case", "MassSelections", "ablate_arm", "ablate_arm_case"]


# ---------------------------------------------------------------------------------------------
# per-row statistics: what the audit re-derives a case's rows from when its K/V are not archived
# ---------------------------------------------------------------------------------------------

STAT_FIELDS = ("undefined", "err2", "ref2", "dot", "out2", "own_err2", "own_ref2", "tau_sum", "tau_rows", "tv_sum",
               "tv_rows", "shift_sum", "shift_rows", "matched", "target_sum", "achieved_sum", "mismatch_sum",
               "mismatch_max", "keys_sum", "target_err2", "target_ref2")


def _sum_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head: the sum of the finite entries of ``x [H, Tq]`` and how many there are."""
    ok = torch.isfinite(x)
    return torch.where(ok, x, torch.zeros_like(x)).sum(dim=-1), ok.sum(dim=-1).to(torch.float64)


def row_statistics(names: list[str], res: ArmResult, mres: MassResult | None, regions: list[str]) -> dict:
    """The statistics of one K/V arm from which every number of its ablation rows follows.

    ``tau [A, H, Tq]`` float32: each row's dropped mass (NaN where undefined or unmatched), for the
    medians; ``heads [A, H, F]`` float64 (F = `STAT_FIELDS`): per head, the sums the row's means,
    ratios and counts are made of (squared errors, dot products, sums and counts of the per-row
    tau, TV and mean shift; for a mass-matched control also its matched rows, their target and
    achieved mass, relative mismatch sum and max, selected keys, the target's own errors on those
    rows); ``regions [R, H]`` float64: the full attention's mass on each region of ``regions``,
    summed over queries. ``A`` follows ``names`` (each in ``res`` or ``mres``)."""
    h, tq = res.dropped_mass.shape[1:]
    tau = torch.full((len(names), h, tq), float("nan"), dtype=torch.float64)
    heads = torch.zeros(len(names), h, len(STAT_FIELDS), dtype=torch.float64)
    col = {f: j for j, f in enumerate(STAT_FIELDS)}
    for a, name in enumerate(names):
        r = res if name in res.names else mres
        i = r.index(name)
        tau[a] = r.dropped_mass[i]
        out = heads[a]
        out[:, col["undefined"]] = r.undefined[i].to(torch.float64)
        for f in ("err2", "ref2", "dot", "out2", "own_err2", "own_ref2"):
            out[:, col[f]] = getattr(r, f)[i]
        for f, x in (("tau", r.dropped_mass[i]), ("tv", r.tv[i]), ("shift", r.mean_shift[i])):
            out[:, col[f"{f}_sum"]], out[:, col[f"{f}_rows"]] = _sum_rows(x)
        if r is mres:
            m = mres.matched[i]
            tm = torch.where(m, mres.target_mass[i], torch.zeros_like(mres.target_mass[i]))
            ach = torch.where(m, mres.achieved[i], torch.zeros_like(tm))
            mism = torch.where(m, (ach - tm).abs() / torch.where(m, tm, torch.ones_like(tm)), torch.zeros_like(tm))
            out[:, col["matched"]] = m.sum(dim=-1).to(torch.float64)
            out[:, col["target_sum"]] = tm.sum(dim=-1)
            out[:, col["achieved_sum"]] = ach.sum(dim=-1)
            out[:, col["mismatch_sum"]] = mism.sum(dim=-1)
            out[:, col["mismatch_max"]] = mism.amax(dim=-1)
            out[:, col["keys_sum"]] = torch.where(m, mres.keys[i], torch.zeros_like(mres.keys[i])).sum(dim=-1).double()
            out[:, col["target_err2"]] = mres.target_err2[i]
            out[:, col["target_ref2"]] = mres.target_ref2[i]
    reg = torch.stack([res.region_mass[n].sum(dim=-1) for n in regions]) if regions else torch.zeros(0, h, dtype=torch.float64)
    return {"tau": tau.to(torch.float32), "heads": heads, "regions": reg}


__all__ += ["STAT_FIELDS", "row_statistics"]
