"""Where training groups come from, on a scripted engine (this layer's logic, not the engine's): rollouts seeded
from the config per step, run and call; failed runs rewarded by cause; what the staleness filter drops; dynamic
sampling's refills. The async producer's tests are in test_async_rollouts.py."""

import asyncio
import itertools
import threading
import time

import openai
import orjson
import pytest

from polar_lab import Lab
from polar_lab.engine import ScriptedEngine
from polar_lab.grpo import GRPOConfig, GRPOTrainer
from polar_lab.grpo.rollouts import SyncRollouts, TaskStream, dropped_stats
from polar_lab.types import Group, Session, Trajectory, call_seed, mix_seed
from tests.grpo.scripted_runs import FLAT, REPLIES, SPREAD, TASKS, by_task, ends_early, two_turns
from tests.grpo.scripted_runs import client as _client


def test_two_rollouts_with_the_same_seed_give_the_same_groups(replies_lab):
    def two_steps(seed):
        config = GRPOConfig(seed=seed, tasks_per_step=2, num_generations=4)
        rollouts = SyncRollouts(replies_lab, config, two_turns, ends_early, TaskStream(TASKS, seed=seed))
        steps = [rollouts.next_groups(0)[0] for _ in range(2)]
        return [[(g.task["id"], [s.reward for s in g.sessions], [t.token_ids for t in g.trajectories])
                 for g in groups] for groups in steps]

    first = two_steps(3)
    assert first == two_steps(3)  # on the same engine, after other calls: nothing depends on arrival order
    assert first != two_steps(4)
    assert first[0] != first[1]  # step 2 is not step 1 again

    calls = replies_lab.reader.call_records()
    seeds = [c.sampling["seed"] for c in calls]
    per_config = 2 * 8 * 2  # steps x runs x calls: every call its own seed, the same ones again for seed 3
    assert (len(seeds), len(set(seeds))) == (3 * per_config, 2 * per_config)
    by_session = {}
    for c in calls:
        by_session.setdefault(c.session_id, []).append(c)
    for session_calls in by_session.values():
        run_seed = session_calls[0].sampling["seed"]
        assert [c.sampling["seed"] for c in session_calls] == [call_seed(run_seed, k) for k in (0, 1)]
    # what the harness asked and training overrides is recorded, not applied (max_tokens: the proxy's default,
    # capped at 128); its top_p is applied: the trainer replays it (sampling_support="replay", the default)
    assert all(c.sampling["overridden"] == {"seed": 42, "max_tokens": 1024} for c in calls)
    assert all((c.sampling["top_p"], c.sampling["max_tokens"]) == (0.5, 128) for c in calls)


async def hangs_every_other_run(session, task, _runs=itertools.count()):
    await _client(session).chat.completions.create(model="m", messages=[{"role": "user", "content": task["q"]}])
    if next(_runs) % 2 == 0:
        await asyncio.sleep(3600)  # a policy that never finishes: the deadline stops it
    return ["reply A"]


@pytest.mark.filterwarnings("ignore:engine and trainer disagree")  # the scripted engine's logprobs are all -1
@pytest.mark.parametrize("timeout_reward", [0.0, None])
def test_a_run_that_hangs_to_the_deadline_gets_timeout_reward(replies_lab, tmp_path, timeout_reward):
    config = GRPOConfig(tasks_per_step=1, num_generations=4, deadline_s=1.0, timeout_reward=timeout_reward,
                        output_dir=str(tmp_path))
    with GRPOTrainer(replies_lab, config, harness=hangs_every_other_run, evaluator=ends_early, tasks=TASKS) as t:
        m = t.step(progress=False)
    (group,) = t.last_groups
    hung = [s for s in group.sessions if s.status == "timeout"]
    assert len(hung) == 2 and all(s.info["failure"] == "timeout" and s.reward == timeout_reward for s in hung)
    assert (m["fail_timeout_frac"], m["group_fail_frac_max"]) == (0.5, 0.5)
    lines = [orjson.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]  # strict JSON
    assert lines[0]["dropped_tokens_mean"] is None and lines[0]["fail_timeout_frac"] == 0.5  # NaN written as null
    trained = {s.session_id for s in t.last_batch.samples}
    if timeout_reward is None:  # masked: the policy learns nothing from its hangs
        assert m["runs_scored"] == 2 and not trained & {s.id for s in hung}
    else:  # scored 0 beside two runs scored 1: the hangs get a negative advantage
        assert m["runs_scored"] == 4 and trained == {s.id for s in group.sessions}
        assert all(s.advantage < 0 for s in t.last_batch.samples if s.session_id in {h.id for h in hung})


async def calls_then_crashes(session, task):
    await _client(session).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the harness fell over")


async def hangs_before_asking(session, task):
    await asyncio.sleep(3600)


def test_failures_the_infrastructure_caused_stay_masked_whatever_the_rewards(replies_lab):
    rewards = dict(timeout_reward=0.0, overflow_reward=0.0, failed_reward=0.0)
    (hung,) = replies_lab.rollout(TASKS[:1], hangs_before_asking, num_generations=2, deadline_s=0.5,
                                  progress=False, **rewards)
    replies_lab.engine.fail_with = RuntimeError("engine gone")  # every call a 503
    (broken,) = replies_lab.rollout(TASKS[:1], calls_then_crashes, num_generations=2, progress=False, **rewards)
    replies_lab.engine.fail_with = None
    (crashed,) = replies_lab.rollout(TASKS[:1], calls_then_crashes, num_generations=2, progress=False, **rewards)
    for group, cause, reward in ((hung, "infrastructure", None), (broken, "infrastructure", None),
                                 (crashed, "crash", 0.0)):
        assert [(s.info["failure"], s.reward) for s in group.sessions] == [(cause, reward)] * 2
    assert all(s.call_errors == {"engine": 1} and s.calls == 0 for s in broken.sessions)
    assert all(s.call_errors == {} and s.calls == 1 for s in crashed.sessions)
    stored = replies_lab.reader.rewards().set_index("session_id")  # the run folder says why, too
    assert stored.loc[crashed.sessions[0].id, "failure"] == "crash"


def test_dropped_groups_report_their_length_and_reward():
    def group(reward, sampled):
        s = Session(id=f"s{sampled}", key="", reward=reward, status="closed")
        t = Trajectory(session_id=s.id, chain_index=0, token_ids=list(range(2 + sampled)),
                       loss_mask=[0, 0] + [1] * sampled, behavior_logprobs=[0.0] * (2 + sampled),
                       policy_versions=[0] * (2 + sampled))
        return Group(task={}, sessions=[s], trajectories=[t])

    stats = dropped_stats([group(1.0, 30), group(0.0, 10)], reruns=1)
    assert stats == {"groups_dropped_stale": 2, "groups_rerun": 1, "dropped_tokens_mean": 20.0,
                     "dropped_reward_mean": 0.5}
    assert dropped_stats([])["groups_dropped_stale"] == 0


async def ask(session, content="hi", **kw):
    return await _client(session).chat.completions.create(model="m", messages=[{"role": "user", "content": content}],
                                                          **kw)


def test_the_cause_is_the_runs_own_doing_only_when_it_is(replies_lab):
    """Overflow only when the last call was refused; a TimeoutError the harness raises is a crash, not the
    deadline; a failing evaluator is the infrastructure's."""
    too_long = "x " * (replies_lab.engine.max_model_len + 8)

    async def overflows(session, task):
        await ask(session)
        await ask(session, too_long)  # a 400: the harness gives up

    async def recovers_then_crashes(session, task):
        with pytest.raises(openai.BadRequestError):
            await ask(session, too_long)
        await ask(session)  # compacted, carried on
        raise RuntimeError("later, something else")

    async def times_out_itself(session, task):
        await ask(session)
        await asyncio.wait_for(asyncio.sleep(10), 0.05)  # its own timeout, well inside the run's deadline

    def broken_evaluator(task, result):
        raise ValueError("cannot score")

    rewards = dict(timeout_reward=-1.0, overflow_reward=-2.0, failed_reward=-3.0)
    cases = [(overflows, None, "overflow", -2.0), (recovers_then_crashes, None, "crash", -3.0),
             (times_out_itself, None, "crash", -3.0), (calls_then_crashes, None, "crash", -3.0),
             (hangs_every_other_run, broken_evaluator, "infrastructure", None)]
    for harness, evaluator, cause, reward in cases:
        (group,) = replies_lab.rollout(TASKS[:1], harness, num_generations=2, evaluator=evaluator, deadline_s=3,
                                       progress=False, **rewards)
        runs = [s for s in group.sessions if s.status != "timeout"]  # hangs_every_other_run: the finishers
        assert runs and [(s.info["failure"], s.reward) for s in runs] == [(cause, reward)] * len(runs), harness


def test_time_spent_waiting_at_a_paused_proxy_is_not_the_policys(replies_lab):
    async def one_call(session, task):
        await ask(session)
        return ["reply A"]

    replies_lab.run(replies_lab.service.gate.pause())  # as a weight sync does
    out = []
    runner = threading.Thread(target=lambda: out.append(replies_lab.rollout(
        TASKS[:1], one_call, num_generations=2, evaluator=ends_early, deadline_s=1.0, timeout_reward=0.0,
        progress=False)))
    runner.start()
    time.sleep(2.5)  # the runs' calls wait at the gate well past their 1 s deadline
    replies_lab.run(replies_lab.service.gate.resume())
    runner.join(30)
    (group,) = out[0]
    assert [(s.status, s.reward) for s in group.sessions] == [("closed", 1.0)] * 2
    assert all(s.waited_s > 2.0 for s in group.sessions)


def test_a_call_answered_after_its_run_ended_is_not_part_of_the_run(model_path, tokenizer, tmp_path):
    engine = ScriptedEngine(tokenizer, REPLIES, model_path=model_path, delay_s=1.5)
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path), run_name="late") as lab:
        (group,) = lab.rollout(TASKS[:1], asks_twice, num_generations=1, deadline_s=2.0, progress=False)
        time.sleep(1.5)  # the second call's answer is recorded after the run closed
        (session,) = group.sessions
        assert len([c for c in lab.reader.call_records() if c.session_id == session.id]) == 2
        for chains in (group.trajectories, lab.trajectories(session_ids=[session.id])):
            assert [len(t.call_ids) for t in chains] == [1]  # only the call the harness saw


async def asks_twice(session, task):
    await ask(session)  # answered after 1.5 s, within the 2 s deadline
    await ask(session, "again")  # still in the engine at the deadline


def test_choices_of_a_forced_seed_do_not_reuse_the_next_runs_seed(replies_lab):
    async def two_choices(session, task):
        return await ask(session, n=2)

    replies_lab.rollout(TASKS[:1], two_choices, num_generations=2, seed=100, progress=False)
    seeds = sorted(c.sampling["seed"] for c in replies_lab.reader.call_records())
    assert seeds == sorted([100, mix_seed(100, "choice", 1), 101, mix_seed(101, "choice", 1)])


def test_each_rollout_gets_the_configs_settings_and_the_kth_is_seeded_from_the_config(replies_lab, monkeypatch):
    """What SyncRollouts hands lab.rollout, step by step: the k-th rollout's seed is mix_seed(config.seed, "rollout",
    k) (k counts from 0, one per step), and concurrency, deadline, failure rewards and builder are the config's."""
    from polar_lab.grpo.rollouts import trajectory_builder
    from polar_lab.rollout import RolloutSpec

    seen, real = [], replies_lab.rollout
    monkeypatch.setattr(replies_lab, "rollout", lambda tasks, harness, **kw: seen.append(kw) or real(tasks, harness,
                                                                                                       **kw))
    config = GRPOConfig(seed=5, tasks_per_step=1, num_generations=2, concurrency=3, deadline_s=77.0,
                        timeout_reward=-1.0, train_constrained=True)
    rollouts = SyncRollouts(replies_lab, config, two_turns, ends_early, TaskStream(TASKS, seed=5))
    for _ in range(3):
        groups, stats = rollouts.next_groups(0)
        assert len(groups) == 1 and len(groups[0].sessions) == 2
    assert [kw["seed"] for kw in seen] == [mix_seed(5, "rollout", k) for k in range(3)]
    assert (stats["groups_dropped_stale"], stats["groups_rerun"]) == (0, 0)  # nothing is dropped in sync rollouts
    assert all((kw["concurrency"], kw["spec"], kw["progress"]) == (3, RolloutSpec(77.0, None, -1.0, 0.0), False)
               for kw in seen)
    builder = seen[0]["builder"]
    assert builder.keywords == {"train_constrained": True} and builder.func is trajectory_builder(config).func
    assert trajectory_builder(GRPOConfig()) == "prefix_merging"  # by name, as the Lab's own builders are


def test_the_task_stream_reshuffles_each_epoch_and_puts_requeued_tasks_first():
    with pytest.raises(ValueError, match="^no training tasks$"):
        TaskStream([], seed=0)
    tasks = [{"id": i} for i in range(5)]
    stream = TaskStream(tasks, seed=3)
    assert stream.epoch == 0
    first = stream.take(5)
    assert stream.epoch == 1 and sorted(t["id"] for t in first) == list(range(5))
    assert [t["id"] for t in first] == [t["id"] for t in TaskStream(tasks, seed=3).take(5)]  # seeded
    stream.take(2)
    assert stream.epoch == 2
    stream.take(3)
    assert stream.epoch == 2  # the second epoch's five, no more
    stream.take(1)
    assert stream.epoch == 3
    task = first[0]
    assert stream.requeue(task, max_reruns=2) and stream.requeue(task, max_reruns=2)
    assert stream.take(2) == [task, task]  # re-queued tasks come first
    assert not stream.requeue(task, max_reruns=2)  # a third time in a row: dropped
    assert stream.requeue(task, max_reruns=2)  # ... and its count starts again
    stream.settled(task)
    assert stream.requeue(task, max_reruns=1) and not stream.requeue(task, max_reruns=1)
    assert not stream.requeue(first[1], max_reruns=0)  # no rerun allowed: a task never re-queued is not either


def test_training_sessions_force_off_every_knob_the_trainer_cannot_replay():
    """Penalties, biases, banned strings, a thinking budget: whatever a harness sends, forced off (a new knob
    declared training_off is too, without touching the trainer). top_k / top_p / min_p are replayed by default
    (the harness's own values apply), forced off with sampling_support="force"."""
    from polar_lab.grpo.rollouts import rollout_sampling
    from polar_lab.types import TRAINING_OFF

    assert {"min_p", "top_p", "top_k", "presence_penalty", "logit_bias", "banned_strings"} <= set(TRAINING_OFF)
    forced = rollout_sampling(GRPOConfig(temperature=0.7, max_completion_length=64, sampling_support="force"))
    assert forced == {"temperature": 0.7, "max_tokens": 64, **TRAINING_OFF} and forced["min_p"] == 0.0
    replayed = rollout_sampling(GRPOConfig(temperature=0.7, max_completion_length=64))
    assert set(forced) - set(replayed) == {"top_k", "top_p", "min_p"}



@pytest.mark.parametrize("refills", [3, 0])
def test_dynamic_sampling_drops_groups_without_spread_and_refills_the_step(replies_lab, refills):
    config = GRPOConfig(seed=1, tasks_per_step=2, num_generations=4, dynamic_sampling=True, max_refill_rounds=refills)
    stream = TaskStream(FLAT[:2] + SPREAD, seed=0)
    stream.take = lambda n, _order=iter(FLAT[:2] + SPREAD): [next(_order) for _ in range(n)]  # the flat ones first
    groups, stats = SyncRollouts(replies_lab, config, two_turns, by_task, stream).next_groups(0)
    assert all(len({s.reward for s in g.sessions}) > 1 for g in groups)  # only groups that can give a gradient
    if refills:  # the two flat groups out, two spread ones in
        assert [g.task["id"] for g in groups] == ["spread0", "spread1"] and stats["refill_rounds"] == 1
        assert stats["groups_filtered_zero_std"] == 2
    else:  # no refill allowed: the step trains on what passed the filter
        assert groups == [] and stats["refill_rounds"] == 0 and stats["groups_filtered_zero_std"] == 2


@pytest.mark.parametrize("order, rounds, filtered", [
    (["flat0", "spread0", "spread1", "flat1"], 1, 1),  # one kept, one refilled (the fourth task is never taken)
    (["flat0", "flat1", "flat2", "spread0", "spread1"], 2, 3),  # nothing kept, then one, then one: two rounds
])
def test_dynamic_sampling_refills_only_what_the_filter_took_round_by_round(replies_lab, capsys, order, rounds,
                                                                          filtered):
    tasks = {t["id"]: t for t in FLAT + SPREAD}
    config = GRPOConfig(seed=1, tasks_per_step=2, num_generations=4, dynamic_sampling=True, max_refill_rounds=3)
    stream = TaskStream(FLAT + SPREAD, seed=0)
    stream.take = lambda n, _order=iter(order): [tasks[next(_order)] for _ in range(n)]
    groups, stats = SyncRollouts(replies_lab, config, two_turns, by_task, stream).next_groups(0, progress=True)
    assert [g.task["id"] for g in groups] == ["spread0", "spread1"]
    assert (stats["refill_rounds"], stats["groups_filtered_zero_std"]) == (rounds, filtered)
    assert "/4 [" in capsys.readouterr().err  # the last refill's bar (one task × 4 runs) is shown like the first's
