"""Progress lines: k/N and the time left, on stderr only, never in the evidence."""

from __future__ import annotations

import json

from testbed.audit import compare
from testbed.progress import Progress, format_seconds
from testbed.run import main as run_main
from tests._helpers import synthetic_protocol


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_lines_count_steps_and_estimate_the_rest_from_the_mean_rate():
    clock, lines = Clock(), []
    bar = Progress(4, "study", lines.append, unit="case", clock=clock)
    clock.t += 10
    bar.step("a")
    clock.t += 30  # 40 s for 2 steps: 20 s each, 2 to go
    bar.step("b")
    clock.t += 20
    bar.step()
    clock.t += 20
    bar.step("d")
    assert lines[0] == "[study] case 1/4 a: 10.0 s elapsed, ~30.0 s left"
    assert lines[1] == "[study] case 2/4 b: 40.0 s elapsed, ~40.0 s left"
    assert lines[2] == "[study] case 3/4: 1 min elapsed, ~20.0 s left"
    assert lines[3] == "[study] case 4/4 d: 1 min 20 s elapsed"  # nothing left: no estimate


def test_unknown_total_and_interval():
    clock, lines = Clock(), []
    bar = Progress(None, "x", lines.append, clock=clock)
    bar.step()
    assert lines == ["[x] 1: 0.0 s elapsed"]
    lines.clear()
    bar = Progress(100, "audit", lines.append, unit="row", interval=2.0, clock=clock)
    for _ in range(100):  # 0.5 s a step: a line every 4 steps at most
        clock.t += 0.5
        bar.step()
    assert len(lines) == 25 and lines[0].startswith("[audit] row 4/100: 2.0 s elapsed, ~48.0 s left")
    lines.clear()
    quick = Progress(10, "audit", lines.append, interval=2.0, clock=clock)
    for _ in range(10):
        quick.step()
    assert lines == []  # work that is over within the interval prints nothing


def test_format_seconds():
    assert [format_seconds(s) for s in (0.04, 59.94, 60, 125, 3600, 5430)] == [
        "0.0 s", "59.9 s", "1 min", "2 min 5 s", "1 h 00 min", "1 h 30 min"]


def test_progress_never_reaches_the_run_folder(tmp_path, capsys):
    proto = tmp_path / "p.json"
    proto.write_text(json.dumps(synthetic_protocol("prog", distributions=["clean", "early_focus"])))
    assert run_main(["--out", str(tmp_path / "loud"), "--protocol", str(proto)]) == 0
    err = capsys.readouterr().err
    assert "[prog] case 1/2 clean-s1-n64" in err and "[prog] case 2/2 " in err
    assert run_main(["--quiet", "--out", str(tmp_path / "quiet"), "--protocol", str(proto)]) == 0
    assert capsys.readouterr().err == ""
    assert compare(tmp_path / "loud", tmp_path / "quiet") == []  # same arrays, results, protocol copies
    for path in (tmp_path / "loud").rglob("*"):
        if path.is_file() and path.suffix in (".json", ".md", ".csv"):
            assert "elapsed" not in path.read_text(), path
