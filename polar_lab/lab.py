"""The Lab: the one object a notebook holds. It owns the engine process, the proxy server (proxy/server.py: its sockets
and loop thread) and the run store.

Threads:
    caller (notebook/main)   creates sessions, reads calls, hands coroutines to the loop (`lab.run`)
    polar-lab-loop           asyncio loop: uvicorn serving the proxy app, harness coroutines (proxy/server.py)
    polar-lab-engine         reads finished generations from the engine process (see engine/vllm_engine.py)
    polar-lab-heal           replaces an engine process that died (see engine/supervisor.py)
The vLLM engine itself runs in a child process the Lab starts and stops; its log is <run>/engine.log. If it
dies, the Lab starts another by itself, at the same weights and policy version (`EngineConfig.max_restarts`).

One live Lab per (host, port): constructing a Lab with the same config again returns the running one,
so re-running a notebook cell never starts a second server or engine. The default port (None) is a free
port chosen by the first Lab of the process and stands for "this kernel's Lab". A different config on the
same port closes the old Lab first. `close()` is idempotent and frees the port, the engine and the files.
"""

from __future__ import annotations

import dataclasses
import atexit
import concurrent.futures
import fcntl
import ipaddress
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Coroutine, Mapping
from pathlib import Path
from types import EllipsisType
from typing import Any, ClassVar, TypeVar

import pandas as pd
import torch

from polar_lab import sandbox
from polar_lab.config import DEFAULT_MODEL, EngineConfig, HarnessConfig, LabConfig, ProxyConfig, StoreConfig
from polar_lab.engine.layout import check_heads, engine_gpus, replica_gpus, visible_gpus
from polar_lab.engine.replicas import ReplicaSet
from polar_lab.engine.supervisor import EngineSupervisor, Restart
from polar_lab.engine.weights import remove_weights, weights_size, write_weights
from polar_lab.errors import LabError
from polar_lab.proxy.server import ProxyServer
from polar_lab.rewards.registry import get_evaluator
from polar_lab.rollout import rollout_async
from polar_lab.run import Run
from polar_lab.store import RunStore
from polar_lab.store.runstore import check_run_name, new_run_name
from polar_lab.types import Evaluator, Group, Harness, ModelCall, Session, SyncResult, Trajectory

log = logging.getLogger(__name__)
T = TypeVar("T")


class Lab:
    _live: ClassVar[dict[tuple[str, int | None], Lab]] = {}  # port 0 (always a new Lab) never in it
    _live_lock: ClassVar[threading.Lock] = threading.Lock()

    def __new__(cls, model: str | None = None, *, config: LabConfig | None = None, engine=None, **overrides: Any):
        cfg = _make_config(model, config, overrides)
        with cls._live_lock:
            existing = cls._live.get((cfg.proxy.host, cfg.proxy.port)) if cfg.proxy.port != 0 else None
            if existing is not None and existing._same_setup(cfg):
                return existing
        if existing is not None:
            warnings.warn(f"closing the Lab on port {existing.port} (model {existing.config.engine.model}) "
                          f"to start one with a different config", stacklevel=2)
            existing.close()
        lab = super().__new__(cls)
        lab._started = False
        return lab

    def __init__(self, model: str | None = None, *, config: LabConfig | None = None, engine=None,
                 **overrides: Any):
        """Start (or return the running) Lab.

        model: model folder, default `data/models/tiny-calc`.
        overrides: any field of EngineConfig / ProxyConfig / StoreConfig / HarnessConfig by name (port=0,
            run_name="x", sandbox="process"...).
        engine: an already-built engine — a ScriptedEngine in unit tests, or one engine several Labs share (each Lab
            its own proxy, sessions and run folder); default builds VLLMEngine. An engine passed in stays its
            owner's: the Lab never restarts it and leaves it running when it closes.
        """
        if self._started:
            return
        self.config = _make_config(model, config, overrides)
        self._closed = False
        self._owned: list[Any] = []  # trainers and producers that use this Lab; closed before it
        self._last_trainer: Any = None  # the latest trainer released (lab.training() shows its curves)
        self._start(engine)
        self._started = True

    # ---- lifecycle -------------------------------------------------------------------------
    def _start(self, engine) -> None:
        """Store, engine launched, then — while its process builds vLLM — the tokenizer and the proxy; then the wait
        for the engine. `startup` keeps each phase's seconds (benchmarks/lab_startup.py prints them)."""
        cfg = self.config
        _warn_if_exposed(cfg.proxy.host)
        clock = _Phases()
        self.startup = clock.seconds
        self.supervisor, self._weights_dir, self._first_engine, self.server = None, None, None, None
        self._owns_engine = engine is None  # one passed in stays its owner's (left running at close)
        self._weights_paths: set[Path] = set()  # weights_path()s not synced yet
        run_name = check_run_name(cfg.store.run_name or new_run_name())
        self.run_dir = Path(cfg.store.runs_dir) / run_name
        self.store = RunStore(self.run_dir, fsync=cfg.store.fsync)
        self.store.write_json("config.json", cfg.to_record())
        self.recorded = None  # the Run over this folder, once the tokenizer is loaded
        self.sandbox_level = self._start_sandbox()
        clock.done("store")
        try:
            engine = self._launch_engine(engine, clock)
            self._start_server(engine)  # no call can reach it before this returns: sessions come later
            clock.done("proxy")
            engine.wait_ready()
            clock.done("engine_wait")
            self.supervisor = EngineSupervisor(
                engine, gate=self.server.gate(),
                factory=self._new_engine if self._owns_engine else None,
                max_restarts=cfg.engine.max_restarts, on_swap=self._swap_engine, owns_engine=self._owns_engine)
            self.service.engine_status = self.supervisor.status
            self.registry.on_close.append(self._forget_route)
        except BaseException:
            self.close()
            raise
        with self._live_lock:
            if cfg.proxy.port != 0:
                self._live[(cfg.proxy.host, cfg.proxy.port)] = self
        atexit.register(self.close)
        self.startup["total"] = sum(self.startup.values())

    def _launch_engine(self, engine, clock: _Phases):
        """The engine, launched (the caller waits for it); the tokenizer and the Run over the folder are loaded while
        its process starts. A passed-in engine is used as it is, never restarted, never closed."""
        if engine is None:
            check_engine_layout(self.config.engine)  # before any process starts
            if self.config.engine.keep_weights:  # the served weights' file, for restarts (shared memory)
                self._weights_dir, self._weights_lock = _weights_dir()
            engine = self._new_engine()
        self._first_engine = engine  # closed by close() if the Lab fails before its supervisor exists
        clock.done("engine_launch")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the proxy tokenises from several threads
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(engine.model_path)  # while the engine process starts
        self.recorded = Run(self.run_dir, store=self.store, tokenizer=self.tokenizer)
        clock.done("tokenizer")
        return engine

    def _new_engine(self):
        """A launched engine (the supervisor waits for it and sets its on_exit): one engine process, or a
        ReplicaSet of `replicas` processes (cluster="local") or Ray actors (cluster="ray")."""
        from polar_lab.engine.vllm_engine import VLLMEngine

        cfg = self.config.engine
        if cfg.cluster == "ray":
            from polar_lab.engine.ray_replicas import ray_replica_set  # Ray is an optional extra

            return ray_replica_set(cfg, log_dir=self.run_dir, weights_dir=self._weights_dir)
        if cfg.replicas == 1:
            return VLLMEngine(cfg, log_path=self.run_dir / "engine.log", weights_dir=self._weights_dir).launch()
        layouts = replica_gpus(cfg, visible_gpus())

        def replica(slot: int) -> VLLMEngine:
            own = dataclasses.replace(cfg, replicas=1, gpus=layouts[slot])
            return VLLMEngine(own, log_path=self.run_dir / f"engine-{slot}.log").launch()

        engines = []
        try:
            for slot in range(cfg.replicas):
                engines.append(replica(slot))
        except BaseException:
            for engine in engines:
                engine.close()
            raise
        return ReplicaSet(engines, factory=replica, weights_dir=self._weights_dir, max_restarts=cfg.max_restarts,
                          queue_bound=cfg.replica_queue_bound)

    def _swap_engine(self, engine) -> None:
        self.service.engine = engine  # calls read it after the gate lets them in

    def _start_server(self, engine) -> None:
        """The proxy, serving (proxy/server.py); its parts the Lab's callers read stay reachable from the Lab."""
        self.server = ProxyServer(self.config.proxy, engine, self.tokenizer, self.store,
                                  tool_parser=self.config.engine.tool_parser,
                                  reasoning_parser=self.config.engine.reasoning_parser)
        self.port, self.url, self.parsers = self.server.port, self.server.url, self.server.parsers
        self.registry, self.service, self.loop = self.server.registry, self.server.service, self.server.loop
        self.store.write_json("config.json", {**self.config.to_record(), "parsers": self.parsers,
                                              "sandbox_level": self.sandbox_level})

    def _start_sandbox(self) -> str | None:
        """Set this process's sandbox from the harness section; returns the level programs will run at, or
        None where "isolated" cannot run and fallback is off: programs are then refused when they are about to
        run, saying why and how to install bubblewrap; not here, where a Lab that runs none would alarm for nothing."""
        cfg = self.config.harness
        self._sandbox_before = sandbox.current()  # put back when this Lab closes
        level = sandbox.configure(cfg.sandbox, fallback=cfg.sandbox_fallback, uid=cfg.sandbox_uid)
        self._sandbox_mine = sandbox.current()
        log.info("harness programs and evaluators run at the %r sandbox level", level)
        return level

    def close(self) -> None:
        """Stop the server, the loop and the engine; close the store. Safe to call twice."""
        if getattr(self, "_closed", True):
            return
        for owned in reversed(self._owned):  # trainers first: their producers still need the loop
            try:
                owned.close()
            except Exception:  # noqa: BLE001 - shutting down regardless
                log.warning("closing %r failed", owned, exc_info=True)
        self._owned.clear()
        self._closed = True
        atexit.unregister(self.close)
        with self._live_lock:
            key = (self.config.proxy.host, self.config.proxy.port)
            if self._live.get(key) is self:
                del self._live[key]
        if self.supervisor is not None:
            self.supervisor.quiesce()  # a restart or load in progress finishes while the loop still runs
        if getattr(self, "server", None) is not None:
            self.server.close()  # stops serving, cancels runs cut off, stops the loop, removes the socket
        if self.supervisor is not None:
            self.supervisor.close()
        elif self._first_engine is not None and self._owns_engine:
            self._first_engine.close()
        if getattr(self, "_sandbox_before", None) is not None and sandbox.current() == self._sandbox_mine:
            sandbox.configure(**self._sandbox_before)  # only what this Lab set: a Lab started after it keeps its own
        for path in self._weights_paths:  # handed out by weights_path() and never synced
            remove_weights(path)
        if self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)
            os.close(self._weights_lock)
        self.store.close()

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"serving {self.url}"
        return f"<Lab {self.config.engine.model} {state} run={self.run_dir}>"

    def _same_setup(self, cfg: LabConfig) -> bool:
        return not self._closed and cfg == self.config

    @property
    def closed(self) -> bool:
        return self._closed

    def adopt(self, owned: Any) -> None:
        """Close `owned` (anything with .close()) when this Lab closes: trainers, rollout producers."""
        self._owned.append(owned)

    def release(self, owned: Any) -> None:
        if owned in self._owned:
            self._owned.remove(owned)
        if hasattr(owned, "history") and hasattr(owned, "reward_log"):  # a trainer: the dashboard keeps its curves
            self._last_trainer = owned

    def owned(self, kind: type) -> list[Any]:
        """The adopted objects of one kind (e.g. the running async rollout producers)."""
        return [o for o in self._owned if isinstance(o, kind)]

    # ---- what notebooks call ---------------------------------------------------------------
    def session(self, task: dict[str, Any] | None = None, *, group_id: str | None = None,
                chat_template: str | None = None, sampling: dict[str, Any] | None = None,
                continuity: str | None = None, name: str | None = None, **info: Any) -> Session:
        """A new session (one harness run) with its own secret key.

        chat_template: render this session's prompts with another Jinja template (see polar_lab.templates).
        sampling: forced on every call whatever the harness asks: temperature, top_p, top_k, banned_strings,
            seed (the run's: call k samples with `types.call_seed(seed, k)`, its own random stream) and
            max_tokens (a cap). RL rollouts and evaluations use it to fix the sampling distribution.
        continuity: "splice" (echoed turns the proxy produced go back as their sampled ids) or "template"
            (re-rendered by the chat template); None: the Lab's `ProxyConfig.continuity`. See proxy/splice.py.
        name: what a request under the Lab's shared key (`ProxyConfig.shared_key`) calls this session in its
            `X-Session-ID` header (or `session_field`); its id works as well. Unique in the Lab.
        info: free-form facts stored with the session, e.g. harness="claude-code" (used by drift_report).
        """
        self._check_open()
        return self.registry.create(task, group_id=group_id, info=info, chat_template=chat_template,
                                    sampling=sampling, continuity=continuity, name=name)

    @property
    def shared_key(self) -> str | None:
        """The key shared-client frameworks send, each request naming its session (`ProxyConfig.shared_key`);
        None when the Lab has none."""
        return self.registry.shared_key

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the Lab's loop and wait for it (works inside Jupyter's own running loop)."""
        self._check_open()
        return self.server.run(coro, timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start a coroutine on the Lab's loop and return at once."""
        self._check_open()
        return self.server.submit(coro)

    def rollout(self, tasks: list[dict[str, Any]], harness: Harness, *, num_generations: int = 8,
                evaluator: str | Evaluator | None = None, concurrency: int = 32, deadline_s: float = 600.0,
                builder: str = "prefix_merging", progress: bool = True,
                failed_reward: float | None = None, timeout_reward: float | None | EllipsisType = ...,
                overflow_reward: float | None | EllipsisType = ..., sampling: dict[str, Any] | None = None,
                seed: int | None = None) -> list[Group]:
        """Run each task `num_generations` times through `harness` (async callable or Command), one Group per task.

        evaluator: a function or a registered name ("final_answer", "unit_tests", "session_completed").
        Crashed or timed-out runs keep their calls, are marked in `session.status` and, with their cause, in
        `session.info["failure"]` (rollout.failure_cause). Their reward is `timeout_reward` (ran past the
        deadline), `overflow_reward` (overflowed the context) or `failed_reward` (crashed); the first two default
        to `failed_reward`, which defaults to None, i.e. masked out of training (fail-closed). The GRPO trainer
        scores timeouts and overflows 0.0 and masks crashes.
        Infrastructure failures (engine/proxy errors, no call served) are always masked.
        sampling: forced on every call of every run (see `session`); seed: run i gets sampling seed seed+i,
        and its call k `types.call_seed(seed + i, k)`, so a rollout is reproducible whatever seeds the
        harness sends.
        """
        return self.run(rollout_async(self, tasks, harness, num_generations=num_generations,
                                      evaluator=get_evaluator(evaluator), concurrency=concurrency,
                                      deadline_s=deadline_s, builder=builder, progress=progress,
                                      failed_reward=failed_reward,
                                      timeout_reward=failed_reward if timeout_reward is ... else timeout_reward,
                                      overflow_reward=failed_reward if overflow_reward is ... else overflow_reward,
                                      sampling=sampling, seed=seed))

    # ---- reading the run (one implementation: polar_lab.run.Run over this Lab's folder) ----------
    def call_records(self, session_ids: list[str] | None = None) -> list[ModelCall]:
        """Every recorded call of this run (or of these sessions), read back from the run folder."""
        return self.recorded.call_records(session_ids)

    def calls(self) -> pd.DataFrame:
        """One row per recorded call (pandas)."""
        return self.recorded.calls()

    def sessions(self) -> pd.DataFrame:
        """The latest state of each session (one row per session)."""
        return self.recorded.sessions()

    def trajectories(self, builder: str = "prefix_merging", *, session_ids: list[str] | None = None,
                     ) -> list[Trajectory]:
        """Training samples rebuilt from the recorded calls; each carries its session's reward."""
        return self.recorded.trajectories(builder, session_ids=session_ids)

    def chain_breaks(self, *, session_ids: list[str] | None = None) -> pd.DataFrame:
        """Every prefix-merging chain break of this run (or of these sessions), classified
        (see polar_lab.trajectory.drift)."""
        return self.recorded.chain_breaks(session_ids=session_ids)

    def drift_report(self) -> pd.DataFrame:
        """Chain breaks counted by harness and class, with an example of each."""
        return self.recorded.drift_report()

    def sft_dataset(self, *, min_reward: float = 1.0, builder: str = "prefix_merging",
                    session_ids: list[str] | None = None):
        """The accepted runs' chains as SFT data (`Run.sft_dataset`): TRL's conversational and tokenized forms."""
        return self.recorded.sft_dataset(min_reward=min_reward, builder=builder, session_ids=session_ids)

    def sft_acceptance(self, *, min_reward: float = 1.0, session_ids: list[str] | None = None) -> pd.DataFrame:
        """Per task: runs, accepted runs, masked runs and the rate (`Run.sft_acceptance`)."""
        return self.recorded.sft_acceptance(min_reward=min_reward, session_ids=session_ids)

    def stats(self) -> dict[str, Any]:
        """Live counters (what the dashboard shows): sessions by status, calls and sampled tokens recorded, the
        policy version, the proxy's gate and the engine's state and restarts."""
        statuses = [s.status for s in self.registry.all()]
        engine = self.supervisor.status()
        return {"sessions_running": statuses.count("open"), "sessions_finished": statuses.count("closed"),
                "sessions_failed": statuses.count("error") + statuses.count("timeout"),
                "calls": self.store.num_calls, "output_tokens": self.store.num_output_tokens,
                "policy_version": self.policy_version, "proxy": self.proxy_state,
                "engine_busy_s": self.supervisor.busy_seconds, **engine,
                **({"replicas_serving": sum(r["serving"] for r in self.engine.replica_status()),
                    "replicas": len(self.engine.engines), "replica_moves": self.engine.moved}
                   if isinstance(self.engine, ReplicaSet) else {})}

    def training(self) -> dict[str, Any]:
        """What the dashboard plots of training: the newest attached trainer's metrics per step (`history`) and its
        runs' rewards as (step, reward); without a trainer, the rewards of this Lab's finished runs (step 0)."""
        trainers = [o for o in self._owned if hasattr(o, "history") and hasattr(o, "reward_log")]
        trainer = trainers[-1] if trainers else self._last_trainer  # a closed trainer's curves stay on show
        if trainer is not None:
            return {"history": list(trainer.history),
                    "rewards": [(r["step"], r["reward"]) for r in list(trainer.reward_log) if r["reward"] is not None]}
        return {"history": [], "rewards": [(0, s.reward) for s in self.registry.all()
                                           if s.status != "open" and s.reward is not None]}

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        """Load new weights into the live engine at once (no pause); returns the new policy version.

        Calls in flight continue with the new weights from the next engine step; their tokens record
        which version sampled them. For a clean cut between versions use `sync_weights`.
        """
        self._check_open()
        return self.supervisor.load(state_dict)

    def sync_weights(self, weights: Mapping[str, torch.Tensor] | str | Path, *,
                     drain_timeout: float = 30.0) -> SyncResult:
        """Weight sync: pause the proxy (new calls wait), drain in-flight calls (up to `drain_timeout`),
        load the weights into the live engine, bump `policy_version`, resume. If the engine dies during the
        load, a new one is started with these weights, at the next version.

        `weights`: HF-named tensors (`lm_head.weight` included), written first — before the pause — as a
        safetensors file in shared memory that the engine maps; or the path of such a file already written
        (a trainer writes it straight from its ranks: `weights_path()`, engine/weights.py). A file from
        `weights_path()` becomes the kept copy of the served weights (no second copy); another path is left
        where it is. A CPU engine keeps a standby copy of its model (`EngineConfig.standby_weights`): the file
        loads into it before the pause, while the engine serves, and the pause only swaps it in (`swapped`).
        The result says how many bytes moved, and how long the write, the preload and the pause took.
        """
        self._check_open()
        if isinstance(weights, (str, Path)):  # a file, or a LoRA adapter's folder
            path, write_s = Path(weights), 0.0
        else:
            t0 = time.perf_counter()
            path = self.weights_path()
            write_weights(path, weights)
            write_s = time.perf_counter() - t0
        size, kind = weights_size(path), "shm-adapter" if path.is_dir() else "shm-file"
        try:
            result = self.supervisor.sync(path, drain_timeout)
        finally:
            if path in self._weights_paths:
                self._weights_paths.discard(path)
                if self.engine.weights_file != path:
                    remove_weights(path)  # ours, and not the kept copy (not kept, or the load failed)
        engine = self.engine
        if isinstance(engine, ReplicaSet) and engine.ship is not None and engine.shipped is not None:
            kind = "+".join(sorted(engine.shipped.transports)) or kind  # Ray: shm on this node, else object store
        return dataclasses.replace(result, bytes=size, write_s=write_s, path=kind)

    def weights_path(self) -> Path:
        """A fresh path in shared memory for a weights file (or a LoRA adapter's folder) that `sync_weights`
        will load (and keep, with keep_weights) and otherwise delete; one not synced is deleted when the Lab
        closes."""
        folder = self._weights_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        path = Path(folder) / f"polar-lab-weights-{uuid.uuid4().hex}"
        self._weights_paths.add(path)
        return path

    def restart_engine(self, state_dict: Mapping[str, torch.Tensor] | None = None, *, version: int | None = None,
                       drain_timeout: float = 30.0, startup_timeout: float = 900.0) -> Restart:
        """Replace the engine process with a fresh one now — to clear a wedged one, or after it died and the
        Lab's own restarts (`max_restarts`) were spent. The proxy, its sessions and keys, and the run's records
        carry on; new calls wait at the paused proxy while the engine starts, calls still in flight after
        `drain_timeout` fail with a 503.

        The new engine serves what the old one served: the model from disk at version 0, or the weights of the
        last load (kept in shared memory) at their version. `state_dict` replaces those with the weights
        passed in, loaded as `version` (default: the version the old engine served). Without kept weights
        (`keep_weights=False`) and past version 0 it refuses rather than silently roll training back.
        If the new engine fails to start, the error is raised and the Lab keeps answering 503s; call again.
        Returns the restart's record (policy_version, startup_s...).
        """
        self._check_open()
        return self.supervisor.restart(state_dict, version=version, drain_timeout=drain_timeout,
                                       startup_timeout=startup_timeout)

    @property
    def engine(self):
        """The live engine (a new object after each restart)."""
        return self.supervisor.engine

    def _forget_route(self, session) -> None:
        engine = self.supervisor.engine if self.supervisor is not None else None
        if isinstance(engine, ReplicaSet):
            engine.forget(session.id)  # a closed session's replica is not remembered

    def replicas(self) -> pd.DataFrame:
        """One row per engine replica (engine/replicas.py): serving, pid, requests in flight, sessions routed to
        it, policy version, busy seconds, restarts. A single engine is replica 0."""
        engine = self.engine
        if isinstance(engine, ReplicaSet):
            return pd.DataFrame(engine.replica_status())
        return pd.DataFrame([{"replica": 0, "serving": engine.alive, "pid": engine.pid, "in_flight": engine.running,
                              "sessions": None, "policy_version": engine.policy_version,
                              "busy_s": engine.busy_seconds, "restarts": len(self.engine_restarts),
                              "failure": engine.failure}])

    def replica_moves(self) -> pd.DataFrame:
        """Every session moved to another replica (its own was dead, out of rotation or over its queue bound)."""
        engine = self.engine
        moves = list(engine.moves) if isinstance(engine, ReplicaSet) else []
        return pd.DataFrame([dataclasses.asdict(m) for m in moves],
                            columns=["route", "from_replica", "to_replica", "why", "at"])

    @property
    def engine_restarts(self) -> list[Restart]:
        """Every replacement of the engine process so far: reason, automatic or not, startup time, outcome."""
        return list(self.supervisor.restarts)

    def dashboard(self, *, interval: float = 1.0, start: bool = True):
        """A live ipywidgets dashboard of this Lab: its counters (sessions, calls/s, tokens/s, version, proxy and
        engine state) and plots (rewards per step, throughput and engine busy, sessions, version and staleness,
        an attached trainer's loss and reward mean). Display it as the last expression of a cell; it refreshes
        every `interval` s in a background thread until the Lab closes."""
        from polar_lab.viz.dashboard import Dashboard

        for old in self.owned(Dashboard):  # the cell run again: one dashboard draws at a time
            old.close()
        board = Dashboard(self, interval=interval)
        self.adopt(board)
        return board.start() if start else board

    @property
    def proxy_state(self) -> dict[str, Any]:
        """serving / draining / paused, calls in flight, pauses so far (see polar_lab.proxy.pause)."""
        return self.service.gate.stats()

    @property
    def engine_busy_seconds(self) -> float:
        """Seconds the engine has spent stepping requests since the Lab started, restarts included (for busy
        fractions)."""
        return self.supervisor.busy_seconds

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def model_path(self) -> str:
        """The model folder (or hub id) the engine was started from."""
        return self.engine.model_path

    def _check_open(self) -> None:
        if self._closed:
            raise LabError("this Lab is closed; create a new one")


class _Phases:
    """Seconds per phase of a Lab's start, in order: `done(name)` closes the phase that began at the previous one."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._last, 4)
        self._last = now


def _weights_dir() -> tuple[str, int]:
    """A folder in shared memory for the served weights' file, and the fd of the lock its Lab holds on it for
    its whole life. Folders whose lock nobody holds belong to kernels that died without closing their Lab
    (SIGKILL): they are removed first, so they do not hold RAM for good. (A lock, not a pid: kernels in other
    PID namespaces may share /dev/shm.)"""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    for old in Path(shm).glob("polar-lab-weights-*"):
        if old.is_dir() and (old / "lock").exists() and _lockable(old / "lock"):
            shutil.rmtree(old, ignore_errors=True)
    folder = tempfile.mkdtemp(prefix="polar-lab-weights-", dir=shm)
    fd = os.open(os.path.join(folder, "lock"), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return folder, fd


def _lockable(path: Path) -> bool:
    """True when no process holds the lock on `path` (its owner is gone)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing releases a lock we took


def check_engine_layout(config: EngineConfig) -> list[int]:
    """The engine's GPUs, and its tensor-parallel size against the model's heads (engine/layout.py)."""
    gpus = engine_gpus(config, visible_gpus())
    if config.tensor_parallel_size > 1:
        from transformers import AutoConfig  # not before the engine launches: ~2 s of imports

        check_heads(AutoConfig.from_pretrained(config.model), config.tensor_parallel_size)
    return gpus


def _make_config(model: str | None, config: LabConfig | None, overrides: dict[str, Any]) -> LabConfig:
    """Merge `model` and flat keyword overrides into a LabConfig (each name belongs to one section)."""
    base = config.to_dict() if config is not None else LabConfig().to_dict()
    if model is not None:
        base["engine"]["model"] = str(model)
    sections = {"engine": EngineConfig, "proxy": ProxyConfig, "store": StoreConfig, "harness": HarnessConfig}
    for name, value in overrides.items():
        owner = [s for s, cls in sections.items() if name in cls.__dataclass_fields__]
        if not owner:
            raise TypeError(f"Lab() got an unexpected keyword '{name}'")
        base[owner[0]][name] = value
    return LabConfig.from_dict(base)


def _warn_if_exposed(host: str) -> None:
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        warnings.warn(f"the proxy binds {host}, not loopback: anyone who can reach it and learns a session key "
                      f"can use the model and write into that session", stacklevel=3)


__all__ = ["DEFAULT_MODEL", "Lab"]
