"""Where a GRPO step's groups come from: sync (rollout, then train) or async (a producer on the Lab's loop).

SyncRollouts   each step runs `tasks_per_step` fresh groups on the current weights and waits for them.
AsyncRollouts  a producer coroutine on the Lab's loop keeps groups running all the time; the trainer
               takes finished ones. Admission is bounded: at most `tasks_per_step × async_window_steps`
               groups are running or waiting, so the producer cannot run far ahead of the trainer.
               A group whose oldest trained token is more than `max_staleness` versions behind the
               trainer when it is taken is dropped or its task re-queued (`stale_groups`, at most
               `max_reruns` times in a row); it never reaches the loss. The default bound (4) is wider than
               the window (1): a long group a few versions old is kept and corrected by TIS rather than dropped,
               since dropping favours short rollouts.

Every rollout is seeded from `GRPOConfig.seed` (sync: per step, async: per group), and within a run each
call has its own seed (`types.call_seed`): the same config gives the same groups on the same weights.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import random
import threading
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from polar_lab.errors import warn_at_caller
from polar_lab.grpo.batch import group_staleness, informative
from polar_lab.grpo.config import GRPOConfig
from polar_lab.rollout import harness_name, make_groups, run_one
from polar_lab.trajectory.builders import BUILDERS
from polar_lab.types import TRAINING_OFF, Evaluator, Group, Harness, ModelCall, Trajectory, derived_seed, mix_seed

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
        self._reruns: dict[int, int] = {}  # id(task) → re-queues in a row (tasks are this stream's own dicts)
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

    def requeue(self, task: dict[str, Any], max_reruns: int) -> bool:
        """Put `task` first in line again, unless it was re-queued `max_reruns` times in a row already (a task
        that never fits the staleness window would otherwise come back forever). Returns whether it was."""
        with self._lock:
            reruns = self._reruns.get(id(task), 0)
            if reruns >= max_reruns:
                self._reruns.pop(id(task), None)
                return False
            self._reruns[id(task)] = reruns + 1
            self._queue.appendleft(task)
            return True

    def settled(self, task: dict[str, Any]) -> None:
        """`task`'s group reached the loss: its rerun count starts again."""
        with self._lock:
            self._reruns.pop(id(task), None)


class SyncRollouts:
    def __init__(self, lab: Lab, config: GRPOConfig, harness: Harness, evaluator: Evaluator | None,
                 tasks: TaskStream):
        self.lab, self.config, self.harness, self.evaluator, self.tasks = lab, config, harness, evaluator, tasks
        self.rollouts = 0  # rollouts so far: the k-th is seeded mix_seed(config.seed, "rollout", k)

    def next_groups(self, trainer_version: int, *, progress: bool = False) -> tuple[list[Group], dict[str, float]]:
        c = self.config
        groups = self._rollout(c.tasks_per_step, progress)
        if not c.dynamic_sampling:
            return groups, dropped_stats([])
        kept, filtered, rounds = [g for g in groups if informative(g)], len(groups), 0
        while len(kept) < c.tasks_per_step and rounds < c.max_refill_rounds:  # refill what the filter took
            rounds += 1
            more = self._rollout(c.tasks_per_step - len(kept), progress)
            filtered += len(more)
            kept += [g for g in more if informative(g)]
        filtered -= len(kept)
        return kept, {**dropped_stats([]), "groups_filtered_zero_std": filtered, "refill_rounds": rounds}

    def _rollout(self, tasks: int, progress: bool) -> list[Group]:
        """One rollout of `tasks` fresh tasks; the k-th rollout of this source is seeded mix_seed(seed, "rollout", k)."""
        c = self.config
        seed = mix_seed(c.seed, "rollout", self.rollouts)
        self.rollouts += 1
        return self.lab.rollout(self.tasks.take(tasks), self.harness, num_generations=c.num_generations,
                                evaluator=self.evaluator, concurrency=c.concurrency, spec=c.rollout_spec(),
                                builder=trajectory_builder(c), progress=progress, sampling=rollout_sampling(c),
                                seed=seed)

    def close(self) -> None:
        pass


class AsyncRollouts:
    def __init__(self, lab: Lab, config: GRPOConfig, harness: Harness, evaluator: Evaluator | None,
                 tasks: TaskStream):
        self.lab, self.config, self.harness, self.evaluator, self.tasks = lab, config, harness, evaluator, tasks
        self.capacity = config.tasks_per_step * config.async_window_steps
        self.ready: queue.Queue[Group | BaseException] = queue.Queue()  # producer (loop) → trainer thread
        self._slots: asyncio.Semaphore | None = None
        self._running: set[asyncio.Task] = set()
        self._stopped = False
        for other in lab.owned(AsyncRollouts):
            warn_at_caller("stopping the async rollouts of an earlier trainer on this Lab (one producer per Lab)")
            other.close()
        lab.adopt(self)
        self._producer = lab.submit(self._produce())

    def next_groups(self, trainer_version: int, timeout: float | None = None, *,
                    progress: bool = False) -> tuple[list[Group], dict[str, float]]:
        """Block until `tasks_per_step` groups within the staleness bound are ready (no bar: runs are
        already under way when this is called)."""
        c = self.config
        fresh: list[Group] = []
        dropped: list[Group] = []
        reruns = filtered = 0
        max_filtered = c.tasks_per_step * c.max_refill_rounds
        while len(fresh) < c.tasks_per_step:
            group = self._take(timeout)
            try:
                if group_staleness(group, trainer_version) > c.max_staleness:
                    dropped.append(group)
                    reruns += c.stale_groups == "rerun" and self.tasks.requeue(group.task, c.max_reruns)
                    continue
                self.tasks.settled(group.task)
                if c.dynamic_sampling and not informative(group) and filtered < max_filtered:
                    filtered += 1  # the producer keeps going: the next group ready takes its place
                    continue
                fresh.append(group)
            finally:  # only now one more group may start: a task re-queued above is the one it runs
                self._free_slot()
        extra = {"groups_filtered_zero_std": filtered} if c.dynamic_sampling else {}
        return fresh, {**dropped_stats(dropped, reruns=reruns), **extra}

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
            groups = 0
            while not self._stopped:
                await self._slots.acquire()
                task = self.tasks.take(1)[0]
                job = asyncio.create_task(self._one_group(task, mix_seed(self.config.seed, "group", groups)))
                groups += 1
                self._running.add(job)
                job.add_done_callback(self._running.discard)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - surfaced to the trainer thread
            self.ready.put(exc)

    async def _one_group(self, task: dict[str, Any], seed: int) -> None:
        c = self.config
        group_id = uuid.uuid4().hex[:8]
        try:
            sessions = await asyncio.gather(*(
                run_one(self.lab, task, self.harness, group_id=group_id, evaluator=self.evaluator,
                        spec=c.rollout_spec(), name=harness_name(self.harness, task),
                        sampling=rollout_sampling(c) | {"seed": derived_seed(seed, i)})
                for i in range(c.num_generations)))
            groups = await asyncio.to_thread(make_groups, self.lab, [task], [group_id], list(sessions),
                                             trajectory_builder(c))
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
        if isinstance(item, BaseException):
            self._free_slot()
            raise RuntimeError(f"async rollout failed: {item!r}") from item
        return item

    def _free_slot(self) -> None:
        self.lab.submit(self._release())


def trajectory_builder(config: GRPOConfig) -> str | Callable[[list[ModelCall]], list[Trajectory]]:
    """The builder the config names, keeping grammar-constrained tokens in the loss when `train_constrained`."""
    if not config.train_constrained:
        return config.builder
    return functools.partial(BUILDERS[config.builder], train_constrained=True)


SUPPORT = ("top_k", "top_p", "min_p")  # what the trainer can replay (loss.restrict): sampling_support="replay"


def rollout_sampling(config: GRPOConfig) -> dict[str, Any]:
    """What every training and evaluation call is forced to, whatever the harness sends: the distribution the
    loss assumes. The trainer computes the softmax at the training temperature — within each call's top-k / top-p /
    min-p support when `sampling_support="replay"` (the default: the harness's own values apply and are replayed,
    loss.restrict), over the whole vocabulary with "force" (they are forced off). What it cannot replay is always
    forced off: banned strings, penalties and logit biases reshape the distribution, and a thinking budget forces a
    thought's end the policy did not choose (each would make the engine's logprobs another distribution's: a
    systematic TIS bias, not noise). A harness's own values are kept in the call's record (`sampling["overridden"]`),
    not applied. (Grammars stay: a harness asking for JSON gets JSON; those tokens are left out of the loss
    instead, see trajectory.builders._extend.)"""
    off = {k: v for k, v in TRAINING_OFF.items() if config.sampling_support == "force" or k not in SUPPORT}
    return {"temperature": config.temperature, "max_tokens": config.max_completion_length, **off}


def dropped_stats(dropped: list[Group], *, reruns: int = 0) -> dict[str, float]:
    """What the staleness filter threw away this step: how many groups, how many of their tasks were re-queued,
    and their runs' mean sampled tokens and reward (compare with the batch's: dropping that favours short or
    easy rollouts shows up here first)."""
    runs = [s for g in dropped for s in g.sessions]
    tokens = sum(sum(t.loss_mask) for g in dropped for t in g.trajectories)
    rewards = [s.reward for s in runs if s.reward is not None]
    return {"groups_dropped_stale": len(dropped), "groups_rerun": reruns,
            "dropped_tokens_mean": tokens / len(runs) if runs else float("nan"),
            "dropped_reward_mean": sum(rewards) / len(rewards) if rewards else float("nan")}
