"""Drawing a figure's data with matplotlib (Agg, imported by the caller): one ``_draw_<kind>`` per
figure kind (`draw_figure`), the page's size and font rules (`PAGE_PX`, `DPI`, `RC`), and
`figure_layout`, where a drawn figure's text and panels lie (the readability tests)."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from .data import REGIONS

__all__ = ["figure_layout", "draw_figure", "PAGE_PX", "DPI", "MIN_TEXT_PX", "RC"]


# The page shows a figure at its native width up to the body's content width (page.py's ``_STYLE``: max-width
# 70em at the browser's 16 px = 1120 px, which a 1400 px window gives in full), so a figure is drawn
# at most that wide, at a dpi where every font (8.5 pt or more: ``RC``) is at least 11 px there.
PAGE_PX = 1120
DPI = 100
MIN_TEXT_PX = 11
_MAX_W = PAGE_PX / DPI  # inches
RC = {"font.size": 9, "axes.titlesize": 9.5, "axes.labelsize": 9, "xtick.labelsize": 8.5, "ytick.labelsize": 8.5,
       "legend.fontsize": 8.5, "figure.titlesize": 10.5, "figure.dpi": DPI, "savefig.dpi": DPI,
       "figure.autolayout": True,  # tight layout: half the time of constrained
       "text.antialiased": False}  # crisp glyphs: half the PNG bytes of smoothed ones, as legible at 1:1


def _log(ax, which: str = "y"):
    """A log scale without minor ticks (their labels are most of a figure's drawing time), called
    after the data are drawn: when fewer than two powers of ten lie in view, the ticks are 1, 2 and
    5 times a power of ten (or every integer multiple) with plain labels, so that two carry a label."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    axis.set_minor_locator(NullLocator())
    lo, hi = sorted(getattr(ax, f"get_{which}lim")())
    for subs in ((1.0,), (1.0, 2.0, 5.0), tuple(range(1, 10))):
        locator = LogLocator(base=10, subs=subs)
        if sum(lo <= t <= hi for t in locator.tick_values(lo, hi)) >= 2:
            break
    if subs != (1.0,):
        axis.set_major_locator(locator)
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _legend_right(ax, **kw):
    """A legend beside the axes (never over the data)."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kw)


def _legend_below(ax, **kw):
    """A legend under the axes, below its tick labels and x label (never over the data)."""
    return ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), borderaxespad=4.2, **kw)


def _ecdf(ax, x, **kw):
    x = np.asarray(x, dtype=float)
    return ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", **kw)


def _draw_heatmap(plt, d):
    n = len(d["panels"])
    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(min(2.7 * cols + 0.6, _MAX_W), 3.2 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, p in zip(axes.flat, d["panels"]):
        im = ax.imshow(np.asarray(p["mean"]), aspect="auto", cmap="viridis", vmin=0)
        ax.set_title(f"{p['distribution']} ({len(p['cases'])} cases)")
        ax.set_xlabel(f"key block ({p['frame']} tokens)")
        ax.set_ylabel("query block")
        ax.set_yticks(range(len(p["mean"])))
        fig.colorbar(im, ax=ax, fraction=0.05, label="attention mass" if ax is axes.flat[n - 1] else None)
    return fig


def _draw_support(plt, d):
    fig, ax = plt.subplots(figsize=(7.6, 3.4))
    for line in d["lines"]:
        _ecdf(ax, line["support_sorted"],
              label=f"{line['distribution']} ({len(line['cases'])} cases, {len(line['support_sorted'])} rows)")
    ax.set_xlabel("effective support (share of visible keys)")
    ax.set_ylabel("share of rows <= x")
    ax.set_xlim(0, 1)
    _legend_right(ax)
    return fig


def _draw_regions(plt, d):
    fig, ax = plt.subplots(figsize=(max(4.0, min(1.6 * len(d["groups"]) + 2.4, _MAX_W)), 3.4))
    width = 0.8 / len(REGIONS)
    labelled = set()
    for gi, g in enumerate(d["groups"]):
        for ri, reg in enumerate(REGIONS):
            vals = [v for v in g["regions"].get(reg, []) if v is not None]
            if not vals:
                continue
            x = gi + (ri - (len(REGIONS) - 1) / 2) * width
            ax.bar(x, np.mean(vals), width * 0.9, color=f"C{ri}")
            labelled.add(reg)
            ax.plot([x] * len(vals), vals, "k.", ms=4)
    for ri, reg in enumerate(REGIONS):  # legend in region order, whichever group has the region first
        if reg in labelled:
            ax.bar([0], [0], 0, color=f"C{ri}", label=f"{reg} (mean)")
    ax.plot([], [], "k.", ms=4, label="one case")
    ax.set_xticks(range(len(d["groups"])), [g["distribution"] for g in d["groups"]])
    ax.set_ylabel("attention mass")
    ax.set_ylim(0, 1)
    _legend_right(ax)
    return fig


def _draw_mx(plt, d):
    fig, axes = plt.subplots(2, 2, figsize=(_MAX_W, 6.6), height_ratios=[1.25, 1])
    (qk, pp), (zeros, sums) = axes
    styles = {}
    for s in d["series"]:
        ax = pp if s["path"] == "p" else qk
        style = styles.setdefault((s["rotation"], s["scale_rule"]), f"C{len(styles)}")
        _ecdf(ax, s["tv_sorted"], color=style, label=f"rotation {s['rotation']}, {s['scale_rule']}")
    for ax, path in ((qk, "Q/K"), (pp, "P")):
        if not ax.lines:
            ax.axis("off")
            continue
        ax.set_title(f"{path} path: TV distance per row")
        _log(ax, "x")
        ax.set_xlabel("TV distance per row")
        ax.set_ylabel("share of rows <= x")
        _legend_below(ax, ncol=2)
    p = d["p"]
    if not p:
        zeros.axis("off")
        sums.axis("off")
        return fig
    dists = list(dict.fromkeys(p["distributions"]))
    rates = [100 * z for z in p["zero_rate_mean"]]
    zeros.set_title("P path strict zeros, one dot per case")
    if all(r == 0 for r in rates):
        zeros.axis("off")
        zeros.text(0.5, 0.5, f"all zero: no strict zero in any of the {len(rates)} cases\n({', '.join(dists)})",
                   ha="center", va="center", transform=zeros.transAxes, wrap=True)
    else:
        zeros.plot([dists.index(t) for t in p["distributions"]], rates, "o", ms=5)
        zeros.set_xticks(range(len(dists)), dists)
        zeros.set_xlim(-0.5, len(dists) - 0.5)
        zeros.set_ylabel("% of entries")
    _ecdf(sums, p["row_sum_sorted"])
    sums.axvline(1.0, color="grey", lw=0.8)
    sums.set_title("P path row sums (1 = a proper distribution)")
    sums.set_xlabel("row sum")
    sums.set_ylabel("share of rows <= x")
    return fig


def _draw_ablation(plt, d):
    kinds = list(dict.fromkeys(p["ablation"] for p in d["pairs"]))
    fig, axes = plt.subplots(1, len(kinds), figsize=(min(5.2 * len(kinds), _MAX_W), 3.6), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        sel = [p for p in d["pairs"] if p["ablation"] == kind]
        for i, p in enumerate(sel):
            for a, b in zip(p["ablation_rel_l2"], p["control_rel_l2"]):
                ax.plot([3 * i, 3 * i + 1], [a, b], "-o", color=f"C{i}", ms=4, lw=0.8)
        ax.set_xticks([3 * i + 0.5 for i in range(len(sel))], [p["distribution"] for p in sel])
        ax.set_xlim(-0.6, 3 * len(sel) - 1.4)
        ax.set_title(f"{kind} (left) vs {sel[0]['control']} (right)")
        ax.set_ylabel("output rel-L2")
        if all(v > 0 for p in sel for v in p["ablation_rel_l2"] + p["control_rel_l2"]):
            _log(ax)
    return fig


def _draw_residual(plt, d):
    dists = list(dict.fromkeys(c["distribution"] for c in d["cells"]))
    arms = list(dict.fromkeys(c["arm"] for c in d["cells"]))
    fig, ax = plt.subplots(figsize=(min(1.2 * len(arms) + 3.0, _MAX_W), 3.6))
    width = 0.8 / len(dists)
    for di, dist in enumerate(dists):
        for c in [c for c in d["cells"] if c["distribution"] == dist]:
            x = arms.index(c["arm"]) + (di - (len(dists) - 1) / 2) * width
            ax.bar(x, float(np.median(c["rel_l2"])), width * 0.9, color=f"C{di}", alpha=0.5,
                   label=f"{dist} (median)" if c["arm"] == arms[0] else None)
            ax.plot([x] * len(c["rel_l2"]), c["rel_l2"], "k.", ms=4)
    ax.plot([], [], "k.", ms=4, label="one seed")
    ax.set_xticks(range(len(arms)), arms)
    _log(ax)
    ax.set_ylabel("output rel-L2")
    _legend_right(ax)
    return fig


def _place_labels(ax, points, labels, colors):
    """Label each point (display-free data coordinates) without overlap: beside the marker if that
    spot is free, else at the nearest free spot on rings around it with a leader line; labels stay
    inside the axes; a leader line has its point's colour. Call after the axes' limits and the
    figure's layout are final."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    px = fig.dpi / 72.0
    xy = ax.transData.transform(np.asarray(points, dtype=float))
    marker = 5.0 * px  # half a marker, pixels
    taken = [(x - marker, y - marker, x + marker, y + marker) for x, y in xy]
    sizes = []
    for text in labels:
        t = ax.text(0, 0, text)
        e = t.get_window_extent(renderer)
        sizes.append((e.width, e.height))
        t.remove()

    def free(b):
        return (b[0] >= box.x0 + 2 and b[2] <= box.x1 - 2 and b[1] >= box.y0 + 2 and b[3] <= box.y1 - 2
                and not any(b[0] < o[2] and o[0] < b[2] and b[1] < o[3] and o[1] < b[3] for o in taken))

    gap = 1.5 * px
    for i in np.argsort(xy[:, 0], kind="stable"):
        (x, y), (w, h) = xy[i], sizes[i]
        near = [((marker + gap, 0), "left", "center"), ((-marker - gap, 0), "right", "center"),
                ((0, marker + gap), "center", "bottom"), ((0, -marker - gap), "center", "top")]
        rings = [((r * math.cos(a), r * math.sin(a)), "center", "center")
                 for r in (20, 30, 42, 56, 72, 90, 110, 135, 165, 200) for a in np.radians(np.arange(0, 360, 22.5))]
        best = None
        for (dx, dy), ha, va in near + [((dx * px, dy * px), ha, va) for (dx, dy), ha, va in rings]:
            x0 = x + dx - {"left": 0, "center": w / 2, "right": w}[ha]
            y0 = y + dy - {"bottom": 0, "center": h / 2, "top": h}[va]
            b = (x0, y0, x0 + w, y0 + h)
            if free(b):
                best = (dx, dy, ha, va, b)
                break
        if best is None:  # nowhere free: beside the marker (the test on overlaps will say so)
            best = (marker + gap, 0, "left", "center", (x + marker + gap, y - h / 2, x + marker + gap + w, y + h / 2))
        dx, dy, ha, va, b = best
        far = math.hypot(dx, dy) > marker + gap + 0.5
        ax.annotate(labels[i], tuple(points[i]), xytext=(dx / px, dy / px), textcoords="offset points", ha=ha, va=va,
                    arrowprops={"arrowstyle": "-", "color": colors[i], "lw": 1.0, "shrinkA": 0, "shrinkB": 3}
                    if far else None, gid="data-label")
        taken.append(b)


# candidate ticks of the bits axis, most wanted first: powers of two, then 1.5 times one, then the rest
_BITS_TICKS = (1, 2, 4, 8, 16, 32, 64, 1.5, 3, 6, 12, 24, 48, 0.5, 2.5, 5, 7, 10, 20)


def _bits_axis(ax, dims):
    """The bytes-per-token axis read again on top in bits per element: bytes x 8 / (2 x layers x KV
    heads x head dim), the K and V elements a token adds; ticks at round bit widths (32, 16, 8, 4,
    then 24, 12, 6, 3, then others) at least an eighth of the view apart on the log scale."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    per_token = 2 * dims["layers"] * dims["kv_heads"] * dims["head_dim"]
    top = ax.secondary_xaxis("top", functions=(lambda b: np.asarray(b) * 8 / per_token,
                                               lambda x: np.asarray(x) * per_token / 8))
    lo, hi = (v * 8 / per_token for v in sorted(ax.get_xlim()))
    gap = math.log10(hi / lo) / 8
    ticks = []
    for t in _BITS_TICKS:
        if lo <= t <= hi and all(abs(math.log10(t / k)) >= gap for k in ticks):
            ticks.append(t)
    top.xaxis.set_major_locator(FixedLocator(sorted(ticks)))
    top.xaxis.set_minor_locator(NullLocator())
    top.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    top.set_xlabel("bits per element (K and V, every scale and index byte)")


def _draw_live(plt, d):
    """Quality against bytes (each point labelled with its arm; the marker's shape is the context
    when there are several), and top-1 agreement along the steps in one small panel per arm."""
    base = [e["arm"].rpartition(" @ ")[0] or e["arm"] for e in d["arms"]]
    contexts = list(dict.fromkeys(e["arm"].rpartition(" @ ")[2] for e in d["arms"] if " @ " in e["arm"]))
    names = list(dict.fromkeys(base))
    cmap = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    color = {n: cmap(i % cmap.N) for i, n in enumerate(names)}
    shapes, dashes = "osD^v<>p", ("-", "--", ":", "-.")

    def context(arm):
        return contexts.index(arm.rpartition(" @ ")[2]) if " @ " in arm else 0

    def shape(arm):
        return shapes[context(arm) % len(shapes)]

    cols = 5
    rows = -(-len(names) // cols)
    fig = plt.figure(figsize=(_MAX_W, 4.4 + 1.4 * rows))
    gs = fig.add_gridspec(1 + rows, 2 * cols, height_ratios=[3.6] + [1.15] * rows)
    a1, a2 = fig.add_subplot(gs[0, :cols]), fig.add_subplot(gs[0, cols:])
    pts = {a1: [], a2: []}
    for e, b in zip(d["arms"], base):
        for ax, y in ((a1, e["delta_pct"]), (a2, e["mean_kl"])):
            if y is not None:
                ax.plot(e["bytes_per_token"], y, shape(e["arm"]), color=color[b], ms=6)
                pts[ax].append(((e["bytes_per_token"], y), b, color[b]))
    for ax, label, lin in ((a1, "perplexity change vs reference (%)", 0.1), (a2, "mean KL (nats / token)", 1e-3)):
        ax.set_xlabel("bytes per token")
        ax.set_ylabel(label)
        ax.set_yscale("symlog", linthresh=lin)
        ax.margins(x=0.12, y=0.12)
        _log(ax, "x")
        if d.get("dims"):
            _bits_axis(ax, d["dims"])
    for i, c in enumerate(contexts):
        a2.plot([], [], dashes[i % len(dashes)] + shapes[i % len(shapes)], color="0.3", label=f"{c} tokens")
    if contexts:
        _legend_right(a2, title="context")
    small = []
    for k, name in enumerate(names):
        ax = fig.add_subplot(gs[1 + k // cols, 2 * (k % cols):2 * (k % cols) + 2],
                             sharex=small[0] if small else None, sharey=small[0] if small else None)
        small.append(ax)
        for e in d["agreement"]:
            if (e["arm"].rpartition(" @ ")[0] or e["arm"]) == name:
                x = np.arange(len(e["values"])) * d["block"] + d["block"] / 2
                ax.plot(x, e["values"], dashes[context(e["arm"]) % len(dashes)] + shape(e["arm"]), color=color[name],
                        lw=1, ms=3)
        ax.set_title(name, color="black")
        ax.set_ylim(-0.05, 1.05)
        ax.set_yticks([0, 0.5, 1])
        if k % cols:
            ax.tick_params(labelleft=False)
        else:
            ax.set_ylabel("top-1 agr.")
        if k < len(names) - cols:
            ax.tick_params(labelbottom=False)
        else:
            ax.set_xlabel(f"step (blocks of {d['block']})")
    _title(fig, d)
    fig.canvas.draw()  # the layout, then labels placed in it, then no more layout
    fig.set_layout_engine("none")
    for ax in (a1, a2):
        if pts[ax]:
            _place_labels(ax, *zip(*pts[ax]))
    return fig


def _rule(arm: str) -> str:
    """The rule an equal-bytes arm stands for, one colour across budgets and with its oracle:
    ``mix28_oracle_diffuse`` -> ``diffuse``, ``int2_hh_oracle`` -> ``int2_hh``."""
    r = arm.replace("_oracle_", "_").removesuffix("_oracle")
    return r.split("_", 1)[1] if r.startswith("mix") else r


def _draw_equal_bytes(plt, d):
    """One panel per (context and) byte budget: the arms on the y axis, named there, sorted by Δ
    perplexity (best on top); the compared arm a solid line, the other uniform int2 / int3 / int4
    arms dashed lines, oracle arms hollow. The x axis is logarithmic when every Δ is positive (+0.3 % and +20 % both
    read), else symlog (linear within ±0.1 %)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator, SymmetricalLogLocator

    panels = d["budgets"]
    cols = min(len(panels), 2)
    rows = -(-len(panels) // cols)
    n_max = max(len(p["arms"]) for p in panels)
    fig, axes = plt.subplots(rows, cols, figsize=(_MAX_W, rows * (0.34 * n_max + 1.3) + 0.7), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    rules = list(dict.fromkeys(_rule(e["arm"]) for p in panels for e in p["arms"]))
    color = {r: f"C{i % 10}" for i, r in enumerate(rules)}
    styles = {"int2": (0, (5, 2)), "int3": (0, (4, 1, 1, 1)), "int4": (0, (2, 2))}
    values = [v for p in panels for v in [e["delta_pct"] for e in p["arms"] + p["uniform"]] + [p["versus"]["delta_pct"]]]
    lo, hi = min(values), max(values)
    span = math.log10(max(hi, 0.2) / (lo if lo > 0 else 0.1)) + 0.4  # decades in view (with the margins)
    subs = (1.0, 2.0, 5.0) if span < 2.2 else (1.0, 3.0) if span < 3.5 else (1.0,)  # labels that stay apart
    for ax, p in zip(axes.flat, panels):
        n = len(p["arms"])
        y = np.arange(n)[::-1]  # best (lowest Δ) on top
        ax.axvline(p["versus"]["delta_pct"], color="black", lw=1.4, zorder=1)
        for u in p["uniform"]:
            ax.axvline(u["delta_pct"], color="0.45", lw=1.1, ls=styles.get(u["arm"], ":"), zorder=1)
        for yi, e in zip(y, p["arms"]):
            c = color[_rule(e["arm"])]
            ax.plot([p["versus"]["delta_pct"], e["delta_pct"]], [yi, yi], "-", color=c, lw=1.0, alpha=0.6, zorder=2)
            ax.plot(e["delta_pct"], yi, "o", ms=7, mew=1.6, color=c, mfc="white" if e["oracle"] else c, zorder=3)
        ax.set_yticks(y, [e["arm"] for e in p["arms"]])
        ax.set_ylim(-0.7, n_max - 0.3)
        if lo > 0:  # every arm worse than the reference: a log axis, no room spent on 0
            ax.set_xscale("log")
            ax.set_xlim(lo / 1.6, hi * 1.6)
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
        else:
            ax.set_xscale("symlog", linthresh=0.1, linscale=0.5)
            ax.set_xlim(min(lo * 1.6, -0.05), max(hi * 1.6, 0.2))
            ax.xaxis.set_major_locator(SymmetricalLogLocator(base=10, linthresh=0.1, subs=subs))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:+g}" if v else "0"))
        ax.grid(axis="x", color="0.9", lw=0.6, zorder=0)
        ax.set_xlabel(f"Δ perplexity vs DynamicCache (%, {'log' if lo > 0 else 'symlog'} scale)")
        where = f" @ {p['context']} tokens" if p["context"] else ""
        star = "_*" if p["budget"].startswith("mix") else "*"
        ax.set_title(f"{p['budget']}{star}{where}: {p['versus']['bytes_per_token']:,.0f} B/token, vs {p['versus']['arm']}")
    compared = " / ".join(dict.fromkeys(p["versus"]["arm"] for p in panels))
    handles = [Line2D([], [], color="black", lw=1.4, label=f"compared arm ({compared})")]
    for u in dict.fromkeys(u["arm"] for p in panels for u in p["uniform"]):
        handles.append(Line2D([], [], color="0.45", lw=1.1, ls=styles.get(u, ":"), label=f"uniform {u}"))
    handles += [Line2D([], [], ls="", marker="o", ms=7, color="0.3", label="online rule"),
                Line2D([], [], ls="", marker="o", ms=7, mew=1.6, color="0.3", mfc="white",
                       label="oracle (impossible online)")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    _title(fig, d)
    fig.tight_layout(rect=(0, 0.06 / rows, 1, 1))
    fig.set_layout_engine("none")
    return fig


def _draw_frontier(plt, d):
    """One panel per context: Δ perplexity against bytes per token, one line per family."""
    n = len(d["contexts"])
    fig, axes = plt.subplots(1, n, figsize=(_MAX_W, 4.6), squeeze=False)
    names = list(dict.fromkeys(f["family"] for c in d["contexts"] for f in c["families"]))
    cmap = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    shapes = "osD^v<>ph*"
    for ax, c in zip(axes[0], d["contexts"]):
        for f in c["families"]:
            i = names.index(f["family"])
            ax.plot([p["bytes_per_token"] for p in f["points"]], [p["delta_pct"] for p in f["points"]],
                    "-" + shapes[i % len(shapes)], color=cmap(i % cmap.N), lw=1.2, ms=5, label=f["family"])
        ax.set_xlabel("bytes per token")
        ax.set_ylabel("perplexity change vs reference (%)")
        ax.set_yscale("symlog", linthresh=0.1)
        _log(ax, "x")
        if c["context"]:
            ax.set_title(f"{c['context']} tokens")
    _legend_right(axes[0][-1], title="family")
    return fig


def _draw_retrieval(plt, d):
    n = len(d["maps"])
    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(min(2.8 * cols, _MAX_W), 2.5 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, m in zip(axes.flat, d["maps"]):
        acc = np.asarray([[np.nan if v is None else v for v in row] for row in m["accuracy"]], dtype=float)
        ax.imshow(acc, aspect="auto", cmap="viridis", vmin=0, vmax=1)
        for (i, j), v in np.ndenumerate(acc):  # the accuracy written in its cell: no colour scale to read
            if np.isfinite(v):
                ax.text(j, i, f"{v:.2g}", ha="center", va="center", color="black" if v > 0.5 else "white")
        ax.set_title(f"{m['task']}: {m['arm']}")
        ax.set_xticks(range(len(m["lengths"])), [str(x) for x in m["lengths"]])
        ax.set_yticks(range(len(m["depths"])), [f"{x:g}" for x in m["depths"]])
        ax.set_xlabel("prefill tokens")
        ax.set_ylabel("needle depth")
    return fig


_DRAW = {"frontier": _draw_frontier,
         "heatmap": _draw_heatmap, "support_ecdf": _draw_support, "region_mass": _draw_regions, "mx_paths": _draw_mx,
         "ablation_pairs": _draw_ablation, "residual_window": _draw_residual, "live_quality": _draw_live,
         "equal_bytes": _draw_equal_bytes, "retrieval_heatmap": _draw_retrieval}


def _title(fig, d):
    fig.suptitle(f"{d['study']}: {d['kind'].replace('_', ' ')}")


def draw_figure(plt, d):
    fig = _DRAW[d["kind"]](plt, d)
    _title(fig, d)
    return fig


def figure_layout(d) -> dict:
    """Draw figure ``d`` as the report does and say where its text and panels lie, in pixels of the
    PNG (drawing is deterministic): ``{"size": (w, h), "dpi", "texts": [{"text", "role", "size_pt",
    "bbox": (x0, y0, x1, y1)}], "legends": [bbox], "axes": [bbox of each visible panel], "log_axes":
    [(panel, "x" or "y", labelled ticks in view)], "all_zero_axes": [panel whose lines are all 0]}``.
    A text's role is ``"label"`` (a point's label), ``"legend"``, ``"tick"`` or ``"text"``; only
    texts actually drawn are listed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.legend import Legend
    from matplotlib.text import Text

    def box(b):
        return (float(b.x0), float(b.y0), float(b.x1), float(b.y1))

    with matplotlib.rc_context(RC):
        fig = draw_figure(plt, d)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        seen = []
        draw = Text.draw

        def spy(self, *args, **kwargs):  # every text the figure draws (a Text skips itself when hidden)
            if self.get_visible() and self not in seen:
                seen.append(self)
            return draw(self, *args, **kwargs)

        Text.draw = spy
        try:
            fig.draw(renderer)
        finally:
            Text.draw = draw
        legends = fig.findobj(Legend)
        in_legend = {id(t) for lg in legends for t in lg.findobj(Text)}
        ticks = {id(t): (i, name) for i, ax in enumerate(fig.axes) for name in "xy"
                 for t in getattr(ax, f"{name}axis").get_ticklabels()}
        texts, labelled = [], defaultdict(int)
        for t in seen:
            if not t.get_text().strip():
                continue
            role = ("label" if t.get_gid() == "data-label" else "legend" if id(t) in in_legend
                    else "tick" if id(t) in ticks else "text")
            if role == "tick":
                labelled[ticks[id(t)]] += 1
            texts.append({"text": t.get_text(), "role": role, "size_pt": float(t.get_fontsize()),
                          "bbox": box(Text.get_window_extent(t, renderer))})
        panels = [ax for ax in fig.axes if ax.axison]
        out = {"size": (int(round(fig.get_figwidth() * fig.dpi)), int(round(fig.get_figheight() * fig.dpi))),
               "dpi": float(fig.dpi), "texts": texts,
               "legends": [box(lg.get_window_extent(renderer)) for lg in legends if lg.get_visible()],
               "axes": [box(ax.get_window_extent(renderer)) for ax in panels],
               "log_axes": [(i, name, labelled[(i, name)]) for i, ax in enumerate(fig.axes) if ax.axison
                            for name in "xy" if getattr(ax, f"get_{name}scale")() == "log"],
               "all_zero_axes": [i for i, ax in enumerate(fig.axes) if ax.axison and ax.lines
                                 and all(np.all(np.asarray(ln.get_ydata(), dtype=float) == 0) for ln in ax.lines)]}
        plt.close(fig)
    return out
