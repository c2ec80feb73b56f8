"""Entry points: ``python -m testbed`` lists them; the console scripts of pyproject.toml resolve."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import tomllib

from tests._helpers import REPO


def test_console_scripts_resolve_to_callables_and_are_listed():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"testbed-run", "testbed-audit", "testbed-compare"}
    listing = subprocess.run([sys.executable, "-m", "testbed"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), target
        assert f"(also: {name})" in listing


def test_every_listed_entry_point_exists():
    from testbed.__main__ import ENTRY_POINTS

    for cmd, _, _ in ENTRY_POINTS:
        words = cmd.split()
        if words[1] == "-m":
            assert importlib.util.find_spec(words[2]) is not None, cmd
        else:
            assert (REPO / words[1]).is_file(), cmd

