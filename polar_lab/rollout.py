"""Rollouts: N runs of a harness per task, each in its own session, concurrently, on the Lab's loop.

A harness here is an async callable `harness(session, task) -> result` (any program that talks to the
session's endpoints; `harness/command.py::Command` runs a program in the sandbox). Each run gets a deadline;
a run that raises or times out keeps every call it made (they are already in the store), is marked, and gets
the reward of its failure's cause (`failure_cause`): a failure the policy may have caused (it kept going past
the deadline, it overflowed the context) can be scored to teach it not to; one the infrastructure caused is
always masked (reward None). The rest of its group still completes. Typed against `Host`, the two Lab methods
it needs, so it sits below the Lab (`lab.rollout` calls it).
"""

from __future__ import annotations

import asyncio
import time
import traceback
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tqdm.auto import tqdm

from polar_lab.errors import HarnessError, MaskedRunError, SandboxError
from polar_lab.types import Evaluator, Group, Harness, Session, Trajectory, derived_seed

if TYPE_CHECKING:
    from polar_lab.proxy.replay import Script


@dataclass(frozen=True)
class RolloutSpec:
    """How each run of a rollout is bounded, and what a failed one scores — declared here once: `lab.rollout`
    makes one of its arguments, the GRPO trainer one of its config (whose defaults are `TRAINING`'s).

    deadline_s: a run still going after this long of the policy's time is stopped (status "timeout").
    The reward of a failed run follows its cause (`failure_cause`): `timeout_reward` (it ran past its deadline),
    `overflow_reward` (it failed after a call overflowed the context), `failed_reward` (it crashed after the model
    answered). None masks the run out of training — each one's default: fail-closed. Infrastructure failures and
    runs their environment masks are always masked."""

    deadline_s: float = 600.0
    failed_reward: float | None = None
    timeout_reward: float | None = None
    overflow_reward: float | None = None

    def reward(self, cause: str) -> float | None:
        return {"timeout": self.timeout_reward, "overflow": self.overflow_reward,
                "crash": self.failed_reward}.get(cause)  # "infrastructure", "masked": None


# What the GRPO trainer runs with (grpo/config.py): a run that loops past its deadline or overflows the context is the
# policy's doing, and scores 0 to teach it not to; a crash of unknown cause stays masked.
TRAINING = RolloutSpec(deadline_s=120.0, timeout_reward=0.0, overflow_reward=0.0)


class Host(Protocol):
    """What a rollout needs of a Lab: sessions to run in, and the trajectories their calls became."""

    def session(self, task: dict[str, Any] | None = None, *, group_id: str | None = None,
                sampling: dict[str, Any] | None = None, replay: Script | None = None, **info: Any) -> Session:
        ...

    def trajectories(self, builder: str = "prefix_merging", *,
                     session_ids: list[str] | None = None) -> list[Trajectory]:
        ...


def failure_cause(session: Session, status: str) -> str | None:
    """Why a run ended in `status` ("closed" is no failure): the policy's doing or the infrastructure's.

    infrastructure  an engine or proxy error on one of its calls, or no model call ever served (the harness
                    failed to start, or hung before asking): the policy cannot have caused it
    overflow        its last call was refused as too long for the model's context, and the run then failed
    timeout         it was still going at the deadline (looping, never finishing)
    crash           the harness raised after the model answered, for no reason seen here
    (masked         its environment failed or asked that it not be trained: `MaskedRunError`, set by `run_one`)

    >>> failure_cause(Session(id="s", key="", calls=3), "timeout")
    'timeout'
    >>> failure_cause(Session(id="s", key="", calls=0), "timeout")
    'infrastructure'
    """
    if status == "closed":
        return None
    errors = session.call_errors
    if errors.get("engine") or errors.get("proxy") or session.calls == 0:
        return "infrastructure"  # any engine or proxy error in the run: masking is the safe reading
    if session.last_call_error == "context_length":  # an overflow the harness recovered from does not count
        return "overflow"
    return "timeout" if status == "timeout" else "crash"


async def run_one(host: Host, task: dict[str, Any], harness: Harness, *, group_id: str,
                  evaluator: Evaluator | None, spec: RolloutSpec, name: str,
                  sampling: dict[str, Any] | None = None, replay: Callable[[], Script] | None = None) -> Session:
    """One harness run in a fresh session; the session is closed with its status, reward and reward parts.

    A failed run's reward follows its cause (`failure_cause`, kept in `session.info["failure"]`) as `spec` says.
    Infrastructure failures, an evaluator that fails, and a run its environment masks (MaskedRunError, cause
    "masked"; "overflow" when its last call overflowed the context, the policy's doing) are always masked.
    sampling: forced on every call of the run (see Lab.session). replay: makes the run's Script, when it replays a
    recorded session (polar_lab/replay.py).
    """
    session = host.session(task, group_id=group_id, sampling=sampling, harness=name,
                           replay=replay() if replay is not None else None)
    t0 = time.perf_counter()

    def fail(status: str, cause: str | None = None, **info: Any) -> Session:
        cause = cause or failure_cause(session, status)
        return session.close(reward=spec.reward(cause), status=status, failure=cause,
                             duration_s=time.perf_counter() - t0, **info)

    try:
        result = await _within_deadline(harness(session, task), session, spec.deadline_s)
    except _Deadline:
        return fail("timeout", waited_s=session.waited_s)
    except SandboxError as exc:  # the machine cannot sandbox any program: stop the rollout, not just this run
        fail("error", "infrastructure", error=repr(exc))
        raise
    except MaskedRunError as exc:  # the environment failed, or asked: never trained, whatever failed_reward says
        cause = "overflow" if session.last_call_error == "context_length" else "masked"  # unless the policy overflowed
        return fail("error", cause, error=repr(exc), output=exc.output[-8000:])
    except Exception as exc:  # noqa: BLE001 - a crashed run is data, not a crashed rollout
        output = exc.output[-8000:] if isinstance(exc, HarnessError) else ""  # a program harness's own words
        limit = {"limit": exc.limit} if isinstance(exc, HarnessError) and exc.limit else {}  # the sandbox's reason
        return fail("error", error=repr(exc), output=output, traceback=traceback.format_exc(limit=5), **limit)
    try:  # the evaluator may run tests in subprocesses: keep it off the loop
        parts = await asyncio.to_thread(evaluator, task, result) if evaluator is not None else {}
    except Exception as exc:
        fail("error", "infrastructure", error=f"evaluator failed: {exc!r}", traceback=traceback.format_exc(limit=5))
        if isinstance(exc, SandboxError):
            raise  # the machine cannot score any run (no prlimit): stop the rollout, not just this run
        return session
    return session.close(reward=parts.get("total"), reward_parts=parts, duration_s=time.perf_counter() - t0)


class _Deadline(Exception):
    """The run's deadline passed (a TimeoutError the harness raises itself is a crash, not this)."""


async def _within_deadline(run: Coroutine[Any, Any, Any], session: Session, deadline_s: float) -> Any:
    """Await `run` for `deadline_s` of the policy's time: what its calls spent waiting for the proxy (paused for a
    weight sync, or for a replacement engine) is added back, and a deadline never passes while one waits."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(run)
    start = loop.time()
    try:
        while True:
            remaining = start + deadline_s + session.waited_s - loop.time()
            if remaining <= 0 and not session.waiting:
                raise _Deadline
            done, _ = await asyncio.wait({task}, timeout=max(remaining, 0.05))
            if done:
                return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=5.0)  # let it unwind (close its client) before the run closes


async def rollout_async(host: Host, tasks: list[dict[str, Any]], harness: Harness, *, num_generations: int,
                        evaluator: Evaluator | None, concurrency: int, spec: RolloutSpec, builder: str,
                        progress: bool = True, sampling: dict[str, Any] | None = None,
                        seed: int | None = None, replay: Callable[[], Script] | None = None) -> list[Group]:
    """Run `num_generations` sessions per task (at most `concurrency` at once) and build one Group per task.

    seed: run i (task-major order) gets the forced sampling seed `derived_seed(seed, i)` (seed + i); its calls
    then sample with `call_seed(that seed, k)`. replay: each run's Script (polar_lab/replay.py).
    """
    gate = asyncio.Semaphore(concurrency)
    name = harness_name(harness)
    bar = tqdm(total=len(tasks) * num_generations, desc=f"rollout {name}", disable=not progress)

    async def gated(task: dict[str, Any], group_id: str, i: int) -> Session:
        forced = dict(sampling or {}) | ({"seed": derived_seed(seed, i)} if seed is not None else {})
        async with gate:
            session = await run_one(host, task, harness, group_id=group_id, evaluator=evaluator, spec=spec,
                                    name=harness_name(harness, task), sampling=forced, replay=replay)
        bar.update(1)
        return session

    group_ids = [uuid.uuid4().hex[:8] for _ in tasks]
    runs = [(task, gid) for task, gid in zip(tasks, group_ids) for _ in range(num_generations)]
    sessions = await asyncio.gather(*(gated(task, gid, i) for i, (task, gid) in enumerate(runs)))
    bar.close()
    return await asyncio.to_thread(make_groups, host, tasks, group_ids, sessions, builder)


def make_groups(host: Host, tasks: list[dict[str, Any]], group_ids: list[str], sessions: list[Session],
                builder: str) -> list[Group]:
    """One Group per task: its sessions (in run order) and the trajectories rebuilt from their calls, in the
    order of their sessions (not of the calls' arrival), so the same runs make the same group."""
    trajectories = host.trajectories(builder, session_ids=[s.id for s in sessions])
    order = {s.id: i for i, s in enumerate(sessions)}
    trajectories.sort(key=lambda t: (order[t.session_id], t.chain_index))
    groups = []
    for task, gid in zip(tasks, group_ids):
        members = [s for s in sessions if s.group_id == gid]
        ids = {s.id for s in members}
        groups.append(Group(task=task, sessions=members, trajectories=[t for t in trajectories if t.session_id in ids]))
    return groups


def harness_name(harness: Harness, task: dict[str, Any] | None = None) -> str:
    """What a session records as its harness: the function's or class's name; a mixture's, the one that runs `task`
    (harness/mixture.py)."""
    if task is not None and hasattr(harness, "name_for"):
        return harness.name_for(task)
    inner = getattr(harness, "func", harness)  # functools.partial
    return getattr(inner, "__name__", type(inner).__name__)
