"""Reward functions: plain functions of (task, final text) returning the total beside its components."""

from polar_lab.rewards.numeric import final_answer, last_integer, numeric_match

__all__ = ["final_answer", "last_integer", "numeric_match"]
