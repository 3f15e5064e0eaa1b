"""Harness transfer: train the same policy behind harness A, evaluate it behind harness B — the matrix of held-out
gains, with seeds and spread. Polar's own results say the harness dominates the gain; this measures it.

Harnesses (polar_lab/harness/registry.py), the calculator task through each: `calculator` (OpenAI chat SDK),
`calculator_anthropic` (Anthropic Messages' tool_use loop), `calculator_google` (google-genai's functionCall loop) and
`calc_cli` (the loop as a program of its own, in the sandbox). One Lab on the shipped tiny model. Each eval harness's
"before" is the shipped weights behind it (eval seed fixed); each (train harness, seed) starts from the shipped
weights, trains `--steps` sync steps behind A, then is evaluated behind every B: gain = after − before(B).

    python benchmarks/harness_transfer.py [--harnesses calculator,calc_cli] [--seeds 1,2,3] [--steps 4]
        [--tasks-per-step 8] [--eval-limit 50] [--lr 1e-3] [--out benchmarks/results/harness_transfer.json]
        [--plot benchmarks/results/harness_transfer.png]

`transfer_matrix(lab, ...)` is what the test (smallest setting, on the suite's shared engine) and notebook 09 call.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from polar_lab import GRPOConfig, GRPOTrainer, Lab

HARNESSES = ["calculator", "calculator_anthropic", "calculator_google", "calc_cli"]


def transfer_matrix(lab: Lab, shipped: dict, harnesses: list[str], *, seeds: list[int], steps: int,
                    tasks_per_step: int = 8, eval_limit: int = 50, lr: float = 1e-3,
                    progress: bool = False) -> pd.DataFrame:
    """One row per (train harness, seed, eval harness): before, after, gain. `shipped`: the weights every run
    starts from (synced back at the end)."""
    def config(harness: str, seed: int) -> GRPOConfig:
        return GRPOConfig(harness=harness, tasks_per_step=tasks_per_step, num_generations=8, learning_rate=lr,
                          seed=seed, eval_limit=eval_limit, output_dir=str(lab.run_dir / f"transfer-{harness}-{seed}"))

    lab.sync_weights(shipped)
    with GRPOTrainer(lab, config(harnesses[0], seeds[0])) as probe:
        before = {b: probe.evaluate(harness=b, progress=progress)["eval_reward"] for b in harnesses}
    rows = []
    for a in harnesses:
        for seed in seeds:
            lab.sync_weights(shipped)
            with GRPOTrainer(lab, config(a, seed)) as trainer:
                t0 = time.perf_counter()
                trainer.train(steps, progress=progress)
                train_s = time.perf_counter() - t0
                for b in harnesses:
                    after = trainer.evaluate(harness=b, progress=progress)["eval_reward"]
                    rows.append({"train": a, "eval": b, "seed": seed, "before": before[b], "after": after,
                                 "gain": after - before[b], "train_s": train_s})
    lab.sync_weights(shipped)
    return pd.DataFrame(rows)


def summary(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean and spread (population sd) of the gain per (train, eval) cell: the matrix."""
    gain = runs.groupby(["train", "eval"])["gain"]
    return pd.DataFrame({"mean": gain.mean(), "std": gain.std(ddof=0), "min": gain.min(), "max": gain.max(),
                         "seeds": gain.count()})


def plot(runs: pd.DataFrame, path: str | Path | None = None):
    """The matrix as a heatmap: rows the harness trained behind, columns the one evaluated behind; each cell its
    mean gain ± spread over seeds."""
    import matplotlib.pyplot as plt

    cells = summary(runs)
    order = list(dict.fromkeys(runs["train"]))
    mean = cells["mean"].unstack().reindex(index=order, columns=order)
    std = cells["std"].unstack().reindex(index=order, columns=order)
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(order), 1.2 + 1.0 * len(order)))
    bound = max(float(mean.abs().max().max()), 1e-3)
    image = ax.imshow(mean.values, cmap="RdBu", vmin=-bound, vmax=bound)
    for i in range(len(order)):
        for j in range(len(order)):
            dark = abs(mean.values[i, j]) > 0.6 * bound
            ax.text(j, i, f"{mean.values[i, j]:+.3f}\n±{std.values[i, j]:.3f}", ha="center", va="center", fontsize=8,
                    color="white" if dark else "black")
    ax.set_xticks(range(len(order)), order, rotation=30, ha="right")
    ax.set_yticks(range(len(order)), order)
    ax.set_xlabel("evaluated behind")
    ax.set_ylabel("trained behind")
    ax.set_title(f"held-out gain ({runs['seed'].nunique()} seeds)")
    fig.colorbar(image, ax=ax, shrink=0.8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def main() -> None:
    from learning_rate import shipped_weights  # benchmarks/ is on the path when run
    from result import save

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--harnesses", default=",".join(HARNESSES))
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tasks-per-step", type=int, default=8, help="tasks per step (8 runs each)")
    parser.add_argument("--eval-limit", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default="benchmarks/results/harness_transfer.json")
    parser.add_argument("--plot", default="benchmarks/results/harness_transfer.png")
    args = parser.parse_args()
    harnesses, seeds = args.harnesses.split(","), [int(x) for x in args.seeds.split(",")]
    t0 = time.perf_counter()
    with Lab(args.model, port=0, run_name=time.strftime("bench-transfer-%Y%m%d-%H%M%S")) as lab:
        runs = transfer_matrix(lab, shipped_weights(lab), harnesses, seeds=seeds, steps=args.steps,
                               tasks_per_step=args.tasks_per_step, eval_limit=args.eval_limit, lr=args.lr)
    with pd.option_context("display.width", 160, "display.float_format", "{:+.3f}".format):
        print(runs.to_string(index=False))
        print(f"\n{len(seeds)} seeds x {args.steps} steps of {args.tasks_per_step} tasks, eval {args.eval_limit} "
              f"tasks, {time.perf_counter() - t0:.0f} s in all\n")
        print(summary(runs).to_string())
    cells, elapsed = summary(runs), round(time.perf_counter() - t0)
    before = runs.drop_duplicates("eval").set_index("eval")["before"]

    def cell(a: str, b: str) -> str:
        return f"{cells.loc[(a, b), 'mean']:+.3f} ± {cells.loc[(a, b), 'std']:.3f}"

    save("harness_transfer", {"held-out before": " / ".join(f"{b} {before[b]:.2f}" for b in harnesses),
                              "gain behind the harness trained on": " / ".join(f"{a} {cell(a, a)}" for a in harnesses),
                              "wall, all runs (s)": elapsed},
         tables=[{"title": "Gain (mean ± sd over seeds): trained behind ↓ / evaluated behind →",
                  "columns": ["trained behind", *harnesses],
                  "rows": [[a, *(cell(a, b) for b in harnesses)] for a in harnesses]}],
         notes=[f"{len(seeds)} seeds × {args.steps} sync steps of {args.tasks_per_step} tasks × 8 runs, "
                f"lr {args.lr:g}, {args.eval_limit} held-out tasks"],
         title="Harness transfer",
         raw={"model": args.model, "steps": args.steps, "seeds": seeds, "tasks_per_step": args.tasks_per_step,
              "eval_limit": args.eval_limit, "lr": args.lr, "runs": runs.to_dict("records")}, out=args.out)
    plot(runs, args.plot)


if __name__ == "__main__":
    main()
