"""The README's first command: N concurrent calculator sessions against a fresh Lab, summarised in a table.

Everything is real: vLLM serves the shipped tiny model, the harness is the official openai SDK over
HTTP, and every call lands in the run folder (`data/runs/<run>/`), with `summary.json` beside it.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pandas as pd

from polar_lab.config import DEFAULT_MODEL
from polar_lab.harness.calculator import calculator_agent
from polar_lab.lab import Lab
from polar_lab.rewards import final_answer
from polar_lab.tasks import load_tasks


def summarize(calls: pd.DataFrame, runs: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    first = calls[calls.call_index == 0]
    attempted = calls[(calls.tool_calls > 0) | (calls.tool_parse_errors > 0)]
    proxy_ms = calls.proxy_s.to_numpy() * 1000
    completion = int(calls.completion_tokens.sum())
    return {
        "sessions": len(runs),
        "failed_sessions": sum(r["error"] is not None for r in runs),
        "calls": len(calls),
        "prompt_tokens": int(calls.prompt_tokens.sum()),
        "completion_tokens": completion,
        "first_turn_tool_call_rate": float((first.tool_calls > 0).mean()) if len(first) else 0.0,
        "tool_call_parse_rate": float((attempted.tool_parse_errors == 0).mean()) if len(attempted) else 0.0,
        "accuracy": float(np.mean([r["reward"] or 0.0 for r in runs])) if runs else 0.0,
        "proxy_ms_p50": float(np.percentile(proxy_ms, 50)) if len(calls) else 0.0,
        "proxy_ms_p99": float(np.percentile(proxy_ms, 99)) if len(calls) else 0.0,
        "engine_s_mean": float(calls.engine_s.mean()) if len(calls) else 0.0,
        "wall_s": wall_s,
        "completion_tokens_per_s": completion / wall_s if wall_s else 0.0,
    }


def run_demo(model: str = DEFAULT_MODEL, *, sessions: int = 32, tasks_path: str = "data/tasks/calc_test.jsonl",
             run_name: str | None = None, port: int = 0, temperature: float = 1.0) -> dict[str, Any]:
    tasks = load_tasks(tasks_path, sessions)
    t0 = time.perf_counter()
    with Lab(model, port=port, run_name=run_name) as lab:
        startup_s = time.perf_counter() - t0
        print(f"Lab up in {startup_s:.1f} s: {lab.url}  run folder: {lab.run_dir}", flush=True)
        t1 = time.perf_counter()

        async def calculator(session, task):
            return await calculator_agent(session, task, temperature=temperature)

        groups = lab.rollout(tasks, calculator, num_generations=1, evaluator=final_answer, concurrency=sessions)
        runs = [{"error": s.info.get("error", s.status) if s.status != "closed" else None, "reward": s.reward}
                for g in groups for s in g.sessions]
        summary = {"model": model, "startup_s": startup_s,
                   **summarize(lab.calls(), runs, time.perf_counter() - t1)}
        (lab.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        summary["run_dir"] = str(lab.run_dir)
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    rows = [(k, f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in summary.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
