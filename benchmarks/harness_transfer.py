"""Harness transfer: train the same policy behind harness A, evaluate it behind harness B — the matrix of held-out
gains, with seeds and spread. Polar's own results say the harness dominates the gain; this measures it.

Harnesses (polar_lab/harness/registry.py), the calculator task through each: `calculator` (OpenAI chat SDK),
`calculator_anthropic` (Anthropic Messages' tool_use loop), `calculator_google` (google-genai's functionCall loop) and
`calc_cli` (the loop as a program of its own, in the sandbox). One Lab on the shipped tiny model. Each eval harness's
"before" is the shipped weights behind it (eval seed fixed); each (train harness, seed) starts from the shipped
weights, trains `--steps` sync steps behind A (fewer within `--budget-s`), then is evaluated behind every B:
gain = after − before(B).

    python benchmarks/harness_transfer.py [--harnesses calculator,calc_cli] [--seeds 1,2,3] [--steps 4]
        [--tasks-per-step 8] [--eval-limit 50] [--lr 1e-3] [--out benchmarks/results/harness_transfer.json]
        [--plot benchmarks/results/harness_transfer.png]

The paper's CLIs, behind which the tiny-agent fixture acts, with a `polar-lab train` config's Lab and run settings
(its harness_options go to every preset; --lr and --tasks-per-step default to the config's):

    python benchmarks/harness_transfer.py --config configs/tiny_agent_codex.yaml \
        --harnesses codex,claude_code,qwen_code,pi --seeds 0 --steps 6 --eval-limit 40 \
        --out benchmarks/results/cli_transfer.json --plot benchmarks/results/cli_transfer.png

One row of it, trained for a time budget rather than a step count, with any other GRPO setting (`--set`, as
`polar-lab train` reads it): `--train codex --steps 60 --budget-s 1200 --set mask_truncated_completions=true ...`.

`transfer_matrix(lab, ...)` is what the test (smallest setting, on the suite's shared engine) and notebook 09 call.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import pandas as pd

from polar_lab import GRPOConfig, GRPOTrainer, Lab
from polar_lab.harness.registry import get_harness

from cli_learning import sessions_shape, setting  # benchmarks/ is on the path (run as a script, or as the test adds it)

HARNESSES = ["calculator", "calculator_anthropic", "calculator_google", "calc_cli"]


def transfer_matrix(lab: Lab, shipped: dict, harnesses: list[str], *, seeds: list[int], steps: int,
                    tasks_per_step: int = 8, eval_limit: int = 50, lr: float = 1e-3, base: GRPOConfig | None = None,
                    known: pd.DataFrame | None = None, train: list[str] | None = None,
                    time_budget_s: float | None = None, progress: bool = False) -> pd.DataFrame:
    """One row per (train harness, seed, eval harness): before, after, gain, and the evaluated sessions' shape
    before and after (calls and chains per session, failed runs: `sessions_shape`). `shipped`: the weights every run
    starts from (synced back at the end). `base`: every other setting of the runs (default: GRPOConfig's, 8 runs
    per task); its harness_options go to every harness, trained or evaluated behind. `known`: the rows of the same
    matrix for other seeds; they are kept, and their "before" is reused rather than measured again. `train`: the
    harnesses trained behind, the matrix's rows (default: all of `harnesses`; each is evaluated behind all of them).
    `time_budget_s`: each run stops before the step that would end past it (GRPOTrainer.train), `steps` at most."""
    base = base or GRPOConfig(num_generations=8)

    def config(harness: str, seed: int) -> GRPOConfig:
        return dataclasses.replace(base, harness=harness, tasks_per_step=tasks_per_step, learning_rate=lr, seed=seed,
                                   eval_limit=eval_limit, output_dir=str(lab.run_dir / f"transfer-{harness}-{seed}"),
                                   eval_steps=0, time_budget_s=time_budget_s)  # evaluated after the last step

    def behind(harness: str):
        return get_harness(harness, base.harness_options)

    lab.sync_weights(shipped)
    before, shape = {}, {}
    if known is not None:
        first = known.drop_duplicates("eval").set_index("eval")
        for b in harnesses:
            before[b] = first.loc[b, "before"]
            shape[b] = {k.removeprefix("before_"): first.loc[b, k] for k in first.columns if k.startswith("before_")}
    else:
        with GRPOTrainer(lab, config(harnesses[0], seeds[0])) as probe:
            for b in harnesses:
                before[b] = probe.evaluate(harness=behind(b), progress=progress)["eval_reward"]
                shape[b] = sessions_shape(probe.last_eval_groups)
    rows = [] if known is None else known.to_dict("records")
    for a in train or harnesses:
        for seed in seeds:
            lab.sync_weights(shipped)
            with GRPOTrainer(lab, config(a, seed)) as trainer:
                t0 = time.perf_counter()
                trainer.train(steps, progress=progress)
                train_s, trained = time.perf_counter() - t0, len(trainer.history)
                for b in harnesses:
                    after = trainer.evaluate(harness=behind(b), progress=progress)["eval_reward"]
                    after_shape = sessions_shape(trainer.last_eval_groups)
                    rows.append({"train": a, "eval": b, "seed": seed, "before": before[b], "after": after,
                                 "gain": after - before[b], "train_s": train_s, "steps": trained,
                                 **{f"before_{k}": v for k, v in shape[b].items()},
                                 **{f"after_{k}": v for k, v in after_shape.items()}})
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
    rows, columns = list(dict.fromkeys(runs["train"])), list(dict.fromkeys(runs["eval"]))
    mean = cells["mean"].unstack().reindex(index=rows, columns=columns)
    std = cells["std"].unstack().reindex(index=rows, columns=columns)
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(columns), 1.2 + 1.0 * len(rows)))
    bound = max(float(mean.abs().max().max()), 1e-3)
    image = ax.imshow(mean.values, cmap="RdBu", vmin=-bound, vmax=bound)
    for i in range(len(rows)):
        for j in range(len(columns)):
            dark = abs(mean.values[i, j]) > 0.6 * bound
            ax.text(j, i, f"{mean.values[i, j]:+.3f}\n±{std.values[i, j]:.3f}", ha="center", va="center", fontsize=8,
                    color="white" if dark else "black")
    ax.set_xticks(range(len(columns)), columns, rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("evaluated behind")
    ax.set_ylabel("trained behind")
    ax.set_title(f"held-out gain ({runs['seed'].nunique()} seeds)")
    fig.colorbar(image, ax=ax, shrink=0.8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def shape_row(runs: pd.DataFrame, harness: str, evaluated: str | None = None) -> list:
    """Calls and chains per held-out session and failed runs behind `evaluated` (default: `harness`), before → after
    training behind `harness`; the seeds' mean."""
    evaluated = evaluated or harness
    own = runs[(runs["train"] == harness) & (runs["eval"] == evaluated)].mean(numeric_only=True)

    def pair(name: str) -> str:
        return f"{own[f'before_{name}']:.3g} → {own[f'after_{name}']:.3g}"

    return [evaluated, pair("calls_p50"), pair("calls_mean"), pair("chains_mean"), pair("failed")]


# Set by transfer_matrix for each run: a --set of one of them would be replaced without a word.
PER_RUN = ("harness", "tasks_per_step", "learning_rate", "seed", "eval_limit", "eval_steps", "output_dir",
           "time_budget_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--config", default=None, help="a `polar-lab train` YAML: its Lab and run settings "
                                                        "(--model is then ignored)")
    parser.add_argument("--harnesses", default=",".join(HARNESSES), help="evaluated behind (the columns)")
    parser.add_argument("--train", default=None, help="trained behind (the rows; default: every harness)")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tasks-per-step", type=int, default=None, help="tasks per step (8, or the config's)")
    parser.add_argument("--eval-limit", type=int, default=50)
    parser.add_argument("--lr", type=float, default=None, help="learning rate (1e-3, or the config's)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="each run stops before the step that would end past this many seconds of training")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=setting,
                        help="with --config: any other grpo setting (YAML value), e.g. --set overlong_buffer_len=192")
    parser.add_argument("--merge", default=None, help="a result file of the same matrix for other seeds: its runs "
                                                       "are kept and its 'before' reused")
    parser.add_argument("--out", default="benchmarks/results/harness_transfer.json")
    parser.add_argument("--plot", default="benchmarks/results/harness_transfer.png")
    args = parser.parse_args(argv)
    args.harnesses, args.seeds = args.harnesses.split(","), [int(x) for x in args.seeds.split(",")]
    args.train = args.train.split(",") if args.train else None
    if args.train and set(args.train) - set(args.harnesses):
        parser.error(f"--train {','.join(args.train)}: each must be one of --harnesses {','.join(args.harnesses)}")
    if args.set and not args.config:
        parser.error("--set needs --config (it overrides the config's grpo settings)")
    if set(dict(args.set)) & set(PER_RUN):
        parser.error(f"--set {sorted(set(dict(args.set)) & set(PER_RUN))}: the benchmark sets these per run; use its "
                     f"own flags (--steps, --tasks-per-step, --lr, --eval-limit, --budget-s, --seeds)")
    return args


def merged(args: argparse.Namespace) -> tuple[pd.DataFrame | None, int, list[str]]:
    """With --merge: the earlier file's runs (the same settings, other seeds), its wall time and the notes naming the
    commands of its seeds. Refuses a file made with other settings."""
    if not args.merge:
        return None, 0, []
    earlier = json.loads(Path(args.merge).read_text())
    keys = ("config", "steps", "tasks_per_step", "eval_limit", "lr", "budget_s", "set", "train")
    settings = {k: earlier["raw"].get(k) for k in keys}  # older files: no budget, --set or --train
    asked = {"config": args.config, "steps": args.steps, "tasks_per_step": args.tasks_per_step,
             "eval_limit": args.eval_limit, "lr": args.lr, "budget_s": args.budget_s, "set": dict(args.set) or None,
             "train": args.train}
    if settings != asked or set(earlier["raw"]["seeds"]) & set(args.seeds):
        raise SystemExit(f"--merge needs the same settings and other seeds: {args.merge} has {settings}, seeds "
                         f"{earlier['raw']['seeds']}; asked {asked}, seeds {args.seeds}")
    known = pd.DataFrame(earlier["raw"]["runs"])
    if "steps" not in known:  # before budgets, every run trained exactly the file's steps
        known["steps"] = earlier["raw"]["steps"]
    first = "" if "--merge" in earlier["command"] else " and the 'before' column"
    notes = [*(n for n in earlier["notes"] if n.startswith("seeds ")),  # the commands of the seeds before it
             f"seeds {earlier['raw']['seeds']}{first}: {earlier['command']}, {earlier['date']}"]
    return known, earlier["figures"]["wall, all runs (s)"], notes


def save_result(args: argparse.Namespace, runs: pd.DataFrame, base: GRPOConfig, model: str, elapsed: float,
                notes: list[str]) -> None:
    """The result file: before, the trained rows' gains (mean ± sd where a cell has seeds to spread), the matrix, and
    the held-out sessions' shape before → after (each trained harness behind itself; a lone row behind every one)."""
    from result import save

    harnesses, train = args.harnesses, list(dict.fromkeys(runs["train"]))
    cells, seeds = summary(runs), sorted(set(runs["seed"]))
    before = runs.drop_duplicates("eval").set_index("eval")["before"]

    def cell(a: str, b: str) -> str:
        spread = f" ± {cells.loc[(a, b), 'std']:.3f}" if cells.loc[(a, b), "seeds"] > 1 else ""
        return f"{round(cells.loc[(a, b), 'mean'], 3) + 0.0:+.3f}{spread}"  # + 0.0: no '-0.000'

    figures = {"held-out before": " / ".join(f"{b} {before[b]:.2f}" for b in harnesses),
               "gain behind the harness trained on": " / ".join(f"{a} {cell(a, a)}" for a in train)}
    if args.budget_s:
        steps_run = runs.drop_duplicates(["train", "seed"]).groupby("train")["steps"].agg(["min", "max"])
        figures[f"steps run (at most {args.steps})"] = " / ".join(
            f"{a} {lo}" if lo == hi else f"{a} {lo}–{hi}" for a, (lo, hi) in steps_run.iterrows())
    one_row = len(train) == 1 and len(harnesses) > 1
    save("harness_transfer", {**figures, "wall, all runs (s)": elapsed},
         tables=[{"title": f"Gain ({'mean ± sd over seeds' if len(seeds) > 1 else 'one seed'}): trained behind ↓ / "
                           "evaluated behind →",
                  "columns": ["trained behind", *harnesses],
                  "rows": [[a, *(cell(a, b) for b in harnesses)] for a in train]},
                 {"title": "Held-out sessions behind each harness, before → after training behind "
                           + (train[0] if one_row else "it") + " (seeds' mean)",
                  "columns": ["harness", "calls per session: median", "mean", "chains per session", "failed runs"],
                  "rows": [shape_row(runs, a, b) for a in train for b in (harnesses if one_row else [a])]}],
         notes=[f"{len(seeds)} seeds × {'up to ' if args.budget_s else ''}{args.steps} sync steps"
                + (f" within {args.budget_s:g} s of training" if args.budget_s else "")
                + f" of {args.tasks_per_step} tasks × {base.num_generations} runs, lr {args.lr:g}"
                + "".join(f", {k}={v}" for k, v in args.set) + f", {args.eval_limit} held-out tasks"
                + (f"; every other setting from {args.config}" if args.config else ""), *notes],
         title="Harness transfer" + (" behind the CLIs" if args.config else "")
               + (f", trained behind {train[0]}" if one_row else ""),
         raw={"model": model, "config": args.config, "steps": args.steps, "seeds": seeds,
              "tasks_per_step": args.tasks_per_step, "eval_limit": args.eval_limit, "lr": args.lr,
              "budget_s": args.budget_s, "set": dict(args.set) or None, "train": args.train,
              "runs": runs.to_dict("records")}, out=args.out)


def main(argv: list[str] | None = None) -> None:
    from learning_rate import shipped_weights  # benchmarks/ is on the path when run

    args = parse_args(argv)
    run_name = time.strftime("bench-transfer-%Y%m%d-%H%M%S")
    if args.config:  # the settings first: a bad --merge is refused before an engine starts
        from polar_lab.grpo.run import load_train_config

        lab_config, base = load_train_config(args.config, dict(args.set))
        lab_config = dataclasses.replace(lab_config, store=dataclasses.replace(lab_config.store, run_name=run_name))
        model = lab_config.engine.model
    else:
        lab_config, base, model = None, GRPOConfig(num_generations=8), args.model
    args.lr = args.lr or (base.learning_rate if args.config else 1e-3)
    args.tasks_per_step = args.tasks_per_step or (base.tasks_per_step if args.config else 8)
    known, earlier_s, notes = merged(args)
    t0 = time.perf_counter()
    with Lab(config=lab_config) if lab_config else Lab(model, port=0, run_name=run_name) as lab:
        runs = transfer_matrix(lab, shipped_weights(lab), args.harnesses, seeds=args.seeds, steps=args.steps,
                               base=base, tasks_per_step=args.tasks_per_step, eval_limit=args.eval_limit, lr=args.lr,
                               known=known, train=args.train, time_budget_s=args.budget_s)
    with pd.option_context("display.width", 160, "display.float_format", "{:+.3f}".format):
        print(runs.to_string(index=False))
        print(f"\n{runs['seed'].nunique()} seeds x {args.steps} steps of {args.tasks_per_step} tasks, eval "
              f"{args.eval_limit} tasks, {time.perf_counter() - t0:.0f} s in all\n")
        print(summary(runs).to_string())
    save_result(args, runs, base, model, round(time.perf_counter() - t0) + earlier_s, notes)
    plot(runs, args.plot)


if __name__ == "__main__":
    main()
