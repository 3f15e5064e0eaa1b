"""The SDK clients of polar_lab's own harnesses share one TLS context per process (polar_lab/harness/clients.py):
httpx builds a context for every client it makes, and loading the CA bundle costs ~30 ms of CPU per harness run."""

import asyncio
import gc
import ssl
from types import SimpleNamespace

import pytest

from polar_lab.harness import calculator_agent
from polar_lab.harness.calculator_apis import anthropic_calculator_agent
from polar_lab.harness.clients import anthropic_client, openai_client, tls_context


@pytest.fixture
def ca_loads(monkeypatch):
    """Every load of CA certificates into a TLS context in this process, by the method that did it."""
    loads = []
    for name in ("load_verify_locations", "set_default_verify_paths"):
        def counted(self, *args, _original=getattr(ssl.SSLContext, name), _name=name, **kwargs):
            loads.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(ssl.SSLContext, name, counted)
    tls_context.cache_clear()  # as in a fresh process
    return loads


@pytest.mark.parametrize("harness", [calculator_agent, anthropic_calculator_agent])
def test_runs_after_the_first_load_no_ca_bundle(scripted_lab, ca_loads, harness):
    """The first rollout builds the process's context (and the SDKs' imports build their own, once); a second
    rollout of 8 runs, each with its own client, loads none (httpx alone would load the bundle 8 times)."""
    tasks = [{"question": "1+1", "answer": "2"}] * 2
    scripted_lab.rollout(tasks, harness, num_generations=4, progress=False)
    assert ca_loads, "the first rollout built no TLS context: this test no longer sees the clients'"
    ca_loads.clear()
    groups = scripted_lab.rollout(tasks, harness, num_generations=4, progress=False)
    sessions = [s for g in groups for s in g.sessions]
    assert len(sessions) == 8 and {s.status for s in sessions} == {"closed"}
    assert len(scripted_lab.calls()) == 16  # every run called the model, through a client of its own
    assert ca_loads == []


@pytest.mark.parametrize("make", [openai_client, anthropic_client])
def test_a_client_its_harness_never_closed_closes_itself_when_collected(make):
    """As the client an SDK makes for itself does: a harness that drops its SDK client leaves no open connection."""
    session = SimpleNamespace(openai_base_url="http://127.0.0.1:9/v1", anthropic_base_url="http://127.0.0.1:9",
                              api_key="k")

    async def drop_one() -> list[bool]:
        closed = []
        http = make(session)._client
        close = http.aclose

        async def counted():
            closed.append(True)
            await close()

        http.aclose = counted
        del http, close  # what is left is a cycle (counted → close → the client): the collector's, as after a run
        gc.collect()
        await asyncio.sleep(0.05)
        return closed

    assert asyncio.run(drop_one()) == [True]
