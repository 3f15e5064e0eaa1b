"""Does a LoRA run learn? Held-out accuracy of the shipped tiny model before and after `--steps` sync GRPO steps that
train only a LoRA adapter, served live by the engine (`max_lora_rank`), beside the same run with full fine-tuning.

    python benchmarks/lora_learning.py [--steps 8] [--rank 16] [--lora-lr 5e-3] [--eval-limit 100] [--seeds 1,2]

Writes benchmarks/results/lora_learning.json.
"""

from __future__ import annotations

import argparse
import json
import time

from polar_lab import GRPOConfig, GRPOTrainer, Lab

from result import save

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_once(lab: Lab, shipped: dict, name: str, seed: int, args, **config) -> dict:
    lab.sync_weights(shipped)  # every run starts from the shipped weights (and no adapter)
    config = GRPOConfig(tasks_per_step=16, num_generations=8, seed=seed, eval_limit=args.eval_limit,
                        output_dir=str(lab.run_dir / f"{name}-seed{seed}"), **config)
    with GRPOTrainer(lab, config) as trainer:
        before = trainer.evaluate(progress=False)["eval_reward"]
        t0 = time.perf_counter()
        metrics = trainer.train(args.steps, progress=False)
        train_s = time.perf_counter() - t0
        after = trainer.evaluate(progress=False)["eval_reward"]
    row = {"run": name, "seed": seed, "before": before, "after": after, "gain": after - before,
           "s_per_step": train_s / args.steps, "sync_bytes": float(metrics["sync_bytes"].mean()),
           "sync_s": float(metrics["sync_s"].mean())}
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lora-lr", type=float, default=5e-3)
    parser.add_argument("--full-lr", type=float, default=5e-4)
    parser.add_argument("--eval-limit", type=int, default=100)
    parser.add_argument("--seeds", default="1,2")
    args = parser.parse_args()
    lora = {"r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": TARGETS}
    rows = []
    with Lab(args.model, port=0, run_name=f"bench-lora-{int(time.time())}", max_lora_rank=args.rank) as lab:
        from transformers import AutoModelForCausalLM

        shipped = AutoModelForCausalLM.from_pretrained(args.model).state_dict()
        for seed in (int(s) for s in args.seeds.split(",")):
            rows.append(run_once(lab, shipped, "lora", seed, args, learning_rate=args.lora_lr, peft_config=lora))
            rows.append(run_once(lab, shipped, "full", seed, args, learning_rate=args.full_lr))
    save("lora_learning", {f"held-out, {r['run']}, seed {r['seed']}": f"{r['before']:.2f} → {r['after']:.2f}"
                           for r in rows},
         tables=[{"title": f"{args.steps} sync steps of 16 tasks × 8 runs, {args.eval_limit} held out",
                  "columns": ["run", "seed", "held-out before → after", "gain", "s/step", "bytes per sync", "sync s"],
                  "rows": [[r["run"], r["seed"], f"{r['before']:.2f} → {r['after']:.2f}", f"{r['gain']:+.2f}",
                            round(r["s_per_step"], 1), round(r["sync_bytes"]), round(r["sync_s"], 3)] for r in rows]}],
         notes=[f"LoRA rank {args.rank}, alpha {2 * args.rank}, lr {args.lora_lr:g}; full fine-tuning lr "
                f"{args.full_lr:g}"],
         title="Does a LoRA run learn?",
         raw={"steps": args.steps, "lora": lora, "lora_lr": args.lora_lr, "full_lr": args.full_lr, "rows": rows})


if __name__ == "__main__":
    main()
