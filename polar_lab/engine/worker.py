"""The engine process: `python -m polar_lab.engine.worker FD` builds `vllm.LLM` and serves one connection.

Started and stopped by `VLLMEngine` (engine/vllm_engine.py), which holds the other end of the socket
`FD`; this process is the only code that touches vLLM, and it has one thread. Between two engine steps it
reads every command waiting on the socket (it blocks there when nothing is running), then steps vLLM while
requests are pending (vLLM batches everything in flight) and sends the generations that finished in that
step back in one message. A request added with `stream=True` also has the tokens each step sampled for it
sent back (one "delta" message per step for all such requests, before that step's "done"): vLLM's DELTA
output kind, whose text already holds back a possible stop string; the worker keeps the pieces and answers
the finished request with the whole generation, as for any other. Weight loads are commands too, so they
land exactly between two steps; vLLM's own weight-version spans then tell which policy version sampled each
output token. With a standby copy of the model (engine/standby.py, `EngineConfig.standby_weights`), a "stage"
loads a file into the standby in a second thread while this loop keeps stepping, and the "weights" load of that
file that follows is a swap between two steps; that thread sends only its "staged" answer (sends are locked).

Why a process of its own: the proxy's HTTP work and vLLM's Python step loop each need a core's worth of
interpreter time under load; in one process they share one GIL, and at 64 concurrent sessions the steps
ran 3.3× slower than with the engine alone (docs/design-notes.md).
Why not vLLM's `AsyncLLM`: its child cannot take weights from memory on vllm 0.32 and it adds a second hop;
here weights arrive as a safetensors file in /dev/shm, mapped, not copied through the socket.

Every request is validated before it is added, and a request that fails validation is answered alone (a
`Rejection`, which the proxy turns into the caller's 400). This matters because vLLM steps all requests in
flight as one batch: a value that raises inside `step()` (a seed `manual_seed` cannot take, seen with a
dict and with an integer beyond 64 bits) fails every request of that batch and ends this process, and with
it every session of the run. So nothing reaches `add_request` that `SamplingSpec.check` and vLLM's own
`SamplingParams` validation have not accepted; an exception that still escapes `step()` is fatal, reported
to the parent, whose owner restarts the engine (engine/supervisor.py).

Messages (pickled, multiprocessing.connection framing); rid = request id chosen by the parent:
    parent → worker   ("start", EngineConfig) first, then ("add", rid, prompt_ids, SamplingSpec, stream)
                      | ("abort", rid) | ("stage", path) | ("weights", path, version or None) | ("stop",)
    worker → parent   ("ready", info) | ("delta", [(rid, TokenDelta)], stats) | ("done", [(rid, Generation |
                      Rejection)], stats) | ("running", n) | ("staged", path, None or why it cannot be swapped in)
                      | ("weights", version or error text) | ("fatal", message)
                      stats = (busy_s, steps, requests running); info["standby"]: "stage" is answered
When the parent goes away (its end of the socket closes) the worker stops: no engine outlives its kernel.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from polar_lab._imports import frozen_imports
from polar_lab.config import EngineConfig
from polar_lab.engine.adapters import AdapterServing
from polar_lab.engine.base import Rejection, versions_from_spans
from polar_lab.types import Generation, SamplingSpec, TokenDelta

log = logging.getLogger("polar_lab.engine.worker")


def _torchvision_stand_in() -> None:
    """Make sure this engine process, and the interpreters vLLM starts from it, have the torchvision stand-in where
    torchvision is not installed (engine/shims/sitecustomize.py). Its sitecustomize normally did it at interpreter
    start; an engine process whose PYTHONPATH lacked the shims (started by another launcher, or before they were
    there: a Ray actor's, whose environment Ray makes) loads it here, and puts the shims on the PYTHONPATH its own
    subprocesses inherit."""
    import importlib.util

    from polar_lab.engine.process_env import SHIMS, torchvision_stand_in

    if importlib.util.find_spec("torchvision") is not None:  # installed, or the stand-in already answers
        return
    log.info("loading the torchvision stand-in in the engine process itself (PYTHONPATH was %r)",
             os.environ.get("PYTHONPATH"))
    torchvision_stand_in(os.environ)  # first: it checks for torchvision, which the stand-in then answers
    spec = importlib.util.spec_from_file_location("polar_lab_torchvision_stand_in", os.path.join(SHIMS,
                                                                                                  "sitecustomize.py"))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


_torchvision_stand_in()


def prefill_left(scheduler) -> int:
    """Prompt tokens vLLM's scheduler has still to prefill: a new request's whole prompt (its prefix-cache hits are
    known only once it is scheduled), the rest of one prefilled in chunks, all of a preempted one's."""
    return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in scheduler.requests.values())


class Worker(AdapterServing):
    """One vLLM engine and the bookkeeping between it and the socket."""

    def __init__(self, conn: Connection, config: EngineConfig):
        self.conn = conn
        self.config = config
        self.version = 0
        self.loads = 0  # full-weight loads so far: the prefix cache's salt (a version number may be given twice)
        self.busy_s = 0.0  # wall time inside vLLM steps, reported with every result
        self.steps = 0
        self.live: set[str] = set()  # request ids vLLM is working on
        self.streams: dict[str, _Pieces] = {}  # streamed requests: what their deltas carried so far
        self.llm = None
        self.adapter = None  # the LoRARequest new requests are served with (None: the weights alone)
        self.adapter_of: dict[str, tuple[int, int]] = {}  # request id → (its adapter's id, that policy version)
        self.adapters_loaded = 0
        self.adapter_dirs: dict[int, str] = {}  # adapter id → the engine's own copy of its folder (in TMPDIR)
        self.standby = None  # a StandbyLoader (engine/standby.py) when the engine keeps a standby copy
        self.threads = None  # a CPU engine's StepThreads (engine/step_threads.py): how many OpenMP threads a step gets
        self.scheduler = None  # vLLM's scheduler, read for the prompt tokens still to prefill (engine_core.py)
        self._send_lock = threading.Lock()  # the standby's thread sends too

    def build(self) -> dict[str, Any]:
        with frozen_imports():  # a fresh process imports here (a forked one has them), 4-5 s of its start
            import torch
            import vllm  # deferred: importing vllm costs seconds and reads the environment the parent set

        t0 = time.perf_counter()
        imported_at = _process_age()  # a fresh process's imports, or ~0 when forked from the forkserver
        self.llm = self.make_llm(vllm, torch.cuda.is_available())
        self.llm.llm_engine.set_weight_version(str(self.version))
        llm_s = time.perf_counter() - t0
        # in this process vLLM's engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), scheduler included
        self.scheduler = getattr(getattr(self.llm.llm_engine.engine_core, "engine_core", None), "scheduler", None)
        if not torch.cuda.is_available() and self.scheduler is not None:
            from polar_lab.engine.step_threads import StepThreads

            self.threads = StepThreads.for_process(self.config.cpu_small_batch, self.config.cpu_small_prefill)
        standby_s = self.build_standby(torch.cuda.is_available())
        return {"max_model_len": self.llm.llm_engine.model_config.max_model_len,
                "startup_seconds": time.perf_counter() - t0, "pid": os.getpid(),
                "standby": self.standby is not None, "standby_s": standby_s, "llm_s": llm_s,
                "dtype": str(self.llm.llm_engine.model_config.dtype).removeprefix("torch."),
                "imported_at_s": imported_at, "step_threads": None if self.threads is None else {  # None: vLLM's own
                    "small_batch": self.threads.small_batch, "small_prefill": self.threads.small_prefill,
                    "every": self.threads.every}}

    def make_llm(self, vllm, cuda: bool):
        """`vllm.LLM` as this project serves it."""
        c, dtype = self.config, _dtype(self.config, cuda)
        if not cuda and dtype == "float32" and hybrid(c.model):
            from polar_lab.engine import gdn_fp32

            gdn_fp32.install()  # vLLM's CPU linear-attention kernels take bf16 only
        if not cuda:
            from polar_lab.engine import cpu_chunks

            cpu_chunks.install()  # a seeded request's split prefill would otherwise kill a CPU engine
        return vllm.LLM(
            model=c.model, runner="generate", dtype=dtype, max_model_len=c.max_model_len,
            enforce_eager=c.enforce_eager, seed=c.seed, max_num_seqs=c.max_num_seqs,
            gpu_memory_utilization=c.gpu_memory_utilization, tensor_parallel_size=c.tensor_parallel_size,
            logprobs_mode="processed_logprobs",  # logprobs of the distribution actually sampled from
            # the structural tags the proxy sends (proxy/constraints.py) are xgrammar's; "auto" may pick another
            structured_outputs_config={"backend": "xgrammar"},
            **_prefill_args(c), **_reasoning_args(c), **_lora_args(c),
            **_executor_args(c), **_kv_args(c, cuda), **_transfer_args(c),
            # logits in fp32 (vLLM: "required for RL training-inference consistency"): the trainer's are fp32, and a
            # logit a bf16 engine rounds is off by up to |logit| * 2**-9, a logprob by as much. Only the head: vLLM
            # casts its weight per step (on CUDA it accumulates into fp32). In an fp32 engine this changes nothing.
            hf_overrides={"head_dtype": "float32"},
        )

    def build_standby(self, cuda: bool) -> float:
        """The standby copy of the model, where the config asks for one (None: on a CPU engine); its seconds."""
        if not self.config.standby_enabled(cuda):
            return 0.0
        from polar_lab.engine import standby

        seconds = self.llm.collective_rpc(standby.build)[0]
        self.standby = standby.StandbyLoader(self.llm, threads=self.threads.every if self.threads else None,
                                             share=self.config.standby_share, busy=lambda: bool(self.live))
        return seconds

    def send(self, msg: tuple) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def serve(self) -> None:
        """Commands between steps until "stop" or until the parent hangs up (EOFError)."""
        engine = self.llm.llm_engine
        while True:
            busy = engine.has_unfinished_requests()
            while not busy or self.conn.poll(0):
                if self.handle(self.conn.recv()) == "stop":
                    return
                busy = engine.has_unfinished_requests()
            if self.threads is not None:
                self.threads.before_step(len(self.live), prefill_left(self.scheduler))
            t0 = time.perf_counter()
            outputs = engine.step()
            self.busy_s += time.perf_counter() - t0
            self.steps += 1
            deltas = [(o.request_id, self.streams[o.request_id].add(o.outputs[0], self.version_of(o.request_id)))
                      for o in outputs if o.request_id in self.streams]
            if deltas:  # a finished request's last piece too: its caller has every token before the answer
                self.send(("delta", deltas, self.stats()))
            done = [(o.request_id, self.generation(o)) for o in outputs if o.finished]
            self.live.difference_update(rid for rid, _ in done)
            if done:
                self.send(("done", done, self.stats()))
                self.retire_adapters()

    def version_of(self, rid: str) -> int:
        """The policy version sampling a request's tokens now: its adapter's, or the weights' being served."""
        adapter = self.adapter_of.get(rid)
        return adapter[1] if adapter is not None else self.version

    def stats(self) -> tuple[float, int, int]:
        """(busy seconds, steps, requests running), sent with every answer."""
        return self.busy_s, self.steps, len(self.live)

    def handle(self, msg: tuple) -> str | None:
        kind = msg[0]
        if kind == "add":
            _, rid, prompt_ids, spec, stream = msg
            try:
                self.add(rid, prompt_ids, spec, stream=stream is True)
            except Exception as exc:  # noqa: BLE001 - a bad request fails only its caller
                param = getattr(exc, "param", None) or getattr(exc, "parameter", None)
                rejection = Rejection(f"{type(exc).__name__}: {exc}", param if isinstance(param, str) else None)
                self.send(("done", [(rid, rejection)], self.stats()))
        elif kind == "abort":
            if msg[1] in self.live:
                self.live.discard(msg[1])
                self.streams.pop(msg[1], None)
                self.adapter_of.pop(msg[1], None)
                self.llm.llm_engine.abort_request([msg[1]])
                self.send(("running", len(self.live)))
                self.retire_adapters()
        elif kind == "stage":
            self.stage(msg[1])
        elif kind == "weights":
            self.send(("weights", self.load_weights(msg[1], msg[2])))
        elif kind == "transfer":
            self.send(("weights", self.transfer(msg[1], msg[2], msg[3])))
        elif kind == "stop":
            return "stop"
        return None

    def add(self, rid: str, prompt_ids: list[int], spec: SamplingSpec, *, stream: bool = False) -> None:
        """Validate, then add: the request is checked as a SamplingSpec (exact types and ranges, including the
        seed, which vLLM leaves to torch) and by vLLM's SamplingParams and input processor, all before
        `add_request` returns, so no value of it can raise later inside a shared step."""
        if not isinstance(spec, SamplingSpec):
            raise TypeError(f"expected a SamplingSpec, got {type(spec).__name__}")
        spec.check()  # unpickling skipped __post_init__
        # salted per load: a load with calls in flight cannot reset vLLM's prefix cache, and no call added after it
        # may read KV the old weights computed (one added before goes on as a call in flight: docs/scale.md)
        prompt = {"prompt_token_ids": prompt_ids, "cache_salt": f"w{self.loads}"}
        self.llm.llm_engine.add_request(rid, prompt, _sampling_params(spec, stream), lora_request=self.adapter)
        if self.adapter is not None:
            self.adapter_of[rid] = (self.adapter.lora_int_id, self.version)
        self.live.add(rid)
        if stream:
            self.streams[rid] = _Pieces()

    def load_weights(self, path: str, version: int | None) -> int | str:
        """Load a safetensors file (engine/weights.py), or a PEFT LoRA adapter folder; it becomes `version`
        (default: the current one + 1)."""
        if os.path.isdir(path):
            return self.load_adapter(path, version)
        from polar_lab.engine.weights import reload_from_file, unplaced_names

        try:
            unplaced = self.llm.collective_rpc(unplaced_names, args=(path,))[0]
            if unplaced:  # refused before anything moves: the old weights keep serving at the old version
                return (f"weight load refused: the served model has no parameter for {len(unplaced)} of the file's "
                        f"tensors, e.g. {unplaced[:3]} (vLLM would pass over them in silence)")
            if self.standby is not None and self.standby.holds(path):
                self.standby.swap_in()  # staged while the engine served: a swap between two steps
            else:
                if self.standby is not None:
                    self.standby.wait()  # never two loads at once
                if self.threads is not None:
                    self.threads.use_every()  # copies and oneDNN's re-packing gain from every core
                # each of vLLM's workers (one per tensor-parallel GPU) maps the file itself
                self.llm.collective_rpc(reload_from_file, args=(path,))
        except Exception as exc:  # noqa: BLE001 - the caller learns why; the old weights keep serving
            log.exception("weight load failed")
            return f"weight load failed: {exc!r}"
        return self.loaded(version)

    def loaded(self, version: int | None) -> int:
        """New full weights serve from now on, as `version` (default: the current one + 1)."""
        self.llm.llm_engine.reset_prefix_cache()  # frees the old weights' blocks (refused while one is held: `add`)
        self.loads += 1
        self.version = self.version + 1 if version is None else version
        self.llm.llm_engine.set_weight_version(str(self.version))
        self.adapter = None  # these weights are the policy now: no adapter on top of them
        self.retire_adapters()
        return self.version

    def transfer(self, method: str, payload: dict | None, version: int | None) -> int | str:
        """One call of vLLM's weight-transfer API (engine/weight_transfer.py `call`); after `finish_weight_update`
        the new weights serve as `version`. "check_names" (ours, before an update): refused if the served model has
        no parameter for some of `payload["names"]`, as a file load is. The version served, or why the call failed."""
        from polar_lab.engine.weight_transfer import call
        from polar_lab.engine.weights import unplaced_of

        if method == "check_names":
            unplaced = self.llm.collective_rpc(unplaced_of, args=(payload["names"],))[0]
            return (f"weight transfer refused: the served model has no parameter for {len(unplaced)} of the "
                    f"trainer's tensors, e.g. {unplaced[:3]} (vLLM would pass over them in silence)"
                    if unplaced else self.version)
        failed = call(self.llm, method, payload)
        return failed or (self.loaded(version) if method == "finish_weight_update" else self.version)

    def stage(self, path: str) -> None:
        """Load a weights file into the standby while this loop keeps stepping; answered with "staged" when done
        (with the reason when the following load of it cannot be a swap)."""
        if self.standby is None or os.path.isdir(path):
            why = "an adapter is served as it is" if os.path.isdir(path) else "this engine keeps no standby copy"
            self.send(("staged", path, why))
            return
        self.standby.start(path, lambda done, error: self.send(("staged", done, error, self.standby.how)))

    def generation(self, output) -> Generation:
        c = output.outputs[0]
        pieces = self.streams.pop(output.request_id, None)
        ids = list(c.token_ids) if pieces is None else pieces.ids
        logprob_dicts = (c.logprobs or []) if pieces is None else pieces.logprobs
        spans = [(int(s.version), s.start, s.end) for s in (c.weight_versions or [])]
        adapter = self.adapter_of.pop(output.request_id, None)
        if adapter is not None:  # every token was sampled with the adapter the request started with
            spans = [(adapter[1], 0, len(ids))]
        return Generation(
            output_ids=ids,
            output_logprobs=[d[t].logprob for t, d in zip(ids, logprob_dicts)],
            output_versions=versions_from_spans(spans, len(ids), default=self.version),
            text=c.text if pieces is None else "".join(pieces.texts),
            finish_reason=c.finish_reason or "abort",
            stop_reason=c.stop_reason,
            top_logprobs=[{t: lp.logprob for t, lp in d.items()} for d in logprob_dicts],
            cached_tokens=output.num_cached_tokens or 0,
            prompt_logprobs=_prompt_logprobs(output),
        )


class _Pieces:
    """A streamed request's output so far: vLLM's DELTA outputs carry only what each step added."""

    def __init__(self):
        self.ids: list[int] = []
        self.logprobs: list = []  # vLLM's per-position {token id: Logprob}
        self.texts: list[str] = []

    def add(self, c, version: int) -> TokenDelta:
        """Keep one step's piece; the delta sent for it (ids, their logprobs, text)."""
        ids = list(c.token_ids)
        self.ids += ids
        self.logprobs += list(c.logprobs or [])
        self.texts.append(c.text)
        logprobs = [d[t].logprob for t, d in zip(ids, c.logprobs or [])]
        return TokenDelta(ids=ids, logprobs=logprobs, text=c.text, version=version)


def _prefill_args(c: EngineConfig) -> dict[str, Any]:
    """vLLM's own prefill settings unless the config turns chunked prefill off; then each prompt prefills in one step
    (a step budget of a whole context), and a hybrid model (linear-attention layers: Qwen3.5) runs without prefix
    caching, since vLLM caches its DeltaNet states only in 'align' mode, which splits prompts at block boundaries.
    On CPU a seeded request's split prefill needs engine/cpu_chunks.py (installed by `make_llm`)."""
    if c.chunked_prefill:
        return {}
    max_len = c.max_model_len or _model_config(c.model).max_position_embeddings
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max_len,
            **({"enable_prefix_caching": False} if hybrid(c.model) else {})}


def _dtype(c: EngineConfig, cuda: bool) -> str:
    """The engine's dtype: the config's. A hybrid model (Qwen3.5's linear-attention layers) on CPU runs in fp32 through
    engine/gdn_fp32.py (vLLM's own CPU kernels for those layers take bf16 only); in any other dtype it runs in bf16
    through vLLM's kernels, whose gap to an fp32 trainer is measured (benchmarks/hybrid_fidelity.py)."""
    if not cuda and c.dtype not in ("float32", "bfloat16") and hybrid(c.model):
        log.info("%s has linear-attention layers: vLLM's CPU kernels run it in bfloat16, not %s", c.model, c.dtype)
        return "bfloat16"
    return c.dtype


def hybrid(model: str) -> bool:
    """Whether a model mixes linear-attention layers into its stack (`layer_types`, as Qwen3.5's config has)."""
    config = _model_config(model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return "linear_attention" in (getattr(text, "layer_types", None) or ())


@functools.lru_cache(maxsize=4)
def _model_config(model: str):
    """The model's config, read once per engine process (the dtype, the prefill budget and `hybrid` each ask)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model)


def _kv_args(c: EngineConfig, cuda: bool) -> dict[str, Any]:
    """A CPU engine's KV cache, in bytes (`kv_cache_gib`; fractions of a GiB, which vLLM's VLLM_CPU_KVCACHE_SPACE cannot
    say). Given, it also spares the start a warm-up pass that only sizes the cache (vLLM's CPU worker skips it). A value
    of VLLM_CPU_KVCACHE_SPACE in the environment still wins, as in vLLM; a GPU engine sizes its cache from
    gpu_memory_utilization."""
    return {} if cuda else {"kv_cache_memory_bytes": int(c.kv_cache_gib * 2**30)}


def _lora_args(c: EngineConfig) -> dict[str, Any]:
    """LoRA on when a rank is set: room for two adapters in a step (the new policy's, and the old one's for
    calls still running across a sync)."""
    if c.max_lora_rank is None:
        return {}
    return {"enable_lora": True, "max_lora_rank": c.max_lora_rank, "max_loras": 2}


# the thought markers a chat template renders → vLLM's reasoning strings (proxy/formats.py's THINKING, by marker:
# the engine sits below the proxy and reads the template itself)
_THOUGHTS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))


def _reasoning_args(c: EngineConfig) -> dict[str, Any]:
    """vLLM's thinking budget (`SamplingParams.thinking_token_budget`) needs the family's thought markers in an
    engine-wide `reasoning_config`; its strings only (no reasoning parser: with one, vLLM would also hold grammars
    back until a thought ends). A template without thoughts gets none, and the proxy never sends it a budget."""
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(c.model).chat_template
    for start, end in _THOUGHTS:
        if isinstance(template, str) and start in template:
            from vllm.config.reasoning import ReasoningConfig

            return {"reasoning_config": ReasoningConfig(reasoning_start_str=start, reasoning_end_str=end)}
    return {}


def _transfer_args(c: EngineConfig) -> dict[str, Any]:
    """vLLM's weight-transfer engine, where weights come through its API (engine/weight_transfer.py)."""
    from polar_lab.engine.weight_transfer import TRANSFER_BACKENDS, register_engine_backend

    if c.weights_transport not in TRANSFER_BACKENDS:
        return {}
    if c.weights_transport == "gloo":
        register_engine_backend()
    return {"weight_transfer_config": {"backend": c.weights_transport}}


def _executor_args(c: EngineConfig) -> dict[str, Any]:
    """Inside a Ray replica actor, tensor-parallel workers are this process's children on the GPUs Ray gave the
    actor (vLLM would otherwise place them on Ray itself, outside the actor's bundle). Not run on a GPU yet."""
    if c.tensor_parallel_size > 1 and os.environ.get("POLAR_LAB_IN_RAY_ACTOR"):
        return {"distributed_executor_backend": "mp"}
    return {}


def _sampling_params(spec: SamplingSpec, stream: bool = False):
    """vLLM's SamplingParams for `spec`: each field under the name its declaration gives (polar_lab.types.knob), and
    what only the engine builds (the grammar of `structure`, how outputs come back)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    structured = StructuredOutputsParams(structural_tag=spec.structure) if spec.structure is not None else None
    return SamplingParams(**spec.vllm_params(), output_kind=kind, structured_outputs=structured)


def _prompt_logprobs(output) -> list[float] | None:
    """log p of each prompt token after the first, from vLLM's per-position {token id: Logprob} (None at position 0)."""
    if not output.prompt_logprobs:
        return None
    ids = output.prompt_token_ids
    return [output.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]


def main(fd: int) -> int:
    sys.meta_path.insert(0, WithoutRay())
    return serve_connection(Connection(fd), exit_after=True)


class WithoutRay:
    """An import hook that makes Ray look absent in a local engine process. vLLM imports Ray whenever it is installed
    (vllm/v1/executor/ray_utils.py, to offer its Ray executor), and Ray's import pulls in jsonschema's format checkers,
    one of which compiles a grammar: ~1.1 s of every engine start (import of vLLM 10.0-10.2 s without, 11.1-11.3 s
    with; 2026-12-03). Such a process never uses Ray: vLLM picks Ray only inside an initialised Ray cluster, and a Ray
    replica's engine is served from its actor (`serve_connection`, engine/ray_replicas.py), not through `main`."""

    def find_spec(self, name: str, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"{name}: Ray is not used in a local engine process (engine/worker.py)")
        return None


def note_start(config: EngineConfig, info: dict[str, Any]) -> None:
    """Append one JSON line about this engine's start to the file named by POLAR_LAB_ENGINE_LOG, if set: the test
    suite counts its engine starts this way (tests/conftest.py, scripts/suite_report.py), whichever process made the
    engine (a test, a notebook kernel, `polar-lab train`). PYTEST_CURRENT_TEST, inherited, names the test."""
    path = os.environ.get("POLAR_LAB_ENGINE_LOG")
    if not path:
        return
    line = {"model": config.model, "pid": os.getpid(), "test": os.environ.get("PYTEST_CURRENT_TEST"),
            "at": time.time(), "process_s": round(_process_age(), 3), "build_s": round(info["startup_seconds"], 3),
            "forked": info["forked"]}
    with open(path, "a") as fh:  # one short write per line: lines from concurrent engines do not interleave
        fh.write(json.dumps(line) + "\n")


def _process_age() -> float:
    """Seconds since this process started (from /proc), 0.0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def serve_connection(conn: Connection, *, forked: bool = False, exit_after: bool = False) -> int:
    """Serve one parent over `conn` until it says "stop" or hangs up; 0 = a clean end, 1 = vLLM failed.
    A local engine process calls it from `main` (or, forked, from engine/forkserver.py) with `exit_after`: the process
    then ends here (`exit_now`); a Ray replica actor calls it from a thread (engine/ray_replicas.py) and lives on."""
    try:
        kind, config = conn.recv()
    except EOFError:
        return 0
    assert kind == "start", kind
    worker = Worker(conn, config)
    code = 0
    try:
        info = {**worker.build(), "forked": forked}
        note_start(config, info)
        conn.send(("ready", info))
        worker.serve()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent went away: nobody is left to serve
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then the process ends
        log.exception("vLLM engine loop died")
        try:
            worker.send(("fatal", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        code = 1
    if exit_after:  # end the process while `worker` still holds vLLM, whose shutdown would run as this returns
        exit_now(code)  # (it frees the KV cache and collects the whole heap, a forkserver's shared pages included)
    return code


def exit_now(code: int) -> None:
    """End this engine process without vLLM's shutdown and the interpreter's teardown of torch and vLLM: nothing is
    left to write, the OS frees the memory, and the engine leaves no files behind. Its cost, measured: 2-3 s per
    Lab.close() for a fresh process; ~0.9 s of CPU for a forked one (py-spy over `make test`, 2026-12-05)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    exit_now(main(int(sys.argv[1])))  # main ends the process itself, but for a failure before serving
