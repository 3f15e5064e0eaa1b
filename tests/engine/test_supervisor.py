"""The engine supervisor's decisions, with scripted engines and a recording gate (the real engine's deaths and
restarts are in tests/integration/test_engine_faults.py)."""

from __future__ import annotations

import threading
import time

import pytest

from polar_lab.engine import ScriptedEngine
from polar_lab.engine.supervisor import EngineSupervisor
from polar_lab.errors import EngineError, LabError


class Gate:
    def __init__(self):
        self.events: list[str] = []

    def pause(self, drain_timeout: float) -> int:
        self.events.append("pause")
        return 0

    def resume(self) -> None:
        self.events.append("resume")


class Engine(ScriptedEngine):
    """A scripted engine that can die (as its process would) and start slowly."""

    def __init__(self, tokenizer, model_path, *, start_s: float = 0.0, fails_to_start: bool = False):
        super().__init__(tokenizer, model_path=model_path)
        self.start_s, self.fails_to_start = start_s, fails_to_start
        self._stopped = threading.Event()

    def wait_ready(self, timeout: float = 900.0):
        if self._stopped.wait(self.start_s) or self.fails_to_start:
            raise EngineError("start-up failed")
        return self

    def die(self) -> None:
        self._closed = True
        if self.on_exit is not None:
            self.on_exit(self, "killed")

    def close(self) -> None:
        super().close()
        self._stopped.set()


@pytest.fixture
def make(tokenizer, model_path):
    return lambda **kw: Engine(tokenizer, model_path, **kw)


def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_every_death_is_healed_once_and_the_gate_is_paused_around_it(make):
    engines = []
    sup = EngineSupervisor(make(), gate=(gate := Gate()), factory=lambda: engines.append(make()) or engines[-1])
    for n in (1, 2):  # the replacement is watched too
        dead = sup.engine
        dead.die()
        dead.die()  # a second report of the same death starts no second heal
        _until(lambda: sup.engine is not dead and not sup._heal_pending)
        assert len(sup.restarts) == n and sup.restarts[-1].automatic and sup.status()["engine"] == "serving"
    assert gate.events == ["pause", "resume"] * 2


def test_a_death_past_version_0_without_kept_weights_is_not_healed(make):
    sup = EngineSupervisor(make(), gate=Gate(), factory=make)
    sup.load({})  # version 1, and a scripted engine keeps no weights file
    sup.engine.die()
    _until(lambda: not sup._heal_pending)
    assert sup.restarts == [] and sup.status()["engine"] == "down"  # no silent roll-back to the folder's weights
    with pytest.raises(LabError, match="not kept"):
        sup.restart()
    assert sup.load({}) == 2 and sup.engine.alive  # the trainer's next load heals, with its weights


def test_a_failed_restart_leaves_the_engine_down_not_restarting(make):
    sup = EngineSupervisor(make(), gate=Gate(), factory=lambda: make(fails_to_start=True), max_restarts=0)
    with pytest.raises(EngineError, match="start-up failed"):
        sup.restart()
    assert not sup.engine.alive and sup.status()["engine"] == "down"  # calls get their 503, they do not wait


def test_a_failing_heal_stops_at_max_restarts(make):
    sup = EngineSupervisor(make(), gate=Gate(), factory=lambda: make(fails_to_start=True), max_restarts=2)
    sup._stopping.wait = lambda delay: None  # no backoff in a unit test
    sup.engine.die()
    _until(lambda: not sup._heal_pending)
    assert [r.ok for r in sup.restarts] == [False, False] and sup.status()["engine"] == "down"


def test_closing_during_a_restart_ends_the_start_up_at_once(make):
    sup = EngineSupervisor(make(), gate=(gate := Gate()), factory=lambda: make(start_s=60))
    sup.engine.die()
    _until(lambda: sup._starting is not None)
    t0 = time.monotonic()
    sup.close()
    assert time.monotonic() - t0 < 5  # not the 60 s start-up
    _until(lambda: not sup._heal_pending)
    assert gate.events == ["pause", "resume"]  # calls waiting at the gate are let through (to their 503)


class Preloading(Engine):
    """Records its weight calls in the gate's event list; ready to swap what it preloaded."""

    def __init__(self, tokenizer, model_path, events: list[str]):
        super().__init__(tokenizer, model_path)
        self.events = events

    def preload_weights_file(self, path):
        self.events.append(f"preload {path}")
        return None

    def load_weights_file(self, path, *, version=None):
        self.events.append(f"load {path}")
        return super().load_weights_file(path, version=version)


def test_a_sync_preloads_a_file_before_it_pauses(tokenizer, model_path):
    gate = Gate()
    supervisor = EngineSupervisor(Preloading(tokenizer, model_path, gate.events), gate=gate)
    result = supervisor.sync("/dev/shm/w", drain_timeout=1.0)
    # the standby loads while the proxy still serves; only the swap sits inside the pause
    assert gate.events == ["preload /dev/shm/w", "pause", "load /dev/shm/w", "resume"]
    assert result.swapped and result.policy_version == 1
    gate.events.clear()
    result = supervisor.sync({"w": None}, drain_timeout=1.0)  # a state dict: nothing to preload, loaded in place
    assert gate.events == ["pause", "resume"] and not result.swapped
