"""The real engine process dies mid-request: callers get a provider-shaped 503, the proxy keeps answering,
completed calls stay on disk exactly once; `restart_engine` brings a fresh engine back behind the same proxy
with the weights and policy version it had; closing the Lab leaves no process or scratch files behind."""

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
    with Lab(model_path, port=0, runs_dir=str(tmp_path), run_name="engine-killed") as lab:
        lab.sync_weights(shipped_weights)
        assert lab.sync_weights(uniform)["policy_version"] == 2
        done = lab.session()
        client = openai.OpenAI(base_url=done.openai_base_url, api_key=done.key, max_retries=0)
        for i in range(3):  # completed before the crash: these must survive it, once each
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{i}+1"}], max_tokens=4)
        engine_pid, scratch = lab.engine.pid, lab.engine._scratch

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
        with pytest.raises(LabError, match="policy version 2"):
            lab.restart_engine()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a harness calling while the engine restarts
            waiting = pool.submit(_call_once_paused, lab, client)
            assert lab.restart_engine(uniform)["policy_version"] == lab.policy_version == 2  # not 0 + 1
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
        engine_pid, scratch = lab.engine.pid, lab.engine._scratch
    assert not running(engine_pid)
    assert not os.path.exists(scratch), "the engine's scratch dir outlived the Lab"
