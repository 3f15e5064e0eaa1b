"""Pause/drain/resume around a weight sync: the state machine, and what a harness sees over HTTP."""

import asyncio
import threading
import time

import openai
import pytest

from polar_lab.proxy.pause import PauseState


def test_transitions_are_explicit():
    async def scenario():
        gate = PauseState()
        with pytest.raises(RuntimeError, match="cannot resume the proxy while it is serving"):
            await gate.resume()
        assert await gate.pause(drain_timeout=1) == 0 and gate.state == "paused"
        with pytest.raises(RuntimeError, match="cannot pause the proxy while it is paused"):
            await gate.pause()
        await gate.resume()
        return gate.stats()

    stats = asyncio.run(scenario())
    assert stats["state"] == "serving" and stats["pauses"] == 1


def test_pause_waits_for_calls_in_flight_and_holds_new_ones():
    async def scenario():
        gate, order = PauseState(), []

        async def call(name, hold):
            async with gate.admit():
                order.append(f"{name} start")
                await asyncio.sleep(hold)
                order.append(f"{name} end")

        first = asyncio.create_task(call("inflight", 0.2))
        await asyncio.sleep(0.01)
        pausing = asyncio.create_task(gate.pause(drain_timeout=5))
        await asyncio.sleep(0.01)
        late = asyncio.create_task(call("late", 0.0))
        assert await pausing == 0  # drained: the in-flight call finished first
        order.append("paused")
        await asyncio.sleep(0.05)
        assert not late.done()  # held at the gate while paused
        await gate.resume()
        await asyncio.gather(first, late)
        return order

    assert asyncio.run(scenario()) == ["inflight start", "inflight end", "paused", "late start", "late end"]


def test_drain_timeout_goes_ahead_and_reports_the_calls_left():
    async def scenario():
        gate = PauseState()

        async def slow():
            async with gate.admit():
                await asyncio.sleep(0.5)

        task = asyncio.create_task(slow())
        await asyncio.sleep(0.01)
        left = await gate.pause(drain_timeout=0.05)
        await gate.resume()
        await task
        return left, gate.stats()["undrained"]

    assert asyncio.run(scenario()) == (1, 1)


def test_sync_over_http_drains_then_serves_the_waiting_harness_with_new_weights(scripted_lab):
    """A harness call in flight finishes on the old version; one sent during the sync waits, then gets the new."""
    lab = scripted_lab
    lab.engine.delay_s = 0.3
    client = openai.OpenAI(base_url=lab.session().openai_base_url, api_key="unused", max_retries=0)
    other = openai.OpenAI(base_url=lab.session().openai_base_url, api_key="unused", max_retries=0)
    results = {}

    def ask(name, c):
        results[name] = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])

    inflight = threading.Thread(target=ask, args=("inflight", client))
    inflight.start()
    time.sleep(0.1)
    waiting = threading.Thread(target=lambda: (time.sleep(0.05), ask("waiting", other)))
    waiting.start()
    sync = lab.sync_weights({}, drain_timeout=5)
    inflight.join()
    waiting.join()
    assert sync.undrained == 0 and sync.policy_version == 1
    versions = {c.session_id: c.policy_version for c in lab.call_records()}
    assert sorted(versions.values()) == [0, 1]  # the in-flight call on v0, the one that waited on v1
    assert lab.proxy_state["state"] == "serving" and lab.proxy_state["pauses"] == 1
    assert results["waiting"].choices[0].message.content == "Hello there."
