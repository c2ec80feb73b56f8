"""What one K/V arm's pass returns (`ArmResult`; `MassResult` for its mass-matched controls) and the
mass-matched selections a Case's arms share (`MassSelections`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ArmResult", "MassResult", "MassSelections"]


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
