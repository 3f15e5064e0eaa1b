"""StepThreads: a CPU engine's small steps (few requests, a short prefill or none) run on one OpenMP thread,
everything else on every thread."""

import pytest

from polar_lab.config import EngineConfig
from polar_lab.engine.step_threads import StepThreads
from polar_lab.errors import ConfigError


def _threads(small_batch: int, every: int = 4, small_prefill: int = 128) -> tuple[StepThreads, list[int]]:
    calls: list[int] = []
    return StepThreads(small_batch, small_prefill, every, calls.append), calls


# (small_batch, small_prefill, requests running, prompt tokens left to prefill) → threads for that step
@pytest.mark.parametrize("small_batch, small_prefill, running, prefill_tokens, threads", [
    (2, 128, 1, 0, 1),     # one stream decoding: one thread, the other cores left to the proxy and the client
    (2, 128, 2, 0, 1),     # at the bound: still small
    (2, 128, 3, 0, 4),     # above it: every thread
    (2, 128, 1, 30, 1),    # a short prompt prefilled beside it: still small
    (2, 128, 1, 128, 1),   # at the prefill bound
    (2, 128, 1, 129, 4),   # a longer prompt: every thread, however few requests
    (2, 128, 2, 200, 4),   # two short prompts whose sum is over the bound
    (2, 128, 3, 10, 4),    # a short prompt in a large batch: every thread
    (2, 0, 1, 1, 4),       # small_prefill 0: any prefill on every thread
    (2, 0, 1, 0, 1),       # ... while small decode steps stay on one
    (2, 128, 0, 0, 1),     # nothing running (a step that only finishes aborts): small
    (0, 128, 1, 0, 4),     # small_batch 0 turns it off: every step on every thread
    (0, 128, 1, 30, 4),    # ... a short prefill too
    (256, 128, 200, 0, 1),  # a bound as large as the batch keeps even large steps on one thread
])
def test_each_step_gets_the_threads_its_batch_needs(small_batch, small_prefill, running, prefill_tokens, threads):
    step_threads, _ = _threads(small_batch, small_prefill=small_prefill)
    assert step_threads.wanted(running, prefill_tokens) == threads


def test_the_count_is_set_only_when_it_changes_and_loads_get_every_thread():
    step_threads, calls = _threads(2)
    for running, prefill_tokens in [(1, 500), (1, 0), (1, 0), (2, 40), (5, 0), (5, 0), (1, 0)]:
        step_threads.before_step(running, prefill_tokens)
    assert calls == [1, 4, 1]  # the long prefill keeps the starting 4; then 1, a batch of 5 → 4, back → 1
    step_threads.use_every()
    step_threads.use_every()
    assert calls == [1, 4, 1, 4] and step_threads.current == 4


def test_a_process_with_one_thread_never_switches():
    step_threads, calls = _threads(2, every=1)  # a bound engine on one core, or a Ray replica with one CPU
    for running, prefill_tokens in [(1, 500), (1, 0), (9, 0)]:
        step_threads.before_step(running, prefill_tokens)
    assert calls == []


@pytest.mark.parametrize("field", ["cpu_small_batch", "cpu_small_prefill"])
def test_a_negative_bound_is_a_config_error(field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: -1})
