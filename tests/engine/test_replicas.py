"""The replica set's decisions — routing, moves, one policy version, replacements — with scripted engines (the
real engines, local and on Ray, are in tests/integration/test_replicas.py)."""

from __future__ import annotations

import threading
import time

import pytest

from polar_lab.engine import ScriptedEngine
from polar_lab.engine.replicas import ReplicaSet
from polar_lab.errors import EngineError
from polar_lab.types import SamplingSpec

SPEC = SamplingSpec(max_tokens=4)


class Replica(ScriptedEngine):
    """A scripted engine that can die as its process would, and can refuse a weight load."""

    def __init__(self, tokenizer, model_path, *, delay_s: float = 0.0, name: str = ""):
        super().__init__(tokenizer, model_path=model_path, delay_s=delay_s)
        self.name = name
        self.refuse_load = False
        self.loads: list[int] = []

    def die(self) -> None:
        self._closed = True
        if self.on_exit is not None:
            self.on_exit(self, "killed")

    def load_weights_file(self, path, *, version=None):
        if self.refuse_load:
            raise EngineError("the load failed")
        self.loads.append(version)
        return super().load_weights_file(path, version=version)


@pytest.fixture
def make(tokenizer, model_path):
    made: list[Replica] = []

    def make(n: int, *, factory: bool = True, delay_s: float = 0.0, **kwargs) -> ReplicaSet:
        def replica(slot: int) -> Replica:
            made.append(Replica(tokenizer, model_path, delay_s=delay_s, name=f"new-{slot}"))
            return made[-1]

        engines = [Replica(tokenizer, model_path, delay_s=delay_s, name=f"first-{i}") for i in range(n)]
        return ReplicaSet(engines, factory=replica if factory else None, **kwargs).wait_ready()

    make.made, make.tokenizer, make.model_path = made, tokenizer, model_path
    return make


def until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_each_session_sticks_to_one_replica_and_sessions_spread(make):
    replicas = make(2)
    seen: dict[str, set[int]] = {}
    for _ in range(3):
        for s in range(8):
            gen = replicas.submit([1, 2, 3], SPEC, route=f"s{s}").result()
            seen.setdefault(f"s{s}", set()).add(gen.replica)
            assert gen.moved_from is None
    assert all(len(used) == 1 for used in seen.values())
    assert sorted(r for used in seen.values() for r in used) == [0] * 4 + [1] * 4  # one call at a time: by sessions
    assert [row["sessions"] for row in replicas.replica_status()] == [4, 4]


def test_a_new_session_goes_to_the_replica_with_fewest_requests_in_flight(make):
    replicas = make(2, delay_s=0.5)
    a1 = replicas.submit([1], SPEC, route="a")  # replica 0
    b = replicas.submit([1], SPEC, route="b")  # replica 1: nothing in flight there
    a2 = replicas.submit([1], SPEC, route="a")  # replica 0 again: 2 in flight there, 1 on replica 1
    c = replicas.submit([1], SPEC, route="c")  # sessions tie (1 and 1): the requests in flight decide
    assert [f.result().replica for f in (a1, b, a2, c)] == [0, 1, 0, 1]
    assert replicas.router.inflight == [0, 0]


def test_a_dead_replicas_sessions_move_and_the_move_is_recorded(make):
    replicas = make(2, factory=False)
    first = replicas.submit([1], SPEC, route="s").result().replica
    replicas.engines[first].die()
    gen = replicas.submit([1], SPEC, route="s").result()
    assert gen.replica == 1 - first and gen.moved_from == first
    assert [(m.route, m.from_replica, m.to_replica, m.why) for m in replicas.moves] == [("s", first, 1 - first, "dead")]
    again = replicas.submit([1], SPEC, route="s").result()
    assert again.replica == 1 - first and again.moved_from is None  # it sticks to its new replica


def test_a_replica_over_its_queue_bound_sends_the_session_elsewhere(make):
    replicas = make(2, delay_s=0.3, queue_bound=1)
    held = replicas.submit([1], SPEC, route="s")
    second = replicas.submit([1], SPEC, route="s")
    assert second.result().moved_from == held.result().replica
    assert replicas.moves[-1].why == "queue over bound"


def test_a_sync_loads_every_replica_at_one_version(make, tmp_path):
    replicas = make(3)
    assert replicas.load_weights_file(tmp_path / "w.safetensors") == 1
    assert replicas.load_weights_file(tmp_path / "w.safetensors") == 2
    assert [e.policy_version for e in replicas.engines] == [2, 2, 2]
    assert [e.loads for e in replicas.engines] == [[1, 2]] * 3


def test_a_replica_that_fails_to_load_never_serves_the_old_weights_under_the_new_version(make, tmp_path):
    replicas = make(2, weights_dir=tmp_path)  # the weights are kept: a replacement can load them
    bad = replicas.engines[1]
    bad.refuse_load = True
    assert replicas.load_weights_file(tmp_path / "w", version=1) == 1
    assert not replicas.serving[1] or replicas.engines[1] is not bad  # out of rotation at once
    for s in range(6):  # while it is replaced, every call is served by the replica at version 1
        gen = replicas.submit([1], SPEC, route=f"s{s}").result()
        assert gen.output_versions[0] == 1
        assert replicas.engines[gen.replica] is not bad
    until(lambda: replicas.serving[1])
    replacement = replicas.engines[1]
    assert replacement is not bad and bad.alive is False
    assert replacement.policy_version == 1 and replacement.loads == [1]  # came back with the new weights


def test_without_kept_weights_a_replica_that_failed_to_load_stays_out_of_rotation(make, tmp_path):
    replicas = make(2)
    replicas.engines[0].refuse_load = True
    replicas.load_weights_file(tmp_path / "w")
    assert replicas.serving == [False, True] and replicas.restarts == []
    until(lambda: not replicas.engines[0].alive)  # closed: nothing may sample with its old weights
    assert {replicas.submit([1], SPEC, route=f"s{s}").result().replica for s in range(4)} == {1}


def test_when_every_replica_fails_to_load_the_version_does_not_change(make, tmp_path):
    replicas = make(2)
    for engine in replicas.engines:
        engine.refuse_load = True
    with pytest.raises(EngineError, match="the load failed"):
        replicas.load_weights_file(tmp_path / "w")
    assert replicas.policy_version == 0 and all(replicas.serving)


def test_a_stale_death_report_leaves_the_replacement_alone(make):
    replicas = make(2)
    dead = replicas.engines[0]
    dead.die()
    until(lambda: replicas.serving[0] and replicas.engines[0] is not dead)
    dead.on_exit(dead, "heard late")  # the old engine's report, after its replacement took the slot
    time.sleep(0.2)
    assert replicas.serving[0] and replicas.engines[0].alive and len(replicas.restarts) == 1


def test_a_dead_replica_comes_back_at_the_current_version(make, tmp_path):
    weights = tmp_path / "kept"
    weights.mkdir()
    replicas = make(2, weights_dir=weights)
    replicas.load_weights_file(weights / "w.safetensors")
    dead = replicas.engines[0]
    dead.die()
    until(lambda: replicas.serving[0] and replicas.engines[0] is not dead)
    assert replicas.engines[0].policy_version == 1 and replicas.engines[0].loads == [1]
    assert [(r.replica, r.ok, r.policy_version) for r in replicas.restarts] == [(0, True, 1)]


def test_a_set_that_cannot_replace_reports_its_death_when_nothing_serves(make):
    replicas = make(2, factory=False)
    deaths: list[str] = []
    replicas.on_exit = lambda engine, reason: deaths.append(reason)
    replicas.engines[0].die()
    assert replicas.alive and deaths == []
    replicas.engines[1].die()
    assert not replicas.alive and len(deaths) == 1 and "every engine replica is down" in deaths[0]
    with pytest.raises(EngineError, match="no engine replica is serving"):
        replicas.submit([1], SPEC, route="s").result()


class Slow(Replica):
    """A replacement that takes its time to start (or never does); `deaf`: closing it does not cut its
    start-up short (a process that was already past the point of no return)."""

    def __init__(self, tokenizer, model_path, *, start_s: float = 0.0, fails: bool = False, deaf: bool = False):
        super().__init__(tokenizer, model_path)
        self.start_s, self.fails, self.deaf = start_s, fails, deaf
        self.stopped = threading.Event()

    def wait_ready(self, timeout: float = 900.0):
        if self.deaf:
            time.sleep(self.start_s)
        elif self.stopped.wait(self.start_s) or self.fails:
            raise EngineError("start-up failed")
        return self

    def close(self) -> None:
        super().close()
        self.stopped.set()


def test_a_failed_replacement_is_tried_again_within_the_budget(tokenizer, model_path):
    attempts: list[Slow] = []

    def factory(slot: int) -> Slow:
        attempts.append(Slow(tokenizer, model_path, fails=len(attempts) == 0))  # the first start fails
        return attempts[-1]

    replicas = ReplicaSet([Replica(tokenizer, model_path) for _ in range(2)], factory=factory,
                          max_restarts=3).wait_ready()
    replicas.engines[0].die()
    until(lambda: replicas.serving[0], timeout=10)
    assert replicas.engines[0] is attempts[1]
    assert [(r.ok, r.replica) for r in replicas.restarts] == [(False, 0), (True, 0)]


def test_replacements_stop_at_max_restarts_and_then_the_set_reports_its_death(tokenizer, model_path):
    deaths: list[str] = []
    replicas = ReplicaSet([Replica(tokenizer, model_path)],
                          factory=lambda slot: Slow(tokenizer, model_path, fails=True), max_restarts=2).wait_ready()
    replicas.on_exit = lambda engine, reason: deaths.append(reason)
    replicas.engines[0].die()
    until(lambda: deaths, timeout=15)  # 2 failed attempts (2 s backoff between), then the set gives up
    assert [r.ok for r in replicas.restarts] == [False, False] and not replicas.alive
    assert "could not be brought back" in deaths[0]


def test_closing_the_set_ends_a_replacement_that_is_starting(tokenizer, model_path):
    starting: list[Slow] = []

    def factory(slot: int) -> Slow:
        starting.append(Slow(tokenizer, model_path, start_s=60))
        return starting[-1]

    replicas = ReplicaSet([Replica(tokenizer, model_path) for _ in range(2)], factory=factory).wait_ready()
    replicas.engines[0].die()
    until(lambda: starting)
    t0 = time.monotonic()
    replicas.close()
    until(lambda: not replicas.healer.healing)
    assert time.monotonic() - t0 < 5 and not starting[0].alive  # closed, not waited out


def test_a_replacement_that_finishes_starting_after_close_is_never_swapped_in(tokenizer, model_path):
    starting: list[Slow] = []

    def factory(slot: int) -> Slow:
        starting.append(Slow(tokenizer, model_path, start_s=1.0, deaf=True))
        return starting[-1]

    replicas = ReplicaSet([Replica(tokenizer, model_path) for _ in range(2)], factory=factory).wait_ready()
    replicas.engines[0].die()
    until(lambda: starting)
    replicas.close()  # while the replacement is still starting; it comes up a moment later
    until(lambda: not replicas.healer.healing)
    assert all(e is not starting[0] for e in replicas.engines) and not starting[0].alive


def test_two_deaths_heard_together_start_one_replacement(make, monkeypatch):
    replicas = make(2)
    dead = replicas.engines[0]
    dead._closed = True
    decide = replicas.healer._can_replace

    def slowly(slot: int) -> bool:  # a slow decision: any thread that checks before another claims would slip in
        time.sleep(0.05)
        return decide(slot)

    monkeypatch.setattr(replicas.healer, "_can_replace", slowly)
    threads = [threading.Thread(target=dead.on_exit, args=(dead, "killed")) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    until(lambda: replicas.serving[0])
    assert len(replicas.restarts) == 1 and len(make.made) == 1


class Shipped:
    """What a Ray set's `ship` makes of a weights file (a Shipment), without Ray."""

    def __init__(self, path):
        self.path, self.kept = path, False

    def keep(self) -> None:
        self.kept = True


def test_weights_not_kept_as_a_file_are_kept_by_the_shipment_for_replacements(make, tmp_path):
    shipments: list[Shipped] = []

    def ship(path):
        shipments.append(Shipped(path))
        return shipments[-1]

    class Loads(Replica):
        def load_weights_file(self, path, *, version=None, shipped=None):
            self.shipped_with = shipped
            return super().load_weights_file(path, version=version)

    made: list[Loads] = []

    def factory(slot: int) -> Loads:
        made.append(Loads(make.tokenizer, make.model_path))
        return made[-1]

    first = [Loads(make.tokenizer, make.model_path) for _ in range(2)]
    replicas = ReplicaSet(first, factory=factory, ship=ship).wait_ready()  # no weights_dir: nothing kept
    replicas.load_weights_file(tmp_path / "w.safetensors")
    assert shipments[0].kept  # the file is the caller's to delete: the shipment made its own copy
    first[0].die()
    until(lambda: replicas.serving[0] and made)
    assert made[0].shipped_with is shipments[0] and made[0].policy_version == 1
