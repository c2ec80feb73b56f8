"""Bit packing of small unsigned codes into bytes, little end first.

At 4 bits two codes share a byte with the *first* code in the low nibble (the convention of
KIVI's and most CUDA kernels' int4 layouts); at 2 bits four codes share a byte, lowest bits
first; at 8 bits a code is a byte. Packing runs along the last axis, which is padded with zero
codes to a whole number of bytes; the padding is counted in ``nbytes`` like any stored byte.
"""

from __future__ import annotations

import torch

__all__ = ["pack_codes", "unpack_codes", "packed_length"]

_SUPPORTED = (1, 2, 4, 8)


def _per_byte(bits: int) -> int:
    if bits not in _SUPPORTED:
        raise ValueError(f"bits must be one of {_SUPPORTED}, got {bits}")
    return 8 // bits


def packed_length(n: int, bits: int) -> int:
    """Bytes needed for ``n`` codes of ``bits`` bits."""
    per = _per_byte(bits)
    return -(-n // per)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (uint8, each < 2**bits) ``[..., L]`` -> uint8 ``[..., ceil(L*bits/8)]``."""
    per = _per_byte(bits)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if per == 1:
        return codes.contiguous()
    n = codes.shape[-1]
    pad = (-n) % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    c = codes.reshape(*codes.shape[:-1], -1, per)
    out = c[..., 0].clone()
    for j in range(1, per):
        out |= c[..., j] << (bits * j)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``[..., B]`` uint8 -> ``[..., n]`` uint8 codes."""
    per = _per_byte(bits)
    if per == 1:
        return packed[..., :n]
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(per)]
    codes = torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)
    return codes[..., :n]
