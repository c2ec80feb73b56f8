"""Progress lines for long work: ``[label] k/N note: 12.3 s elapsed, ~1 min left``.

Stdlib only (the audit uses it too). A line goes to ``emit`` (a run's progress callback, which
writes to stderr and is silenced by ``--quiet``); nothing here ever writes into a run folder, so
progress can never change the evidence. The estimate of the time left is the mean time per step
so far times the steps still to do; with an unknown ``total`` only ``k`` and the elapsed time are
shown.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

__all__ = ["Progress", "format_seconds", "stderr_emit"]


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


class Progress:
    """Counts steps of one piece of work and emits one line per step.

    ``Progress(total, label, emit, unit="case")``; ``step(note="")`` advances by one and emits
    ``[label] case k/N note: elapsed, ~left``. ``every`` emits only every so many steps (and the
    last); ``interval`` instead emits at most one line per that many seconds (nothing for work that
    is over sooner), for thousands of small steps. ``clock`` is injectable for tests."""

    def __init__(self, total: int | None, label: str, emit: Callable[[str], None] | None = stderr_emit, *,
                 unit: str = "", every: int = 1, interval: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter):
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

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float | None:
        """Seconds still to go at the mean rate so far (None before the first step or without a total)."""
        if not self.total or not self.done:
            return None
        return self.elapsed() / self.done * max(0, self.total - self.done)

    def line(self, note: str = "") -> str:
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        text = f"[{self.label}] " + (f"{self.unit} " if self.unit else "") + count + (f" {note}" if note else "")
        text += f": {format_seconds(self.elapsed())} elapsed"
        left = self.left()
        if left is not None and self.done < self.total:
            text += f", ~{format_seconds(left)} left"
        return text

    def step(self, note: str = "") -> None:
        self.done += 1
        if self.interval:  # at most one line per interval; the last only when the work took that long
            now = self.clock()
            if now - (self.t0 if self.last is None else self.last) >= self.interval:
                self.last = now
                self.emit(self.line(note))
            return
        if self.done % self.every == 0 or self.done == self.total:
            self.emit(self.line(note))
