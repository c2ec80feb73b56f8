"""Bit packing of small unsigned codes into bytes, little end first.

At 4 bits two codes share a byte with the *first* code in the low nibble (the convention of
KIVI's and most CUDA kernels' int4 layouts); at 2 bits four codes share a byte, lowest bits
first; at 8 bits a code is a byte. At 3 bits eight codes share three bytes: code ``j`` of a
group of eight occupies bits ``[3j, 3j+3)`` of the group's 24-bit little-endian word, so the byte
stream is little end first as at the other widths (a code may straddle two bytes). Packing runs
along the last axis, which is padded with zero codes to a whole number of bytes,
``ceil(L * bits / 8)``; the padding is counted in ``nbytes`` like any stored byte.
"""

from __future__ import annotations

import torch

__all__ = ["pack_codes", "unpack_codes", "packed_length"]

_SUPPORTED = (1, 2, 3, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in _SUPPORTED:
        raise ValueError(f"bits must be one of {_SUPPORTED}, got {bits}")


def packed_length(n: int, bits: int) -> int:
    """Bytes needed for ``n`` codes of ``bits`` bits: ``ceil(n * bits / 8)``."""
    _check_bits(bits)
    return -(-n * bits // 8)


def _pack3(codes: torch.Tensor) -> torch.Tensor:
    n = codes.shape[-1]
    pad = (-n) % 8
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 8, 8).to(torch.int32)
    word = c[..., 0].clone()
    for j in range(1, 8):
        word |= c[..., j] << (3 * j)
    out = torch.stack([(word >> (8 * b)) & 0xFF for b in range(3)], dim=-1).to(torch.uint8)
    return out.reshape(*codes.shape[:-1], out.shape[-2] * 3)[..., :packed_length(n, 3)].contiguous()


def _unpack3(packed: torch.Tensor, n: int) -> torch.Tensor:
    nb = packed.shape[-1]
    pad = (-nb) % 3
    if pad:
        packed = torch.nn.functional.pad(packed, (0, pad))
    b = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 3, 3).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    parts = [(word >> (3 * j)) & 7 for j in range(8)]
    codes = torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], word.shape[-1] * 8).to(torch.uint8)
    return codes[..., :n]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (uint8, each < 2**bits) ``[..., L]`` -> uint8 ``[..., ceil(L*bits/8)]``."""
    _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if bits == 3:
        return _pack3(codes)
    per = 8 // bits
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
    _check_bits(bits)
    if bits == 3:
        return _unpack3(packed, n)
    per = 8 // bits
    if per == 1:
        return packed[..., :n]
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(per)]
    codes = torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)
    return codes[..., :n]
