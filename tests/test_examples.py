"""examples/plot_run.py: one figure from a run's results.csv, written outside the run."""

from __future__ import annotations

import struct
import subprocess
import sys
import zlib

import pytest

from testbed.audit import audit
from tests._helpers import REPO, synthetic_run


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG after checking its signature, chunk CRCs and final IEND."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND" and pos == len(data)
    assert any(k == b"IDAT" for k, _ in chunks)
    return struct.unpack(">II", chunks[0][1][:8])


def test_plot_run_writes_a_valid_png_outside_the_run(tmp_path):
    pytest.importorskip("matplotlib")
    run = synthetic_run(tmp_path, "plot", distributions=["clean", "recent_focus"])
    out = tmp_path / "fig.png"
    r = subprocess.run([sys.executable, str(REPO / "examples" / "plot_run.py"), str(run), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "2 series" in r.stdout  # one line per distribution
    width, height = png_size(out.read_bytes())
    assert width > 100 and height > 100
    assert audit(run, check_sources=False)[0]  # nothing was added to the run folder


def _plot_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_run", REPO / "examples" / "plot_run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _report_table(md: str, section: str, first_header: str) -> list[dict]:
    """The first markdown table of ``## section`` whose header starts with ``first_header``, as dicts."""
    body = md.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    lines = body.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|") and ln.strip("| ").startswith(first_header))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    out = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        out.append(dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))))
    return out


def test_default_plot_points_are_the_reports_residual_window_table():
    """The default plot (residual_window, rel-L2 per arm and distribution) of the archived evidence
    run equals report.md's table: arms are chosen by name, so first16 (residual 0, float32 sink)
    is not averaged into R=0."""
    mod = _plot_module()
    evidence = REPO / "evidence"
    data = mod.plot_data(mod.parser().parse_args([str(evidence), "--out", "unused.png"]))
    table = _report_table((evidence / "report.md").read_text(encoding="utf-8"), "residual_window", "distribution")
    assert {r["distribution"] for r in table} == set(data)
    compared = 0
    for r in table:
        points = dict(data[r["distribution"]])
        arms = [c[len("rel-L2 "):] for c in r if c.startswith("rel-L2 ")]
        assert set(arms) == set(points), (arms, points)
        for arm in arms:
            cell = r[f"rel-L2 {arm}"]
            decimals = len(cell.rstrip("%").split(".")[1])
            assert f"{100 * points[arm]:.{decimals}f}%" == cell, (r["distribution"], arm)
            compared += 1
    assert compared == 15
    # R=0 and first16 both have residual 0; by residual value they are refused, not averaged
    with pytest.raises(ValueError, match="first16"):
        mod.plot_data(mod.parser().parse_args([str(evidence), "--out", "u.png", "--x", "residual"]))
