"""Signed Hadamard rotation of the head dimension (the "signed-H128" of FP8 attention kernels).

``R = diag(s) · blockdiag(H_n, ..., H_n) / sqrt(n)`` with ``H_n`` the Sylvester Hadamard matrix
(``H_1 = [1]``, ``H_2m = [[H_m, H_m], [H_m, -H_m]]``) and ``s`` a vector of seeded random signs,
one per channel. ``R`` is orthogonal (``R Rᵀ = I``), so rotating Q and K alike leaves
``Q Kᵀ = (Q R)(K R)ᵀ`` unchanged in exact arithmetic, while an outlier channel is spread over
``n`` channels before block quantization (QuaRot, Ashkboos et al. 2024; SpinQuant; the
``signed-H128`` Q/K path of the seed study).

Block size ``n``: the head dimension ``D`` itself when it is a power of two up to 128, else 128
when ``D`` is a multiple of 128 (block-diagonal: each group of 128 channels is rotated on its
own, which keeps the rotation cheap and matches per-128 kernel tiles). Any other ``D`` is refused
with a ``ValueError``. Rotation is done in float64 and the result rounded once to the input's
dtype.

The signs come from ``torch.Generator().manual_seed(seed)`` (``randint(0, 2) * 2 - 1``, int8),
so a seed reproduces them on any machine; analyses also store the signs so that an audit can
rebuild ``R`` from its own Sylvester construction without torch.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["MAX_BLOCK", "sylvester", "rotation_block", "random_signs", "SignedHadamard"]

MAX_BLOCK = 128


@functools.lru_cache(maxsize=16)
def _sylvester_cpu(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def sylvester(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix (entries ±1, float64); ``n`` a power of two."""
    if not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n!r}")
    return _sylvester_cpu(n).to(device)


def rotation_block(dim: int) -> int:
    """Size of the Hadamard blocks for head dimension ``dim`` (see the module docstring)."""
    if isinstance(dim, int) and dim >= 1 and not dim & (dim - 1) and dim <= MAX_BLOCK:
        return dim
    if isinstance(dim, int) and dim > 0 and dim % MAX_BLOCK == 0:
        return MAX_BLOCK
    raise ValueError(
        f"signed_hadamard rotation needs a head dimension that is a power of two up to {MAX_BLOCK} "
        f"or a multiple of {MAX_BLOCK} (block-diagonal per {MAX_BLOCK}); got {dim!r}")


def random_signs(dim: int, seed: int) -> torch.Tensor:
    """``dim`` seeded random signs (int8, ±1)."""
    g = torch.Generator().manual_seed(int(seed))
    return (torch.randint(0, 2, (dim,), generator=g, dtype=torch.int64) * 2 - 1).to(torch.int8)


class SignedHadamard:
    """``x -> x R`` along the last axis, ``R = diag(signs) · blockdiag(H_n) / sqrt(n)``."""

    def __init__(self, dim: int, seed: int = 0):
        self.block = rotation_block(dim)
        self.dim = dim
        self.seed = int(seed)
        self.signs = random_signs(dim, self.seed)

    def __repr__(self) -> str:
        return f"SignedHadamard(dim={self.dim}, seed={self.seed}, block={self.block})"

    def matrix(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The dense ``[D, D]`` float64 matrix ``R`` (for tests and small dimensions)."""
        h = sylvester(self.block, device) / math.sqrt(self.block)
        r = torch.block_diag(*([h] * (self.dim // self.block)))
        return self.signs.to(device, torch.float64).unsqueeze(1) * r

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.dim:
            raise ValueError(f"rotation built for head dimension {self.dim}, got a tensor of shape {tuple(x.shape)}")

    def _blocks_times_h(self, x64: torch.Tensor) -> torch.Tensor:
        n = self.block
        h = sylvester(n, x64.device)
        y = x64.reshape(*x64.shape[:-1], self.dim // n, n) @ h
        return y.reshape(x64.shape) / math.sqrt(n)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x R`` (computed in float64, returned in ``x.dtype``)."""
        self._check(x)
        s = self.signs.to(x.device, torch.float64)
        return self._blocks_times_h(x.detach().to(torch.float64) * s).to(x.dtype)

    def invert(self, y: torch.Tensor) -> torch.Tensor:
        """``y Rᵀ`` (H is symmetric, so ``Rᵀ = blockdiag(H_n) diag(signs) / sqrt(n)``)."""
        self._check(y)
        s = self.signs.to(y.device, torch.float64)
        return (self._blocks_times_h(y.detach().to(torch.float64)) * s).to(y.dtype)
