"""The suite's own rules (tests/conftest.py), run on small inner test files: a test that needs root fails in CI
instead of skipping, and every test is in exactly one tier."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

pytest_plugins = ("pytester",)

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()

NEEDS_NETNS = """
import pytest

@pytest.mark.netns
def test_builds_namespaces():
    pass
"""

NEEDS_DOCKER = """
import pytest

@pytest.mark.docker
def test_runs_containers():
    pass
"""


@pytest.fixture
def inner(pytester, monkeypatch):
    pytester.makeconftest(CONFTEST)
    # Namespaces cannot be made here, nor a Docker engine started (whatever this machine allows): the rules'
    # reaction is what is tested.
    monkeypatch.setattr("deploy.netns.have_netns", lambda: (False, "needs root (test)"))
    monkeypatch.setattr("deploy.engine.why_unavailable", lambda: "no package registry (test)")
    return pytester


def test_a_root_only_test_skips_with_the_reason(inner, monkeypatch):
    monkeypatch.delenv("SWARM_REQUIRE_ROOT_TESTS", raising=False)
    inner.makepyfile(NEEDS_NETNS)
    result = inner.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*network namespaces unavailable: needs root (test)*"])


def test_a_root_only_test_fails_when_ci_requires_it(inner, monkeypatch):
    monkeypatch.setenv("SWARM_REQUIRE_ROOT_TESTS", "1")
    inner.makepyfile(NEEDS_NETNS)
    result = inner.runpytest()
    # an error in setup, before the test's body: the run fails (exit status 1) either way
    result.assert_outcomes(errors=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*network namespaces unavailable: needs root (test)*CI must run*"])


def test_a_test_that_needs_docker_skips_with_the_reason_and_fails_when_ci_requires_it(
    inner, monkeypatch
):
    monkeypatch.delenv("SWARM_REQUIRE_ROOT_TESTS", raising=False)
    inner.makepyfile(NEEDS_DOCKER)
    result = inner.runpytest("-rs", "-m", "swarm")  # in the swarm tier, like a netns test
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*a Docker engine unavailable: no package registry (test)*"])
    monkeypatch.setenv("SWARM_REQUIRE_ROOT_TESTS", "1")
    result = inner.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*a Docker engine unavailable: no package registry (test)*CI must run*"]
    )


def test_every_test_gets_one_tier(inner):
    inner.makepyfile(
        test_plain="def test_a():\n    pass\n",
        test_marked="import pytest\npytestmark = pytest.mark.integration\ndef test_b():\n    pass\n",
        test_older="import pytest\npytestmark = pytest.mark.slow\ndef test_c():\n    pass\n",
    )
    assert inner.runpytest("-m", "unit").parseoutcomes() == {"passed": 1, "deselected": 2}
    assert inner.runpytest("-m", "integration").parseoutcomes() == {"passed": 1, "deselected": 2}
    assert inner.runpytest("-m", "swarm").parseoutcomes() == {"passed": 1, "deselected": 2}


def test_two_tiers_or_a_swarm_outside_its_tier_is_refused(inner):
    inner.makepyfile(
        test_two="import pytest\n@pytest.mark.unit\n@pytest.mark.swarm\ndef test_a():\n    pass\n"
    )
    result = inner.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert (
        "test_a is marked ['swarm', 'unit']: a test is in exactly one tier" in result.stderr.str()
    )
    inner.makepyfile(test_two="def test_b(local_swarm):\n    pass\n")
    result = inner.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "test_b starts a local swarm but is in the unit tier" in result.stderr.str()
