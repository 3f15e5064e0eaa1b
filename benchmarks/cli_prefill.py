"""What chunked prefill and vLLM's prefix cache save behind an unmodified CLI on CPU: held-out evaluations of the
tiny-agent fixture behind Codex with `engine.chunked_prefill` off (each prompt prefilled whole, a hybrid model without
prefix caching) and on (vLLM's 4096-token step budget; Qwen3.5's DeltaNet states cached in 'align' mode).

    python benchmarks/cli_prefill.py [--config configs/tiny_agent_codex.yaml] [--tasks 24] [--out ...]

Each setting is a Lab of its own on the shipped weights; the same evaluation (same tasks, same sampling seed) runs
twice in it, the second finding what the first left in the cache. Per evaluation: wall time, the engine's busy
seconds, prompt tokens and those the prefix cache served. Whether the setting changes what is sampled: the sessions
whose token ids are the same as the unchunked first evaluation's, and the largest gap of their sampled tokens'
logprobs; the unchunked second evaluation is the baseline (Codex's tool output carries its own wall time, so even two
identical engines do not give identical sessions).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from polar_lab.grpo.run import load_train_config

from result import save


def evaluate_twice(config_path: str, chunked: bool, tasks: int) -> list[dict]:
    from polar_lab import GRPOTrainer, Lab

    lab_config, config = load_train_config(config_path, eval_limit=tasks)
    lab_config = dataclasses.replace(
        lab_config, engine=dataclasses.replace(lab_config.engine, chunked_prefill=chunked),
        store=dataclasses.replace(lab_config.store, run_name=time.strftime(f"bench-cli-prefill-{int(chunked)}-%H%M%S")))
    rows = []
    with Lab(config=lab_config) as lab, GRPOTrainer(lab, config) as trainer:
        for _ in range(2):
            busy, t0 = lab.stats()["engine_busy_s"], time.perf_counter()
            result = trainer.evaluate(progress=False)
            wall = time.perf_counter() - t0
            groups = trainer.last_eval_groups
            calls = lab.call_records([s.id for g in groups for s in g.sessions])
            rows.append({"chunked": chunked, "wall_s": round(wall, 1),
                         "engine_busy_s": round(lab.stats()["engine_busy_s"] - busy, 1),
                         "pass_rate": result["eval_reward"], "calls": len(calls),
                         "prompt_tokens": sum(len(c.prompt_ids) for c in calls),
                         "cached_tokens": sum(c.cached_tokens for c in calls),
                         "sessions": [_sampled(g) for g in groups]})
    return rows


def _sampled(group) -> dict | None:
    """The run's (first) chain: its token ids, loss mask and behaviour logprobs."""
    if not group.trajectories:
        return None
    t = group.trajectories[0]
    return {"ids": t.token_ids, "mask": t.loss_mask, "logprobs": t.behavior_logprobs}


def agreement(a: list, b: list) -> tuple[int, float]:
    """Sessions with the same token ids in both, and the largest gap between the logprobs of sampled tokens up to
    where each pair first differs."""
    same, worst = 0, 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            continue
        same += x["ids"] == y["ids"]
        for i, j, m, p, q in zip(x["ids"], y["ids"], x["mask"], x["logprobs"], y["logprobs"]):
            if i != j:
                break
            if m:
                worst = max(worst, abs(p - q))
    return same, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny_agent_codex.yaml")
    parser.add_argument("--tasks", type=int, default=24)
    parser.add_argument("--out", default="benchmarks/results/cli_prefill.json")
    args = parser.parse_args()
    off = evaluate_twice(args.config, False, args.tasks)
    on = evaluate_twice(args.config, True, args.tasks)
    reference = off[0]["sessions"]
    rows, figures = [], {}
    for label, r in [("off, first", off[0]), ("off, again", off[1]), ("on, first", on[0]), ("on, again", on[1])]:
        same, gap = agreement(reference, r["sessions"])
        rows.append([label, r["wall_s"], r["engine_busy_s"], r["calls"], r["prompt_tokens"], r["cached_tokens"],
                     r["pass_rate"], f"{same} of {len(reference)}", f"{gap:.1e}"])
        print(rows[-1], flush=True)
    figures["evaluation wall time, chunked prefill off → on (s)"] = f"{off[0]['wall_s']} → {on[0]['wall_s']}"
    figures["engine busy, off → on (s)"] = f"{off[0]['engine_busy_s']} → {on[0]['engine_busy_s']}"
    figures["prompt tokens served from the prefix cache, on"] = \
        f"{on[0]['cached_tokens']} of {on[0]['prompt_tokens']} ({on[0]['cached_tokens'] / on[0]['prompt_tokens']:.0%})"
    figures["speed-up of an evaluation, first / repeated"] = \
        f"{off[0]['wall_s'] / on[0]['wall_s']:.1f}× / {off[1]['wall_s'] / on[1]['wall_s']:.1f}×"
    save("cli_prefill", figures,
         tables=[{"title": f"{args.tasks} held-out tasks behind Codex, one seeded run each, evaluated twice per Lab",
                  "columns": ["chunked prefill, evaluation", "wall (s)", "engine busy (s)", "calls", "prompt tokens",
                              "cached tokens", "pass rate", "sessions as 'off, first'",
                              "max logprob gap before they differ"],
                  "rows": rows}],
         notes=["'off, again' is the baseline for the last two columns: Codex's tool output carries its own wall time, "
                "so a session can differ from one evaluation to the next on the same engine"],
         title="Chunked prefill and the prefix cache behind Codex", raw={"config": args.config, "tasks": args.tasks},
         out=args.out)


if __name__ == "__main__":
    main()
