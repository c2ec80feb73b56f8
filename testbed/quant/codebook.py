"""Non-uniform codebooks over KIVI groups: each element a ``bits``-bit index into a table of levels.

The grouping is KIVI's (as :class:`~testbed.quant.intgrouped.IntGrouped` forms it, edge padding
included): keys per channel (``axis = "channel"``, groups of G consecutive tokens of one feature),
values per token (``axis = "token"``, groups of G consecutive features of one token). Per group,
in float32, the group's range is mapped affinely onto [-1, 1]:

- ``offset = (max + min) * 0.5`` and ``scale = (max - min) * 0.5``, each rounded to float16 (an
  offset as +0 for a zero), stored as ``offset`` and ``scale``;
- ``u = (x - offset16) / scale16`` (float32), and the code is the index of the table's level
  nearest to ``u``: the number of midpoints ``(l[i] + l[i+1]) / 2`` (exact in float64) strictly
  below ``u``, so a tie goes to the lower level. A group of zero float16 scale stores code 0;
- decoding is ``l[code] * scale16 + offset16`` in float32 (the product of two float16 values is
  exact in float32), so every decoded value lies in the table's image under its group's map.

The table (``levels``) has ``2**bits`` strictly increasing float16 values in [-1, 1]:

- ``"nf"``: the NormalFloat levels (QLoRA, Dettmers et al., 2023, its construction with an exact
  zero), the content-blind control. With ``n = 2**bits``, ``p = 1 - (1 / (2n) + 1 / (2(n - 1))) / 2``
  (QLoRA's 0.9677 at n = 16), ``Phi^-1`` the standard normal quantile: the ``n/2`` positive levels
  ``Phi^-1(p + (1/2 - p) i / (n/2))`` for ``i = 0 .. n/2 - 1``, the ``n/2 - 1`` negative levels
  ``-Phi^-1(p + (1/2 - p) i / (n/2 - 1))`` for ``i = 0 .. n/2 - 2``, and 0; all divided by
  ``Phi^-1(p)`` (so the ends are -1 and +1), sorted and rounded to float16. Derived from ``bits``:
  nothing is stored for it (:func:`nf_levels`).
- a calibrated table (:func:`calibrate`, Lloyd's k-means): one shared table ``[2**bits]``, or for
  ``axis = "channel"`` one table per channel ``[D, 2**bits]``. Given as (nested) lists of numbers,
  each rounded to float16 on construction (so ``config()`` round-trips JSON exactly). The table is a
  parameter of the quantizer, carried in its config and **not** stored in a payload: a protocol
  amortizes it over a layer's payloads, and a caller that compares bytes counts
  :meth:`Codebook.table_bytes` (its float16 size) once per layer on top of the payloads' ``nbytes``.
  The scheme's name and label carry ``cb`` and the first 8 hex digits of the table's SHA-256
  (:func:`table_digest`), so a payload made with one table is refused by a quantizer of another.

Stored arrays (a payload's ``nbytes`` is exactly these, the int kinds' layout and byte count):

- ``codes``  uint8 ``[..., T_pad, ceil(D * bits / 8)]`` (channel) or ``[..., T, ceil(D_pad * bits / 8)]``
  (token), packed by :mod:`testbed.quant.packing`
- ``scale``, ``offset``  float16 ``[..., T_pad / G, D]`` (channel) or ``[..., T, D_pad / G]`` (token)
- ``header`` int64 ``[2]`` = (T, D)
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .base import Packed, Quantizer, check_input, make_header, register, register_kind
from .constants import FP16_MAX, KIVI_GROUP_SIZE
from .intgrouped import IntGrouped
from .packing import pack_codes, unpack_codes

__all__ = ["Codebook", "nf_levels", "calibrate", "table_digest", "CODEBOOK_BITS", "LLOYD_ITERS"]

CODEBOOK_BITS = (2, 3, 4)
LLOYD_ITERS = 25


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in CODEBOOK_BITS:
        raise ValueError(f"bits must be 2, 3 or 4, got {bits!r}")
    return bits


@functools.lru_cache(maxsize=None)
def nf_levels(bits: int) -> tuple[float, ...]:
    """The ``2**bits`` NormalFloat levels (module docstring: QLoRA's construction with an exact zero),
    float16 values as Python floats, increasing, from -1 to 1."""
    n = 1 << _check_bits(bits)
    half = n // 2
    p = 1.0 - (1.0 / (2 * n) + 1.0 / (2 * (n - 1))) / 2.0
    pos = torch.tensor([p + (0.5 - p) * i / half for i in range(half)], dtype=torch.float64)
    neg = torch.tensor([p + (0.5 - p) * i / (half - 1) for i in range(half - 1)], dtype=torch.float64)
    top = torch.special.ndtri(torch.tensor(p, dtype=torch.float64))
    vals = torch.cat([torch.special.ndtri(pos), -torch.special.ndtri(neg), torch.zeros(1, dtype=torch.float64)])
    vals = torch.sort(vals / top).values.to(torch.float16) + 0.0
    return tuple(float(v) for v in vals.tolist())


def table_digest(table: np.ndarray) -> str:
    """First 8 hex digits of SHA-256 over ``"<shape>:"`` (the table's shape as a list, e.g. ``[8]:`` or
    ``[64, 8]:``) followed by its float16 values, little-endian, in row-major order."""
    t = np.ascontiguousarray(np.asarray(table, dtype="<f2"))
    return hashlib.sha256(f"{list(t.shape)}:".encode() + t.tobytes()).hexdigest()[:8]


def _as_table(levels, bits: int, axis: str) -> tuple:
    """``levels`` (nested lists / tuples / arrays of numbers) as a tuple (of tuples) of float16 values;
    ValueError naming what is wrong."""
    n = 1 << bits
    try:
        arr = np.asarray(levels, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"levels must be 'nf' or a table of numbers, got {levels!r}") from None
    if any(isinstance(v, bool) for v in np.asarray(levels, dtype=object).ravel()):
        raise ValueError("levels must be numbers, not booleans")
    if arr.ndim == 2 and axis != "channel":
        raise ValueError(f"a per-channel table [D, {n}] needs axis='channel' (a shared table [{n}] for axis={axis!r})")
    if arr.ndim not in (1, 2) or arr.shape[-1] != n or arr.size == 0:
        raise ValueError(f"a {bits}-bit table has shape [{n}] (shared) or [D, {n}] (per channel, axis='channel'), "
                         f"got {list(arr.shape)}")
    if not np.all(np.isfinite(arr)):
        raise ValueError("levels must be finite")
    t16 = arr.astype(np.float16) + np.float16(0.0)
    if np.any(np.abs(t16) > 1):
        raise ValueError("levels must lie in [-1, 1] (the groups are normalized onto [-1, 1])")
    if np.any(np.diff(t16.astype(np.float64), axis=-1) <= 0):
        raise ValueError("levels must be strictly increasing after rounding to float16")
    if arr.ndim == 1:
        return tuple(float(v) for v in t16.tolist())
    return tuple(tuple(float(v) for v in row) for row in t16.tolist())


@dataclass(frozen=True)
class Codebook(Quantizer):
    """``bits``-bit indices into a table of levels (``"nf"`` or calibrated) over KIVI groups along ``axis``."""

    KIND: ClassVar[str] = "int_codebook"
    bits: int = 3
    group_size: int = KIVI_GROUP_SIZE
    axis: str = "channel"
    levels: str | tuple = "nf"

    def __post_init__(self):
        _check_bits(self.bits)
        IntGrouped(self.bits, self.group_size, self.axis)  # the grouping's rules and errors
        if isinstance(self.levels, str):
            if self.levels != "nf":
                raise ValueError(f"levels must be 'nf' or a table of numbers, got {self.levels!r}")
        else:
            object.__setattr__(self, "levels", _as_table(self.levels, self.bits, self.axis))

    def config(self) -> dict:
        """The dataclass's config, a calibrated table as (nested) lists, so that it equals its JSON copy."""
        cfg = super().config()
        if not isinstance(self.levels, str):
            cfg["levels"] = self.table.tolist()
        return cfg

    @property
    def grid(self) -> IntGrouped:
        """The grouped-integer scheme of the same bits, group and axis: its grouping, its byte layout."""
        return IntGrouped(self.bits, self.group_size, self.axis)

    @property
    def table(self) -> np.ndarray:
        """The levels as float64 ``[2**bits]`` or ``[D, 2**bits]`` (each a float16 value)."""
        if isinstance(self.levels, str):
            return np.array(nf_levels(self.bits), dtype=np.float64)
        return np.array(self.levels, dtype=np.float64)

    @property
    def tag(self) -> str:
        return "nf" if isinstance(self.levels, str) else f"cb{table_digest(self.table)}"

    @property
    def name(self) -> str:
        return f"int{self.bits}_{self.tag}_{self.axis}_g{self.group_size}"

    @property
    def label(self) -> str:
        """Bits, the table (``nf`` or ``cb`` and its digest) and group size; the axis is the layout's."""
        return f"int{self.bits}_{self.tag}_g{self.group_size}"

    def table_bytes(self) -> int:
        """The calibrated table's float16 bytes (0 for ``"nf"``, derived from ``bits``): not in any
        payload's ``nbytes``; a caller counts it once for all the payloads that share the quantizer."""
        return 0 if isinstance(self.levels, str) else 2 * self.table.size

    def _levels_for(self, d: int, device) -> torch.Tensor:
        """The table as float64 ``[n]`` or ``[d, n]``; a per-channel table of another width is refused."""
        t = self.table
        if t.ndim == 2 and t.shape[0] != d:
            raise ValueError(f"{self.name}: its per-channel table has {t.shape[0]} channels, the input has {d}")
        return torch.from_numpy(t).to(device)

    def quantize_reference(self, x: torch.Tensor, *, name: str = "x") -> Packed:
        check_input(x, name)
        n, d = x.shape[-2], x.shape[-1]
        lv = self._levels_for(d, x.device)
        grouped = self.grid.grouped(x.detach().to(torch.float32))
        red = -2 if self.axis == "channel" else -1
        mn, mx = grouped.amin(dim=red), grouped.amax(dim=red)
        scale16 = ((mx - mn) * 0.5).to(torch.float16)
        offset16 = ((mx + mn) * 0.5 + 0.0).to(torch.float16)  # + 0.0: a zero offset is stored as +0
        if bool(torch.isinf(scale16).any()) or bool(torch.isinf(offset16).any()):
            raise ValueError(f"{name}: a group's range or midpoint exceeds float16 (above {FP16_MAX:g}); the "
                             "float16 scale/offset cannot represent it")
        s = scale16.to(torch.float32).unsqueeze(red)
        z = offset16.to(torch.float32).unsqueeze(red)
        live = s > 0
        u = ((grouped - z) / torch.where(live, s, torch.ones_like(s))).to(torch.float64)
        mid = (lv[..., 1:] + lv[..., :-1]) * 0.5  # exact: two float16 values
        codes = (u.unsqueeze(-1) > mid).sum(-1)  # a per-channel table [D, n-1] lines up with the channel axis
        codes = torch.where(live, codes, torch.zeros_like(codes)).to(torch.uint8)
        codes = codes.reshape(*codes.shape[:-3], -1, d) if self.axis == "channel" else codes.reshape(
            *codes.shape[:-2], -1)
        tensors = {"codes": pack_codes(codes, self.bits), "scale": scale16, "offset": offset16,
                   "header": make_header(n, d, x.device)}
        return Packed(self.name, tuple(x.shape), x.dtype, tensors, self.config())

    def dequantize(self, p: Packed) -> torch.Tensor:
        self._check_packed(p)
        *lead, n, d = p.shape
        g = self.group_size
        lv = self._levels_for(d, p.tensors["scale"].device).to(torch.float32)
        scale = p.tensors["scale"].to(torch.float32)
        offset = p.tensors["offset"].to(torch.float32)
        if self.axis == "channel":
            n_pad = scale.shape[-2] * g
            codes = unpack_codes(p.tensors["codes"], self.bits, d).to(torch.int64).reshape(*lead, n_pad, d)
            vals = lv[codes] if lv.dim() == 1 else lv[torch.arange(d, device=codes.device), codes]
            x = vals.reshape(*lead, n_pad // g, g, d) * scale.unsqueeze(-2) + offset.unsqueeze(-2)
            x = x.reshape(*lead, n_pad, d)[..., :n, :]
        else:
            d_pad = scale.shape[-1] * g
            codes = unpack_codes(p.tensors["codes"], self.bits, d_pad).to(torch.int64)
            x = lv[codes].reshape(*lead, n, d_pad // g, g) * scale.unsqueeze(-1) + offset.unsqueeze(-1)
            x = x.reshape(*lead, n, d_pad)[..., :d]
        return x.to(p.dtype)


def _normalized(x: torch.Tensor, quantizer: Codebook) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u, w)`` per channel ``[D, M]`` (channel axis) or pooled ``[1, M]`` (token axis): each element's
    normalized value as the quantizer computes it (float32, then float64) and its weight ``scale16**2``
    (0 for a group of zero scale and for the edge padding)."""
    n, d = x.shape[-2], x.shape[-1]
    xf = x.detach().to(torch.float32).reshape(-1, n, d)
    grouped = quantizer.grid.grouped(xf)
    red = -2 if quantizer.axis == "channel" else -1
    mn, mx = grouped.amin(dim=red, keepdim=True), grouped.amax(dim=red, keepdim=True)
    s = ((mx - mn) * 0.5).to(torch.float16).to(torch.float32)
    z = ((mx + mn) * 0.5 + 0.0).to(torch.float16).to(torch.float32)
    if bool(torch.isinf(s).any()) or bool(torch.isinf(z).any()):
        raise ValueError("calibrate: a group's range or midpoint exceeds float16")
    live = s > 0
    u = ((grouped - z) / torch.where(live, s, torch.ones_like(s))).to(torch.float64)
    w = torch.where(live, s.to(torch.float64) ** 2, torch.zeros_like(s, dtype=torch.float64)).expand_as(u)
    if quantizer.axis == "channel":
        u, w = (t.reshape(t.shape[0], -1, d)[:, :n, :] for t in (u, w))
        return u.permute(2, 0, 1).reshape(d, -1), w.permute(2, 0, 1).reshape(d, -1)
    u, w = (t.reshape(t.shape[0], n, -1)[..., :d] for t in (u, w))
    return u.reshape(1, -1), w.reshape(1, -1)


def _next16(v: float, up: bool) -> float:
    """The float16 neighbour of the float16 value ``v`` (up or down)."""
    return float(np.nextafter(np.float16(v), np.float16(np.inf if up else -np.inf)))


def _strict16(row: np.ndarray) -> list[float]:
    """Centres (float64, increasing, in [-1, 1]) rounded to float16 and made strictly increasing: from the
    bottom, a level not above its predecessor moves to the next float16 value up; then from the top, a
    level above 1 (or not below its successor) moves to the next one down."""
    t = [float(np.float16(v)) + 0.0 for v in row]
    for i in range(1, len(t)):
        if t[i] <= t[i - 1]:
            t[i] = _next16(t[i - 1], up=True)
    t[-1] = min(t[-1], 1.0)
    for i in range(len(t) - 2, -1, -1):
        if t[i] >= t[i + 1]:
            t[i] = _next16(t[i + 1], up=False)
    return [v + 0.0 for v in t]


def calibrate(x: torch.Tensor, bits: int, axis: str = "channel", group: int = KIVI_GROUP_SIZE,
              iters: int = LLOYD_ITERS) -> list:
    """A calibrated table for ``Codebook(bits, group, axis, levels=table)`` from the tensor ``x [..., T, D]``:
    ``[D][2**bits]`` (one table per channel) for ``axis = "channel"``, ``[2**bits]`` (shared) for ``"token"``.

    Lloyd's k-means in float64 on the values as the quantizer normalizes them (its groups, float16
    offset and scale), each weighted by its group's squared float16 scale, so that the objective is
    the squared error in ``x``'s units; the edge padding and groups of zero scale weigh nothing.
    Deterministic: the ``n = 2**bits`` centres start at the (unweighted) sample quantiles, the sorted
    weighted values' elements ``floor((i + 1/2) M / n)`` of ``M``; then ``iters`` rounds of: assign each
    value to its nearest centre (the quantizer's rule: the count of midpoints strictly below it, ties
    to the lower centre), move each centre to its cluster's weighted mean (an empty cluster, or one of
    zero weight, keeps its centre). The centres, clipped to [-1, 1], are rounded to float16 and made
    strictly increasing (a level equal to its predecessor moves to the next float16 value up, then from
    the top down where that passed 1). A channel with no weighted value gets the uniform table
    ``linspace(-1, 1, n)``."""
    _check_bits(bits)
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"iters must be a non-negative int, got {iters!r}")
    q = Codebook(bits, group, axis)  # validates group and axis
    check_input(x, "calibrate: x")
    u, w = _normalized(x, q)
    n = 1 << bits
    rows = []
    for ur, wr in zip(u, w):
        keep = wr > 0
        uk, wk = ur[keep], wr[keep]
        m = uk.numel()
        if m == 0:
            rows.append(np.linspace(-1.0, 1.0, n))
            continue
        srt = torch.sort(uk).values
        centres = srt[[min(m - 1, math.floor((i + 0.5) * m / n)) for i in range(n)]].clone()
        for _ in range(iters):
            mid = (centres[1:] + centres[:-1]) * 0.5
            idx = torch.searchsorted(mid, uk)  # the count of midpoints strictly below (centres stay sorted)
            mass = torch.zeros(n, dtype=torch.float64).index_add_(0, idx, wk)
            moment = torch.zeros(n, dtype=torch.float64).index_add_(0, idx, wk * uk)
            centres = torch.where(mass > 0, moment / torch.where(mass > 0, mass, torch.ones_like(mass)), centres)
        rows.append(centres.clamp(-1.0, 1.0).numpy())
    tables = [_strict16(np.asarray(r)) for r in rows]
    return tables if axis == "channel" else tables[0]


register_kind("int_codebook", Codebook)
for _bits, _axis in ((2, "channel"), (3, "channel"), (3, "token"), (4, "token")):
    register(f"int{_bits}_nf_{_axis}_g32", (lambda b=_bits, a=_axis: Codebook(b, 32, a)))


def _registered_table() -> list:
    """A fixed calibrated table for the property matrix: 3 bits, per token in groups of 32, from 64 x 128
    Laplace draws (a heavier tail than the Gaussian NF assumes) of the generator seeded 46."""
    g = torch.Generator().manual_seed(46)
    e = torch.rand(64, 128, generator=g, dtype=torch.float64)
    signs = torch.where(torch.rand(64, 128, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
    return calibrate((signs * -torch.log1p(-e)).to(torch.float32), 3, "token", 32)


_CALIBRATED = Codebook(3, 32, "token", _registered_table())
register(_CALIBRATED.name, lambda: _CALIBRATED)
