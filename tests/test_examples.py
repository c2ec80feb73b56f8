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
