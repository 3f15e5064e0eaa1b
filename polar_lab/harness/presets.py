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

from polar_lab.harness.calculator import SYSTEM_PROMPT, run_calculator
from polar_lab.harness.clients import openai_client
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
# Agents that call the model with Node's own fetch (undici) instantiate its HTTP parser as WebAssembly, and V8
# reserves ~10 GB of address space per WebAssembly memory: under 16 GB of RLIMIT_AS fetch fails ("fetch failed",
# "Cannot allocate Wasm memory"). Address space, not memory: their RLIMIT_AS is 64 GB, while the memory cgroup
# (where one can be made) stays at the Node agents' 16 GB.
_FETCH_ADDRESS_MB = 65536


def claude_code(*, model: str = "tiny-calc", bare: bool = True, task_field: str = "question",
                workspace: str | None = None, run_commands: bool = True) -> Command:
    """Claude Code (npm `@anthropic-ai/claude-code`) in print mode, against the session's Anthropic URL.

    `--bare` keeps the request at ~4 KB (3 tools: Bash, Edit, Read) so it fits a small model's context; without it
    the request is ~76 KB with 24 tools. Non-essential traffic and telemetry are off: no outside connections.
    `workspace`: the task field holding a repository to start in (SWE-style tasks, `repo_tests`).
    `run_commands` (the default): it runs the model's commands and edits without asking
    (`--dangerously-skip-permissions`) — in print mode nobody can approve them, and each would come back as "This
    command requires approval" — and so it refuses to run outside the isolated sandbox, which is the boundary.
    Its final answer is the `result` of the JSON it prints.
    """
    argv = [agents_bin("claude"), "-p", "{" + task_field + "}", "--output-format", "json", "--model", model]
    if run_commands:
        argv.append("--dangerously-skip-permissions")
    return Command(argv + (["--bare"] if bare else []), memory_mb=_NODE_MEMORY_MB, name="claude-code",
                   readonly=[install_root(argv[0])], workspace=workspace, isolated_only=run_commands,
                   final_field="result",
                   env={"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                        "IS_SANDBOX": "1"})


CODEX_CONFIG = """model = "{model}"
model_provider = "polar"
check_for_update_on_startup = false
web_search = "disabled"
allow_login_shell = false
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


def codex(*, model: str = "tiny-calc", task_field: str = "question", workspace: str | None = None,
          run_commands: bool = True) -> Command:
    """Codex CLI (npm `@openai/codex`) `exec` mode. It ignores OPENAI_BASE_URL, so a provider config pointing at
    the session's Responses endpoint is written into its own CODEX_HOME (quiet: 4 function tools, no
    plugins, analytics or web search). `workspace`: the task field holding a repository to start in.
    `run_commands` (the default): Codex's own sandbox is turned off with the flag its docs give for "environments
    that are externally sandboxed" — it cannot start inside polar_lab's (it re-executes itself as
    `codex-linux-sandbox`, which is not there: every command would fail) — and so it refuses to run outside the
    isolated sandbox, which is the boundary. False: Codex's own read-only sandbox, for the process level."""
    executable = agents_bin("codex")
    writes = ["--dangerously-bypass-approvals-and-sandbox"] if run_commands else []
    return Command([executable, "exec", "--skip-git-repo-check", "--ephemeral", *writes, "{" + task_field + "}"],
                   files={"codex-home/config.toml": CODEX_CONFIG.replace("{model}", model)},
                   readonly=[install_root(executable)],
                   env={"CODEX_HOME": "{workdir}/codex-home"}, memory_mb=_NODE_MEMORY_MB, name="codex",
                   workspace=workspace, isolated_only=run_commands)


# Qwen Code's settings: no usage statistics (by default it reports to Aliyun RUM), and no "managed memory" sub-agent
# (a second model call per run, with its own prompt: a second chain).
QWEN_SETTINGS = json.dumps({"privacy": {"usageStatisticsEnabled": False},
                            "memory": {"enableManagedAutoMemory": False}})


def qwen_code(*, model: str = "tiny-calc", task_field: str = "question", max_output_tokens: int = 1024,
              bare: bool = True, workspace: str | None = None, run_commands: bool = True) -> Command:
    """Qwen Code (npm `@qwen-code/qwen-code`) headless (`-p`) over Chat Completions (`--auth-type openai`: the
    session's OPENAI_BASE_URL / OPENAI_API_KEY), streaming. `--bare` (its minimal mode: no skills, no deferred-tool
    registry) keeps the first prompt at ~12k tokens of tiny-calc's tokenizer with 6 tools (`run_shell_command`,
    `read_file`, `edit`...); without it ~21k. `max_output_tokens` (QWEN_CODE_MAX_OUTPUT_TOKENS): its default, 32,000,
    does not fit beside that prompt in a 32k context. Its settings file turns usage statistics and the memory
    sub-agent off (docs/harnesses.md). `workspace`: the task field holding a repository to start in.
    `run_commands` (the default): `--approval-mode yolo` — headless, it leaves out the shell and edit tools unless
    they need no approval — and so it refuses to run outside the isolated sandbox, which is the boundary. `--bare`
    ignores the settings file, so its usage statistics are on: it too runs only in the isolated sandbox, which has
    no network to send them over."""
    executable = agents_bin("qwen")
    flags = (["--approval-mode", "yolo"] if run_commands else []) + (["--bare"] if bare else [])
    return Command([executable, "--auth-type", "openai", *flags, "-p", "{" + task_field + "}"],
                   files={".qwen/settings.json": QWEN_SETTINGS}, readonly=[install_root(executable)],
                   env={"OPENAI_MODEL": model, "QWEN_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens)},
                   memory_mb=_NODE_MEMORY_MB, address_mb=_FETCH_ADDRESS_MB, name="qwen-code", workspace=workspace,
                   isolated_only=run_commands or bare)


# Gemini CLI's settings: the API-key auth (no login prompt), no usage statistics (Clearcut, play.googleapis.com),
# no telemetry, no update checks.
GEMINI_SETTINGS = json.dumps({"security": {"auth": {"selectedType": "gemini-api-key"}},
                              "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
                              "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False}})


def gemini_cli(*, model: str = "tiny-calc", task_field: str = "question") -> Command:
    """Gemini CLI (npm `@google/gemini-cli`) headless (`-p`) over Google's generateContent (the session's
    GEMINI_API_KEY and GOOGLE_GEMINI_BASE_URL), 8 function declarations, a ~14.5k-token first prompt; the
    workspace trusted (GEMINI_CLI_TRUST_WORKSPACE) so that it runs without asking."""
    executable = agents_bin("gemini")
    return Command([executable, "-m", model, "-p", "{" + task_field + "}"],
                   files={".gemini/settings.json": GEMINI_SETTINGS}, readonly=[install_root(executable)],
                   env={"GEMINI_CLI_TRUST_WORKSPACE": "true"}, memory_mb=_NODE_MEMORY_MB,
                   address_mb=_FETCH_ADDRESS_MB, name="gemini-cli")


# Pi's custom provider (its docs/models.md): the session's Chat Completions endpoint; `compat` as its docs advise
# for vLLM-style servers (no `developer` role, no reasoning_effort). `apiKey` names the environment variable.
PI_MODELS = """{"providers": {"polar": {"baseUrl": "{openai_base_url}", "api": "openai-completions",
  "apiKey": "OPENAI_API_KEY", "compat": {"supportsDeveloperRole": false, "supportsReasoningEffort": false},
  "models": [{"id": "{model}", "contextWindow": 32768, "maxTokens": 1024, "reasoning": false, "input": ["text"]}]}}}
"""


def pi(*, model: str = "tiny-calc", task_field: str = "question", workspace: str | None = None) -> Command:
    """The Pi coding agent (npm `@mariozechner/pi-coding-agent`, `pi -p`) with a custom provider pointed at the
    session's Chat Completions endpoint (`~/.pi/agent/models.json`); PI_OFFLINE=1 turns off its version check,
    package update checks and install ping. The smallest prompt of the presets (~2.1k tokens, 4 tools: `read`,
    `bash`, `edit`, `write`); it runs commands without asking. `workspace`: the task field holding a repository
    to start in."""
    executable = agents_bin("pi")
    return Command([executable, "--provider", "polar", "--model", model, "-p", "{" + task_field + "}"],
                   files={".pi/agent/models.json": PI_MODELS.replace("{model}", model)},
                   readonly=[install_root(executable)], env={"PI_OFFLINE": "1"}, memory_mb=_NODE_MEMORY_MB,
                   address_mb=_FETCH_ADDRESS_MB, name="pi", workspace=workspace)


# OpenCode's config: one provider (the bundled @ai-sdk/openai-compatible, nothing downloaded) at the session's
# Chat Completions endpoint, no autoupdate, no sharing. `{env:OPENAI_API_KEY}` is OpenCode's own syntax.
OPENCODE_CONFIG = """{"$schema": "https://opencode.ai/config.json", "model": "polar/{model}", "autoupdate": false,
  "share": "disabled", "enabled_providers": ["polar"],
  "provider": {"polar": {"npm": "@ai-sdk/openai-compatible", "name": "polar",
    "options": {"baseURL": "{openai_base_url}", "apiKey": "{env:OPENAI_API_KEY}"},
    "models": {"{model}": {"name": "{model}", "limit": {"context": 32768, "output": 1024}}}}}}
"""
# On every start OpenCode installs `@opencode-ai/plugin` into its config folder from the npm registry (even with its
# DISABLE flags) unless node_modules is there and the lock file lists it: both are put there, so it never
# reaches the network (read from its binary, not a documented switch: re-check when the pin moves).
OPENCODE_LOCK = json.dumps({"packages": {"": {"dependencies": {"@opencode-ai/plugin": "*"}}}})


def opencode(*, model: str = "tiny-calc", task_field: str = "question") -> Command:
    """OpenCode (npm `opencode-ai`, `opencode run`) with one provider at the session's Chat Completions endpoint
    (streaming, 10 tools, ~11k-token prompt). `--title` is given so that it does not ask the model for a session
    title first (a second call and chain); its update, model-list, LSP-download, plugin and share features off."""
    executable = agents_bin("opencode")
    return Command([executable, "run", "-m", f"polar/{model}", "--title", "polar", "{" + task_field + "}"],
                   files={".config/opencode/opencode.json": OPENCODE_CONFIG.replace("{model}", model),
                          ".config/opencode/package-lock.json": OPENCODE_LOCK,
                          ".config/opencode/node_modules/.polar_lab": ""},
                   readonly=[install_root(executable)], memory_mb=_NODE_MEMORY_MB, name="opencode",
                   env={"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
                        "OPENCODE_DISABLE_SHARE": "1"})


async def openai_agents_calculator(session: Session, task: dict[str, Any], *, max_turns: int = 4) -> dict[str, Any]:
    """An OpenAI Agents SDK agent (PyPI `openai-agents`) with a calculator function tool, over the Responses
    surface. The SDK is used as published; only its client points at the session (tracing off: no uploads)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return run_calculator(json.dumps({"expression": expression}))

    client = openai_client(session, max_retries=0)
    agent = Agent(name="calculator", instructions=SYSTEM_PROMPT, tools=[calculator],
                  model=OpenAIResponsesModel("tiny-calc", client), model_settings=ModelSettings(max_tokens=128))
    result = await Runner.run(agent, task["question"], max_turns=max_turns)
    return {"final": str(result.final_output)}
