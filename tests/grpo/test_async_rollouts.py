"""The async producer (grpo/rollouts.py AsyncRollouts) on a scripted engine: a window of groups at most, each
seeded from the config; the staleness bound, reruns and drops; dynamic sampling as groups arrive; one producer per
Lab; failures raised to the trainer; close() waiting for runs to unwind."""

import asyncio
import itertools
import queue
import threading
import time
from pathlib import Path

import pytest

from polar_lab.grpo import GRPOConfig
from polar_lab.grpo.batch import group_staleness
from polar_lab.grpo.rollouts import AsyncRollouts, TaskStream
from polar_lab.types import call_seed, derived_seed, mix_seed
from tests.grpo.scripted_runs import FLAT, SPREAD, TASKS, by_task, ends_early, two_turns
from tests.grpo.scripted_runs import client as _client


def test_async_dynamic_sampling_skips_groups_without_spread_as_they_arrive(replies_lab):
    config = GRPOConfig(seed=1, tasks_per_step=2, num_generations=4, dynamic_sampling=True, async_mode=True)
    stream = TaskStream(FLAT + SPREAD, seed=0)
    order = itertools.cycle(FLAT[:2] + SPREAD)
    stream.take = lambda n: [next(order) for _ in range(n)]
    rollouts = AsyncRollouts(replies_lab, config, two_turns, by_task, stream)
    try:
        groups, stats = rollouts.next_groups(0, timeout=20)
    finally:
        rollouts.close()
    assert len(groups) == 2 and all(len({s.reward for s in g.sessions}) > 1 for g in groups)
    assert all(g.task["id"].startswith("spread") for g in groups) and stats["groups_filtered_zero_std"] >= 1


def _wait_until(condition, timeout: float = 20.0) -> None:  # what takes 1-2 s here
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


async def _producer_state(rollouts: AsyncRollouts) -> tuple[int, bool]:
    """The producer's groups under way and whether it waits for a slot, after the loop had turns enough to start
    any group it could."""
    for _ in range(20):
        await asyncio.sleep(0)
    return len(rollouts._running), rollouts._slots.locked()


def test_async_rollouts_run_a_window_of_groups_at_most_each_seeded_from_the_config(replies_lab):
    """tasks_per_step × async_window_steps groups run at once (2 × 3: 6, not 5 or 7); the k-th group's runs are seeded
    derived_seed(mix_seed(seed, "group", k), i) from k = 0; a group three versions behind is within max_staleness=3;
    close() cuts off the groups still running."""
    gates, started, cancelled = [threading.Event()], [], []  # each run waits for the gate current at its start

    async def held(session, task):
        gate = gates[-1]
        reply = await _client(session).chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        started.append(session.id)
        try:
            while not gate.is_set():
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            cancelled.append(session.id)
            raise
        return [reply.choices[0].message.content]

    config = GRPOConfig(seed=5, tasks_per_step=2, async_window_steps=3, num_generations=2, async_mode=True,
                        max_staleness=3)
    rollouts = AsyncRollouts(replies_lab, config, held, ends_early, TaskStream(TASKS, seed=0))
    try:
        _wait_until(lambda: len(started) == 12)
        assert replies_lab.run(_producer_state(rollouts)) == (6, True) and len(started) == 12
        seeds = {c.sampling["seed"] for c in replies_lab.reader.call_records()}
        assert seeds == {call_seed(derived_seed(mix_seed(5, "group", k), i), 0) for k in range(6) for i in range(2)}
        gates.append(threading.Event())  # the groups that start from now on are held
        gates[0].set()
        groups, stats = rollouts.next_groups(3, timeout=20)  # sampled at version 0, at the bound: kept
        assert len(groups) == 2 and stats["groups_dropped_stale"] == 0
        _wait_until(lambda: len(started) == 16)  # a slot freed by each group taken: two new groups run
        assert replies_lab.run(_producer_state(rollouts)) == (2, True)  # the finished ones are not kept
    finally:
        rollouts.close()
        for gate in gates:
            gate.set()
    assert cancelled and replies_lab.owned(AsyncRollouts) == []


@pytest.mark.parametrize("stale_groups", ["rerun", "drop"])
def test_an_async_group_staler_than_the_bound_is_dropped_and_its_task_runs_next_when_rerun(replies_lab, stale_groups):
    config = GRPOConfig(seed=1, tasks_per_step=1, async_window_steps=1, num_generations=2, async_mode=True,
                        max_staleness=1, stale_groups=stale_groups, max_reruns=1)
    first, second = TaskStream(TASKS, seed=0).take(2)
    rollouts = AsyncRollouts(replies_lab, config, two_turns, ends_early, TaskStream(TASKS, seed=0))
    try:
        _wait_until(lambda: rollouts.ready.qsize() == 1)  # the first group, sampled at version 0; a window of one
        replies_lab.engine.load_weights({}, version=2)  # the trainer moved on two versions: that group is stale
        groups, stats = rollouts.next_groups(2, timeout=20)
    finally:
        rollouts.close()
    assert [g.task["id"] for g in groups] == [first["id"] if stale_groups == "rerun" else second["id"]]
    assert group_staleness(groups[0], 2) == 0
    runs = groups[0].sessions  # one group id for the group's runs, each named after its harness
    assert runs[0].group_id and [(s.group_id, s.info["harness"]) for s in runs] == [(runs[0].group_id, "two_turns")] * 2
    assert (stats["groups_dropped_stale"], stats["groups_rerun"]) == (1, int(stale_groups == "rerun"))
    assert stats["dropped_tokens_mean"] > 0 and "groups_filtered_zero_std" not in stats  # no dynamic sampling


def test_every_stale_group_of_a_step_is_counted_and_each_task_reruns_in_turn(replies_lab):
    """Two groups go stale before one step takes them: both are dropped, both tasks re-queued (the count adds up, it
    is not the last one's), and the step trains one of their tasks, re-run at the new version."""
    config = GRPOConfig(seed=1, tasks_per_step=1, async_window_steps=2, num_generations=2, async_mode=True,
                        max_staleness=2, stale_groups="rerun", max_reruns=1)
    first, second = TaskStream(TASKS, seed=0).take(2)
    rollouts = AsyncRollouts(replies_lab, config, two_turns, ends_early, TaskStream(TASKS, seed=0))
    try:
        _wait_until(lambda: rollouts.ready.qsize() == 2)  # a window of two groups, both sampled at version 0
        replies_lab.engine.load_weights({}, version=3)  # three versions on: both past the bound of two
        groups, stats = rollouts.next_groups(3, timeout=20)
    finally:
        rollouts.close()
    assert (stats["groups_dropped_stale"], stats["groups_rerun"]) == (2, 2)
    # re-queued tasks run before new ones: the step trains one of the two, whichever went stale first
    assert len(groups) == 1 and groups[0].task["id"] in {first["id"], second["id"]} and first["id"] != second["id"]
    assert group_staleness(groups[0], 3) == 0


def test_a_step_waiting_on_groups_gives_up_at_its_timeout(replies_lab):
    """`next_groups(timeout=...)` raises queue.Empty when no group is ready in time, instead of blocking the trainer."""
    gate = threading.Event()

    async def held(session, task):
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return ["reply A"]

    config = GRPOConfig(seed=1, tasks_per_step=1, num_generations=2, async_mode=True)
    rollouts = AsyncRollouts(replies_lab, config, held, ends_early, TaskStream(TASKS, seed=0))
    raised = []

    def step():
        try:
            rollouts.next_groups(0, timeout=0.3)
        except queue.Empty as exc:
            raised.append(exc)

    waiter = threading.Thread(target=step, daemon=True)  # daemon: a build that blocks here must not hang pytest
    try:
        waiter.start()
        waiter.join(15)
        assert not waiter.is_alive() and len(raised) == 1, "the step blocked past its timeout"
    finally:
        rollouts.close()
        gate.set()


def test_a_second_async_producer_on_a_lab_stops_the_first(replies_lab):
    config = GRPOConfig(seed=1, tasks_per_step=1, num_generations=2, async_mode=True)
    first = AsyncRollouts(replies_lab, config, two_turns, ends_early, TaskStream(TASKS, seed=0))
    why = r"^stopping the async rollouts of an earlier trainer on this Lab \(one producer per Lab\)$"
    with pytest.warns(UserWarning, match=why) as caught:
        second = AsyncRollouts(replies_lab, config, two_turns, ends_early, TaskStream(TASKS, seed=0))
    # once, naming the line that made the second producer, not polar_lab's (mutmut's trampoline, where it wraps the
    # class, is the first frame outside polar_lab). Only this warning is counted: pytest.warns records every warning
    # of every thread, and a CI run caught two more in this window. Stopping producers in a loop shows what they are:
    # ResourceWarnings ("unclosed transport") of the cut-off runs' SDK connections, which the collector finalises
    # whenever it next runs, in whichever thread.
    stops = [w for w in caught if "one producer per Lab" in str(w.message)]
    assert len(stops) == 1 and (stops[0].filename == __file__ or "mutmut" in Path(stops[0].filename).parts)
    try:
        assert first._producer.done() and replies_lab.owned(AsyncRollouts) == [second]
        assert len(second.next_groups(0, timeout=20)[0]) == 1
    finally:
        second.close()
    assert second._producer.done() and replies_lab.owned(AsyncRollouts) == []


def test_async_dynamic_sampling_skips_up_to_its_bound_then_keeps_what_comes(replies_lab):
    """A window of one group makes the order of arrival the order of tasks: with max_refill_rounds=2 (two groups
    without spread may be skipped per group kept), flat0 and flat1 are skipped and flat2 is trained."""
    config = GRPOConfig(seed=1, tasks_per_step=1, async_window_steps=1, num_generations=2, dynamic_sampling=True,
                        max_refill_rounds=2, async_mode=True)
    stream = TaskStream(FLAT, seed=0)
    stream.take = lambda n, _order=iter(FLAT + FLAT[:1]): [next(_order) for _ in range(n)]  # then the stream ends
    rollouts = AsyncRollouts(replies_lab, config, two_turns, by_task, stream)
    try:
        groups, stats = rollouts.next_groups(0, timeout=20)
    finally:
        rollouts.close()
    assert [g.task["id"] for g in groups] == ["flat2"] and stats["groups_filtered_zero_std"] == 2


def test_a_task_that_reaches_the_loss_may_be_rerun_again_later(replies_lab):
    """max_reruns bounds re-queues *in a row*: once a task's rerun is trained, its count starts again, so the same
    task going stale at a later step is re-run again (one task, so every group is that task's)."""
    config = GRPOConfig(seed=1, tasks_per_step=1, async_window_steps=1, num_generations=2, async_mode=True,
                        max_staleness=1, stale_groups="rerun", max_reruns=1)
    rollouts = AsyncRollouts(replies_lab, config, two_turns, ends_early, TaskStream(TASKS[:1], seed=0))
    reruns = []
    try:
        for version in (2, 4):  # each time, the group waiting was sampled two versions ago
            _wait_until(lambda: rollouts.ready.qsize() == 1)
            replies_lab.engine.load_weights({}, version=version)
            groups, stats = rollouts.next_groups(version, timeout=20)
            assert len(groups) == 1 and group_staleness(groups[0], version) == 0
            reruns.append(stats["groups_rerun"])
    finally:
        rollouts.close()
    assert reruns == [1, 1]


@pytest.mark.parametrize("where", ["group", "producer"])
def test_a_failure_building_a_group_or_in_the_producer_reaches_the_trainer(replies_lab, monkeypatch, where):
    """A group whose trajectories cannot be built, and the producer itself failing (its task stream), each reach the
    trainer's next_groups as the error, not as a wait."""
    from polar_lab.grpo import rollouts as rollouts_module

    error = ValueError if where == "group" else OSError

    def broken(*args, **kwargs):
        raise error("no trajectories" if where == "group" else "the task file went away")

    stream = TaskStream(TASKS, seed=0)
    if where == "group":
        monkeypatch.setattr(rollouts_module, "make_groups", broken)
    else:
        stream.take = broken
    config = GRPOConfig(seed=1, tasks_per_step=1, num_generations=2, async_mode=True)
    rollouts = AsyncRollouts(replies_lab, config, two_turns, ends_early, stream)
    try:
        with pytest.raises(RuntimeError, match=f"^async rollout failed: {error.__name__}") as failed:
            rollouts.next_groups(0, timeout=20)
        assert isinstance(failed.value.__cause__, error)
    finally:
        rollouts.close()


def test_each_async_run_records_the_harness_of_a_mixture_that_ran_its_task(replies_lab):
    from polar_lab.harness.mixture import HarnessMixture

    async def other(session, task):
        return await two_turns(session, task)

    mixture = HarnessMixture({"two_turns": two_turns, "other": other})
    config = GRPOConfig(seed=1, tasks_per_step=2, num_generations=2, async_mode=True)
    rollouts = AsyncRollouts(replies_lab, config, mixture, ends_early, TaskStream(TASKS, seed=0))
    try:
        groups, _ = rollouts.next_groups(0, timeout=20)
    finally:
        rollouts.close()
    recorded = {g.task["id"]: {s.info["harness"] for s in g.sessions} for g in groups}
    assert recorded == {g.task["id"]: {mixture.name_for(g.task)} for g in groups}
    assert set().union(*recorded.values()) == {"two_turns", "other"}  # the two tasks took the two in turn


def test_close_returns_once_the_cancelled_runs_have_unwound(replies_lab):
    """close() waits for every running group to unwind, a harness's own clean-up included: nothing of the producer's
    is left running on the Lab's loop when it returns."""
    started, unwound = [], []

    async def slow_to_unwind(session, task):
        started.append(session.id)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)  # a harness's clean-up: closing its client, stopping its program
            unwound.append(session.id)
            raise

    config = GRPOConfig(seed=1, tasks_per_step=1, async_window_steps=2, num_generations=2, async_mode=True)
    rollouts = AsyncRollouts(replies_lab, config, slow_to_unwind, ends_early, TaskStream(TASKS, seed=0))
    try:
        _wait_until(lambda: len(started) == 4)  # two groups of two runs
    finally:
        rollouts.close()
    assert sorted(unwound) == sorted(started)
