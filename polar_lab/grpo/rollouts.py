"""Where a GRPO step's groups come from: sync (rollout, then train) or async (a producer on the Lab's loop).

SyncRollouts   each step runs `tasks_per_step` fresh groups on the current weights and waits for them.
AsyncRollouts  a producer coroutine on the Lab's loop keeps groups running all the time; the trainer
               takes finished ones. Admission is bounded: at most `tasks_per_step × max_staleness`
               groups are running or waiting, so the producer cannot run far ahead of the trainer.
               A group whose oldest trained token is more than `max_staleness` versions behind the
               trainer when it is taken is dropped or its task re-queued (`stale_groups`); it never
               reaches the loss.
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import uuid
import warnings
from collections import deque
from typing import TYPE_CHECKING, Any

from polar_lab.grpo.batch import group_staleness
from polar_lab.grpo.config import GRPOConfig
from polar_lab.rollout import harness_name, make_groups, run_one
from polar_lab.types import Evaluator, Group, Harness

if TYPE_CHECKING:
    from polar_lab.lab import Lab


class TaskStream:
    """The training tasks in a seeded shuffle, reshuffled each epoch; re-queued tasks come first."""

    def __init__(self, tasks: list[dict[str, Any]], seed: int):
        if not tasks:
            raise ValueError("no training tasks")
        self._tasks = list(tasks)
        self._rng = random.Random(seed)
        self._queue: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()
        self.epoch = 0

    def take(self, n: int) -> list[dict[str, Any]]:
        with self._lock:
            out = []
            while len(out) < n:
                if not self._queue:
                    order = self._tasks[:]
                    self._rng.shuffle(order)
                    self._queue.extend(order)
                    self.epoch += 1
                out.append(self._queue.popleft())
            return out

    def requeue(self, task: dict[str, Any]) -> None:
        with self._lock:
            self._queue.appendleft(task)


class SyncRollouts:
    def __init__(self, lab: Lab, config: GRPOConfig, harness: Harness, evaluator: Evaluator | None,
                 tasks: TaskStream):
        self.lab, self.config, self.harness, self.evaluator, self.tasks = lab, config, harness, evaluator, tasks

    def next_groups(self, trainer_version: int, *, progress: bool = False) -> tuple[list[Group], dict[str, float]]:
        c = self.config
        groups = self.lab.rollout(self.tasks.take(c.tasks_per_step), self.harness, num_generations=c.num_generations,
                                  evaluator=self.evaluator, concurrency=c.concurrency, deadline_s=c.deadline_s,
                                  builder=c.builder, progress=progress, failed_reward=c.failed_reward,
                                  sampling=rollout_sampling(c))
        return groups, {"groups_dropped_stale": 0}

    def close(self) -> None:
        pass


class AsyncRollouts:
    def __init__(self, lab: Lab, config: GRPOConfig, harness: Harness, evaluator: Evaluator | None,
                 tasks: TaskStream):
        self.lab, self.config, self.harness, self.evaluator, self.tasks = lab, config, harness, evaluator, tasks
        self.capacity = config.tasks_per_step * config.max_staleness
        self.ready: queue.Queue[Group | BaseException] = queue.Queue()  # producer (loop) → trainer thread
        self._slots: asyncio.Semaphore | None = None
        self._running: set[asyncio.Task] = set()
        self._stopped = False
        for other in lab.owned(AsyncRollouts):
            warnings.warn("stopping the async rollouts of an earlier trainer on this Lab (one producer per Lab)",
                          stacklevel=3)
            other.close()
        lab.adopt(self)
        self._producer = lab.submit(self._produce())

    def next_groups(self, trainer_version: int, timeout: float | None = None, *,
                    progress: bool = False) -> tuple[list[Group], dict[str, float]]:
        """Block until `tasks_per_step` groups within the staleness bound are ready (no bar: runs are
        already under way when this is called)."""
        fresh: list[Group] = []
        dropped = 0
        while len(fresh) < self.config.tasks_per_step:
            group = self._take(timeout)
            if group_staleness(group, trainer_version) > self.config.max_staleness:
                dropped += 1
                if self.config.stale_groups == "rerun":
                    self.tasks.requeue(group.task)
                continue
            fresh.append(group)
        return fresh, {"groups_dropped_stale": dropped}

    def close(self) -> None:
        """Stop producing; cancel running groups (their completed calls stay recorded)."""
        if self._stopped:
            return
        self._stopped = True
        self.lab.release(self)
        if not self.lab.closed:
            self.lab.run(self._cancel_all(), timeout=60)

    # ---- on the Lab's loop -----------------------------------------------------------------------
    async def _produce(self) -> None:
        self._slots = asyncio.Semaphore(self.capacity)
        try:
            while not self._stopped:
                await self._slots.acquire()
                task = self.tasks.take(1)[0]
                job = asyncio.create_task(self._one_group(task))
                self._running.add(job)
                job.add_done_callback(self._running.discard)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - surfaced to the trainer thread
            self.ready.put(exc)

    async def _one_group(self, task: dict[str, Any]) -> None:
        c = self.config
        group_id = uuid.uuid4().hex[:8]
        try:
            sessions = await asyncio.gather(*(
                run_one(self.lab, task, self.harness, group_id=group_id, evaluator=self.evaluator,
                        deadline_s=c.deadline_s, name=harness_name(self.harness), failed_reward=c.failed_reward,
                        sampling=rollout_sampling(c))
                for _ in range(c.num_generations)))
            groups = await asyncio.to_thread(make_groups, self.lab, [task], [group_id], list(sessions), c.builder)
            self.ready.put(groups[0])
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - surfaced to the trainer thread
            self.ready.put(exc)

    async def _cancel_all(self) -> None:
        self._producer.cancel()
        for job in list(self._running):
            job.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)

    async def _release(self) -> None:
        self._slots.release()

    def _take(self, timeout: float | None) -> Group:
        item = self.ready.get(timeout=timeout)
        self.lab.submit(self._release())  # one more group may start
        if isinstance(item, BaseException):
            raise RuntimeError(f"async rollout failed: {item!r}") from item
        return item


def rollout_sampling(config: GRPOConfig) -> dict[str, Any]:
    """What every training and evaluation call is forced to, whatever the harness sends: the distribution the
    loss assumes. The trainer computes the full softmax at the training temperature, so the sampler must draw
    from it too: no top-p/top-k truncation and no banned strings (each renormalises over fewer tokens, and the
    engine's logprobs then belong to another distribution: a systematic TIS bias, not noise). A harness's own
    values are kept in the call's record (`sampling["overridden"]`), not applied."""
    return {"temperature": config.temperature, "max_tokens": config.max_completion_length,
            "top_p": 1.0, "top_k": -1, "banned_strings": ()}
