"""The sampled replay (``python -m testbed.replay``, docs/replay.md): a finished tiny run of a live
and a retrieval study replays bit-identically on the machine that made it; a consistently forged
log-probability, answer token or pair of swapped arms fails on a line naming the unit; bad input
exits 2 with one line.

Marked ``capture``: needs the capture extra and the SmolLM2 GGUF; skipped with that reason otherwise.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from testbed.replay import default_sample, escape_chance, main, plan_units, sample
from testbed.sources import models
from tests import _arrays
from tests._helpers import forge_array, forge_results, synthetic_run

pytestmark = [pytest.mark.capture, pytest.mark.slow]

LIVE, RETR = "live_rp", "retr_rp"


def _protocols(tmp: Path) -> list[Path]:
    repo = Path(__file__).resolve().parent.parent / "protocols"
    live = json.loads((repo / "smollm2_quality.json").read_text())
    live.update(name=LIVE, default=False)
    live["live"].update({"segments": 2, "prefill": 32, "steps": 40, "batch": 2, "window": 16, "group": 16,
                         "evict_window": 16, "policies": ["int4", "streaming"], "peers": []})
    ret = json.loads((repo / "retrieval_small.json").read_text())
    ret.update(name=RETR, default=False)
    ret["retrieval"].update({"tasks": ["passkey"], "lengths": [128], "depths": [0.0, 1.0], "trials": 1, "batch": 2,
                             "window": 16, "group": 16, "evict_window": 16, "policies": ["int4", "streaming"]})
    paths = []
    for proto in (live, ret):
        paths.append(tmp / f"{proto['name']}.json")
        paths[-1].write_text(json.dumps(proto))
    return paths


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run of a tiny live study (2 segments x 3 arms) and a tiny retrieval study (2 trials x 3
    arms): 12 units, one batch each."""
    from testbed.run import main as run_main

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}; install with: {models.INSTALL_HINT}")
    tmp = tmp_path_factory.mktemp("replay")
    args = ["--quiet", "--out", str(tmp / "run")]
    for p in _protocols(tmp):
        args += ["--protocol", str(p)]
    assert run_main(args) == 0
    return tmp / "run"


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "copy"))


def _res(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())


def _row(res: dict, study: str, case: str, arm: str) -> dict:
    return next(r for r in res["rows"] if (r["study"], r["case"], r["arm"]) == (study, case, arm))


def _replay(capsys, *args) -> tuple[int, list[str], list[str]]:
    code = main(["--quiet", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def _seed_picking(run: Path, n: int, study: str, case: str, arm: str) -> int:
    """A seed whose draw of ``n`` units includes (study, case, arm)."""
    units = plan_units(run)[3]
    for seed in range(1000):
        if any((u.study, u.case, u.arm) == (study, case, arm) for u in sample(units, n, seed)):
            return seed
    raise AssertionError("no seed picks the unit")


def test_untouched_run_replays_bit_identically(run, capsys):
    code, out, err = _replay(capsys, run, "--sample", 100)
    assert code == 0, out
    assert err == []
    assert out[0].startswith(f"replay of {run}: 12 of 12 units checked (100.0 %)")
    assert "tolerance same" in out[1] and "expected bit-identical" in out[1]  # made here, by this code
    assert "1 - 12/12 = 0.0 %" in out[2]
    assert out[3].startswith("units (study case arm): ") and out[3].count("; ") == 11  # the sample, on one line
    assert out[-1].startswith("PASS: 12 of 12 units replayed within the same tolerance, 12 bit-identical")
    assert not any(line.startswith("FAIL") for line in out)


def test_sample_share_and_escape_chance_are_printed(run, capsys):
    code, out, _ = _replay(capsys, run, "--sample", 3, "--seed", 5)
    assert code == 0, out
    assert out[0].startswith(f"replay of {run}: 3 of 12 units checked (25.0 %)")
    assert "1 - 3/12 = 75.0 %" in out[2]
    # k = 2 forged units both escape: C(10, 3) / C(12, 3) = 120 / 220
    assert "k=2 54.5 %" in out[2]


def test_default_sample_leaves_one_forged_unit_at_most_5_percent(reliability):
    """Issue #48: the default sample is the fewest units that catch one forged unit with >= 95 %
    probability, for every run size (the old default of 8 let one escape 94.7 % of the time among
    the default run's 150 units): at most 5 % with it, more than 5 % with one unit fewer."""
    for total in range(1, 1001):
        n = default_sample(total)
        assert 1 <= n <= total
        assert escape_chance(total, n) <= 0.05
        assert n == 1 or escape_chance(total, n - 1) > 0.05
    reliability("replay", "default sample on the default run's 150 units", "one forged unit escapes <= 5 %",
                f"{default_sample(150)} of 150 sampled: {100 * escape_chance(150, default_sample(150)):.2f} %")
    assert escape_chance(150, 8) > 0.9  # what the old default left


def test_the_default_and_all_print_their_escape_chance(run, capsys):
    """Without --sample the replay draws the default (12 units: 12 - floor(12/20) = 12, all) and says
    so; --all with --sample is refused."""
    code, out, _ = _replay(capsys, run)
    assert code == 0, out
    assert out[0].startswith(f"replay of {run}: 12 of 12 units checked (100.0 %) (the default: the fewest that "
                             "leave one forged unit at most 5 % to escape)")
    assert "1 - 12/12 = 0.0 %" in out[2]
    with pytest.raises(SystemExit) as e:
        main(["--quiet", str(run), "--all", "--sample", "3"])
    assert e.value.code == 2


def test_escape_chance_counts_draws():
    """Against an enumeration of every draw: the share of N-subsets of T units that hold none of k
    forged ones."""
    for total, n, k in ((7, 3, 1), (7, 3, 2), (6, 5, 1), (6, 2, 4), (5, 5, 1)):
        draws = list(itertools.combinations(range(total), n))
        missed = sum(1 for d in draws if not set(d) & set(range(k)))
        assert escape_chance(total, n, k) == pytest.approx(missed / len(draws))


@pytest.mark.parametrize("where", ["live", "retrieval"])
def test_forged_logprob_fails_when_sampled(run, tmp_path, capsys, where):
    """One per-token log-prob of int4 moved by 0.5 nats, its array re-hashed, the row's summary
    numbers re-derived and every file rewritten and re-hashed: replayed, the unit fails on a line
    naming study, case, arm, chunk and the token."""
    forged = _copy(run, tmp_path)
    res = _res(forged)
    study, case = (LIVE, "seg001") if where == "live" else (RETR, "t0001")
    row = _row(res, study, case, "int4")
    i = 3 if where == "live" else 1
    forge_array(forged, row["arrays"]["logprob"], lambda x: x.__setitem__(i, x[i] - np.float32(0.5)))
    _resummarize(forged, row)
    forge_results(forged, res)
    n = 2
    code, out, _ = _replay(capsys, forged, "--sample", n, "--seed", _seed_picking(forged, n, study, case, "int4"))
    assert code == 1, out
    fails = [line for line in out if line.startswith(f"FAIL: {study} case {case} arm int4 chunk ")]
    assert len(fails) == 1, out
    assert f"logprob[{i}]" in fails[0] and "|Δ| 0.5" in fails[0], fails[0]
    assert out[-1].startswith(f"FAIL: 1 of {n} replayed units differ")


def _resummarize(run: Path, row: dict) -> None:
    """The row's numbers that follow from its log-probs, re-derived as a consistent forger would."""
    lp = _arrays.load(run, row["arrays"]["logprob"]).astype(np.float64)
    if row["analysis"] == "live_quality":
        row["nll"] = -float(lp.mean())
        row["perplexity"] = float(np.exp(row["nll"]))
    else:
        row["answer_logprob"] = float(lp.sum())


def test_logprobs_raised_toward_the_reference_fail(run, tmp_path, capsys):
    """The audit's known gap (tests/test_live.py, test_gap_consistently_rewritten_logprobs): int4's
    log-probs raised to the reference's wherever their argmaxes agree keep every bound that needs
    no model; the replay tells them from the model's."""
    forged = _copy(run, tmp_path)
    res = _res(forged)
    row, ref = _row(res, LIVE, "seg000", "int4"), _row(res, LIVE, "seg000", "dynamic_cache")
    ref_lp = _arrays.load(forged, ref["arrays"]["logprob"])
    same = _arrays.load(forged, row["arrays"]["argmax"]) == _arrays.load(forged, ref["arrays"]["argmax"])
    before = _arrays.load(forged, row["arrays"]["logprob"])
    assert (np.maximum(before, ref_lp) - before)[same].max() > 1e-3, "int4 is the reference here: nothing to raise"
    forge_array(forged, row["arrays"]["logprob"], lambda x: np.copyto(x, np.maximum(x, ref_lp), where=same))
    _resummarize(forged, row)
    forge_results(forged, res)
    code, out, _ = _replay(capsys, forged, "--sample", 100)
    assert code == 1, out
    fails = [line for line in out if line.startswith("FAIL: ") and " replayed units differ" not in line]
    assert len(fails) == 1 and fails[0].startswith(f"FAIL: {LIVE} case seg000 arm int4 chunk "), out
    assert "logprob[" in fails[0]


def test_forged_generated_token_fails(run, tmp_path, capsys):
    """A greedy answer token of the streaming arm replaced (the row's counts re-derived): the
    replay's generated tokens differ."""
    forged = _copy(run, tmp_path)
    res = _res(forged)
    row = _row(res, RETR, "t0000", "streaming")
    gen = _arrays.load(forged, row["arrays"]["generated"])
    answer = _arrays.load(forged, res["cases"][RETR]["t0000"]["arrays"]["token_ids"])[-len(gen):]
    new = answer.copy()  # the forger claims the evicting arm generated the right answer
    assert not np.array_equal(new, gen), "streaming already generates the answer: nothing to forge"
    rel = f"arrays/{RETR}/t0000/streaming.generated.npy"
    if rel == row["arrays"]["generated"]:
        forge_array(forged, rel, lambda x: x.__setitem__(slice(None), new))
    else:  # stored once with an equal array (the store is content-addressed): the forger gives it its own member
        assert rel not in json.loads((forged / "manifest.json").read_text())["arrays"]
        _arrays.save(forged, rel, new)
        m = json.loads((forged / "manifest.json").read_text())
        m["arrays"][rel] = {"sha256": _arrays.sha(forged, rel), "nbytes": int(new.nbytes), "dtype": new.dtype.str,
                            "shape": list(new.shape)}
        (forged / "manifest.json").write_text(json.dumps(m, indent=1))
        row["arrays"]["generated"] = rel
    row["greedy_tokens_correct"], row["greedy_em"] = len(new), 1
    forge_results(forged, res)
    code, out, _ = _replay(capsys, forged, "--sample", 100)
    assert code == 1, out
    fails = [line for line in out if line.startswith("FAIL: ") and " replayed units differ" not in line]
    assert len(fails) == 1 and fails[0].startswith(f"FAIL: {RETR} case t0000 arm streaming greedy step "), out
    assert "generated[" in fails[0]


def test_swapped_arms_fail(run, tmp_path, capsys):
    """The int4 and streaming rows of one segment trade their outputs (log-probs, argmaxes, KL and
    the numbers that follow from them; each row stays self-consistent, results rewritten and
    re-hashed), the audit's known gap (tests/test_live.py, test_gap_swapped_outputs_of_two_quantized_arms):
    both units fail, on their log-probs."""
    forged = _copy(run, tmp_path)
    res = _res(forged)
    a, b = _row(res, LIVE, "seg000", "int4"), _row(res, LIVE, "seg000", "streaming")
    assert not np.array_equal(_arrays.load(forged, a["arrays"]["logprob"]), _arrays.load(forged, b["arrays"]["logprob"]))
    for k in ("nll", "perplexity", "mean_kl", "top1_agreement"):
        a[k], b[k] = b[k], a[k]
    for k in ("logprob", "argmax", "kl"):
        a["arrays"][k], b["arrays"][k] = b["arrays"][k], a["arrays"][k]
    forge_results(forged, res)
    code, out, _ = _replay(capsys, forged, "--sample", 100)
    assert code == 1, out
    for arm in ("int4", "streaming"):
        line = next((x for x in out if x.startswith(f"FAIL: {LIVE} case seg000 arm {arm} chunk ")), None)
        assert line is not None and "logprob[" in line, out
    assert out[-1].startswith("FAIL: 2 of 12 replayed units differ")


def test_bad_input_exits_2_with_one_line(run, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "synthetic").mkdir()
    attention = synthetic_run(tmp_path / "synthetic", "guard")  # a run with no live or retrieval study
    capsys.readouterr()  # the run's own "wrote" line
    for args, says in (([tmp_path / "missing"], "is not a folder"),
                       ([tmp_path / "empty"], "not a run folder"),
                       ([attention], "no rows of a live or retrieval study"),
                       ([run, "--sample", 0], "sample at least one unit")):
        code, out, err = _replay(capsys, *args)
        assert code == 2, (args, out, err)
        assert out == [] and len(err) == 1 and err[0].startswith("error: ") and says in err[0], (args, err)
