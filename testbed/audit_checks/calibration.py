"""The audit of calibrated codebooks in the live study (a codec middle whose ``int_codebook`` levels
are ``"calibrated"``), written again from docs/live.md's definition:

- **The windows.** ``live.calibration = {"windows": C, "tokens": T}`` (T the prefill by default):
  window ``c`` is the T tokens ``[(c + 1) stride - T, (c + 1) stride)`` with ``stride = corpus tokens // segments``. The
  live manifest's record must be exactly these starts, each window disjoint from every segment of
  the study ``[i stride, i stride + prefill + steps + 1)`` (all of them, whatever ``segment_range``
  this run decodes), and the stored token ids must match the recorded SHA-256.
- **The tables.** Each calibrated arm's rows carry ``codebook.k`` / ``codebook.v``: ``[L, D, 2**bits]``
  (per channel) or ``[L, 2**bits]`` float16, each table strictly increasing in [-1, 1]. On the evidence
  row the evidence layer's table is computed again, by Lloyd's k-means as below, from the stored
  calibration input (``calibration.k`` / ``calibration.v``, ``[C, H, T, D]`` float32, C and T the
  manifest's windows), and must agree within ``TOLERANCES["codebook_lloyd"]`` per level (the two
  sides sum in different orders); the middle
  is then re-encoded with that stored table (:mod:`live_evidence`).
- **The k-means** (the run's ``testbed.quant.codebook.calibrate``, restated): the input grouped as the
  codebook groups it (keys per channel over G tokens, values per token over G features, edge padding),
  each value normalized by its group's float16 offset and scale, ``u = (x - offset16) / scale16``,
  weighted by ``scale16**2`` (a group of zero scale and the padding weigh nothing); per channel
  (channel axis) or pooled (token axis). The ``n`` centres start at the sorted weighted values'
  elements ``floor((i + 1/2) M / n)``; 25 rounds assign each value to the centres' midpoints (the count
  strictly below it) and move each centre to its cluster's weighted mean (an empty cluster keeps its
  centre); then clipped to [-1, 1], rounded to float16 and made strictly increasing (upwards from the
  bottom, then downwards from the top). A channel with no weighted value gets ``linspace(-1, 1, n)``.

What is not re-derived: that the calibration input is the model's K / V on those windows (the audit
runs no model), and the tables of layers other than the evidence layer (stored, checked for shape and
order only).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from .common import TOLERANCES
from .schemes import codebook_normalized

__all__ = ["CALIBRATED", "is_calibrated", "payload_config", "calibrated_parts", "table_bytes", "layer_tables", "lloyd",
           "check_tables", "check_windows"]

CALIBRATED = "calibrated"
LLOYD_ROUNDS = 25  # the run's testbed.quant.codebook.LLOYD_ITERS (tests/test_spec_constants.py holds them equal)


def is_calibrated(cfg) -> bool:
    """Whether a quantizer config is a codebook whose levels are calibrated per layer."""
    return isinstance(cfg, dict) and cfg.get("kind") == "int_codebook" and cfg.get("levels") == CALIBRATED


def payload_config(cfg: dict) -> dict:
    """The config whose payload a part stores: a calibrated codebook's with NF levels (the tables are not in
    the payload; its codes, scales and offsets are laid out alike)."""
    return {**cfg, "levels": "nf"} if is_calibrated(cfg) else cfg


def calibrated_parts(pol: dict) -> tuple[str, ...]:
    """The parts of a policy's codec whose levels are calibrated per layer."""
    codec = pol.get("codec") or {}
    return tuple(part for part in ("k", "v") if is_calibrated(codec.get(part)))


def table_bytes(pol: dict, d: int) -> int:
    """Float16 bytes of one layer's calibrated tables: ``D x 2**bits`` per channel, ``2**bits`` shared."""
    out = 0
    for part in calibrated_parts(pol):
        cfg = pol["codec"][part]
        out += 2 * (1 << cfg["bits"]) * (d if cfg["axis"] == "channel" else 1)
    return out


def layer_tables(row, ctx, pol: dict, layer: int) -> tuple[dict, int]:
    """The policy with each calibrated part's levels set to the row's stored table of ``layer``, and those
    tables' bytes."""
    codec, nbytes = dict(pol["codec"]), 0
    for part in calibrated_parts(pol):
        rel = (row.get("arrays") or {}).get(f"codebook.{part}")
        if rel is None:
            raise ValueError(f"a calibrated codebook's row has no codebook.{part} array")
        t = ctx.load(rel)
        if t.dtype != np.float16 or not 0 <= layer < t.shape[0]:
            raise ValueError(f"codebook.{part} is {t.dtype} {list(t.shape)}: no float16 table of layer {layer}")
        codec[part] = {**codec[part], "levels": t[layer].astype(np.float64).tolist()}
        nbytes += int(t[layer].nbytes)
    return {**pol, "codec": codec}, nbytes


def _normalized(x: np.ndarray, cfg: dict) -> tuple[list, list]:
    """Per channel (channel axis) or pooled (token axis): each value's normalized ``u`` (float64) and weight."""
    n, d = x.shape[-2], x.shape[-1]
    u, s, _, live, _ = codebook_normalized(x.astype(np.float32).reshape(-1, n, d), cfg)
    w = np.broadcast_to(np.where(live, s.astype(np.float64) ** 2, 0.0), u.shape)
    if cfg["axis"] == "channel":
        u, w = (t.reshape(t.shape[0], -1, d)[:, :n, :] for t in (u, w))
        return [u[..., c].ravel() for c in range(d)], [w[..., c].ravel() for c in range(d)]
    u, w = (t.reshape(t.shape[0], n, -1)[..., :d] for t in (u, w))
    return [u.ravel()], [w.ravel()]


def _float16_increasing(row: np.ndarray) -> np.ndarray:
    t = [float(np.float16(v)) + 0.0 for v in row]
    for i in range(1, len(t)):
        if t[i] <= t[i - 1]:
            t[i] = float(np.nextafter(np.float16(t[i - 1]), np.float16(np.inf)))
    t[-1] = min(t[-1], 1.0)
    for i in range(len(t) - 2, -1, -1):
        if t[i] >= t[i + 1]:
            t[i] = float(np.nextafter(np.float16(t[i + 1]), np.float16(-np.inf)))
    return np.array(t, dtype=np.float16)


def lloyd(x: np.ndarray, cfg: dict) -> np.ndarray:
    """The calibrated table of ``cfg`` (bits, group_size, axis) from ``x [..., T, D]`` (module docstring):
    float16 ``[D, n]`` (channel axis) or ``[n]``."""
    n = 1 << cfg["bits"]
    rows = []
    for ur, wr in zip(*_normalized(x, cfg)):
        keep = wr > 0
        uk, wk = ur[keep], wr[keep]
        m = uk.size
        if m == 0:
            rows.append(np.linspace(-1.0, 1.0, n))
            continue
        srt = np.sort(uk)
        c = srt[[min(m - 1, math.floor((i + 0.5) * m / n)) for i in range(n)]].copy()
        for _ in range(LLOYD_ROUNDS):
            idx = np.searchsorted((c[1:] + c[:-1]) * 0.5, uk, side="left")
            mass = np.bincount(idx, weights=wk, minlength=n)
            moment = np.bincount(idx, weights=wk * uk, minlength=n)
            c = np.where(mass > 0, moment / np.where(mass > 0, mass, 1.0), c)
        rows.append(np.clip(c, -1.0, 1.0))
    tables = np.stack([_float16_increasing(r) for r in rows])
    return tables if cfg["axis"] == "channel" else tables[0]


def check_tables(row, ctx, pol: dict, dims: dict, evidence_layer: int | None, windows: tuple | None) -> None:
    """The row's tables (shape, float16, strictly increasing in [-1, 1]); on its evidence row the
    evidence layer's table computed again from the stored calibration input, of the manifest's
    ``windows`` (C, T) shape ``[C, KV heads, T, D]``."""
    layers, d = dims["layers"], dims["head_dim"]
    arrays = row.get("arrays") or {}
    for part in calibrated_parts(pol):
        cfg = pol["codec"][part]
        n = 1 << cfg["bits"]
        want = (layers, d, n) if cfg["axis"] == "channel" else (layers, n)
        rel = arrays.get(f"codebook.{part}")
        if rel is None:
            ctx.fail(row, f"codebook.{part}: a calibrated codebook's tables are not stored")
            continue
        t = ctx.load(rel)
        ctx.numbers += 1
        if t.dtype != np.float16 or t.shape != want:
            ctx.fail(row, f"codebook.{part} is {t.dtype} {list(t.shape)}, expected float16 {list(want)}")
            continue
        tf = t.astype(np.float64)
        if not np.all(np.isfinite(tf)) or np.any(np.abs(tf) > 1) or np.any(np.diff(tf, axis=-1) <= 0):
            ctx.fail(row, f"codebook.{part}: a table is not strictly increasing within [-1, 1]")
        if evidence_layer is None or (row.get("evidence") or {}).get("layer") != evidence_layer:
            continue
        src = arrays.get(f"calibration.{part}")
        if src is None:
            ctx.fail(row, f"calibration.{part}: the evidence row stores no calibration input to re-derive its table")
            continue
        x = ctx.load(src)
        want_x = (None, dims["kv_heads"], None, d) if windows is None else (windows[0], dims["kv_heads"], windows[1], d)
        if x.dtype != np.float32 or x.ndim != 4 or any(w is not None and w != g for w, g in zip(want_x, x.shape)):
            ctx.fail(row, f"calibration.{part} is {x.dtype} {list(x.shape)}, expected float32 {list(want_x)} (the "
                          "manifest's windows x tokens)")
            continue
        got = lloyd(x, cfg).astype(np.float64)
        ctx.numbers += got.size
        bad = np.abs(got - tf[evidence_layer]) > TOLERANCES["codebook_lloyd"]["atol"]
        if np.any(bad):
            i = tuple(int(v) for v in np.argwhere(bad)[0])
            ctx.fail(row, f"codebook.{part}: layer {evidence_layer}'s table is not Lloyd's k-means of its stored "
                          f"calibration input (level {list(i)}: stored {tf[evidence_layer][i]:.6g}, re-derived "
                          f"{got[i]:.6g})")


def check_windows(ctx, where: str, manifest: dict, live: dict, stride: int | None, load) -> None:
    """The calibration windows of the live manifest: the rule's starts, disjoint from every segment, their
    token ids as recorded."""
    rec = manifest.get("calibration")
    cal = live.get("calibration")
    if cal is None:
        if rec is not None:
            ctx.fail(where, "live_manifest.json records calibration windows the protocol does not ask for")
        return
    if not isinstance(rec, dict):
        ctx.fail(where, "live_manifest.json records no calibration windows")
        return
    length = live["prefill"] + live["steps"] + 1
    prefill = cal.get("tokens") or live["prefill"]  # the window's length
    count = cal.get("windows")
    ctx.numbers += 1
    if stride is None:
        ctx.fail(where, "calibration windows: no corpus_tokens to place them by")
        return
    want = [(c + 1) * stride - prefill for c in range(count)] if type(count) is int else None
    starts = rec.get("starts")
    if starts != want or rec.get("tokens") != prefill:
        ctx.fail(where, f"calibration windows start at {starts} ({rec.get('tokens')} tokens), not the rule's {want} "
                        f"({prefill} tokens)")
    if not (isinstance(starts, list) and all(type(x) is int for x in starts)):
        return
    segs = [(i * stride, i * stride + length) for i in range(live["segments"])]
    for s in starts:
        hit = [a for a, b in segs if s < b and a < s + prefill]
        if hit:
            ctx.fail(where, f"calibration window [{s}, {s + prefill}) overlaps the scored segment starting at {hit[0]}")
    try:
        ids = load(rec.get("token_ids"))
    except Exception as e:  # noqa: BLE001 - reported as a FAIL line
        ctx.fail(where, f"calibration token_ids: {e}")
        return
    sums = [hashlib.sha256(np.ascontiguousarray(r).tobytes()).hexdigest() for r in ids] \
        if ids.dtype == np.int32 and ids.shape == (count, prefill) else None
    if sums is None or sums != rec.get("token_ids_sha256"):
        ctx.fail(where, "calibration token_ids do not match their recorded sha256")
