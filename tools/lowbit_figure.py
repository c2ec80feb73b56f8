"""Issue 46's figure: perplexity change against the packed middle's bits per element, every arm of
one or more finished live runs (``lowbit``, ``lowbit_groups``, ``lowbit_calibrated``, ...).

    python tools/lowbit_figure.py /work/runs/lowbit /work/runs/lowbit_int4 /work/runs/lowbit_calibrated \
        /work/runs/lowbit_groups --out docs/img/lowbit_bits.png        # the README's figure

Per arm: Δ perplexity = exp(mean over segments of the arm's NLL minus the reference's) - 1, from
results.json (the number report.md prints); bits per element = the middle's bytes per packed token
of K and V (codes, scales, zero-points, outliers and their indices: ``Policy.packed_bytes_per_token``)
plus a calibrated codebook's per-layer tables spread over the tokens packed at the segment's end,
times 8, over the 2 x KV heads x head dim elements of a token. The float32 window and sink are not
in it (the report.html figure's bits axis is the whole cache's). Run it after the audit passes.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

REFERENCE = "dynamic_cache"


def arm_points(run: Path) -> list[tuple[str, float, float]]:
    """(arm, bits per element of the middle, Δ perplexity) of every quantized policy arm of a run."""
    from testbed.policies import Policy
    from testbed.sources.models import MODELS

    rows = json.loads((run / "results.json").read_text())["rows"]
    dims = rows[0].get("model_dims") or MODELS[rows[0]["model"]]  # a model given by path states its own
    heads, head_dim = dims["kv_heads"], dims["head_dim"]
    ref = {r["case"]: r["nll"] for r in rows if r["arm"] == REFERENCE}
    out = {}
    for r in rows:
        if r.get("kind") != "policy":
            continue
        out.setdefault(r["arm"], []).append(r)
    points = []
    for arm, rs in out.items():
        pol = Policy(**rs[0]["policy"])
        if not pol.quantized:
            continue
        per = pol.packed_bytes_per_token(heads, head_dim)
        packed = pol.packed_tokens(int(rs[0]["context_final"]))
        if pol.calibrated and packed:
            per += pol.table_bytes(head_dim) / packed
        bits = per * 8 / (2 * heads * head_dim)
        d = sum(r["nll"] - ref[r["case"]] for r in rs) / len(rs)
        points.append((arm, bits, math.exp(d) - 1))
    return points


def family(arm: str) -> str:
    if arm.startswith("cb"):
        return "levels calibrated per layer"
    if arm.startswith("nf"):
        return "NormalFloat levels"
    if "had" in arm or "ds" in arm or "pre" in arm:
        return "rotation / outliers / pre-RoPE keys"
    return "uniform (KIVI)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default="SmolLM2-135M-Instruct, 2,048 tokens, mean of 8 segments (no intervals drawn)")
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen, pts = set(), []
    for run in a.runs:
        for arm, bits, dppl in arm_points(run):
            if arm not in seen:  # an arm run twice (the same config) is drawn once, from the first run given
                seen.add(arm)
                pts.append((arm, bits, dppl))
    colours = {"uniform (KIVI)": "black", "NormalFloat levels": "tab:blue",
               "levels calibrated per layer": "tab:green", "rotation / outliers / pre-RoPE keys": "tab:orange"}
    dropped = [p for p in pts if p[2] <= 0]  # a log axis has no place for them: say so
    if dropped:
        print("not drawn (Δ <= 0 on a log axis): " + ", ".join(f"{a} {100 * d:+.2f} %" for a, _, d in dropped))
    pts = [p for p in pts if p[2] > 0]
    fig, ax = plt.subplots(figsize=(8, 5.2), dpi=110)
    for fam, colour in colours.items():
        sel = [p for p in pts if family(p[0]) == fam]
        ax.scatter([p[1] for p in sel], [100 * p[2] for p in sel], c=colour, label=fam, s=22, zorder=3)
    for arm, bits, dppl in pts:
        ax.annotate(arm, (bits, 100 * dppl), fontsize=6.5, xytext=(3, 2), textcoords="offset points")
    ax.set_yscale("log")
    ax.axhline(1.0, ls="--", c="grey", lw=0.8)
    ax.axhline(5.0, ls=":", c="grey", lw=0.8)
    ax.axvline(3.25, ls="--", c="grey", lw=0.8)
    ax.text(3.27, 0.62, "3.25 bits", fontsize=7, color="grey")
    ax.text(4.3, 1.05, "1 %", fontsize=7, color="grey")
    ax.text(4.3, 5.25, "5 %", fontsize=7, color="grey")
    ax.set_xlabel("bits per element of the quantized middle (K and V; scales, zero-points, outliers, indices, tables)")
    ax.set_ylabel("Δ perplexity vs DynamicCache (%, log)")
    ax.set_title(a.title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out)
    print(f"wrote {a.out} ({len(pts)} arms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
