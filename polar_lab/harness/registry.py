"""Harnesses by name, for configs and the CLI: `grpo: {harness: calculator}` or `"my_pkg.agents:solve"`; the
unmodified CLI agents by preset name with their options: `grpo: {harness: codex, harness_options: {...}}`."""

from __future__ import annotations

import importlib

from polar_lab.harness.calculator import calculator_agent
from polar_lab.harness.calculator_apis import anthropic_calculator_agent, google_calculator_agent
from polar_lab.harness.code_agent import code_agent
from polar_lab.harness.command import Command
from polar_lab.harness.mixture import HarnessMixture
from polar_lab.harness.multiagent import planner_solver
from polar_lab.harness.presets import claude_code, codex, gemini_cli, mini_swe_agent, opencode, pi, qwen_code
from polar_lab.types import Harness

HARNESSES: dict[str, Harness] = {
    "calculator": calculator_agent,  # openai-SDK tool loop, the tiny model's home task
    "calculator_anthropic": anthropic_calculator_agent,  # the same task over the Anthropic SDK's tool loop
    "calculator_google": google_calculator_agent,  # ... and google-genai's
    # the same loop as a program of its own, run in the sandbox (polar_lab/harness/calc_cli.py)
    "calc_cli": Command(["{python}", "-m", "polar_lab.harness.calc_cli", "{question}"], name="calc_cli"),
    "code_agent": code_agent,  # writes a function, runs the task's unit tests, retries
    "planner_solver": planner_solver,  # two agents, two chains per session
}

PRESETS = {  # real CLI agents (harness/presets.py): a Command from keyword options
    "codex": codex,
    "claude_code": claude_code,
    "mini_swe_agent": mini_swe_agent,
    "qwen_code": qwen_code,
    "gemini_cli": gemini_cli,
    "pi": pi,
    "opencode": opencode,
}


def get_harness(name: str | list[str] | Harness, options: dict | None = None) -> Harness:
    """A registered name, a preset with its `options` (keyword arguments of harness/presets.py's function,
    e.g. {"task_field": "prompt", "workspace": "files"}), or 'module:attribute' naming any async callable (or
    Command) importable here. A list of names is a mixture, one harness per task (harness/mixture.py); its
    `options` are keyed by name."""
    if isinstance(name, (list, tuple)):
        unknown = set(options or {}) - set(name)
        if unknown:
            raise ValueError(f"harness_options for a list of harnesses are keyed by their names; {sorted(unknown)} "
                             f"is not among {list(name)}")
        return HarnessMixture({n: get_harness(n, (options or {}).get(n)) for n in name})
    if isinstance(name, str) and name in PRESETS:  # (a Command is a dataclass: unhashable)
        return PRESETS[name](**(options or {}))
    if options:
        raise ValueError(f"harness_options are for the presets {sorted(PRESETS)}, not {name!r}")
    if callable(name):
        return name
    if name in HARNESSES:
        return HARNESSES[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr)
    raise KeyError(f"unknown harness {name!r}; registered: {sorted(HARNESSES)}, presets: {sorted(PRESETS)}, or "
                   f"use 'module:function'")
