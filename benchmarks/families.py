"""Per model family: which parsers "auto" picks, how often first turns are calls vLLM's parser reads, the chains
of the calculator agent under "splice" and "template" continuity, and engine vs trainer logprobs.

For each fixture, one Lab (real vLLM on CPU) runs the calculator agent (an OpenAI-SDK loop that echoes calls
without their thought) on `--tasks` test tasks, `--runs` seeded runs each, once per continuity policy; the same
seeds in both (one per run), so both policies see the same first turns. Prints one JSON line per family and a
markdown table; writes benchmarks/results/families.json.

    python benchmarks/families.py [--tasks 20] [--runs 2] [--models tiny-calc tiny-calc-qwen35 ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from polar_lab import Lab
from polar_lab.harness.calculator import calculator_agent
from polar_lab.tasks import load_tasks
from polar_lab.trajectory.fidelity import fidelity

from result import save

MODELS = ["tiny-calc", "tiny-calc-qwen35", "tiny-calc-llama3", "tiny-calc-mistral"]


def run_policy(lab: Lab, tasks: list[dict], runs: int, continuity: str) -> dict:
    """Run every task `runs` times under one continuity policy; the sessions' chains and breaks."""
    sessions = []
    for i, task in enumerate(tasks):
        for run in range(runs):
            # a seed per run: one seed for every task would draw the same random numbers at every first token
            s = lab.session(task, sampling={"seed": i * runs + run}, continuity=continuity, harness=continuity)
            lab.run(calculator_agent(s, task), timeout=300)
            s.close()
            sessions.append(s)
    ids = [s.id for s in sessions]
    calls = lab.call_records(ids)
    chains = lab.trajectories("prefix_merging", session_ids=ids)
    breaks = lab.chain_breaks()
    kinds = breaks[breaks.session_id.isin(ids)].kind.value_counts().to_dict()
    first = [c for c in calls if c.call_index == 0]
    return {"sessions": len(ids), "calls": len(calls), "chains": len(chains),
            "breaks": kinds, "first_turn_calls": sum(c.parse["num_tool_calls"] > 0 for c in first) / len(first),
            "chain_list": chains}


def measure(model: str, tasks: list[dict], runs: int) -> dict:
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    with Lab(f"data/models/{model}", port=0, run_name=f"bench-families-{model}") as lab:
        out = {"model": model, **lab.parsers}
        for policy in ("splice", "template"):
            out[policy] = run_policy(lab, tasks, runs, policy)
        hf = AutoModelForCausalLM.from_pretrained(f"data/models/{model}", dtype="float32").eval()
        report = fidelity(out["splice"].pop("chain_list"), hf)
        out["template"].pop("chain_list")
        out["fidelity_mean_abs_diff"] = float(report["mean_abs_diff"].mean())
        out["fidelity_max_abs_diff"] = float(report["max_abs_diff"].max())
    out["seconds"] = round(time.time() - t0, 1)
    return out


COLUMNS = ["model", "parsers (auto)", "first turns that are calls", "splice: chains / sessions, breaks",
           "template: chains / sessions, breaks", "engine vs trainer mean / max abs diff"]


def table(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        sp, tp = r["splice"], r["template"]
        out.append([f"`{r['model']}`", f"`{r['tool_parser']}`, `{r['reasoning_parser']}`",
                    f"{sp['first_turn_calls']:.0%}", f"{sp['chains']} / {sp['sessions']}, {sp['breaks'] or 'none'}",
                    f"{tp['chains']} / {tp['sessions']}, {tp['breaks'] or 'none'}",
                    f"{r['fidelity_mean_abs_diff']:.1e} / {r['fidelity_max_abs_diff']:.1e}"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", type=int, default=20)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--models", nargs="+", default=MODELS)
    args = p.parse_args()
    tasks = load_tasks("data/tasks/calc_test.jsonl", args.tasks)
    rows = []
    for model in args.models:
        if not (Path("data/models") / model / "model.safetensors").exists():
            print(f"skipping {model}: not built")
            continue
        rows.append(measure(model, tasks, args.runs))
        print(json.dumps(rows[-1]), flush=True)
    print("\n".join(["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
                    + ["| " + " | ".join(row) + " |" for row in table(rows)]))
    calls = min(r["splice"]["first_turn_calls"] for r in rows)
    mean, most = (max(r[f"fidelity_{k}_abs_diff"] for r in rows) for k in ("mean", "max"))
    save("families", {"fixtures": len(rows), "first turns that are calls, lowest": f"{calls:.0%}",
                      "engine vs trainer mean / max abs diff, largest": f"{mean:.1e} / {most:.1e}"},
         tables=[{"title": f"Per fixture, {args.tasks} tasks × {args.runs} runs per policy", "columns": COLUMNS,
                  "rows": table(rows)}],
         title="Model families through the proxy",
         raw={"tasks": args.tasks, "runs": args.runs, "rows": rows})


if __name__ == "__main__":
    main()
