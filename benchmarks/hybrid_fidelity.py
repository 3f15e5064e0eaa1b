"""Engine vs trainer logprobs on Qwen3.5's hybrid architecture: how far are the engine's logprobs from the trainer's,
with the CPU engine serving the hybrid in fp32 and in bf16, and the trainer scoring the same tokens four ways?

The CPU engine serves a hybrid in fp32 (its DeltaNet layers through engine/gdn_fp32.py) or in bf16 (through vLLM's
own CPU kernels, which take nothing else); both are measured, one Lab each.

Per engine dtype, one Lab on the hybrid fixture; `--sessions` calculator-style chats of three turns each at T=0.7
(seeded); every sampled token of each session's one chain is rescored by the trainer four ways:
  fp32                 the trainer's default (fp32 weights and compute) — the reference
  fp32, bf16 weights   fp32 compute on the weights rounded to bf16, as the engine holds them
  bf16 autocast        GRPOConfig(dtype="bfloat16"): fp32 master weights, bf16 matmuls
  bf16 model           weights and compute in bf16
Printed per way: mean and max |Δ logprob| and the mean TIS weight exp(trainer − engine), over all sampled tokens.

    python benchmarks/hybrid_fidelity.py [--model data/models/tiny-calc-qwen35-hybrid] [--sessions 8]
                                         [--engine-dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from transformers import AutoModelForCausalLM

from polar_lab import Lab
from polar_lab.grpo.loss import token_logprobs

from result import save

QUESTIONS = ["What is 2+3?", "What is 17*4?", "Compute 120-45.", "What is (8+9)*3?", "What is 250+175?",
             "Compute 13*13.", "What is 99-27?", "What is 6*(7+5)?"]


def chains(lab: Lab, sessions: int, *, temperature: float = 0.7, seed: int = 100, **request) -> list:
    """`sessions` seeded three-turn calculator chats (session i samples with seed + i); `request`: more fields of
    every request (benchmarks/support_replay.py sends top_p and top_k). Their trajectories, one chain each."""
    import openai

    out = []
    for i in range(sessions):
        s = lab.session(sampling={"temperature": temperature, "seed": seed + i})
        client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key, max_retries=0)
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        for follow_up in ("And times two?", "Thanks."):
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=48, **request)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                         {"role": "user", "content": follow_up}]
        client.chat.completions.create(model="m", messages=messages, max_tokens=48, **request)
        out += lab.trajectories(session_ids=[s.id])
    return out


def scorers(model_path: str) -> dict:
    fp32 = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    rounded = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    bf16 = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()

    def plain(model):
        return lambda ids: token_logprobs(model, ids, torch.ones_like(ids), torch.tensor([0.7]))[0].float()

    def autocast(ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return token_logprobs(fp32, ids, torch.ones_like(ids), torch.tensor([0.7]))[0].float()

    return {"fp32": plain(fp32), "fp32, bf16 weights": plain(rounded), "bf16 autocast": autocast,
            "bf16 model": plain(bf16)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc-qwen35-hybrid")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--engine-dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    ways = scorers(args.model)
    rows = {}
    for dtype in args.engine_dtypes.split(","):
        t0 = time.perf_counter()
        with Lab(args.model, port=0, kv_cache_gib=0.25, max_model_len=4096, dtype=dtype) as lab:
            found = chains(lab, args.sessions)
        seconds = time.perf_counter() - t0
        with torch.no_grad():
            for name, score in ways.items():
                gaps, ratios = [], []
                for chain in found:
                    trainer = score(torch.tensor([chain.token_ids]))
                    for i, m in enumerate(chain.loss_mask):
                        if m:
                            delta = trainer[i - 1].item() - chain.behavior_logprobs[i]
                            gaps.append(abs(delta))
                            ratios.append(math.exp(delta))
                rows[dtype, name] = {"tokens": len(gaps), "mean": sum(gaps) / len(gaps), "max": max(gaps),
                                     "tis_mean": sum(ratios) / len(ratios), "engine_s": round(seconds, 1)}
                print(json.dumps({"engine": dtype, "way": name, **rows[dtype, name]}), flush=True)
    print("\n| engine | trainer | tokens | mean \\|Δ\\| | max \\|Δ\\| | TIS mean |\n|---|---|---|---|---|---|")
    for (dtype, name), r in rows.items():
        print(f"| {dtype} | {name} | {r['tokens']} | {r['mean']:.2e} | {r['max']:.2e} | {r['tis_mean']:.4f} |")
    against_fp32 = {dtype: r for (dtype, name), r in rows.items() if name == "fp32"}  # the trainer's default
    save("hybrid_fidelity",
         {f"{dtype} engine vs fp32 trainer: mean / max |Δ|, TIS mean": f"{r['mean']:.2e} / {r['max']:.2e}, "
          f"{r['tis_mean']:.4f}" for dtype, r in against_fp32.items()},
         tables=[{"title": f"{args.sessions} three-turn sessions at T=0.7 per engine dtype, every sampled token",
                  "columns": ["engine", "trainer", "tokens", "mean |Δ|", "max |Δ|", "TIS mean"],
                  "rows": [[dtype, name, r["tokens"], f"{r['mean']:.2e}", f"{r['max']:.2e}", f"{r['tis_mean']:.4f}"]
                           for (dtype, name), r in rows.items()]}],
         notes=["Goal against the fp32 trainer: mean |Δ| ≤ 2e-3, max ≤ 1e-2"],
         title="Engine vs trainer logprobs on Qwen3.5's hybrid architecture",
         raw={"model": args.model, "sessions": args.sessions,
              "rows": [{"engine": dtype, "way": name, **r} for (dtype, name), r in rows.items()]})


if __name__ == "__main__":
    main()
