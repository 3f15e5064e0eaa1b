"""Evaluators by name: `lab.rollout(..., evaluator="final_answer")`.

An evaluator is a plain function `(task, harness_result) -> {"total": float, <component>: float, ...}`.
Register your own with `@register("name")`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polar_lab.rewards.code import repo_tests, unit_tests
from polar_lab.rewards.numeric import final_answer
from polar_lab.types import Evaluator

EVALUATORS: dict[str, Evaluator] = {}


def register(name: str) -> Callable[[Evaluator], Evaluator]:
    def add(fn: Evaluator) -> Evaluator:
        EVALUATORS[name] = fn
        return fn

    return add


def session_completed(task: dict[str, Any], result: Any) -> dict[str, float]:
    """1.0 for any run that finished (crashed and timed-out runs never reach an evaluator).

    >>> session_completed({}, {"final": ""})
    {'total': 1.0}
    """
    return {"total": 1.0}


def get_evaluator(evaluator: str | Evaluator | None) -> Evaluator | None:
    if evaluator is None or callable(evaluator):
        return evaluator
    if evaluator not in EVALUATORS:
        raise KeyError(f"unknown evaluator {evaluator!r}; registered: {sorted(EVALUATORS)}")
    return EVALUATORS[evaluator]


for _name, _fn in (("final_answer", final_answer), ("unit_tests", unit_tests), ("repo_tests", repo_tests),
                   ("session_completed", session_completed)):
    register(_name)(_fn)
