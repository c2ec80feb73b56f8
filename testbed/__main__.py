"""``python -m testbed``: the entry points, one line each."""

from __future__ import annotations

import sys

ENTRY_POINTS = (
    ("python -m testbed.run --out DIR", "testbed-run", "run the default (or --protocol) studies into a new run folder"),
    ("python -m testbed.run --describe [NAME]", "testbed-run", "every protocol key, type, default and meaning"),
    ("python -m testbed.audit DIR", "testbed-audit", "re-derive every number of a run (numpy + stdlib only)"),
    ("python -m testbed.compare A B", "testbed-compare", "compare two runs within cross-machine tolerances"),
    ("python -m testbed.replay RUN", "", "re-run a random sample of the live and retrieval units and compare"),
    ("python examples/capture_any_model.py", "", "capture attention from a transformers model into a trace file"),
    ("python examples/plot_run.py DIR", "", "plot one figure from a run's results.csv (needs matplotlib)"),
)


def main() -> int:
    width = max(len(cmd) for cmd, _, _ in ENTRY_POINTS)
    print("testbed: KV-cache compression testbed. Entry points:")
    for cmd, script, what in ENTRY_POINTS:
        print(f"  {cmd:<{width}}  {what}" + (f" (also: {script})" if script else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
