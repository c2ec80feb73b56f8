"""The shared property matrix: every registered quantizer must obey these laws (hypothesis).

Laws: shape and dtype kept; determinism; exact ``nbytes`` (the sum of the stored arrays, equal to
the closed-form size written out below per scheme kind, *not* taken from the implementation);
the error within the scheme's own stated bound (written out below per kind); idempotence on
already-quantized data (re-quantizing the decoded tensor gives the same decoded tensor); NaN /
Inf refused with the tensor's name and the index. Scheme-specific laws live beside their scheme.

A new scheme is in the matrix as soon as it is registered. Its closed-form bytes and error bound are
laws written out here from its documentation (``NBYTES_FORMULA``, ``ERROR_BOUND``; ``IDEMPOTENT_WHEN``
only where idempotence has an exception), never derived from its code: until they are, the tests
that need them fail with a message naming the kind and the table (``law``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed import quant
from testbed.audit_checks import schemes

SCHEMES = quant.names()
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def nbytes_int_grouped(cfg: dict, shape: tuple) -> int:
    """Codes ``bits`` per element over the group-padded axis, packed to whole bytes per row; a float16
    scale and a float16 zero per group; the 16-byte (N, D) header."""
    *lead, n, d = shape
    heads = math.prod(lead)
    bits, g = cfg["bits"], cfg["group_size"]
    if cfg["axis"] == "channel":
        rows, per_row, groups = _ceil_to(n, g), d, (_ceil_to(n, g) // g) * d
    else:
        rows, per_row, groups = n, _ceil_to(d, g), n * (_ceil_to(d, g) // g)
    code_bytes = rows * (-(-per_row * bits // 8))
    return heads * (code_bytes + groups * (2 + 2)) + 16


def _groups(x: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The groups of ``x`` (float64) as the last axis, edge-padded like the scheme documents."""
    g = cfg["group_size"]
    xt = x.to(torch.float64)
    xt = xt.transpose(-1, -2) if cfg["axis"] == "channel" else xt
    pad = _ceil_to(xt.shape[-1], g) - xt.shape[-1]
    xp = torch.cat([xt, xt[..., -1:].expand(*xt.shape[:-1], pad)], dim=-1) if pad else xt
    return xp.reshape(*xp.shape[:-1], -1, g)


def int_grouped_grid_holds(x: torch.Tensor, cfg: dict) -> bool:
    """Idempotence precondition: in every group the float16 zero-point lands within half a step of
    the minimum and the top code within half a step of the maximum, so the decoded group spans
    codes 0..qmax exactly and re-quantizing finds the same grid. Narrow groups far from zero break
    it (the float16 rounding of the minimum exceeds half a step): they stay within the error bound,
    but the grid moves."""
    grp = _groups(x, cfg)
    qmax = (1 << cfg["bits"]) - 1
    mn, mx = grp.amin(-1).float(), grp.amax(-1).float()
    s16 = ((mx - mn) / qmax).half().double()
    z16 = mn.half().double()
    live = s16 > 0
    ok_lo = (mn.double() - z16).abs() < 0.45 * s16
    ok_hi = (mx.double() - (z16 + qmax * s16)).abs() < 0.45 * s16
    return bool(((ok_lo & ok_hi) | ~live).all())


def bound_int_grouped(x: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Half a quantization step plus the float16 rounding of the group's min and range."""
    grp = _groups(x, cfg)
    mn, mx = grp.amin(-1, keepdim=True), grp.amax(-1, keepdim=True)
    step = (mx - mn) / ((1 << cfg["bits"]) - 1)
    # float16 subnormals have an absolute quantum of 2^-24: zero and scale may each round by half of it
    qmax = (1 << cfg["bits"]) - 1
    b = 0.5 * step * (1 + 2 ** -10) + 2 ** -10 * (mn.abs() + (mx - mn)) + (1 + qmax) * 2 ** -25
    n = x.shape[-2] if cfg["axis"] == "channel" else x.shape[-1]
    b = b.expand_as(grp).reshape(*grp.shape[:-2], -1)[..., :n]
    return b.transpose(-1, -2) if cfg["axis"] == "channel" else b


# OCP MX v1.0 element formats: code bits, mantissa bits, exponent of the smallest normal, exponent
# of the largest normal (the FLOOR rule's emax) and the largest magnitude (saturation).
MX_SPEC = {
    "e4m3": {"bits": 8, "mbits": 3, "emin": -6, "emax": 8, "max": 448.0},
    "e5m2": {"bits": 8, "mbits": 2, "emin": -14, "emax": 15, "max": 57344.0},
    "e2m1": {"bits": 4, "mbits": 1, "emin": 0, "emax": 2, "max": 6.0},
}


def nbytes_mx(cfg: dict, shape: tuple) -> int:
    """Last axis zero-padded to whole blocks; ``bits`` per padded element (FP4 two to a byte), one
    uint8 E8M0 scale per block; the 16-byte (N, D) header."""
    *lead, n, d = shape
    spec, b = MX_SPEC[cfg["element"]], cfg["block_size"]
    d_pad = _ceil_to(d, b)
    return math.prod(lead) * n * (d_pad * spec["bits"] // 8 + d_pad // b) + 16


def bound_mx(x: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Block scale ``X = 2**clamp(floor(log2 amax) - emax, -127, 127)``; an element is off by at most
    its saturation (``|x| - max X`` above the format's max) plus half a quantum: ``2**-(m+1) |x|``
    in the normal range, ``2**(emin - m - 1) X`` in the subnormal range."""
    spec, b = MX_SPEC[cfg["element"]], cfg["block_size"]
    d = x.shape[-1]
    xa = x.to(torch.float64).abs()
    xp = torch.cat([xa, xa.new_zeros(*xa.shape[:-1], _ceil_to(d, b) - d)], dim=-1)
    blocks = xp.reshape(*xp.shape[:-1], -1, b)
    amax = blocks.amax(-1, keepdim=True)
    e = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - spec["emax"]
    scale = torch.exp2(e.clamp(-127, 127))
    sat = (blocks - spec["max"] * scale).clamp(min=0)
    half_q = 2.0 ** -(spec["mbits"] + 1) * blocks + 2.0 ** (spec["emin"] - spec["mbits"] - 1) * scale
    bound = torch.where(amax > 0, sat + half_q, torch.zeros_like(blocks))
    return bound.reshape(xp.shape)[..., :d]


def _ds_outliers(x: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The dense-and-sparse outlier mask of ``x``: per leading index the ``floor(p * N * D + 1/2)``
    largest magnitudes, ties to the lower flat index (ranked here by a key that sorts both at once)."""
    *lead, n, d = x.shape
    k = math.floor(cfg["outliers"] * n * d + 0.5)
    flat = x.reshape(*lead, n * d).to(torch.float64).abs()
    # rank by magnitude, then by flat index: every magnitude is distinct from the next key's
    order = np.lexsort((np.arange(n * d) * np.ones(flat.shape), -flat.numpy()), axis=-1)
    mask = np.zeros(flat.shape, dtype=bool)
    np.put_along_axis(mask, order[..., :k], True, axis=-1)
    return torch.from_numpy(mask).reshape(x.shape)


def _ds_filled(x: torch.Tensor, cfg: dict) -> torch.Tensor:
    """``x`` with each outlier slot set to the smallest non-outlier of its group (0 if none), as documented."""
    mask = _ds_outliers(x, cfg)
    xt, mt = (x.transpose(-1, -2), mask.transpose(-1, -2)) if cfg["axis"] == "channel" else (x, mask)
    n, g = xt.shape[-1], cfg["group_size"]
    out = xt.clone()
    for a in range(0, n, g):
        grp, m = xt[..., a:a + g], mt[..., a:a + g]
        # the edge padding repeats the last member, which changes no minimum
        low = torch.where(m, torch.full_like(grp, math.inf), grp).amin(-1, keepdim=True)
        low = torch.where(torch.isinf(low), torch.zeros_like(low), low)
        out[..., a:a + g] = torch.where(m, low.expand_as(grp), grp)
    return out.transpose(-1, -2) if cfg["axis"] == "channel" else out


def nbytes_dense_sparse(cfg: dict, shape: tuple) -> int:
    """The grouped-integer payload of the whole span, plus per leading index ``floor(p * N * D + 1/2)``
    outliers of a float16 value and a uint16 index each (int32 above 65,536 elements per span)."""
    *lead, n, d = shape
    k = math.floor(cfg["outliers"] * n * d + 0.5)
    return nbytes_int_grouped(cfg, shape) + math.prod(lead) * k * (2 + (2 if n * d <= 65536 else 4))


def _hadamard_matrix(d: int, seed: int) -> torch.Tensor:
    """The documented rotation as a dense float64 matrix: ``diag(s) blockdiag(H_n) / sqrt(n)``, ``n`` the
    largest power of two dividing ``d`` (at most 128), ``H`` Sylvester's, ``s_i = 1 - 2 * bit i`` of the
    concatenated ``SHA-256(b"testbed.hadamard:<seed>:<k>")``, least significant bit first."""
    import hashlib

    n = min(d & -d, 128)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    stream = b"".join(hashlib.sha256(f"testbed.hadamard:{seed}:{k}".encode()).digest() for k in range(d // 256 + 1))
    signs = torch.tensor([1.0 - 2.0 * ((stream[i // 8] >> (i % 8)) & 1) for i in range(d)], dtype=torch.float64)
    return signs[:, None] * torch.block_diag(*([h / math.sqrt(n)] * (d // n)))


def bound_dense_sparse(x: torch.Tensor, cfg: dict) -> torch.Tensor:
    """An outlier is off by its float16 rounding (half an ulp: ``2**-11 |x|``, ``2**-25`` among
    subnormals); every other element by the grouped-integer bound of its group's non-outlier range.
    With the rotation these hold in the rotated domain (of ``x R``, rounded to float32, give or take
    an ulp); decoding multiplies the error by ``R^T``, so element ``i`` is off by at most the rotated
    bounds of its block weighted by ``|R_ij| = 1/sqrt(n)``, plus the float32 rounding of the decode."""
    if cfg.get("rotation"):
        r = _hadamard_matrix(x.shape[-1], cfg.get("seed", 0))
        xr = (x.to(torch.float64) @ r).to(torch.float32)
        inner = bound_dense_sparse(xr, {**cfg, "rotation": None}) + 2.0 ** -22 * xr.to(torch.float64).abs()
        return inner @ r.abs().T + 2.0 ** -23 * x.to(torch.float64).abs() + 2.0 ** -60
    dense = bound_int_grouped(_ds_filled(x, cfg), cfg)
    sparse = 2.0 ** -11 * x.to(torch.float64).abs() + 2.0 ** -25
    return torch.where(_ds_outliers(x, cfg), sparse, dense)


def dense_sparse_stable(x: torch.Tensor, cfg: dict) -> bool:
    """Idempotence precondition: no rotation, the decoded tensor has the same outliers (a near tie
    between the last outlier and the first ordinary value can swap them) and the grid of its dense
    part holds."""
    if cfg.get("rotation"):  # a rotated decode rounds on the way back: its re-rotation need not land on the grid
        return False
    q = quant.from_config(cfg)
    x1 = q.dequantize(q.quantize(x))
    return bool(torch.equal(_ds_outliers(x1, cfg), _ds_outliers(x, cfg))) and int_grouped_grid_holds(
        _ds_filled(x, cfg), cfg)


def _codebook_table(cfg: dict, d: int) -> torch.Tensor:
    """A codebook's levels, float64 ``[D, n]`` (a shared table repeated per channel): NormalFloat from
    ``bits`` as the audit derives them on its own (tests/quant/test_codebook.py holds them to QLoRA's
    table), else the config's table."""
    nf = cfg["levels"] == "nf"
    t = torch.tensor(schemes.codebook_nf_levels(cfg["bits"]) if nf else cfg["levels"], dtype=torch.float64)
    return t.expand(d, -1) if t.dim() == 1 else t


def _codebook_per_group(x: torch.Tensor, cfg: dict, values: torch.Tensor) -> torch.Tensor:
    """``values`` (one per group, ``[..., D, N_pad/G]`` for channel or ``[..., N, D_pad/G]`` for token)
    spread over the elements of ``x``'s layout."""
    n = x.shape[-2] if cfg["axis"] == "channel" else x.shape[-1]
    b = values.unsqueeze(-1).expand(*values.shape, cfg["group_size"]).reshape(*values.shape[:-1], -1)[..., :n]
    return b.transpose(-1, -2) if cfg["axis"] == "channel" else b


def _codebook_row_stat(x: torch.Tensor, cfg: dict, stat) -> torch.Tensor:
    """A per-channel statistic of the table, shaped to broadcast against ``_groups``' ``[..., Dg, 1]``:
    per channel ``[D, 1]`` on the channel axis; the shared table's on the token axis."""
    t = _codebook_table(cfg, x.shape[-1])
    v = stat(t)
    return v[:, None] if cfg["axis"] == "channel" else v[0]


def bound_codebook(x: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Per group, ``h = (max - min) / 2`` and ``m = (max + min) / 2`` are the float16 scale and offset
    up to ``e = 2**-9 (|m| + h) + 2**-23`` (float32 and float16 rounding, subnormals included). An element
    of the group's range is then within half the table's widest gap times the scale of a level, or past an
    end of the table by ``(l[0] + 1) s`` or ``(1 - l[-1]) s`` (plus ``e``); plus the float32 rounding of the
    normalization and the decode, ``2**-22 (|m| + 2h)``."""
    grp = _groups(x, cfg)
    mn, mx = grp.amin(-1), grp.amax(-1)
    h, m = (mx - mn) / 2, (mx + mn) / 2
    s_hi = h * (1 + 2 ** -10) + 2 ** -24
    e = 2 ** -9 * (m.abs() + h) + 2 ** -23
    gap = _codebook_row_stat(x, cfg, lambda t: t.diff(dim=-1).amax(-1))
    lo = _codebook_row_stat(x, cfg, lambda t: t[:, 0] + 1)
    hi = _codebook_row_stat(x, cfg, lambda t: 1 - t[:, -1])
    inner = torch.maximum(gap / 2 * s_hi, torch.maximum(lo, hi) * s_hi + e)
    return _codebook_per_group(x, cfg, inner + e + 2 ** -22 * (m.abs() + 2 * h) + 2 ** -25)


def codebook_grid_holds(x: torch.Tensor, cfg: dict) -> bool:
    """Idempotence precondition: the table runs from -1 to 1; in every group of non-zero float16 scale
    the minimum and maximum land within 0.45 of the end gaps of -1 and 1 (so they take the end codes and
    decode to ``offset16 -/+ scale16``), those two decoded ends give back the same float16 offset and scale,
    and the float32 rounding of a decoded level, ``2**-23 (|offset16| / scale16 + 3)`` in units of the scale,
    stays below half the table's narrowest gap (so every code re-encodes to itself). A calibrated table
    whose ends are not -1 and 1 shrinks the decoded range: it is not idempotent."""
    t = _codebook_table(cfg, x.shape[-1])
    if not (bool((t[:, 0] == -1).all()) and bool((t[:, -1] == 1).all())):
        return False
    grp = _groups(x, cfg).float()
    mn, mx = grp.amin(-1), grp.amax(-1)
    s16 = ((mx - mn) * 0.5).half().float()
    z16 = ((mx + mn) * 0.5 + 0.0).half().float()
    live = s16 > 0
    safe = torch.where(live, s16, torch.ones_like(s16)).double()
    first = _codebook_row_stat(x, cfg, lambda t: t[:, 1] - t[:, 0])
    last = _codebook_row_stat(x, cfg, lambda t: t[:, -1] - t[:, -2])
    narrow = _codebook_row_stat(x, cfg, lambda t: t.diff(dim=-1).amin(-1))
    ends = ((mn.double() - z16.double()) / safe + 1).abs() < 0.45 * first
    ends &= ((mx.double() - z16.double()) / safe - 1).abs() < 0.45 * last
    a, b = z16 + (-s16), z16 + s16
    same = (((b - a) * 0.5).half().float() == s16) & (((b + a) * 0.5 + 0.0).half().float() == z16)
    codes = 2.0 ** -23 * (z16.double().abs() / safe + 3) < narrow / 2
    return bool((ends & same & codes | ~live).all())


NBYTES_FORMULA = {"int_grouped": nbytes_int_grouped, "mx": nbytes_mx, "int_dense_sparse": nbytes_dense_sparse,
                  # the codebook's payload is the int kinds' layout (its table is a parameter, not stored)
                  "int_codebook": nbytes_int_grouped}
ERROR_BOUND = {"int_grouped": bound_int_grouped, "mx": bound_mx, "int_dense_sparse": bound_dense_sparse,
               "int_codebook": bound_codebook}
# MX is idempotent everywhere: a decoded block keeps its scale (its amax rounds into [2**emax, max] X,
# or the scale was already clamped to 2**-127, where a smaller amax clamps to it again).
IDEMPOTENT_WHEN = {"int_grouped": int_grouped_grid_holds, "mx": lambda x, cfg: True,
                   "int_dense_sparse": dense_sparse_stable, "int_codebook": codebook_grid_holds}
_TABLES = {"bytes": ("NBYTES_FORMULA", NBYTES_FORMULA), "bound": ("ERROR_BOUND", ERROR_BOUND)}


def law(what: str, cfg: dict):
    """The closed form ``what`` ("bytes" or "bound") of ``cfg``'s kind. A registered kind without one
    fails (never skips: the law is part of the matrix) with a message saying what to write where."""
    table_name, table = _TABLES[what]
    if cfg["kind"] not in table:
        pytest.fail(f"quantizer kind {cfg['kind']!r} has no closed-form {what} in tests/quant/test_properties.py "
                    f"({table_name}): write it out from the scheme's documented layout, not from its code",
                    pytrace=False)
    return table[cfg["kind"]]


def test_a_kind_without_a_closed_form_fails_naming_it_and_the_table():
    for what, table in (("bytes", "NBYTES_FORMULA"), ("bound", "ERROR_BOUND")):
        with pytest.raises(pytest.fail.Exception, match=rf"'int_symmetric' has no closed-form {what} .*\({table}\)"):
            law(what, {"kind": "int_symmetric", "bits": 4})
    assert law("bytes", {"kind": "mx"}) is nbytes_mx and law("bound", {"kind": "int_grouped"}) is bound_int_grouped


@st.composite
def tensors(draw, max_tokens=80, max_dim=72):
    lead = draw(st.sampled_from([(), (1,), (3,)]))
    n = draw(st.integers(1, max_tokens))
    d = draw(st.integers(1, max_dim))
    seed = draw(st.integers(0, 2**31 - 1))
    log_scale = draw(st.floats(-6, 6))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, n, d, generator=g) * (2.0 ** log_scale)
    if draw(st.booleans()):
        x = x + draw(st.floats(-8, 8))
    if draw(st.integers(0, 5)) == 0:
        x[..., : max(1, n // 2), :] = draw(st.floats(-2, 2))  # constant (degenerate) groups
    return x


@pytest.mark.parametrize("scheme", SCHEMES)
@SETTINGS
@given(x=tensors())
def test_shape_dtype_nbytes_and_determinism(scheme, x):
    q = quant.get(scheme)
    p = q.quantize(x)
    x_hat = q.dequantize(p)
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    assert p.nbytes == sum(a.nbytes for a in p.arrays.values())
    assert p.nbytes == law("bytes", q.config())(q.config(), tuple(x.shape))
    p2 = q.quantize(x.clone())
    assert p.arrays.keys() == p2.arrays.keys()
    for name in p.arrays:
        assert np.array_equal(p.arrays[name], p2.arrays[name]), name


@pytest.mark.parametrize("scheme", SCHEMES)
@SETTINGS
@given(x=tensors())
def test_error_within_stated_bound(scheme, x):
    q = quant.get(scheme)
    x_hat = q.dequantize(q.quantize(x))
    bound = law("bound", q.config())(x, q.config())
    err = (x_hat.to(torch.float64) - x.to(torch.float64)).abs()
    worst = (err - bound).max()
    assert worst <= 0, f"error exceeds the bound by {float(worst):.3g}"


@pytest.mark.parametrize("scheme", SCHEMES)
@SETTINGS
@given(x=tensors())
def test_idempotent_on_quantized_data(scheme, x):
    q = quant.get(scheme)
    cfg = q.config()
    x1 = q.dequantize(q.quantize(x))
    x2 = q.dequantize(q.quantize(x1))
    if IDEMPOTENT_WHEN.get(cfg["kind"], lambda *_: True)(x, cfg):
        assert torch.equal(x1, x2)
    else:  # the documented exception still respects the bound around the first decode
        bound = law("bound", cfg)(x1, cfg)
        assert bool(((x2.double() - x1.double()).abs() <= bound).all())


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_refused_with_name_and_index(scheme, bad):
    x = torch.randn(2, 40, 32)
    x[1, 7, 3] = bad
    with pytest.raises(ValueError, match=r"x: non-finite value .* at index \(1, 7, 3\)"):
        quant.get(scheme).quantize(x)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", [(0, 32), (4, 0), (5,)])
def test_empty_and_wrong_rank_refused(scheme, shape):
    with pytest.raises(ValueError):
        quant.get(scheme).quantize(torch.zeros(shape))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_parameters_are_a_frozen_dataclass_that_round_trips(scheme):
    """A scheme's parameters are its dataclass fields: the config lists exactly them after its kind,
    rebuilds an equal quantizer, the repr names each, and a parameter cannot be changed in place
    (a packed payload's config would then describe another scheme)."""
    import dataclasses

    q = quant.get(scheme)
    assert dataclasses.is_dataclass(q)
    fields = [f.name for f in dataclasses.fields(q)]
    cfg = q.config()
    assert list(cfg) == ["kind", *fields]
    assert quant.from_config(cfg) == q and quant.from_config(cfg).name == q.name
    assert all(f"{f}=" in repr(q) for f in fields)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(q, fields[0], cfg[fields[0]])


def test_residual_window_parameters_round_trip_and_validate():
    from testbed.quant import ResidualWindow

    rw = ResidualWindow(quant.IntGrouped(4, 32, "channel"), quant.IntGrouped(4, 32, "token"), recent=16, sink=4)
    again = ResidualWindow.from_config(rw.config())
    assert again == rw and again.config() == rw.config()
    assert rw.config()["key"] == {"kind": "int_grouped", "bits": 4, "group_size": 32, "axis": "channel"}
    for bad in ({"recent": -1}, {"sink": True}, {"key": {"kind": "int_grouped"}}):
        args = {"key": rw.key, "value": rw.value, "recent": 16, "sink": 0, **bad}
        with pytest.raises(ValueError):
            ResidualWindow(**args)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape, log_scale, offset", [((3, 700, 40), 0.0, 0.0), ((2, 1030, 72), 4.0, 3.0),
                                                      ((4, 513, 33), -5.0, 0.0)])
def test_laws_hold_past_the_fast_path_threshold(scheme, shape, log_scale, offset):
    """The matrix's laws on tensors large enough (more than `kernels.MIN_FAST_ELEMENTS` elements)
    that `quantize` takes the numba kernels, with ragged last groups: the closed-form bytes, the
    stated error bound, idempotence, and bit equality with the torch reference."""
    from testbed.quant import kernels

    assert math.prod(shape) > kernels.MIN_FAST_ELEMENTS
    if kernels.numba is None:
        pytest.skip("numba is not installed: no fast path to test")
    g = torch.Generator().manual_seed(math.prod(shape))
    x = torch.randn(*shape, generator=g) * 2.0 ** log_scale + offset
    assert kernels.use_fast(x)
    q = quant.get(scheme)
    cfg = q.config()
    p = q.quantize(x)
    ref = q.quantize_reference(x)
    assert p.arrays.keys() == ref.arrays.keys()
    for name in p.arrays:
        assert np.array_equal(p.arrays[name], ref.arrays[name]), name
    assert p.nbytes == law("bytes", cfg)(cfg, shape)
    x1 = q.dequantize(p)
    assert bool(((x1.double() - x.double()).abs() <= law("bound", cfg)(x, cfg)).all())
    x2 = q.dequantize(q.quantize(x1))
    if IDEMPOTENT_WHEN.get(cfg["kind"], lambda *_: True)(x, cfg):
        assert torch.equal(x1, x2)


@pytest.mark.parametrize("scheme", SCHEMES)
@SETTINGS
@given(x=tensors(), recent=st.integers(0, 90), sink=st.integers(0, 20))
def test_residual_window_over_every_scheme(scheme, x, recent, sink):
    """`ResidualWindow` with any registered scheme for K and V: its windows (the first ``sink`` and
    the last ``recent`` tokens) come back bit for bit, the span between is exactly that scheme's own
    quantization of the span, and its bytes are the scheme's bytes of the span (without the
    scheme's headers) plus the float32 windows plus one 16-byte header."""
    from testbed.quant import ResidualWindow

    q = quant.get(scheme)
    k, v = x, x.flip(-1) * 0.5 + 0.25
    rw = ResidualWindow(q, q, recent=recent, sink=sink)
    p = rw.pack(k, v)
    k_hat, v_hat = rw.unpack(p)
    n = x.shape[-2]
    start, stop = min(sink, n), max(min(sink, n), n - recent)
    for src, got in ((k, k_hat), (v, v_hat)):
        assert got.shape == src.shape
        assert torch.equal(got[..., :start, :], src[..., :start, :]) and torch.equal(got[..., stop:, :], src[..., stop:, :])
    windows = 2 * (start + n - stop) * math.prod(x.shape[:-2]) * x.shape[-1] * 4
    middle = 0
    if stop > start:
        for src, got in ((k, k_hat), (v, v_hat)):
            own = q.quantize(src[..., start:stop, :].contiguous())
            assert torch.equal(got[..., start:stop, :], q.dequantize(own).to(torch.float32))
            middle += own.nbytes - own.tensors["header"].numel() * own.tensors["header"].element_size()
    assert p.nbytes == middle + windows + 16


@pytest.mark.parametrize("scheme", SCHEMES)
def test_residual_window_past_the_fast_path_threshold(scheme):
    """The same law where the span between the windows is large enough for the numba kernels."""
    from testbed.quant import ResidualWindow, kernels

    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(3, 700, 40, generator=g), torch.randn(3, 700, 40, generator=g) * 3
    q = quant.get(scheme)
    rw = ResidualWindow(q, q, recent=64, sink=4)
    assert kernels.use_fast(k[..., 4:636, :].contiguous()) or kernels.numba is None
    k_hat, v_hat = rw.unpack(rw.pack(k, v))
    for src, got in ((k, k_hat), (v, v_hat)):
        ref = q.dequantize(q.quantize_reference(src[..., 4:636, :].contiguous())).to(torch.float32)
        assert torch.equal(got[..., 4:636, :], ref)
        assert torch.equal(got[..., :4, :], src[..., :4, :]) and torch.equal(got[..., 636:, :], src[..., 636:, :])
