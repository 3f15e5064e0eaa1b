"""Trainer memory and time per rank: ddp vs fsdp, 1 and 2 ranks (+ activation checkpointing, LoRA), next to
the memory plan's prediction (polar_lab/grpo/memory.py), on CPU with gloo.

Each configuration starts its rank processes, resets each rank's peak resident memory (Linux VmHWM) once
the model is loaded (and sharded), runs one GRPO update — the first, so Adam's state is created in it —
then reads each rank's peak: `held` is what a rank holds before the update (the interpreter and libraries
too, ~0.4–0.5 GiB), `step` what the update added on top. The plan's figures for the same parts: parameters
(held) and the update's peak — the larger of (held gradients + activations + logits + a gathered unit) and
(gradients + Adam). A second update gives the time per update. Results → benchmarks/results/trainer_memory.json.

    python benchmarks/trainer_memory.py [--model data/models/smollm2-135m-instruct] [--samples 8] [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoConfig

from polar_lab.grpo import GRPOConfig
from polar_lab.grpo.batch import Sample
from polar_lab.grpo.distributed import DistributedPolicy
from polar_lab.grpo.memory import ModelShape, plan

from result import save

MIB = 1024 ** 2
CONFIGS = [("ddp", 1, False, False), ("ddp", 2, False, False), ("fsdp", 1, False, False), ("fsdp", 2, False, False),
           ("fsdp", 2, True, False), ("fsdp", 2, False, True)]  # strategy, ranks, checkpointing, lora
LORA = {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]}


def samples(n: int, length: int, vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        weights = torch.zeros(length - 1)
        weights[length // 4:] = 1.0 / (n * length)
        out.append(Sample(input_ids=torch.randint(3, vocab, (length,), generator=g), weights=weights,
                          advantage=1.0 if i % 2 else -1.0, behavior_logprobs=torch.full((length - 1,), -5.0),
                          versions=torch.zeros(length - 1, dtype=torch.long), temperature=1.0, session_id=f"s{i}"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="data/models/smollm2-135m-instruct")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sample")
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()

    shape = ModelShape.from_config(AutoConfig.from_pretrained(args.model))
    batch = samples(args.samples, args.tokens, shape.vocab)
    rows = []
    for strategy, ranks, checkpointing, lora in CONFIGS:
        config = GRPOConfig(strategy=strategy, world_size=ranks, gradient_checkpointing=checkpointing,
                            micro_batch_size=args.micro_batch, learning_rate=1e-5, peft_config=LORA if lora else None)
        policy = DistributedPolicy(args.model, config, devices=["cpu"] * ranks)
        try:
            before = policy.memory(reset_peak=True)
            policy.update(batch)
            after = policy.memory()
            t0 = time.perf_counter()
            policy.update(batch)
            update_s = time.perf_counter() - t0
        finally:
            policy.close()
        # a rank's micro-batch: its share of the samples, micro_batch_size of them at a time
        share = -(-args.samples // ranks)
        tokens = min(args.micro_batch, share) * args.tokens
        predicted = plan(shape, strategy=strategy, ranks=ranks, tokens=tokens, seq_len=args.tokens, attention="math",
                         micro_batches=-(-share // args.micro_batch), checkpointing=checkpointing,
                         lora_rank=LORA["r"] if lora else 0, lora_targets=LORA["target_modules"])
        step_parts = predicted["trainer_step_peak"]
        predicted = predicted["trainer"]
        row = {"strategy": strategy + ("+lora" if lora else ""), "ranks": ranks, "checkpointing": checkpointing,
               "held_mib": max(m["rss"] for m in before) / MIB, "step_mib": max(a["peak"] - b["rss"] for a, b in
                                                                                zip(after, before)) / MIB,
               "peak_mib": max(m["peak"] for m in after) / MIB, "plan_params_mib": predicted["parameters"] / MIB,
               "plan_step_mib": step_parts / MIB, "update_s": update_s}
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    def name(row: dict) -> str:
        return f"{row['strategy']} × {row['ranks']}" + (", checkpointing" if row["checkpointing"] else "")

    save("trainer_memory", {f"step peak, {name(r)} (MiB)": round(r["step_mib"]) for r in rows},
         tables=[{"title": f"One GRPO update of {args.samples} sequences × {args.tokens} tokens per configuration",
                  "columns": ["configuration", "held (MiB)", "plan: parameters (MiB)", "step (MiB)",
                              "plan: step peak (MiB)", "update (s)"],
                  "rows": [[name(r), round(r["held_mib"]), round(r["plan_params_mib"]), round(r["step_mib"]),
                            round(r["plan_step_mib"]), round(r["update_s"], 1)] for r in rows]}],
         title="Trainer memory and time per rank, ddp vs fsdp",
         raw={"model": args.model, "samples": args.samples, "tokens": args.tokens, "rows": rows})


if __name__ == "__main__":
    main()
