"""A policy's middle stored by any quantizer of :mod:`testbed.quant`: ``middle = "codec"``.

The built-in middles (``"int2"`` .. ``"int8"``, ``"mxfp8"``, ``"mxfp4"``) are fixed KIVI / MX
layouts. ``middle = "codec"`` with ``codec = {"k": K's quantizer, "v": V's quantizer}`` stores the
middle with any quantizer ``testbed.quant.from_config`` can rebuild: a registered kind of the
package (dense-and-sparse outliers, a rotation, ...) or a user's own, registered with
``testbed.quant.register_kind`` before the policy is built. Each quantizer is given as its config
(``Quantizer.config()``, a JSON object with its ``"kind"``), a registered scheme name
(``testbed.quant.names()``) or a :class:`~testbed.quant.Quantizer`; the policy keeps the config,
so a row states exactly what stored its middle.

**One payload per group.** A codec middle quantizes every group of G tokens (``group``, the
tokens a flush moves out of the window at a time) as its own ``[..., G, D]`` payload, whatever
the flush size: the prefill's flush of many groups stores exactly what one group per flush would.
This is what makes any quantizer well defined in a growing cache; a quantizer whose choices span
the payload (dense-and-sparse's outliers, one per span) decides within each group. The stored
arrays hold the groups along one axis after the leading ``[B, H]``: ``x [B, H, m, D]`` is
quantized as ``[B, H, m / G, G, D]``, and each array grows along axis 2 as groups arrive
(:class:`~testbed.policies.storage.PackedSpan`).

**Bytes.** A group's bytes are its payload's, less the 16-byte header (the layer stores one). A
quantizer whose payload size depends on the values, not only on the shape, cannot be a live
middle: :func:`group_bytes` measures it on two different inputs and refuses it when they differ.

**Calibrated codebooks, one table per layer.** An ``int_codebook`` config with
``"levels": "calibrated"`` names no table: the live study calibrates one per layer (Lloyd's k-means,
:func:`testbed.quant.codebook.calibrate`) on corpus windows disjoint from the scored segments
(``live.calibration``, :mod:`testbed.live.calibration`) and hands them to the policy
(``Policy.tables``); each layer's middle is then that layer's :class:`~testbed.quant.Codebook`. The
table is not in the payloads: a layer stores it once, and its float16 bytes (:func:`table_bytes`,
set by the shape: ``D x 2**bits`` per channel, ``2**bits`` shared) count in every step's bytes.

The audit re-encodes the middle with its own encoder of the config's kind
(``testbed.audit_checks.schemes.SCHEMES``): a user's kind runs live, and its rows fail the audit
until the audit knows the kind (the error names it).
"""

from __future__ import annotations

import functools
import json

import torch

from ..quant import Quantizer, from_config, get
from ..quant.constants import HEADER_BYTES

__all__ = ["normalize", "quantizers", "group_bytes", "grouped", "ungrouped", "calibrated_parts", "table_bytes",
           "CALIBRATED"]

_PARTS = ("k", "v")
CALIBRATED = "calibrated"  # an int_codebook's levels: one table per layer, from the study's calibration


def _is_calibrated(config: dict) -> bool:
    return config.get("kind") == "int_codebook" and config.get("levels") == CALIBRATED


def _with_levels(config: dict, levels) -> dict:
    return {**config, "levels": levels}


def _payload_config(config: dict) -> dict:
    """The config whose payloads a part stores: a calibrated codebook's with NF levels in place of its tables
    (the same codes, scales and offsets, so the same bytes; the tables are not in the payload)."""
    return _with_levels(config, "nf") if _is_calibrated(config) else dict(config)


def _config_of(spec, where: str) -> dict:
    if isinstance(spec, Quantizer):
        return spec.config()
    if isinstance(spec, str):
        return get(spec).config()  # an unknown name raises, listing the registered ones
    if isinstance(spec, dict) and isinstance(spec.get("kind"), str):
        try:
            q = from_config(_payload_config(spec))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {spec!r} is not a quantizer config ({e})") from None
        return _with_levels(q.config(), CALIBRATED) if _is_calibrated(spec) else q.config()
    raise ValueError(f"{where}: a quantizer is its config (an object with a \"kind\"), a registered scheme name or "
                     f"a Quantizer, got {spec!r}")


def normalize(codec, where: str = "codec") -> dict:
    """``{"k": config, "v": config}`` of a codec given as ``{"k": .., "v": ..}`` (each a config, a
    registered name or a quantizer); raises ``ValueError`` naming what is wrong."""
    if not isinstance(codec, dict) or set(codec) != set(_PARTS):
        raise ValueError(f"{where}: a codec middle needs {{\"k\": quantizer, \"v\": quantizer}}, got {codec!r}")
    out = {part: _config_of(codec[part], f"{where}.{part}") for part in _PARTS}
    json.dumps(out, allow_nan=False)  # a row states it: it must be plain JSON
    for part in _PARTS:
        q = from_config(_payload_config(out[part]))
        if getattr(q, "table_bytes", lambda: 0)():
            raise ValueError(f"{where}.{part}: a table given in the config would serve every layer; a live middle "
                             "takes \"nf\" levels or \"calibrated\" (one table per layer from the study's "
                             "calibration, live.calibration)")
    return out


def calibrated_parts(codec: dict | None) -> tuple[str, ...]:
    """The parts (``"k"``, ``"v"``) of a normalized codec whose levels are calibrated per layer."""
    return () if codec is None else tuple(part for part in _PARTS if _is_calibrated(codec[part]))


def table_bytes(config: dict, head_dim: int) -> int:
    """Float16 bytes of one layer's calibrated table of this part (0 unless calibrated): ``[D, 2**bits]``
    for keys per channel, ``[2**bits]`` shared otherwise."""
    if not _is_calibrated(config):
        return 0
    return 2 * (1 << config["bits"]) * (head_dim if config["axis"] == "channel" else 1)


def quantizers(codec: dict, tables: dict | None = None, layer: int | None = None) -> tuple[Quantizer, Quantizer]:
    """(K's quantizer, V's quantizer) of a normalized codec; a calibrated part's is layer ``layer``'s
    codebook from ``tables`` (``{"k": [table per layer], "v": [...]}``, :mod:`testbed.live.calibration`)."""
    out = []
    for part in _PARTS:
        cfg = dict(codec[part])
        if _is_calibrated(cfg):
            if tables is None or part not in tables or layer is None:
                raise ValueError(f"codec.{part}: calibrated levels need the layer's table from the study's "
                                 "calibration (live.calibration); none was given")
            if not 0 <= layer < len(tables[part]) or tables[part][layer] is None:
                raise ValueError(f"codec.{part}: no calibrated table for layer {layer}")
            cfg = _with_levels(cfg, tables[part][layer])
        out.append(from_config(cfg))
    return out[0], out[1]


def grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[..., m, D]`` (m a multiple of ``group``) as ``[..., m / group, group, D]``: one payload per group."""
    *lead, m, d = x.shape
    if m % group:
        raise ValueError(f"a codec middle takes whole groups of {group} tokens, got {m}")
    return x.reshape(*lead, m // group, group, d)


def ungrouped(y: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`grouped`: ``[..., n, G, D]`` as ``[..., n G, D]``."""
    *lead, n, g, d = y.shape
    return y.reshape(*lead, n * g, d)


@functools.lru_cache(maxsize=64)
def _group_bytes(config: str, heads: int, group: int, head_dim: int) -> int:
    q = from_config(_payload_config(json.loads(config)))
    sizes = set()
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(heads, 1, group, head_dim, generator=gen) * (1.0 + 9.0 * seed)
        sizes.add(q.quantize(x).nbytes - HEADER_BYTES)
    if len(sizes) != 1:
        raise ValueError(f"quantizer {config}: its payload's size depends on the values ({sorted(sizes)} bytes for one "
                         f"group of [{heads}, {group}, {head_dim}]); a live middle needs a size set by the shape")
    return sizes.pop()


def group_bytes(config: dict, heads: int, group: int, head_dim: int) -> int:
    """Bytes one group of ``group`` tokens of ``heads`` KV heads stores under ``config`` (its
    payload less the header), measured on the quantizer itself and checked to depend on the shape alone."""
    return _group_bytes(json.dumps(config, sort_keys=True), heads, group, head_dim)
