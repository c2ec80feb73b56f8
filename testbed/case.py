"""The `Case`: the one currency between sources and analyses.

A Case holds the post-RoPE queries, keys and values of one attention call together with the
layout of the key axis (named contiguous regions in physical order, e.g. ``sink | middle |
recent | current``), the key-axis position of every query (for the causal mask) and free-form
metadata. Nothing downstream knows whether it came from the synthetic generator or a capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Region", "Case", "validate_tensor"]

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def validate_tensor(x: Any, name: str, *, rank: int | None = None, min_rank: int | None = None,
                    finite: bool = True) -> torch.Tensor:
    """Refuse anything that is not a finite, non-empty floating tensor of the expected rank.

    The error names the tensor and, for NaN/Inf, the first offending index, so a researcher can
    find the bad value without a debugger. ``finite=False`` skips the finiteness scan, for callers
    (the fused kernels) that detect non-finite values during their own pass and then call again.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if rank is not None and x.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank}, got shape {tuple(x.shape)}")
    if min_rank is not None and x.dim() < min_rank:
        raise ValueError(f"{name}: expected at least rank {min_rank}, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{name}: tensor is empty (shape {tuple(x.shape)})")
    if not finite:
        return x
    ok = torch.isfinite(x)
    if not bool(ok.all()):
        bad = torch.nonzero(~ok, as_tuple=False)[0].tolist()
        value = x[tuple(bad)].item()
        raise ValueError(f"{name}: non-finite value {value} at index {tuple(bad)}")
    if x.dtype.itemsize > 4:
        # Everything downstream stores and quantizes float32: a float64 value beyond its range would
        # silently become Inf (or a saturated code) there instead of being refused here.
        over = x.abs() > _FLOAT32_MAX
        if bool(over.any()):
            bad = torch.nonzero(over, as_tuple=False)[0].tolist()
            raise ValueError(f"{name}: value {x[tuple(bad)].item():.6g} at index {tuple(bad)} is outside the float32 "
                             f"range (|x| <= {_FLOAT32_MAX:.6g})")
    return x


@dataclass(frozen=True)
class Region:
    """A named contiguous span ``[start, stop)`` of the key axis."""

    name: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def to_json(self) -> dict:
        return {"name": self.name, "start": self.start, "stop": self.stop}


@dataclass
class Case:
    """One attention call: ``q [H, Tq, D]``, ``k, v [H_kv, Tk, D]`` with ``H % H_kv == 0`` (GQA).

    ``query_positions[i]`` is the key-axis index of query ``i``; with ``causal=True`` query ``i``
    sees keys ``0 .. query_positions[i]``. ``layout`` covers ``[0, Tk)`` with contiguous regions.
    ``token_ids`` (optional, 1-D integer) are the input tokens a model read to produce the case
    (a capture); they are stored with the case so the audit can check them against their hash.
    ``archive_kv_heads``: which arrays the evidence keeps. None (the default) keeps q, k and v; a
    list keeps only those KV heads with their query heads (possibly none), and the analyses store
    per-row statistics of every head instead, from which the audit re-derives the case's rows.
    """

    id: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    query_positions: torch.Tensor
    causal: bool
    layout: tuple[Region, ...]
    tokens_per_frame: int | None = None
    meta: dict = field(default_factory=dict)
    token_ids: torch.Tensor | None = None
    archive_kv_heads: list[int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id or "/" in self.id or ".." in self.id or not self.id.isprintable():
            raise ValueError(f"case id {self.id!r} must be a non-empty printable name without '/' or '..'")
        if not isinstance(self.causal, bool):
            raise ValueError(f"{self.id}: causal must be True or False, got {self.causal!r}")
        if not isinstance(self.meta, dict):
            raise ValueError(f"{self.id}: meta must be a dict, got {type(self.meta).__name__}")
        if self.tokens_per_frame is not None and (not isinstance(self.tokens_per_frame, int)
                                                  or isinstance(self.tokens_per_frame, bool)):
            raise ValueError(f"{self.id}: tokens_per_frame must be an integer or None, got {self.tokens_per_frame!r}")
        validate_tensor(self.q, f"{self.id}.q", rank=3)
        validate_tensor(self.k, f"{self.id}.k", rank=3)
        validate_tensor(self.v, f"{self.id}.v", rank=3)
        h, tq, d = self.q.shape
        hkv, tk, dk = self.k.shape
        if self.v.shape != self.k.shape:
            raise ValueError(f"{self.id}: k {tuple(self.k.shape)} and v {tuple(self.v.shape)} differ in shape")
        if dk != d:
            raise ValueError(f"{self.id}: head dim of q ({d}) and k ({dk}) differ")
        if h % hkv != 0:
            raise ValueError(f"{self.id}: {h} query heads are not a multiple of {hkv} KV heads")
        qp = self.query_positions
        if not isinstance(qp, torch.Tensor) or qp.dim() != 1 or qp.numel() != tq or qp.is_floating_point():
            raise ValueError(f"{self.id}: query_positions must be an integer tensor of shape [{tq}]")
        if int(qp.min()) < 0 or int(qp.max()) >= tk:
            raise ValueError(f"{self.id}: query_positions must lie in [0, {tk})")
        ids = self.token_ids
        if ids is not None and (not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point()
                                or ids.dtype == torch.bool or ids.numel() == 0):
            raise ValueError(f"{self.id}: token_ids must be a non-empty 1-D integer tensor or None")
        arch = self.archive_kv_heads
        if arch is not None:
            if (not isinstance(arch, list) or len(set(arch)) != len(arch)
                    or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < hkv for x in arch)):
                raise ValueError(f"{self.id}: archive_kv_heads must be a list of distinct KV heads in [0, {hkv}) or None, "
                                 f"got {arch!r}")
            self.archive_kv_heads = sorted(arch)
        self.layout = tuple(self.layout)
        pos = 0
        names = set()
        for r in self.layout:
            if not isinstance(r, Region) or not isinstance(r.name, str) or not all(
                    isinstance(b, int) and not isinstance(b, bool) for b in (r.start, r.stop)):
                raise ValueError(f"{self.id}: layout entries must be Region(name: str, start: int, stop: int), got {r!r}")
            if r.start != pos or r.stop < r.start:
                raise ValueError(f"{self.id}: layout is not contiguous at region {r.name!r} "
                                 f"({r.start}..{r.stop}, expected start {pos})")
            if r.name in names:
                raise ValueError(f"{self.id}: region {r.name!r} appears twice in the layout")
            names.add(r.name)
            pos = r.stop
        if pos != tk:
            raise ValueError(f"{self.id}: layout covers [0, {pos}) but the key axis has {tk} keys")
        if self.tokens_per_frame is not None and (self.tokens_per_frame <= 0 or tk % self.tokens_per_frame):
            raise ValueError(f"{self.id}: tokens_per_frame={self.tokens_per_frame} does not divide {tk} keys")

    @property
    def heads(self) -> int:
        return self.q.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[0]

    @property
    def keys(self) -> int:
        return self.k.shape[1]

    @property
    def head_map(self) -> list[int]:
        """KV head used by each query head (GQA: consecutive query heads share a KV head)."""
        group = self.heads // self.kv_heads
        return [h // group for h in range(self.heads)]

    def region(self, name: str) -> Region | None:
        for r in self.layout:
            if r.name == name:
                return r
        return None

    def layout_json(self) -> list[dict]:
        return [r.to_json() for r in self.layout]
