"""The `polar-lab` command line: `polar-lab demo` (the README's first command)."""

from __future__ import annotations

import argparse
import sys

from polar_lab.config import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="polar-lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run concurrent calculator sessions through a fresh Lab and summarise")
    demo.add_argument("--model", default=DEFAULT_MODEL, help="model folder (default: %(default)s)")
    demo.add_argument("--sessions", type=int, default=32, help="concurrent sessions (default: %(default)s)")
    demo.add_argument("--tasks", default="data/tasks/calc_test.jsonl", help="task file (JSON lines)")
    demo.add_argument("--run-name", default=None, help="run folder name under data/runs/")
    demo.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args(argv)

    if args.command == "demo":
        from polar_lab.demo import format_summary, run_demo

        summary = run_demo(args.model, sessions=args.sessions, tasks_path=args.tasks,
                           run_name=args.run_name, temperature=args.temperature)
        print(format_summary(summary))
        return 0 if summary["failed_sessions"] == 0 else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
