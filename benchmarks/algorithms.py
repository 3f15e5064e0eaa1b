"""The algorithms side by side: the same tasks, the same budget, several seeds each — held-out gain and seconds per
step for grpo, dr_grpo, dapo, GSPO, CISPO, IcePop, dynamic sampling and on-policy distillation, on the tiny model.

One Lab on the shipped tiny model; each (method, seed) starts from the shipped weights: evaluate (eval_seed fixed),
`--steps` sync steps, evaluate again. Methods are GRPOConfig overrides on one base (lr, tasks, group size):

    grpo          loss_type="grpo"
    dr_grpo       loss_type="dr_grpo"
    dapo          the default (loss_type="dapo", token_truncate TIS at 2)
    gspo          importance_sampling_level="sequence", loss_type="grpo"
    cispo         loss_type="cispo", epsilon_high=5.0
    dapo+icepop   vllm_importance_sampling_mode="token_mask", clip_min 0.5, clip_max 2.0
    dapo+dynamic  dynamic_sampling=True (max_refill_rounds 3)
    dapo+distill  teacher_model="data/models/tiny-calc-teacher" (the build script's --teacher), scored by an engine

On-policy and one pass per batch (num_iterations=1) the clip, the sequence ratio and the correction barely act: the
methods then differ in their normalisers (grpo, dr_grpo, dapo), CISPO's gradient past the clip, and what dynamic
sampling keeps. That is what this toy measures; it says so rather than crown a winner.

    python benchmarks/algorithms.py [--methods grpo,dapo,...] [--seeds 1,2,3] [--steps 4] [--tasks-per-step 8]
                                    [--eval-limit 50] [--lr 1e-3] [--out benchmarks/results/algorithms.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

from polar_lab import GRPOConfig, GRPOTrainer, Lab

from learning_rate import shipped_weights  # benchmarks/ is on the path when run
from result import save

METHODS = {
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {},
    "gspo": {"importance_sampling_level": "sequence", "loss_type": "grpo"},
    "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
    "dapo+icepop": {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5,
                    "vllm_importance_sampling_clip_max": 2.0},
    "dapo+dynamic": {"dynamic_sampling": True},
    # the teacher: the build script's better-trained tiny-calc (`build_tiny_model.py --teacher`), in its own engine
    "dapo+distill": {"teacher_model": "data/models/tiny-calc-teacher", "teacher_scorer": "engine"},
}


def run_once(lab: Lab, shipped: dict, method: str, seed: int, args) -> dict:
    lab.sync_weights(shipped)  # every run starts from the shipped weights, in the engine and the trainer
    config = GRPOConfig(tasks_per_step=args.tasks_per_step, num_generations=8, learning_rate=args.lr, seed=seed,
                        eval_limit=args.eval_limit, output_dir=str(lab.run_dir / f"{method}-seed{seed}"),
                        **METHODS[method])
    with GRPOTrainer(lab, config) as trainer:
        before = trainer.evaluate(progress=False)["eval_reward"]
        t0 = time.perf_counter()
        trainer.train(args.steps, progress=False)
        step_s = (time.perf_counter() - t0) / args.steps
        after = trainer.evaluate(progress=False)["eval_reward"]
    return {"method": method, "seed": seed, "before": before, "after": after, "gain": after - before,
            "step_s": step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tasks-per-step", type=int, default=8, help="tasks per step (8 runs each)")
    parser.add_argument("--eval-limit", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default="benchmarks/results/algorithms.json")
    args = parser.parse_args()
    methods, seeds = args.methods.split(","), [int(x) for x in args.seeds.split(",")]
    runs = []
    with Lab(args.model, port=0, run_name=time.strftime("bench-algorithms-%Y%m%d-%H%M%S")) as lab:
        shipped = shipped_weights(lab)
        print(f"{'method':>13} {'seed':>4} {'before':>7} {'after':>7} {'gain':>7} {'s/step':>7}")
        for method in methods:
            for seed in seeds:
                r = run_once(lab, shipped, method, seed, args)
                runs.append(r)
                print(f"{method:>13} {seed:>4} {r['before']:>7.3f} {r['after']:>7.3f} {r['gain']:>+7.3f} "
                      f"{r['step_s']:>7.1f}", flush=True)
        lab.sync_weights(shipped)
    summary = {}
    print(f"\n{'method':>13} {'gain mean':>9} {'spread':>7} {'s/step':>7}   ({len(seeds)} seeds, {args.steps} steps)")
    for method in methods:
        gains = [r["gain"] for r in runs if r["method"] == method]
        steps = [r["step_s"] for r in runs if r["method"] == method]
        summary[method] = {"gain_mean": statistics.mean(gains), "gain_sd": statistics.pstdev(gains),
                           "gain_min": min(gains), "gain_max": max(gains), "step_s": statistics.mean(steps)}
        s = summary[method]
        print(f"{method:>13} {s['gain_mean']:>+9.3f} {s['gain_sd']:>7.3f} {s['step_s']:>7.1f}")
    save("algorithms", {f"gain, {m}": f"{s['gain_mean']:+.3f} ± {s['gain_sd']:.3f}" for m, s in summary.items()},
         tables=[{"title": "Held-out gain per method (mean, sd, min, max over seeds) and seconds per step",
                  "columns": ["method", "gain mean", "sd", "min", "max", "s/step"],
                  "rows": [[m, round(s["gain_mean"], 3), round(s["gain_sd"], 3), round(s["gain_min"], 3),
                            round(s["gain_max"], 3), round(s["step_s"], 1)] for m, s in summary.items()]}],
         notes=[f"{len(seeds)} seeds × {args.steps} sync steps of {args.tasks_per_step} tasks × 8 runs, "
                f"lr {args.lr:g}, {args.eval_limit} held-out tasks"],
         title="The algorithms side by side",
         raw={"model": args.model, "steps": args.steps, "tasks_per_step": args.tasks_per_step,
              "eval_limit": args.eval_limit, "lr": args.lr, "runs": runs, "summary": summary}, out=args.out)


if __name__ == "__main__":
    main()
