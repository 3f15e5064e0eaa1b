"""A pytest plugin (loaded by tests/conftest.py): what the suite spent its time on (the engines it started), and the
tests CI may not skip.

Optional tools (npm agents, Chromium, bubblewrap, the NeMo Gym and verifiers venvs, SmolLM2, TCMalloc) make their
tests skip with the reason on a machine without them: `make test` never fails for a missing extra. CI installs them
all, so there a skip means a promise went unchecked: with POLAR_LAB_CI=1 (set by .ci/run) a skipped test marked
`ci_required` is reported as a failure that names it and the reason.

Every vLLM engine process appends a line to the file named by POLAR_LAB_ENGINE_LOG when it is ready
(engine/worker.py `note_start`), whichever process started it — this pytest process, a notebook kernel, a
`polar-lab train` run — since they all inherit the variable set here. The summary at the end of the run counts them by
test module and says how many were forked from the forkserver (engine/forkserver.py) rather than started fresh.
`scripts/suite_report.py` reads the same log beside a JUnit XML for the tables in docs/testing.md.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections import Counter
from pathlib import Path

import pytest

ENGINE_LOG = "POLAR_LAB_ENGINE_LOG"


CI = "POLAR_LAB_CI"


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "ci_required: an acceptance test of an ecosystem promise; under POLAR_LAB_CI=1 "
                                       "(.ci/run) its skip fails the run")
    if not os.environ.get(ENGINE_LOG):
        fd, path = tempfile.mkstemp(prefix="polar-lab-engines-", suffix=".jsonl")
        os.close(fd)
        os.environ[ENGINE_LOG] = path
        config._polar_lab_engine_log = path  # ours: removed at the end


def read_starts(path: str | Path) -> list[dict]:
    """The engine-start lines of a log (a line cut short by a killed process is skipped)."""
    starts = []
    for line in Path(path).read_text().splitlines():
        try:
            starts.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return starts


def module_of(test: str | None) -> str:
    """'tests/x/test_y.py::test_z (setup)' → 'tests/x/test_y.py'; engines started outside a test → '(no test)'."""
    return test.split("::")[0].split(" ")[0] if test else "(no test)"


def pytest_terminal_summary(terminalreporter, config) -> None:
    path = os.environ.get(ENGINE_LOG)
    if not path or not os.path.exists(path):
        return
    starts = read_starts(path)
    if getattr(config, "_polar_lab_engine_log", None) == path:
        os.unlink(path)
    if not starts:
        return
    forked = sum(bool(s.get("forked")) for s in starts)
    build = statistics.median(s["build_s"] for s in starts)
    terminalreporter.write_sep("=", f"{len(starts)} engine starts ({forked} forked from the forkserver; "
                                    f"vLLM build p50 {build:.1f} s)")
    for module, count in Counter(module_of(s.get("test")) for s in starts).most_common():
        terminalreporter.write_line(f"{count:4d}  {module}")



@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under POLAR_LAB_CI=1, a `ci_required` test that skips fails instead, naming itself and why it skipped."""
    outcome = yield
    report = outcome.get_result()
    required = item.get_closest_marker("ci_required") is not None
    if report.skipped and required and os.environ.get(CI) == "1" and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} is required in CI ({CI}=1) but skipped: {reason}"
