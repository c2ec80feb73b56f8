"""Small shared pieces of the test suite: a tiny synthetic protocol and a finished run of a protocol."""

from __future__ import annotations

from pathlib import Path

from testbed.run import main as run_main

REPO = Path(__file__).resolve().parent.parent


def synthetic_protocol(name: str = "guard", **source) -> dict:
    """A residual-window protocol over one small synthetic case; ``source`` overrides its source keys."""
    src = {"kind": "synthetic", "seeds": [1], "lengths": [64], "distributions": ["clean"], "head_dim": 16,
           "queries": 4, "focus_tokens": 8}
    src.update(source)
    return {"name": name, "source": src,
            "analyses": {"residual_window": {"bits": 4, "group_size": 16, "residuals": [0, 16], "early_window": 8,
                                             "recent_mass_window": 8}},
            "timing": {"repeats": 0, "seed": 0}}


def finished_run(tmp_path_factory, protocol: str, folder: str) -> Path:
    """Run ``protocols/<protocol>`` once into a fresh temporary folder and return it."""
    out = tmp_path_factory.mktemp("runs") / folder
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(REPO / "protocols" / protocol)]) == 0
    return out


def synthetic_run(base: Path, name: str, **source) -> Path:
    """Run :func:`synthetic_protocol` (``source`` overrides) once into ``base / "run"``; returns the run."""
    import json

    proto = base / f"{name}.json"
    proto.write_text(json.dumps(synthetic_protocol(name, **source)))
    out = base / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(proto)]) == 0
    return out


def copy_run(run: Path, dst: Path) -> Path:
    """A private copy of a finished run (to tamper with)."""
    import shutil

    shutil.copytree(run, dst)
    return dst


def heavy_imports(call: str, run: Path) -> tuple[str, list[str]]:
    """Run ``call`` (Python using ``sys.argv[1]``, the run folder, and setting ``ok``) in a fresh
    interpreter; returns (str(ok), the modules it imported that the audit side must not: torch,
    scipy, numba, the testbed's numerics and its run driver)."""
    import json
    import subprocess
    import sys

    code = (f"import sys, json\n{call}\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'scipy', 'numba') or m.startswith(("
            "'testbed.quant', 'testbed.attention', 'testbed.metrics', 'testbed.ablation', 'testbed.run'))]\n"
            "print(json.dumps([str(ok), bad]))")
    out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    ok, bad = json.loads(out.stdout.strip().splitlines()[-1])
    return ok, bad


def forge_results(run: Path, res: dict) -> None:
    """What a consistent forger does to results.json: write ``res``, rewrite results.csv to say the
    same (the audit checks one against the other) and record both new sha256 in the manifest, so
    that only the audit's own re-derivation of the numbers can notice."""
    import hashlib
    import json

    from testbed.tables import results_csv

    (run / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (run / "results.csv").write_bytes(results_csv(res["rows"]))
    m = json.loads((run / "manifest.json").read_text())
    for rel in ("results.json", "results.csv"):
        m["files"][rel] = hashlib.sha256((run / rel).read_bytes()).hexdigest()
    (run / "manifest.json").write_text(json.dumps(m, indent=1))
