"""A verifiers (0.4) taskset run through polar_lab, against the real engine: verifiers' own harness and rubric in
its own venv (`make verifiers`), each rollout in its own polar_lab session, in a GRPO step."""

import pytest

from polar_lab.envs import verifiers as vf_env
from polar_lab.envs.verifiers import VerifiersEnv
from polar_lab.grpo import GRPOConfig, GRPOTrainer
from tests.conftest import session_calls

pytestmark = [pytest.mark.ci_required,
              pytest.mark.skipif(vf_env.missing() is not None, reason=f"verifiers: {vf_env.missing()}")]

TASKSETS = "data/envs/verifiers"


@pytest.fixture(scope="module")
def calc_env():
    with VerifiersEnv("polar_calc", path=TASKSETS, max_turns=3, sampling={"max_tokens": 64}) as env:
        yield env


def test_a_grpo_step_trains_on_the_verifiers_taskset(lab, calc_env, tmp_path, restore_weights):
    """One step of 2 tasks x 4 runs of verifiers' own harness, each run in its own session, scored by the taskset's
    rubric; its groups are what the trainer trains on. (That GRPO steps raise held-out accuracy is proven once per
    surface: tests/grpo/test_train_cli.py, notebook 05, test_families, test_replicas.)"""
    tasks = calc_env.tasks(8)
    assert tasks[0]["prompt"] and "answer" in tasks[0]
    config = GRPOConfig(tasks_per_step=2, num_generations=4, learning_rate=1e-3, output_dir=str(tmp_path),
                        concurrency=8)
    with GRPOTrainer(lab, config, harness=calc_env.harness, evaluator=calc_env.evaluator, tasks=tasks) as trainer:
        version = lab.policy_version
        history = trainer.train(1, progress=False)
    assert list(history["policy_version"]) == [version + 1]
    assert (history["tokens"] > 0).all() and history["groups"].iloc[0] == 2

    groups = trainer.last_groups
    sessions = [s for g in groups for s in g.sessions]
    assert len(sessions) == 8 and all(s.status == "closed" for s in sessions), [s.info for s in sessions]
    for s in sessions:
        calls = session_calls(lab, s)
        assert calls and all(c.api == "openai.chat" for c in calls)  # its own session got every call
        assert s.reward in (0.0, 1.0) and s.reward_parts["correct"] == s.reward  # the taskset's rubric
        assert calls[0].request["stream"] is True  # verifiers' harness streams; unmodified
    assert any(s.reward == 1.0 for s in sessions)  # tiny-calc solves some of its own questions
    assert all(t.reward is not None and sum(t.loss_mask) > 0 for g in groups for t in g.trajectories)
    for s in (s for s in sessions if len(session_calls(lab, s)) > 1):  # a tool call and its answer: one chain
        assert len([t for g in groups for t in g.trajectories if t.session_id == s.id]) == 1


def test_a_worker_that_dies_mid_episode_fails_its_runs_masked(lab):
    env = VerifiersEnv("polar_calc", path=TASKSETS, max_turns=2).start()
    ids = set()

    async def harness(session, task):
        ids.add(session.id)
        return await env.harness(session, task)

    def kill_at_the_first_call(call, request, response):  # recorded before the model's answer leaves
        if call.session.id in ids and env.process.poll() is None:
            env.process.kill()

    lab.service.on_record.append(kill_at_the_first_call)
    try:
        (group,) = lab.rollout(env.tasks(1), harness, evaluator=env.evaluator, num_generations=2, failed_reward=0.0,
                               progress=False)
    finally:
        lab.service.on_record.remove(kill_at_the_first_call)
        env.close()
    assert [(s.status, s.reward, s.info["failure"]) for s in group.sessions] == [("error", None, "masked")] * 2
    assert max(s.calls for s in group.sessions) >= 1  # mid-episode: the model had answered
    assert all("worker exited" in s.info["error"] for s in group.sessions)
