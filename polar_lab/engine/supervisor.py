"""The engine supervisor: owns a Lab's live engine and every change to it — weight loads, restarts, healing.

One lock serialises those changes; the thread that holds it may pause the proxy (the `Gate` the Lab passes
in), so new calls wait instead of reaching an engine that is being replaced. When the engine process dies
unasked (a vLLM bug, out of memory, a SIGKILL) its reader thread calls `exited`, and a "polar-lab-heal"
thread replaces it by itself:

    serving ──process dies──▶ (calls in flight: 503) ──heal──▶ proxy paused ──▶ new process ──▶ weights
       ▲                                                                                       │
       └──────────────────────────── proxy resumed ◀── same policy version ◀───────────────────┘

The new engine gets the weights the dead one served: the model folder at version 0, or the file the last
load left in `weights_dir` (shared memory, outside the kernel's heap), at that load's version. A death
during a weight load is healed with the weights being loaded, at the next version, so a trainer syncing at
that moment carries on. Calls that arrive while a replacement is coming wait for it (`status()` says
"restarting" from the moment of death); calls in flight get a 503 — a request that killed the engine is not
re-sent by the proxy. Restarts are bounded (`EngineConfig.max_restarts`, automatic ones over the Lab's life);
each is logged with its reason and kept in `restarts`. An engine past version 0 whose weights were not kept
(`keep_weights=False`) is not healed: that would silently roll training back. A Lab given a ready-made engine
(a fake in unit tests) has no `factory` and never restarts it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from polar_lab.engine.base import Engine
from polar_lab.engine.launch import WeightsFolder
from polar_lab.engine.weight_transfer import WeightTransfer
from polar_lab.engine.weights import is_slot, remove_weights, weights_size, write_weights
from polar_lab.errors import EngineError, LabError
from polar_lab.types import SyncResult

# a state dict, a safetensors file (engine/weights.py), or a policy's weights through vLLM's transfer API
Weights = Mapping[str, torch.Tensor] | str | Path | WeightTransfer

log = logging.getLogger(__name__)


class Gate(Protocol):
    """The proxy's pause gate, seen from a thread that is not the proxy's loop (the Lab adapts PauseState)."""

    def pause(self, drain_timeout: float) -> int:
        """Stop admitting calls and wait up to `drain_timeout` for those in flight; returns how many remain."""

    def resume(self) -> None:
        ...


@dataclass
class Restart:
    """One replacement of the engine process."""

    reason: str
    automatic: bool
    policy_version: int  # what the new engine serves
    at: float = field(default_factory=time.time)
    startup_s: float = 0.0
    ok: bool = True
    error: str | None = None


class EngineSupervisor:
    def __init__(self, engine: Engine, *, gate: Gate, factory: Callable[[], Engine] | None = None,
                 max_restarts: int = 3, on_swap: Callable[[Engine], None] | None = None, owns_engine: bool = True):
        """engine: the running engine. factory: builds a launched (not yet ready) engine; None = this engine
        cannot be replaced. on_swap(new): tell the proxy about a new engine. owns_engine: False for an engine that
        belongs to someone else (shared by several Labs): `close` leaves it running."""
        self.engine = engine
        self.owns_engine = owns_engine
        self.gate = gate
        self.factory = factory
        self.max_restarts = max_restarts
        self.on_swap = on_swap
        self.lock = threading.RLock()  # held for every change to the live engine
        self.restarts: list[Restart] = []
        self.replacing = False  # a replacement is under way (automatic or asked for)
        self.busy_before = 0.0  # busy seconds of the engines replaced so far
        self.closed = False
        self._stopping = threading.Event()  # set by quiesce(): backoffs end, engines being started are closed
        self._starting: Engine | None = None
        self._healing: Engine | None = None  # the dead engine a heal thread was started for
        self._heal_pending = False  # a heal thread is running or about to
        self._given_up: Engine | None = None  # a dead engine whose replacement failed: down until asked
        self._pause_depth = 0  # pauses held by the lock's holder (nested: a heal inside a sync)
        if factory is not None:
            self._watch(engine)

    # ---- weight changes ----------------------------------------------------------------------
    def load(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        """Load weights into the live engine (no pause); if it dies meanwhile, replace it with them loaded."""
        with self.lock:
            return self._load_or_heal(state_dict)

    def sync(self, weights: Weights, drain_timeout: float, pause: str = "drain") -> SyncResult:
        """Preload a file into the standby while the engine serves; pause the proxy and drain ("keep": the engine
        holds its requests between two steps instead), load `weights` (a swap, when preloaded), resume."""
        with self.lock:
            t0 = time.perf_counter()
            why = self.engine.preload_weights_file(weights) if isinstance(weights, (str, Path)) else "not a file"
            t1 = time.perf_counter()
            held = contextlib.nullcontext(self.engine.running) if pause == "keep" else self._paused(drain_timeout)
            with held as undrained:
                t2 = time.perf_counter()
                version = self._load_or_heal(weights)
            t3 = time.perf_counter()
        if why is not None:
            log.debug("the weights load in place: %s", why)
        return SyncResult(policy_version=version, undrained=undrained, drain_s=t2 - t1, load_s=t3 - t2,
                          sync_s=t3 - t1, preload_s=t1 - t0, swapped=why is None)

    def _load_or_heal(self, state_dict: Weights) -> int:
        try:
            return load_into(self.engine, state_dict)
        except EngineError:
            if self.engine.alive or not self._budget_left() or isinstance(state_dict, WeightTransfer):
                raise  # a transfer reaches only its own engine: the heal (`exited`) restarts at what it served
        version = self.engine.policy_version + 1
        log.warning("the engine died during a weight load; starting a new one with those weights")
        with self._paused(drain_timeout=30.0):
            self._replace(f"died during a weight load ({self.engine.failure})", automatic=True,
                          state_dict=state_dict, version=version)
        return self.engine.policy_version

    # ---- restarts ----------------------------------------------------------------------------
    def restart(self, state_dict: Mapping[str, torch.Tensor] | None = None, *, version: int | None = None,
                drain_timeout: float = 30.0, startup_timeout: float = 900.0) -> Restart:
        """Replace the engine process now (see `Lab.restart_engine`); returns the restart's record."""
        if version is not None and state_dict is None:
            raise LabError(f"version={version} names the weights passed in; pass them as state_dict")
        if self.factory is None:
            raise LabError("this Lab was given its engine (engine=...); it cannot start another")
        with self.lock:
            old = self.engine
            if state_dict is None and not _recoverable(old):
                raise LabError(f"the engine was serving policy version {old.policy_version} and its weights were "
                               f"not kept (keep_weights=False); restarting from the weights on disk would roll it "
                               f"back to 0 — pass the current weights, e.g. "
                               f"lab.restart_engine(trainer.policy.state_dict())")
            with self._paused(drain_timeout):
                self._replace("requested", automatic=False, state_dict=state_dict, version=version,
                              startup_timeout=startup_timeout)
            return self.restarts[-1]

    def exited(self, engine: Engine, reason: str) -> None:
        """The engine's `on_exit`, called from its reader thread: heal in a thread of our own (once per death)."""
        if self.closed or engine is not self.engine or self._healing is engine:
            return
        self._healing = engine
        self._heal_pending = True  # before the thread starts: status() says "restarting" from now on
        threading.Thread(target=self._heal, args=(engine, reason), name="polar-lab-heal", daemon=True).start()

    def _heal(self, dead: Engine, reason: str) -> None:
        try:
            with self.lock:
                if self.closed or dead is not self.engine:
                    return  # closed meanwhile, or a weight load already replaced it
                why_not = self._why_not_heal(dead)
                if why_not:
                    log.error("the engine died (%s) and will not be restarted: %s; the Lab answers 503 until "
                              "lab.restart_engine()", reason, why_not)
                    return
                log.warning("the engine died (%s); restarting it", reason)
                with self._paused(drain_timeout=30.0):
                    self._replace(reason, automatic=True)
        except Exception:  # noqa: BLE001 - a thread of our own: log, the Lab keeps answering 503s
            if not self.closed:
                log.exception("restarting the engine failed; the Lab answers 503 until lab.restart_engine()")
        finally:
            self._heal_pending = False

    def _replace(self, reason: str, *, automatic: bool, state_dict: Mapping[str, torch.Tensor] | None = None,
                 version: int | None = None, startup_timeout: float = 900.0) -> None:
        """Close the old engine, start new ones until one serves the old one's weights (bounded attempts)."""
        old = self.engine
        weights_file = old.weights_file if state_dict is None else None
        version = old.policy_version if version is None else version
        self.replacing = True
        try:
            old.close()  # fails what is still in flight (503), ends the old process by its pid
            while True:
                t0 = time.perf_counter()
                record = Restart(reason=reason, automatic=automatic, policy_version=version)
                try:
                    new = self._ready(state_dict, weights_file, version, startup_timeout)
                    break
                except BaseException as exc:
                    record.ok, record.error = False, f"{type(exc).__name__}: {exc}"[:2000]
                    self.restarts.append(record)
                    if not isinstance(exc, Exception) or not automatic or self.closed or not self._budget_left():
                        self._given_up = old  # down (503s) until lab.restart_engine()
                        raise
                    log.warning("engine restart failed (%s); trying again", record.error.splitlines()[0])
                    self._stopping.wait(min(2.0 ** sum(not r.ok for r in self.restarts), 30.0))
            record.startup_s = time.perf_counter() - t0
            self.restarts.append(record)
            self._swap(old, new, superseded=weights_file is None)
            log.warning("engine restarted in %.1f s (pid %s, policy version %d; reason: %s)", record.startup_s,
                        new.pid, new.policy_version, reason)
        finally:
            self.replacing = False
        if not new.alive:  # it died before it was the live engine, so its exit was not heard: heal it now
            self.exited(new, new.failure or "died while starting")

    def _ready(self, state_dict, weights_file, version: int, timeout: float) -> Engine:
        """A new engine, started and serving `state_dict` (or `weights_file`) as `version`; closed again on
        failure, or when the Lab closed while it started (nothing would close it later)."""
        if self.closed:
            raise LabError("the Lab closed while its engine restarted")
        new = self.factory()
        self._starting = new  # quiesce() closes it, so a closing Lab does not wait out a start-up
        try:
            if self._stopping.is_set():  # quiesce() ran between the check above and `_starting`
                raise LabError("the Lab closed while its engine restarted")
            new.on_exit = self.exited
            new.wait_ready(timeout)
            if state_dict is not None:
                load_into(new, state_dict, version=version)
            elif weights_file is not None:
                new.load_weights_file(weights_file, version=version)
            if self.closed:
                raise LabError("the Lab closed while its engine restarted")
            if new.policy_version != version:
                raise EngineError(f"the new engine serves policy version {new.policy_version}, not {version}")
        except BaseException:
            new.close()
            raise
        finally:
            self._starting = None
        return new

    def _swap(self, old: Engine, new: Engine, *, superseded: bool) -> None:
        self.busy_before += old.busy_seconds
        self.engine = new
        if superseded and old.weights_file not in (None, new.weights_file) and not is_slot(old.weights_file):
            remove_weights(old.weights_file)  # replaced by the weights passed in
        if self.on_swap is not None:
            self.on_swap(new)

    def _watch(self, engine: Engine) -> None:
        engine.on_exit = self.exited
        if not engine.alive:  # it died before anyone was listening
            self.exited(engine, engine.failure or "died before it was watched")

    def _budget_left(self) -> bool:
        return self.factory is not None and not self.closed and \
            sum(r.automatic for r in self.restarts) < self.max_restarts

    def _why_not_heal(self, engine: Engine) -> str | None:
        if self.factory is None:
            return "this Lab was given its engine"
        if not self._budget_left():
            return f"the {self.max_restarts} automatic restarts allowed (max_restarts) are spent"
        if not _recoverable(engine):
            return f"it served policy version {engine.policy_version} and its weights were not kept (keep_weights=False)"
        return None

    @contextlib.contextmanager
    def _paused(self, drain_timeout: float) -> Iterator[int]:
        """Pause the proxy, unless the lock's holder already did (a heal nested in a sync); always resume."""
        if self._pause_depth:
            self._pause_depth += 1
            try:
                yield 0
            finally:
                self._pause_depth -= 1
            return
        undrained = self.gate.pause(drain_timeout)
        self._pause_depth = 1
        try:
            yield undrained
        finally:
            self._pause_depth = 0
            self.gate.resume()  # also when closing: calls waiting at the gate get their answer (a 503)

    # ---- status ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """For /health and the dashboard: serving | restarting (a replacement is coming) | down, and the
        restarts so far."""
        engine = self.engine
        unseen = self._healing is not engine and self._given_up is not engine  # its death not handled yet
        if engine.alive:
            state = "serving"
        elif self.replacing or self._heal_pending or (unseen and not self._why_not_heal(engine)):
            state = "restarting"
        else:
            state = "down"
        last = self.restarts[-1] if self.restarts else None
        return {"engine": state, "engine_restarts": sum(r.ok for r in self.restarts),
                "last_restart": None if last is None else {"reason": last.reason, "ok": last.ok, "at": last.at,
                                                           "automatic": last.automatic}}

    @property
    def busy_seconds(self) -> float:
        return self.busy_before + self.engine.busy_seconds

    def quiesce(self) -> None:
        """Start no more changes, end a start-up or backoff in progress, and wait for the change holding the
        lock (a load, a restart) to finish."""
        self.closed = True
        self._stopping.set()
        starting = self._starting
        if starting is not None:
            starting.close()  # its wait_ready fails at once
        with self.lock:
            pass

    def close(self) -> None:
        """Close the live engine if it is ours (after `quiesce`, once nothing may call it any more)."""
        self.quiesce()
        if self.owns_engine:
            self.engine.close()


def load_into(engine: Engine, weights: Weights, *, version: int | None = None) -> int:
    """`engine.load_weights` for a state dict, `engine.load_weights_file` for a file's path, a transfer's `send`
    (bound to the engine it was opened with: a replacement engine cannot take it, and is not healed with it)."""
    if isinstance(weights, (str, Path)):
        return engine.load_weights_file(weights, version=version)
    if isinstance(weights, WeightTransfer):
        if weights.engine is not engine:
            raise EngineError("weights sent through vLLM's transfer API reach only the engine the transfer was "
                              "opened with; sync a state dict or a file to a replacement engine")
        return weights.send(version)
    return engine.load_weights(weights, version=version)


def _recoverable(engine: Engine) -> bool:
    """A replacement can serve what this engine served: the model folder (version 0) or its kept weights."""
    return engine.policy_version == 0 or engine.weights_file is not None


def sync_weights(supervisor: EngineSupervisor, weights: Weights, folder: WeightsFolder,
                 drain_timeout: float, pause: str = "drain") -> SyncResult:
    """`supervisor.sync` of a state dict written first — before the pause — into a slot of `folder` (in the engine's
    dtype), or of a file (or a LoRA adapter's folder) already written. A path of the folder becomes the engine's kept
    copy, or is removed (a slot stays, for the next write). The result also says how many bytes moved, how long the
    write took and how they travelled."""
    if pause not in ("drain", "keep"):
        raise LabError(f"pause must be 'drain' or 'keep', got {pause!r}")
    if isinstance(weights, WeightTransfer):
        return dataclasses.replace(supervisor.sync(weights, drain_timeout, pause), path=weights.backend)
    if isinstance(weights, (str, Path)):
        path, write_s = Path(weights), 0.0
    else:
        t0 = time.perf_counter()
        path = folder.slot(supervisor.engine.weights_file)
        write_weights(path, weights, dtype=supervisor.engine.weights_dtype)
        write_s = time.perf_counter() - t0
    size = weights_size(path)
    kind = "shm-adapter" if path.is_dir() else "shared-memory" if is_slot(path) else "shm-file"
    try:
        result = supervisor.sync(path, drain_timeout, pause)
    finally:
        folder.taken(path, kept=supervisor.engine.weights_file == path)  # else removed (not kept, or load failed)
    return dataclasses.replace(result, bytes=size, write_s=write_s, path=supervisor.engine.weights_transport or kind)
