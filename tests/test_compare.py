"""testbed.compare: two runs compared numerically within the cross-machine tolerances."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from testbed.audit import audit
from testbed.compare import TOLERANCES, main as compare_main
from tests import _arrays
from tests._helpers import REPO, copy_run, forge_results, heavy_imports, synthetic_run


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    return synthetic_run(tmp_path_factory.mktemp("cmp"), "cmp", distributions=["clean", "recent_focus"])


@pytest.fixture
def copy(small_run, tmp_path) -> Path:
    return copy_run(small_run, tmp_path / "b")


def run_compare(a, b, capsys) -> tuple[int, list[str]]:
    code = compare_main([str(a), str(b)])
    return code, capsys.readouterr().out.splitlines()


def edit_rows(run: Path, fn) -> None:
    res = json.loads((run / "results.json").read_text())
    fn(res["rows"])
    (run / "results.json").write_text(json.dumps(res))


def first_row(rows, field="rel_l2"):
    """The first row whose ``field`` is well above the absolute tolerance (so rtol decides)."""
    return next(r for r in rows if isinstance(r.get(field), float) and abs(r[field]) > 1e-3)


def test_a_run_compared_with_itself_passes_with_zero_difference(small_run, capsys):
    code, out = run_compare(small_run, small_run, capsys)
    assert code == 0
    assert out[0] == "no differences: every compared array and number is identical"
    assert out[-1].startswith("PASS: ")


def test_a_number_changed_beyond_the_tolerance_fails_naming_it(small_run, copy, capsys):
    rows = json.loads((copy / "results.json").read_text())["rows"]
    target = first_row(rows)
    def beyond(rows):
        row = first_row(rows)
        row["rel_l2"] *= 1 + 100 * TOLERANCES["float"]["rtol"]

    edit_rows(copy, beyond)
    code, out = run_compare(small_run, copy, capsys)
    assert code == 1
    fails = [line for line in out if line.startswith("FAIL: ")]
    assert len(fails) == 1 and "rel_l2" in fails[0] and f"case={target['case']}" in fails[0] \
        and f"arm={target['arm']}" in fails[0], out


def test_a_tiny_change_passes_but_is_shown(small_run, copy, capsys):
    def tiny(rows):
        row = first_row(rows, "cosine")
        row["cosine"] *= 1 - 1e-12

    edit_rows(copy, tiny)
    code, out = run_compare(small_run, copy, capsys)
    assert code == 0, out
    table = [line for line in out if line.startswith("  ")]
    assert any("cosine" in line for line in table[1:]), out  # after the table's header
    assert out[-1].startswith("PASS: ")


def test_a_missing_row_fails(small_run, copy, capsys):
    rows = json.loads((copy / "results.json").read_text())["rows"]
    gone = rows[-1]
    edit_rows(copy, lambda rs: rs.pop())
    code, out = run_compare(small_run, copy, capsys)
    assert code == 1
    fails = [line for line in out if line.startswith("FAIL: ")]
    assert len(fails) == 1 and "only in" in fails[0] and f"case={gone['case']}" in fails[0] and str(small_run) in fails[0]


def test_rows_are_matched_by_identity_not_position(small_run, copy, capsys):
    edit_rows(copy, lambda rs: rs.reverse())
    code, out = run_compare(small_run, copy, capsys)
    assert code == 0 and out[0].startswith("no differences"), out


def _array(run: Path, kind: str) -> str:
    m = json.loads((run / "manifest.json").read_text())
    return next(rel for rel, e in sorted(m["arrays"].items())
                if np.dtype(e["dtype"]).kind == kind and "query_positions" not in rel and "header" not in rel
                and e["shape"] and np.prod(e["shape"]) > 8)


def test_array_differences(small_run, copy, capsys):
    f = _array(copy, "f")
    x = _arrays.load(copy, f)
    x.flat[3] = x.flat[3] * 1.01 + 1e-3  # beyond the float tolerance
    _arrays.save(copy, f, x)
    c = _array(copy, "u") if any(np.dtype(e["dtype"]).kind == "u" for e in
                                 json.loads((copy / "manifest.json").read_text())["arrays"].values()) else _array(copy, "i")
    y = _arrays.load(copy, c)
    y.flat[0] = y.flat[0] ^ 1
    _arrays.save(copy, c, y)
    code, out = run_compare(small_run, copy, capsys)
    assert code == 1
    fails = [line for line in out if line.startswith("FAIL: ")]
    assert any(f in line and ": differs by" in line for line in fails), fails
    assert any(c in line and ": 1 of " in line for line in fails), fails


def test_a_missing_array_fails(small_run, copy, capsys):
    m = json.loads((copy / "manifest.json").read_text())
    rel = sorted(m["arrays"])[0]
    del m["arrays"][rel]
    _arrays.delete(copy, rel)
    (copy / "manifest.json").write_text(json.dumps(m))
    code, out = run_compare(small_run, copy, capsys)
    assert code == 1 and any(line.startswith("FAIL: ") and rel in line and line.endswith(f": array only in {small_run}")
                             for line in out), out


def _split_shared_array(run: Path, edit) -> str:
    """In a copy of evidence/: the float32 policy's log-probs of smollm2_quality seg000 equal the
    reference's to the last bit, so the store kept them once, at the reference's path. Give them
    their own path, holding ``edit`` of them, as the store does where the two are not equal (another
    machine, 1 ulp apart): a new member of the case's container, its manifest entry, the row naming
    it, results.json and results.csv. Returns the row's label fragment."""
    res = json.loads((run / "results.json").read_text())
    row = next(r for r in res["rows"] if r.get("study") == "smollm2_quality" and r.get("case") == "seg000"
               and r.get("arm") == "float32")
    shared = row["arrays"]["logprob"]
    assert shared.endswith("/dynamic_cache.logprob.npy")  # one path for two arrays in evidence/
    new = "arrays/smollm2_quality/seg000/float32.logprob.npy"
    y = edit(_arrays.load(run, shared).copy())
    _arrays.save(run, new, y)
    m = json.loads((run / "manifest.json").read_text())
    assert new not in m["arrays"]
    m["arrays"][new] = {"sha256": _arrays.sha(run, new), "nbytes": int(y.nbytes), "dtype": y.dtype.str,
                        "shape": list(y.shape)}
    (run / "manifest.json").write_text(json.dumps(m, indent=1))
    row["arrays"]["logprob"] = new
    forge_results(run, res, redraw=False)  # results.json and results.csv name the new path, re-hashed
    return "case=seg000 arm=float32"


def _one_ulp(x: np.ndarray) -> np.ndarray:
    x[0] = np.nextafter(x[0], np.float32(0))
    return x


def test_arrays_are_matched_by_what_they_are_not_by_path(tmp_path, capsys):
    """A run whose store kept two arrays apart that evidence/ keeps as one (1 ulp apart on another
    machine) compares with evidence/ by what each array is: it passes, the 1-ulp difference shown
    for the row's array; a real difference of the same array fails, naming the row and the field."""
    ev = REPO / "evidence"
    near = copy_run(ev, tmp_path / "near")
    label = _split_shared_array(near, _one_ulp)
    ok, failures, _ = audit(near, check_sources=False)
    assert ok, failures[:5]  # a run as the store would have written it
    code, out = run_compare(near, ev, capsys)
    assert code == 0, [line for line in out if line.startswith("FAIL")][:5]
    assert any(label in line and "arrays.logprob" in line for line in out if line.startswith("  ")), out[:12]
    far = copy_run(ev, tmp_path / "far")
    _split_shared_array(far, lambda x: x * np.float32(0.5))
    code, out = run_compare(far, ev, capsys)
    fails = [line for line in out if line.startswith("FAIL: ")]
    assert code == 1 and len(fails) == 1, fails[:5]
    assert label in fails[0] and "arrays.logprob" in fails[0] and "differs by" in fails[0], fails


def test_bad_input_exits_2(small_run, tmp_path):
    (tmp_path / "empty").mkdir()
    for other in (tmp_path / "nope", tmp_path / "empty"):
        r = subprocess.run([sys.executable, "-m", "testbed.compare", str(small_run), str(other)], cwd=REPO,
                           capture_output=True, text=True)
        assert r.returncode == 2 and r.stdout == ""
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: "), r.stderr


def test_compare_imports_neither_torch_nor_testbed_numerics(small_run):
    call = "import testbed.compare as c; ok, _, _ = c.compare_runs(sys.argv[1], sys.argv[1])"
    assert heavy_imports(call, small_run) == ("True", [])


def test_floats_are_judged_on_their_fields_scale_not_their_own(small_run, copy, capsys):
    """A float32 arm's rel_l2 (rounding noise, ~1e-7) doubled is far below the scale of the field
    (the quantized arms' rel_l2, ~1e-1): normwise it passes; the same absolute change on the row
    that sets the scale is a relative 2e-6 there too. A change of 1 % of the field's scale fails
    wherever it lands."""
    rows = json.loads((copy / "results.json").read_text())["rows"]
    scale = max(abs(r["rel_l2"]) for r in rows if isinstance(r.get("rel_l2"), float))
    tiny = min((r for r in rows if isinstance(r.get("rel_l2"), float) and r["rel_l2"] > 0), key=lambda r: r["rel_l2"])
    assert tiny["rel_l2"] < 1e-4 * scale  # the premise: a near-zero value in a field of large ones

    def double_the_tiny(rs):
        r = next(x for x in rs if x.get("case") == tiny["case"] and x.get("arm") == tiny["arm"])
        r["rel_l2"] *= 2

    edit_rows(copy, double_the_tiny)
    code, out = run_compare(small_run, copy, capsys)
    assert code == 0, out

    def one_percent(rs):
        r = next(x for x in rs if x.get("case") == tiny["case"] and x.get("arm") == tiny["arm"])
        r["rel_l2"] += 0.01 * scale

    edit_rows(copy, one_percent)
    code, out = run_compare(small_run, copy, capsys)
    fails = [line for line in out if line.startswith("FAIL: ")]
    assert code == 1 and len(fails) == 1 and f"arm={tiny['arm']}" in fails[0] and "rel_l2" in fails[0], out


def test_flip_sensitive_analyses_get_their_own_tolerance():
    """The same 2 % move of a field's largest value passes for an MX-path field (where one flipped
    E4M3 code moves a row's TV by that much) and fails for an ablation field."""
    from testbed.compare import Diffs

    ref = np.array([0.10, 0.02, 0.05])
    moved = ref.copy()
    moved[1] += 0.02 * ref.max()
    flip, plain = Diffs(), Diffs()
    flip.floats("mx", moved, ref, "flip_sensitive", ["r0", "r1", "r2"])
    plain.floats("ablation", moved, ref, "float", ["r0", "r1", "r2"])
    assert flip.failures == []
    assert len(plain.failures) == 1 and plain.failures[0].startswith("FAIL: r1: differs by 0.002")


def test_each_arm_is_judged_on_its_own_scale():
    """One field, two arms of very different size (a control with tiny mass at ~100 per unit of
    mass, an ablation at ~1): a 10 % drift of the small arm must not hide behind the large one."""
    from testbed.compare import Diffs, _compare_rows

    def rows(x):
        return {"rows": [{"study": "s", "analysis": "ablation", "case": f"c{i}", "arm": "float32", "ablation": name,
                          "rel_l2_per_mass": v} for i in range(3) for name, v in (("drop_sink", x), ("control_sink", 100.0))]}

    out = Diffs()
    _compare_rows(Path("a"), Path("b"), rows(1.1), rows(1.0), out)
    assert out.failures and all("ablation=drop_sink" in f for f in out.failures), out.failures
    out = Diffs()
    _compare_rows(Path("a"), Path("b"), rows(1.0 + 1e-7), rows(1.0), out)
    assert out.failures == []


def test_the_ablations_dropped_mass_array_may_move_within_the_mass_matched_band_and_no_further():
    """A mass-matched control's row of ``stats.tau`` is the mass its keys reached, anywhere in
    [(1 - 0.01) t, (1 + 0.01) t] of the target's mass t: a flipped comparison on another CPU moves it
    by up to 2 % of t, on many rows at once (no outlier quota). A move past the band still fails, and
    every other ablation array keeps the plain float tolerance."""
    from testbed.compare import Diffs, float_array_kind

    name = "row study=s analysis=ablation case=c0 arm=float32 ablation=none layer=0 arrays.stats.tau"
    path = "arrays/s/c0/ablation.float32.stats.tau.npy"
    assert float_array_kind(name, path, set()) == "mass_band"
    assert float_array_kind("arrays/s/c0/ablation.float32.stats.tau.npy", path, set()) == "mass_band"
    assert float_array_kind(name.replace("stats.tau", "stats.tv"), path.replace("tau", "tv"), set()) == "float"
    assert float_array_kind(name.replace("analysis=ablation", "analysis=observation"),
                            "arrays/s/c0/observation.stats.tau.npy", set()) == "float"
    assert float_array_kind(name, path, {"s"}) == "per_token"

    rng = np.random.default_rng(0)
    target = rng.uniform(0.05, 0.95, size=200)
    reached = target * rng.uniform(0.99, 1.01, size=200)  # one machine's first fit
    other = target * rng.uniform(0.99, 1.01, size=200)    # another's: the same band, other keys
    band, plain = Diffs(), Diffs()
    band.floats("tau", other, reached, "mass_band")
    plain.floats("tau", other, reached, "float")
    assert band.failures == [] and plain.failures, (band.failures, plain.failures)
    past = other.copy()
    past[17] = target[17] * 1.05  # 4 % beyond the band's edge: not a flip
    band = Diffs()
    band.floats("tau", past, reached, "mass_band")
    assert len(band.failures) == 1 and "element 17" in band.failures[0], band.failures


def test_a_flip_sensitive_group_allows_one_percent_of_outliers_and_no_more():
    """One flipped code moves one row: up to 1 % of a flip-sensitive group (at least one element)
    may lie beyond 5 % of its scale, none beyond 50 %; plain float groups allow no outlier."""
    from testbed.compare import Diffs

    ref = np.linspace(0.01, 0.1, 144)
    one = ref.copy()
    one[7] += 0.06 * ref.max()
    two = one.copy()
    two[90] += 0.06 * ref.max()
    far = ref.copy()
    far[7] += 0.6 * ref.max()
    for moved, kind, ok in ((one, "flip_sensitive", True), (two, "flip_sensitive", False),
                            (far, "flip_sensitive", False), (one, "float", False)):
        d = Diffs()
        d.floats("g", moved, ref, kind, [f"r{i}" for i in range(144)])
        assert (d.failures == []) is ok, (kind, d.failures)


def test_help_readme_and_docs_agree_that_b_is_the_reference(capsys):
    """The tolerances scale with B's values (Diffs.floats: max |b|), so B is the reference: --help,
    the README's sentence and docs/compare.md all say so, and none calls A the reference."""
    with pytest.raises(SystemExit):
        compare_main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    b_help = help_text.split(" B ", 2)[-1]
    assert "reference" in b_help and "reference" not in help_text.split("A B")[-1].split(" B ")[0]
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    sentence = readme.split("`python -m testbed.compare A B` (numpy + stdlib)", 1)[1].split(":", 1)[0]
    assert "A reproduces B, the reference" in sentence and "reproduced A" not in readme
    doc = " ".join((REPO / "docs" / "compare.md").read_text(encoding="utf-8").split())
    assert "B is the reference" in doc


def test_study_selection_compares_only_those_studies(small_run, tmp_path, capsys):
    """``--study`` keeps one study's rows and arrays: a run holding an extra study compares clean
    against one without it when only the shared study is named, fails without the option, and a
    study one run lacks is bad input naming it."""
    (tmp_path / "o").mkdir()
    other = synthetic_run(tmp_path / "o", "other", distributions=["clean"])
    merged = copy_run(small_run, tmp_path / "merged")
    res, extra = json.loads((merged / "results.json").read_text()), json.loads((other / "results.json").read_text())
    res["rows"] += extra["rows"]
    (merged / "results.json").write_text(json.dumps(res))
    code, lines = run_compare(merged, small_run, capsys)
    assert code == 1 and any("only in" in x and "study=other" in x for x in lines)
    assert compare_main([str(merged), str(small_run), "--study", "cmp"]) == 0
    assert "studies cmp only" in capsys.readouterr().out
    assert compare_main([str(small_run), str(merged), "--study", "cmp", "--study", "other"]) == 2
    assert "has no study other" in capsys.readouterr().err


def _one_level_down() -> dict:
    """Environment that makes this machine compute like an older CPU: torch's ATen kernels and MKL
    one instruction-set level below what they would pick, numpy's dispatch without it, numba
    compiled for a generic x86-64."""
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512":
        return {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "NPY_DISABLE_CPU_FEATURES": "X86_V4",
                "NUMBA_CPU_NAME": "x86-64"}
    if cap == "AVX2":
        return {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                "NPY_DISABLE_CPU_FEATURES": "X86_V3", "NUMBA_CPU_NAME": "x86-64"}
    pytest.skip(f"no lower instruction set to fall back to from {cap}")


@pytest.mark.slow
@pytest.mark.capture
def test_a_run_on_another_instruction_set_and_thread_count_passes_against_evidence(tmp_path):
    """What a user on another CPU does: run protocols and compare against the archived evidence/.
    Here the other CPU is this one with its kernels one instruction-set level down (another sum
    order in every float kernel) and 2 threads instead of 1. The studies where a code flips at a
    rounding boundary are the ones run: MX paths, the ablation and residual-window quantizers, the
    mass-matched controls on captured attention (a selection a flipped comparison changes), and the
    live study 30 layers deep with quanto's peers (its int2 is the most sensitive arm). Their audit
    passes and compare finds them within its tolerances; before the per-token and mass-mismatch
    tolerances, the same comparison of a whole default run failed on exactly these."""
    import os

    env = {**os.environ, **_one_level_down(), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    names = ["mx_paths", "ablation", "residual_window", "smollm2_prompts", "smollm2_quality"]
    out = tmp_path / "other_cpu"
    cmd = [sys.executable, "-m", "testbed.run", "--quiet", "--threads", "2", "--out", str(out)]
    for n in names:
        cmd += ["--protocol", str(REPO / "protocols" / f"{n}.json")]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode != 0 and "capture skipped" in r.stderr:
        pytest.skip("the capture extra or SmolLM2 is missing")
    assert r.returncode == 0, r.stderr[-2000:]
    ok, failures, _ = audit(out)
    assert ok, failures[:5]
    c = subprocess.run([sys.executable, "-m", "testbed.compare", str(out), str(REPO / "evidence")]
                       + [x for n in names for x in ("--study", n)], cwd=REPO, capture_output=True, text=True)
    assert c.returncode == 0, c.stdout[-3000:]
    assert "PASS: studies" in c.stdout
