"""Spec constants are named once on each side: the run side in ``testbed/quant/constants.py``, the
audit (which never imports the run side) in ``testbed/audit_checks/common.py``. The two are written
separately from the same specs and must agree, and what they describe must hold of the payloads."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import torch

from testbed import quant
from testbed.audit_checks import common, schemes
from testbed.quant import constants
from tests._helpers import REPO

NAMES = ("HEADER_BYTES", "MX_BLOCK_SIZE", "E8M0_BIAS", "E8M0_NAN", "FP16_MAX")


def _assigned(path: Path) -> set[str]:
    """Module-level names a file assigns."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def test_each_side_defines_each_constant_in_one_module():
    owners: dict[str, list[str]] = {}
    for path in sorted((REPO / "testbed").rglob("*.py")):
        for name in _assigned(path) & set(NAMES):
            owners.setdefault(name, []).append(path.relative_to(REPO).as_posix())
    for name in NAMES:
        assert sorted(owners.get(name, [])) == ["testbed/audit_checks/common.py", "testbed/quant/constants.py"], name


def test_the_audits_copies_equal_the_run_sides():
    for name in NAMES:
        assert getattr(common, name) == getattr(constants, name), name
    from testbed.audit_checks import calibration
    from testbed.quant import codebook

    # the calibrated codebook's k-means rounds: the audit's re-derivation runs as many as the run
    assert calibration.LLOYD_ROUNDS == codebook.LLOYD_ITERS


def test_the_constants_describe_the_payloads():
    """The header is HEADER_BYTES; an MX scheme's default block is MX_BLOCK_SIZE elements per scale;
    E8M0 code E8M0_BIAS is the scale 1 and the audit decodes E8M0_NAN as NaN."""
    x = torch.linspace(-3, 3, 5 * 70).reshape(5, 70)
    for name in quant.names():
        header = quant.get(name).quantize(x).arrays["header"]
        assert header.nbytes == constants.HEADER_BYTES and header.tolist() == [5, 70]
    mx = quant.MX("e4m3")
    assert mx.block_size == constants.MX_BLOCK_SIZE
    assert mx.quantize(x).arrays["scales"].shape == (5, -(-70 // constants.MX_BLOCK_SIZE))
    ones = torch.ones(1, constants.MX_BLOCK_SIZE) * 2.0 ** mx.fmt.emax  # amax 2**emax: unbiased exponent 0
    assert mx.quantize(ones).arrays["scales"].tolist() == [[constants.E8M0_BIAS]]
    decoded = schemes.decode_e8m0(np.array([common.E8M0_BIAS, common.E8M0_NAN], np.uint8))
    assert decoded[0] == 1.0 and np.isnan(decoded[1])
