"""Progress lines: k/N and the time left, on stderr only, never in the evidence."""

from __future__ import annotations

import json

from testbed.audit import compare
from testbed.progress import Progress, format_seconds, weighted_left
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


def test_the_estimate_weights_steps_by_their_cost_class():
    """Two testbed arms and two quanto arms left after one testbed arm took 10 s: with quanto's prior
    of 8 the rest is 2 x 10 + 2 x 80 s, not 4 x 10 s; once a quanto arm is timed its own time is used."""
    clock, lines = Clock(), []
    kinds = ["testbed", "testbed", "quanto", "testbed", "quanto"]
    bar = Progress(5, "live", lines.append, unit="batch x arm", clock=clock, kinds=kinds, prior={"quanto": 8.0})
    clock.t += 10
    bar.step("a", kind="testbed")
    assert bar.left() == 2 * 10 + 2 * 8 * 10
    assert lines[-1].endswith("~3 min left")  # 180 s; the unweighted mean rate said 40 s
    clock.t += 30  # a quanto arm: 30 s, not the 80 s of the prior
    bar.step("b", kind="quanto")
    assert bar.left() == 2 * 10 + 1 * 30  # each class at its own mean
    clock.t += 20
    bar.step("c", kind="testbed")  # testbed's mean is now (10 + 20) / 2
    assert bar.left() == 15 + 30


def test_weighted_left_prices_untimed_classes_by_their_prior():
    # 12 s for steps of prior 1 and 2 (3 units): 4 s a unit; a class never timed costs its prior x 4 s
    done = [("a", 2.0), ("b", 10.0)]
    assert weighted_left(done, {"a": 1, "c": 2}, {"b": 2.0, "c": 3.0}) == 2.0 + 2 * 3 * 4.0
    assert weighted_left(done, {"a": 1, "b": 1}, {"b": 2.0}, learn=False) == 4.0 + 8.0  # parallel: prior only
    assert weighted_left([], {"a": 1}) is None
    assert weighted_left(done, {"a": 0}) == 0.0


def test_the_quanto_warm_up_is_announced_before_it_runs(monkeypatch):
    from testbed import live

    lines, calls = [], []
    monkeypatch.setattr(live.peers, "_QUANTO_WARM", [])
    monkeypatch.setattr(live.peers, "_quanto_warmup", lambda model, kw, cfg: calls.append(list(lines)))
    assert live.warm_quanto(None, {}, None, lines.append) >= 0.0
    assert len(calls) == 1 and len(calls[0]) == 1  # one line was out when the warm-up began
    assert "quanto" in calls[0][0] and "compil" in calls[0][0]
    assert len(lines) == 2 and "ready" in lines[1]
    assert live.warm_quanto(None, {}, None, lines.append) == 0.0  # once per process: no second warm-up, no line
    assert len(calls) == 1 and len(lines) == 2


def test_a_one_off_inside_a_step_is_left_out_of_its_class_cost():
    """The first quanto arm took 100 s of which 80 s compiling: the next quanto arm is priced at 20 s."""
    clock = Clock()
    bar = Progress(3, "live", None, clock=clock, kinds=["testbed", "quanto", "quanto"], prior={"quanto": 8.0})
    clock.t += 5
    bar.step(kind="testbed")
    clock.t += 100
    bar.step(kind="quanto", one_off=80.0)
    assert bar.left() == 20.0
    assert bar.elapsed() == 105.0  # the one-off still counts as time spent


def test_a_live_units_note_names_its_batch_among_the_batches():
    from testbed.live import batch_note, cost_kind
    from testbed.policies import preset

    note = batch_note({"batch": 0, "batches": 3}, 4, "segments")
    assert "1/3" in note and "4 segments" in note and "(batch 1)" not in note
    assert [cost_kind(None), cost_kind({"bits": 4}), cost_kind(preset("int4"))] == ["reference", "quanto", "testbed"]
