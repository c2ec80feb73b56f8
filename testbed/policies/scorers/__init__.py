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

import importlib.util
import re
from pathlib import Path
from typing import ClassVar

import torch

__all__ = ["Scorer", "SCORERS", "register", "get", "keep_top", "MODES", "is_user_scorer", "user_file_sha256"]

# when a scorer decides: once, on the prefill (kvpress's compression), or at every token as it arrives
MODES = ("prefill", "online")
SCORERS: dict[str, type] = {}
_USER = re.compile(r"^[^:]+\.py:[A-Za-z_][A-Za-z0-9_]*$")


class Scorer:
    """The interface of a token scorer. ``MODES``: the modes of :data:`MODES` it supports.

    A scorer of the token alone (``ATTENTION = False``): ``score(keys, positions, layer)``: ``keys
    [B, H, T, D]`` float32 post-RoPE keys of ``T`` tokens at ``positions [T]`` (int64, their index in
    the sequence), of layer ``layer``; returns ``[B, H, T]`` float32, larger kept first.

    A scorer of attention (``ATTENTION = True``): ``attention_score(query, keys, scale, previous,
    received)`` after each attention call it decides on: ``query [B, H_q, q, D]`` the call's last
    ``QUERIES`` queries (all of them when ``QUERIES`` is 0), ``keys [B, H, n, D]`` every key they
    attended (held ones first, the call's own last), ``previous [B, H, n]`` float32 the held keys'
    stored scores (0 for the call's own), ``received [B, H, n]`` float64 the attention each key
    received over all of the call's queries and the KV head's query heads; returns ``[B, H, n]``
    float32."""

    NAME: ClassVar[str] = ""
    MODES: ClassVar[tuple[str, ...]] = MODES
    ATTENTION: ClassVar[bool] = False
    QUERIES: ClassVar[int] = 0

    def __init__(self, seed: int = 0):
        self.seed = seed

    def score(self, keys: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


def register(cls: type) -> type:
    """Register a built-in scorer class under its ``NAME``."""
    if not cls.NAME or cls.NAME in SCORERS:
        raise ValueError(f"scorer {cls.__name__}: NAME {cls.NAME!r} is empty or taken")
    SCORERS[cls.NAME] = cls
    return cls


def is_user_scorer(name: str) -> bool:
    return bool(_USER.match(name))


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
    module = _LOADED.get((str(path.resolve()), digest))  # one import per file content, not one per layer
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


_LOADED: dict[tuple[str, str], object] = {}


def user_file_sha256(path: Path) -> str:
    """SHA-256 of a user's scorer file (its bytes): what a run records of the code that chose its tokens."""
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _takes_seed(cls) -> bool:
    import inspect

    try:
        return len(inspect.signature(cls).parameters) >= 1
    except (TypeError, ValueError):
        return False


def keep_top(score: torch.Tensor, keep: int) -> torch.Tensor:
    """Positions along the last axis of the ``keep`` largest scores, ties to the earlier position,
    in ascending order (the tokens must lie along that axis in the order they arrived)."""
    if score.shape[-1] <= keep:
        return torch.arange(score.shape[-1], device=score.device).expand(score.shape)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :keep]
    return torch.sort(order, dim=-1).values  # ascending position = ascending index


from . import h2o, knorm, random, snapkv, tova  # noqa: E402,F401  (the built-in scorers register themselves)
