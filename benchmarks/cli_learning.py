"""Learning behind an unmodified CLI: GRPO on the tiny-agent fixture behind Codex (or another preset) — held-out pass
rate before and after, the evaluations in between, and the time per step, per seed.

    python benchmarks/cli_learning.py [--config configs/tiny_agent_codex.yaml] [--seeds 0] [--steps 8]
        [--eval-every 2] [--eval-limit 60] [--tasks ...] [--eval-tasks ...] [--harness codex] [--lr 2e-4]
        [--set KEY=VALUE ...] [--budget-s 1200] [--merge RESULT.json] [--out benchmarks/results/cli_learning.json]

Each seed is `polar-lab train CONFIG` (polar_lab/grpo/run.py) from the shipped weights, in a Lab of its own, with
evaluations every `--eval-every` steps on the same held-out tasks and sampling seed. With `--budget-s` (not the config's
`time_budget_s`), training stops before `--steps` when the next step (and its evaluation) would end past that many
seconds of training (`train_steps`, GRPOTrainer.train's loop); the held-out pass rate after is then measured once more
(outside the budget; its curve point carries the seconds of training behind the weights it measured). Prints the
curve and writes it, with wall times and calls and chains per session before and after, to `--out`
(benchmarks/result.py's shape). `--merge` keeps the runs of an earlier result file with the same settings and other seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from polar_lab.errors import ConfigError
from polar_lab.grpo.run import load_train_config, parse_setting

from result import save

DEFAULT_CONFIG = "configs/tiny_agent_codex.yaml"


def sessions_shape(groups) -> dict:
    """Calls and chains per session of an evaluation's groups (medians and means)."""
    sessions = [s for g in groups for s in g.sessions]
    chains = {s.id: 0 for s in sessions}
    for g in groups:
        for t in g.trajectories:
            chains[t.session_id] = chains.get(t.session_id, 0) + 1
    return {"calls_p50": statistics.median(s.calls for s in sessions),
            "calls_mean": round(statistics.mean(s.calls for s in sessions), 3),
            "chains_mean": round(statistics.mean(chains.values()), 3),
            "failed": sum(s.status != "closed" for s in sessions)}


def learning_curve(before: dict, during: list[dict], after: dict, train_s: float) -> list[dict]:
    """Held-out pass rate by step, with the seconds of training behind each point: the evaluation before training
    (step 0), those during it (when each ended, on the clock from the first's end) and the one after the last step
    when none ended it (`train_s`: it measured the weights of the whole run)."""
    curve = [{"step": 0, "eval_reward": before["eval_reward"], "s": 0}]
    curve += [{"step": e["step"], "eval_reward": e["eval_reward"], "s": round(e["time"] - before["time"])}
              for e in during]
    if curve[-1]["step"] != after["step"]:
        curve.append({"step": after["step"], "eval_reward": after["eval_reward"], "s": round(train_s)})
    return curve


def seed_config(config_path: str, seed: int, args):
    """The Lab and GRPO configs of one seed's run: the file's, with the command line's overrides."""
    overrides = {"seed": seed, "max_steps": args.steps, "eval_limit": args.eval_limit, "eval_steps": args.eval_every}
    if args.tasks:
        overrides["tasks"] = args.tasks
    if args.eval_tasks:
        overrides["eval_tasks"] = args.eval_tasks
    if args.harness:
        overrides["harness"] = args.harness
    if args.lr:
        overrides["learning_rate"] = args.lr
    lab_config, config = load_train_config(config_path, args.grpo, **overrides)
    config = dataclasses.replace(config, time_budget_s=args.budget_s)  # --budget-s, not the config's: None is none
    lab_config = dataclasses.replace(lab_config, store=dataclasses.replace(
        lab_config.store, run_name=time.strftime(f"bench-cli-learning-s{seed}-%Y%m%d-%H%M%S")))
    return lab_config, config


def run_seed(config_path: str, seed: int, args) -> dict:
    from polar_lab import GRPOTrainer, Lab
    from polar_lab.grpo.trainer import train_steps

    lab_config, config = seed_config(config_path, seed, args)
    t0 = time.perf_counter()
    with Lab(config=lab_config) as lab, GRPOTrainer(lab, config) as trainer:
        before = trainer.evaluate(progress=False)
        before_shape = sessions_shape(trainer.last_eval_groups)
        train_s = train_steps(trainer, args.steps, time_budget_s=config.time_budget_s, progress=False)
        trainer.save_checkpoint()  # the trained weights, as `polar-lab train` leaves them (GRPOTrainer.train)
        during, last = trainer.evaluations[1:], trainer.evaluations[-1]
        after = last if last["step"] == len(trainer.history) else trainer.evaluate(progress=False)  # once per step
        after_shape = sessions_shape(trainer.last_eval_groups)
        curve = learning_curve(before, during, after, train_s)
        metrics = trainer.metrics
        rewards = [round(float(r), 4) for r in metrics["reward_mean"]]
        step_s = [round(float(s), 1) for s in metrics["step_s"]]
    row = {"seed": seed, "before": before["eval_reward"], "after": after["eval_reward"],
           "gain": after["eval_reward"] - before["eval_reward"], "steps": len(rewards), "curve": curve,
           "train_rewards": rewards, "step_s": step_s, "train_s": round(train_s),
           "total_s": round(time.perf_counter() - t0), "before_sessions": before_shape, "after_sessions": after_shape,
           "eval_runs": after["eval_runs"]}
    print(json.dumps(row), flush=True)
    return row


def figures(rows: list[dict]) -> dict:
    """Per seed: held-out pass rate before and after, every evaluation, steps and seconds of training, the spread of
    step times, and the held-out sessions' shape before and after (calls and chains per session, failed runs)."""
    out = {}
    for r in rows:
        seed, before, after = r["seed"], r["before_sessions"], r["after_sessions"]
        out |= {f"held-out pass rate, seed {seed}: before → after": f"{r['before']:.3f} → {r['after']:.3f}",
                f"evaluations, seed {seed} (step: pass rate)": ", ".join(f"{c['step']}: {c['eval_reward']:.3f}"
                                                                          for c in r["curve"]),
                f"training, seed {seed}: steps, seconds": f"{r['steps']}, {r['train_s']}",
                f"step time, seed {seed} (s)": f"{min(r['step_s'])}–{max(r['step_s'])}",
                f"held-out sessions, seed {seed}, before → after":
                    f"calls {before['calls_p50']:g} / {before['calls_mean']:g} → {after['calls_p50']:g} / "
                    f"{after['calls_mean']:g} (median / mean), chains {before['chains_mean']:g} → "
                    f"{after['chains_mean']:g}, failed {before['failed']} → {after['failed']} of {r['eval_runs']}"}
    return out


def goal_note(rows: list[dict]) -> str:
    """The issue's goal, per seed: +0.25 held-out within 20 minutes of training (evaluations between steps included)."""
    def met(r: dict) -> str:
        return "met" if r["gain"] >= 0.25 and r["train_s"] <= 1200 else "missed"
    seeds = (f"seed {r['seed']} {met(r)}, {r['gain']:+.3f} in {r['steps']} steps, {r['train_s']} s" for r in rows)
    return "goal +0.25 within 20 min: " + "; ".join(seeds)


def setting(text: str) -> tuple[str, object]:
    """`--set KEY=VALUE` as `polar-lab train` reads it; its error as argparse shows a flag's."""
    try:
        return parse_setting(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--eval-limit", type=int, default=60)
    parser.add_argument("--tasks", default=None, help="override grpo.tasks")
    parser.add_argument("--eval-tasks", default=None, help="override grpo.eval_tasks")
    parser.add_argument("--harness", default=None, help="override grpo.harness")
    parser.add_argument("--lr", type=float, default=None, help="override grpo.learning_rate")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=setting,
                        help="override any other grpo setting (YAML value), e.g. --set overlong_buffer_len=192")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop training before the step that would end past this many seconds (default: no "
                             "limit, whatever the config's grpo.time_budget_s)")
    parser.add_argument("--merge", default=None, help="a result file of the same settings for other seeds: its runs "
                                                       "are kept")
    parser.add_argument("--out", default="benchmarks/results/cli_learning.json")
    args = parser.parse_args()
    settings = {"config": args.config, "steps": args.steps, "budget_s": args.budget_s, "eval_every": args.eval_every,
                "eval_limit": args.eval_limit, "lr": args.lr, "tasks": args.tasks, "eval_tasks": args.eval_tasks,
                "harness": args.harness}
    args.grpo = dict(args.set)
    # every GRPO setting the runs use (--set's among them), so that a seed merged later cannot run a config file that
    # has changed since
    grpo = {k: v for k, v in seed_config(args.config, 0, args)[1].to_dict().items() if k != "seed"}
    settings["grpo"] = json.loads(json.dumps(grpo, default=str))  # as the file holds it: lists, not tuples
    seeds, earlier, merged = [int(s) for s in args.seeds.split(",")], [], []
    if args.merge:
        result = json.loads(Path(args.merge).read_text())
        earlier = result["raw"]["runs"]
        theirs = {k: result["raw"].get(k, "(not recorded)") for k in settings}
        if theirs != settings or {r["seed"] for r in earlier} & set(seeds):
            raise SystemExit(f"--merge needs the same settings and other seeds: {args.merge} has {theirs}, seeds "
                             f"{[r['seed'] for r in earlier]}")
        merged = [*(n for n in result["notes"] if n.startswith("seeds ")),  # the commands of the seeds before it
                  f"seeds {[r['seed'] for r in earlier]}: {result['command']}, {result['date']}"]
    rows = earlier + [run_seed(args.config, seed, args) for seed in seeds]
    for r in rows:
        print(f"seed {r['seed']}: {r['before']:.3f} -> {r['after']:.3f} ({r['gain']:+.3f}) in {r['train_s']} s of "
              f"training ({r['total_s']} s in all); curve {[round(c['eval_reward'], 3) for c in r['curve']]}")
    # what the runs change from the default config, in the section's heading
    changes = ([args.config] if args.config != DEFAULT_CONFIG else []) + ([f"lr {args.lr:g}"] if args.lr else [])
    changes += [f"{k}={v}" for k, v in args.grpo.items()]
    save("cli_learning", figures(rows),
         notes=[f"{'up to ' if args.budget_s else ''}{args.steps} steps of {args.config}"
                + (f" within {args.budget_s:g} s of training" if args.budget_s else "")
                + (f" at lr {args.lr:g}" if args.lr else "")
                + "".join(f", {k}={v}" for k, v in args.grpo.items()) + f", evaluated every {args.eval_every} steps on "
                f"{args.eval_limit} held-out tasks", *merged, goal_note(rows)],
         title="Learning behind an unmodified CLI" + (": " + ", ".join(changes) if changes else ""),
         raw={**settings, "runs": rows}, out=args.out)


if __name__ == "__main__":
    main()
