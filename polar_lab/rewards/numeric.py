"""Numeric answer matching for arithmetic tasks."""

from __future__ import annotations

import re
from typing import Any

_INT = re.compile(r"-?\d+")


def last_integer(text: str | None) -> int | None:
    """The last integer written in `text`, or None.

    >>> last_integer("3*7+2 = 23")
    23
    """
    found = _INT.findall(text or "")
    return int(found[-1]) if found else None


def numeric_match(task: dict[str, Any], final_text: str | None) -> dict[str, float]:
    """1.0 when the last integer of the final answer equals `task["answer"]`.

    >>> numeric_match({"answer": 23}, "The answer is 23.")
    {'total': 1.0, 'has_number': 1.0, 'correct': 1.0}
    """
    value = last_integer(final_text)
    correct = float(value is not None and value == task["answer"])
    return {"total": correct, "has_number": float(value is not None), "correct": correct}


def final_answer(task: dict[str, Any], result: Any) -> dict[str, float]:
    """Evaluator for harnesses that return {"final": text}: numeric match of the final text.

    >>> final_answer({"answer": 5}, {"final": "It equals 5."})["total"]
    1.0
    """
    final = result.get("final") if isinstance(result, dict) else result
    return numeric_match(task, final)
