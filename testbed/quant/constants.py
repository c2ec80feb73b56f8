"""The run side's spec constants, each named once (the audit keeps its own copies in
``testbed/audit_checks/common.py``, written from the same specs: it never imports this package).

- OCP Microscaling Formats (MX) Specification v1.0 (Open Compute Project, September 2023): the
  concrete MX formats share one scale per block of k = 32 elements; the scale is E8M0, an 8-bit
  exponent with bias 127 and no sign or mantissa (unbiased exponents -127..127; 0xFF is NaN).
- KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"):
  keys per channel and values per token in groups of G = 32, each group with a scale and a
  zero-point (stored here as IEEE 754 binary16, whose largest finite value is 65504).
- testbed's own payload layout: every packed payload carries one ``header`` of (N tokens, D
  features) as two little-endian int64, 16 bytes.
"""

from __future__ import annotations

__all__ = ["HEADER_BYTES", "MX_BLOCK_SIZE", "E8M0_BIAS", "E8M0_NAN", "KIVI_GROUP_SIZE", "FP16_MAX"]

# testbed's payload header: (N, D) as two int64
HEADER_BYTES = 16

# OCP MX v1.0: elements per shared scale (k) of every concrete MX format
MX_BLOCK_SIZE = 32
# OCP MX v1.0, E8M0: exponent bias (a code c is the scale 2**(c - 127)); the unbiased
# exponent is clamped to [-E8M0_BIAS, E8M0_BIAS]
E8M0_BIAS = 127
# OCP MX v1.0, E8M0: the one code that is NaN (never produced by an encoder here)
E8M0_NAN = 255

# KIVI's group size G (tokens per key group, features per value group)
KIVI_GROUP_SIZE = 32
# IEEE 754 binary16: the largest finite magnitude a float16 scale or zero-point can hold
FP16_MAX = 65504.0
