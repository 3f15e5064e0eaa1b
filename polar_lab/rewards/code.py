"""Unit-test rewards for code-writing harnesses: the task's tests run against the harness's code or changes, in
a fresh sandbox built from the task's own files (never the workdir the harness ran in)."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import sys
from pathlib import Path, PurePosixPath
from typing import Any
from xml.etree import ElementTree

from polar_lab import sandbox
from polar_lab.errors import SandboxError
from polar_lab.sandbox import files as files_of_sandbox

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
              limits: sandbox.Limits | None = None, level: str | None = None) -> tuple[bool, str]:
    """Run `tests` against `code` (as solution.py) in a fresh sandbox (polar_lab/sandbox.py: from-scratch
    environment, prlimit limits, its own process group killed at the deadline); returns (passed, the tail of
    the output). Refuses (SandboxError) where the limits cannot be applied, unless `limits.enforce` is False.
    level: the sandbox level (None: the configured default, "isolated" unless the Lab says otherwise).
    Default limits: 1 GiB of address space, the timeout as CPU seconds, no process count outside a cgroup."""
    limits = limits or sandbox.Limits(memory_mb=TEST_MEMORY_MB, cpu_seconds=int(timeout_s) + 1, processes=None)
    files = {"solution.py": code, "test_solution.py": "from solution import *\n" + tests}
    outcome = sandbox.run([sys.executable, "test_solution.py"], timeout=timeout_s, files=files,
                          env={"PYTHONDONTWRITEBYTECODE": "1"}, limits=limits, level=level)
    if outcome.timed_out:
        return False, f"the tests did not finish within {timeout_s:.0f} s"
    return outcome.returncode == 0, (outcome.stdout + outcome.stderr)[-1000:]


# ---- SWE-style: a repository, the harness's changes, the task's own tests ---------------------------------
REPO_TEST_TIMEOUT_S = 60
REPO = "repo"  # the repository's folder in the test run's workdir; the evaluator's own files sit beside it
REPORT = "report.xml"  # pytest's junit report, beside the repository
PYTEST_INI_NAME = "evaluator-pytest.ini"
PYTEST_INI = "[pytest]\npythonpath = repo\n"  # the only configuration the tests run with: the repo's own
#   (pytest.ini, .pytest.ini, pytest.toml, pyproject.toml, tox.ini, setup.cfg) is never read
MAX_REPORT_BYTES = 16 * 1024 * 1024
TEST_SETUP = ("conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini", "setup.cfg",
              "pyproject.toml", "sitecustomize.py", "usercustomize.py", "*.pth", "pytest.py", "_pytest",
              "pluggy", "py.py")  # names that change how tests run: never taken from a harness


def is_test_path(path: str) -> bool:
    """Whether a repository path is a test: pytest's file names, or anything under a tests folder.

    >>> [is_test_path(p) for p in ("test_a.py", "pkg/a_test.py", "tests/data.json", "testing/x.py", "pkg/core.py")]
    [True, True, True, True, False]
    """
    parts = PurePosixPath(path).parts
    name = parts[-1]
    in_tests = any(part in ("tests", "test", "testing") for part in parts[:-1])
    return in_tests or (name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py")))


def apply_changes(files: dict[str, str], changes: dict[str, Any], *, editable: list[str] | None = None
                  ) -> tuple[dict[str, str], list[str]]:
    """The repository `files` with a harness's `changes` ({path: text, or None to delete}) applied, and the
    paths refused: tests and test set-up files (`TEST_SETUP`), paths outside `editable` (globs) where the
    task names them, and paths that are not plain relative ones.

    >>> apply_changes({"a.py": "x = 1", "test_a.py": "assert x"}, {"a.py": "x = 2", "test_a.py": "", "conftest.py": ""})
    ({'a.py': 'x = 2', 'test_a.py': 'assert x'}, ['conftest.py', 'test_a.py'])
    """
    out, refused = dict(files), []
    for path, text in sorted(changes.items(), key=lambda item: item[1] is not None):  # deletions first
        clean = PurePosixPath(str(path))
        plain = not clean.is_absolute() and ".." not in clean.parts and str(clean) == str(path) and str(path) != "."
        allowed = editable is None or any(fnmatch.fnmatch(str(path), pattern) for pattern in editable)
        setup = any(fnmatch.fnmatch(part, pattern) for part in clean.parts for pattern in TEST_SETUP)
        clash = text is not None and _clashes(str(path), out)
        if (not plain or not allowed or setup or clash or is_test_path(str(path))
                or not isinstance(text, (str, type(None)))):
            refused.append(str(path))
        elif text is None:
            out.pop(str(path), None)
        else:
            out[str(path)] = text
    return out, sorted(refused)


def _clashes(path: str, files: dict[str, str]) -> bool:
    """Whether `path` cannot be written beside `files`: a file is among its folders, or it is a folder of one
    (a harness that replaced test_calc.py by a folder test_calc.py/x)."""
    folders = {str(p) for p in PurePosixPath(path).parents}
    return any(other in folders or other.startswith(path + "/") for other in files)


def repo_tests(task: dict[str, Any], result: Any) -> dict[str, float]:
    """SWE-style: 1.0 when the task's tests pass on its repository (`task["files"]`: path → text) with the
    harness's `changes` applied (a `Command(workspace="files")` result), in a fresh sandbox.

    What the harness may have done to its own workdir does not count: the evaluator starts from the task's
    pristine files, applies only the changes `apply_changes` allows (`task["editable"]` globs narrow them),
    and re-copies every test file from the task. `task["test_files"]` names the tests (default: pytest's
    conventions; only .py files are passed to pytest, the rest are re-copied); `task["test_ids"]` (pytest node ids,
    SWE-bench's FAIL_TO_PASS + PASS_TO_PASS: envs/swe.py) are run instead of the files when given;
    `task["test_command"]` (argv, `{python}` allowed, run in the repository) replaces pytest, and then its exit status
    alone decides. With pytest, a pass also needs its report: tests ran, none failed, errored or skipped (code that
    exits 0 at import does not pass; code that forges the report from inside the test run is not caught — see
    docs/reliability.md). Components: `passed`, `refused` (changes dropped).
    """
    changes = result.get("changes") if isinstance(result, dict) else None
    if not isinstance(changes, dict):
        return {"total": 0.0, "passed": 0.0, "refused": 0.0}
    files, refused = apply_changes(task["files"], changes, editable=task.get("editable"))
    tests = task.get("test_files") or sorted(p for p in task["files"] if is_test_path(p))
    missing = sorted(set(tests) - set(task["files"]))
    if missing:
        raise KeyError(f"the task's test_files {missing} are not among its files")
    files.update({path: task["files"][path] for path in tests})  # whatever the harness did to them
    run = task.get("test_ids") or [p for p in tests if p.endswith(".py")]  # node ids (SWE rows), else the files
    command = task.get("test_command")
    expected = None if command else expected_tests(task["files"], run)
    passed, _ = run_repo_tests(files, run, command, expected=expected)
    return {"total": float(passed), "passed": float(passed), "refused": float(len(refused))}


_EXPECTED: dict[str, int] = {}  # a task's files → how many tests pytest collects from them


def expected_tests(files: dict[str, str], tests: list[str]) -> int | None:
    """How many tests pytest collects from the task's own repository (once per task: cached). A run must
    report exactly these, all passed: code that ends pytest early (`pytest.exit(returncode=0)`) reports fewer."""
    key = hashlib.sha256(json.dumps([files, tests], sort_keys=True).encode()).hexdigest()
    if key not in _EXPECTED:
        outcome, _ = _pytest_run(files, ["--collect-only", "-q", *tests])
        _EXPECTED[key] = sum("::" in line for line in outcome.stdout.splitlines())
    return _EXPECTED[key] or None  # none collected (the task's code does not import): at least one, then


def run_repo_tests(files: dict[str, str], tests: list[str], command: list[str] | None = None,
                   timeout_s: float = REPO_TEST_TIMEOUT_S, expected: int | None = None) -> tuple[bool, str]:
    """Run a repository's tests in a fresh sandbox; (passed, the tail of the output). The repository goes in
    `<workdir>/repo`, where the tests run; pytest runs with `-P` (the repository is not where `pytest` and
    its plugins are imported from: a `pytest.py` there is not imported) and with the evaluator's own
    configuration (`-c`), which puts the repository on the path for the tests. `expected`: how many tests
    its report must show (all passed); None: at least one."""
    if command:
        outcome, report = _pytest_run(files, [], timeout_s, argv=[a.replace("{python}", sys.executable) for a in command])
    else:
        outcome, report = _pytest_run(files, ["-q", f"--junitxml=../{REPORT}", *tests], timeout_s, keep=REPORT)
    output = (outcome.stdout + outcome.stderr)[-1000:]
    if outcome.reason is not None:
        return False, f"the tests were stopped: {outcome.reason} limit. {output}"
    if outcome.returncode != 0:
        return False, output
    return command is not None or _report_clean(report, expected), output


def _pytest_run(files: dict[str, str], args: list[str], timeout_s: float = REPO_TEST_TIMEOUT_S,
                argv: list[str] | None = None, keep: str | None = None) -> tuple[sandbox.Outcome, bytes | None]:
    """pytest (or `argv`) on `files` in a fresh sandbox: its outcome, and the bytes of `keep` (a file beside
    the repository; read safely, bounded; None without one). A repository that cannot be written (a path too long, a
    file where a folder must be) is a failed run, not an error."""
    argv = argv or [sys.executable, "-P", "-m", "pytest", "-p", "no:cacheprovider", "-c", f"../{PYTEST_INI_NAME}",
                    "--rootdir", ".", *args]
    limits = sandbox.Limits(memory_mb=2048, cpu_seconds=int(timeout_s) + 1, processes=256)
    env = {"PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    with sandbox.workdir() as where:
        repo = Path(where) / REPO
        repo.mkdir()
        try:
            sandbox.write_files(repo, files)
        except (OSError, SandboxError) as exc:
            return sandbox.Outcome(returncode=1, stdout="", stderr=f"the repository cannot be written: {exc}",
                                   timed_out=False, pids_peak=None), None
        sandbox.write_files(where, {PYTEST_INI_NAME: PYTEST_INI})
        with sandbox.Sandbox(argv, workdir=where, env=sandbox.environment(where, env), limits=limits,
                             cwd=repo) as box:
            outcome = box.wait(timeout_s)
        kept = files_of_sandbox.read_file(Path(where) / keep, MAX_REPORT_BYTES) if keep else None
    return outcome, kept


def _report_clean(data: bytes | None, expected: int | None) -> bool:
    """A pytest junit report in which `expected` tests (None: at least one) ran and none failed, errored or
    was skipped."""
    if data is None:  # missing, or a link, a FIFO, too big: the tested code may have put it there
        return False
    try:
        root = ElementTree.fromstring(data)
    except ElementTree.ParseError:
        return False
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    try:
        counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    except ValueError:
        return False
    ran = counts["tests"] == expected if expected is not None else counts["tests"] > 0
    return ran and counts["failures"] == counts["errors"] == counts["skipped"] == 0
