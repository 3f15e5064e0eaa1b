"""The SDK clients of polar_lab's own harnesses share one TLS context per process (polar_lab/harness/clients.py):
httpx builds a context for every client it makes, and loading the CA bundle costs ~30 ms of CPU per harness run."""

import ssl

import pytest

from polar_lab.harness import calculator_agent
from polar_lab.harness.calculator_apis import anthropic_calculator_agent
from polar_lab.harness.clients import tls_context


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
