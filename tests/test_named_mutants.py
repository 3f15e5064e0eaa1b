"""scripts/named_mutants.py stays runnable: each hand-written mutant's edits apply to today's code exactly once, the
mutated file still compiles, and each test it names exists. Nothing else runs the script between mutation passes,
and a refactor under a mutant made it stale unseen: on 2026-12-06, 15 of its 77 mutants no longer matched the code,
and the script refused to run any of them."""

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
