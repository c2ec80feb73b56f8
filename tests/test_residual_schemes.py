"""The residual-window analysis takes its K and V quantizers from the protocol: the KIVI layout by
bits and group size (the default protocols), or any registered scheme's config, audited alike."""

from __future__ import annotations

import copy
import json

import pytest

from testbed.audit import audit
from testbed.protocol import ProtocolError, validate_protocol

from ._helpers import run_main

MX = {"kind": "mx", "element": "e4m3", "block_size": 32, "rotation": None, "seed": 0, "scale_rule": "rceil"}
INT_V = {"kind": "int_grouped", "bits": 4, "group_size": 32, "axis": "token"}


def protocol(**analysis) -> dict:
    params = {"residuals": [0, 16], "early_window": 8, "recent_mass_window": 8, **analysis}
    return {"name": "schemes", "source": {"kind": "synthetic", "seeds": [3], "lengths": [128],
                                          "distributions": ["clean", "recent_focus"], "head_dim": 32, "queries": 8,
                                          "focus_tokens": 16},
            "analyses": {"residual_window": params}, "timing": {"repeats": 0}}


def test_any_registered_scheme_runs_in_the_window_and_passes_the_audit(tmp_path):
    raw = protocol(key=MX, value=INT_V)
    (tmp_path / "p.json").write_text(json.dumps(raw))
    assert run_main(["--quiet", "--out", str(tmp_path / "run"), "--protocol", str(tmp_path / "p.json")]) == 0
    rows = json.loads((tmp_path / "run" / "results.json").read_text())["rows"]
    quantized = [r for r in rows if r["quant"] is not None]
    assert quantized and {r["scheme"] for r in quantized} == {"mx_e4m3_b32_rceil+residual(value int4_grouped_g32)"}
    assert all(r["quant"]["key"] == MX and r["quant"]["value"] == INT_V for r in quantized)
    # every byte, in closed form at N = 128, D = 32, R = 0: MXFP8 K is one byte per element and one
    # E8M0 scale per 32; int4 V half a byte per element and a float16 scale and zero per 32 features
    # of each token; one 16-byte (N, D) header (the quantizers' own headers are not stored)
    n, d = 128, 32
    r0 = next(r for r in quantized if r["arm"] == "R=0" and r["n"] == n)
    assert r0["payload_bytes"] == n * d + n * (d // 32) + n * d // 2 + n * (d // 32) * 2 * 2 + 16
    assert r0["baseline_bytes"] == 2 * n * d * 4
    ok, fails, _ = audit(tmp_path / "run", check_sources=False)
    assert ok, fails[:5]


@pytest.mark.parametrize("edit, says", [
    (lambda a: a.update(bits=4, group_size=32, key=MX, value=INT_V), "either bits and group_size"),
    (lambda a: a.update(key=MX), "either bits and group_size"),
    (lambda a: a.update(bits=4), "either bits and group_size"),
    (lambda a: a.update(key={"kind": "mx", "element": "e4m3", "block_size": 32}, value=INT_V), "spell out every"),
    (lambda a: a.update(key={**MX, "block_size": 3}, value=INT_V), "block_size"),
    (lambda a: a.update(bits=5, group_size=32), "bits must be 2, 3, 4 or 8"),
    (lambda a: a.update(bits=4, group_size=512), "above 256"),
])
def test_quantizers_given_one_way_and_in_full(edit, says):
    raw = protocol()
    edit(raw["analyses"]["residual_window"])
    with pytest.raises(ProtocolError, match=says):
        validate_protocol(copy.deepcopy(raw))
