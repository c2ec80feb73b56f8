"""--describe: the protocol reference comes from the specs the validators check with."""

from __future__ import annotations

import json
import re

import pytest

from testbed import live
from testbed.analyses import ANALYSES
from testbed.describe import markdown, names, spec_of
from testbed.protocol import ProtocolError, validate_protocol
from testbed.run import main as run_main
from testbed.sources import SOURCES
from tests._helpers import REPO, synthetic_protocol

VALIDATORS = {**{k: (m.validate, {"kind": k}) for k, m in SOURCES.items()},
              **{k: (m.validate, {}) for k, m in ANALYSES.items()}, "live": (live.validate, {})}


def allowed_by_validator(validate, base: dict) -> set[str]:
    """The keys a validator accepts, read from its own unknown-key error."""
    with pytest.raises(ProtocolError) as info:
        validate({**base, "zz_not_a_key": 1}, "p")
    m = re.search(r"unknown key \(allowed: (.*)\)$", str(info.value))
    assert m, str(info.value)
    return set(m.group(1).split(", "))


@pytest.mark.parametrize("name", sorted(VALIDATORS))
def test_described_keys_are_the_keys_the_validator_accepts(name):
    spec = spec_of(name if name != "live" else "live").keys
    if name == "live":
        spec = live.SPEC.keys
    validate, base = VALIDATORS[name]
    assert allowed_by_validator(validate, base) == set(spec)


def test_protocol_level_keys_too():
    for raw, spec in (({"name": "x"}, spec_of("protocol")), ({"name": "x", "kind": "live"}, spec_of("live"))):
        assert allowed_by_validator(lambda o, w: validate_protocol(o, w), raw) == set(spec.keys)


@pytest.mark.parametrize("name", ["observation", "mx_paths", "ablation", "residual_window", "synthetic"])
def test_described_defaults_are_what_validation_fills_in(name):
    spec = spec_of(name)
    minimal = {"residual_window": {"bits": 4, "group_size": 16, "residuals": [0]},
               "synthetic": {"kind": "synthetic", "seeds": [1], "lengths": [64], "distributions": ["clean"]}}.get(name, {})
    mod = ANALYSES.get(name) or SOURCES[name]
    got = mod.validate(json.loads(json.dumps(minimal)), "p")
    explicit = {**{key: k.default for key, k in spec.keys.items() if not k.required}, **minimal}
    assert mod.validate(json.loads(json.dumps(explicit)), "p") == got  # omitting a key = writing its described default
    for key, k in spec.keys.items():
        if not k.required and key != "kv_arms" and key not in minimal:  # (kv_arms come back with each arm's defaults)
            assert got[key] == k.default, key


def test_defaults_are_not_shared_between_protocols():
    a = ANALYSES["ablation"].validate({}, "p")
    b = ANALYSES["ablation"].validate({}, "p")
    a["ablations"].append("drop_sink")
    assert b["ablations"] == spec_of("ablation").keys["ablations"].default


def test_docs_protocols_md_is_current():
    assert (REPO / "docs" / "protocols.md").read_text(encoding="utf-8") == markdown(), \
        "regenerate: python -m testbed.run --describe --markdown > docs/protocols.md"


def test_describe_cli(capsys):
    assert run_main(["--describe"]) == 0
    out = capsys.readouterr().out
    for name in names():
        assert spec_of(name).title in out
    assert run_main(["--describe", "capture"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("source: capture") and "capture prompt" in out and "source: synthetic" not in out


def test_describe_unknown_name_is_one_line_listing_the_names(capsys):
    assert run_main(["--describe", "nonesuch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nonesuch" in err[0] and all(n in err[0] for n in names())


# -- trace paths resolve against the protocol file's folder -------------------------------------------

def test_a_relative_trace_path_is_relative_to_the_protocol_file(tmp_path, monkeypatch):
    from testbed.audit import audit
    from testbed.sources.synthetic import make_case
    from testbed.sources.traces import save_trace

    study = tmp_path / "study"
    save_trace(study / "clip.safetensors", [make_case("clean", 1, 64, 16, 4), make_case("recent_focus", 2, 64, 16, 4)])
    proto = synthetic_protocol("trace_rel")
    proto["source"] = {"kind": "trace", "files": ["clip.safetensors"]}
    (study / "p.json").write_text(json.dumps(proto))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # neither the repository nor the protocol's folder
    out = tmp_path / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(study / "p.json")]) == 0
    cases = json.loads((out / "results.json").read_text())["cases"]["trace_rel"]
    assert sorted(cases) == ["clean-s1-n64", "recent_focus-s2-n64"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["memory_guard"]["estimated_peak_bytes"]["trace_rel"] > 256 << 20  # the estimate found the file
    assert audit(out, check_sources=False)[0]


def test_the_protocol_kind_lists_every_kind_the_loader_accepts():
    """The shipped protocols use every study kind the loader dispatches on; --describe's `kind`
    allows each of them (it said only "attention" while live and retrieval protocols loaded)."""
    from testbed.schema import spec_allowed

    kinds = {json.loads(p.read_text(encoding="utf-8")).get("kind", "attention")
             for p in (REPO / "protocols").glob("*.json")}
    assert {"attention", "live", "retrieval"} <= kinds
    for k in kinds:  # the loader accepts the kind: whatever it refuses next, it is not the kind
        with pytest.raises(ProtocolError) as info:
            validate_protocol({"name": "x", "kind": k}, "p")
        assert not str(info.value).startswith("p.kind"), str(info.value)
    with pytest.raises(ProtocolError, match=r"^p\.kind"):
        validate_protocol({**synthetic_protocol("x"), "kind": "zz_not_a_kind"}, "p")
    allowed = spec_allowed(spec_of("protocol").keys["kind"].spec)
    for k in kinds:
        assert json.dumps(k) in allowed, (k, allowed)
    kind_line = next(ln for ln in (REPO / "docs" / "protocols.md").read_text(encoding="utf-8").splitlines()
                     if ln.startswith("| `kind` | string | `\"attention\"`"))
    assert all(json.dumps(k) in kind_line for k in kinds), kind_line
