"""The live study's calibration: one codebook per layer from corpus text the study never scores.

A codec middle whose ``int_codebook`` levels are ``"calibrated"`` (:mod:`testbed.policies.codec`)
gets its tables here, before any arm runs, from ``live.calibration = {"windows": C}`` (and
optionally ``"tokens": T``, the window's length, the prefill's by default):

- **Where the text comes from.** The scored segments start every ``stride = corpus tokens //
  segments`` tokens and hold ``length = prefill + steps + 1`` of them. Calibration window ``c``
  (``c = 0 .. C - 1``) is the ``T`` tokens that end where segment ``c + 1`` would start:
  ``[(c + 1) stride - T, (c + 1) stride)``. With ``stride >= length + T`` (refused
  otherwise) each window lies in the gap after segment ``c``, so it overlaps no segment of the study
  (whatever ``segment_range`` a part of a split study runs: every part calibrates on the same
  windows and gets the same tables).
- **What is calibrated.** The windows go through one float32 prefill (:func:`shared_prefill`); per
  layer, each calibrated part's input is what that layer's middle would store: V, and K post-RoPE or,
  for ``key_rope = "pre"``, un-rotated with the layer's own rotary ``(cos, sin)`` as the layer does.
  :func:`testbed.quant.codebook.calibrate` (weighted Lloyd's k-means over the codebook's own groups)
  turns it into the layer's table: ``[D, 2**bits]`` for keys per channel (shared by the layer's KV
  heads), ``[2**bits]`` shared otherwise.
- **What is stored.** Each calibrated arm's rows carry its tables as arrays (``codebook.k`` ``[L, D,
  n]``, ``codebook.v`` ``[L, n]`` float16) and, on its evidence row, the evidence layer's calibration
  input (``calibration.k`` / ``calibration.v`` ``[C, H, P, D]`` float32), from which the audit runs
  the k-means again; the live manifest records the windows (``calibration``: starts, tokens and the
  SHA-256 of their token ids), which the audit checks are disjoint from every scored segment.

Only models whose layers are all full attention are served (a sliding layer stores no middle).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from ..policies.policy import Policy
from ..schema import ProtocolError
from .corpus import segment_stride

__all__ = ["windows", "calibrate_tables", "tables_arrays", "window_record"]


def windows(n_tokens: int, segments: int, length: int, prefill: int, count: int) -> list[int]:
    """Starts of the ``count`` calibration windows of ``prefill`` (the window's T) tokens (module docstring);
    ``ProtocolError`` when they would not fit between the scored segments."""
    stride = segment_stride(n_tokens, segments)
    if stride < length + prefill:
        raise ProtocolError(f"live.calibration: the corpus has {n_tokens} tokens; {segments} segments of {length} "
                            f"tokens leave gaps of {stride - length}, and a calibration window needs {prefill} "
                            "in a gap: use fewer segments, a shorter context or calibration.tokens")
    if not 1 <= count <= segments:
        raise ProtocolError(f"live.calibration.windows must be 1..{segments} (one per gap), got {count}")
    return [(c + 1) * stride - prefill for c in range(count)]


def _inputs(shared, layer: int, key_rope: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(K as the layer's middle stores it, V) of one layer's calibration prefill, float32 ``[C, H, P, D]``."""
    from ..policies.rope import rope_unrotate

    k = shared.keys[layer].detach().to(torch.float32)
    if key_rope == "pre":
        cos, sin = shared.rope[layer]
        k = rope_unrotate(k, cos, sin)
    return k.contiguous(), shared.values[layer].detach().to(torch.float32).contiguous()


def calibrate_tables(model, kw, ids: torch.Tensor, policies: list[Policy], record_layer: int | None,
                     progress=None) -> tuple[dict, dict]:
    """Per calibrated policy (by name) its tables ``{"k": [table per layer], "v": [...]}`` for its
    calibrated parts, and its evidence layer's calibration input ``{"k": .., "v": ..}`` (or None),
    from one float32 prefill of the windows ``ids [C, P]``. Policies of one codec and key placement
    share their tables."""
    from ..quant.codebook import calibrate
    from .prefill import shared_prefill

    todo = [pol for pol in policies if pol.calibrated]
    if not todo:
        return {}, {}
    shared, _ = shared_prefill(model, kw, ids, rope=any(pol.key_rope == "pre" for pol in todo))
    n_layers = len(shared.keys)
    done: dict = {}
    tables, samples = {}, {}
    for pol in todo:
        sig = json.dumps([pol.codec, pol.key_rope, list(pol.calibrated)], sort_keys=True)
        if sig not in done:
            out = {part: [] for part in pol.calibrated}
            for i in range(n_layers):
                k, v = _inputs(shared, i, pol.key_rope)
                for part in pol.calibrated:
                    c = pol.codec[part]
                    out[part].append(calibrate(k if part == "k" else v, c["bits"], c["axis"], c["group_size"]))
                if progress is not None and (i + 1) % 10 == 0:
                    progress(f"calibration of {pol.name}: {i + 1}/{n_layers} layers")
            done[sig] = out
        tables[pol.name] = done[sig]
        if record_layer is not None:
            k, v = _inputs(shared, record_layer, pol.key_rope)
            samples[pol.name] = {"k": k, "v": v}
    return tables, samples


def tables_arrays(tables: dict) -> dict[str, np.ndarray]:
    """A policy's tables as float16 arrays: ``codebook.k`` ``[L, D, n]`` (or ``[L, n]``), ``codebook.v``."""
    return {f"codebook.{part}": np.asarray(t, dtype=np.float16) for part, t in tables.items()}


def window_record(starts: list[int], prefill: int, ids: torch.Tensor) -> dict:
    """The live manifest's record of the calibration windows."""
    return {"starts": [int(s) for s in starts], "tokens": int(prefill),
            "token_ids_sha256": [hashlib.sha256(row.to(torch.int32).numpy().tobytes()).hexdigest() for row in ids]}
