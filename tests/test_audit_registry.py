"""The audit's registry of quantizer kinds (``audit_checks/schemes.py``, ``SCHEMES``) against the run side.

For every scheme registered in ``testbed.quant`` (the names the property matrix of
``tests/quant/test_properties.py`` iterates), on both sides of the fast path's size threshold and
on ragged last groups and blocks:

- the audit's decoder, given the run's stored payload, returns the run's ``dequantize`` bit for
  bit (both are exact: a float32 ``code * scale + zero``, or an MX value times a power of two);
- the audit's encoder, given the same float32 input, writes the run's payload byte for byte (where
  the kind's payload is deterministic from its input; else the audit refuses to re-encode it);
- the audit's label is the run's ``label``.

A scheme registered on the run side without an audit entry fails here by name. A kind neither side
knows is an error naming it, on both sides and in both residual-window labels, never a bare kind.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from testbed import quant
from testbed.analyses import residual_window as rw_analysis
from testbed.audit_checks import schemes
from testbed.audit_checks import residual_window as rw_check
from testbed.quant import kernels
from tests._helpers import REPO

SCHEMES = quant.names()
# (shape, log2 scale, offset): ragged groups and blocks (D = 33, 40, 72; N not a multiple of 32),
# the last two past the fast path's threshold (kernels.MIN_FAST_ELEMENTS elements)
INPUTS = [((5, 33), 0.0, 0.0), ((2, 37, 40), -5.0, 0.0), ((3, 700, 40), 0.0, 0.0), ((2, 1030, 72), 4.0, 3.0)]
UNKNOWN = {"kind": "int_symmetric", "bits": 4, "group_size": 32}


def _input(shape, log_scale, offset) -> torch.Tensor:
    g = torch.Generator().manual_seed(math.prod(shape))
    x = torch.randn(*shape, generator=g) * 2.0 ** log_scale + offset
    x[..., :3, :] = 0.5  # a constant span: degenerate integer groups, MX blocks of one value
    return x


def test_the_inputs_cover_both_sides_of_the_fast_path():
    sizes = [math.prod(shape) for shape, *_ in INPUTS]
    assert min(sizes) < kernels.MIN_FAST_ELEMENTS < max(sizes)


def _package_kinds() -> set[str]:
    """The kinds the package itself registers: ``quant.kinds()`` in a fresh interpreter. This process's
    registry may also hold a test module's own kinds (``tests/test_codec_middle.py`` registers two at
    import), which the audit rightly does not know."""
    code = "import json; from testbed import quant; print(json.dumps(quant.kinds()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    return set(json.loads(out.stdout))


def test_every_run_side_kind_has_an_audit_entry_and_no_more():
    """The audit knows exactly the kinds the package's ``from_config`` knows: a new run-side kind without
    an audit decoder, encoder and label fails here, and so does an audit entry for a kind the run removed."""
    package = _package_kinds()
    assert package <= set(quant.kinds()) and "int_grouped" in package  # the fresh interpreter saw the package
    missing, extra = package - set(schemes.SCHEMES), set(schemes.SCHEMES) - package
    assert not missing, f"quantizer kinds without an audit entry (schemes.SCHEMES): {sorted(missing)}"
    assert not extra, f"audit entries for kinds the run side does not register: {sorted(extra)}"
    assert {quant.get(name).config()["kind"] for name in SCHEMES} <= set(schemes.SCHEMES)
    # both are deterministic from their input: the residual-window and live audits re-encode them
    assert schemes.SCHEMES["int_grouped"].encode is not None and schemes.SCHEMES["mx"].encode is not None


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape, log_scale, offset", INPUTS)
def test_audit_decodes_and_encodes_as_the_run(scheme, shape, log_scale, offset):
    q = quant.get(scheme)
    cfg = q.config()
    entry = schemes.SCHEMES.get(cfg["kind"])
    assert entry is not None, f"{scheme}: the audit has no entry for quantizer kind {cfg['kind']!r} (schemes.SCHEMES)"
    x = _input(shape, log_scale, offset)
    packed = q.quantize(x)
    stored = packed.arrays
    run_decoded = q.dequantize(packed).numpy()
    audit_decoded = schemes.decode_tensor(dict(stored), cfg, tuple(shape))
    assert audit_decoded.shape == tuple(shape)
    np.testing.assert_array_equal(np.asarray(audit_decoded, np.float64), run_decoded.astype(np.float64))
    if entry.encode is None:  # a payload not deterministic from its input: the audit says it cannot re-encode
        with pytest.raises(ValueError, match=repr(cfg["kind"])):
            schemes.encode_tensor(x.numpy(), cfg)
        return
    want = schemes.encode_tensor(x.numpy(), cfg)
    assert schemes.payload_differences(stored, want, "the input") == []


@pytest.mark.parametrize("scheme", SCHEMES)
def test_audit_label_is_the_run_label(scheme):
    q = quant.get(scheme)
    assert schemes.quantizer_label(q.config()) == q.label


def test_labels_keep_every_parameter_that_tells_two_schemes_apart():
    """Two registered schemes with one label differ only in the axis (which the layout fixes: K per
    channel, V per token); so the label never drops bits, group, element, block, rule, rotation or table.
    A config is compared as its JSON text (a codebook's table is a list)."""
    by_label: dict[str, set] = {}
    for name in SCHEMES:
        cfg = quant.get(name).config()
        by_label.setdefault(schemes.quantizer_label(cfg), set()).add(
            json.dumps({k: v for k, v in cfg.items() if k != "axis"}, sort_keys=True))
    assert all(len(cfgs) == 1 for cfgs in by_label.values()), by_label
    variants = [quant.MX("e4m3", 32, "signed_hadamard", 0, "rceil"), quant.MX("e4m3", 16), quant.MX("e5m2", 32),
                quant.IntGrouped(3, 16, "token")]
    labels = [q.label for q in variants]
    assert labels == [schemes.quantizer_label(q.config()) for q in variants]
    assert len(set(labels)) == len(labels) and all(lbl not in {"mx", "int_grouped"} for lbl in labels)


def test_residual_window_scheme_labels_agree_on_both_sides():
    pairs = [(quant.IntGrouped(4, 32, "channel"), quant.IntGrouped(4, 32, "token")),
             (quant.IntGrouped(4, 32, "channel"), quant.IntGrouped(2, 16, "token")),
             (quant.MX("e4m3", 32), quant.MX("e2m1", 32)),
             (quant.MX("e4m3", 32, None, 0, "rceil"), quant.MX("e4m3", 32, None, 0, "rceil")),
             (quant.IntGrouped(8, 32, "channel"), quant.MX("e4m3", 32))]
    for k, v in pairs:
        run = rw_analysis.scheme_label(k.config(), v.config())
        assert run == rw_check.scheme_label(k.config(), v.config())
        assert run.startswith(k.label + "+residual")


def test_an_unknown_kind_is_an_error_naming_it():
    """No side labels, decodes or encodes a kind it does not know with a fallback."""
    x = np.zeros((4, 32), np.float32)
    for call in (lambda: schemes.scheme(UNKNOWN), lambda: schemes.quantizer_label(UNKNOWN),
                 lambda: schemes.decode_tensor({}, UNKNOWN, (4, 32)), lambda: schemes.encode_tensor(x, UNKNOWN),
                 lambda: rw_check.scheme_label(UNKNOWN, UNKNOWN), lambda: quant.from_config(UNKNOWN),
                 lambda: rw_analysis.scheme_label(UNKNOWN, UNKNOWN)):
        with pytest.raises(ValueError, match="int_symmetric"):
            call()
    with pytest.raises(ValueError, match="None"):
        schemes.decode_tensor({}, {"bits": 4}, (4, 32))


def test_a_kind_without_a_label_raises_naming_it():
    """A quantizer class that defines no ``label`` raises when asked for one, naming its kind: the base
    class offers no default that would label its rows with the bare kind."""
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass(frozen=True)
    class Toy(quant.Quantizer):
        KIND: ClassVar[str] = "toy_kind"
        bits: int = 4

    with pytest.raises(NotImplementedError, match="toy_kind"):
        _ = Toy().label
