"""Engine replicas (and trainer ranks) as Ray actors: Ray places, starts, restarts and stops the processes;
the kernel talks to each over one authenticated socket, as it does with a local engine process.

    kernel (Lab)                                   Ray actor `Host` (one per replica, on its bundle)
    RayEngine ── listens on a port (HMAC key) ◀── connects back, then runs engine/worker.py's loop
              ◀──── deltas, generations ────────  in a thread of the actor (vLLM in the actor's process)
    ReplicaSet.load_weights_file: a replica on the kernel's node maps the file in /dev/shm itself; for
              replicas on other nodes ray.put(file) once ─▶ each actor's `stage` writes it to its node's
              /dev/shm, then the usual "weights" command loads it there

Why a socket rather than a Ray call per request: the worker's protocol already batches one engine step's
tokens and answers into one message per step, and an actor call per request would add Ray's task overhead
and one object per answer (docs/scale.md has the figures). The actor is async, so `stage`, `ready` and
the long-running `serve` never wait for each other.

Ray is an optional extra (`pip install -e .[ray]`), imported only when `EngineConfig.cluster == "ray"`.
`RayCluster` joins a running cluster (`ray_address="auto"` or an address) or starts a local one bound to
127.0.0.1, which the last Lab using it stops. Each actor gets its environment explicitly (`runtime_env`):
Ray would set `OMP_NUM_THREADS` to the actor's CPUs, and the engine needs vLLM's settings before it imports.
Ray restarts a dead actor's process (`max_restarts=-1` at Ray's level); the replica set bounds how often a
replica is replaced (`EngineConfig.max_restarts`) and brings it back at the served weights and version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from polar_lab.config import EngineConfig
from polar_lab.engine.process import EngineProcess
from polar_lab.engine.replicas import ReplicaSet
from polar_lab.engine.process_env import ENV_DEFAULTS, ENV_FIXED
from polar_lab.engine.vllm_engine import VLLMEngine
from polar_lab.engine.weights import is_slot
from polar_lab.errors import EngineError

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
WORKER = "polar_lab.engine.worker:serve_connection"  # what a replica actor runs


# ---- the cluster --------------------------------------------------------------------------------------
_cluster_lock = threading.Lock()
_cluster_users = 0
_cluster_ours = False  # this process started the cluster it is connected to
_connected_by_us = False  # ray.init was ours (not the user's own, made before any Lab): ours to end


class RayCluster:
    """This process's connection to Ray, shared by the Labs (and trainers) that use it. `close()` once per
    `RayCluster`; the last one stops a local cluster this process started."""

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None):
        global _cluster_users, _cluster_ours, _connected_by_us
        with _cluster_lock:
            if not ray.is_initialized():
                if address is None:  # a local cluster of our own, on loopback only (never one RAY_ADDRESS names)
                    ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                             _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
                    _cluster_ours = True
                else:
                    try:
                        ray.init(address=address, log_to_driver=False, configure_logging=False)
                    except (ConnectionError, RuntimeError) as exc:
                        raise EngineError(
                            f"could not join the Ray cluster at {address!r}: {str(exc).splitlines()[0]}. A cluster "
                            f"started with `ray start` uses token authentication (Ray 2.60): set RAY_AUTH_MODE=token "
                            f"here, with its token in ~/.ray/auth_token or RAY_AUTH_TOKEN") from exc
                    _cluster_ours = False
                _connected_by_us = True
            self.started = _cluster_ours
            # where actors connect back: loopback on a cluster of our own, else this node's cluster address
            self.host = "127.0.0.1" if _cluster_ours else ray.util.get_node_ip_address()
            _cluster_users += 1
        self._closed = False

    def close(self) -> None:
        global _cluster_users, _cluster_ours, _connected_by_us
        with _cluster_lock:
            if self._closed:
                return
            self._closed = True
            _cluster_users -= 1
            if _cluster_users == 0 and _connected_by_us and ray.is_initialized():
                # a cluster we started stops with it (its raylet, GCS, workers); a joined one is only left
                ray.shutdown()
                _cluster_ours = _connected_by_us = False

    def has_gpus(self) -> bool:
        return ray.cluster_resources().get("GPU", 0) > 0


# ---- the actor ----------------------------------------------------------------------------------------
@ray.remote(num_cpus=0)
class Host:
    """Hosts one polar_lab process loop (an engine worker, a trainer rank) in a thread, connected back to the
    kernel; stages weight files on its node. Async: its methods never wait for each other."""

    def __init__(self) -> None:
        self.staged: dict[str, str] = {}  # staged path → the folder to remove
        # what an earlier process of this actor staged or used and could not remove (it was killed): remove it now
        actor_id = ray.get_runtime_context().get_actor_id()
        self.prefix = f"polar-lab-staged-{actor_id}-"
        shm = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
        for folder in shm.glob(self.prefix + "*"):
            shutil.rmtree(folder, ignore_errors=True)
        remove_scratch([actor_id])
        self.scratch_prefix = scratch_prefix(actor_id)

    async def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    async def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0 hosts torch.distributed's store there)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    async def serve(self, target: str, address: tuple[str, int], authkey: bytes, args: tuple = (),
                    log_path: str | None = None) -> int:
        """Run `module:function(conn, *args)` with a connection back to `address`; its return code."""
        return await asyncio.to_thread(_serve_back, target, tuple(address), authkey, args, log_path,
                                       self.scratch_prefix)

    async def stage(self, payload: Any) -> str:
        """Write shipped weights (`ship_weights`; Ray resolves the reference) to this node's shared memory;
        the path to load."""
        path, folder = await asyncio.to_thread(_write_payload, payload, self.prefix)
        self.staged[path] = folder
        return path

    async def unstage(self, path: str) -> None:
        folder = self.staged.pop(path, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def scratch_prefix(actor_id: str) -> str:
    """The name an actor's scratch folders start with, in its node's temp dir: the actor's id, so whoever outlives the
    process — the actor's next process, or the kernel that ended it — can find and remove what it left."""
    return f"polar-lab-actor-{actor_id}-"


def remove_scratch(actor_ids: list[str]) -> None:
    """Remove these actors' scratch folders from this node's temp dir (those of a process that was killed: one that
    ends removes its own)."""
    for actor_id in actor_ids:
        for folder in Path(tempfile.gettempdir()).glob(scratch_prefix(actor_id) + "*"):
            shutil.rmtree(folder, ignore_errors=True)


def _serve_back(target: str, address: tuple[str, int], authkey: bytes, args: tuple, log_path: str | None,
                prefix: str) -> int:
    import importlib

    if log_path and os.path.isdir(os.path.dirname(log_path)):  # the run folder is on this node: log there
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    scratch = tempfile.mkdtemp(prefix=prefix)  # vLLM's rendezvous files, the worker's adapter copies
    os.environ["TMPDIR"] = scratch
    tempfile.tempdir = None
    os.environ["POLAR_LAB_IN_RAY_ACTOR"] = "1"  # the engine keeps vLLM's own workers off Ray (worker.py)
    conn = None
    try:
        conn = Client(address, authkey=authkey)
        module, function = target.split(":")
        return getattr(importlib.import_module(module), function)(conn, *args)
    finally:
        if conn is not None:
            conn.close()  # the kernel hears the end now (a local process's exit closes it; a thread must)
        shutil.rmtree(scratch, ignore_errors=True)


SHARE_LOCAL_FILES = True  # a replica on the kernel's node reads the weights file itself (tests turn it off)


class Shipment:
    """One weights file (or adapter folder) on its way to every replica of a set: a replica on the kernel's
    node maps the file itself, from shared memory; the first replica on another node puts it into Ray's
    object store, once, and every replica there fetches that one copy. `transports` says which were used."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.transports: set[str] = set()
        self.file_valid = True  # False once the file may be gone or rewritten: only the copy counts then
        self._ref: ray.ObjectRef | None = None
        self._lock = threading.Lock()

    def ref(self) -> ray.ObjectRef:
        with self._lock:
            if self._ref is None:
                self._ref = ship_weights(self.path)
            return self._ref

    def keep(self) -> None:
        """Make the object store's copy now, before the file goes (the Lab deletes weights it does not keep):
        replacements load that copy."""
        self.ref()
        self.file_valid = False

    @property
    def kept(self) -> bool:
        return self._ref is not None


def ship_weights(path: str | Path) -> ray.ObjectRef:
    """Put a weights file (or a LoRA adapter's folder) into Ray's object store once; every replica's actor
    fetches that copy (zero-copy on the same node). The file is mapped, not read into the kernel's heap."""
    path = Path(path)
    if path.is_dir():
        return ray.put({str(p.relative_to(path)): _mapped(p) for p in sorted(path.rglob("*")) if p.is_file()})
    return ray.put(_mapped(path))


def _mapped(path: Path) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=np.uint8)
    # a plain ndarray over the mapping pickles out of band (zero-copy into the object store); a memmap would
    # pickle its bytes in-band, a full copy in the kernel's heap
    return np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))


def _write_payload(payload: Any, prefix: str) -> tuple[str, str]:
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    folder = tempfile.mkdtemp(prefix=prefix, dir=shm)
    if isinstance(payload, dict):  # an adapter's folder
        for name, data in payload.items():
            target = Path(folder) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            np.asarray(data).tofile(target)
        return folder, folder
    target = Path(folder) / "weights.safetensors"
    np.asarray(payload).tofile(target)
    return str(target), folder


class ActorProcess:
    """A Ray actor's `serve` call, seen as the process handle VLLMEngine and the trainer expect (poll, wait,
    kill, join, is_alive, exitcode)."""

    def __init__(self, actor: Any, ref: ray.ObjectRef):
        self.actor = actor
        self.ref = ref
        self.pid: int | None = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _ = ray.wait([self.ref], timeout=0)
            if ready:
                try:
                    self.returncode = int(ray.get(self.ref))
                except ray.exceptions.RayActorError:
                    self.returncode = -9  # the actor died (killed, out of memory) or could not start
                except ray.exceptions.RayError:
                    self.returncode = 1  # the call raised; the actor's process lives on
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        ready, _ = ray.wait([self.ref], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired("ray actor", timeout)
        return self.poll()

    def kill(self) -> None:
        """End the actor's process; Ray starts a fresh one in its place (for the next replica or rank)."""
        try:
            ray.kill(self.actor, no_restart=False)
        except ValueError:
            pass  # already gone for good

    # multiprocessing.Process's names, for the trainer's rank handles
    def join(self, timeout: float | None = None) -> None:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def is_alive(self) -> bool:
        return self.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.poll()


def connect_back(listener: socket.socket, authkey: bytes, proc: ActorProcess, deadline: float) -> Connection:
    """Accept the actor's connection (HMAC-authenticated with `authkey`, as multiprocessing's Listener does),
    failing early if the actor's call ends first."""
    listener.settimeout(0.5)
    try:
        while True:
            try:
                sock, _ = listener.accept()
                break
            except TimeoutError:
                if proc.poll() is not None:
                    raise EngineError(f"the Ray actor ended (code {proc.returncode}) before it connected") from None
                if time.monotonic() > deadline:
                    raise EngineError("the Ray actor did not connect in time (is the cluster short of "
                                      "resources? `ray status`)") from None
    finally:
        listener.close()
    sock.setblocking(True)  # Connection reads the raw descriptor
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn


def listen(host: str) -> socket.socket:
    return socket.create_server((host, 0))


# ---- the engine replica -------------------------------------------------------------------------------
class ActorConnection(EngineProcess):
    """A replica's process: a Ray actor's `serve` call that dials back to a port the kernel listens on (with an HMAC
    key, as multiprocessing's Listener does); the start command goes over the socket once it is accepted."""

    def __init__(self, config: EngineConfig, log_path: Path | None, actor: Any, *, host: str, target: str):
        super().__init__(config, log_path)
        self.actor = actor
        self.node: str | None = None  # the Ray node it runs on (known once ready)
        self._authkey = secrets.token_bytes(32)
        self._listener = listen(host)
        try:
            ref = actor.serve.remote(target, self._listener.getsockname()[:2], self._authkey,
                                     log_path=str(log_path) if log_path else None)
        except BaseException:
            self._listener.close()
            raise
        self.proc = ActorProcess(actor, ref)

    def connect(self, deadline: float) -> None:
        if self.conn is None:
            self.conn = connect_back(self._listener, self._authkey, self.proc, deadline)
            self.conn.send(("start", self.config))

    def wait_ready(self, timeout: float) -> dict:
        info = super().wait_ready(timeout)
        self.proc.pid = info.get("pid")
        self.node = ray.get(self.actor.ready.remote(), timeout=60)["node"]
        return info

    def release(self) -> None:
        self._listener.close()  # not yet accepted: nothing will connect to it now


class RayEngine(VLLMEngine):
    """A VLLMEngine whose process is a Ray actor: the same protocol over a socket the actor dials back."""

    def __init__(self, config: EngineConfig, actor: Any, *, host: str, log_path: str | Path | None = None,
                 target: str = WORKER):
        """target: the loop the actor runs (engine/worker.py; engine/simulated.py for load benchmarks)."""
        super().__init__(config, log_path=log_path)
        self.actor = actor
        self.host = host
        self.target = target

    def _open_process(self) -> ActorConnection:
        return ActorConnection(self.config, self.log_path, self.actor, host=self.host, target=self.target)

    @property
    def node(self) -> str | None:
        """The Ray node it runs on (known once ready)."""
        return self.process.node if self.process is not None else None

    def preload_weights_file(self, path: str | Path, *, timeout: float = 600.0) -> str | None:
        """Only a replica on the kernel's node maps the file itself and can load it before the load."""
        if not (SHARE_LOCAL_FILES and self.node == ray.get_runtime_context().get_node_id()):
            return "the weights reach this replica's node at the load (Ray's object store)"
        return super().preload_weights_file(path, timeout=timeout)

    def load_weights_file(self, path: str | Path, *, version: int | None = None, timeout: float = 600.0,
                          shipped: Shipment | None = None) -> int:
        """Load a weights file (`shipped`: the set's one Shipment of it): on the kernel's node the engine maps
        the file itself; elsewhere the actor writes the object store's copy to its node's /dev/shm, the engine
        loads that, the actor removes it."""
        if not self.alive:
            raise EngineError(f"engine is not running ({self.failure})")
        shipped = Shipment(path) if shipped is None else shipped
        kind = "-adapter" if shipped.path.is_dir() else "-file"
        if SHARE_LOCAL_FILES and shipped.file_valid and self.node == ray.get_runtime_context().get_node_id():
            shipped.transports.add("shared-memory" if is_slot(shipped.path) else "shm" + kind)  # a slot: in place
            return super().load_weights_file(shipped.path, version=version, timeout=timeout)
        shipped.transports.add("ray-object-store" + kind)
        try:
            local = ray.get(self.actor.stage.remote(shipped.ref()), timeout=timeout)
        except ray.exceptions.RayError as exc:
            raise EngineError(f"the replica could not stage the weights: {exc}") from None
        try:
            return super().load_weights_file(local, version=version, timeout=timeout)
        finally:
            self.actor.unstage.remote(local)


class RayReplicas:
    """The actors and placement group of one replica set; `close()` ends them for good."""

    def __init__(self, config: EngineConfig, cluster: RayCluster, *, log_dir: Path | None, target: str = WORKER,
                 env: dict[str, str] | None = None):
        self.config = config
        self.cluster = cluster
        self.log_dir = log_dir
        self.target = target
        n = config.replicas
        gpu = cluster.has_gpus()
        bundle = {"GPU": config.tensor_parallel_size, "CPU": 1} if gpu else {"CPU": config.replica_cpus}
        self.pg = _placed(bundle, n, "engine replicas")
        threads = config.replica_cpus if not gpu else 1
        env = {**ENV_DEFAULTS, "VLLM_LOGGING_LEVEL": config.vllm_log_level,  # the KV cache size: EngineConfig's
               "OMP_NUM_THREADS": str(threads),  # Ray would set it to the bundle's CPUs; say it ourselves
               **(env or {}), **ENV_FIXED}
        self.actors = [
            Host.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                         num_cpus=0 if gpu else config.replica_cpus, num_gpus=bundle.get("GPU", 0),
                         max_restarts=-1, runtime_env={"env_vars": env}, name=None).remote()
            for i in range(n)]
        self.engines: list[RayEngine | None] = [None] * n

    def engine(self, slot: int) -> RayEngine:
        """A launched engine on `slot`'s actor. An actor whose previous engine stopped normally is restarted
        first (a fresh process: vLLM is not built twice in one); a dead one Ray is restarting already."""
        previous = self.engines[slot]
        ended = previous.process.poll() if previous is not None and previous.process is not None else None
        if ended in (0, 1):  # its loop ended and the process lives on, holding a vLLM: a fresh process instead
            try:
                old_pid = ray.get(self.actors[slot].ready.remote(), timeout=10)["pid"]
                ActorProcess(self.actors[slot], None).kill()
            except ray.exceptions.RayError:  # it died meanwhile: Ray is restarting it
                old_pid = previous.pid
            self._wait_restarted(slot, old_pid)
        elif ended is not None:  # the process died: Ray restarts it; wait for the new one
            self._wait_restarted(slot, previous.pid)
        log_path = self.log_dir / f"engine-{slot}.log" if self.log_dir else None
        engine = RayEngine(self.config, self.actors[slot], host=self.cluster.host, log_path=log_path,
                           target=self.target).launch()
        self.engines[slot] = engine
        return engine

    def _wait_restarted(self, slot: int, old_pid: int | None, timeout: float = PLACEMENT_TIMEOUT_S) -> None:
        """Until Ray serves `slot`'s actor again from a new process (a call sent before Ray noticed the death
        fails, one sent before a kill landed is answered by the old process: ask again)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                info = ray.get(self.actors[slot].ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
                if info["pid"] != old_pid:
                    return
                if time.monotonic() > deadline:
                    raise EngineError(f"Ray did not restart replica {slot}'s actor within {timeout:.0f} s")
                time.sleep(0.2)
            except ray.exceptions.RayActorError:  # dead, restarting, or unavailable for a moment
                if time.monotonic() > deadline:
                    raise EngineError(f"Ray did not restart replica {slot}'s actor within {timeout:.0f} s") from None
                time.sleep(0.5)
            except ray.exceptions.GetTimeoutError:
                raise EngineError(f"Ray did not restart replica {slot}'s actor within {timeout:.0f} s") from None

    def close(self) -> None:
        _end(self.actors, self.pg)


def _placed(bundle: dict[str, float], n: int, what: str):
    """A placement group of `n` `bundle`s, packed on as few nodes as fit, ready; a clear error if it cannot be."""
    pg = placement_group([bundle] * n, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise EngineError(f"the Ray cluster cannot place {n} {what} of {bundle} within {PLACEMENT_TIMEOUT_S:.0f} s; "
                          f"it has {ray.available_resources()}") from None
    return pg


def _end(actors: list, pg) -> None:
    """End `actors` for good (no restart), remove the scratch folders they leave on this node (a killed process
    removes nothing; on another node, its actor's next process would) and free their placement group."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except ValueError:
            pass  # already gone
    for actor in actors:
        _wait_gone(actor)
    remove_scratch([actor._actor_id.hex() for actor in actors])
    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - the cluster may be gone already
        pass


def _wait_gone(actor, timeout: float = 10.0) -> None:
    """Until a killed actor answers no more (its process is gone: nothing writes into its scratch after)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ready.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        except Exception:  # noqa: BLE001 - the cluster itself may be gone
            return
        time.sleep(0.05)


def ray_replica_set(config: EngineConfig, *, log_dir: Path | None, weights_dir: Path | None, target: str = WORKER,
                    env: dict[str, str] | None = None) -> ReplicaSet:
    """`config.replicas` engines as Ray actors behind one ReplicaSet (launched; `wait_ready` waits for them).
    Closing the set ends the actors, the placement group and this set's use of the cluster. target, env: the
    loop each actor runs and extra environment for it (a benchmark's simulated engine)."""
    cluster = RayCluster(config.ray_address, num_cpus=max(os.cpu_count() or 1, config.replicas * config.replica_cpus + 4))
    try:
        group = RayReplicas(config, cluster, log_dir=log_dir, target=target, env=env)
    except BaseException:
        cluster.close()
        raise

    def closed() -> None:
        group.close()
        cluster.close()

    engines = []
    try:
        for slot in range(config.replicas):
            engines.append(group.engine(slot))
    except BaseException:
        for engine in engines:
            engine.close()
        closed()
        raise
    return ReplicaSet(engines, factory=group.engine, weights_dir=weights_dir, max_restarts=config.max_restarts,
                      queue_bound=config.replica_queue_bound, ship=Shipment, on_close=closed)


# ---- trainer ranks ------------------------------------------------------------------------------------
class RayRanks:
    """Trainer ranks as Ray actors (grpo/distributed.py), one bundle each: {"GPU": 1, "CPU": 1} on a cluster
    with GPUs (the actor sees its own GPU as cuda:0), else {"CPU": 1}. `close()` ends them for good."""

    def __init__(self, world_size: int, address: str | None = None):
        self.cluster = RayCluster(address)
        try:
            gpu = self.cluster.has_gpus()
            bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
            self.pg = _placed(bundle, world_size, "trainer ranks")
        except BaseException:
            self.cluster.close()
            raise
        self.threads = 1 if gpu else max(1, (os.cpu_count() or 1) // world_size)
        env = {"OMP_NUM_THREADS": str(self.threads), "TOKENIZERS_PARALLELISM": "false"}
        self.actors = [
            Host.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
                         num_cpus=1, num_gpus=bundle.get("GPU", 0), max_restarts=0,
                         runtime_env={"env_vars": env}).remote()
            for r in range(world_size)]
        self.devices = ["cuda:0" if gpu else "cpu"] * world_size

    def master_address(self, timeout: float = PLACEMENT_TIMEOUT_S) -> tuple[str, int]:
        """Where rank 0's node takes the process group's rendezvous (its address, a free port there)."""
        return tuple(ray.get(self.actors[0].rendezvous.remote(), timeout=timeout))

    def start(self, rank: int, target: str, args: tuple, timeout: float = PLACEMENT_TIMEOUT_S
              ) -> tuple[Connection, ActorProcess]:
        authkey = secrets.token_bytes(32)
        listener = listen(self.cluster.host)
        ref = self.actors[rank].serve.remote(target, listener.getsockname()[:2], authkey, args)
        proc = ActorProcess(self.actors[rank], ref)
        return connect_back(listener, authkey, proc, time.monotonic() + timeout), proc

    def close(self) -> None:
        _end(self.actors, self.pg)
        self.cluster.close()
