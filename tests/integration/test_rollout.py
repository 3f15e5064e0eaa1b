"""lab.rollout: groups of concurrent harness runs on real vLLM; crashes and timeouts are kept and masked."""

import asyncio

from polar_lab.tasks import load_tasks
from polar_lab.harness.calculator import calculator_agent
from polar_lab.rewards import final_answer


def test_rollout_returns_one_group_per_task_with_rewarded_trajectories(lab):
    tasks = load_tasks("data/tasks/calc_test.jsonl", 3)
    groups = lab.rollout(tasks, calculator_agent, num_generations=4, evaluator=final_answer, progress=False)
    assert [g.task["id"] for g in groups] == [t["id"] for t in tasks]
    for g in groups:
        assert len(g.sessions) == 4 and len({s.group_id for s in g.sessions}) == 1
        assert all(s.status == "closed" and s.reward in (0.0, 1.0) for s in g.sessions)
        assert {t.session_id for t in g.trajectories} == {s.id for s in g.sessions}
        rewards = {s.id: s.reward for s in g.sessions}
        assert all(t.reward == rewards[t.session_id] for t in g.trajectories)


async def flaky_agent(session, task):
    """Makes one real call, then crashes (odd tasks) or hangs past the deadline (even tasks)."""
    await calculator_agent(session, task, max_turns=1)
    if task["n"] % 2:
        raise RuntimeError("harness crashed")
    await asyncio.sleep(3600)


def test_crashed_and_timed_out_runs_keep_their_calls_and_are_masked(lab):
    tasks = [dict(t, n=i) for i, t in enumerate(load_tasks("data/tasks/calc_test.jsonl", 2))]
    groups = lab.rollout(tasks, flaky_agent, num_generations=2, evaluator=final_answer, deadline_s=10, progress=False)
    statuses = [[(s.status, s.info["failure"]) for s in g.sessions] for g in groups]
    assert statuses == [[("timeout", "timeout")] * 2, [("error", "crash")] * 2]
    for g in groups:
        assert all(s.reward is None for s in g.sessions)  # fail-closed by default: masked, not scored 0
        assert len(g.trajectories) == 2 and all(sum(t.loss_mask) > 0 for t in g.trajectories)  # partial kept
    stored = lab.sessions().set_index("id")  # the store has the same verdicts as the objects
    for s in groups[1].sessions:
        assert stored.loc[s.id, "status"] == "error" and "harness crashed" in stored.loc[s.id, "info"]["error"]


def test_8x8_rollout_with_a_crash_and_a_hang_in_the_mix(lab):
    tasks = load_tasks("data/tasks/calc_test.jsonl", 8)
    started = []

    async def mixed(session, task):
        started.append(session.id)
        if len(started) == 1:
            raise RuntimeError("deliberate crash")
        if len(started) == 2:
            await asyncio.sleep(3600)  # past any deadline
        return await calculator_agent(session, task)

    # 30 s: 62 runs of 1-4 calls each end within ~15 s on a loaded 2-core machine (the suite runs two workers)
    groups = lab.rollout(tasks, mixed, num_generations=8, evaluator="final_answer", deadline_s=30, progress=False)
    sessions = [s for g in groups for s in g.sessions]
    assert len(groups) == 8 and len(sessions) == 64
    by_status = {st: [s for s in sessions if s.status == st] for st in ("closed", "error", "timeout")}
    assert [len(by_status[k]) for k in ("closed", "error", "timeout")] == [62, 1, 1]
    assert all(s.reward in (0.0, 1.0) for s in by_status["closed"])  # 62 scored runs
    assert by_status["error"][0].reward is None and by_status["timeout"][0].reward is None  # masked
    # every scored run's calls became trajectories (the crash and the hang made no call before stopping)
    assert {t.session_id for g in groups for t in g.trajectories} == {s.id for s in by_status["closed"]}


async def overflowing_agent(session, task):
    """Answers once, then sends a history longer than the model's context (refused: 400) and gives up."""
    import openai

    await calculator_agent(session, task, max_turns=1)
    client = openai.AsyncOpenAI(base_url=session.openai_base_url, api_key=session.key, max_retries=0)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": " x" * task["tokens"]}])


def test_failures_the_policy_caused_are_scored_by_cause(lab):
    """A run that hangs to the deadline gets timeout_reward, one that overflows the context overflow_reward."""
    hang, overflow = (dict(t, n=0, tokens=lab.engine.max_model_len + 8)
                      for t in load_tasks("data/tasks/calc_test.jsonl", 2))
    timed_out, = lab.rollout([hang], flaky_agent, num_generations=2, evaluator=final_answer, deadline_s=5,
                             timeout_reward=-0.5, overflow_reward=-0.25, progress=False)
    overflowed, = lab.rollout([overflow], overflowing_agent, num_generations=2, evaluator=final_answer,
                              timeout_reward=-0.5, overflow_reward=-0.25, progress=False)
    assert [(s.status, s.info["failure"], s.reward) for s in timed_out.sessions] == [("timeout", "timeout", -0.5)] * 2
    assert [(s.status, s.info["failure"], s.reward) for s in overflowed.sessions] == [("error", "overflow", -0.25)] * 2
    assert all(s.call_errors == {"context_length": 1} and s.calls == 1 for s in overflowed.sessions)
