"""The real engine process dies mid-request: callers get a provider-shaped 503, the proxy keeps answering,
completed calls stay on disk exactly once. The Lab restarts it by itself (a rollout in progress completes, the
new engine serves the synced weights at their version; a sync the death interrupted is done again), or with
its own restarts off, `restart_engine` brings a fresh engine back behind the same proxy with the weights and
policy version it had; closing the Lab leaves no process or scratch files behind.
Private engines here: an engine's death and its replacement are the subject (each forked, ~1-2 s)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time

import anthropic
import httpx
import openai
import pytest
import torch

from polar_lab import Lab
from polar_lab.errors import LabError
from polar_lab.store import load_calls
from tests.conftest import running


async def _long_openai_call(s) -> BaseException | None:
    client = openai.AsyncOpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0)
    try:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "count"}],
                                             max_tokens=1500, extra_body={"ignore_eos": True})
    except openai.APIStatusError as exc:
        return exc
    return None


async def _kill_engine_mid_flight(lab: Lab, sessions) -> list:
    calls = [asyncio.create_task(_long_openai_call(s)) for s in sessions]
    deadline = time.monotonic() + 60
    while lab.proxy_state["in_flight"] < len(sessions) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert lab.proxy_state["in_flight"] == len(sessions), "the calls never got to the engine"
    os.kill(lab.engine.pid, signal.SIGKILL)
    return await asyncio.wait_for(asyncio.gather(*calls), timeout=60)


def _call_once_paused(lab: Lab, client: openai.OpenAI) -> None:
    deadline = time.monotonic() + 60
    while lab.proxy_state["state"] != "paused" and time.monotonic() < deadline:
        time.sleep(0.01)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2"}], max_tokens=4)


def test_engine_killed_mid_request_then_restarted(model_path, shipped_weights, tmp_path):
    # policy version 2 = a head of zeros: every token equally likely, unlike the weights on disk
    uniform = {**shipped_weights, "lm_head.weight": torch.zeros_like(shipped_weights["lm_head.weight"])}
    # the Lab's own restarts off, and no weights kept: the manual path, and what it must refuse
    with Lab(model_path, port=0, runs_dir=str(tmp_path), run_name="engine-killed", max_restarts=0,
             keep_weights=False) as lab:
        lab.sync_weights(shipped_weights)
        assert lab.sync_weights(uniform).policy_version == 2
        done = lab.session()
        client = openai.OpenAI(base_url=done.openai_base_url, api_key=done.key, max_retries=0)
        for i in range(3):  # completed before the crash: these must survive it, once each
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{i}+1"}], max_tokens=4)
        engine_pid, scratch = lab.engine.pid, lab.engine.process.scratch

        sessions = [lab.session() for _ in range(5)]
        errors = asyncio.run(_kill_engine_mid_flight(lab, sessions))

        for exc in errors:  # every caller in flight: an OpenAI error object, 503
            assert isinstance(exc, openai.InternalServerError) and exc.status_code == 503
            assert exc.body["type"] == "server_error" and exc.body["code"] == "engine_unavailable"

        # the proxy still answers: health says why, new calls fail fast in their API's shape, bad keys get 401
        health = httpx.get(lab.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "engine_down"
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
        s = sessions[0]
        with pytest.raises(anthropic.APIStatusError) as anth:
            anthropic.Anthropic(base_url=s.anthropic_base_url, api_key=s.key, max_retries=0).messages.create(
                model="m", max_tokens=8, messages=[{"role": "user", "content": "again"}])
        assert anth.value.status_code == 503 and anth.value.body["error"]["type"] == "overloaded_error"
        assert time.monotonic() - t0 < 5
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=lab.url + "/v1", api_key="pl-wrong", max_retries=0).models.list()

        recorded = load_calls(lab.run_dir)
        assert [c.session_id for c in recorded] == [done.id] * 3
        assert len({c.call_id for c in recorded}) == 3
        assert not running(engine_pid)

        # restart: refused without the weights it served (that would silently roll training back) ...
        with pytest.raises(LabError, match="serving policy version 2"):
            lab.restart_engine()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a harness calling while the engine restarts
            waiting = pool.submit(_call_once_paused, lab, client)
            assert lab.restart_engine(uniform).policy_version == lab.policy_version == 2  # not 0 + 1
            waiting.result(timeout=60)  # it waited at the paused proxy, then the new engine answered it
        assert lab.engine.pid != engine_pid and not os.path.exists(scratch)
        assert httpx.get(lab.url + "/health", timeout=5).status_code == 200
        # ... then the same session and key carry on, sampled by the weights passed in, at version 2
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "9+1"}], max_tokens=8,
                                       extra_body={"ignore_eos": True})
        recorded = load_calls(lab.run_dir)
        assert [c.session_id for c in recorded] == [done.id] * 5
        assert recorded[3].timings["paused_s"] > 0
        after = recorded[-1]
        assert after.policy_version == 2 and len(after.output_ids) == 8
        assert max(after.output_logprobs) - min(after.output_logprobs) < 1e-4  # uniform: the zero head
        engine_pid, scratch = lab.engine.pid, lab.engine.process.scratch
    assert not running(engine_pid)
    assert not os.path.exists(scratch), "the engine's scratch dir outlived the Lab"


def _sharper(weights: dict) -> dict:
    """A policy the engine cannot have on disk: the shipped one with its output head scaled by 1.5."""
    return {**weights, "lm_head.weight": weights["lm_head.weight"] * 1.5}


def _kill_when_busy(lab: Lab, killed: list, min_calls: int = 8) -> None:
    """SIGKILL the engine process once calls are recorded and several are in flight (a rollout in full swing)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if lab.writer.num_calls >= min_calls and lab.proxy_state["in_flight"] >= 4:
            killed.append(lab.engine.pid)
            os.kill(lab.engine.pid, signal.SIGKILL)
            return
        time.sleep(0.005)


def test_engine_killed_during_a_rollout_restarts_by_itself_at_the_same_policy(model_path, shipped_weights, tmp_path):
    from transformers import AutoModelForCausalLM

    from polar_lab.harness.calculator import calculator_agent
    from polar_lab.tasks import load_tasks
    from polar_lab.trajectory import fidelity

    answers: dict[str, list[int]] = {}  # session id -> HTTP statuses its harness saw, retries included

    async def harness(session, task):
        async def seen(response):
            answers.setdefault(session.id, []).append(response.status_code)
        client = httpx.AsyncClient(timeout=120, event_hooks={"response": [seen]})
        return await calculator_agent(session, task, max_retries=2, http_client=client)

    sharper = _sharper(shipped_weights)
    with Lab(model_path, port=0, runs_dir=str(tmp_path), run_name="heal") as lab:
        assert lab.sync_weights(sharper).policy_version == 1
        killed: list[int] = []
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(_kill_when_busy, lab, killed)
            groups = lab.rollout(load_tasks("data/tasks/calc_train.jsonl")[:2], harness, num_generations=8,
                                 evaluator="final_answer", sampling={"temperature": 1.0}, progress=False)
        assert killed and not running(killed[0]) and lab.engine.pid != killed[0]

        # the Lab restarted the engine by itself, once, at the policy it served; the rollout completed
        (restart,) = lab.engine_restarts
        assert restart.automatic and restart.ok and "code -9" in restart.reason
        assert lab.policy_version == restart.policy_version == 1
        sessions = [s for g in groups for s in g.sessions]
        assert len(sessions) == 16 and {s.status for s in sessions} == {"closed"}
        health = httpx.get(lab.url + "/health", timeout=5).json()
        assert health["status"] == "ok" and health["engine_restarts"] == 1
        from polar_lab.viz.dashboard import Dashboard

        board = Dashboard(lab)
        assert "serving · restarts: 1 (last: the engine process exited (code -9))" in board.table.value

        # records intact: one per answered call, none for a failed one; each harness saw at most one failure
        records = load_calls(lab.run_dir)
        assert len({c.call_id for c in records}) == len(records)
        for s in sessions:
            statuses = answers[s.id]
            assert statuses.count(503) <= 1, statuses
            assert set(statuses) <= {200, 503} and statuses.count(200) == sum(c.session_id == s.id for c in records)
        assert sum(st.count(503) for st in answers.values()) >= 1  # the kill did hit calls in flight

        # the new engine samples from the synced weights, not the shipped ones on disk
        after = {c.call_id: c.session_id for c in records if c.timings["received"] > restart.at}
        trajs = [t for t in lab.trajectories("per_request", session_ids=sorted(set(after.values())))
                 if set(t.call_ids) <= set(after)]
        assert trajs and all(v == 1 for t in trajs for v, m in zip(t.policy_versions, t.loss_mask) if m)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        model.load_state_dict(sharper)
        assert fidelity(trajs, model)["max_abs_diff"].max() < 1e-3
        model.load_state_dict(shipped_weights)  # negative control: the weights on disk do not match
        assert fidelity(trajs, model)["max_abs_diff"].max() > 1e-2

        # a second death is healed too (the replacement is watched), and a call arriving after it — from a
        # client without retries — waits for the next engine instead of getting a 503
        second = lab.engine.pid
        os.kill(second, signal.SIGKILL)
        _wait_until(lambda: not lab.engine.alive)
        s = lab.session()
        client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0)
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1"}], max_tokens=4)
        assert reply.system_fingerprint == "polar_lab-v1" and lab.engine.pid not in (second, killed[0])
        assert [r.automatic and r.ok for r in lab.engine_restarts] == [True, True]


class _KillsTheEngine(dict):
    """A state dict that SIGKILLs the engine process while it is being saved for the load: a death mid-sync."""

    def __init__(self, weights: dict, pid: int):
        super().__init__(weights)
        self.pid = pid

    def items(self):
        if self.pid is not None:  # once: the load on the new engine goes through
            os.kill(self.pid, signal.SIGKILL)
            self.pid = None
            time.sleep(0.5)
        return super().items()


def test_a_sync_the_engine_dies_in_is_done_again_on_a_new_engine(model_path, shipped_weights, tmp_path):
    # keep_weights=False: a sync heals with the weights it is loading; a death outside a sync cannot be healed
    with Lab(model_path, port=0, runs_dir=str(tmp_path), run_name="die-in-sync", keep_weights=False) as lab:
        assert lab.sync_weights(_sharper(shipped_weights)).policy_version == 1
        pid = lab.engine.pid
        sync = lab.sync_weights(_KillsTheEngine(shipped_weights, pid))  # what a trainer's step calls
        assert sync.policy_version == lab.policy_version == 2 and not running(pid)
        assert [r.automatic for r in lab.engine_restarts] == [True]
        s = lab.session()
        client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0)
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1"}],
                                               max_tokens=4, logprobs=True)
        assert reply.system_fingerprint == "polar_lab-v2"
        (call,) = load_calls(lab.run_dir)
        assert call.policy_version == 2

        # dead outside a sync, with no weights kept: restarting would serve version 0 as 2 — it stays down
        os.kill(lab.engine.pid, signal.SIGKILL)
        _wait_until(lambda: httpx.get(lab.url + "/health", timeout=5).json()["status"] == "engine_down")
        time.sleep(1)
        assert len(lab.engine_restarts) == 1 and not lab.engine.alive
        # the trainer's next sync brings it back, with the weights it syncs, at the next version
        assert lab.sync_weights(shipped_weights).policy_version == 3 and lab.engine.alive


def _wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)
