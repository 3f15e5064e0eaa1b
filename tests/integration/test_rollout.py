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


def test_crashed_and_timed_out_runs_keep_their_calls_and_are_masked_beside_scored_runs(lab):
    """In each group one run crashes after a real call and one hangs past the deadline after one; the others answer.
    The failures keep their calls (partial trajectories), are marked and masked; the others are scored; every group
    ends."""
    tasks = load_tasks("data/tasks/calc_test.jsonl", 2)
    started: dict[str, list[str]] = {}

    async def mixed(session, task):
        runs = started.setdefault(task["id"], [])
        runs.append(session.id)
        order = len(runs)  # read before its first await: the runs of a group get 1, 2, 3 and 4, once each
        if order > 2:
            return await calculator_agent(session, task)
        await calculator_agent(session, task, max_turns=1)  # one real call, then it fails
        if order == 1:
            raise RuntimeError("harness crashed")
        await asyncio.sleep(3600)  # past any deadline

    groups = lab.rollout(tasks, mixed, num_generations=4, evaluator=final_answer, deadline_s=10, progress=False)
    assert [g.task["id"] for g in groups] == [t["id"] for t in tasks]
    for g in groups:
        verdicts = sorted((s.status, s.info.get("failure")) for s in g.sessions)
        assert verdicts == sorted([("error", "crash"), ("timeout", "timeout"), ("closed", None), ("closed", None)]), \
            [(s.status, s.info) for s in g.sessions]
        assert all(s.reward is None for s in g.sessions if s.status != "closed")  # fail-closed: masked, not scored 0
        assert all(s.reward in (0.0, 1.0) for s in g.sessions if s.status == "closed")
        assert {t.session_id for t in g.trajectories} == {s.id for s in g.sessions}  # the failures' calls kept
        assert all(sum(t.loss_mask) > 0 for t in g.trajectories)
    stored = lab.sessions().set_index("id")  # the store has the same verdicts as the objects
    for s in (s for g in groups for s in g.sessions if s.status == "error"):
        assert stored.loc[s.id, "status"] == "error" and "harness crashed" in stored.loc[s.id, "info"]["error"]


async def hanging_agent(session, task):
    """Makes one real call, then hangs past the deadline."""
    await calculator_agent(session, task, max_turns=1)
    await asyncio.sleep(3600)


async def overflowing_agent(session, task):
    """Answers once, then sends a history longer than the model's context (refused: 400) and gives up."""
    import openai

    await calculator_agent(session, task, max_turns=1)
    client = openai.AsyncOpenAI(base_url=session.openai_base_url, api_key=session.key, max_retries=0)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": " x" * task["tokens"]}])


def test_failures_the_policy_caused_are_scored_by_cause(lab):
    """A run that hangs to the deadline gets timeout_reward, one that overflows the context overflow_reward."""
    hang, overflow = (dict(t, tokens=lab.engine.max_model_len + 8) for t in load_tasks("data/tasks/calc_test.jsonl", 2))
    timed_out, = lab.rollout([hang], hanging_agent, num_generations=2, evaluator=final_answer, deadline_s=5,
                             timeout_reward=-0.5, overflow_reward=-0.25, progress=False)
    overflowed, = lab.rollout([overflow], overflowing_agent, num_generations=2, evaluator=final_answer,
                              timeout_reward=-0.5, overflow_reward=-0.25, progress=False)
    assert [(s.status, s.info["failure"], s.reward) for s in timed_out.sessions] == [("timeout", "timeout", -0.5)] * 2
    assert [(s.status, s.info["failure"], s.reward) for s in overflowed.sessions] == [("error", "overflow", -0.25)] * 2
    assert all(s.call_errors == {"context_length": 1} and s.calls == 1 for s in overflowed.sessions)
