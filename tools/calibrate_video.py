"""Fit the synthetic video generator to the seed study's attention statistics: protocols/ablation_calibrated.json.

The hand-set video preset of protocols/ablation.json puts more mass on the sink and less on the
recent frames than the seed study (the video KV-cache attention study of a chunked video diffusion model,
docs/studies.md) measured, and its rows are far more diffuse. This tool fits, per query head ``h``
of a 16-head / 4-KV-head video layout (frames of 4 tokens, keys [sink 4 | recent 6 | current 6]
frames, D = 32), the three knobs of testbed/sources/video.py that set a head's logits
``kappa_h * cos + sink_h [sink key] + current_h [current key]``: the concentration ``kappa_h``,
``sink_logits[h]`` and ``current_logits[h]``. Everything else is the hand-set preset's (rho 0.8,
noise 0.5, query noise 0.3, chunk 3).

Targets (``TARGETS``): the mean sink / recent / current mass over the 42 records of the study's
record-level table (``RECORDS``, transcribed below; each record is 3,072 query-head rows), and the
study's row-level effective-support distribution over its 129,024 rows: the share of rows with
support ``exp(H)/Sk`` <= 10 %, <= 25 %, >= 75 % and the median (the record table holds only each
record's median support, from which the row distribution cannot be rebuilt, so these four are the
study's own pooled figures).

How: the cosines ``cos`` of every query head against every key are generated once per fit seed
(they do not depend on the fitted knobs), and Adam minimises the squared error, in percentage
points, of the mean sink and current mass and of the support ECDF at 6.76 / 10 / 25 / 75 %
(the median and the three shares), the ECDF smoothed by a logistic of width ``TAU`` in log
support. The smoothed share differs from the counted one, so ``ROUNDS`` times the smoothed targets
are shifted by ``DAMPING`` times the counted error and the fit continues from where it stopped;
the round with the smallest counted squared error on the fit seeds is kept. The fitted knobs are
rounded to 4 decimals, then every figure of the table is measured on cases the generator makes
from them (testbed.metrics.observe: the float64 reference attention), on the fit seeds and on
held-out seeds the fit never saw. Deterministic (one torch thread, fixed seeds and steps); 70-85 s
on 2 cores.

    python tools/calibrate_video.py           # fit, print the table and the protocol
    python tools/calibrate_video.py --write   # ... and write protocols/ablation_calibrated.json

docs/calibration.md has the table and what the calibration does not show.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.metrics import observe  # noqa: E402  (the repository root goes on the path first)
from testbed.sources.video import make_video_case, validate  # noqa: E402

# The seed study's record-level table: record, layer, chunk, NFE position, median support %,
# sink %, recent %, current % (each record: 32 heads x 96 sampled queries of one layer / chunk / NFE).
RECORDS = [
    ("layer00_chunk04_position0", 0, 4, 0, 77.66, 16.46, 25.04, 58.50),
    ("layer00_chunk04_position3", 0, 4, 3, 87.81, 19.33, 29.96, 50.71),
    ("layer00_chunk07_position0", 0, 7, 0, 77.91, 17.66, 25.08, 57.26),
    ("layer00_chunk07_position3", 0, 7, 3, 88.03, 20.64, 29.94, 49.41),
    ("layer00_chunk10_position0", 0, 10, 0, 77.64, 16.38, 25.53, 58.09),
    ("layer00_chunk10_position3", 0, 10, 3, 88.73, 19.78, 30.39, 49.82),
    ("layer07_chunk04_position0", 7, 4, 0, 53.04, 21.71, 35.91, 42.38),
    ("layer07_chunk04_position3", 7, 4, 3, 39.12, 17.47, 29.77, 52.77),
    ("layer07_chunk07_position0", 7, 7, 0, 52.23, 22.35, 34.36, 43.29),
    ("layer07_chunk07_position3", 7, 7, 3, 42.88, 18.59, 30.04, 51.38),
    ("layer07_chunk10_position0", 7, 10, 0, 53.22, 23.05, 35.29, 41.65),
    ("layer07_chunk10_position3", 7, 10, 3, 43.02, 18.78, 29.61, 51.60),
    ("layer15_chunk04_position0", 15, 4, 0, 40.79, 18.33, 34.21, 47.46),
    ("layer15_chunk04_position3", 15, 4, 3, 31.45, 14.98, 26.13, 58.90),
    ("layer15_chunk07_position0", 15, 7, 0, 41.80, 19.04, 32.81, 48.14),
    ("layer15_chunk07_position3", 15, 7, 3, 31.67, 15.55, 25.27, 59.17),
    ("layer15_chunk10_position0", 15, 10, 0, 44.46, 19.57, 33.26, 47.17),
    ("layer15_chunk10_position3", 15, 10, 3, 34.58, 15.37, 26.26, 58.37),
    ("layer23_chunk04_position0", 23, 4, 0, 5.34, 11.75, 27.82, 60.43),
    ("layer23_chunk04_position3", 23, 4, 3, 3.03, 8.46, 24.13, 67.40),
    ("layer23_chunk07_position0", 23, 7, 0, 6.19, 14.72, 24.37, 60.91),
    ("layer23_chunk07_position3", 23, 7, 3, 3.36, 9.97, 21.09, 68.94),
    ("layer23_chunk10_position0", 23, 10, 0, 5.80, 13.32, 24.73, 61.94),
    ("layer23_chunk10_position3", 23, 10, 3, 3.29, 8.84, 21.04, 70.12),
    ("layer31_chunk04_position0", 31, 4, 0, 1.63, 13.90, 25.40, 60.70),
    ("layer31_chunk04_position3", 31, 4, 3, 1.00, 11.63, 26.94, 61.44),
    ("layer31_chunk07_position0", 31, 7, 0, 1.80, 14.84, 21.81, 63.35),
    ("layer31_chunk07_position3", 31, 7, 3, 0.98, 10.77, 24.15, 65.08),
    ("layer31_chunk10_position0", 31, 10, 0, 1.69, 12.57, 22.58, 64.85),
    ("layer31_chunk10_position3", 31, 10, 3, 0.98, 10.56, 26.53, 62.90),
    ("layer39_chunk04_position0", 39, 4, 0, 1.66, 14.10, 21.39, 64.51),
    ("layer39_chunk04_position3", 39, 4, 3, 0.66, 10.10, 16.63, 73.26),
    ("layer39_chunk07_position0", 39, 7, 0, 1.87, 16.35, 20.96, 62.69),
    ("layer39_chunk07_position3", 39, 7, 3, 0.69, 11.59, 17.38, 71.02),
    ("layer39_chunk10_position0", 39, 10, 0, 2.05, 15.85, 19.72, 64.44),
    ("layer39_chunk10_position3", 39, 10, 3, 0.72, 11.08, 16.55, 72.37),
    ("layer47_chunk04_position0", 47, 4, 0, 0.63, 6.01, 25.04, 68.95),
    ("layer47_chunk04_position3", 47, 4, 3, 0.44, 3.47, 21.01, 75.52),
    ("layer47_chunk07_position0", 47, 7, 0, 0.73, 7.61, 27.37, 65.02),
    ("layer47_chunk07_position3", 47, 7, 3, 0.46, 4.53, 25.11, 70.36),
    ("layer47_chunk10_position0", 47, 10, 0, 0.89, 6.01, 27.72, 66.27),
    ("layer47_chunk10_position3", 47, 10, 3, 0.50, 3.97, 24.88, 71.15),
]
# The study's row-level effective-support figures, pooled over its 129,024 rows (percent).
ROW_SUPPORT = {"support<=10%": 53.85, "support<=25%": 65.23, "support>=75%": 17.84, "median support": 6.76}
REGIONS = ("sink", "recent", "current")
TARGETS = {**{f"{r} mass": round(sum(rec[5 + i] for rec in RECORDS) / len(RECORDS), 2) for i, r in enumerate(REGIONS)},
           **ROW_SUPPORT}
QUANTITIES = list(TARGETS)
# Figures of the study the fit does not target, shown beside the fitted ones as a check of what the
# marginals leave free (the study's row-level figures, percent).
UNFITTED = {"history<10% (rows)": 20.54, "history>50% (rows)": 43.23, "top10%>=80% (rows)": 55.24, "median top10% mass": 86.43}

# The generator: the hand-set preset's video layout with 16 query heads on 4 KV heads.
HEADS, KV_HEADS, HEAD_DIM = 16, 4, 32
GENERATOR = {"chunks": [3], "tokens_per_frame": 4, "sink_frames": 4, "recent_frames": 6, "current_frames": 6,
             "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "rho": 0.8, "noise": 0.5, "query_noise": 0.3}
FIT_SEEDS = list(range(1001, 1017))
HELD_OUT_SEEDS = list(range(2001, 2033))
PROTOCOL_SEEDS = list(range(1, 17))
TAU, STEPS, ROUNDS, DAMPING, LR = 0.05, 600, 10, 0.5, 0.03
HAND_SET = REPO / "protocols" / "ablation.json"
OUT = REPO / "protocols" / "ablation_calibrated.json"


def _case(seed: int, concentrations, sink_logits, current_logits):
    g = GENERATOR
    return make_video_case(seed, g["chunks"][0], tokens_per_frame=g["tokens_per_frame"], sink_frames=g["sink_frames"],
                           recent_frames=g["recent_frames"], current_frames=g["current_frames"], heads=g["heads"],
                           kv_heads=g["kv_heads"], head_dim=g["head_dim"], concentrations=concentrations, rho=g["rho"],
                           noise=g["noise"], query_noise=g["query_noise"], sink_logits=sink_logits,
                           current_logits=current_logits)


def cosines(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cos [H, Tq, Tk]`` (float64) of a case with unit concentration and zero bonuses, and the
    sink and current key indicators ``[Tk]``."""
    case = _case(seed, [1.0] * HEADS, [0.0] * HEADS, [0.0] * HEADS)
    k = case.k.double().repeat_interleave(HEADS // KV_HEADS, dim=0)
    cos = case.q.double() @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    ind = {r.name: torch.zeros(case.keys, dtype=torch.float64) for r in case.layout}
    for r in case.layout:
        ind[r.name][r.start:r.stop] = 1.0
    return cos, ind["sink"], ind["current"]


def _smooth_stats(cos, sink, cur, log_kappa, s, c):
    logits = log_kappa.exp().view(1, -1, 1, 1) * cos + s.clamp(min=0).view(1, -1, 1, 1) * sink + c.view(1, -1, 1, 1) * cur
    p = logits.softmax(dim=-1)
    support = torch.exp(-(p * p.clamp(min=1e-300).log()).sum(dim=-1)) / cos.shape[-1]
    return 100 * (p * sink).sum(-1).mean(), 100 * (p * cur).sum(-1).mean(), support


ECDF_POINTS = [(TARGETS["median support"] / 100, 50.0), (0.10, TARGETS["support<=10%"]),
               (0.25, TARGETS["support<=25%"]), (0.75, 100.0 - TARGETS["support>=75%"])]


def fit(log: bool = True) -> dict:
    """The fitted per-head knobs (rounded to 4 decimals)."""
    torch.set_num_threads(1)
    data = [cosines(seed) for seed in FIT_SEEDS]
    cos = torch.stack([d[0] for d in data])
    sink, cur = data[0][1], data[0][2]
    log_kappa = torch.linspace(math.log(20.0), math.log(0.3), HEADS, dtype=torch.float64).requires_grad_()
    s = torch.ones(HEADS, dtype=torch.float64, requires_grad=True)
    c = torch.zeros(HEADS, dtype=torch.float64, requires_grad=True)
    goal = [t for _, t in ECDF_POINTS]  # the smoothed ECDF's targets, shifted each round by the counted error
    opt = torch.optim.Adam([log_kappa, s, c], lr=LR)
    best = (math.inf, None)
    for rnd in range(ROUNDS):
        for _ in range(STEPS):
            opt.zero_grad()
            ms, mc, support = _smooth_stats(cos, sink, cur, log_kappa, s, c)
            ecdf = [100 * torch.sigmoid((math.log(x) - support.log()) / TAU).mean() for x, _ in ECDF_POINTS]
            loss = (ms - TARGETS["sink mass"]) ** 2 + (mc - TARGETS["current mass"]) ** 2
            loss = loss + sum((e - g) ** 2 for e, g in zip(ecdf, goal)) + 1e-3 * ((s ** 2).sum() + (c ** 2).sum())
            loss.backward()
            opt.step()
        with torch.no_grad():
            ms, mc, support = _smooth_stats(cos, sink, cur, log_kappa, s, c)
            counted = [100 * float((support <= x).double().mean()) for x, _ in ECDF_POINTS]
            err = (float(ms) - TARGETS["sink mass"]) ** 2 + (float(mc) - TARGETS["current mass"]) ** 2 + \
                sum((n - t) ** 2 for n, (_, t) in zip(counted, ECDF_POINTS))
            if err < best[0]:
                best = (err, [x.detach().clone() for x in (log_kappa, s, c)])
        goal = [g + DAMPING * (t - n) for g, (_, t), n in zip(goal, ECDF_POINTS, counted)]
        if log:
            print(f"[calibrate] round {rnd + 1}/{ROUNDS}: sink {float(ms):.2f} current {float(mc):.2f} "
                  f"ECDF at {' / '.join(f'{x:g}' for x, _ in ECDF_POINTS)}: {' / '.join(f'{n:.2f}' for n in counted)} "
                  f"(squared error {err:.2f})", file=sys.stderr)
    log_kappa, s, c = best[1]
    kappa = [round(float(x), 4) for x in log_kappa.exp()]
    assert len(set(kappa)) == HEADS, kappa  # a protocol list may not repeat an item
    return {"concentrations": kappa, "sink_logits": [round(max(0.0, float(x)), 4) for x in s],
            "current_logits": [round(float(x), 4) for x in c]}


def measure(cases) -> dict:
    """The table's quantities (percent) pooled over every row of ``cases``."""
    rows = [observe(case).rows for case in cases]
    support = torch.cat([r["support"].flatten() for r in rows])
    out = {f"{name} mass": 100 * float(torch.cat([r[f"{name}_mass"].flatten() for r in rows]).mean()) for name in REGIONS}
    out["support<=10%"] = 100 * float((support <= 0.10).double().mean())
    out["support<=25%"] = 100 * float((support <= 0.25).double().mean())
    out["support>=75%"] = 100 * float((support >= 0.75).double().mean())
    out["median support"] = 100 * float(support.quantile(0.5))
    history = torch.cat([r["history_mass"].flatten() for r in rows])
    top10 = torch.cat([r["top10"].flatten() for r in rows])
    out["history<10% (rows)"] = 100 * float((history < 0.10).double().mean())
    out["history>50% (rows)"] = 100 * float((history > 0.50).double().mean())
    out["top10%>=80% (rows)"] = 100 * float((top10 >= 0.80).double().mean())
    out["median top10% mass"] = 100 * float(top10.quantile(0.5))
    return out


def hand_set_cases():
    """The video cases of protocols/ablation.json as it stands (its own seeds)."""
    from testbed.sources.video import cases

    src = validate({**json.loads(HAND_SET.read_text())["source"], "layouts": ["video"]}, "ablation.json.source")
    return list(cases(src)), src["seeds"]


def protocol(knobs: dict) -> dict:
    """protocols/ablation.json's video part with the calibrated generator."""
    base = json.loads(HAND_SET.read_text())
    src = {"kind": "synthetic_video", "seeds": PROTOCOL_SEEDS, "layouts": ["video"], **GENERATOR, **knobs}
    validate(json.loads(json.dumps(src)), "ablation_calibrated.json.source")
    analyses = json.loads(json.dumps(base["analyses"]))
    analyses["ablation"]["ablations"] = [a for a in analyses["ablation"]["ablations"] if "middle" not in a]
    return {
        "name": "ablation_calibrated",
        "description": (
            "What is the cache worth, on attention calibrated to the seed study? The video-like layout of the ablation "
            "protocol (frames of 4 tokens; keys [sink 4 | recent 6 | current 6] frames; the current chunk's queries see "
            "every key), with 16 query / 4 KV heads, D=32, whose per-head concentration, sink logit and current-chunk "
            "logit are fitted by tools/calibrate_video.py so that the region masses (sink / recent / current) match the "
            "mean of the seed study's record-level table and the effective-support distribution (rows with support "
            "<=10 %, <=25 %, >=75 %, median) matches the study's row-level figures; docs/calibration.md has the fit "
            "error per quantity on held-out seeds. The hand-set preset of protocols/ablation.json stays as it is. "
            "Observation and intervention as in the ablation protocol (drop the sink, the recent window, all history, "
            "same-size and mass-matched controls, on the float32 cache and its history quantized: 4-bit grouped with "
            "and without the recent region in float32, MXFP8 E4M3). 16 seeds (none of them a fit seed), the units of its "
            "paired tests. Not in the default run: evidence/ has no room left under its 20 MB for its arrays."),
        "default": False,
        "source": src,
        "analyses": analyses,
        "timing": base["timing"],
        "audit": base["audit"],
    }


def table(rows: dict[str, dict]) -> str:
    heads = list(rows)
    out = ["| quantity | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for q in [*QUANTITIES, *UNFITTED]:
        if q == next(iter(UNFITTED)):
            out.append("| *not fitted:* |" + " |" * len(heads))
        out.append(f"| {q} | " + " | ".join(f"{rows[h][q]:+.2f}" if h.endswith("(points)") else f"{rows[h][q]:.2f} %"
                                              for h in heads) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(REPO)}")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    knobs = fit()
    t_fit = time.perf_counter() - t0
    hand, hand_seeds = hand_set_cases()
    rows = {"target (seed study)": {**TARGETS, **UNFITTED},
            f"hand-set (ablation.json, seeds {hand_seeds[0]}-{hand_seeds[-1]})": measure(hand),
            f"calibrated, fit seeds ({len(FIT_SEEDS)})": measure(_case(s, **knobs) for s in FIT_SEEDS),
            f"calibrated, held-out seeds ({len(HELD_OUT_SEEDS)})": measure(_case(s, **knobs) for s in HELD_OUT_SEEDS),
            f"calibrated, protocol seeds {PROTOCOL_SEEDS}": measure(_case(s, **knobs) for s in PROTOCOL_SEEDS)}
    held = rows[f"calibrated, held-out seeds ({len(HELD_OUT_SEEDS)})"]
    rows["held-out error (points)"] = {q: held[q] - t for q, t in {**TARGETS, **UNFITTED}.items()}
    print(table(rows))
    print(f"\nfit {t_fit:.1f} s, total {time.perf_counter() - t0:.1f} s; knobs: {json.dumps(knobs)}")
    proto = protocol(knobs)
    text = json.dumps(proto, indent=1) + "\n"
    if args.write:
        OUT.write_text(text, encoding="utf-8")
        print(f"wrote {OUT.relative_to(REPO)}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
