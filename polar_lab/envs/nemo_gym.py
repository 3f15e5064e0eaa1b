"""NeMo Gym, both ways (docs/harnesses.md).

NeMo Gym (0.7) is a set of HTTP servers: *resources servers* (an environment: `/seed_session`, one route per
tool, `/verify` → `reward` and `mask_sample`), *model servers* (`vllm_model`: the Responses API in front of an
OpenAI-compatible backend, token ids on every generated item) and *agents* (`/run`: seed, model ↔ tools, verify).
Gym needs Python ≥ 3.13; it lives in its own venv (`make nemo-gym`, `.cache/nemo_gym`, installed with
`--ignore-requires-python`), and polar_lab drives its servers over HTTP — nothing here imports Gym.

- `GymServers`: Gym servers, one process each on 127.0.0.1, from one global config (what Gym's `ng_run`
  launcher does, without its uv/3.13 requirements). Each process is its own process group, stopped by its pid.
- `GymEnvironment` (Gym → polar_lab): a resources server's tasks run through `lab.rollout` by polar_lab's own
  tool loop over Chat Completions: `/seed_session`, each tool call → its route, `/verify` → the run's reward.
- `GymAgent` (polar_lab under Gym): Gym's own `simple_agent` and `vllm_model`, the model server pointed at the
  Lab under its shared key; each run names its polar_lab session through the request's `metadata.extra_body`
  (which `vllm_model` merges into the backend body), so the Lab records it token-exact in that session.
- polar_lab → NeMo RL: chains as Gym rollout rows (`polar_lab.envs.gym_rows`).

A Gym server that fails (unreachable, a 5xx) or masks a sample fails its run as `MaskedRunError`: masked, never
trained; a malformed `/verify` answer is a `HarnessError` on that run.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from polar_lab.errors import ConfigError, HarnessError, LabError, MaskedRunError
from polar_lab.harness.clients import openai_client, tls_context
from polar_lab.types import Session

# $POLAR_LAB_GYM_VENV, else this checkout's .cache/nemo_gym (made by `make nemo-gym`)
GYM_VENV = os.environ.get("POLAR_LAB_GYM_VENV") or str(Path(__file__).resolve().parents[2] / ".cache" / "nemo_gym")
HOST = "127.0.0.1"

# Run in Gym's venv: the one server class its module defines (the class with `run_webserver`), started as Gym's
# launcher starts it (the instance's config comes from NEMO_GYM_CONFIG_DICT / NEMO_GYM_CONFIG_PATH).
_LAUNCH = ("import importlib, sys\n"
           "m = importlib.import_module(sys.argv[1])\n"
           "(server,) = [c for c in vars(m).values() if isinstance(c, type) and c.__module__ == m.__name__ "
           "and hasattr(c, 'run_webserver')]\n"
           "server.run_webserver()\n")


def gym_python(venv: str | None = None) -> Path:
    return Path(venv or GYM_VENV).absolute() / "bin" / "python"


def site_packages(venv: str | None = None) -> Path:
    found = glob.glob(str(Path(venv or GYM_VENV) / "lib" / "python3*" / "site-packages"))
    if not found:
        raise ConfigError(f"no NeMo Gym venv at {venv or GYM_VENV}: run `make nemo-gym`")
    return Path(found[0])


def missing(venv: str | None = None) -> str | None:
    """Why NeMo Gym cannot run here (None: it can)."""
    python = gym_python(venv)
    if not python.exists():
        return f"no NeMo Gym venv at {venv or GYM_VENV} (make nemo-gym)"
    if not (site_packages(venv) / "nemo_gym").is_dir():
        return f"nemo_gym is not installed in {venv or GYM_VENV} (make nemo-gym)"
    return None


def example_rows(resources_server: str, *, limit: int | None = None, venv: str | None = None) -> list[dict[str, Any]]:
    """The example rows a Gym resources server ships (`data/example.jsonl`), as polar_lab tasks."""
    path = site_packages(venv) / "resources_servers" / resources_server / "data" / "example.jsonl"
    if not path.exists():
        raise ConfigError(f"NeMo Gym has no resources server {resources_server!r} with example rows ({path})")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit]


def gym_reward(task: dict[str, Any], result: dict[str, Any]) -> dict[str, float]:
    """The evaluator of a Gym run: the reward its `/verify` gave (the run's result is the verdict)."""
    return {"total": float(result["reward"])}


def _without_secrets(spec: Any) -> Any:
    """An instance's config as the other servers see it: its `api_key`s blanked."""
    if isinstance(spec, dict):
        return {k: ("(hidden)" if k == "api_key" else _without_secrets(v)) for k, v in spec.items()}
    return spec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class GymServers:
    """NeMo Gym servers, one process each on 127.0.0.1, sharing one global config (servers find each other by
    instance name in it). `add` them, then `start`; `close` (or the context manager) stops what was started."""

    def __init__(self, *, venv: str | None = None, log_dir: str | Path | None = None, start_timeout_s: float = 120.0):
        if (reason := missing(venv)) is not None:
            raise ConfigError(reason)
        self.venv, self.start_timeout_s = venv, start_timeout_s
        self.log_dir = Path(log_dir) if log_dir else None
        self.config: dict[str, Any] = {"head_server": {"host": HOST, "port": _free_port()}, "dry_run": False}
        self.modules: dict[str, str] = {}  # instance → module
        self.processes: dict[str, subprocess.Popen] = {}

    def add(self, instance: str, kind: str, impl: str, **config: Any) -> str:
        """One server: `kind` is "resources_servers" | "responses_api_models" | "responses_api_agents", `impl`
        its package in Gym (e.g. "example_single_tool_call"); config: the instance's fields. Returns its URL."""
        port = _free_port()
        self.config[instance] = {kind: {impl: {"entrypoint": "app.py", "host": HOST, "port": port, **config}}}
        self.modules[instance] = f"{kind}.{impl}.app"
        return f"http://{HOST}:{port}"

    def url(self, instance: str) -> str:
        (spec,) = next(iter(self.config[instance].values())).values()
        return f"http://{HOST}:{spec['port']}"

    def start(self) -> GymServers:
        """Start every server added (again: nothing) and wait until each answers `/health`; a failure stops them."""
        if self.processes:
            return self
        try:
            for instance, module in self.modules.items():
                self.processes[instance] = self._launch(instance, module)
            for instance in self.modules:
                self._wait_up(instance)
        except BaseException:
            self.close()
            raise
        return self

    def _launch(self, instance: str, module: str) -> subprocess.Popen:
        # each process sees the others' addresses, not their secrets (vllm_model's api_key: the Lab's shared key)
        settings = {name: spec if name == instance else _without_secrets(spec) for name, spec in self.config.items()}
        env = {**os.environ, "NEMO_GYM_CONFIG_DICT": json.dumps(settings),  # JSON is YAML: Gym reads it as such
               "NEMO_GYM_CONFIG_PATH": instance, "PYTHONUNBUFFERED": "1"}
        cwd = site_packages(self.venv) / module.rsplit(".", 1)[0].replace(".", "/")
        out = open(self.log_dir / f"{instance}.log", "wb") if self.log_dir else subprocess.DEVNULL
        try:
            return subprocess.Popen([str(gym_python(self.venv)), "-c", _LAUNCH, module], cwd=cwd, env=env,
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()

    def _wait_up(self, instance: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.processes[instance].poll() is not None:
                raise LabError(f"the NeMo Gym server {instance!r} exited with {self.processes[instance].returncode}"
                               f" while starting" + (f"; see {self.log_dir}/{instance}.log" if self.log_dir else ""))
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url(instance) + "/health", timeout=2, verify=tls_context()).status_code == 200:
                    return
            time.sleep(0.3)
        raise LabError(f"the NeMo Gym server {instance!r} did not answer /health in {self.start_timeout_s:.0f} s")

    def stop(self, instance: str) -> None:
        """Stop one server (its whole process group) — what a fault test does to one mid-rollout."""
        process = self.processes.get(instance)
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)

    def close(self) -> None:
        for instance in reversed(list(self.processes)):
            self.stop(instance)

    def __enter__(self) -> GymServers:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- Gym → polar_lab: a resources server's tasks through polar_lab's own tool loop -------------------------

class _OnGym:
    """What both directions share: their Gym servers (`self.servers`), started and stopped with them, and the
    resources server's example rows as tasks (`self.name`, `self.venv`)."""

    servers: GymServers
    name: str
    venv: str | None

    def start(self):
        self.servers.start()
        return self

    def close(self) -> None:
        self.servers.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def tasks(self, limit: int | None = None) -> list[dict[str, Any]]:
        return example_rows(self.name, limit=limit, venv=self.venv)


class GymEnvironment(_OnGym):
    """A Gym resources server as a polar_lab environment:

        with GymEnvironment("example_single_tool_call") as env:
            groups = lab.rollout(env.tasks(), env.harness, evaluator=env.evaluator, num_generations=4)

    `harness(session, task)` seeds the server's session with the task row, runs a Chat Completions tool loop
    against the polar_lab session (tools: the row's), sends each tool call to the server's route of that name and
    its answer back as the tool result, until a reply calls no tool (or `max_turns`); then `/verify` with the
    conversation as a Responses-API response. Its reward is the run's; `mask_sample` masks the run. `/verify`'s
    answers are kept in `results` by session id.
    """

    def __init__(self, resources_server: str, *, venv: str | None = None, max_turns: int = 6, max_tokens: int = 256,
                 first_tool_choice: str | dict[str, Any] = "auto", config: dict[str, Any] | None = None,
                 log_dir: str | Path | None = None, timeout_s: float = 60.0):
        """first_tool_choice: the first turn's `tool_choice` ("required": it must call a tool; later turns "auto");
        config: the resources server's own config fields."""
        self.name, self.venv, self.first_tool_choice = resources_server, venv, first_tool_choice
        self.max_turns, self.max_tokens, self.timeout_s = max_turns, max_tokens, timeout_s
        self.results: dict[str, dict[str, Any]] = {}  # session id → its /verify answer
        self.servers = GymServers(venv=venv, log_dir=log_dir)
        self.url = self.servers.add(resources_server, "resources_servers", resources_server, domain="agent",
                                    **(config or {}))

    async def harness(self, session: Session, task: dict[str, Any]) -> dict[str, Any]:
        params = task["responses_create_params"]
        tools = [_chat_tool(t) for t in params.get("tools") or [] if t.get("type") == "function"]
        messages = [_chat_message(item) for item in _items(params.get("input"))]
        output: list[dict[str, Any]] = []
        client = openai_client(session, max_retries=0, timeout=self.timeout_s * 10)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s, verify=tls_context()) as gym, client:
            await _gym(gym, "/seed_session", task, self.name)  # the server keeps its session in a cookie
            for turn in range(self.max_turns):
                choice = self.first_tool_choice if turn == 0 else "auto"
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, max_tokens=self.max_tokens,
                    **({"tools": tools, "tool_choice": choice} if tools else {}))
                message = reply.choices[0].message
                calls = message.tool_calls or []
                messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
                if message.content or not calls:
                    output.append(output_message(message.content or ""))
                for call in calls:
                    output.append({"type": "function_call", "name": call.function.name, "call_id": call.id,
                                   "id": call.id, "arguments": call.function.arguments, "status": "completed"})
                    result = await _tool(gym, call.function.name, call.function.arguments, self.name)
                    output.append({"type": "function_call_output", "call_id": call.id, "output": result})
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                if not calls:
                    break
            response = {"id": "resp_" + uuid.uuid4().hex, "created_at": int(time.time()), "model": "policy",
                        "object": "response", "output": output, "tools": params.get("tools") or [],
                        "parallel_tool_calls": params.get("parallel_tool_calls", True), "tool_choice": "auto"}
            verdict = await _gym(gym, "/verify", {**task, "response": response}, self.name)
        self.results[session.id] = verdict
        return checked_verdict(verdict, self.name)

    evaluator = staticmethod(gym_reward)


async def _gym(gym: httpx.AsyncClient, path: str, body: dict[str, Any], server: str) -> dict[str, Any]:
    """POST to a Gym server; its failure (unreachable, a 5xx, not JSON) fails the run masked."""
    try:
        r = await gym.post(path, json=body)
    except httpx.TransportError as exc:
        raise MaskedRunError(f"the NeMo Gym server {server!r} is unreachable at {path}: {exc!r}") from None
    if r.status_code >= 500 or r.status_code in (404, 422) and path in ("/seed_session", "/verify"):
        raise MaskedRunError(f"the NeMo Gym server {server!r} answered {path} with {r.status_code}",
                             output=r.text[-2000:])
    try:
        data = r.json()
    except ValueError:
        raise MaskedRunError(f"the NeMo Gym server {server!r} answered {path} with no JSON ({r.status_code})",
                             output=r.text[-2000:]) from None
    if not isinstance(data, dict):
        raise HarnessError(f"the NeMo Gym server {server!r} answered {path} with a JSON {type(data).__name__}, "
                           f"not an object", output=r.text[-2000:])
    return data


async def _tool(gym: httpx.AsyncClient, name: str, arguments: str, server: str) -> str:
    """A tool call's result as the model reads it: the route's JSON answer, or what was wrong with the call (the
    model's doing: arguments that are no JSON object, a tool the server has not)."""
    try:
        args = json.loads(arguments)
    except ValueError as exc:
        return json.dumps({"error": f"the arguments are not JSON: {exc}"})
    if not isinstance(args, dict):
        return json.dumps({"error": "the arguments must be a JSON object"})
    try:
        r = await gym.post("/" + name, json=args)
    except httpx.TransportError as exc:
        raise MaskedRunError(f"the NeMo Gym server {server!r} is unreachable at /{name}: {exc!r}") from None
    if r.status_code >= 500:
        raise MaskedRunError(f"the NeMo Gym server {server!r} answered /{name} with {r.status_code}",
                             output=r.text[-2000:])
    return r.text


def checked_verdict(verdict: dict[str, Any], server: str) -> dict[str, Any]:
    """`/verify`'s answer, checked: a numeric reward, and `mask_sample` honoured (the run is masked)."""
    if verdict.get("mask_sample"):
        raise MaskedRunError(f"the NeMo Gym server {server!r} masked this sample: "
                             f"{verdict.get('failure_kind')}: {verdict.get('failure_reason')}")
    reward = verdict.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise HarnessError(f"the NeMo Gym server {server!r} answered /verify without a numeric reward "
                           f"(reward={reward!r})", output=json.dumps(verdict)[-2000:])
    return verdict


def _items(value: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": value}] if isinstance(value, str) else list(value or [])


def _chat_message(item: dict[str, Any]) -> dict[str, Any]:
    """A Responses input message as a chat message (content parts joined; the developer role is the proxy's)."""
    content = item.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return {"role": item.get("role", "user"), "content": content or ""}


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "",
                                             "parameters": tool.get("parameters") or {"type": "object"}}}


def output_message(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "id": "msg_" + uuid.uuid4().hex, "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


# ---- polar_lab under Gym: Gym's own agent and model server, the Lab as the vLLM backend ---------------------

class GymAgent(_OnGym):
    """Gym's `simple_agent` and `vllm_model` around one resources server, with the Lab as the model server's
    backend (token information on: `return_token_ids`, logprobs as `token_id:N`, `/tokenize`).

        lab = Lab(model, shared_key="auto", session_field="session_id")
        with GymAgent(lab, "example_single_tool_call") as agent:
            groups = lab.rollout(agent.tasks(), agent.harness, evaluator=agent.evaluator)

    `vllm_model` sends one key for every rollout — the Lab's shared key — and each run names its session in the
    backend body: `harness` lets the session be named (`session.shared`) and puts `{session_field: session.id}`
    into the row's `metadata.extra_body`, which `vllm_model` merges into every call it makes for that run. The
    shared key reaches only the `vllm_model` process (the other servers see it blanked). The run's result is Gym's own rollout row
    (`/run`'s answer: the reward, and the output items with the token ids the Lab recorded), also kept in
    `results` by session id.
    """

    def __init__(self, lab, resources_server: str, *, venv: str | None = None, max_steps: int = 6,
                 log_dir: str | Path | None = None, timeout_s: float = 600.0):
        proxy = lab.config.proxy
        if lab.shared_key is None or not proxy.session_field:
            raise ConfigError("GymAgent needs a Lab with a shared key and a session body field, e.g. "
                              "Lab(model, shared_key='auto', session_field='session_id'): Gym's model server "
                              "sends one key for all rollouts, and names each rollout's session in the body")
        self.name, self.venv, self.timeout_s, self.field = resources_server, venv, timeout_s, proxy.session_field
        self.results: dict[str, dict[str, Any]] = {}  # session id → Gym's rollout row (/run's answer)
        self.servers = GymServers(venv=venv, log_dir=log_dir)
        self.servers.add(resources_server, "resources_servers", resources_server, domain="agent")
        self.servers.add("policy_model", "responses_api_models", "vllm_model",
                         base_url=lab.url + "/v1", api_key=lab.shared_key, model=lab.served_as,
                         return_token_id_information=True, request_prompt_and_generation_token_ids=True,
                         uses_reasoning_parser=bool(lab.parsers.get("reasoning_parser")))
        self.url = self.servers.add("agent", "responses_api_agents", "simple_agent", max_steps=max_steps,
                                    resources_server={"type": "resources_servers", "name": resources_server},
                                    model_server={"type": "responses_api_models", "name": "policy_model"})

    async def harness(self, session: Session, task: dict[str, Any]) -> dict[str, Any]:
        session.shared = True  # requests under the shared key may now name this session (by its id)
        params = dict(task["responses_create_params"])
        metadata = dict(params.get("metadata") or {})
        metadata["extra_body"] = json.dumps(_nested(self.field, session.id))
        row = {**task, "responses_create_params": {**params, "metadata": metadata}}
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s, verify=tls_context()) as agent:
            verdict = await _gym(agent, "/run", row, "agent")
        self.results[session.id] = verdict
        return checked_verdict(verdict, self.name)

    evaluator = staticmethod(gym_reward)


def _nested(path: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for the dotted path "a.b"."""
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


__all__ = ["GymAgent", "GymEnvironment", "GymServers", "example_rows", "gym_reward", "missing"]
