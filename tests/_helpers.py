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


# Small copies of three default protocols (seeds, lengths and arms cut down): together they make
# every attention figure of report.html (heatmap, support ECDF, region mass, ablation pairs, MX
# paths, residual window) in about 20 s on 2 cores.
FIGURE_PROTOCOLS = {
    "ablation": {"source": {"seeds": [1, 2]}},
    "mx_paths": {"source": {"seeds": [7, 19], "lengths": [128]}},
    "residual_window": {"source": {"seeds": [7, 19], "lengths": [128]}},
}


def figure_run(tmp_path_factory, folder: str = "figures") -> Path:
    """A finished run of the small copies of FIGURE_PROTOCOLS."""
    import json

    base = tmp_path_factory.mktemp("figure_run")
    args = ["--quiet", "--out", str(base / folder)]
    for name, edits in FIGURE_PROTOCOLS.items():
        proto = json.loads((REPO / "protocols" / f"{name}.json").read_text())
        proto["source"].update(edits["source"])
        proto.update(default=False, timing={"repeats": 0, "seed": 0})
        if name == "ablation":
            proto["analyses"]["ablation"]["kv_arms"] = proto["analyses"]["ablation"]["kv_arms"][:2]
        path = base / f"{name}.json"
        path.write_text(json.dumps(proto, indent=1))
        args += ["--protocol", str(path)]
    assert run_main(args) == 0
    return base / folder


def forge_report_html(run_dir: Path) -> None:
    """What a consistent forger does after rewriting results.json: redraw report.html from it with the
    run's own builder and record its new sha256 (the audit recomputes the figures from the rows, so a
    forger who left report.html alone would be caught there)."""
    import hashlib
    import json

    from testbed.report_html import build_html

    m = json.loads((run_dir / "manifest.json").read_text())
    protocols = [json.loads((run_dir / e["copy"]).read_text()) for e in m["protocols"]]
    rows = json.loads((run_dir / "results.json").read_text())["rows"]
    (run_dir / "report.html").write_text(build_html(protocols, rows, run_dir), encoding="utf-8")
    m["files"]["report.html"] = hashlib.sha256((run_dir / "report.html").read_bytes()).hexdigest()
    (run_dir / "manifest.json").write_text(json.dumps(m, indent=1))


def forge_report_md(run_dir: Path) -> None:
    """What a consistent forger does after rewriting results.json: rewrite report.md from the rows with
    the run's own builder (the protocols as the run validated them, the manifest, timings.json) and
    record its new sha256 (the audit re-derives every table cell from the rows, so a forger who left
    report.md alone would be caught there)."""
    import hashlib
    import json

    from testbed.protocol import validate_protocol
    from testbed.report import build_report

    m = json.loads((run_dir / "manifest.json").read_text())
    protocols = [validate_protocol(json.loads((run_dir / e["copy"]).read_text())) for e in m["protocols"]]
    rows = json.loads((run_dir / "results.json").read_text())["rows"]
    timings = json.loads((run_dir / "timings.json").read_text()) if (run_dir / "timings.json").exists() else []
    (run_dir / "report.md").write_text(build_report(protocols, rows, m, timings), encoding="utf-8")
    m["files"]["report.md"] = hashlib.sha256((run_dir / "report.md").read_bytes()).hexdigest()
    (run_dir / "manifest.json").write_text(json.dumps(m, indent=1))


def protocol_run(base: Path, proto: dict) -> Path:
    """Write the protocol ``proto`` to ``base / "<name>.json"``, run it once into ``base / "run"``
    (asserting success) and return the run folder."""
    import json

    path = base / f"{proto['name']}.json"
    path.write_text(json.dumps(proto))
    out = base / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(path)]) == 0
    return out


def synthetic_run(base: Path, name: str, **source) -> Path:
    """Run :func:`synthetic_protocol` (``source`` overrides) once into ``base / "run"``; returns the run."""
    return protocol_run(base, synthetic_protocol(name, **source))


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


def drop_row(run: Path, res: dict, victim: dict) -> None:
    """A consistent forger deleting one row: it leaves ``res``, its arrays that no other row names
    leave the manifest and their containers, and results, CSV and reports are rewritten
    (:func:`forge_results`)."""
    import json

    from tests import _arrays

    res["rows"].remove(victim)
    m = json.loads((run / "manifest.json").read_text())
    for rel in victim["arrays"].values():
        if not any(rel in json.dumps(r) for r in res["rows"]) and rel in m["arrays"]:
            del m["arrays"][rel]
            _arrays.delete(run, rel)
    (run / "manifest.json").write_text(json.dumps(m, indent=1))
    forge_results(run, res)


def forge_array(run: Path, rel: str, edit) -> None:
    """Edit one stored array in place (``edit(x)``) and record its new SHA-256 in the manifest, as
    a consistent forger does."""
    import json

    from tests import _arrays

    x = _arrays.load(run, rel).copy()
    edit(x)
    _arrays.save(run, rel, x)
    m = json.loads((run / "manifest.json").read_text())
    m["arrays"][rel]["sha256"] = _arrays.sha(run, rel)
    (run / "manifest.json").write_text(json.dumps(m, indent=1))


def forge_results(run: Path, res: dict, redraw: bool = True) -> None:
    """What a consistent forger does to results.json: write ``res``, rewrite results.csv to say the
    same (the audit checks one against the other), redraw report.html and rewrite report.md from the
    rows (the audit recomputes the figures and every table cell) and record the new sha256 in the
    manifest, so that only the audit's own re-derivation of the numbers can notice. ``redraw=False``
    leaves report.html and report.md (their builders need well-formed rows)."""
    import hashlib
    import json

    from testbed.tables import results_csv

    (run / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (run / "results.csv").write_bytes(results_csv(res["rows"]))
    m = json.loads((run / "manifest.json").read_text())
    for rel in ("results.json", "results.csv"):
        m["files"][rel] = hashlib.sha256((run / rel).read_bytes()).hexdigest()
    (run / "manifest.json").write_text(json.dumps(m, indent=1))
    if redraw and (run / "report.html").exists():
        forge_report_html(run)
    if redraw and (run / "report.md").exists():
        forge_report_md(run)


def default_sigint() -> None:
    """``preexec_fn`` of a child that a test interrupts: SIGINT back to its default, so that Python
    turns it into KeyboardInterrupt even when the test runs under a parent that ignores SIGINT
    (a shell's background job, nohup): an inherited SIG_IGN would otherwise stay ignored."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def oracle_kwargs(pol, config, batch: int, tokens: int, seed: int = 0) -> dict:
    """``PolicyCache`` keyword arguments a heavy-hitter oracle needs (``received``: the whole segment's
    scores, one ``[batch, KV heads, tokens]`` tensor per layer; random here, where a test checks what
    does not depend on which tokens are held); nothing for any other policy."""
    import torch

    if not pol.heavy_oracle:
        return {}
    g = torch.Generator().manual_seed(seed)
    shape = (batch, int(config.num_key_value_heads), tokens)
    return {"received": [torch.rand(shape, generator=g, dtype=torch.float64)
                         for _ in range(int(config.num_hidden_layers))]}


def tiny_live_run(tmp_path_factory, name: str, arms: list, **live) -> Path:
    """A one-segment SmolLM2 live run of ``arms`` (smollm2_quality.json with ``live`` overriding its
    live block: prefill, steps, budget_tolerance, ...; evidence at layer 7, R = G = W = 16, no
    peers); skips when the model is not installed. Returns the run folder."""
    import json

    import pytest

    from testbed.sources import models

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}")
    base = tmp_path_factory.mktemp(name)
    proto = json.loads((Path(__file__).resolve().parent.parent / "protocols" / "smollm2_quality.json").read_text())
    proto.update(name=name, default=False)
    proto["live"].update({"evidence_layer": 7, "segments": 1, "batch": 1, "window": 16, "group": 16,
                          "evict_window": 16, "policies": arms, "peers": [], **live})
    return protocol_run(base, proto)


def tiny_retrieval_run(tmp_path_factory, name: str, policies: list, **retrieval) -> Path:
    """A small SmolLM2 retrieval run of ``policies`` (R = G = W = 16, the question after and inside the
    prefill; ``retrieval`` sets the tasks, lengths, depths, trials, ...); skips when the model is not
    installed. Returns the run folder."""
    import pytest

    from testbed.sources import models

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}; install with: {models.INSTALL_HINT}")
    proto = {"name": name, "kind": "retrieval", "description": "tiny", "default": False,
             "retrieval": {"batch": 2, "window": 16, "group": 16, "evict_window": 16, "question": ["after", "inside"],
                           "policies": policies, **retrieval},
             "timing": {"repeats": 0, "seed": 0}}
    return protocol_run(tmp_path_factory.mktemp(name), proto)


def rows_by_arm(run: Path) -> dict:
    """A run's results.json rows by arm name."""
    import json

    return {r["arm"]: r for r in json.loads((run / "results.json").read_text())["rows"]}


def audited_rows(run: Path) -> dict:
    """The run's rows by arm, after asserting that the whole run passes the audit."""
    from testbed.audit import audit

    ok, failures, _ = audit(run)
    assert ok, failures[:5]
    return rows_by_arm(run)


def tiny_llama(layers: int = 2, heads: int = 4, kv: int = 2, d: int = 16, seed: int = 1):
    """A tiny random Llama (float32, SDPA, vocabulary 256) seeded by ``seed``: the live-cache tests' model."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=heads * d, intermediate_size=96, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=d, num_hidden_layers=layers, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
