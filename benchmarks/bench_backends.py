"""Wall time of one set of protocols run serially, with --jobs N and with --backend ray.

    .venv/bin/python benchmarks/bench_backends.py                      # the default protocols
    .venv/bin/python benchmarks/bench_backends.py --protocol protocols/smollm2_quality_full.json

Each backend runs the same protocols into its own folder under --work (default target/bench_backends),
one after the other on the same machine; the script then checks that the three folders hold the
same arrays and results (the serial run is the reference) and prints wall times as ratios to it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _same(a: Path, b: Path) -> bool:
    ma, mb = (json.loads((x / "manifest.json").read_text()) for x in (a, b))
    return ma["arrays"] == mb["arrays"] and (a / "results.json").read_bytes() == (b / "results.json").read_bytes()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--protocol", action="append", default=[], metavar="FILE")
    ap.add_argument("--jobs", type=int, default=2, help="--jobs for the worker-process run and Ray's CPUs (default 2)")
    ap.add_argument("--work", default="target/bench_backends")
    args = ap.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    protos = [a for p in args.protocol for a in ("--protocol", p)]
    arms = {"serial": [], f"--jobs {args.jobs}": ["--jobs", str(args.jobs)],
            f"--backend ray ({args.jobs} CPUs)": ["--backend", "ray", "--jobs", str(args.jobs)]}
    wall = {}
    for i, (name, extra) in enumerate(arms.items()):
        out = work / f"run{i}"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "testbed.run", "--quiet", "--out", str(out), *protos, *extra],
                       cwd=REPO, check=True)
        wall[name] = (time.perf_counter() - t0, out)
        print(f"{name}: {wall[name][0]:.1f} s", file=sys.stderr, flush=True)
    ref_s, ref_out = wall["serial"]
    print("| backend | wall (s) | ÷ serial | same arrays and results as serial |")
    print("|---|---:|---:|---|")
    for name, (sec, out) in wall.items():
        print(f"| {name} | {sec:.1f} | {sec / ref_s:.2f} | {'yes' if _same(ref_out, out) else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
