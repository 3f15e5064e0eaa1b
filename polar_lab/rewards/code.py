"""Unit-test rewards for code-writing harnesses: run the task's tests against the harness's code, sandboxed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

TEST_TIMEOUT_S = 30


def unit_tests(task: dict[str, Any], result: Any) -> dict[str, float]:
    """1.0 when `task["tests"]` (Python asserts) pass against `result["code"]` written as solution.py.

    >>> unit_tests({"tests": "assert add(2, 3) == 5"}, {"code": "def add(a, b):\n    return a + b"})
    {'total': 1.0, 'has_code': 1.0, 'passed': 1.0}
    """
    code = result.get("code") if isinstance(result, dict) else None
    if not code:
        return {"total": 0.0, "has_code": 0.0, "passed": 0.0}
    passed, _ = run_tests(code, task["tests"])
    return {"total": float(passed), "has_code": 1.0, "passed": float(passed)}


def run_tests(code: str, tests: str, timeout_s: float = TEST_TIMEOUT_S) -> tuple[bool, str]:
    """Run `tests` against `code` (as solution.py) in a fresh temp folder with a from-scratch environment,
    prlimit limits and a timeout; returns (passed, the tail of the output)."""
    workdir = tempfile.mkdtemp(prefix="polar-tests-")
    try:
        with open(os.path.join(workdir, "solution.py"), "w") as fh:
            fh.write(code)
        with open(os.path.join(workdir, "test_solution.py"), "w") as fh:
            fh.write("from solution import *\n" + tests)
        limits = ["prlimit", f"--as={1024 ** 3}", f"--cpu={int(timeout_s) + 1}", "--"] \
            if shutil.which("prlimit") else []
        env = {"PATH": os.environ.get("PATH", ""), "HOME": workdir, "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            proc = subprocess.run([*limits, sys.executable, "test_solution.py"], cwd=workdir, env=env,
                                  capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False, f"the tests did not finish within {timeout_s:.0f} s"
        return proc.returncode == 0, (proc.stdout + proc.stderr)[-1000:]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
