"""The example harnesses on real vLLM: a code agent scored by sandboxed unit tests, a planner/solver pair."""

from polar_lab.tasks import load_tasks
from polar_lab.harness.code_agent import code_agent
from polar_lab.harness.multiagent import planner_solver
from tests.conftest import session_calls


def test_code_agent_runs_tests_retries_and_is_scored_by_them(lab):
    tasks = load_tasks("data/tasks/code_test.jsonl", 2)
    groups = lab.rollout(tasks, code_agent, num_generations=2, evaluator="unit_tests", progress=False)
    for g in groups:
        for s in g.sessions:
            assert s.status == "closed" and s.reward in (0.0, 1.0)
            assert s.reward == s.reward_parts["passed"]
            calls = session_calls(lab, s)
            # the tiny calculator model cannot write code: the agent gets the failure and tries again,
            # and the retry continues the same token chain
            if s.reward == 0.0:
                assert len(calls) == 2 and calls[1].render["mode"] == "continued"


def test_failed_runs_can_be_scored_zero_instead_of_masked(lab):
    from polar_lab.harness.calculator import calculator_agent

    async def broken(session, task):
        await calculator_agent(session, task, max_turns=1)  # the model answered: the crash may be its doing
        raise RuntimeError("no")

    (g,) = lab.rollout([{"id": "x", "question": "What is 2+2?"}], broken, num_generations=2, failed_reward=0.0,
                       progress=False)
    assert [(s.status, s.info["failure"], s.reward) for s in g.sessions] == [("error", "crash", 0.0)] * 2


def test_planner_and_solver_are_two_chains_of_one_session(lab):
    tasks = load_tasks("data/tasks/calc_test.jsonl", 1)
    (g,) = lab.rollout(tasks, planner_solver, num_generations=2, evaluator="final_answer", progress=False)
    breaks = lab.chain_breaks()
    for s in g.sessions:
        assert s.status == "closed"
        chains = [t for t in g.trajectories if t.session_id == s.id]
        assert len(chains) == 2 and len(chains[0].call_ids) == 1  # the planner's call, then the solver's chain
        assert breaks[breaks.session_id == s.id].kind.tolist() == ["new_context"]
