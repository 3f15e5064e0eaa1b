"""The engine supervisor: owns a Lab's live engine and every change to it — weight loads, restarts, healing.

One lock serialises those changes; the thread that holds it may pause the proxy (the `Gate` the Lab passes
in), so new calls wait instead of reaching an engine that is being replaced. When the engine process dies
unasked (a vLLM bug, out of memory, a SIGKILL) its reader thread calls `_exited`, and a "polar-lab-heal"
thread replaces it by itself:

    serving ──process dies──▶ (calls in flight: 503) ──heal──▶ proxy paused ──▶ new process ──▶ weights
       ▲                                                                                       │
       └──────────────────────────── proxy resumed ◀── same policy version ◀───────────────────┘

The new engine gets the weights the dead one served: the model folder at version 0, or the file the last
load left in `weights_dir` (shared memory: the kernel holds no second copy), at that load's version. A weight
load the death interrupted is retried on the new engine, so a trainer syncing at that moment carries on.
Restarts are bounded (`EngineConfig.max_restarts`, over the Lab's life); each is logged with its reason and
kept in `restarts`, which `/health` and the dashboard show. A Lab given a ready-made engine (a fake in unit
tests) has no `factory` and never restarts it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from polar_lab.errors import EngineError, LabError

log = logging.getLogger(__name__)


class Gate(Protocol):
    """The proxy's pause gate, seen from a thread that is not the proxy's loop (the Lab adapts PauseState)."""

    def pause(self, drain_timeout: float) -> int:
        """Stop admitting calls and wait up to `drain_timeout` for those in flight; returns how many remain."""

    def resume(self) -> None:
        ...

    @property
    def paused(self) -> bool:
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
    def __init__(self, engine, *, gate: Gate, factory: Callable[[], Any] | None = None,
                 max_restarts: int = 3, on_swap: Callable[[Any], None] | None = None):
        """engine: the running engine. factory: builds a launched (not yet ready) engine whose `on_exit` is
        `self.exited`; None = this engine cannot be replaced. on_swap(new): tell the proxy about a new engine."""
        self.engine = engine
        self.gate = gate
        self.factory = factory
        self.max_restarts = max_restarts
        self.on_swap = on_swap
        self.lock = threading.RLock()  # held for every change to the live engine
        self.restarts: list[Restart] = []
        self.healing = False
        self.busy_before = 0.0  # busy seconds of the engines replaced so far
        self.closed = False
        if factory is not None:
            engine.on_exit = self.exited
            if not engine.alive:  # it died before anyone was listening
                self.exited(engine, engine.failure)

    # ---- weight changes ----------------------------------------------------------------------
    def load(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        """Load weights into the live engine (no pause); if it dies meanwhile, replace it and load again."""
        with self.lock:
            return self._load_or_heal(state_dict)

    def sync(self, state_dict: Mapping[str, torch.Tensor], drain_timeout: float) -> dict[str, Any]:
        """Pause the proxy, drain, load, resume. Returns policy_version, undrained, drain_s, load_s, sync_s."""
        with self.lock:
            t0 = time.perf_counter()
            with self._paused(drain_timeout) as undrained:
                t1 = time.perf_counter()
                version = self._load_or_heal(state_dict)
            t2 = time.perf_counter()
        return {"policy_version": version, "undrained": undrained, "drain_s": t1 - t0, "load_s": t2 - t1,
                "sync_s": t2 - t0}

    def _load_or_heal(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        try:
            return self.engine.load_weights(state_dict)
        except EngineError:
            if getattr(self.engine, "alive", True) or not self._may_restart():
                raise
        log.warning("the engine died during a weight load; restarting it and loading again")
        with self._paused(drain_timeout=30.0):
            self._replace(f"died during a weight load ({self.engine.failure})", automatic=True)
        return self.engine.load_weights(state_dict)

    # ---- restarts ----------------------------------------------------------------------------
    def restart(self, state_dict: Mapping[str, torch.Tensor] | None = None, *, version: int | None = None,
                drain_timeout: float = 30.0, startup_timeout: float = 900.0) -> dict[str, Any]:
        """Replace the engine process now (see `Lab.restart_engine`). Returns policy_version, startup_s."""
        if version is not None and state_dict is None:
            raise LabError(f"version={version} names the weights passed in; pass them as state_dict")
        if self.factory is None:
            raise LabError("this Lab was given its engine (engine=...); it cannot start another")
        with self.lock:
            old = self.engine
            if state_dict is None and old.policy_version and getattr(old, "weights_file", None) is None:
                raise LabError(f"the engine was serving policy version {old.policy_version} and its weights were "
                               f"not kept (keep_weights=False); restarting from the weights on disk would roll it "
                               f"back to 0 — pass the current weights, e.g. "
                               f"lab.restart_engine(trainer.policy.state_dict())")
            t0 = time.perf_counter()
            with self._paused(drain_timeout):
                self._replace("requested", automatic=False, state_dict=state_dict, version=version,
                              startup_timeout=startup_timeout)
        return {"policy_version": self.engine.policy_version, "startup_s": time.perf_counter() - t0}

    def exited(self, engine, reason: str) -> None:
        """The engine's `on_exit`, called from its reader thread: heal in a thread of our own."""
        if self.closed or engine is not self.engine:
            return
        self.healing = True  # before the thread starts: /health says "restarting" from this moment
        threading.Thread(target=self._heal, args=(engine, reason), name="polar-lab-heal", daemon=True).start()

    def _heal(self, dead, reason: str) -> None:
        try:
            with self.lock:
                if self.closed or dead is not self.engine:
                    return  # closed meanwhile, or a weight load already replaced it
                if not self._may_restart():
                    log.error("the engine died (%s) and will not be restarted: %d restarts were allowed (max_restarts)",
                              reason, self.max_restarts)
                    return
                log.warning("the engine died (%s); restarting it", reason)
                with self._paused(drain_timeout=30.0):
                    self._replace(reason, automatic=True)
        except Exception:  # noqa: BLE001 - a thread of our own: log, the Lab keeps answering 503s
            if not self.closed:
                log.exception("restarting the engine failed; the Lab answers 503 until lab.restart_engine()")
        finally:
            self.healing = False

    def _replace(self, reason: str, *, automatic: bool, state_dict: Mapping[str, torch.Tensor] | None = None,
                 version: int | None = None, startup_timeout: float = 900.0) -> None:
        """Close the old engine, start new ones until one serves the old one's weights (bounded attempts)."""
        old = self.engine
        weights_file = getattr(old, "weights_file", None) if state_dict is None else None
        version = old.policy_version if version is None else version
        old.close()  # fails what is still in flight (503), ends the old process by its pid
        while True:
            t0 = time.perf_counter()
            record = Restart(reason=reason, automatic=automatic, policy_version=version)
            try:
                new = self._ready(state_dict, weights_file, version, startup_timeout)
            except Exception as exc:
                record.ok, record.error = False, f"{type(exc).__name__}: {exc}"[:2000]
                self.restarts.append(record)
                if not automatic or self.closed or not self._may_restart():
                    raise
                log.warning("engine restart failed (%s); trying again", record.error.splitlines()[0])
                time.sleep(min(2.0 ** sum(not r.ok for r in self.restarts), 30.0))
                continue
            record.startup_s = time.perf_counter() - t0
            self.restarts.append(record)
            self.busy_before += float(getattr(old, "busy_seconds", 0.0))
            self.engine = new
            if weights_file is None and getattr(old, "weights_file", None) is not None:
                old.weights_file.unlink(missing_ok=True)  # superseded by the weights passed in
            if self.on_swap is not None:
                self.on_swap(new)
            log.warning("engine restarted in %.1f s (pid %s, policy version %d; reason: %s)", record.startup_s,
                        getattr(new, "pid", None), new.policy_version, reason)
            return

    def _ready(self, state_dict, weights_file, version: int, timeout: float):
        """A new engine, started and serving `state_dict` (or `weights_file`) as `version`; closed again on
        failure, or when the Lab closed while it started (nothing would close it later)."""
        new = self.factory()
        try:
            new.wait_ready(timeout)
            if state_dict is not None:
                new.load_weights(state_dict, version=version)
            elif weights_file is not None:
                new.load_weights_file(weights_file, version=version)
            if self.closed:
                raise LabError("the Lab closed while its engine restarted")
        except BaseException:
            new.close()
            raise
        return new

    def _may_restart(self) -> bool:
        return self.factory is not None and not self.closed and \
            sum(r.automatic for r in self.restarts) < self.max_restarts

    @contextlib.contextmanager
    def _paused(self, drain_timeout: float) -> Iterator[int]:
        """Pause the proxy unless this thread's caller already did (the lock makes that the same holder)."""
        if self.gate.paused:
            yield 0
            return
        undrained = self.gate.pause(drain_timeout)
        try:
            yield undrained
        finally:
            if not self.closed:
                self.gate.resume()

    # ---- status ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """For /health and the dashboard: serving | restarting | down, and the restarts so far."""
        alive = getattr(self.engine, "alive", True)
        state = "serving" if alive else "restarting" if self.healing else "down"
        last = self.restarts[-1] if self.restarts else None
        return {"engine": state, "engine_restarts": sum(r.ok for r in self.restarts),
                "last_restart": None if last is None else {"reason": last.reason, "ok": last.ok, "at": last.at,
                                                           "automatic": last.automatic}}

    @property
    def busy_seconds(self) -> float:
        return self.busy_before + float(getattr(self.engine, "busy_seconds", 0.0))

    def quiesce(self) -> None:
        """Start no more changes, and wait for one in progress (a load, a restart) to finish."""
        self.closed = True
        with self.lock:
            pass

    def close(self) -> None:
        """Close the live engine (after `quiesce`, once nothing may call it any more)."""
        self.quiesce()
        self.engine.close()
