"""StepThreads: a CPU engine's small decode steps run on one OpenMP thread, everything else on every thread."""

import pytest

from polar_lab.config import EngineConfig
from polar_lab.engine.step_threads import StepThreads
from polar_lab.errors import ConfigError


def _threads(small_batch: int, every: int = 4) -> tuple[StepThreads, list[int]]:
    calls: list[int] = []
    return StepThreads(small_batch, every, calls.append), calls


# (small_batch, requests running, a prefill in the step) → threads for that step
@pytest.mark.parametrize("small_batch, running, prefill, threads", [
    (2, 1, False, 1),   # one stream decoding: one thread, the other cores left to the proxy and the client
    (2, 2, False, 1),   # at the bound: still small
    (2, 3, False, 4),   # above it: every thread
    (2, 1, True, 4),    # a prompt is prefilled in this step: every thread, whatever the batch
    (2, 0, False, 1),   # nothing running (a step that only finishes aborts): small
    (0, 1, False, 4),   # 0 turns it off: every step on every thread, as before
    (0, 0, False, 4),
    (256, 200, False, 1),  # a bound as large as the batch keeps even large steps on one thread
])
def test_each_step_gets_the_threads_its_batch_needs(small_batch, running, prefill, threads):
    step_threads, _ = _threads(small_batch)
    assert step_threads.wanted(running, prefill) == threads


def test_the_count_is_set_only_when_it_changes_and_loads_get_every_thread():
    step_threads, calls = _threads(2)
    for running, prefill in [(1, True), (1, False), (1, False), (2, False), (5, False), (5, False), (1, False)]:
        step_threads.before_step(running, prefill)
    assert calls == [1, 4, 1]  # the prefill step keeps the starting 4; decode → 1, a batch of 5 → 4, back → 1
    step_threads.use_every()
    step_threads.use_every()
    assert calls == [1, 4, 1, 4] and step_threads.current == 4


def test_a_process_with_one_thread_never_switches():
    step_threads, calls = _threads(2, every=1)  # a bound engine on one core, or a Ray replica with one CPU
    for running, prefill in [(1, True), (1, False), (9, False)]:
        step_threads.before_step(running, prefill)
    assert calls == []


def test_a_negative_small_batch_is_a_config_error():
    with pytest.raises(ConfigError, match="cpu_small_batch"):
        EngineConfig(cpu_small_batch=-1)
