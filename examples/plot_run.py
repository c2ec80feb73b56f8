"""Plot one figure from a run folder's results.csv with matplotlib (installed with testbed: it draws report.html).

    python examples/plot_run.py target/first --out rw.png            # residual window: error per arm
    python examples/plot_run.py evidence --analysis live_quality --x arm --y perplexity --by study --out ppl.png

Rows of ``--analysis`` with a number in column ``--y`` are grouped by ``--by`` (one line per
group) and averaged per value of ``--x``. A point never mixes arms: rows of different ``arm``
that share an x value are refused (plot ``--x arm``, split them with ``--by arm`` or keep some
with ``--arm NAME``), since two arms can share a column value (the residual window's ``first16``
arm and its ``R=0`` arm both have residual 0). Columns are those of results.csv (nested fields are
dotted: ``quant.key.bits``). The figure is written to ``--out``, never into the run folder (the
audit would refuse a file the manifest does not name).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path


def _number(cell: str):
    try:
        return float(cell)
    except ValueError:
        return None


def series(rows: list[dict], x: str, y: str, by: str) -> dict[str, list[tuple]]:
    """{group: [(x value, mean y), ...]} in the order the x values first appear.

    Raises ValueError when one point would average rows of different arms."""
    sums: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    arms: dict[tuple[str, str], set] = defaultdict(set)
    for r in rows:
        val = _number(r.get(y, ""))
        if val is not None and r.get(x, "") != "":
            group = r.get(by, "") or "(none)"
            sums[group][r[x]].append(val)
            arms[group, r[x]].add(r.get("arm", ""))
    for (group, xv), names in arms.items():
        if len(names) > 1:
            raise ValueError(f"the point {x}={xv} of {by}={group} would average the arms {sorted(names)}; "
                             "plot --x arm, split with --by arm, or keep one with --arm NAME")
    out = {}
    for group, per_x in sums.items():
        keys = list(per_x)
        if all(_number(k) is not None for k in keys):
            keys.sort(key=float)
        out[group] = [(k, sum(per_x[k]) / len(per_x[k])) for k in keys]
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a run folder (holds results.csv)")
    ap.add_argument("--out", required=True, help="PNG file to write")
    ap.add_argument("--analysis", default="residual_window")
    ap.add_argument("--x", default="arm", help="column of the x axis (default: arm, selected by name)")
    ap.add_argument("--y", default="rel_l2")
    ap.add_argument("--by", default="distribution")
    ap.add_argument("--arm", action="append", default=None, help="keep only rows of this arm (repeatable)")
    return ap


def plot_data(args) -> dict[str, list[tuple]]:
    """The points `main` plots for parsed ``args``: {group: [(x value, mean y), ...]}.

    Raises FileNotFoundError without results.csv and ValueError for a point mixing arms."""
    path = Path(args.run) / "results.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a run folder of this testbed version holds one)")
    with open(path, newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r.get("analysis") == args.analysis
                and (not args.arm or r.get("arm") in args.arm)]
    return series(rows, args.x, args.y, args.by)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        data = plot_data(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not data:
        print(f"error: no {args.analysis} rows with a number in column {args.y!r} and a value in {args.x!r}",
              file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for group, points in sorted(data.items()):
        ax.plot([str(p[0]) for p in points], [p[1] for p in points], marker="o", label=group)
    ax.set_xlabel(args.x)
    ax.set_ylabel(f"mean {args.y}")
    ax.set_title(f"{args.analysis}: {Path(args.run).resolve().name}")
    if args.y in ("rel_l2", "tv", "mean_kl") and all(p[1] > 0 for pts in data.values() for p in pts):
        ax.set_yscale("log")
    ax.legend(title=args.by, fontsize="small")
    fig.tight_layout()
    fig.savefig(args.out, format="png", dpi=100)
    print(f"wrote {args.out} ({sum(len(p) for p in data.values())} points in {len(data)} series)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
