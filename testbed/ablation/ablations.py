"""What each ablation drops (see the package's docstring): the region ablations (`Full`,
`DropRegion`, `DropHistory`, `KeepCurrentOnly`), the same-size control (`control_block`, `Control`)
and the mass-matched control's seeded key orders (`mass_control_order`, `MassControl`); the
constants of the mass-matched selection; `make_ablation` by name and `kept_mask`."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from ..metrics import history_span

__all__ = ["Full", "DropRegion", "DropHistory", "KeepCurrentOnly", "Control", "MassControl", "make_ablation",
           "ABLATION_NAMES", "control_block", "mass_control_order", "kept_mask", "MASS_TOLERANCE", "MASS_ATTEMPTS"]

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
