"""Where a test run spent its time: per folder, per module, the slowest tests, and the engines each module started.

    .venv/bin/python -m pytest --junitxml=/tmp/run.xml ...        # POLAR_LAB_ENGINE_LOG=/tmp/engines.jsonl to keep it
    .venv/bin/python scripts/suite_report.py /tmp/run.xml [--engines /tmp/engines.jsonl] [--top 25] [--markdown]

Reads the JUnit XML pytest writes (each test's time: setup, call and teardown together) and, optionally, the engine
start log (tests/suite_report.py); prints the tables docs/testing.md shows. Module fixtures' time lands on the
module's first test, as pytest counts it.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.suite_report import module_of, read_starts  # noqa: E402


def read_junit(path: str) -> list[dict]:
    """One row per test case: module file, name, seconds, outcome."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            if case.find(kind) is not None:
                outcome = kind
        rows.append({"module": _module(case.get("classname", ""), case.get("file")), "name": case.get("name"),
                     "seconds": float(case.get("time", 0)), "outcome": outcome})
    return rows


def _module(classname: str, file: str | None) -> str:
    """pytest's classname 'tests.proxy.test_render' (or '...test_x.TestCls', 'notebooks.01_quickstart.ipynb') → path."""
    if file:
        return file
    if ".ipynb" in classname:
        return classname.split(".ipynb")[0].replace(".", "/", 1) + ".ipynb"
    parts = classname.split(".")
    while parts and parts[-1][:1].isupper():
        parts.pop()  # a test class
    return "/".join(parts) + ".py"


def folder_of(module: str) -> str:
    parts = module.split("/")
    return "/".join(parts[:2]) if parts[0] == "tests" and len(parts) > 2 else parts[0]


def table(rows: list[dict], starts: list[dict], top: int, markdown: bool) -> str:
    total = sum(r["seconds"] for r in rows)
    engines = Counter(module_of(s.get("test")) for s in starts)
    by_module: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_module[r["module"]].append(r)
    out = [f"{len(rows)} tests, {total / 60:.1f} min of test time "
           f"({Counter(r['outcome'] for r in rows)}); {len(starts)} engine starts "
           f"({sum(bool(s.get('forked')) for s in starts)} forked)"]
    folders: dict[str, float] = defaultdict(float)
    folder_engines: Counter = Counter()
    for module, mine in by_module.items():
        folders[folder_of(module)] += sum(r["seconds"] for r in mine)
        folder_engines[folder_of(module)] += engines.get(module, 0)
    out.append(_rows(["folder", "min", "engine starts"],
                     [[f, f"{s / 60:.1f}", folder_engines[f]] for f, s in sorted(folders.items(), key=lambda x: -x[1])],
                     markdown))
    modules = sorted(by_module.items(), key=lambda kv: -sum(r["seconds"] for r in kv[1]))
    out.append(_rows(["module", "tests", "s", "engine starts"],
                     [[m, len(mine), f"{sum(r['seconds'] for r in mine):.0f}", engines.get(m, 0)] for m, mine in modules],
                     markdown))
    slowest = sorted(rows, key=lambda r: -r["seconds"])[:top]
    out.append(_rows(["slowest tests", "s"], [[f"{r['module']}::{r['name']}", f"{r['seconds']:.1f}"] for r in slowest],
                     markdown))
    return "\n\n".join(out)


def _rows(header: list[str], rows: list[list], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in [header, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit")
    parser.add_argument("--engines", default=None, help="the engine start log (POLAR_LAB_ENGINE_LOG)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    starts = read_starts(args.engines) if args.engines else []
    print(table(read_junit(args.junit), starts, args.top, args.markdown))


if __name__ == "__main__":
    main()
