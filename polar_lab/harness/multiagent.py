"""A two-agent harness in one session: a planner (its own system prompt) writes a plan, then a solver — the
calculator agent — works from it. The two conversations become two chains of the same session.
"""

from __future__ import annotations

from typing import Any

from polar_lab.harness.calculator import calculator_agent
from polar_lab.harness.clients import openai_client
from polar_lab.types import Session

PLANNER = "You are a planner. Restate the arithmetic problem as one expression for a calculator."


async def planner_solver(session: Session, task: dict[str, Any]) -> dict[str, Any]:
    async with openai_client(session, max_retries=0) as client:
        plan = await client.chat.completions.create(
            model="tiny-calc", max_tokens=64,
            messages=[{"role": "system", "content": PLANNER}, {"role": "user", "content": task["question"]}])
    note = plan.choices[0].message.content or ""
    solved = await calculator_agent(session, {**task, "question": f"{task['question']} (plan: {note.strip()})"})
    return {**solved, "plan": note}
