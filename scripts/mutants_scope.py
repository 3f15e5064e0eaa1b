"""Keep the proxy modules' mutants to the proxy's own tests: drop `tests/grpo/` from the test lists mutmut recorded for
`polar_lab.proxy.history` and `polar_lab.proxy.render` (mutants/mutmut-stats.json).

Why: `tests/grpo/test_rollouts.py` reaches the renderer through a real Lab and proxy, so mutmut runs it for every
render and history mutant (~20 of the ~30 s a surviving mutant costs there), though it asserts nothing about rendering.
With it dropped a kill needs a proxy test, so the kill rate can only be lower than with it: a lower bound.

Run after a `mutmut run` has collected its stats (any run does, first), then `mutmut run <the proxy mutants>`; a
later run that finds new tests collects their stats again, so run this again after adding tests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

STATS = Path("mutants/mutmut-stats.json")
MODULES = ("polar_lab.proxy.history.", "polar_lab.proxy.render.")
DROPPED = "tests/grpo/"


def main() -> int:
    if not STATS.exists():
        print(f"no {STATS}: run `mutmut run` once first", file=sys.stderr)
        return 2
    stats = json.loads(STATS.read_text())
    dropped = 0
    for function, tests in stats["tests_by_mangled_function_name"].items():
        if function.startswith(MODULES):
            kept = [t for t in tests if not t.startswith(DROPPED)]
            dropped += len(tests) - len(kept)
            stats["tests_by_mangled_function_name"][function] = kept
    STATS.write_text(json.dumps(stats))
    print(f"dropped {dropped} test entries under {DROPPED} from the functions of {', '.join(MODULES)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
