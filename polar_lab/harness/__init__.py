"""Harnesses: programs that talk to a model API. The Lab runs them unmodified against a session."""

from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT, calculator_agent, safe_eval

__all__ = ["CALC_TOOL", "SYSTEM_PROMPT", "calculator_agent", "safe_eval"]
