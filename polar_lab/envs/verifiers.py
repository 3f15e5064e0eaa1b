"""A verifiers environment's rollouts as `lab.rollout` runs (docs/harnesses.md).

verifiers (0.4, `verifiers.v1`): an environment is a taskset (tasks and their rewards), a harness (the program
that talks to the model: by default its `null` harness, a chat-and-tools loop) and a runtime (where the harness
runs: here a local subprocess). It lives in its own venv (`make verifiers`); one worker process there
(polar_lab/envs/verifiers_worker.py) loads the environment and runs its episodes. Each polar_lab run asks the
worker for one episode whose client is the run's own session (`session.openai_base_url` and key), so every model
call of it is recorded in that session, and the run's reward is the taskset's (the sum of its weighted rewards,
each part in `reward_parts`). The environment's harness is verifiers' own, unmodified.

    with VerifiersEnv("polar_calc", path="data/envs/verifiers") as env:
        groups = lab.rollout(env.tasks(8), env.harness, evaluator=env.evaluator, num_generations=8)

An episode verifiers reports failed (its harness errored) is a failed run (`HarnessError`); a worker that dies
fails its runs masked (`MaskedRunError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from polar_lab.errors import ConfigError, HarnessError, LabError, MaskedRunError
from polar_lab.types import Session

# $POLAR_LAB_VERIFIERS_VENV, else this checkout's .cache/verifiers (made by `make verifiers`)
VF_VENV = os.environ.get("POLAR_LAB_VERIFIERS_VENV") or str(
    Path(__file__).resolve().parents[2] / ".cache" / "verifiers")
WORKER = Path(__file__).with_name("verifiers_worker.py")
log = logging.getLogger(__name__)


def vf_python(venv: str | None = None) -> Path:
    return Path(venv or VF_VENV).absolute() / "bin" / "python"


def missing(venv: str | None = None) -> str | None:
    """Why verifiers cannot run here (None: it can)."""
    python = vf_python(venv)
    if not python.exists():
        return f"no verifiers venv at {venv or VF_VENV} (make verifiers)"
    return None


class VerifiersEnv:
    """One verifiers environment, served by a worker process in verifiers' venv for as long as this is open.

    taskset: the taskset's id (a module on `path`, or an installed verifiers environment); path: a folder put on
    the worker's PYTHONPATH; max_turns: the harness's turn limit; sampling: verifiers' `SamplingConfig` for every
    episode (e.g. max_tokens; a polar_lab session's forced sampling still wins); offline: run the harness's chat
    program with the venv's own Python instead of `uv` (verifiers_worker.py says why).
    """

    def __init__(self, taskset: str, *, path: str | Path | None = None, venv: str | None = None, max_turns: int = 4,
                 sampling: dict[str, Any] | None = None, offline: bool = True, start_timeout_s: float = 180.0,
                 taskset_config: dict[str, Any] | None = None):
        if (reason := missing(venv)) is not None:
            raise ConfigError(reason)
        self.settings = {"taskset": taskset, "max_turns": max_turns, "offline": offline,
                         "taskset_config": taskset_config or {}}
        self.path, self.venv, self.start_timeout_s = path, venv, start_timeout_s
        self.sampling = {"max_tokens": 128, **(sampling or {})}
        self.process: subprocess.Popen | None = None
        self._tasks: list[dict[str, Any]] | None = None  # set by the worker's "ready"
        self._ids = itertools.count()
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ready = threading.Event()  # "ready" came, or the worker is gone
        self._output = tempfile.TemporaryFile()  # what the worker and verifiers print (a failed start's reason)

    def start(self) -> VerifiersEnv:
        """Start the worker (again: nothing) and wait for its tasks; a worker that cannot load is a LabError with
        what it printed."""
        if self.process is not None:
            return self
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.path is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(self.path).absolute()),
                                                              env.get("PYTHONPATH")]))
        theirs, ours = os.pipe()[::-1]  # (write end for the worker, read end for us)
        try:
            self.process = subprocess.Popen(
                # -P: the worker's own folder is not put on sys.path, where this module would shadow verifiers
                [str(vf_python(self.venv)), "-P", str(WORKER), json.dumps({**self.settings, "fd": theirs})],
                stdin=subprocess.PIPE, stdout=self._output, stderr=subprocess.STDOUT, text=True, env=env,
                pass_fds=(theirs,), start_new_session=True)
        except BaseException:
            os.close(ours)
            raise
        finally:
            os.close(theirs)
        threading.Thread(target=self._read, args=(os.fdopen(ours, "r"),), name="verifiers-worker",
                         daemon=True).start()
        if not self._ready.wait(self.start_timeout_s) or self._tasks is None:
            self.close()
            raise LabError(f"the verifiers worker did not start: {self.printed()[-3000:]}")
        return self

    def printed(self) -> str:
        """The last of what the worker printed."""
        self._output.seek(0, os.SEEK_END)
        size = self._output.tell()
        self._output.seek(max(0, size - 8000))
        return self._output.read().decode(errors="replace")

    def _read(self, pipe) -> None:
        """The worker's messages → the waiting runs; when the pipe ends (the worker is gone), every run still
        waiting fails masked. A line that is not a message is logged and skipped."""
        try:
            for line in pipe:
                try:
                    message = json.loads(line)
                    op = message["op"]
                except (ValueError, KeyError, TypeError):
                    log.warning("the verifiers worker sent a line that is no message: %r", line[:200])
                    continue
                if op == "ready":
                    self._tasks = list(message.get("tasks") or [])
                    self._ready.set()
                elif op == "done":
                    with self._lock:
                        waiter = self._pending.pop(message.get("id"), None)
                    if waiter is not None:
                        loop, future = waiter
                        loop.call_soon_threadsafe(_settle, future, message)
        finally:
            pipe.close()
            self._ready.set()  # nothing more will come
            with self._lock:
                pending, self._pending = self._pending, {}
            gone = MaskedRunError("the verifiers worker exited", output=self.printed()[-2000:])
            for loop, future in pending.values():
                loop.call_soon_threadsafe(_settle, future, gone)

    def tasks(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The taskset's tasks as polar_lab tasks: each its verifiers data, plus `vf_index`."""
        if self._tasks is None:
            raise LabError("start the VerifiersEnv first (with VerifiersEnv(...) as env: ...)")
        return [{**data, "vf_index": i} for i, data in enumerate(self._tasks[:limit])]

    async def harness(self, session: Session, task: dict[str, Any]) -> dict[str, Any]:
        """One verifiers episode of `task`, its client the session's own endpoint and key."""
        if self.process is None or self.process.poll() is not None:
            raise MaskedRunError("the verifiers worker is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        request_id = next(self._ids)
        with self._lock:
            self._pending[request_id] = (loop, future)
        request = {"op": "run", "id": request_id, "index": task["vf_index"], "base_url": session.openai_base_url,
                   "api_key": session.api_key, "model": "policy", "sampling": self.sampling}
        try:
            await asyncio.to_thread(self._send, request)
            result = await future
        except asyncio.CancelledError:  # the run's deadline: the episode must not go on calling the session
            with contextlib.suppress(MaskedRunError):
                self._send({"op": "cancel", "id": request_id})
            raise
        finally:
            with self._lock:
                self._pending.pop(request_id, None)
        if not result["ok"]:
            raise HarnessError(f"the verifiers episode failed ({result['stop']}): {'; '.join(result['errors'])[:500]}",
                               output="\n".join(result["errors"]))
        return result

    def _send(self, message: dict[str, Any]) -> None:
        assert self.process is not None and self.process.stdin is not None
        try:
            with self._send_lock:  # runs send from worker threads, a cancel from the loop: one line at a time
                self.process.stdin.write(json.dumps(message) + "\n")
                self.process.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            raise MaskedRunError(f"the verifiers worker is gone: {exc!r}") from None

    @staticmethod
    def evaluator(task: dict[str, Any], result: dict[str, Any]) -> dict[str, float]:
        """The taskset's reward (the weighted sum) and each of its rewards."""
        parts = {name: float(score) for name, score in result["rewards"].items() if score is not None}
        return {**parts, "total": float(result["reward"])}

    def close(self) -> None:
        """Stop the worker (it closes its servers), then whatever of its process group is left (its episodes'
        chat programs and tool servers, when the worker itself was killed)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(Exception):
                self._send({"op": "close"})
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, 15)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, 9)
                self.process.wait(5)
        with contextlib.suppress(ProcessLookupError):  # what the episodes started (chat programs, tool servers)
            os.killpg(self.process.pid, 9)

    def __enter__(self) -> VerifiersEnv:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _settle(future: asyncio.Future, outcome: dict[str, Any] | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


__all__ = ["VerifiersEnv", "missing"]
