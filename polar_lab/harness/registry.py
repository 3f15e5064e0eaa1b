"""Harnesses by name, for configs and the CLI: `grpo: {harness: calculator}` or `"my_pkg.agents:solve"`."""

from __future__ import annotations

import importlib

from polar_lab.harness.calculator import calculator_agent
from polar_lab.harness.code_agent import code_agent
from polar_lab.harness.multiagent import planner_solver
from polar_lab.types import Harness

HARNESSES: dict[str, Harness] = {
    "calculator": calculator_agent,  # openai-SDK tool loop, the tiny model's home task
    "code_agent": code_agent,  # writes a function, runs the task's unit tests, retries
    "planner_solver": planner_solver,  # two agents, two chains per session
}


def get_harness(name: str | Harness) -> Harness:
    """A registered name, or 'module:attribute' naming any async callable (or Command) importable here."""
    if callable(name):
        return name
    if name in HARNESSES:
        return HARNESSES[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr)
    raise KeyError(f"unknown harness {name!r}; registered: {sorted(HARNESSES)}, or use 'module:function'")
