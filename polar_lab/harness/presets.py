"""Presets: real agent programs, unmodified, as `Command` harnesses pointed at a session.

Each preset only supplies what the program needs to talk to the Lab offline (its own config flags and
environment variables); the program itself is the published one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import openai

from polar_lab.harness.calculator import SYSTEM_PROMPT, run_calculator
from polar_lab.harness.command import Command
from polar_lab.types import Session


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


def agents_bin(name: str) -> str:
    """Where an npm agent's executable is: $POLAR_LAB_AGENTS_DIR, this checkout's .cache/agents (`make agents`),
    or PATH."""
    folders = [os.environ.get("POLAR_LAB_AGENTS_DIR", ""), str(Path(__file__).resolve().parents[2] / ".cache" / "agents")]
    for folder in folders:
        candidate = Path(folder) / "node_modules" / ".bin" / name
        if folder and candidate.exists():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed: run `make agents` (npm) or put it on PATH")
    return found


def install_root(executable: str) -> str:
    """The folder an npm agent is installed in (what an isolated sandbox shows it, read-only): the folder
    holding its node_modules, else the executable's own folder.

    >>> install_root("/work/.cache/agents/node_modules/.bin/claude")
    '/work/.cache/agents'
    """
    parts = Path(executable).parts
    if "node_modules" in parts:
        return str(Path(*parts[:parts.index("node_modules")]))
    return str(Path(executable).parent)


# Node reserves large virtual ranges at start-up; RLIMIT_AS has to leave room for them.
_NODE_MEMORY_MB = 16384


def claude_code(*, model: str = "tiny-calc", bare: bool = True, task_field: str = "question",
                workspace: str | None = None) -> Command:
    """Claude Code (npm `@anthropic-ai/claude-code`) in print mode, against the session's Anthropic URL.

    `--bare` keeps the request at ~4 KB (3 tools) so it fits a small model's context; without it the
    request is ~76 KB with 24 tools. Non-essential traffic and telemetry are off: no outside connections.
    `workspace`: the task field holding a repository to start in (SWE-style tasks, `repo_tests`); then it
    runs with `--dangerously-skip-permissions` so that it can edit it, and refuses to run outside the isolated sandbox.
    """
    argv = [agents_bin("claude"), "-p", "{" + task_field + "}", "--output-format", "json", "--model", model]
    if workspace:  # it must edit the repository without asking; polar_lab's sandbox is the boundary
        argv.append("--dangerously-skip-permissions")
    return Command(argv + (["--bare"] if bare else []), memory_mb=_NODE_MEMORY_MB, name="claude-code",
                   readonly=[install_root(argv[0])], workspace=workspace, isolated_only=bool(workspace),
                   env={"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                        "IS_SANDBOX": "1"})


CODEX_CONFIG = """model = "{model}"
model_provider = "polar"
check_for_update_on_startup = false
web_search = "disabled"
[model_providers.polar]
name = "polar"
base_url = "{openai_base_url}"
env_key = "OPENAI_API_KEY"
wire_api = "responses"
[analytics]
enabled = false
[feedback]
enabled = false
[features]
plugins = false
remote_plugin = false
apps = false
goals = false
image_generation = false
[agents]
enabled = false
"""


def codex(*, model: str = "tiny-calc", task_field: str = "question", workspace: str | None = None) -> Command:
    """Codex CLI (npm `@openai/codex`) `exec` mode. It ignores OPENAI_BASE_URL, so a provider config pointing at
    the session's Responses endpoint is written into its own CODEX_HOME (quiet: 4 function tools, no
    plugins, analytics or web search). `workspace`: the task field holding a repository to start in; then
    Codex's own sandbox (read-only by default in `exec`) is turned off with the flag its docs give for
    "environments that are externally sandboxed", so that it can edit it; it then refuses to run outside the
    isolated sandbox."""
    executable = agents_bin("codex")
    writes = ["--dangerously-bypass-approvals-and-sandbox"] if workspace else []
    return Command([executable, "exec", "--skip-git-repo-check", "--ephemeral", *writes, "{" + task_field + "}"],
                   files={"codex-home/config.toml": CODEX_CONFIG.replace("{model}", model)},
                   readonly=[install_root(executable)],
                   env={"CODEX_HOME": "{workdir}/codex-home"}, memory_mb=_NODE_MEMORY_MB, name="codex",
                   workspace=workspace, isolated_only=bool(workspace))


async def openai_agents_calculator(session: Session, task: dict[str, Any], *, max_turns: int = 4) -> dict[str, Any]:
    """An OpenAI Agents SDK agent (PyPI `openai-agents`) with a calculator function tool, over the Responses
    surface. The SDK is used as published; only its client points at the session (tracing off: no uploads)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return run_calculator(json.dumps({"expression": expression}))

    client = openai.AsyncOpenAI(base_url=session.openai_base_url, api_key=session.api_key, max_retries=0)
    agent = Agent(name="calculator", instructions=SYSTEM_PROMPT, tools=[calculator],
                  model=OpenAIResponsesModel("tiny-calc", client), model_settings=ModelSettings(max_tokens=128))
    result = await Runner.run(agent, task["question"], max_turns=max_turns)
    return {"final": str(result.final_output)}
