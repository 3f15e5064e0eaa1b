"""The kernel's CPU per harness run, with the SDK clients sharing one TLS context and with one context per client.

Each run of an in-kernel harness makes its own SDK client, and httpx builds a TLS context for every client, loading
the system's CA bundle again. polar_lab's harnesses share one context per process (polar_lab/harness/clients.py).
This runs the calculator agent `--runs` times on a scripted engine (so the engine's work does not count) both ways,
alternating rounds, and reports the kernel process's CPU seconds per run (`time.process_time`, all its threads:
the harness, the proxy, the store).

    python benchmarks/harness_overhead.py [--runs 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import openai
from transformers import AutoTokenizer

from polar_lab import Lab
from polar_lab.engine import ScriptedEngine
from polar_lab.harness import calculator_agent

from result import save


async def own_context(session, task):
    """The calculator agent with a client that builds its own TLS context, as the SDK does by default."""
    return await calculator_agent(session, task, http_client=openai.DefaultAsyncHttpxClient())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--runs", type=int, default=128, help="runs per round (a GRPO step of 16 tasks × 8)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine = ScriptedEngine(tokenizer, ["The answer is 2."], model_path=args.model)
    tasks = [{"question": "1+1", "answer": "2"}] * (args.runs // 8)
    per_run = {"shared context": [], "a context per client": []}
    walls = {name: [] for name in per_run}
    with tempfile.TemporaryDirectory() as runs, Lab(port=0, engine=engine, runs_dir=runs) as lab:
        lab.rollout(tasks[:1], calculator_agent, progress=False)  # imports and first contexts, not counted
        for _ in range(args.rounds):
            for name, harness in (("shared context", calculator_agent), ("a context per client", own_context)):
                cpu, wall = time.process_time(), time.perf_counter()
                groups = lab.rollout(tasks, harness, num_generations=8, progress=False)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                runs_done = sum(len(g.sessions) for g in groups)
                per_run[name].append(cpu / runs_done)
                walls[name].append(wall)
                print(f"{name:>22}: {runs_done} runs, kernel CPU {cpu:.2f} s ({cpu / runs_done * 1e3:.1f} ms per run), "
                      f"wall {wall:.2f} s", flush=True)
    shared, own = (statistics.median(v) * 1e3 for v in per_run.values())
    print(f"median kernel CPU per run: {shared:.1f} ms with the shared context, {own:.1f} ms with one per client "
          f"({own - shared:+.1f} ms per run; {(own - shared) * args.runs / 1e3:.2f} s per {args.runs} runs)")
    save("harness_overhead", {
        "kernel CPU per run, shared TLS context (ms, median)": round(shared, 1),
        "kernel CPU per run, a context per client (ms, median)": round(own, 1),
        **{f"{args.runs} runs, wall, {name} (s)": f"{min(w):.2f}–{max(w):.2f}" for name, w in walls.items()}},
        tables=[{"title": "Kernel CPU per run (ms), each round",
                 "columns": ["SDK clients", *(f"round {i + 1}" for i in range(args.rounds))],
                 "rows": [[name, *(round(v * 1e3, 1) for v in values)] for name, values in per_run.items()]}],
        title="A harness run's cost in the kernel",
        raw={"runs": args.runs, "rounds": args.rounds, "cpu_per_run_s": per_run, "wall_s": walls})


if __name__ == "__main__":
    main()
