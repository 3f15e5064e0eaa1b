"""scripts/named_mutants.py stays runnable: each hand-written mutant's edits apply to today's code exactly once, the
mutated file still compiles, and each test it names exists. Nothing else runs the script between mutation passes,
so without this a refactor under a mutant leaves it stale unseen, and the script refuses to run any of them."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("named_mutants", ROOT / "scripts" / "named_mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("named_mutants", module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


SCRIPT = _script()


@pytest.mark.parametrize("mutant", SCRIPT.MUTANTS, ids=[m.name for m in SCRIPT.MUTANTS])
def test_each_named_mutant_applies_once_compiles_and_names_tests_that_exist(mutant):
    """The script's own edit check (`mutated`, as `check` runs it), then what its collection check leaves to pytest
    (too slow here: it imports every named module), read from the test files."""
    text, problems = SCRIPT.mutated(mutant)
    assert problems == [] and text != (ROOT / mutant.file).read_text()
    compile(text, mutant.file, "exec")  # a mutant that does not compile is killed by a SyntaxError: proves nothing
    for test in mutant.tests:
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), f"no test file {path}"
        if name:  # a test, or one parametrisation of it: its function is defined in that file
            function = name.split("::")[-1].split("[")[0]
            assert re.search(rf"^\s*(async )?def {re.escape(function)}\(", (ROOT / path).read_text(), re.M), \
                f"no test {function} in {path}"


def _report(tmp_path, *cases: str) -> Path:
    path = tmp_path / "junit.xml"
    path.write_text(f'<testsuites><testsuite name="pytest">{"".join(cases)}</testsuite></testsuites>')
    return path


def _case(name: str, failure: str = "", kind: str = "failure") -> str:
    body = f'<{kind} message="{failure}">Traceback: ...\n    assert x == y  # a line of the test\n</{kind}>' \
        if failure else ""
    return f'<testcase classname="tests.test_a" name="{name}" time="0.1">{body}</testcase>'


def test_judge_counts_a_kill_only_when_a_named_test_fails_on_its_own_assertion(tmp_path):
    """Another test failing proves nothing about the mutant; nor does an error whose traceback merely shows an
    assert line; a named test's AssertionError, a DID NOT RAISE, or an error raised in the mutated file does."""
    named = ["tests/test_a.py::test_named"]
    judge = SCRIPT.judge
    assert judge(_report(tmp_path, _case("test_named", "assert 1 == 2")), "polar_lab/x.py", named)[0] == "killed"
    assert judge(_report(tmp_path, _case("test_named[p1]", "Failed: DID NOT RAISE")), "polar_lab/x.py",
                 named)[0] == "killed"
    assert judge(_report(tmp_path, _case("test_named", "TypeError: unsupported operand")), "polar_lab/x.py",
                 named)[0] == "unclear"
    assert judge(_report(tmp_path, _case("test_named"), _case("test_other", "assert 1 == 2")), "polar_lab/x.py",
                 named)[0] == "survived"
    assert judge(_report(tmp_path, _case("test_named", "ValueError in polar_lab/x.py", kind="error")),
                 "polar_lab/x.py", named)[0] == "killed"
    assert judge(_report(tmp_path, _case("test_other", "assert 0")), "polar_lab/x.py",
                 ["tests/test_a.py"])[0] == "killed"  # a whole file named: each of its tests counts


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FORMULAS = _load("formula_mutants").MUTANTS


@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_each_formula_mutant_applies_once_compiles_and_names_a_test_file_that_exists(name):
    """scripts/formula_mutants.py, guarded as the named mutants are: its edit occurs exactly once in today's code."""
    file, old, new, test = FORMULAS[name]
    text = (ROOT / file).read_text()
    assert text.count(old) == 1, f"{name}: its edit occurs {text.count(old)} times in {file}"
    compile(text.replace(old, new), file, "exec")
    assert (ROOT / test.partition("::")[0]).is_file()


def test_mutmuts_files_and_test_list_exist():
    """pyproject's [tool.mutmut]: each mutated file, each copied folder and each selected test (file or function)."""
    import tomllib

    mutmut = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    for path in mutmut["only_mutate"] + mutmut["also_copy"]:
        assert (ROOT / path).exists(), path
    for test in mutmut["pytest_add_cli_args_test_selection"]:
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), f"no test file {path}"
        if name:
            assert re.search(rf"^\s*(async )?def {re.escape(name.split('[')[0])}\(", (ROOT / path).read_text(), re.M), \
                f"no test {name} in {path}"
