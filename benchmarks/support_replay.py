"""On-policy TIS weight under a harness's own top_p / top_k: with sampling_support="replay" (the engine samples within
the harness's support, the trainer renormalises over it), how close is exp(log π_old − log μ) to 1, and without?

One Lab on the shipped tiny model; `--sessions` three-turn chats whose every request sends top_p 0.9 and top_k 20
at T=1 (seeded); every sampled token is rescored by the trainer's own chunked logprob path
(Policy.logprobs, as a step computes π_old) two ways:
  replay      within each token's recorded support (trajectory/support.py) — what training does
  no replay   over the whole vocabulary — what a trainer that ignores the support computes
Printed per way: the mean TIS weight, its max |w − 1|, and the mean |Δ logprob| over all sampled tokens.
Goal: replay's mean within 1e-3 of 1.

    python benchmarks/support_replay.py [--model data/models/tiny-calc] [--sessions 16] [--out F]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from polar_lab import Lab
from polar_lab.grpo import GRPOConfig
from polar_lab.grpo.batch import _sample
from polar_lab.grpo.policy import Policy

from hybrid_fidelity import chains  # the same seeded three-turn chats (benchmarks/ is on the path when run)
from result import save


def weights(policy: Policy, trajectories: list, *, replay: bool) -> torch.Tensor:
    """log π_old − log μ of every sampled token."""
    samples = [_sample(t if replay else dataclasses.replace(t, sampling_support=[]), 0.0, 1.0) for t in trajectories]
    return torch.cat([(lp - s.behavior_logprobs)[s.weights > 0] for s, lp in zip(samples, policy.logprobs(samples))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/results/support_replay.json")
    args = parser.parse_args()
    t0 = time.perf_counter()
    with Lab(args.model, port=0, run_name=f"support-replay-{int(time.time())}") as lab:
        trajectories = chains(lab, args.sessions, temperature=1.0, seed=300, top_p=0.9, extra_body={"top_k": 20})
    policy = Policy(args.model, GRPOConfig())
    rows = {}
    for name, replay in (("replay", True), ("no replay", False)):
        delta = weights(policy, trajectories, replay=replay)
        w = delta.exp()
        rows[name] = {"tokens": len(w), "tis_weight_mean": float(w.mean()),
                      "tis_weight_max_dev": float((w - 1).abs().max()), "mean_abs_delta": float(delta.abs().mean())}
        print(f"{name:10s} tokens {len(w):5d}  TIS weight mean {w.mean():.6f}  max |w-1| {(w - 1).abs().max():.2e}  "
              f"mean |Δ logprob| {delta.abs().mean():.2e}")
    goal = abs(rows["replay"]["tis_weight_mean"] - 1) <= 1e-3
    print(f"goal (replay mean within 1e-3 of 1): {'met' if goal else 'MISSED'}; {time.perf_counter() - t0:.0f} s")
    def both(key: str, spec: str) -> str:  # replay / no replay
        return f"{rows['replay'][key]:{spec}} / {rows['no replay'][key]:{spec}}"

    save("support_replay", {"sampled tokens": rows["replay"]["tokens"],
                            "TIS weight mean, replay / whole vocabulary": both("tis_weight_mean", ".6f"),
                            "max |w − 1|, replay / whole vocabulary": both("tis_weight_max_dev", ".2e"),
                            "mean |Δ logprob|, replay / whole vocabulary": both("mean_abs_delta", ".1e")},
         notes=[f"Goal (replay's mean within 1e-3 of 1): {'met' if goal else 'missed'}"],
         title="A harness's own top_p, replayed by the trainer",
         raw={"model": args.model, "sessions": args.sessions, **rows}, out=args.out)


if __name__ == "__main__":
    main()
