"""Build the shipped SWE-style set: small Python repositories, each with a real bug, its fix, a test that fails
before the fix and tests that pass either way — written as SWE-bench rows (`data/swe/rows.jsonl`) with each
repository as an archive of its tree at the base commit (`data/swe/repos/`), then converted to tasks
(`data/tasks/swe_mini.jsonl`, by `polar_lab.envs.swe`, as a researcher converts SWE-Gym's rows).

    python scripts/build_swe_tasks.py

Deterministic: fixed commit dates and author, so the base commits (and the rows) are the same on every run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "data" / "swe"
TASKS = ROOT / "data" / "tasks" / "swe_mini.jsonl"
OWNER = "polar-lab-swe"
GIT_ENV = {"GIT_AUTHOR_NAME": "polar_lab", "GIT_AUTHOR_EMAIL": "swe@polar-lab.invalid",
           "GIT_COMMITTER_NAME": "polar_lab", "GIT_COMMITTER_EMAIL": "swe@polar-lab.invalid",
           "GIT_AUTHOR_DATE": "2026-12-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-12-01T00:00:00Z"}


@dataclass(frozen=True)
class Bug:
    """One repository: `pkg/mod.py` as it is (`code`, with the bug), the fix (`old` → `new` in it), the tests it
    already has (pass with the bug and without: PASS_TO_PASS), the test the fix must make pass (FAIL_TO_PASS)."""

    pkg: str
    mod: str
    problem: str
    code: str
    old: str
    new: str
    tests: str  # test functions that pass before and after
    test: str  # the test function the fix makes pass


BUGS = [
    Bug("rangekit", "clamp", "clamp(5, 0, 3) returns 0; it should return 3. clamp(x, lo, hi) must keep x within "
        "[lo, hi].", "def clamp(x, lo, hi):\n    return min(lo, max(x, hi))\n",
        "min(lo, max(x, hi))", "max(lo, min(x, hi))",
        "def test_equal_bounds():\n    assert clamp(2, 2, 2) == 2\n",
        "def test_above_range():\n    assert clamp(5, 0, 3) == 3\n    assert clamp(-1, 0, 3) == 0\n"),
    Bug("calendar_tools", "leap", "is_leap(2000) is False, but 2000 was a leap year: years divisible by 400 are leap "
        "years.", "def is_leap(year):\n    return year % 4 == 0 and year % 100 != 0\n",
        "year % 100 != 0\n", "(year % 100 != 0 or year % 400 == 0)\n",
        "def test_ordinary():\n    assert is_leap(2024) and not is_leap(2023) and not is_leap(1900)\n",
        "def test_divisible_by_400():\n    assert is_leap(2000)\n"),
    Bug("statlite", "center", "median([1, 2, 3, 4]) returns 3; the median of an even-length list is the mean of the "
        "two middle values (2.5).", "def median(xs):\n    s = sorted(xs)\n    return s[len(s) // 2]\n",
        "    return s[len(s) // 2]\n",
        "    n = len(s)\n    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2\n",
        "def test_odd():\n    assert median([3, 1, 2]) == 2\n",
        "def test_even():\n    assert median([1, 2, 3, 4]) == 2.5\n"),
    Bug("listkit", "chunks", "chunk([1, 2, 3], 2) drops the last element; it should return [[1, 2], [3]].",
        "def chunk(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs) - n + 1, n)]\n",
        "range(0, len(xs) - n + 1, n)", "range(0, len(xs), n)",
        "def test_even_split():\n    assert chunk([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]\n",
        "def test_remainder():\n    assert chunk([1, 2, 3], 2) == [[1, 2], [3]]\n"),
    Bug("wordstat", "count", "word_count counts empty strings between repeated spaces: word_count('a  b') is 3, "
        "and word_count('') is 1. Both should count words only (2 and 0).",
        "def word_count(text):\n    return len(text.split(' '))\n", "text.split(' ')", "text.split()",
        "def test_simple():\n    assert word_count('one two three') == 3\n",
        "def test_spaces_and_empty():\n    assert word_count('a  b') == 2\n    assert word_count('') == 0\n"),
    Bug("thermo", "convert", "fahrenheit(100) gives 203.0 instead of 212.0: the offset is wrong.",
        "def fahrenheit(c):\n    return c * 9 / 5 + 23\n\n\ndef celsius(f):\n    return (f - 32) * 5 / 9\n",
        "+ 23", "+ 32", "def test_celsius():\n    assert celsius(212) == 100\n",
        "def test_fahrenheit():\n    assert fahrenheit(100) == 212\n    assert fahrenheit(0) == 32\n"),
    Bug("seqtools", "unique", "dedupe([3, 1, 3, 2]) returns the items in a different order; it must keep the order "
        "of first appearance: [3, 1, 2].", "def dedupe(xs):\n    return sorted(set(xs))\n",
        "    return sorted(set(xs))\n", "    seen = set()\n    return [x for x in xs if not (x in seen or seen.add(x))]\n",
        "def test_duplicates_removed():\n    assert dedupe([1, 1]) == [1]\n",
        "def test_order_kept():\n    assert dedupe([3, 1, 3, 2]) == [3, 1, 2]\n"),
    Bug("safemath", "divide", "safe_div(1, 0) raises ZeroDivisionError; it should return 0.0 when the divisor is 0.",
        "def safe_div(a, b):\n    return a / b\n", "return a / b", "return a / b if b else 0.0",
        "def test_divides():\n    assert safe_div(6, 3) == 2\n",
        "def test_zero_divisor():\n    assert safe_div(1, 0) == 0.0\n"),
    Bug("names", "initials", "initials('ada lovelace') returns 'al'; initials are upper case: 'AL'.",
        "def initials(name):\n    return ''.join(part[0] for part in name.split())\n",
        "part[0] for part", "part[0].upper() for part",
        "def test_capitalised():\n    assert initials('Grace Hopper') == 'GH'\n",
        "def test_lower_case_name():\n    assert initials('ada lovelace') == 'AL'\n"),
    Bug("games", "fizz", "fizzbuzz(15) returns 'Fizz'; multiples of both 3 and 5 are 'FizzBuzz'.",
        "def fizzbuzz(n):\n    if n % 3 == 0:\n        return 'Fizz'\n    if n % 15 == 0:\n        return 'FizzBuzz'\n"
        "    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)\n",
        "    if n % 3 == 0:\n        return 'Fizz'\n    if n % 15 == 0:\n        return 'FizzBuzz'\n",
        "    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:\n        return 'Fizz'\n",
        "def test_plain():\n    assert [fizzbuzz(n) for n in (1, 3, 5)] == ['1', 'Fizz', 'Buzz']\n",
        "def test_fifteen():\n    assert fizzbuzz(15) == 'FizzBuzz'\n"),
    Bug("flags", "parse", "parse_bool only accepts the exact string 'true': 'TRUE', ' yes ' and '1' should be true too.",
        "def parse_bool(s):\n    return s == 'true'\n", "return s == 'true'",
        "return s.strip().lower() in ('true', 'yes', '1')",
        "def test_true_and_false():\n    assert parse_bool('true') and not parse_bool('false')\n",
        "def test_other_spellings():\n    assert parse_bool('TRUE') and parse_bool(' yes ') and parse_bool('1')\n"),
    Bug("tail", "last", "last_n(xs, 0) returns the whole list; it should return an empty list.",
        "def last_n(xs, n):\n    return xs[-n:]\n", "return xs[-n:]", "return xs[len(xs) - n:] if n else []",
        "def test_last_two():\n    assert last_n([1, 2, 3], 2) == [2, 3]\n",
        "def test_none():\n    assert last_n([1, 2, 3], 0) == []\n"),
    Bug("motion", "speed", "average_speed(5, 2) returns 2; it should return 2.5 (no rounding down).",
        "def average_speed(distance, hours):\n    return distance // hours\n", "distance // hours", "distance / hours",
        "def test_whole():\n    assert average_speed(10, 2) == 5\n",
        "def test_fraction():\n    assert average_speed(5, 2) == 2.5\n"),
    Bug("padding", "pad", "pad_left('7', 3, '0') returns '700'; it should pad on the left: '007'.",
        "def pad_left(s, width, char=' '):\n    return s + char * (width - len(s))\n",
        "return s + char * (width - len(s))", "return char * (width - len(s)) + s",
        "def test_already_wide():\n    assert pad_left('abc', 3) == 'abc'\n",
        "def test_pads_left():\n    assert pad_left('7', 3, '0') == '007'\n"),
    Bug("phonetics", "vowels", "count_vowels('AEIOU') returns 0; upper-case vowels count too.",
        "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n", "for c in s)", "for c in s.lower())",
        "def test_lower():\n    assert count_vowels('banana') == 3\n",
        "def test_upper():\n    assert count_vowels('AEIOU') == 5\n"),
    Bug("mirror", "palindrome", "is_palindrome('Level') is False; the check should ignore case.",
        "def is_palindrome(s):\n    return s == s[::-1]\n", "    return s == s[::-1]\n",
        "    t = s.lower()\n    return t == t[::-1]\n",
        "def test_plain():\n    assert is_palindrome('abba') and not is_palindrome('abc')\n",
        "def test_case():\n    assert is_palindrome('Level')\n"),
    Bug("nesting", "flat", "flatten([[1, 2], [3]]) returns [1, 3]; it should return every item: [1, 2, 3].",
        "def flatten(xss):\n    return [xs[0] for xs in xss]\n", "[xs[0] for xs in xss]", "[x for xs in xss for x in xs]",
        "def test_singletons():\n    assert flatten([[1], [2]]) == [1, 2]\n",
        "def test_longer_lists():\n    assert flatten([[1, 2], [3]]) == [1, 2, 3]\n"),
    Bug("ratios", "percent", "percent(1, 3) returns 33; it should keep one decimal: 33.3.",
        "def percent(part, whole):\n    return round(part / whole * 100)\n", "round(part / whole * 100)",
        "round(part / whole * 100, 1)", "def test_half():\n    assert percent(1, 2) == 50\n",
        "def test_one_decimal():\n    assert percent(1, 3) == 33.3\n"),
    Bug("settings", "merge", "merge(defaults, overrides) keeps the defaults where both set a key; the overrides must "
        "win.", "def merge(defaults, overrides):\n    return {**overrides, **defaults}\n",
        "{**overrides, **defaults}", "{**defaults, **overrides}",
        "def test_disjoint():\n    assert merge({'a': 1}, {'b': 2}) == {'a': 1, 'b': 2}\n",
        "def test_overrides_win():\n    assert merge({'a': 1}, {'a': 2}) == {'a': 2}\n"),
    Bug("sequences", "fib", "fib(10) returns 34; fib(n) is the n-th Fibonacci number with fib(0) = 0, fib(1) = 1, "
        "so fib(10) = 55.", "def fib(n):\n    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n"
        "    return a\n", "range(n - 1)", "range(n)",
        "def test_zero():\n    assert fib(0) == 0\n",
        "def test_ten():\n    assert fib(1) == 1\n    assert fib(10) == 55\n"),
    Bug("sourcetools", "comments", "strip_comment('x = 1  # one') returns 'x = 1  ' with trailing spaces; it should "
        "return 'x = 1'.", "def strip_comment(line):\n    return line.split('#')[0]\n", "line.split('#')[0]",
        "line.split('#')[0].rstrip()", "def test_no_comment():\n    assert strip_comment('x = 1') == 'x = 1'\n",
        "def test_trailing_spaces():\n    assert strip_comment('x = 1  # one') == 'x = 1'\n"),
]


def git(repo: Path, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, input=stdin,
                          env={**os.environ, **GIT_ENV}, check=True)
    return done.stdout


def build(bug: Bug, repos: Path) -> dict:
    """The bug's repository (base commit, then the fix and the new test as diffs against it): its SWE-bench row;
    its tree at the base commit goes into `repos` as an archive."""
    assert bug.old in bug.code, bug.pkg
    test_path = f"tests/test_{bug.mod}.py"
    header = f"from {bug.pkg}.{bug.mod} import *  # noqa: F401,F403\n\n\n"
    with tempfile.TemporaryDirectory(prefix="polar-swe-build-") as where:
        repo = Path(where)
        git(repo, "init", "-q", "-b", "main")
        for path, text in {f"{bug.pkg}/__init__.py": "", f"{bug.pkg}/{bug.mod}.py": bug.code, "tests/__init__.py": "",
                           test_path: header + bug.tests, "README.md": f"# {bug.pkg}\n"}.items():
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_text(text)
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", f"{bug.pkg}: {bug.mod}")
        base = git(repo, "rev-parse", "HEAD").strip()
        (repo / f"{bug.pkg}/{bug.mod}.py").write_text(bug.code.replace(bug.old, bug.new, 1))
        patch = git(repo, "diff")
        git(repo, "checkout", "-q", "--", ".")
        (repo / test_path).write_text(header + bug.tests + "\n\n" + bug.test)
        test_patch = git(repo, "diff")
        name = f"{OWNER}__{bug.pkg}"
        archive = repos / f"{name}-{base}.tar.gz"
        subprocess.run(["git", "-C", str(repo), "-c", "tar.tar.gz.command=gzip -cn", "archive", "--format=tar.gz",
                        "-o", str(archive), base], check=True, env={**os.environ, **GIT_ENV})
    def node(source: str) -> str:  # a test function's pytest node id
        return f"{test_path}::{source.split('(')[0].removeprefix('def ')}"

    tests = [node(block) for block in bug.tests.split("\n\n\n") if block.strip()]
    return {"instance_id": f"{OWNER}__{bug.pkg}-1", "repo": f"{OWNER}/{bug.pkg}", "base_commit": base,
            "problem_statement": bug.problem, "patch": patch, "test_patch": test_patch,
            "FAIL_TO_PASS": json.dumps([node(bug.test)]), "PASS_TO_PASS": json.dumps(tests), "version": "1.0",
            "created_at": "2026-12-01T00:00:00Z", "hints_text": "", "environment_setup_commit": base}


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from polar_lab.envs.swe import convert

    repos = OUT / "repos"
    repos.mkdir(parents=True, exist_ok=True)
    for old in repos.glob("*.tar.gz"):
        old.unlink()
    rows = [build(bug, repos) for bug in BUGS]
    (OUT / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    count = convert(OUT / "rows.jsonl", repos, TASKS)
    print(f"{len(rows)} SWE rows in {OUT / 'rows.jsonl'}, {count} tasks in {TASKS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
