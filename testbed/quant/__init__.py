"""Packed KV quantizers: one small class per scheme, every stored byte accounted for.

Registered schemes (stable names) are listed by :func:`names`; each passes the shared
property-based test matrix in ``tests/quant/``.
"""

from .base import Packed, Quantizer, from_config, get, kinds, names, register, register_kind
from .codebook import Codebook, calibrate, nf_levels
from .densesparse import DenseSparse
from .intgrouped import Int2Grouped, Int3Grouped, Int4Grouped, Int8Grouped, IntGrouped
from .mx import MX, MXFP4, MXFP8
from .residual import ResidualWindow
from .rotation import SignedHadamard

__all__ = [
    "Packed", "Quantizer", "from_config", "get", "kinds", "names", "register", "register_kind",
    "IntGrouped", "Int2Grouped", "Int3Grouped", "Int4Grouped", "Int8Grouped", "ResidualWindow",
    "MX", "MXFP8", "MXFP4", "SignedHadamard", "DenseSparse", "Codebook", "calibrate", "nf_levels",
]
