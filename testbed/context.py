"""The run context handed to sources and analyses: where arrays go, timings, gates, progress."""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .evidence import ArrayStore

__all__ = ["RunContext", "case_fields"]

CASE_FIELDS = ("source", "distribution", "seed", "n", "model", "prompt", "layer", "chunk", "step", "layout_kind")


def case_fields(case) -> dict:
    """The identifying fields every result row carries about its case."""
    out = {"case": case.id}
    for key in CASE_FIELDS:
        if key in case.meta:
            out[key] = case.meta[key]
    return out


def _stderr_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class RunContext:
    store: ArrayStore
    study: str = ""
    timing_repeats: int = 3
    timing_seed: int = 0
    progress: Callable[[str], None] = _stderr_progress
    timings: list = field(default_factory=list)
    gates: dict = field(default_factory=dict)
    excluded: list = field(default_factory=list)
    case_arrays: dict = field(default_factory=dict)
    extra_files: dict = field(default_factory=dict)
    base: Path | None = None  # the protocol file's folder: relative paths in the protocol resolve against it
    one_off: float = 0.0  # seconds of one-off work (quanto's first-use compile): left out of progress estimates, never recorded

    def __post_init__(self):
        self.rng = random.Random(self.timing_seed)

    def timed(self, case_id: str, arm: str, op: str, repeat: int, fn):
        """Run ``fn()`` and record one raw timing entry."""
        t0 = time.perf_counter()
        out = fn()
        self.timings.append({"study": self.study, "case": case_id, "arm": arm, "op": op, "repeat": repeat,
                             "seconds": time.perf_counter() - t0})
        return out

    def shuffled(self, items: list) -> list:
        items = list(items)
        self.rng.shuffle(items)
        return items
