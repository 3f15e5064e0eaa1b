"""vLLM owned by the kernel: `VLLMEngine` starts one engine process, talks to it over a socket, stops it.

The process (engine/worker.py) is the only code that touches vLLM; this object is its handle in the kernel, and
engine/process.py holds the process and its socket: how it starts, is reached and stops. `submit` from any thread
sends the prompt ids and returns a `concurrent.futures.Future`; the `generate` coroutine does the same for an
asyncio caller, and with `on_delta` streams: the callback gets each step's new tokens (`TokenDelta`) on the caller's
loop, all of them before `generate` returns. One reader thread ("polar-lab-engine") receives each step's deltas and
finished generations and hands them over: thread futures at once, and each event loop's share in one callback per
step (a cross-thread wake-up per request cost the loop more than the request).
Weights travel as a safetensors file in /dev/shm (engine/weights.py) that the worker maps and loads between two
steps; given a `weights_dir`, the file of the weights being served is kept there (`weights_file`, one at a time) so
that a replacement engine can load them again without the kernel holding a copy.
If the process dies, every waiting caller gets `EngineError` (the proxy turns that into a 503), later
submits fail at once, and `on_exit` is called (from the reader thread); this object never restarts itself —
its owner does (engine/supervisor.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from polar_lab.config import EngineConfig
from polar_lab.engine.base import OneProcess, Rejection
from polar_lab.engine.pending import Pending, settle
from polar_lab.engine.process import EngineProcess, LocalProcess
from polar_lab.engine.weight_calls import WeightCalls
from polar_lab.errors import EngineError, RequestError
from polar_lab.types import Generation, SamplingSpec, TokenDelta

log = logging.getLogger(__name__)

class VLLMEngine(WeightCalls, OneProcess):
    """The real engine. Context manager; `close()` stops the process (by its pid) and frees the model."""

    def __init__(self, config: EngineConfig, *, log_path: str | Path | None = None,
                 weights_dir: str | Path | None = None,
                 on_exit: Callable[[VLLMEngine, str], None] | None = None):
        """log_path: the worker's stdout/stderr (vLLM's logs). weights_dir: keep the served weights' file there
        (the owner removes the folder). on_exit(engine, reason): called once if the process dies unasked."""
        self.config = config
        self.model_path = config.model
        self.model_name = config.name
        self.max_model_len = 0
        self.log_path = Path(log_path) if log_path else None  # the worker's stdout/stderr (vLLM's logs)
        self.startup_seconds = 0.0
        self.forked = False
        self.start_info: dict = {}
        self.busy_seconds = 0.0  # wall time the worker spent inside vLLM steps (busy fraction = Δbusy / Δwall)
        self.steps = 0  # vLLM steps so far (tokens per step = batching)
        self.running = 0  # requests the engine process is working on, as it last reported
        self._version = 0
        self.process: EngineProcess | None = None  # once launched; kept after close (its pid, its exit code)
        self._pending = Pending()  # the requests it is working on (engine/pending.py)
        self._weights = self._staged = None  # the futures of a weight load, of a preload (concurrent.futures)
        self.standby = False  # the engine keeps a standby copy of the model (engine/standby.py)
        self.standby_how: str | None = None  # how its last preload loaded: "direct" or "layerwise (why not)"
        self._weights_lock = threading.Lock()  # one weight load at a time
        self._failure: str | None = None
        self._reader: threading.Thread | None = None
        self._closing = False
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.weights_file: Path | None = None  # the served weights, if they came from a load (not the model folder)
        self.weights_dtype: torch.dtype | None = None  # its model's dtype, once it is ready
        self.on_exit = on_exit

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 900.0) -> VLLMEngine:
        """Start the engine process and wait until it serves (`launch` + `wait_ready`)."""
        return self.launch().wait_ready(timeout)

    def launch(self) -> VLLMEngine:
        """Start the engine process and return at once (the caller can load its tokenizer meanwhile); a server
        still importing answers once its imports are done."""
        if self.process is None:
            self._t_launch = time.perf_counter()
            self.process = self._open_process()
        return self

    def _open_process(self) -> EngineProcess:
        """The process this engine talks to (engine/process.py): a local one here, a Ray actor for RayEngine."""
        return LocalProcess(self.config, self.log_path)

    def wait_ready(self, timeout: float = 900.0) -> VLLMEngine:
        """Wait for the launched process to report ready; a start-up failure raises with its log's end."""
        if self._reader is not None:
            return self
        try:
            info = self.process.wait_ready(timeout)
        except BaseException:
            self.close()
            raise
        self.max_model_len = info["max_model_len"]
        self.standby = bool(info.get("standby"))
        self.weights_dtype = getattr(torch, info["dtype"]) if info.get("dtype") else None
        self.forked = bool(info.get("forked"))  # forked from the forkserver, not started fresh (engine/forkserver.py)
        self.start_info = info  # the worker's own figures: llm_s, standby_s, imported_at_s (benchmarks/lab_startup.py);
        # step_threads: a CPU engine's thread policy as the step loop applies it (engine/step_threads.py)
        self.startup_seconds = time.perf_counter() - self._t_launch
        self._reader = threading.Thread(target=self._read, name="polar-lab-engine", daemon=True)
        self._reader.start()
        return self

    def close(self) -> None:
        """Stop the worker: ask, wait, then kill our own pid if it does not go. Safe to call twice."""
        if self.process is None or self._closing:
            return
        self._closing = True
        self._failure = self._failure or "engine closed"
        self.process.stop(serving=self._reader is not None)
        if self._reader is not None:
            self._reader.join(timeout=10)
        self.process.close()
        self._fail_all(EngineError("engine closed"))

    def __enter__(self) -> VLLMEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        """The engine process's pid (known once it is started; kept after it stops)."""
        return self.process.pid if self.process is not None else None

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def alive(self) -> bool:
        return self.process is not None and self._failure is None

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving (None while it serves)."""
        return self._failure

    # ---- public calls (any thread) ---------------------------------------------------------
    def submit(self, prompt_ids: list[int], spec: SamplingSpec, *,
               route: str | None = None) -> concurrent.futures.Future[Generation]:
        fut: concurrent.futures.Future[Generation] = concurrent.futures.Future()
        rid = self._add(fut, prompt_ids, spec)
        fut.add_done_callback(lambda f: f.cancelled() and self._abort(rid))
        return fut

    async def generate(self, prompt_ids: list[int], spec: SamplingSpec,
                       on_delta: Callable[[TokenDelta], None] | None = None, *,
                       route: str | None = None) -> Generation:
        """`submit` for a caller on an event loop; cancelling the awaiting task aborts the request.
        on_delta: streams — called on this loop with each engine step's new tokens, every one of them before
        the Generation is returned."""
        fut = asyncio.get_running_loop().create_future()
        rid = self._add(fut, prompt_ids, spec, on_delta)
        try:
            return await fut
        except asyncio.CancelledError:
            self._abort(rid)
            raise

    def _add(self, fut, prompt_ids: list[int], spec: SamplingSpec, on_delta: Callable | None = None) -> str:
        """Register `fut` and send the request; a dead engine fails `fut` at once."""
        rid = self._pending.add(fut, on_delta)
        error = None
        if not self.alive:
            error = EngineError(f"engine is not running ({self._failure})")
        else:
            try:
                self.process.send(("add", rid, list(prompt_ids), spec, on_delta is not None))
            except OSError as exc:
                error = EngineError(f"engine is not running ({exc!r})")
        if error is not None:
            self._pending.discard(rid)
            settle(fut, error)
        return rid

    # ---- the reader thread -----------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                msg = self.process.conn.recv()
                if msg[0] == "delta":
                    self.busy_seconds, self.steps, self.running = msg[2]
                    self._pending.deliver(msg[1])
                elif msg[0] == "done":
                    self.busy_seconds, self.steps, self.running = msg[2]
                    self._pending.resolve([(rid, _outcome(r)) for rid, r in msg[1]])
                elif msg[0] == "running":
                    self.running = msg[1]
                elif msg[0] == "weights":
                    self._weights.set_result(msg[1])
                elif msg[0] == "staged":
                    self.standby_how = msg[3] if len(msg) > 3 else None
                    self._staged.set_result(msg[2])
                elif msg[0] == "fatal":
                    self._failure = f"engine failed: {msg[1]}"
        except (EOFError, OSError):
            pass  # the worker exited (stopped, crashed or killed)
        if self._failure is None:
            code = self.process.exit_code()
            self._failure = f"the engine process exited (code {code})"
        self._fail_all(EngineError(f"engine failed: {self._failure}"))
        if not self._closing:
            log.error("%s; see %s", self._failure, self.log_path)
            if self.on_exit is not None:
                self.on_exit(self, self._failure)

    def _abort(self, rid: str) -> None:
        if self._pending.discard(rid):
            try:
                self.process.send(("abort", rid))
            except OSError:
                pass

    def abandon(self, reason: str) -> None:
        """End this engine now, e.g. its weights are no longer one version's: its owner restarts it (supervisor)."""
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        """Give up on a live engine: kill our own process; the reader thread then fails what waits."""
        self._failure = self._failure or reason
        self.process.kill()

    def _fail_all(self, exc: EngineError) -> None:
        self._pending.fail(exc)
        for waiting in (self._weights, self._staged):  # a load or a preload waiting on the dead engine
            if waiting is not None and not waiting.done():
                waiting.set_result(str(exc))


def _outcome(result: Generation | Rejection | str) -> Generation | Exception:
    """A worker's answer for one request: a generation, that request's own 400, or the engine's failure."""
    if isinstance(result, Generation):
        return result
    if isinstance(result, Rejection):
        return RequestError(f"the engine rejected the request: {result.message}", param=result.param)
    return EngineError(result)
