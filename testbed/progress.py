"""Progress lines for long work: ``[label] k/N note: 12.3 s elapsed, ~1 min left``.

Stdlib only (the audit uses it too). A line goes to ``emit`` (a run's progress callback, which
writes to stderr and is silenced by ``--quiet``); nothing here ever writes into a run folder, so
progress can never change the evidence. The estimate of the time left is the mean time per step
so far times the steps still to do; with an unknown ``total`` only ``k`` and the elapsed time are
shown. Steps of unequal cost (a live study's quanto arms take 5-10 times as long as testbed's)
are weighted instead: each step has a cost class (``kinds``), and the time left is what the
remaining steps of each class cost (`weighted_left`).
"""

from __future__ import annotations

import sys
import time
from typing import Callable

__all__ = ["Progress", "format_seconds", "stderr_emit", "weighted_left"]


def stderr_emit(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def format_seconds(s: float) -> str:
    """``4.2 s``, ``3 min 5 s``, ``1 h 02 min``: short and readable at any scale."""
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        m, sec = divmod(int(round(s)), 60)
        return f"{m} min {sec} s" if sec else f"{m} min"
    h, m = divmod(int(round(s / 60)), 60)
    return f"{h} h {m:02d} min"


def weighted_left(done: list[tuple[str, float]], todo: dict[str, int], prior: dict[str, float] | None = None,
                  learn: bool = True) -> float | None:
    """Seconds still to go for ``todo`` ({cost class: steps left}) after ``done`` ([(class, seconds)]).

    ``prior`` gives each class's cost relative to the others (1 where absent). A class with timed
    steps costs the mean of its own steps (``learn``); any other class costs its prior times the
    seconds per unit of prior of all finished steps. Without ``learn`` (steps that ran in parallel,
    whose gaps are not their costs) every class is priced by its prior that way. None before the
    first step. A one-off cost inside a step (a compile on first use) is best left out of its
    seconds (`Progress.step`'s ``one_off``)."""
    if not done:
        return None
    prior = prior or {}
    weight = sum(prior.get(k, 1.0) for k, _ in done)
    rate = sum(s for _, s in done) / weight if weight else 0.0
    own: dict[str, list[float]] = {}
    for k, s in done:
        own.setdefault(k, []).append(s)
    left = 0.0
    for k, n in todo.items():
        if n <= 0:
            continue
        if learn and k in own:
            left += n * sum(own[k]) / len(own[k])
        else:
            left += n * prior.get(k, 1.0) * rate
    return left


class Progress:
    """Counts steps of one piece of work and emits one line per step.

    ``Progress(total, label, emit, unit="case")``; ``step(note="")`` advances by one and emits
    ``[label] case k/N note: elapsed, ~left``. ``every`` emits only every so many steps (and the
    last); ``interval`` instead emits at most one line per that many seconds (nothing for work that
    is over sooner), for thousands of small steps. ``kinds`` (the cost class of every step, as
    many as ``total``) with ``prior`` (relative costs) weights the estimate: ``step(kind=...)`` says
    which class finished (see `weighted_left`; ``learn=False`` for steps run in parallel).
    ``clock`` is injectable for tests."""

    def __init__(self, total: int | None, label: str, emit: Callable[[str], None] | None = stderr_emit, *,
                 unit: str = "", every: int = 1, interval: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter, kinds: list[str] | None = None,
                 prior: dict[str, float] | None = None, learn: bool = True):
        self.total = total
        self.unit = unit
        self.label = label
        self.emit = emit or (lambda m: None)
        self.every = max(1, int(every))
        self.interval = interval
        self.last = None
        self.clock = clock
        self.done = 0
        self.t0 = clock()
        self.todo: dict[str, int] | None = None
        if kinds is not None:
            if total is not None and len(kinds) != total:
                raise ValueError(f"{len(kinds)} step kinds for {total} steps")
            self.todo = {}
            for k in kinds:
                self.todo[k] = self.todo.get(k, 0) + 1
        self.prior = dict(prior or {})
        self.learn = learn
        self.timed: list[tuple[str, float]] = []  # (kind, seconds since the previous step)
        self.t_last = self.t0

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float | None:
        """Seconds still to go at the mean rate so far (None before the first step or without a total)."""
        if not self.total or not self.done:
            return None
        if self.todo is not None:
            return weighted_left(self.timed, self.todo, self.prior, self.learn)
        return self.elapsed() / self.done * max(0, self.total - self.done)

    def line(self, note: str = "") -> str:
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        text = f"[{self.label}] " + (f"{self.unit} " if self.unit else "") + count + (f" {note}" if note else "")
        text += f": {format_seconds(self.elapsed())} elapsed"
        left = self.left()
        if left is not None and self.done < self.total:
            text += f", ~{format_seconds(left)} left"
        return text

    def step(self, note: str = "", kind: str | None = None, one_off: float = 0.0) -> None:
        """One more step done; ``kind``: its cost class (with ``kinds``); ``one_off``: seconds of it
        that later steps of its class will not spend again (a compile on first use), left out of
        that class's cost but not out of the elapsed time."""
        self.done += 1
        if self.todo is not None:
            if kind not in self.todo:
                raise ValueError(f"a step of kind {kind!r}, not one of {sorted(self.todo)}")
            now = self.clock()
            self.timed.append((kind, max(0.0, now - self.t_last - one_off)))
            self.t_last = now
            self.todo[kind] -= 1
        if self.interval:  # at most one line per interval; the last only when the work took that long
            now = self.clock()
            if now - (self.t0 if self.last is None else self.last) >= self.interval:
                self.last = now
                self.emit(self.line(note))
            return
        if self.done % self.every == 0 or self.done == self.total:
            self.emit(self.line(note))
