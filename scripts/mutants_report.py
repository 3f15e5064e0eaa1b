"""Summarise a `mutmut run` (make mutants): the kill rate per module and the surviving mutants.

Reads mutmut's own result files (mutants/<module>.py.meta). Run from the repository root after
`mutmut run`; `mutmut show <name>` prints the diff of any mutant listed here.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.configuration import config
from mutmut.stats import status_by_exit_code

# A mutant counts as killed only when a test failed on it (pytest's exit code 1: an assertion, or an error raised while
# the tests ran the mutated code) or the type check caught it. A timeout, a crash, an interrupted or unusable run
# (pytest's exit codes 2-4: a collection error, an internal error, a test id that does not exist) are counted apart as
# "unclear" and listed: they say the run went wrong, not that a test noticed the change. "no tests" means no selected
# test ever ran the mutated function (a gap in coverage, listed with the survivors).
KILLED = {"killed", "caught by type check"}
KNOWN = {"killed", "survived", "no tests", "not checked"}


def main(root: Path = Path("mutants")) -> int:
    # only the modules pyproject.toml still lists (a module dropped from the list may have old results)
    metas = sorted(m for m in root.rglob("*.py.meta") if config().should_mutate(str(m.relative_to(root))[:-5]))
    if not metas:
        print("no mutmut results under mutants/; run `make mutants` first", file=sys.stderr)
        return 2
    total = Counter()
    survivors: list[str] = []
    print(f"{'module':42} {'mutants':>7} {'killed':>7} {'survived':>8} {'no tests':>8} {'unclear':>7} "
          f"{'kill rate':>9}")
    unclear: list[str] = []
    for meta in metas:
        module = str(meta.relative_to(root)).removesuffix(".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        statuses = {key: status_by_exit_code[code] for key, code in codes.items()}
        if any(code == 3 for code in codes.values()):  # mutmut reads pytest's internal error as killed; it is not
            statuses.update({key: "internal error" for key, code in codes.items() if code == 3})
        statuses = {key: "killed" if s in KILLED else s if s in KNOWN else "unclear: " + s
                    for key, s in statuses.items()}
        counts = Counter("unclear" if s.startswith("unclear") else s for s in statuses.values())
        unclear += sorted(f"{k} ({s[9:]})" for k, s in statuses.items() if s.startswith("unclear"))
        survivors += sorted(k for k, s in statuses.items() if s in ("survived", "no tests"))
        total.update(counts)
        n = sum(counts.values())
        print(f"{module:42} {n:7} {counts['killed']:7} {counts['survived']:8} {counts['no tests']:8} "
              f"{counts['unclear']:7} {counts['killed'] / max(n, 1):9.1%}")
    n = sum(total.values())
    print(f"{'all':42} {n:7} {total['killed']:7} {total['survived']:8} {total['no tests']:8} "
          f"{total['unclear']:7} {total['killed'] / max(n, 1):9.1%}")
    if total["not checked"]:
        print(f"{total['not checked']} mutants not checked (an interrupted run?)")
    print("\nsurviving (survived / no tests):")
    for name in survivors:
        print(" ", name)
    if unclear:
        print("\nunclear (timed out, crashed or the run could not run its tests; not counted as killed):")
        for name in unclear:
            print(" ", name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
