"""Fixtures shared by the test modules.

``live_tiny_run``: one finished run of the tiny live protocol (tests/test_live.py's), made once per
session for the suites that read it (test_live, test_audit_reencode); tests copy it before editing.

``smollm2``: the capture model, loaded once per session (test_capture, test_archive).

``attention_block``: a test that plays a model's attention calls itself, inside a
``policy_attention`` block's flag (test_mixed_precision, test_heavy_hitters).

``reliability`` (tests/_reliability.py) is offered here rather than imported into each suite: a
fixture imported into a test module and then requested as a test's argument reads to pyflakes as
a name redefined while unused (ruff F811).
"""

from tests._reliability import reliability  # noqa: F401  (a fixture: pytest finds it in conftest.py)


import pytest  # noqa: E402  (after the fixture import above, which must stay first for its comment)


@pytest.fixture(scope="session")
def live_tiny_run(tmp_path_factory):
    from testbed.run import main as run_main
    from testbed.sources import models
    from tests.test_live import _tiny_protocol

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}; install with: {models.INSTALL_HINT}")
    pytest.importorskip("optimum.quanto", reason="the quanto peer needs optimum-quanto: pip install -e '.[bench]'")
    tmp = tmp_path_factory.mktemp("live")
    out = tmp / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(_tiny_protocol(tmp))]) == 0
    return out


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2 loaded once per session (the capture tests); skipped, with the install command,
    without the capture extra or the GGUF."""
    from testbed.sources import models

    try:
        return models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}; install with: {models.INSTALL_HINT}")


@pytest.fixture
def attention_block():
    """The test plays the attention calls itself inside a policy_attention block's flag; the
    block's pending state is cleared after it."""
    from testbed.policies import handoff

    handoff.ACTIVE[0] += 1
    yield
    handoff.ACTIVE[0] -= 1
    handoff.PENDING.clear()
    handoff.DIRECT.clear()
    handoff.SELECT.clear()
