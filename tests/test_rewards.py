"""Evaluators: plain functions, a registry by name, sandboxed unit tests."""

import pytest

from polar_lab.rewards import EVALUATORS, final_answer, get_evaluator, unit_tests
from polar_lab.rewards.code import run_tests

TASK = {"tests": "assert add(2, 3) == 5\n"}


@pytest.mark.parametrize("code, total", [
    ("def add(a, b):\n    return a + b\n", 1.0),   # correct
    ("def add(a, b):\n    return a - b\n", 0.0),   # wrong
    ("def add(a, b)\n    return a + b\n", 0.0),    # syntax error
    ("", 0.0),                                     # no code at all
])
def test_unit_tests_table(code, total):
    assert unit_tests(TASK, {"code": code})["total"] == total


def test_a_hanging_solution_times_out_instead_of_hanging_the_evaluator():
    passed, output = run_tests("import time\ntime.sleep(60)\n", "assert True\n", timeout_s=2)
    assert not passed and "did not finish" in output


def test_the_tests_cannot_see_the_kernel_environment(monkeypatch):
    monkeypatch.setenv("POLAR_TEST_SECRET", "kernel-only")
    passed, _ = run_tests("import os\nSECRET = os.environ.get('POLAR_TEST_SECRET')\n", "assert SECRET is None\n")
    assert passed


def test_registry_by_name():
    assert set(EVALUATORS) >= {"final_answer", "unit_tests", "session_completed"}
    assert get_evaluator("final_answer") is final_answer and get_evaluator(None) is None
    with pytest.raises(KeyError, match="final_answr"):
        get_evaluator("final_answr")


def test_the_evaluator_refuses_to_run_tests_without_limits(monkeypatch):
    import shutil

    from polar_lab import sandbox
    from polar_lab.errors import SandboxError

    real_which = shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None if name == "prlimit" else real_which(name))
    with pytest.raises(SandboxError, match="prlimit"):
        unit_tests(TASK, {"code": "def add(a, b):\n    return a + b\n"})
    unlimited = sandbox.Limits(enforce=False)  # the explicit opt-out
    assert run_tests("def add(a, b):\n    return a + b\n", TASK["tests"], limits=unlimited)[0]


def test_the_deadline_kills_a_grandchild_the_tests_started(tmp_path):
    """At the "process" level (same user as the kernel): the grandchild's pid is written where the test reads it."""
    import time

    from tests.conftest import running

    pidfile = tmp_path / "grandchild"
    code = ("import os, time\n"  # a child that starts a grandchild; all three then hang
            "if os.fork() == 0:\n"
            "    grandchild = os.fork()\n"
            "    if grandchild == 0:\n"
            "        time.sleep(120)\n"
            f"    open({str(pidfile)!r}, 'w').write(str(grandchild))\n"
            "    time.sleep(120)\n"
            "time.sleep(120)\n")
    passed, output = run_tests(code, "assert True\n", timeout_s=3, level="process")
    assert not passed and "did not finish" in output
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(grandchild), f"grandchild {grandchild} outlived the tests' deadline"


@pytest.mark.ci_required
def test_isolated_tests_leave_no_process_of_the_sandbox_user_behind():
    """The default ("isolated") level: the tests run as the sandbox user, so from outside every process of
    that user is the run's — three while it hangs, none after its deadline."""
    import os
    import threading
    import time

    from polar_lab.sandbox import isolation
    from tests.conftest import processes_of

    if isolation.unavailable() is not None or os.geteuid() != 0:
        pytest.skip("needs the isolated level run by root (its own uids)")
    uids = isolation.pool()
    code = "import os, time\nif os.fork() == 0:\n    os.fork()\ntime.sleep(120)\n"
    seen = []
    watcher = threading.Thread(target=lambda: (time.sleep(2), seen.append(len(processes_of(uids)))))
    watcher.start()
    passed, output = run_tests(code, "assert True\n", timeout_s=4)
    watcher.join()
    assert not passed and "did not finish" in output
    assert seen[0] >= 3, f"{seen[0]} processes of the sandbox uids while the tests hung"  # tests, child, grandchild
    assert processes_of(uids) == [], "a process of a sandbox user outlived the tests' deadline"


@pytest.mark.parametrize("answer, text, parts", [
    (23, "3*7+2 = 23", {"total": 1.0, "has_number": 1.0, "correct": 1.0}),
    (23, "23 is not it; the answer is 24", {"total": 0.0, "has_number": 1.0, "correct": 0.0}),  # the LAST integer
    (-5, "it comes to -5.", {"total": 1.0, "has_number": 1.0, "correct": 1.0}),  # negatives
    (5, "five", {"total": 0.0, "has_number": 0.0, "correct": 0.0}),  # no integer at all
    (5, None, {"total": 0.0, "has_number": 0.0, "correct": 0.0}),  # a run with no final text
    (12, "1,2", {"total": 0.0, "has_number": 1.0, "correct": 0.0}),  # digits are not joined across a comma
])
def test_numeric_match_table(answer, text, parts):
    from polar_lab.rewards.numeric import numeric_match

    assert numeric_match({"answer": answer}, text) == parts


def test_final_answer_reads_the_harness_result_or_its_text():
    assert final_answer({"answer": 5}, {"final": "It is 5."})["total"] == 1.0
    assert final_answer({"answer": 5}, "It is 5.")["total"] == 1.0  # a harness that returns its text
    assert final_answer({"answer": 5}, {"final": None})["total"] == 0.0
