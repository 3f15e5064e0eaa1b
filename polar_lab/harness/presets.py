"""Presets: real agent programs, unmodified, as `Command` harnesses pointed at a session.

Each preset only supplies what the program needs to talk to the Lab offline (its own config flags and
environment variables); the program itself is the published one.
"""

from __future__ import annotations

from polar_lab.harness.command import Command


def mini_swe_agent(*, step_limit: int = 3, model: str = "tiny-calc", task_field: str = "question") -> Command:
    """mini-swe-agent (PyPI `mini-swe-agent`): non-streaming chat completions with a `bash` tool.

    It talks to OPENAI_BASE_URL through litellm (`openai/<model>`); cost tracking off (no price for a local
    model), a step limit so a small model cannot loop, and the trajectory written into the workdir.
    Note it drops a malformed assistant turn from its history and adds an error message instead, so its
    calls break chains by design (visible in `lab.drift_report()`).
    """
    return Command(
        ["{bin}/mini", "-m", f"openai/{model}", "-t", "{" + task_field + "}", "--yolo", "--exit-immediately",
         "-o", "traj.json", "-c", "mini.yaml", "-c", f"agent.step_limit={step_limit}"],
        env={"MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors",
             "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        name="mini-swe-agent")
