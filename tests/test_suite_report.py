"""The suite's own plugin (tests/suite_report.py): under POLAR_LAB_CI=1 a `ci_required` test that skips fails, naming
itself and the reason; elsewhere it skips like any other; an optional test skips either way."""

import pytest

INNER = """
import pytest

@pytest.mark.ci_required
@pytest.mark.skipif(True, reason="Codex is not installed")
def test_agent_preset():
    pass

@pytest.mark.skipif(True, reason="no CUDA device")
def test_optional():
    pass

@pytest.mark.ci_required
def test_required_and_present():
    pass
"""


@pytest.mark.parametrize("ci, outcomes", [
    (None, {"passed": 1, "skipped": 2}),             # a laptop without Codex: the run does not fail
    ("1", {"passed": 1, "skipped": 1, "errors": 1}),  # CI: the unchecked promise fails the run (at its setup)
])
def test_a_required_test_that_skips_fails_only_in_ci(pytester, monkeypatch, ci, outcomes):
    pytester.makeconftest('pytest_plugins = ["tests.suite_report"]')
    pytester.makepyfile(INNER)
    if ci is None:
        monkeypatch.delenv("POLAR_LAB_CI", raising=False)
    else:
        monkeypatch.setenv("POLAR_LAB_CI", ci)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(**outcomes)
    if ci:
        result.stdout.fnmatch_lines(["*test_agent_preset is required in CI (POLAR_LAB_CI=1) but skipped: "
                                     "*Codex is not installed*"])
        assert result.ret != 0
