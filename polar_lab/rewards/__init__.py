"""Reward functions: plain functions of (task, harness result) returning the total beside its components."""

from polar_lab.rewards.code import repo_tests, unit_tests
from polar_lab.rewards.numeric import final_answer, last_integer, numeric_match
from polar_lab.rewards.registry import EVALUATORS, get_evaluator, register, session_completed

__all__ = ["EVALUATORS", "final_answer", "get_evaluator", "last_integer", "numeric_match", "register",
           "repo_tests", "session_completed", "unit_tests"]
