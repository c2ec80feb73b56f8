"""No partial output: kills, interrupts, an existing --out and bad protocols leave nothing at --out.

The interrupt tests start ``python -m testbed.run`` as a subprocess on a protocol slow enough to be
caught mid-way, wait for its first progress line on stderr (never a fixed sleep) and then signal it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests._helpers import default_sigint

from testbed.audit import audit
from testbed.run import main as run_main, partial_dir, sweep_stale_partials
from tests._helpers import synthetic_protocol as synthetic

REPO = Path(__file__).resolve().parent.parent
WAIT = 180  # seconds to wait for a progress line / an exit; generous for a loaded 2-core machine


def write(tmp_path: Path, proto: dict, name: str = "p.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(proto))
    return path


def slow_protocol(tmp_path: Path) -> Path:
    """Hundreds of cases of 4096 keys: minutes in all, the first case within seconds."""
    return write(tmp_path, synthetic("slow", seeds=list(range(400)), lengths=[4096], queries=64, head_dim=64,
                                     distributions=["clean", "recent_focus"]), "slow.json")


class Run:
    """``python -m testbed.run`` in a subprocess, its stderr read line by line on a thread."""

    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "testbed.run", *args], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=default_sigint)
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip("\n"))
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str) -> str:
        while True:
            try:
                line = self.lines.get(timeout=WAIT)
            except queue.Empty:
                self.proc.kill()
                pytest.fail(f"no line containing {text!r} within {WAIT} s; stderr so far: {self.stderr[-5:]}")
            if line is None:
                pytest.fail(f"run ended before printing {text!r}: {self.stderr[-5:]}")
            if text in line:
                return line

    def finish(self) -> tuple[int, str, list[str]]:
        try:
            self.proc.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        out = self.proc.stdout.read()  # small: one line at most (stderr is drained by the reader thread)
        self._reader.join(timeout=WAIT)
        self.proc.stdout.close()
        self.proc.stderr.close()
        return self.proc.returncode, out, self.stderr


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name)


# -- signals -------------------------------------------------------------------------------------

def test_sigkill_leaves_nothing_at_out_and_a_rerun_works(tmp_path, reliability):
    out = tmp_path / "runs" / "slow"
    run = Run("--out", str(out), "--protocol", str(slow_protocol(tmp_path)))
    run.wait_for("[slow] case 1/")
    run.proc.kill()  # SIGKILL: no handler can run
    code, _, _ = run.finish()
    partial = partial_dir(out, run.proc.pid)
    reliability("kill", "SIGKILL after the first case", "nothing at --out; a named, ignored partial folder; re-run works",
                f"exit {code}; left {leftovers(out.parent)}")
    assert code == -signal.SIGKILL
    assert not out.exists()
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    # never confused with a run: the audit refuses it, and git ignores it wherever it sits
    assert not audit(partial, check_sources=False)[0]
    rel = f"somewhere/{partial.name}/manifest.json"
    assert subprocess.run(["git", "check-ignore", "-q", "--no-index", rel], cwd=REPO).returncode == 0
    # a re-run to the same --out works and sweeps the dead run's folder
    rerun = Run("--out", str(out), "--protocol", str(write(tmp_path, synthetic("fast"))))
    code, stdout, stderr = rerun.finish()
    assert code == 0, stderr[-3:]
    assert any(f"removed {partial}" in line for line in stderr)
    assert leftovers(out.parent) == []
    assert audit(out, check_sources=False)[0]


@pytest.mark.parametrize("sig,code,word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_interrupt_ends_with_one_line_and_no_output(tmp_path, sig, code, word, reliability):
    out = tmp_path / "runs" / "slow"
    run = Run("--out", str(out), "--protocol", str(slow_protocol(tmp_path)))
    run.wait_for("[slow] case 1/")
    run.proc.send_signal(sig)
    rc, stdout, stderr = run.finish()
    reliability("kill", f"{signal.Signals(sig).name} after the first case", f"exit {code}, one line, nothing written",
                f"exit {rc}: {stderr[-1] if stderr else ''}")
    assert rc == code
    assert stderr[-1] == f"{word}: nothing was written to {out}"
    assert not any("Traceback" in line for line in stderr)
    assert [line for line in stderr if not line.startswith("[slow] case ")] == [stderr[-1]]
    assert stdout == ""
    assert not out.exists() and leftovers(out.parent) == []


# -- --out ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["folder", "file", "dangling symlink", "partial name"])
def test_existing_or_reserved_out_refused_untouched(tmp_path, kind, capsys, reliability):
    out = tmp_path / "out"
    if kind == "folder":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif kind == "file":
        out.write_text("mine")
    elif kind == "dangling symlink":
        out.symlink_to(tmp_path / "nowhere")
    else:
        out = tmp_path / ".x.partial-1"
    proto = write(tmp_path, synthetic("fast"))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    rc = run_main(["--quiet", "--out", str(out), "--protocol", str(proto)])
    err = capsys.readouterr().err.strip().splitlines()
    reliability("bad input: CLI",
                f"--out is an existing {kind}" if kind != "partial name" else "--out named like a partial folder",
                "exit 2, one line, untouched", f"exit {rc}: {err[-1] if err else ''}")
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: --out")
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    if kind == "folder":
        assert (out / "keep.txt").read_text() == "mine"
    if kind == "file":
        assert out.read_text() == "mine"


def test_existing_out_via_cli_subprocess(tmp_path, reliability):
    out = tmp_path / "out"
    out.mkdir()
    rc, stdout, stderr = Run("--out", str(out), "--protocol", str(write(tmp_path, synthetic("fast")))).finish()
    reliability("bad input: CLI", "--out exists (real subprocess)", "exit 2, one line", f"exit {rc}: {stderr}")
    assert rc == 2 and len(stderr) == 1 and "already exists" in stderr[0] and list(out.iterdir()) == []


# -- bad protocols through the CLI -----------------------------------------------------------------

BAD = {
    "missing file": None,
    "not JSON": b"{",
    "not UTF-8": b"\xff{}",
    "duplicate key": b'{"name": "a", "name": "b", "source": {}, "analyses": {}}',
    "NaN literal": json.dumps(synthetic("x", focus_logit=0.5)).replace("0.5", "NaN").encode(),
    "a list": b"[]",
    "missing source": json.dumps({"name": "x", "analyses": {}}).encode(),
    "unknown top-level key": json.dumps(dict(synthetic("x"), extra=1)).encode(),
    "unknown source key": json.dumps(synthetic("x", colour="red")).encode(),
    "wrong type (lengths a string)": json.dumps(synthetic("x", lengths="64")).encode(),
    "negative length": json.dumps(synthetic("x", lengths=[-64])).encode(),
    "absurd length": json.dumps(synthetic("x", lengths=[10 ** 12])).encode(),
    "boolean for an integer": json.dumps(synthetic("x", head_dim=True)).encode(),
    "unknown analysis": json.dumps(dict(synthetic("x"), analyses={"nope": {}})).encode(),
    "seed beyond 64 bits": json.dumps(synthetic("x", seeds=[2 ** 70])).encode(),
    "focus longer than half a length": json.dumps(synthetic("x", focus_tokens=40)).encode(),
    "name with a slash": json.dumps(dict(synthetic("x"), name="../evil")).encode(),
    "folder instead of file": "dir",
}


@pytest.mark.parametrize("what", list(BAD))
def test_bad_protocol_one_line_exit_2_nothing_written(tmp_path, what, capsys, reliability):
    path = tmp_path / "bad.json"
    if BAD[what] == "dir":
        path.mkdir()
    elif BAD[what] is not None:
        path.write_bytes(BAD[what])
    out = tmp_path / "runs" / "out"
    rc = run_main(["--quiet", "--out", str(out), "--protocol", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    reliability("bad input: protocol", what, "exit 2, one 'error:' line, nothing written", err[-1] if err else "")
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert not out.exists()
    assert not out.parent.exists() or leftovers(out.parent) == []


def test_bad_protocol_via_cli_subprocess_names_the_key(tmp_path, reliability):
    path = write(tmp_path, synthetic("x", lengths=[64, "long"]))
    rc, stdout, stderr = Run("--out", str(tmp_path / "o"), "--protocol", str(path)).finish()
    reliability("bad input: protocol", "wrong type inside a list (real subprocess)", "exit 2, one line naming source.lengths[1]",
                f"exit {rc}: {stderr}")
    assert rc == 2 and len(stderr) == 1 and "source.lengths[1]" in stderr[0] and not (tmp_path / "o").exists()


def test_bug_inside_an_analysis_leaves_nothing(tmp_path, monkeypatch, reliability):
    """A crash that is not bad input keeps its traceback (it is a bug), but still leaves no output."""
    from testbed.analyses import residual_window

    calls = []

    def boom(case, params, ctx):
        calls.append(case.id)
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(residual_window, "evaluate", boom)
    out = tmp_path / "runs" / "out"
    with pytest.raises(RuntimeError, match="simulated bug"):
        run_main(["--quiet", "--out", str(out), "--protocol", str(write(tmp_path, synthetic("x")))])
    reliability("kill", "an exception inside an analysis", "traceback kept, nothing at --out, no partial folder",
                f"left {leftovers(out.parent)}")
    assert calls and not out.exists() and leftovers(out.parent) == []


# -- the sweep itself ------------------------------------------------------------------------------

def test_sweep_removes_only_dead_runs_partials(tmp_path, reliability):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        alive_dir = tmp_path / f".a.partial-{sleeper.pid}"
        dead_dir = tmp_path / f".b.partial-{dead.pid}"
        other = [tmp_path / ".c.partial-x", tmp_path / "d.partial-1", tmp_path / f".e.partial-{dead.pid}.bak"]
        for d in [alive_dir, dead_dir, *other]:
            d.mkdir()
        link = tmp_path / f".f.partial-{dead.pid + 1}"
        link.symlink_to(alive_dir)
        removed = sweep_stale_partials(tmp_path)
        reliability("kill", "stale partial folders swept", "only the dead run's folder removed", [p.name for p in removed])
        assert removed == [dead_dir]
        assert alive_dir.is_dir() and all(d.is_dir() for d in other) and link.is_symlink()
    finally:
        sleeper.kill()
        sleeper.wait()
