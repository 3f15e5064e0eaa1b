"""The verifiers side of polar_lab.envs.verifiers: run by verifiers' own venv's Python (`make verifiers`), never
imported by the Lab (verifiers is not installed there; this file imports nothing of polar_lab).

    python -P verifiers_worker.py '{"taskset": "polar_calc", "max_turns": 4, "offline": true, "fd": 5}'

It loads the environment (the taskset, verifiers' `null` harness — its own chat-and-tools loop — and a local
subprocess runtime), opens its servers (`env.serving()`: the interception proxy, the taskset's tool servers) and
then runs episodes as asked, concurrently. Protocol: one JSON object per line, the Lab's on stdin, the worker's on
its own pipe (`fd`, so that nothing verifiers or its children print can split a message):

    → {"op": "ready", "tasks": [task data, ...]}                       once loaded
    ← {"op": "run", "id": 7, "index": 3, "base_url": ..., "api_key": ..., "model": ..., "sampling": {...}}
    → {"op": "done", "id": 7, "ok": true, "reward": 1.0, "rewards": {"correct": 1.0}, "errors": [], ...}
    ← {"op": "cancel", "id": 7}  (the run's deadline passed: the episode stops, nothing is sent for it)
    ← {"op": "close"}  (or the end of stdin)

offline: verifiers prepares its harness's chat program with `uv sync --script` in every process, which asks the
package index every time (~20 s, and fails without a network). The chat program's dependencies are verifiers'
own, so with `offline` its interpreter is this venv's Python and uv never runs. This reaches into verifiers'
internals (`SubprocessRuntime._interpreters`, checked at start): re-check it when the pin moves.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from pathlib import Path

OUT = None  # the protocol's pipe (settings["fd"])


def emit(message: dict) -> None:
    OUT.write(json.dumps(message, default=str) + "\n")
    OUT.flush()


def run_offline() -> None:
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    if not isinstance(getattr(SubprocessRuntime, "_interpreters", None), dict):
        raise RuntimeError("this verifiers has no SubprocessRuntime._interpreters: offline mode needs updating")
    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    SubprocessRuntime._interpreters[str(path)] = sys.executable


async def episode(env, tasks, request: dict) -> dict:
    import verifiers.v1 as vf
    from verifiers.v1.env import RunSlot

    variable = f"POLAR_LAB_KEY_{request['id']}"  # verifiers reads a client's key from the variable it names
    os.environ[variable] = request["api_key"]
    client = vf.EvalClientConfig(base_url=request["base_url"], api_key_var=variable)
    context = vf.ModelContext(model=request.get("model") or "policy", client=client,
                              sampling=vf.SamplingConfig(**request.get("sampling", {})))
    try:
        ep = await env.run_slot(RunSlot(tasks[request["index"]]), context)
    finally:
        os.environ.pop(variable, None)
    trace = ep.traces[0] if ep.traces else None
    errors = [e.message for e in ep.errors] + ([e.message for e in trace.errors] if trace else [])
    return {"op": "done", "id": request["id"], "ok": bool(ep.ok), "reward": trace.reward if trace else None,
            "rewards": {k: (v.score if v else None) for k, v in (trace.rewards if trace else {}).items()},
            "errors": [str(e)[:2000] for e in errors], "turns": trace.num_turns if trace else 0,
            "stop": trace.stop_condition if trace else None}


async def serve(settings: dict) -> None:
    global OUT
    OUT = os.fdopen(settings["fd"], "w", buffering=1)
    import verifiers.v1 as vf

    if settings.get("offline", True):
        run_offline()
    env = vf.load_environment(vf.resolve_env_config({
        "taskset": {"id": settings["taskset"], **settings.get("taskset_config", {})},
        "agent": {"harness": {"id": settings.get("harness", "null")}, "runtime": {"type": "subprocess"},
                  "max_turns": settings.get("max_turns", 4)}}))
    tasks = list(env.taskset)
    loop = asyncio.get_running_loop()
    running: dict[int, asyncio.Task] = {}

    async def one(request: dict) -> None:
        try:
            emit(await episode(env, tasks, request))
        except asyncio.CancelledError:
            pass  # the Lab cancelled it: it waits for nothing
        except Exception as exc:  # noqa: BLE001 - reported to the Lab as that run's failure
            emit({"op": "done", "id": request["id"], "ok": False, "reward": None, "rewards": {},
                  "errors": [f"{type(exc).__name__}: {exc}"[:2000]], "turns": 0, "stop": "worker_error"})

    async with env.serving():
        emit({"op": "ready", "tasks": [t.data.model_dump(mode="json") for t in tasks]})
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            request = json.loads(line)
            if request.get("op") == "close":
                break
            if request.get("op") == "cancel":
                if (job := running.get(request["id"])) is not None:
                    job.cancel()
                continue
            job = asyncio.create_task(one(request))
            running[request["id"]] = job
            job.add_done_callback(lambda _, key=request["id"]: running.pop(key, None))
        for job in list(running.values()):
            job.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)


if __name__ == "__main__":
    asyncio.run(serve(json.loads(sys.argv[1])))
