"""Several engines behind one: `ReplicaSet` routes each session to a replica, and keeps one policy version.

The proxy stays the single front door; it calls the set like any `Engine`, passing the session id as the
request's `route`. The set implements the whole protocol (engine/base.py), so the supervisor, the Lab and the
trainer see one engine whatever runs behind it: local engine processes (`VLLMEngine`, cluster="local") or Ray
actors (`RayEngine`, engine/ray_replicas.py).

Routing (`pick`, a dict lookup and a minimum over the replicas, on the proxy's loop):
    first call of a session  → the replica with the fewest requests in flight (as this set counts them),
                               then the fewest sessions (sessions that call one at a time still spread)
    later calls              → the same replica: its prefix cache holds the session's history
    that replica dead, out of rotation, or `queue_bound` requests in flight while another has fewer
                             → the least loaded one; the session moves there, and the call records
                               `moved_from` (its prefix is recomputed once: the cache is cold)
Every generation says which replica sampled it (`Generation.replica` → `ModelCall.replica`).

One policy version: `load_weights_file` loads the file into every replica in parallel (each at the same
version); a replica that fails to load is taken out of rotation and replaced — it never serves old weights
under the new version. Given `ship`, the file is wrapped once for all replicas (Ray: replicas on other nodes
fetch one copy from the object store) and passed to each replica's load as `shipped=`.

Faults: a replica that dies fails only its own requests in flight (the proxy answers them 503); the set
takes it out of rotation, its sessions move on their next call, and a "polar-lab-replica" thread brings a
replacement (`factory(slot)`: a new process, or the Ray actor Ray restarted) back at the current weights and
version, at most `max_restarts` times per slot. Only when no replica serves and none can come back does the set
report its own death (`on_exit`), and the Lab's supervisor replaces the whole set.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from polar_lab.engine.base import Engine
from polar_lab.engine.weights import is_slot, load_through_file, remove_weights_soon
from polar_lab.errors import EngineError
from polar_lab.types import Generation, SamplingSpec, TokenDelta

log = logging.getLogger(__name__)

MAX_ROUTES = 200_000  # sessions whose replica is remembered (least recently used forgotten: they re-pick)


@dataclass
class Move:
    """A session sent to another replica than its own."""

    route: str
    from_replica: int
    to_replica: int
    why: str  # "dead" | "out of rotation" | "queue over bound"
    at: float = field(default_factory=time.time)


@dataclass
class ReplicaRestart:
    """One replacement of one replica."""

    replica: int
    reason: str
    policy_version: int
    ok: bool = True
    error: str | None = None
    startup_s: float = 0.0
    at: float = field(default_factory=time.time)


class Router:
    """Which replica each request goes to (the module docstring's routing rules): a session sticks to its replica
    while that one is usable and under `queue_bound` requests in flight, else moves to the least loaded one."""

    def __init__(self, replicas: int, queue_bound: int):
        self.queue_bound = queue_bound
        self.inflight = [0] * replicas  # requests sent to each and not answered, as this set counts them
        self.sessions = [0] * replicas  # routes (sessions) that stick to each
        self.moves: deque[Move] = deque(maxlen=10_000)
        self.moved = 0  # moves so far (the deque keeps the latest)
        self._routes: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()  # pick from the loop, submit from any thread

    def pick(self, route: str | None, usable: Callable[[int], bool],
             why_out: Callable[[int], str]) -> tuple[int, int | None] | None:
        """(replica, the replica the session left or None), the request counted in flight; None when no replica
        is usable. why_out(slot): why a session's own replica was not picked."""
        with self._lock:
            own = self._routes.get(route) if route is not None else None
            if own is not None and usable(own) and self.inflight[own] < self.queue_bound:
                self._routes.move_to_end(route)
                self.inflight[own] += 1
                return own, None
            candidates = [slot for slot in range(len(self.inflight)) if usable(slot)]
            if not candidates:
                return None
            best = min(candidates, key=lambda slot: (self.inflight[slot], self.sessions[slot]))
            moved = None
            if own is not None and best != own:
                self.moves.append(Move(route, own, best, why_out(own)))
                self.moved += 1
                moved = own
            if route is not None:
                self._stick(route, own, best)
            self.inflight[best] += 1
            return best, moved

    def _stick(self, route: str, own: int | None, best: int) -> None:
        if own is not None:
            self.sessions[own] -= 1
        self._routes[route] = best
        self.sessions[best] += 1
        self._routes.move_to_end(route)
        if len(self._routes) > MAX_ROUTES:
            self.sessions[self._routes.popitem(last=False)[1]] -= 1

    def done(self, slot: int) -> None:
        with self._lock:
            self.inflight[slot] -= 1

    def forget(self, route: str) -> None:
        with self._lock:
            slot = self._routes.pop(route, None)
            if slot is not None:
                self.sessions[slot] -= 1


class Healer:
    """Brings dead replicas of a set back (the module docstring's "Faults"): each replacement in a thread of its own,
    at most `max_restarts` per slot, with a backoff; the set's death reported only when nothing serves and nothing
    can come back. Owns the restart history and the slots being replaced; reads and swaps the set's engines."""

    def __init__(self, replicas: ReplicaSet):
        self.set = replicas
        self.restarts: list[ReplicaRestart] = []
        self.healing: set[int] = set()  # slots a replacement thread owns
        self.starting: dict[int, Engine] = {}  # replacements being started
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # check and claim a slot at once

    def stop(self) -> None:
        """The set is closing: backoffs end, replacements still starting are closed (their wait_ready fails)."""
        self.stopping.set()
        for engine in list(self.starting.values()):
            engine.close()

    def exited_callback(self, slot: int) -> Callable[[Engine, str], None]:
        def exited(engine: Engine, reason: str) -> None:
            if not self.set.closed:
                log.warning("engine replica %d died (%s); its sessions move on their next call", slot, reason)
                self.replace(slot, reason, engine)
        return exited

    def replace(self, slot: int, reason: str, engine: Engine) -> None:
        """`engine` (the slot's engine) failed: take the slot out of rotation and bring a replacement in a thread
        of its own, or close it for good and report the set's death when nothing serves and nothing can come
        back. A stale report (the slot holds another engine by now) and a slot being replaced are left alone."""
        with self.lock:  # check and claim at once: two deaths heard together start one replacement
            if self.set.closed or self.set.engines[slot] is not engine or slot in self.healing:
                return
            self.set.serving[slot] = False
            replace = self._can_replace(slot)
            if replace:
                self.healing.add(slot)
        if replace:
            threading.Thread(target=self._heal, args=(slot, reason), name="polar-lab-replica", daemon=True).start()
            return
        # out for good: it would serve weights nobody asked for (closed from a thread of its own: this may be
        # the dying engine's reader thread, which its close() joins)
        threading.Thread(target=engine.close, name="polar-lab-replica", daemon=True).start()
        if not self.set.alive and not self.healing:
            self._set_died(reason)

    def _can_replace(self, slot: int) -> bool:
        used = sum(r.replica == slot for r in self.restarts)
        return (self.set.factory is not None and not self.set.closed and used < self.set.max_restarts
                and self.set.reloadable())

    def _heal(self, slot: int, reason: str) -> None:
        """The slot's replacement thread: attempts with a backoff while the budget lasts (the slot stays
        claimed throughout), then either the replacement serves or the slot is out for good."""
        ok = False
        try:
            while not self.set.closed:
                ok = self._attempt(slot, reason)
                if ok or not self._can_replace(slot):
                    break
                failures = sum(not r.ok and r.replica == slot for r in self.restarts)
                if self.stopping.wait(min(2.0 ** failures, 30.0)):
                    break
        finally:
            with self.lock:
                self.healing.discard(slot)
        if self.set.closed:
            return
        engine = self.set.engines[slot]
        if not ok and not self.set.alive and not self.healing:
            self._set_died(f"replica {slot} could not be brought back ({self.restarts[-1].error})")
        elif ok and not engine.alive:  # it died while joining, unheard: its exit came before its on_exit was set
            self.replace(slot, engine.failure or "died while joining", engine)

    def _attempt(self, slot: int, reason: str) -> bool:
        """One replacement: close the old engine, start a new one, load the served weights, swap it in."""
        old = self.set.engines[slot]
        record = ReplicaRestart(replica=slot, reason=reason, policy_version=self.set.policy_version)
        t0 = time.perf_counter()
        new = None
        try:
            old.close()  # fails what it still had in flight (503)
            new = self.set.factory(slot)
            self.starting[slot] = new  # close() closes it: a closing set does not wait out a start-up
            if self.set.closed:
                raise EngineError("the replica set closed while a replica restarted")
            new.wait_ready()
            with self.set.weights_lock:  # between two syncs: it joins at the version being served
                if self.set.closed:  # no swap after close() began (it looks for late swaps under this lock)
                    raise EngineError("the replica set closed while a replica restarted")
                if self.set.policy_version > 0:
                    if self.set.weights_file is not None:  # the kept file
                        new.load_weights_file(self.set.weights_file, version=self.set.policy_version)
                    elif getattr(self.set.shipped, "kept", False):  # the copy that outlives the file
                        new.load_weights_file(self.set.served, version=self.set.policy_version,
                                              shipped=self.set.shipped)
                    else:
                        raise EngineError(f"policy version {self.set.policy_version}'s weights were not kept")
                record.policy_version = self.set.policy_version
                record.startup_s = time.perf_counter() - t0
                self.restarts.append(record)  # before the swap: a serving slot's restart is on record
                self.set.busy_before += old.busy_seconds
                new.on_exit = self.exited_callback(slot)
                self.set.engines[slot] = new
                self.set.serving[slot] = new.alive
            log.warning("engine replica %d is back in %.1f s at policy version %d", slot, record.startup_s,
                        record.policy_version)
            return True
        except Exception as exc:  # noqa: BLE001 - a thread of our own: the replica stays out, the set goes on
            record.ok, record.error = False, f"{type(exc).__name__}: {exc}"[:2000]
            self.restarts.append(record)
            if new is not None and self.set.engines[slot] is not new:
                new.close()
            if not self.set.closed:
                log.error("engine replica %d could not be brought back: %s", slot, record.error)
            return False
        finally:
            self.starting.pop(slot, None)

    def _set_died(self, reason: str) -> None:
        if self.set.on_exit is not None and not self.set.closed:
            self.set.on_exit(self.set, f"every engine replica is down (last: {reason})")


class ReplicaSet:
    """N engines behind one `Engine`; see the module docstring."""

    def __init__(self, replicas: list[Engine], *, factory: Callable[[int], Engine] | None = None,
                 weights_dir: str | Path | None = None, max_restarts: int = 3, queue_bound: int = 256,
                 ship: Callable[[Path], Any] | None = None, on_close: Callable[[], None] | None = None):
        """replicas: launched engines (wait_ready waits for all). factory(slot): a launched replacement for a
        dead replica; None = dead replicas stay out. weights_dir: keep the served weights' file there (for
        replacements), as VLLMEngine does. ship(path): wraps a weights file for every replica (Ray: a Shipment,
        engine/ray_replicas.py), passed to each replica's load as `shipped=`; its `keep()` makes a copy that
        outlives the file, and `kept` says there is one (then a replacement can load it). on_close: called
        after the replicas are closed (the Ray set removes its actors and placement group)."""
        if not replicas:
            raise EngineError("a replica set needs at least one engine")
        self.engines: list[Engine] = list(replicas)
        self.factory = factory
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.max_restarts = max_restarts
        self.queue_bound = queue_bound
        self.ship = ship
        self.on_close = on_close
        self.model_name = replicas[0].model_name
        self.model_path = replicas[0].model_path
        self.max_model_len = 0
        self.pid: int | None = None  # several processes: see `replica_status()`
        self.weights_file: Path | None = None
        self.on_exit: Callable[[Engine, str], None] | None = None
        self.serving = [True] * len(replicas)  # in rotation
        self.router = Router(len(replicas), queue_bound)
        self.weights_lock = threading.RLock()  # one weight load at a time; a replacement joins between loads
        self._version = 0
        self.shipped: Any = None  # what `ship` made of the weights being served (for replacements)
        self.served: Path | None = None  # the file (or folder) those weights came from
        self.busy_before = 0.0  # busy seconds of replaced replicas
        self.closed = False
        self.healer = Healer(self)  # dead replicas brought back
        for slot, engine in enumerate(replicas):
            engine.on_exit = self.healer.exited_callback(slot)

    # ---- state --------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def alive(self) -> bool:
        return not self.closed and any(self._usable(slot) for slot in range(len(self.engines)))

    @property
    def failure(self) -> str | None:
        if self.alive:
            return None
        if self.closed:
            return "engine closed"
        why = "; ".join(f"replica {slot}: {e.failure or 'out of rotation'}" for slot, e in enumerate(self.engines))
        return f"no engine replica is serving ({why})"

    @property
    def busy_seconds(self) -> float:
        return self.busy_before + sum(e.busy_seconds for e in self.engines)

    @property
    def restarts(self) -> list[ReplicaRestart]:
        return self.healer.restarts

    @property
    def running(self) -> int:
        return sum(e.running for e in self.engines)

    def replica_status(self) -> list[dict[str, Any]]:
        """One row per replica: serving (in rotation and alive), its pid, requests in flight, sessions routed
        to it, busy seconds, restarts."""
        return [{"replica": slot, "serving": self._usable(slot), "pid": e.pid, "in_flight": self.router.inflight[slot],
                 "sessions": self.router.sessions[slot], "policy_version": e.policy_version, "busy_s": e.busy_seconds,
                 "restarts": sum(r.ok and r.replica == slot for r in self.restarts),
                 "failure": e.failure} for slot, e in enumerate(self.engines)]

    def replica_counts(self) -> dict[str, Any]:
        return {"replicas_serving": sum(self._usable(slot) for slot in range(len(self.engines))),
                "replicas": len(self.engines), "replica_moves": self.router.moved}

    @property
    def weights_dtype(self):  # one model: one dtype
        return self.engines[0].weights_dtype if self.engines else None

    @property
    def weights_transport(self) -> str | None:
        """How the last weights were shipped to the replicas (Ray: "shm" on this node, else "object-store")."""
        if self.ship is None or self.shipped is None:
            return None
        return "+".join(sorted(self.shipped.transports)) or None

    def _usable(self, slot: int) -> bool:
        return self.serving[slot] and self.engines[slot].alive

    # ---- routing (Router) ---------------------------------------------------------------------
    def pick(self, route: str | None) -> tuple[int, int | None]:
        """(replica for this request, the replica its session left or None); counts the request in flight."""
        picked = self.router.pick(route, self._usable, self._why_out)
        if picked is None:
            raise EngineError(f"engine is not running ({self.failure})")
        return picked

    def _why_out(self, slot: int) -> str:
        return ("queue over bound" if self._usable(slot) else
                "dead" if not self.engines[slot].alive else "out of rotation")

    def _done(self, slot: int) -> None:
        self.router.done(slot)

    def forget(self, route: str) -> None:
        """A session closed: its next call (if any) picks afresh."""
        self.router.forget(route)

    @property
    def moves(self) -> deque[Move]:
        return self.router.moves

    # ---- requests -----------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], spec: SamplingSpec, *,
               route: str | None = None) -> concurrent.futures.Future[Generation]:
        outer: concurrent.futures.Future[Generation] = concurrent.futures.Future()
        try:
            slot, moved = self.pick(route)
        except EngineError as exc:
            outer.set_exception(exc)
            return outer
        try:
            inner = self.engines[slot].submit(prompt_ids, spec)
        except BaseException:
            self._done(slot)
            raise

        def settle(f: concurrent.futures.Future) -> None:
            self._done(slot)
            if f.cancelled():
                outer.cancel()
            elif f.exception() is not None:
                outer.set_exception(f.exception())
            else:
                gen = f.result()
                gen.replica, gen.moved_from = slot, moved
                outer.set_result(gen)

        inner.add_done_callback(settle)
        outer.add_done_callback(lambda f: f.cancelled() and inner.cancel())
        return outer

    async def generate(self, prompt_ids: list[int], spec: SamplingSpec,
                       on_delta: Callable[[TokenDelta], None] | None = None, *,
                       route: str | None = None) -> Generation:
        slot, moved = self.pick(route)
        try:
            gen = await self.engines[slot].generate(prompt_ids, spec, on_delta)
        finally:
            self._done(slot)
        gen.replica, gen.moved_from = slot, moved
        return gen

    # ---- weights ------------------------------------------------------------------------------
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], *, version: int | None = None) -> int:
        """Write the tensors once as a file (shared memory) and load it into every replica."""
        return load_through_file(self, state_dict, version=version)

    def preload_weights_file(self, path: str | Path) -> str | None:
        """Preload the file into every serving replica's standby in parallel; None when all are ready, else the
        first reason one is not (that replica's load then goes in place; the others still swap)."""
        with self.weights_lock:
            engines = [self.engines[slot] for slot in range(len(self.engines)) if self._usable(slot)]
            if not engines:
                return f"engine is not running ({self.failure})"
            with concurrent.futures.ThreadPoolExecutor(len(engines), thread_name_prefix="polar-lab-preload") as pool:
                reasons = list(pool.map(lambda engine: engine.preload_weights_file(path), engines))
        return next((why for why in reasons if why is not None), None)

    def load_weights_file(self, path: str | Path, *, version: int | None = None) -> int:
        """Load a weights file (or a LoRA adapter's folder) into every serving replica in parallel, all at one
        version. Replicas that fail while others succeed are taken out of rotation and replaced; if none
        succeeds the error is raised and the version does not change."""
        path = Path(path)
        with self.weights_lock:
            target = self._version + 1 if version is None else version
            slots = [slot for slot in range(len(self.engines)) if self._usable(slot)]
            if not slots:
                raise EngineError(f"engine is not running ({self.failure})")
            shipped = self.ship(path) if self.ship is not None else None
            with concurrent.futures.ThreadPoolExecutor(len(slots), thread_name_prefix="polar-lab-load") as pool:
                futures = {slot: pool.submit(self._load_one, self.engines[slot], path, target, shipped)
                           for slot in slots}
            errors = {slot: f.exception() for slot, f in futures.items() if f.exception() is not None}
            if len(errors) == len(slots):
                first = next(iter(errors.values()))
                raise first if isinstance(first, EngineError) else EngineError(f"weight load failed: {first!r}")
            for slot in errors:  # out of rotation before the version moves: none serves old weights under it
                self.serving[slot] = False
            self._version = target
            self.shipped, self.served = shipped, path
            previous = self.weights_file
            self.weights_file = path if self.weights_dir is not None and path.parent == self.weights_dir else None
            if previous is not None and previous != self.weights_file and not is_slot(previous):
                remove_weights_soon(previous)
            if self.weights_file is None and shipped is not None and self.factory is not None and self.max_restarts:
                try:
                    shipped.keep()  # the file may go once this returns: replacements need their own copy
                except Exception:  # noqa: BLE001 - the load succeeded; only later replacements lack the weights
                    log.exception("the weights could not be kept for replacements; a replica that dies stays out")
            for slot, exc in errors.items():
                log.warning("replica %d failed to load policy version %d (%s); replacing it", slot, target, exc)
                self.healer.replace(slot, f"failed to load policy version {target}: {exc}", self.engines[slot])
        return target

    def _load_one(self, engine: Engine, path: Path, version: int, shipped: Any) -> int:
        if shipped is None:
            return engine.load_weights_file(path, version=version)
        return engine.load_weights_file(path, version=version, shipped=shipped)

    # ---- faults -------------------------------------------------------------------------------
    def reloadable(self) -> bool:
        """The served weights can be loaded again: the model folder, the kept file, or a shipped copy that
        outlives the file (a user's path may be gone or rewritten by now)."""
        return self._version == 0 or self.weights_file is not None or bool(getattr(self.shipped, "kept", False))

    # ---- lifecycle ----------------------------------------------------------------------------
    def wait_ready(self, timeout: float = 900.0) -> ReplicaSet:
        """Wait for every replica to serve (they start in parallel); one that fails closes them all."""
        deadline = time.monotonic() + timeout
        try:
            for engine in self.engines:
                engine.wait_ready(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.close()
            raise
        self.max_model_len = min(e.max_model_len for e in self.engines)
        return self

    def close(self) -> None:
        """Close every replica (in parallel), then what `on_close` frees. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        self.healer.stop()
        engines = list(self.engines)
        with concurrent.futures.ThreadPoolExecutor(len(engines), thread_name_prefix="polar-lab-close") as pool:
            list(pool.map(lambda e: e.close(), engines))  # a load in progress fails now instead of being waited out
        with self.weights_lock:  # a replacement that swapped in meanwhile (it checked _closed just before)
            late = [e for e in self.engines if all(e is not seen for seen in engines)]
        for engine in late:
            engine.close()
        if self.on_close is not None:
            self.on_close()

