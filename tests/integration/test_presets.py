"""Real agent programs, unmodified, against a Lab session."""

from polar_lab.demo import load_tasks
from polar_lab.harness.presets import mini_swe_agent
from tests.conftest import session_calls


def test_mini_swe_agent_runs_and_every_call_is_recorded_with_exact_ids(lab, tokenizer):
    (g,) = lab.rollout(load_tasks("data/tasks/calc_test.jsonl", 1), mini_swe_agent(step_limit=3),
                       num_generations=1, deadline_s=300, progress=False)
    (s,) = g.sessions
    assert s.status == "closed", s.info.get("error")
    calls = session_calls(lab, s)
    assert 1 <= len(calls) <= 3  # its step limit
    for c in calls:
        assert c.api == "openai.chat" and c.request["tools"][0]["function"]["name"] == "bash"
        assert len(c.output_logprobs) == len(c.output_ids) > 0
    assert sum(len(t.call_ids) for t in g.trajectories) == len(calls)  # every call is in some chain
