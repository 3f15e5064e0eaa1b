"""Unit-test rewards for code-writing harnesses: run the task's tests against the harness's code in the sandbox."""

from __future__ import annotations

import sys
from typing import Any

from polar_lab import sandbox

TEST_TIMEOUT_S = 30
TEST_MEMORY_MB = 1024


def unit_tests(task: dict[str, Any], result: Any) -> dict[str, float]:
    """1.0 when `task["tests"]` (Python asserts) pass against `result["code"]` written as solution.py.

    >>> unit_tests({"tests": "assert add(2, 3) == 5"}, {"code": "def add(a, b):\\n    return a + b"})
    {'total': 1.0, 'has_code': 1.0, 'passed': 1.0}
    """
    code = result.get("code") if isinstance(result, dict) else None
    if not code:
        return {"total": 0.0, "has_code": 0.0, "passed": 0.0}
    passed, _ = run_tests(code, task["tests"])
    return {"total": float(passed), "has_code": 1.0, "passed": float(passed)}


def run_tests(code: str, tests: str, timeout_s: float = TEST_TIMEOUT_S,
              limits: sandbox.Limits | None = None) -> tuple[bool, str]:
    """Run `tests` against `code` (as solution.py) in a fresh sandbox (polar_lab/sandbox.py: from-scratch
    environment, prlimit limits, its own process group killed at the deadline); returns (passed, the tail of
    the output). Refuses (SandboxError) where the limits cannot be applied, unless `limits.enforce` is False.
    Default limits: 1 GiB of address space, the timeout as CPU seconds, no process count outside a cgroup."""
    limits = limits or sandbox.Limits(memory_mb=TEST_MEMORY_MB, cpu_seconds=int(timeout_s) + 1, processes=None)
    files = {"solution.py": code, "test_solution.py": "from solution import *\n" + tests}
    outcome = sandbox.run([sys.executable, "test_solution.py"], timeout=timeout_s, files=files,
                          env={"PYTHONDONTWRITEBYTECODE": "1"}, limits=limits)
    if outcome.timed_out:
        return False, f"the tests did not finish within {timeout_s:.0f} s"
    return outcome.returncode == 0, (outcome.stdout + outcome.stderr)[-1000:]
