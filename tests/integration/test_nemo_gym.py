"""NeMo Gym both ways, against Gym's own server code (its venv: `make nemo-gym`) and the real engine:

(a) a Gym resources server's tasks through `lab.rollout` with polar_lab's tool loop;
(b) Gym's own `simple_agent` + `vllm_model` with the Lab as the vLLM backend (shared key, session in the body);
(c) chains exported as Gym rollout rows that pass NeMo RL's contiguity rule (ours, and Gym's own check).
Faults: a Gym server that dies mid-rollout, a `/verify` that masks or answers nonsense.
"""

import http.server
import json
import threading

import httpx
import pytest

from polar_lab.envs import nemo_gym
from polar_lab.envs.gym_rows import check_rows_with_gym, contiguous, gym_rows
from polar_lab.envs.nemo_gym import GymAgent, GymEnvironment
from polar_lab.errors import ConfigError
from tests.conftest import free_port, session_calls

pytestmark = [pytest.mark.ci_required,
              pytest.mark.skipif(nemo_gym.missing() is not None, reason=f"NeMo Gym: {nemo_gym.missing()}")]


@pytest.fixture(scope="module")
def gym_lab(model_path, engines, tmp_path_factory):
    """A Lab as NeMo Gym's vLLM backend: one shared key, each rollout's session named in the body."""
    with engines.lab(model_path, port=free_port(), runs_dir=str(tmp_path_factory.mktemp("gym")), run_name="gym",
                     shared_key="auto", session_field="session_id") as lab:
        yield lab


def test_a_resources_servers_tasks_run_through_polar_labs_tool_loop(gym_lab, tmp_path):
    with GymEnvironment("example_single_tool_call", first_tool_choice="required", log_dir=tmp_path) as env:
        tasks = env.tasks(limit=2)
        groups = gym_lab.rollout(tasks, env.harness, evaluator=env.evaluator, num_generations=2, progress=False)
    sessions = [s for g in groups for s in g.sessions]
    assert len(sessions) == 4 and all(s.status == "closed" for s in sessions)
    # the forced first call is get_weather, the server's one tool: /verify rewards exactly that
    assert [s.reward for s in sessions] == [1.0] * 4
    for s in sessions:
        calls = session_calls(gym_lab, s)
        assert len(calls) >= 2  # the tool's answer went back to the model
        second = calls[1].request["messages"]
        assert second[-1]["role"] == "tool" and "weather_description" in second[-1]["content"]  # the route's answer
    assert all(t.reward == 1.0 and sum(t.loss_mask) for g in groups for t in g.trajectories)


def test_workplace_assistants_tools_answer_in_the_seeded_session_and_verify_scores_the_run(gym_lab, tmp_path):
    """27 tools, a ~6k-token prompt, state per session: a tool route only answers a seeded session (else a 400
    'Session not initialized'), so an `output` coming back shows the cookie session carried through the run."""
    with GymEnvironment("workplace_assistant", first_tool_choice="required", log_dir=tmp_path) as env:
        (group,) = gym_lab.rollout(env.tasks(limit=1), env.harness, evaluator=env.evaluator, num_generations=2,
                                   progress=False)
    for s in group.sessions:
        assert s.status == "closed" and s.reward == env.results[s.id]["reward"] in (0.0, 1.0)
        calls = session_calls(gym_lab, s)
        assert len(calls[0].request["tools"]) == 27 and len(calls) >= 2
        tool_answer = calls[1].request["messages"][-1]
        assert tool_answer["role"] == "tool" and json.loads(tool_answer["content"]).keys() == {"output"}


def test_gyms_own_agent_and_model_server_on_the_lab_give_token_exact_rewarded_runs(gym_lab, tmp_path):
    with GymAgent(gym_lab, "example_single_tool_call", max_steps=3, log_dir=tmp_path) as agent:
        tasks = [{**row, "responses_create_params": {**row["responses_create_params"], "tool_choice": "required"}}
                 for row in agent.tasks(limit=2)]
        groups = gym_lab.rollout(tasks, agent.harness, evaluator=agent.evaluator, num_generations=2, progress=False)
    verdicts = []
    for s in (s for g in groups for s in g.sessions):
        assert s.status == "closed", s.info
        calls = session_calls(gym_lab, s)
        verdict = agent.results[s.id]  # Gym's own rollout row for this run
        generated = [item for item in verdict["response"]["output"] if item.get("generation_token_ids")]
        # every model call Gym made for this run landed in this run's session, with the very ids Gym got back
        assert [(i["prompt_token_ids"], i["generation_token_ids"]) for i in generated] == \
               [(c.prompt_ids, c.output_ids) for c in calls]
        assert [i["generation_log_probs"] for i in generated] == [c.output_logprobs for c in calls]
        assert s.reward == verdict["reward"] == 1.0  # required calls to its one tool: get_weather
        verdicts.append(verdict)
    assert check_rows_with_gym(verdicts) == [None] * len(verdicts)  # Gym's own rows are contiguous too
    assert all(t.reward == 1.0 for g in groups for t in g.trajectories)


def test_chains_export_as_gym_rows_that_satisfy_nemo_rls_contiguity_rule(gym_lab, tmp_path):
    with GymEnvironment("example_single_tool_call", first_tool_choice="required", log_dir=tmp_path) as env:
        groups = gym_lab.rollout(env.tasks(limit=1), env.harness, evaluator=env.evaluator, num_generations=2,
                                 progress=False)
    ids = [s.id for g in groups for s in g.sessions]
    rows = gym_rows(gym_lab, session_ids=ids)
    chains = gym_lab.trajectories(session_ids=ids)
    assert len(rows) == len(chains) >= 2
    for row, chain in zip(rows, chains, strict=True):
        assert contiguous(row) and row["reward"] == chain.reward
        generated = [i for i in row["response"]["output"] if "generation_token_ids" in i]
        rebuilt = generated[-1]["prompt_token_ids"] + generated[-1]["generation_token_ids"]
        assert rebuilt == chain.token_ids  # the last item's prompt + generation is the whole chain
        assert any(i["type"] == "function_call_output" for i in row["response"]["output"])
        assert row["responses_create_params"]["tools"][0]["name"] == "get_weather"
    assert check_rows_with_gym(rows) == [None] * len(rows)
    broken = json.loads(json.dumps(rows[0]))
    generated = [i for i in broken["response"]["output"] if "generation_token_ids" in i]
    generated[-1]["prompt_token_ids"][0] += 1  # the rule's other side: a prompt that does not extend
    assert not contiguous(broken) and check_rows_with_gym([broken])[0]


def test_a_gym_server_that_dies_mid_rollout_fails_and_masks_its_runs_and_the_lab_serves_on(gym_lab, tmp_path):
    env = GymEnvironment("example_single_tool_call", first_tool_choice="required", log_dir=tmp_path).start()
    runs, doomed = [], set()

    async def harness(session, task):
        runs.append(session.id)
        if len(runs) >= 3:
            doomed.add(session.id)
        return await env.harness(session, task)

    def kill_after_the_first_call(call, request, response):  # the record is written before the model answers
        if call.session.id in doomed:
            env.servers.stop("example_single_tool_call")

    gym_lab.service.on_record.append(kill_after_the_first_call)
    try:
        (group,) = gym_lab.rollout(env.tasks(limit=1), harness, evaluator=env.evaluator, num_generations=4,
                                   concurrency=1, failed_reward=0.0, progress=False)
    finally:
        gym_lab.service.on_record.remove(kill_after_the_first_call)
        env.close()
    statuses = [(s.status, s.reward, s.info.get("failure")) for s in group.sessions]
    assert statuses[:2] == [("closed", 1.0, None)] * 2
    assert statuses[2:] == [("error", None, "masked")] * 2  # masked although failed_reward is 0.0
    third = group.sessions[2]
    assert third.calls == 1 and "unreachable" in third.info["error"]  # the model had answered: not a no-call run
    s = gym_lab.session()
    r = httpx.post(s.openai_base_url + "/chat/completions", headers={"Authorization": f"Bearer {s.key}"},
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=60)
    assert r.status_code == 200


class _BadVerify(http.server.BaseHTTPRequestHandler):
    verdict: dict = {}

    def do_POST(self):  # noqa: N802 - the stdlib's name
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = json.dumps(self.verdict if self.path == "/verify" else {}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("verdict, status, failure, words", [
    ({"reward": "lots"}, "error", "crash", "without a numeric reward"),
    ({"mask_sample": True, "reward": 1.0, "failure_kind": "judge", "failure_reason": "timeout"}, "error",
     "masked", "masked this sample"),
])
def test_a_malformed_or_masking_verify_fails_that_run_with_a_clear_error(scripted_lab, verdict, status, failure,
                                                                         words):
    """A stand-in for a broken Gym server (the failure is the environment's, not the engine's)."""
    handler = type("Handler", (_BadVerify,), {"verdict": verdict})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = GymEnvironment("example_single_tool_call")
    env.url = f"http://127.0.0.1:{server.server_address[1]}"  # never started: the stand-in answers instead
    try:
        (group,) = scripted_lab.rollout(env.tasks(limit=1), env.harness, evaluator=env.evaluator,
                                        num_generations=2, failed_reward=0.0, progress=False)
    finally:
        server.shutdown()
    for s in group.sessions:
        assert (s.status, s.info["failure"]) == (status, failure) and words in s.info["error"]
        assert s.reward == (None if failure == "masked" else 0.0)


def test_gym_agent_says_what_the_lab_lacks(lab):
    with pytest.raises(ConfigError, match="shared_key='auto', session_field="):
        GymAgent(lab, "example_single_tool_call")
