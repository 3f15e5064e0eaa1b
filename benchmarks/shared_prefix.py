"""One GRPO update of CLI-shaped chains with and without the shared prefix (grpo/prefix.py): seconds, peak memory, and
how far the two gradients are apart.

    python benchmarks/shared_prefix.py [--model data/models/tiny-agent] [--prompt 9164] [--chains 32]
        [--suffix 150 600] [--micro-batch 8] [--trials 2] [--out benchmarks/results/shared_prefix.json]

The chains are what one step behind Codex trains on: `--chains` sessions of one task family, each one chain of Codex's
~9.2k-token prompt (system prompt and tools: `--prompt`, the figure data/models/tiny-agent/eval.json records for
codex-calc) followed by a suffix of `--suffix` tokens (the task, the model's calls, the tool outputs), the model's
tokens trained. Token ids are random: the cost does not depend on them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from polar_lab.grpo import GRPOConfig
from polar_lab.grpo.batch import Sample
from polar_lab.grpo.policy import Policy

from result import save


def chains(args) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 2000, (args.prompt,), generator=g)
    out = []
    for i in range(args.chains):
        n = int(torch.randint(args.suffix[0], args.suffix[1] + 1, (1,), generator=g))
        ids = torch.cat([prompt, torch.randint(3, 2000, (n,), generator=g)])
        weights = torch.zeros(len(ids) - 1)
        weights[args.prompt + n // 2:] = 1.0  # the suffix's second half: the model's own tokens
        weights /= weights.sum() * args.chains
        out.append(Sample(input_ids=ids, weights=weights, advantage=(-1.0) ** i,
                          behavior_logprobs=torch.where(weights > 0, -1.0, 0.0),
                          versions=torch.zeros(len(weights), dtype=torch.long), temperature=1.0, session_id=f"r{i}"))
    return out


def measure(args, samples: list[Sample], min_tokens: int | None) -> dict:
    """One update per trial from the same weights: seconds (median), peak resident memory, the last gradients."""
    config = GRPOConfig(micro_batch_size=args.micro_batch, learning_rate=1e-4, shared_prefix_min_tokens=min_tokens)
    times, peaks = [], []
    for _ in range(args.trials):
        policy = Policy(args.model, config)
        policy.memory(reset_peak=True)
        t0 = time.perf_counter()
        stats = policy.update(samples)
        times.append(time.perf_counter() - t0)
        peaks.append(policy.memory()["peak"] / 2**20)
    return {"update_s": statistics.median(times), "times": times, "peak_mib": max(peaks),
            "shared_tokens": stats.shared_prefix_tokens, "gradients": policy.gradients()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-agent")
    parser.add_argument("--prompt", type=int, default=9164)
    parser.add_argument("--chains", type=int, default=32)
    parser.add_argument("--suffix", type=int, nargs=2, default=[150, 600])
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/shared_prefix.json")
    args = parser.parse_args()
    samples = chains(args)
    plain = measure(args, samples, None)
    shared = measure(args, samples, 1024)
    total = torch.sqrt(sum(g.norm() ** 2 for g in plain["gradients"].values()))
    gap = torch.sqrt(sum((shared["gradients"][n] - g).norm() ** 2 for n, g in plain["gradients"].items()))
    speedup = plain["update_s"] / shared["update_s"]
    print(f"plain {plain['update_s']:.1f} s, peak {plain['peak_mib']:.0f} MiB; shared ({shared['shared_tokens']} "
          f"tokens once) {shared['update_s']:.1f} s, peak {shared['peak_mib']:.0f} MiB; {speedup:.1f}x; "
          f"gradient gap {float(gap / total):.1e} of its norm")
    tokens = sum(len(s.input_ids) for s in samples)
    save("shared_prefix",
         {"update, plain (s)": round(plain["update_s"], 1), "update, shared prefix (s)": round(shared["update_s"], 1),
          "speed-up": round(speedup, 1), "peak memory, plain / shared (MiB)":
              f"{plain['peak_mib']:.0f} / {shared['peak_mib']:.0f}",
          "gradient gap, shared vs plain (of its norm)": f"{float(gap / total):.1e}"},
         notes=[f"{args.chains} chains of a {args.prompt}-token prompt and {args.suffix[0]}–{args.suffix[1]}-token "
                f"suffixes ({tokens:,} tokens), micro-batches of {args.micro_batch}, {args.model}; the shared path ran "
                f"{shared['shared_tokens']} tokens once; median of {args.trials} updates each"],
         title="Shared-prefix updates: one GRPO update of Codex-shaped chains",
         raw={"args": {k: v for k, v in vars(args).items() if k != "out"}, "tokens": tokens,
              "plain": {k: v for k, v in plain.items() if k != "gradients"},
              "shared": {k: v for k, v in shared.items() if k != "gradients"}}, out=args.out)


if __name__ == "__main__":
    main()
