"""Build the shipped SWE-style set: small Python repositories, each with a real bug, its fix, a test that fails
before the fix and tests that pass either way — written as SWE-bench rows with each repository as an archive of its
tree at the base commit (`data/swe/repos/`, both splits), then converted to tasks by `polar_lab.envs.swe`, as a
researcher converts SWE-Gym's rows. Two splits, no package in both:

- held out (`HELD_OUT`): `data/swe/rows.jsonl` → `data/tasks/swe_mini.jsonl`, the set tests and notebooks score;
  its entries are frozen (any change alters its rows and archives).
- train (`TRAIN`): `data/swe/rows_train.jsonl` → `data/tasks/swe_train.jsonl`.

    python scripts/build_swe_tasks.py

Every instance is checked as the grader sees it (`repo_tests`): the gold patch passes all its tests, the base commit
fails FAIL_TO_PASS and passes PASS_TO_PASS; an instance that does not is named and the build exits 1.
Deterministic: fixed commit dates and author, so the base commits (and the rows) are the same on every run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "data" / "swe"
TASKS = ROOT / "data" / "tasks"
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


HELD_OUT = [
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

TRAIN = [
    Bug("bucketing", "histogram", "bucket(-1, 10) returns 0; values below 0 belong to the bucket below: -1.",
        "def bucket(x, width):\n    return int(x / width)\n", "int(x / width)", "x // width",
        "def test_positive():\n    assert bucket(25, 10) == 2\n",
        "def test_negative():\n    assert bucket(-1, 10) == -1\n"),
    Bug("gridmath", "manhattan", "manhattan((0, 0), (3, 4)) returns -7; a distance is never negative: it should be 7.",
        "def manhattan(a, b):\n    return sum(x - y for x, y in zip(a, b))\n", "x - y for", "abs(x - y) for",
        "def test_same_point():\n    assert manhattan((1, 1), (1, 1)) == 0\n",
        "def test_distance():\n    assert manhattan((0, 0), (3, 4)) == 7\n    assert manhattan((3, 0), (0, 4)) == 7\n"),
    Bug("pager", "pages", "page_count(11, 5) returns 2; a partly filled last page is still a page, so it should be 3.",
        "def page_count(items, per_page):\n    return items // per_page\n", "items // per_page",
        "-(-items // per_page)",
        "def test_full_pages():\n    assert page_count(10, 5) == 2\n",
        "def test_partial_page():\n    assert page_count(11, 5) == 3\n    assert page_count(0, 5) == 0\n"),
    Bug("snippets", "truncate", "truncate('abcdefgh', 5) returns 'abcde...', 8 characters; the result, '...' included, "
        "must be at most 5 characters: 'ab...'.",
        "def truncate(s, n):\n    if len(s) <= n:\n        return s\n    return s[:n] + '...'\n",
        "s[:n] + '...'", "s[:n - 3] + '...'",
        "def test_short():\n    assert truncate('abc', 5) == 'abc'\n",
        "def test_long():\n    assert truncate('abcdefgh', 5) == 'ab...'\n"),
    Bug("moneyfmt", "cents", "to_cents(0.29) returns 28; it should return 29.",
        "def to_cents(amount):\n    return int(amount * 100)\n", "int(amount * 100)", "round(amount * 100)",
        "def test_whole_cents():\n    assert to_cents(1.5) == 150\n",
        "def test_float_error():\n    assert to_cents(0.29) == 29\n"),
    Bug("scoring", "grades", "grade(90) returns 'B'; a score of 90 or more is an 'A'.",
        "def grade(score):\n    if score > 90:\n        return 'A'\n    if score >= 80:\n        return 'B'\n"
        "    return 'C'\n", "score > 90", "score >= 90",
        "def test_grades():\n    assert [grade(s) for s in (95, 85, 80, 50)] == ['A', 'B', 'B', 'C']\n",
        "def test_ninety():\n    assert grade(90) == 'A'\n"),
    Bug("stacks", "stack", "After push(1) and push(2), Stack.pop() returns 1; a stack pops the last item pushed: 2.",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
        "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop(0)\n",
        "self.items.pop(0)", "self.items.pop()",
        "def test_one_item():\n    s = Stack()\n    s.push(1)\n    assert s.pop() == 1\n",
        "def test_last_in_first_out():\n    s = Stack()\n    s.push(1)\n    s.push(2)\n    assert s.pop() == 2\n"),
    Bug("ringbuf", "ring", "Ring(2) after add(1), add(2), add(3) holds [1, 2]; a full ring drops its oldest item and "
        "should hold [2, 3].",
        "class Ring:\n    def __init__(self, size):\n        self.size = size\n        self.items = []\n\n"
        "    def add(self, x):\n        self.items.append(x)\n        if len(self.items) > self.size:\n"
        "            self.items.pop()\n", "self.items.pop()", "self.items.pop(0)",
        "def test_not_full():\n    r = Ring(3)\n    r.add(1)\n    r.add(2)\n    assert r.items == [1, 2]\n",
        "def test_full():\n    r = Ring(2)\n    for x in (1, 2, 3):\n        r.add(x)\n    assert r.items == [2, 3]\n"),
    Bug("vectorops", "dot", "dot([1, 2], [3, 4]) returns 21; the dot product is 1*3 + 2*4 = 11.",
        "def dot(a, b):\n    return sum(x * y for x in a for y in b)\n", "for x in a for y in b",
        "for x, y in zip(a, b)",
        "def test_single():\n    assert dot([2], [3]) == 6\n",
        "def test_pairs():\n    assert dot([1, 2], [3, 4]) == 11\n"),
    Bug("circles", "area", "circle_area(3) returns 18.85; the area of a circle of radius 3 is about 28.27.",
        "import math\n\n\ndef circle_area(r):\n    return math.pi * r * 2\n", "r * 2", "r ** 2",
        "def test_radius_two():\n    assert round(circle_area(2), 2) == 12.57\n",
        "def test_radius_three():\n    assert round(circle_area(3), 2) == 28.27\n"),
    Bug("timefmt", "duration", "hms(3600) returns '10:00:00'; one hour should be '1:00:00'.",
        "def hms(seconds):\n    h, rest = divmod(seconds, 360)\n    m, s = divmod(rest, 60)\n"
        "    return f'{h}:{m:02}:{s:02}'\n", "divmod(seconds, 360)", "divmod(seconds, 3600)",
        "def test_under_an_hour():\n    assert hms(59) == '0:00:59'\n    assert hms(61) == '0:01:01'\n",
        "def test_hours():\n    assert hms(3600) == '1:00:00'\n    assert hms(3725) == '1:02:05'\n"),
    Bug("lengths", "inches", "inches_to_cm(10) returns 24.5; ten inches are 25.4 cm.",
        "INCH_CM = 2.45\n\n\ndef inches_to_cm(x):\n    return x * INCH_CM\n\n\ndef cm_to_inches(x):\n"
        "    return x / INCH_CM\n", "2.45", "2.54",
        "def test_round_trip():\n    assert round(cm_to_inches(inches_to_cm(3)), 9) == 3\n",
        "def test_ten_inches():\n    assert round(inches_to_cm(10), 6) == 25.4\n"),
    Bug("casing", "camel", "camel('user_id') returns 'UserId'; the first word keeps its case: 'userId'.",
        "def camel(name):\n    first, *rest = name.split('_')\n"
        "    return first.title() + ''.join(w.title() for w in rest)\n",
        "first.title() +", "first +",
        "def test_capitalised_first_word():\n    assert camel('Http_code') == 'HttpCode'\n",
        "def test_lower_first_word():\n    assert camel('user_id') == 'userId'\n"),
    Bug("slugs", "slug", "slugify('Hello, World!') returns 'hello_world'; slugs join words with hyphens: "
        "'hello-world'.",
        "def slugify(title):\n    words = ''.join(c if c.isalnum() else ' ' for c in title.lower()).split()\n"
        "    return '_'.join(words)\n", "'_'.join", "'-'.join",
        "def test_one_word():\n    assert slugify('Hello') == 'hello'\n",
        "def test_two_words():\n    assert slugify('Hello, World!') == 'hello-world'\n"),
    Bug("binsearch", "search", "find([1, 3, 5], 5) returns -1, though 5 is at index 2; a one-item list [7] does not "
        "find 7 either.",
        "def find(xs, target):\n    lo, hi = 0, len(xs) - 1\n    while lo < hi:\n        mid = (lo + hi) // 2\n"
        "        if xs[mid] == target:\n            return mid\n        if xs[mid] < target:\n"
        "            lo = mid + 1\n        else:\n            hi = mid - 1\n    return -1\n",
        "while lo < hi:", "while lo <= hi:",
        "def test_middle_and_missing():\n    assert find([1, 3, 5], 3) == 1\n    assert find([1, 3, 5], 4) == -1\n",
        "def test_last_item():\n    assert find([1, 3, 5], 5) == 2\n    assert find([7], 7) == 0\n"),
    Bug("matrixlite", "transpose", "transpose([[1, 2], [3, 4]]) returns [[[1, 2]], [[3, 4]]]; it should return "
        "[[1, 3], [2, 4]].", "def transpose(m):\n    return [list(row) for row in zip(m)]\n", "zip(m)", "zip(*m)",
        "def test_empty():\n    assert transpose([]) == []\n",
        "def test_square():\n    assert transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]\n"),
    Bug("tally", "common", "most_common(['a', 'b', 'b']) returns 'a'; it should return the most frequent item, 'b'.",
        "def most_common(xs):\n    counts = {}\n    for x in xs:\n        counts[x] = counts.get(x, 0) + 1\n"
        "    return min(counts, key=counts.get)\n", "min(counts", "max(counts",
        "def test_single():\n    assert most_common(['a']) == 'a'\n",
        "def test_majority():\n    assert most_common(['a', 'b', 'b']) == 'b'\n"),
    Bug("intervals", "overlap", "overlaps((0, 5), (3, 8)) is False, but both intervals hold 3 to 5.",
        "def overlaps(a, b):\n    return a[0] < b[1] and b[0] < a[0]\n", "b[0] < a[0]", "b[0] < a[1]",
        "def test_apart_and_reversed():\n    assert not overlaps((0, 2), (5, 8))\n"
        "    assert overlaps((3, 8), (0, 5))\n",
        "def test_overlap():\n    assert overlaps((0, 5), (3, 8))\n"),
    Bug("numerals", "roman", "to_roman(4) returns 'VI'; 4 is 'IV' (and 14 is 'XIV').",
        "VALUES = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'),\n"
        "          (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'VI'), (1, 'I')]\n\n\n"
        "def to_roman(n):\n    out = ''\n    for value, letters in VALUES:\n        while n >= value:\n"
        "            out += letters\n            n -= value\n    return out\n", "(4, 'VI')", "(4, 'IV')",
        "def test_year():\n    assert to_roman(1987) == 'MCMLXXXVII'\n",
        "def test_four():\n    assert to_roman(4) == 'IV'\n    assert to_roman(14) == 'XIV'\n"),
    Bug("checksum", "luhn", "luhn_ok(79927398713) is False, but it is a valid Luhn number: every second digit from "
        "the right, starting with the second, is doubled.",
        "def luhn_ok(number):\n    digits = [int(d) for d in str(number)][::-1]\n    total = 0\n"
        "    for i, d in enumerate(digits):\n        if i % 2 == 0:\n            d *= 2\n            if d > 9:\n"
        "                d -= 9\n        total += d\n    return total % 10 == 0\n", "i % 2 == 0", "i % 2 == 1",
        "def test_zero():\n    assert luhn_ok(0)\n",
        "def test_valid_number():\n    assert luhn_ok(79927398713)\n    assert not luhn_ok(79927398710)\n"),
    Bug("ciphers", "caesar", "shift('xyz', 3) returns 'bcd'; letters wrap around after 'z': it should be 'abc'.",
        "def shift(text, k):\n    out = ''\n    for c in text:\n        if c.isalpha():\n"
        "            out += chr((ord(c) - ord('a') + k) % 25 + ord('a'))\n        else:\n            out += c\n"
        "    return out\n", "% 25", "% 26",
        "def test_no_wrap():\n    assert shift('abc', 1) == 'bcd'\n    assert shift('a b', 0) == 'a b'\n",
        "def test_wrap():\n    assert shift('xyz', 3) == 'abc'\n"),
    Bug("smoothing", "moving", "moving_average([1, 2, 3, 4], 2) returns [1.5, 2.5]; the last window is missing: "
        "[1.5, 2.5, 3.5].",
        "def moving_average(xs, k):\n    return [sum(xs[i:i + k]) / k for i in range(len(xs) - k)]\n",
        "range(len(xs) - k)", "range(len(xs) - k + 1)",
        "def test_too_short():\n    assert moving_average([1], 2) == []\n",
        "def test_windows():\n    assert moving_average([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]\n"),
    Bug("hexcolor", "rgb", "to_hex(255, 0, 128) returns '#ff8000'; it should be '#ff0080'.",
        "def to_hex(r, g, b):\n    return '#{:02x}{:02x}{:02x}'.format(r, b, g)\n", "format(r, b, g)",
        "format(r, g, b)",
        "def test_grey_and_black():\n    assert to_hex(0, 0, 0) == '#000000'\n"
        "    assert to_hex(16, 32, 32) == '#102020'\n",
        "def test_colour():\n    assert to_hex(255, 0, 128) == '#ff0080'\n"),
    Bug("exponents", "ipow", "power(2, 3) returns 0; it should return 8 (and power(5, 0) should be 1).",
        "def power(base, exp):\n    result = 0\n    for _ in range(exp):\n        result *= base\n    return result\n",
        "result = 0", "result = 1",
        "def test_zero_base():\n    assert power(0, 3) == 0\n",
        "def test_powers():\n    assert power(2, 3) == 8\n    assert power(5, 0) == 1\n"),
    Bug("combinatorics", "choose", "choose(5, 2) returns 3; there are 10 ways to pick 2 of 5.",
        "from math import factorial\n\n\ndef choose(n, k):\n    if k > n:\n        return 0\n"
        "    return factorial(n) // (factorial(k) * factorial(k))\n",
        "factorial(k) * factorial(k)", "factorial(k) * factorial(n - k)",
        "def test_small():\n    assert choose(2, 1) == 2\n    assert choose(2, 3) == 0\n",
        "def test_five_choose_two():\n    assert choose(5, 2) == 10\n"),
    Bug("primality", "primes", "is_prime(9) and is_prime(25) return True; squares of primes are not prime.",
        "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5)):\n"
        "        if n % d == 0:\n            return False\n    return True\n",
        "int(n ** 0.5))", "int(n ** 0.5) + 1)",
        "def test_small_numbers():\n    assert is_prime(7) and not is_prime(1) and not is_prime(12)\n",
        "def test_squares():\n    assert not is_prime(9)\n    assert not is_prime(25)\n"),
    Bug("divisors", "gcd", "gcd(12, 18) returns 18; the greatest common divisor of 12 and 18 is 6.",
        "def gcd(a, b):\n    while b:\n        a, b = b, a // b\n    return a\n", "a // b", "a % b",
        "def test_trivial():\n    assert gcd(7, 0) == 7\n    assert gcd(5, 5) == 5\n",
        "def test_common_divisor():\n    assert gcd(12, 18) == 6\n"),
    Bug("backoff", "delays", "delays(1, 3, 100) returns [2, 4]; there is one delay per attempt and the first is the "
        "base: [1, 2, 4].", "def delays(base, attempts, cap):\n    return [min(base * 2 ** i, cap) for i in "
        "range(1, attempts)]\n", "range(1, attempts)", "range(attempts)",
        "def test_no_attempts():\n    assert delays(1, 0, 10) == []\n",
        "def test_three_attempts():\n    assert delays(1, 3, 100) == [1, 2, 4]\n"
        "    assert delays(3, 3, 5) == [3, 5, 5]\n"),
    Bug("inventory", "stock", "restock_needed({'a': 1, 'b': 9}, 5) returns ['b']; the items below the threshold need "
        "restocking: ['a'].",
        "def restock_needed(stock, threshold):\n    return [item for item, qty in stock.items() if qty > threshold]\n",
        "qty > threshold", "qty < threshold",
        "def test_at_threshold():\n    assert restock_needed({'a': 5}, 5) == []\n",
        "def test_low_stock():\n    assert restock_needed({'a': 1, 'b': 9}, 5) == ['a']\n"),
    Bug("bankacct", "account", "Account(10).withdraw(3) leaves the balance at 13; it should be 7.",
        "class Account:\n    def __init__(self, balance=0):\n        self.balance = balance\n\n"
        "    def withdraw(self, amount):\n        if amount > self.balance:\n"
        "            raise ValueError('insufficient funds')\n        self.balance += amount\n",
        "self.balance += amount", "self.balance -= amount",
        "def test_overdraw_refused():\n    import pytest\n    with pytest.raises(ValueError):\n"
        "        Account(10).withdraw(20)\n",
        "def test_withdraw():\n    a = Account(10)\n    a.withdraw(3)\n    assert a.balance == 7\n"),
    Bug("stopwatch", "laps", "lap_times([0, 5, 12]) returns [12]; it should return the time of each lap: [5, 7].",
        "def lap_times(marks):\n    return [b - a for a, b in zip(marks, marks[2:])]\n", "marks[2:]", "marks[1:]",
        "def test_one_mark():\n    assert lap_times([3]) == []\n",
        "def test_laps():\n    assert lap_times([0, 5, 12]) == [5, 7]\n"),
    Bug("csvlite", "row", "parse_row('a,b,c') returns ['a', 'b,c']; every comma separates a field: ['a', 'b', 'c'].",
        "def parse_row(line, sep=','):\n    return [field.strip() for field in line.split(sep, 1)]\n",
        "line.split(sep, 1)", "line.split(sep)",
        "def test_two_fields():\n    assert parse_row(' a , b ') == ['a', 'b']\n",
        "def test_three_fields():\n    assert parse_row('a,b,c') == ['a', 'b', 'c']\n"),
    Bug("urlkit", "query", "parse_query('a=1&b=2') returns {'1': 'a', '2': 'b'}; it should be {'a': '1', 'b': '2'}.",
        "def parse_query(qs):\n    pairs = [p.split('=', 1) for p in qs.split('&') if p]\n"
        "    return {v: k for k, v in pairs}\n", "{v: k for", "{k: v for",
        "def test_empty():\n    assert parse_query('') == {}\n",
        "def test_pairs():\n    assert parse_query('a=1&b=2') == {'a': '1', 'b': '2'}\n"),
    Bug("versions", "compare", "newer('1.10.0', '1.9.0') is False; version 1.10.0 comes after 1.9.0.",
        "def newer(a, b):\n    return a.split('.') > b.split('.')\n", "a.split('.') > b.split('.')",
        "[int(x) for x in a.split('.')] > [int(x) for x in b.split('.')]",
        "def test_major():\n    assert newer('2.0.0', '1.0.0')\n    assert not newer('1.0.0', '1.0.0')\n",
        "def test_two_digit_minor():\n    assert newer('1.10.0', '1.9.0')\n"),
    Bug("lexer", "tokens", "tokens('12+3') returns ['12', '+']; the last number is missing: ['12', '+', '3'].",
        "def tokens(expr):\n    out, num = [], ''\n    for c in expr:\n        if c.isdigit():\n            num += c\n"
        "        else:\n            if num:\n                out.append(num)\n                num = ''\n"
        "            if c != ' ':\n                out.append(c)\n    return out\n",
        "    return out\n", "    return out + [num] if num else out\n",
        "def test_closed():\n    assert tokens('(1) ') == ['(', '1', ')']\n",
        "def test_trailing_number():\n    assert tokens('12+3') == ['12', '+', '3']\n"),
    Bug("bitcount", "popcount", "popcount(1) returns 0 and popcount(7) returns 2; they should be 1 and 3.",
        "def popcount(n):\n    count = 0\n    while n > 1:\n        count += n & 1\n        n >>= 1\n"
        "    return count\n",
        "while n > 1:", "while n:",
        "def test_zero():\n    assert popcount(0) == 0\n",
        "def test_ones():\n    assert popcount(1) == 1\n    assert popcount(7) == 3\n"),
    Bug("ranking", "top", "top_k([3, 9, 1, 7], 2) returns [1, 3]; it should return the two largest: [9, 7].",
        "def top_k(scores, k):\n    return sorted(scores, reverse=False)[:k]\n", "reverse=False", "reverse=True",
        "def test_trivial():\n    assert top_k([5], 1) == [5]\n    assert top_k([1, 2], 0) == []\n",
        "def test_largest():\n    assert top_k([3, 9, 1, 7], 2) == [9, 7]\n"),
    Bug("monthdays", "days", "days_in_month(1) returns 28; January has 31 days, and days_in_month(12) raises "
        "IndexError.", "DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]\n\n\n"
        "def days_in_month(month, leap=False):\n    if month == 2 and leap:\n        return 29\n"
        "    return DAYS[month]\n",
        "DAYS[month]", "DAYS[month - 1]",
        "def test_leap_february():\n    assert days_in_month(2, leap=True) == 29\n",
        "def test_months():\n    assert days_in_month(1) == 31\n    assert days_in_month(2) == 28\n"
        "    assert days_in_month(12) == 31\n"),
    Bug("healthcalc", "bmi", "bmi(80, 2.0) returns 80.0; the body mass index of 80 kg at 2 m is 20.0.",
        "def bmi(weight_kg, height_m):\n    return round(weight_kg / height_m * 2, 1)\n", "height_m * 2",
        "height_m ** 2",
        "def test_half_metre():\n    assert bmi(10, 0.5) == 40.0\n",
        "def test_two_metres():\n    assert bmi(80, 2.0) == 20.0\n"),
    Bug("discounts", "price", "apply_discount(200, 10) returns -1800.0; a 10 percent discount on 200 gives 180.0.",
        "def apply_discount(price, percent):\n    return round(price * (1 - percent), 2)\n",
        "(1 - percent)", "(1 - percent / 100)",
        "def test_no_discount():\n    assert apply_discount(50, 0) == 50\n",
        "def test_ten_percent():\n    assert apply_discount(200, 10) == 180.0\n"),
    Bug("scheduler", "slots", "free_slots([(2, 4)], 10) returns [(0, 2), (2, 10)]; 2 to 4 is busy, so it should "
        "return [(0, 2), (4, 10)].",
        "def free_slots(busy, day_end):\n    slots, t = [], 0\n    for start, end in sorted(busy):\n"
        "        if start > t:\n            slots.append((t, start))\n        t = max(t, start)\n"
        "    if t < day_end:\n        slots.append((t, day_end))\n    return slots\n",
        "max(t, start)", "max(t, end)",
        "def test_free_day():\n    assert free_slots([], 5) == [(0, 5)]\n",
        "def test_busy_hours():\n    assert free_slots([(2, 4)], 10) == [(0, 2), (4, 10)]\n"),
    Bug("pathbits", "ext", "extension('archive.tar.gz') returns 'tar'; it should return the text after the last "
        "dot: 'gz'.", "def extension(filename):\n    return filename.split('.')[1]\n", "split('.')[1]",
        "split('.')[-1]",
        "def test_one_dot():\n    assert extension('a.py') == 'py'\n",
        "def test_two_dots():\n    assert extension('archive.tar.gz') == 'gz'\n"),
    Bug("shipping", "cost", "shipping_cost(5) returns 10; parcels of 5 kg or more cost 20.",
        "def shipping_cost(weight_kg):\n    if weight_kg < 1:\n        return 5\n    if weight_kg <= 5:\n"
        "        return 10\n    return 20\n", "weight_kg <= 5", "weight_kg < 5",
        "def test_tiers():\n    assert [shipping_cost(w) for w in (0.5, 3, 9)] == [5, 10, 20]\n",
        "def test_five_kg():\n    assert shipping_cost(5) == 20\n"),
    Bug("anagrams", "anagram", "is_anagram('aab', 'abb') is True; each letter must appear as often in both words.",
        "def is_anagram(a, b):\n    return set(a) == set(b)\n", "set(a) == set(b)", "sorted(a) == sorted(b)",
        "def test_anagram():\n    assert is_anagram('listen', 'silent')\n    assert not is_anagram('abc', 'abd')\n",
        "def test_letter_counts():\n    assert not is_anagram('aab', 'abb')\n"),
    Bug("running", "cumsum", "cumulative([1, 2, 3]) returns [0, 1, 3]; each item should be the sum up to and "
        "including it: [1, 3, 6].",
        "def cumulative(xs):\n    out, total = [], 0\n    for x in xs:\n        out.append(total)\n"
        "        total += x\n    return out\n",
        "        out.append(total)\n        total += x\n", "        total += x\n        out.append(total)\n",
        "def test_zeros():\n    assert cumulative([]) == []\n    assert cumulative([0, 0]) == [0, 0]\n",
        "def test_sums():\n    assert cumulative([1, 2, 3]) == [1, 3, 6]\n"),
    Bug("normalize", "scale", "min_max([2, 4, 6]) returns [0.0, 0.25, 0.5]; the values should span 0 to 1: "
        "[0.0, 0.5, 1.0].", "def min_max(xs):\n    lo, hi = min(xs), max(xs)\n"
        "    return [(x - lo) / (hi + lo) for x in xs]\n", "(hi + lo)", "(hi - lo)",
        "def test_from_zero():\n    assert min_max([0, 5]) == [0, 1]\n",
        "def test_offset():\n    assert min_max([2, 4, 6]) == [0.0, 0.5, 1.0]\n"),
    Bug("wordwrap", "wrap", "wrap('ab cd', 5) returns ['ab', 'cd'], but 'ab cd' is 5 characters and fits on one line.",
        "def wrap(text, width):\n    lines, line = [], ''\n    for word in text.split():\n"
        "        if line and len(line) + 1 + len(word) >= width:\n            lines.append(line)\n"
        "            line = word\n        else:\n            line = f'{line} {word}' if line else word\n"
        "    if line:\n        lines.append(line)\n    return lines\n", ">= width", "> width",
        "def test_narrow():\n    assert wrap('aa bb cc', 4) == ['aa', 'bb', 'cc']\n",
        "def test_exact_fit():\n    assert wrap('ab cd', 5) == ['ab cd']\n"),
    Bug("dicttools", "invert", "invert({'a': 1, 'b': 1}) returns {1: ['b']}; every key with that value must be kept: "
        "{1: ['a', 'b']}.", "def invert(d):\n    out = {}\n    for k, v in d.items():\n        out[v] = [k]\n"
        "    return out\n", "out[v] = [k]", "out.setdefault(v, []).append(k)",
        "def test_distinct_values():\n    assert invert({'a': 1, 'b': 2}) == {1: ['a'], 2: ['b']}\n",
        "def test_shared_value():\n    assert invert({'a': 1, 'b': 1}) == {1: ['a', 'b']}\n"),
    Bug("geo2d", "points", "midpoint((0, 0), (4, 2)) returns (2.0, 2.0); it should return (2.0, 1.0).",
        "def midpoint(p, q):\n    return ((p[0] + q[0]) / 2, (p[1] + q[0]) / 2)\n", "(p[1] + q[0])", "(p[1] + q[1])",
        "def test_diagonal():\n    assert midpoint((1, 1), (3, 3)) == (2.0, 2.0)\n",
        "def test_off_diagonal():\n    assert midpoint((0, 0), (4, 2)) == (2.0, 1.0)\n"),
    Bug("runlength", "rle", "encode('aab') returns [('a', 1), ('b', 0)]; the counts are one short: [('a', 2), "
        "('b', 1)].", "def encode(s):\n    out = []\n    for c in s:\n        if out and out[-1][0] == c:\n"
        "            out[-1][1] += 1\n        else:\n            out.append([c, 0])\n"
        "    return [(c, n) for c, n in out]\n", "[c, 0]", "[c, 1]",
        "def test_empty():\n    assert encode('') == []\n",
        "def test_runs():\n    assert encode('aab') == [('a', 2), ('b', 1)]\n"),
    Bug("hamming", "distance", "hamming('abc', 'abd') returns 2; only one position differs, so it should be 1.",
        "def hamming(a, b):\n    if len(a) != len(b):\n        raise ValueError('lengths differ')\n"
        "    return sum(x == y for x, y in zip(a, b))\n", "x == y", "x != y",
        "def test_empty():\n    assert hamming('', '') == 0\n\n\n"
        "def test_lengths_differ():\n    import pytest\n    with pytest.raises(ValueError):\n"
        "        hamming('a', 'ab')\n",
        "def test_one_difference():\n    assert hamming('abc', 'abd') == 1\n"),
    Bug("rounding", "nearest", "round_to(17, 5) returns 17.0; it should round to the nearest multiple of 5: 15.",
        "def round_to(x, step):\n    return round(x * step) / step\n", "round(x * step) / step",
        "round(x / step) * step",
        "def test_step_one():\n    assert round_to(10, 1) == 10\n",
        "def test_step_five():\n    assert round_to(17, 5) == 15\n    assert round_to(18, 5) == 20\n"),
]


def git(repo: Path, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, input=stdin,
                          env={**os.environ, **GIT_ENV}, check=True)
    return done.stdout


def build(bug: Bug, repos: Path) -> dict:
    """The bug's repository (base commit, then the fix and the new test as diffs against it): its SWE-bench row;
    its tree at the base commit goes into `repos` as an archive."""
    assert bug.code.count(bug.old) == 1, bug.pkg
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


SPLITS = {"held out": (HELD_OUT, OUT / "rows.jsonl", TASKS / "swe_mini.jsonl"),
          "train": (TRAIN, OUT / "rows_train.jsonl", TASKS / "swe_train.jsonl")}


def check(tasks_path: Path) -> list[str]:
    """The instances of `tasks_path` that are not a bug and its fix, graded as a harness's edit is: the gold patch
    must pass all its tests; the base commit must fail FAIL_TO_PASS and pass PASS_TO_PASS."""
    from polar_lab.envs.swe import changes_of
    from polar_lab.rewards.code import repo_tests
    from polar_lab.tasks import load_tasks

    def faults(task: dict) -> list[str]:
        def score(test_ids: list[str], changes: dict) -> float:
            return repo_tests({**task, "test_ids": test_ids}, {"changes": changes})["total"]

        swe, gold = task["swe"], changes_of(task["files"], task["reference_patch"])
        return [f"{task['id']}: {fault}" for fault, found in (
            ("the gold patch fails its tests", score(task["test_ids"], gold) != 1.0),
            ("FAIL_TO_PASS passes at the base commit", score(swe["FAIL_TO_PASS"], {}) != 0.0),
            ("PASS_TO_PASS fails at the base commit", score(swe["PASS_TO_PASS"], {}) != 1.0)) if found]

    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:  # each score is a sandboxed pytest of its own
        return [fault for found in pool.map(faults, load_tasks(tasks_path)) for fault in found]


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from polar_lab.envs.swe import convert

    names = [bug.pkg for bugs, _, _ in SPLITS.values() for bug in bugs]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    repos = OUT / "repos"
    repos.mkdir(parents=True, exist_ok=True)
    for old in repos.glob("*.tar.gz"):
        old.unlink()
    faults = []
    for split, (bugs, rows_path, tasks_path) in SPLITS.items():
        rows = [build(bug, repos) for bug in bugs]
        rows_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        count = convert(rows_path, repos, tasks_path)
        faults += check(tasks_path)
        print(f"{split}: {len(rows)} SWE rows in {rows_path}, {count} tasks in {tasks_path}")
    if faults:
        print("not a bug and its fix:\n  " + "\n  ".join(faults), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
