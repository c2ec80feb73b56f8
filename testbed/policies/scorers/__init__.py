"""Token scorers: which tokens of each (layer, KV head) an evicting selection keeps.

One scorer per file, each registered under its name (as kvpress keeps one press per file). A
scorer gives every token a float32 score per (sequence, KV head); the cache keeps the ``keep``
tokens of largest score, ties to the older token, and drops the rest
(:func:`keep_top`). A scorer whose score depends only on the token itself (its key, its position)
can decide as tokens arrive; one that reads queries decides at the prefill.

- ``knorm``: the negative L2 norm of the key (Devoto et al., 2024, "A Simple and Effective L2
  Norm-Based Strategy for KV Cache Compression": low-norm keys draw attention); ignores queries.
- ``random``: a seeded content-blind control: a hash of (seed, layer, KV head, position).
- ``snapkv``: the attention of the prefill's last 64 queries, averaged, pooled over 5 neighbours and
  over the KV head's query heads; the window itself always kept (prefill only).
- ``tova``: the newest query's attention, averaged over every query head; the newest token kept
  (at the prefill, or online at every step).
- ``h2o``: the attention each token has accumulated over every query so far (online, or at the prefill).

Your own scorer: a protocol may name ``"my_scorers.py:MyScorer"``, a file relative to the protocol
and a class in it with the interface of :class:`Scorer` (a ``score`` method; ``MODES``). It runs as
a built-in one does; the audit checks its kept sets self-consistently (count, indices, the stored
K/V and the bytes), not the choice itself.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
from pathlib import Path

from . import expected_attention, h2o, knorm, random, snapkv, tova  # noqa: F401  (the built-in scorers register themselves)
from .base import MODES, SCORERS, USER_SCORER, Scorer, keep_adaptive, keep_blocks, keep_top, register

__all__ = ["Scorer", "SCORERS", "register", "get", "keep_top", "keep_blocks", "keep_adaptive", "MODES", "is_user_scorer",
           "user_file_sha256", "kept_first"]

# a user's scorer module per (resolved path, SHA-256 of its bytes): imported once, not once per layer
_LOADED: dict[tuple[str, str], object] = {}


def is_user_scorer(name: str) -> bool:
    return bool(USER_SCORER.match(name))


def get(name: str, seed: int = 0, base: Path | None = None) -> Scorer:
    """The scorer ``name``: a built-in one, or ``"file.py:Class"`` relative to ``base`` (the
    protocol's folder). Raises ``ValueError`` naming what is missing."""
    if name in SCORERS:
        return SCORERS[name](seed)
    if not is_user_scorer(name):
        raise ValueError(f"scorer {name!r} is neither a built-in one ({', '.join(SCORERS)}) nor 'file.py:Class'")
    file, cls_name = name.split(":")
    path = Path(file) if base is None else Path(base) / file
    if not path.is_file():
        raise ValueError(f"scorer {name!r}: no file {path}")
    digest = user_file_sha256(path)
    module = _LOADED.get((str(path.resolve()), digest))
    if module is None:
        spec = importlib.util.spec_from_file_location(f"testbed_user_scorer_{path.stem}_{digest[:12]}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _LOADED[(str(path.resolve()), digest)] = module
    cls = getattr(module, cls_name, None)
    if cls is None or not callable(getattr(cls, "score", None)):
        raise ValueError(f"scorer {name!r}: {path} has no class {cls_name} with a score(keys, positions, layer) method")
    inst = cls(seed) if _takes_seed(cls) else cls()
    return inst


def kept_first(name: str) -> tuple[int, int]:
    """The (first, last) prefill tokens a built-in scorer always keeps (:attr:`Scorer.KEPT_FIRST`)."""
    return tuple(getattr(SCORERS[name], "KEPT_FIRST", (0, 0)))


def user_file_sha256(path: Path) -> str:
    """SHA-256 of a user's scorer file (its bytes): what a run records of the code that chose its tokens."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _takes_seed(cls) -> bool:
    try:
        return len(inspect.signature(cls).parameters) >= 1
    except (TypeError, ValueError):
        return False


