"""Several harnesses in one training run, one per task — the paper trains one policy behind Codex, Claude Code,
Qwen Code and Pi. In a config: `grpo: {harness: [codex, claude_code], harness_options: {codex: {...},
claude_code: {...}}}`.

Every run of a task goes through the same harness, so a group's advantages compare runs of one harness; tasks take
the harnesses in turn, in the order they are first run (deterministic for a given task order). Each session records
the harness it ran (`harness_name(mixture, task)`, rollout.py), so calls, rewards and chains can be read per
harness."""

from __future__ import annotations

import json
from typing import Any

from polar_lab.types import Harness, Session


class HarnessMixture:
    def __init__(self, harnesses: dict[str, Harness]):
        if not harnesses:
            raise ValueError("a harness mixture needs at least one harness")
        self.harnesses = dict(harnesses)
        self._names = list(self.harnesses)
        self._by_task: dict[str, str] = {}

    def name_for(self, task: dict[str, Any]) -> str:
        """The harness this task's runs go through: the next one in turn the first time the task is seen."""
        key = str(task["id"]) if "id" in task else json.dumps(task, sort_keys=True, default=str)
        if key not in self._by_task:
            self._by_task[key] = self._names[len(self._by_task) % len(self._names)]
        return self._by_task[key]

    async def __call__(self, session: Session, task: dict[str, Any]) -> dict[str, Any]:
        return await self.harnesses[self.name_for(task)](session, task)

    def __repr__(self) -> str:
        return f"HarnessMixture({self._names})"
