"""GRPO step costs on one Lab: seconds per step (rollout, update, sync) and the engine's busy fraction, sync vs async
mode, per trainer layout; and the time of a weight sync on an idle proxy.

One process, one real vLLM engine, the calculator harness, the shipped tiny model (or --model):
  1. weight sync: `lab.sync_weights(state_dict)` repeated on an idle proxy (drain + load + resume);
  2. sync mode: rollout → update → sync, `--steps` steps after one warm-up step;
  3. async mode: the same number of steps with rollouts running while the trainer steps
     (max_staleness 1), starting again from the shipped weights.
Steps 2 and 3 run once per trainer layout (`--layouts`, STRATEGY:RANKS; ddp:1 trains in this process, the
others in rank processes over gloo): "GRPO s/step ddp vs fsdp" as whole steps, rollouts and sync included.
Engine busy fraction = time inside vLLM steps / wall time of the step. Results → benchmarks/results/grpo_step.json.

    python benchmarks/grpo_step.py [--model data/models/tiny-calc] [--steps 8] [--tasks-per-step 16]
    python benchmarks/grpo_step.py --tasks-per-step 8 --steps 4 --layouts ddp:1 ddp:2 fsdp:2
"""

from __future__ import annotations

import argparse
import statistics
import time

from polar_lab import GRPOConfig, GRPOTrainer, Lab
from polar_lab.grpo.config import STRATEGIES

from result import save

COLUMNS = ["step_s", "rollout_s", "train_s", "sync_s", "engine_busy_frac", "sampled_tokens_per_s", "reward_mean",
           "staleness_max"]


def sync_time(lab: Lab, trainer: GRPOTrainer, repeats: int) -> dict:
    state = trainer.policy.state_dict()
    runs = [lab.sync_weights(state) for _ in range(repeats)]
    return {k: statistics.median(getattr(r, k) for r in runs) for k in ("sync_s", "drain_s", "load_s")}


def layout(text: str) -> tuple[str, int]:
    strategy, _, ranks = text.partition(":")
    if strategy not in STRATEGIES or not ranks.isdigit() or int(ranks) < 1:
        raise argparse.ArgumentTypeError(f"a layout is STRATEGY:RANKS with STRATEGY one of {STRATEGIES}, e.g. fsdp:2 "
                                         f"(got {text!r})")
    return strategy, int(ranks)


def run_mode(lab: Lab, shipped: dict, args, async_mode: bool, strategy: str = "ddp", ranks: int = 1) -> dict:
    lab.sync_weights(shipped)
    name = f"{strategy}{ranks}-{'async' if async_mode else 'sync'}"
    config = GRPOConfig(tasks_per_step=args.tasks_per_step, learning_rate=args.learning_rate, async_mode=async_mode,
                        max_staleness=1, seed=args.seed, strategy=strategy, world_size=ranks,
                        output_dir=str(lab.run_dir / name))
    with GRPOTrainer(lab, config) as trainer:
        trainer.step()  # warm-up: first micro-batch shapes, and the async producer filling its queue
        t0 = time.perf_counter()
        rows = [trainer.step() for _ in range(args.steps)]
        wall = time.perf_counter() - t0
    summary = {c: statistics.mean(r[c] for r in rows) for c in COLUMNS}
    summary["staleness_max"] = max(r["staleness_max"] for r in rows)
    summary["wall_s"] = wall
    summary["steps"] = len(rows)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tasks-per-step", type=int, default=16)
    parser.add_argument("--sync-repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--layouts", type=layout, nargs="+", default=[("ddp", 1)],
                        help="trainer layouts STRATEGY:RANKS (GRPOConfig.strategy / world_size), each measured in "
                             "both modes; default ddp:1, the in-process trainer")
    parser.add_argument("--modes", nargs="+", choices=["sync", "async"], default=["sync", "async"])
    args = parser.parse_args()
    args.layouts, args.modes = list(dict.fromkeys(args.layouts)), list(dict.fromkeys(args.modes))  # each row once
    for strategy, ranks in args.layouts:  # a config GRPOConfig refuses is refused before the Lab starts
        GRPOConfig(strategy=strategy, world_size=ranks, tasks_per_step=args.tasks_per_step,
                   learning_rate=args.learning_rate, max_steps=args.steps)

    with Lab(args.model, port=0, run_name=time.strftime("bench-grpo-%Y%m%d-%H%M%S")) as lab:
        probe = GRPOTrainer(lab, GRPOConfig(output_dir=str(lab.run_dir / "probe")))
        shipped = probe.policy.state_dict()
        params = sum(v.numel() for k, v in shipped.items() if k != "lm_head.weight")
        sync = sync_time(lab, probe, args.sync_repeats)
        probe.close()
        results = {"model": args.model, "params": params, "tasks_per_step": args.tasks_per_step,
                   "runs_per_step": args.tasks_per_step * 8, "weight_sync": sync, "rows": [
                       {"strategy": strategy, "ranks": ranks, "mode": mode,
                        **run_mode(lab, shipped, args, async_mode=mode == "async", strategy=strategy, ranks=ranks)}
                       for strategy, ranks in args.layouts for mode in args.modes]}
        lab.sync_weights(shipped)

    print(f"model {args.model} ({params / 1e6:.2f}M params), {results['runs_per_step']} harness runs per step")
    print(f"weight sync (idle proxy, median of {args.sync_repeats}): total {sync['sync_s'] * 1e3:.1f} ms = "
          f"drain {sync['drain_s'] * 1e3:.1f} ms + load into vLLM {sync['load_s'] * 1e3:.1f} ms")
    print(f"{'layout mode':<14} " + " ".join(f"{c:>20}" for c in COLUMNS))
    names = [f"{row['strategy']}:{row['ranks']} {row['mode']}" for row in results["rows"]]
    for name, row in zip(names, results["rows"]):
        print(f"{name:<14} " + " ".join(f"{row[c]:>20.3f}" for c in COLUMNS))
    save("grpo_step", {"weight sync, idle proxy (ms)": round(sync["sync_s"] * 1e3, 1),
                       **{f"s/step, {name}": round(row["step_s"], 2) for name, row in zip(names, results["rows"])}},
         tables=[{"title": f"Means over {args.steps} steps after a warm-up, {results['runs_per_step']} runs a step",
                  "columns": ["layout, mode", *COLUMNS],
                  "rows": [[name, *(round(row[c], 3) for c in COLUMNS)] for name, row in zip(names, results["rows"])]}],
         title="GRPO step costs, sync vs async",
         raw=results)


if __name__ == "__main__":
    main()
