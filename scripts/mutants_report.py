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

# A mutant counts as killed when a test failed, timed out or crashed on it; "no tests" means no selected
# test ever ran the mutated function (a gap in coverage, listed with the survivors).
KILLED = {"killed", "timeout", "segfault", "caught by type check"}


def main(root: Path = Path("mutants")) -> int:
    # only the modules pyproject.toml still lists (a module dropped from the list may have old results)
    metas = sorted(m for m in root.rglob("*.py.meta") if config().should_mutate(str(m.relative_to(root))[:-5]))
    if not metas:
        print("no mutmut results under mutants/; run `make mutants` first", file=sys.stderr)
        return 2
    total = Counter()
    survivors: list[str] = []
    print(f"{'module':42} {'mutants':>7} {'killed':>7} {'survived':>8} {'no tests':>8} {'kill rate':>9}")
    for meta in metas:
        module = str(meta.relative_to(root)).removesuffix(".meta")
        statuses = {key: status_by_exit_code[code] for key, code in
                    json.loads(meta.read_text())["exit_code_by_key"].items()}
        counts = Counter("killed" if s in KILLED else s for s in statuses.values())
        survivors += sorted(k for k, s in statuses.items() if s in ("survived", "no tests", "suspicious"))
        total.update(counts)
        n = sum(counts.values())
        print(f"{module:42} {n:7} {counts['killed']:7} {counts['survived']:8} {counts['no tests']:8} "
              f"{counts['killed'] / max(n, 1):9.1%}")
    n = sum(total.values())
    print(f"{'all':42} {n:7} {total['killed']:7} {total['survived']:8} {total['no tests']:8} "
          f"{total['killed'] / max(n, 1):9.1%}")
    if total["not checked"]:
        print(f"{total['not checked']} mutants not checked (an interrupted run?)")
    print("\nsurviving (survived / no tests / suspicious):")
    for name in survivors:
        print(" ", name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
