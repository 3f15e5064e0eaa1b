"""The `polar-lab` command line: `polar-lab demo` (the README's first command), `polar-lab train CONFIG.yaml`,
`polar-lab forkserver`."""

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
    train = sub.add_parser("train", help="GRPO from a YAML config: evaluate, train, evaluate again")
    train.add_argument("config", help="YAML with engine/proxy/store/grpo sections (e.g. configs/tiny_calc_grpo.yaml)")
    train.add_argument("--max-steps", type=int, default=None, help="override grpo.max_steps")
    train.add_argument("--time-budget-s", type=float, default=None,
                       help="override grpo.time_budget_s: start no step that would end past this many seconds "
                            "(0: no limit)")
    train.add_argument("--eval-limit", type=int, default=None, help="override grpo.eval_limit")
    train.add_argument("--output-dir", default=None, help="override grpo.output_dir")
    train.add_argument("--async", dest="async_mode", action="store_true", default=None,
                       help="override grpo.async_mode to true")
    train.add_argument("--world-size", type=int, default=None, help="override grpo.world_size")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                       help="override any grpo setting, after the file and the other flags; VALUE read as YAML (e.g. "
                            "--set mask_truncated_completions=true; null lifts the file's); repeatable")
    train.add_argument("--replicas", type=int, default=None, help="override engine.replicas")
    train.add_argument("--ray-address", default=None,
                       help="run engine replicas and trainer ranks as actors on Ray: 'auto' or HOST:PORT joins a "
                            "running cluster, 'local' starts one on 127.0.0.1 for this run (docs/scale.md)")
    sub.add_parser("forkserver", help="keep torch and vLLM imported for the engines of every kernel started with the "
                                      "variable this prints (a restarted kernel's Lab is up in seconds); Ctrl-C ends it")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from polar_lab.demo import format_summary, run_demo

        summary = run_demo(args.model, sessions=args.sessions, tasks_path=args.tasks,
                           run_name=args.run_name, temperature=args.temperature)
        print(format_summary(summary))
        return 0 if summary["failed_sessions"] == 0 else 1
    if args.command == "train":
        from polar_lab.errors import ConfigError
        from polar_lab.grpo.run import (format_train_summary, load_train_config, on_cluster, parse_setting,
                                        train_from_config)

        try:  # a config error, the file's or a flag's, is a usage error: the message, no traceback
            settings = {"time_budget_s": None} if args.time_budget_s == 0 else {}  # 0 lifts the file's budget
            settings |= dict(parse_setting(text) for text in args.settings)
            lab_config, grpo_config = load_train_config(
                args.config, settings, max_steps=args.max_steps, time_budget_s=args.time_budget_s or None,
                eval_limit=args.eval_limit, output_dir=args.output_dir, async_mode=args.async_mode,
                world_size=args.world_size)
        except ConfigError as e:
            train.error(str(e))
        lab_config = on_cluster(lab_config, replicas=args.replicas, ray_address=args.ray_address)
        print(format_train_summary(train_from_config(lab_config, grpo_config)))
        return 0
    if args.command == "forkserver":
        from polar_lab.engine.forkserver import serve_until_interrupted

        return serve_until_interrupted()
    return 2


if __name__ == "__main__":
    sys.exit(main())
