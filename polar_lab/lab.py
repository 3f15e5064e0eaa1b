"""The Lab: the one object a notebook holds. It owns the engine process, the proxy's loop thread and the run store.

Threads:
    caller (notebook/main)   creates sessions, reads calls, hands coroutines to the loop (`lab.run`)
    polar-lab-loop           asyncio loop: uvicorn serving the proxy app, harness coroutines
    polar-lab-engine         reads finished generations from the engine process (see engine/vllm_engine.py)
The vLLM engine itself runs in a child process the Lab starts and stops; its log is <run>/engine.log.

One live Lab per (host, port): constructing a Lab with the same config again returns the running one,
so re-running a notebook cell never starts a second server or engine. A different config on the same
port closes the old Lab first. `close()` is idempotent and frees the port, the engine and the files.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import ipaddress
import logging
import os
import socket
import threading
import time
import warnings
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pandas as pd
import torch
import uvicorn

from polar_lab.config import DEFAULT_MODEL, EngineConfig, LabConfig, ProxyConfig, StoreConfig
from polar_lab.errors import LabError
from polar_lab.proxy.app import create_app
from polar_lab.proxy.render import Renderer
from polar_lab.proxy.service import CallService
from polar_lab.proxy.sessions import SessionRegistry
from polar_lab.rewards.registry import get_evaluator
from polar_lab.store import RunStore, calls_frame, load_calls, load_sessions
from polar_lab.store.runstore import check_run_name, new_run_name
from polar_lab.trajectory.builders import BUILDERS
from polar_lab.trajectory.report import chain_breaks, drift_summary
from polar_lab.harness.runtime import Evaluator, Harness, rollout_async
from polar_lab.types import Group, ModelCall, Session, Trajectory

log = logging.getLogger(__name__)
T = TypeVar("T")


class Lab:
    _live: ClassVar[dict[tuple[str, int], Lab]] = {}
    _live_lock: ClassVar[threading.Lock] = threading.Lock()

    def __new__(cls, model: str | None = None, *, config: LabConfig | None = None, engine=None, **overrides: Any):
        cfg = _make_config(model, config, overrides)
        with cls._live_lock:
            existing = cls._live.get((cfg.proxy.host, cfg.proxy.port)) if cfg.proxy.port else None
            if existing is not None and existing._same_setup(cfg):
                return existing
        if existing is not None:
            warnings.warn(f"closing the Lab on port {cfg.proxy.port} (model {existing.config.engine.model}) "
                          f"to start one with a different config", stacklevel=2)
            existing.close()
        lab = super().__new__(cls)
        lab._started = False
        return lab

    def __init__(self, model: str | None = None, *, config: LabConfig | None = None, engine=None,
                 **overrides: Any):
        """Start (or return the running) Lab.

        model: model folder, default `data/models/tiny-calc`.
        overrides: any field of EngineConfig / ProxyConfig / StoreConfig by name (port=0, run_name="x"...).
        engine: an already-built engine (a ScriptedEngine in unit tests); default builds VLLMEngine.
        """
        if self._started:
            return
        self.config = _make_config(model, config, overrides)
        self._closed = False
        self._owned: list[Any] = []  # trainers and producers that use this Lab; closed before it
        self._start(engine)
        self._started = True

    # ---- lifecycle -------------------------------------------------------------------------
    def _start(self, engine) -> None:
        cfg = self.config
        _warn_if_exposed(cfg.proxy.host)
        run_name = check_run_name(cfg.store.run_name or new_run_name())
        self.run_dir = Path(cfg.store.runs_dir) / run_name
        self.store = RunStore(self.run_dir, fsync=cfg.store.fsync)
        self.store.write_json("config.json", cfg.to_dict())
        try:
            self._start_engine(engine)
            self._start_server()
        except BaseException:
            self.close()
            raise
        with self._live_lock:
            if cfg.proxy.port:
                self._live[(cfg.proxy.host, cfg.proxy.port)] = self
        atexit.register(self.close)

    def _start_engine(self, engine) -> None:
        self._engine_given = engine is not None  # a passed-in engine (a fake) cannot be restarted by the Lab
        self._busy_before = 0.0  # busy seconds of engines replaced by restart_engine()
        if engine is None:
            engine = self._new_engine()
        self.engine = engine
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the proxy tokenises from several threads
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(engine.model_path)  # while the engine process starts
        if hasattr(engine, "wait_ready"):
            engine.wait_ready()

    def _new_engine(self):
        from polar_lab.engine.vllm_engine import VLLMEngine

        return VLLMEngine(self.config.engine, log_path=self.run_dir / "engine.log").launch()

    def _start_server(self) -> None:
        cfg = self.config.proxy
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say so, and without it
        # each keep-alive response waits ~40 ms for a delayed ACK (Nagle).
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.port))
        except OSError as exc:
            sock.close()
            raise LabError(f"cannot bind {cfg.host}:{cfg.port} ({exc}); is another Lab or server on it? "
                           f"pass port=0 for a free port") from exc
        self.port = sock.getsockname()[1]
        self.url = f"http://{cfg.host}:{self.port}"
        self.registry = SessionRegistry(self.store, base_url=self.url, auto_sessions=cfg.auto_sessions)
        self.service = CallService(self.engine, Renderer(self.tokenizer), self.registry, self.store, cfg)
        server_config = uvicorn.Config(create_app(self.service), log_level=cfg.uvicorn_log_level, lifespan="off",
                                       timeout_keep_alive=30, access_log=False)
        self._server = uvicorn.Server(server_config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="polar-lab-loop", daemon=True)
        self._thread.start()
        self._serving = asyncio.run_coroutine_threadsafe(self._server.serve(sockets=[sock]), self.loop)
        self._wait_started(sock)

    def _wait_started(self, sock: socket.socket) -> None:
        for _ in range(600):
            if self._server.started:
                return
            if self._serving.done():
                self._serving.result()  # re-raises the start-up error
                raise LabError("the proxy server stopped during start-up")
            threading.Event().wait(0.05)
        raise LabError("the proxy server did not start within 30 s")

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
        if getattr(self, "_server", None) is not None:
            self._server.should_exit = True
            try:
                self._serving.result(timeout=30)
            except Exception:  # noqa: BLE001 - shutting down regardless
                log.debug("server shutdown raised", exc_info=True)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            self.loop.close()
        if getattr(self, "engine", None) is not None:
            self.engine.close()
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

    def owned(self, kind: type) -> list[Any]:
        """The adopted objects of one kind (e.g. the running async rollout producers)."""
        return [o for o in self._owned if isinstance(o, kind)]

    # ---- what notebooks call ---------------------------------------------------------------
    def session(self, task: dict[str, Any] | None = None, *, group_id: str | None = None,
                chat_template: str | None = None, sampling: dict[str, Any] | None = None, **info: Any) -> Session:
        """A new session (one harness run) with its own secret key.

        chat_template: render this session's prompts with another Jinja template (see polar_lab.templates).
        sampling: forced on every call whatever the harness asks: temperature, top_p, top_k, seed, and
            max_tokens (a cap). RL rollouts and evaluations use it to fix the sampling distribution.
        info: free-form facts stored with the session, e.g. harness="claude-code" (used by drift_report).
        """
        self._check_open()
        return self.registry.create(task, group_id=group_id, info=info, chat_template=chat_template,
                                    sampling=sampling)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the Lab's loop and wait for it (works inside Jupyter's own running loop)."""
        self._check_open()
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start a coroutine on the Lab's loop and return at once."""
        self._check_open()
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def rollout(self, tasks: list[dict[str, Any]], harness: Harness, *, num_generations: int = 8,
                evaluator: str | Evaluator | None = None, concurrency: int = 32, deadline_s: float = 600.0,
                builder: str = "prefix_merging", progress: bool = True,
                failed_reward: float | None = None, sampling: dict[str, Any] | None = None,
                seed: int | None = None) -> list[Group]:
        """Run each task `num_generations` times through `harness` (async callable or Command), one Group per task.

        evaluator: a function or a registered name ("final_answer", "unit_tests", "session_completed").
        Crashed or timed-out runs keep their calls, are marked in `session.status`, and get `failed_reward`:
        None by default, i.e. masked out of training (fail-closed); pass 0.0 to score them 0 instead.
        sampling: forced on every call of every run (see `session`); seed: run i gets sampling seed seed+i,
        so a rollout is reproducible whatever seeds the harness sends.
        """
        return self.run(rollout_async(self, tasks, harness, num_generations=num_generations,
                                      evaluator=get_evaluator(evaluator), concurrency=concurrency,
                                      deadline_s=deadline_s, builder=builder, progress=progress,
                                      failed_reward=failed_reward, sampling=sampling, seed=seed))

    def call_records(self) -> list[ModelCall]:
        """Every recorded call of this run, read back from the run folder."""
        return load_calls(self.run_dir)

    def calls(self) -> pd.DataFrame:
        """One row per recorded call (pandas)."""
        return calls_frame(self.call_records())

    def sessions(self) -> pd.DataFrame:
        return load_sessions(self.run_dir)

    def trajectories(self, builder: str = "prefix_merging", *, session_ids: list[str] | None = None,
                     ) -> list[Trajectory]:
        """Training samples rebuilt from the recorded calls; each carries its session's reward."""
        if builder not in BUILDERS:
            raise ValueError(f"unknown builder {builder!r}; choose from {sorted(BUILDERS)}")
        trajectories = BUILDERS[builder](self._calls_of(session_ids))
        sessions = {s.id: s for s in self.registry.all()}
        for traj in trajectories:
            session = sessions.get(traj.session_id)
            traj.reward = session.reward if session is not None else None
        return trajectories

    def chain_breaks(self, *, session_ids: list[str] | None = None) -> pd.DataFrame:
        """Every prefix-merging chain break of this run (or of these sessions), classified
        (see polar_lab.trajectory.drift)."""
        harness_of = {s.id: str(s.info.get("harness", "unknown")) for s in self.registry.all()}
        return chain_breaks(self._calls_of(session_ids), self.tokenizer, harness_of)

    def drift_report(self) -> pd.DataFrame:
        """Chain breaks counted by harness and class, with an example of each."""
        return drift_summary(self.chain_breaks())

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        """Load new weights into the live engine at once (no pause); returns the new policy version.

        Calls in flight continue with the new weights from the next engine step; their tokens record
        which version sampled them. For a clean cut between versions use `sync_weights`.
        """
        self._check_open()
        return self.engine.load_weights(state_dict)

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], *, drain_timeout: float = 30.0) -> dict[str, Any]:
        """Weight sync: pause the proxy (new calls wait), drain in-flight calls (up to `drain_timeout`),
        load the weights into the live engine, bump `policy_version`, resume.

        Returns {"policy_version", "undrained" (calls still in flight when loading), "drain_s", "load_s",
        "sync_s"}.
        """
        self._check_open()
        gate = self.service.gate
        t0 = time.perf_counter()
        undrained = self.run(gate.pause(drain_timeout))
        t1 = time.perf_counter()
        try:
            version = self.engine.load_weights(state_dict)
        finally:
            self.run(gate.resume())
        t2 = time.perf_counter()
        return {"policy_version": version, "undrained": undrained, "drain_s": t1 - t0, "load_s": t2 - t1,
                "sync_s": t2 - t0}

    def restart_engine(self, state_dict: Mapping[str, torch.Tensor] | None = None, *, version: int | None = None,
                       drain_timeout: float = 30.0, startup_timeout: float = 900.0) -> dict[str, Any]:
        """Replace the engine process with a fresh one — after it died (calls get 503 `engine_unavailable`),
        or to clear a wedged one. The proxy, its sessions and keys, and the run's records carry on; new calls
        wait at the paused proxy while the engine starts, calls still in flight after `drain_timeout` fail.

        The new engine loads the model from disk. Once weights were synced (policy_version > 0), pass the
        current ones — `lab.restart_engine(trainer.policy.state_dict())` — or this refuses, rather than
        silently rolling training back to the shipped weights. They are loaded as `version`, by default the
        version the old engine served: right when the trainer's weights are the ones last synced. If the
        engine died *during* a sync, the trainer is one update ahead: pass `version=lab.policy_version + 1`.
        If the new engine fails to start, the error is raised and the Lab keeps answering 503s; call again.
        Returns {"policy_version", "startup_s"}.
        """
        self._check_open()
        if version is not None and state_dict is None:
            raise LabError(f"version={version} names the weights passed in; pass them as state_dict")
        if self._engine_given:
            raise LabError("this Lab was given its engine (engine=...); it cannot start another")
        gate = self.service.gate
        t0 = time.perf_counter()
        self.run(gate.pause(drain_timeout))  # from here no call reaches an engine, and no sync runs
        try:
            old = self.engine
            if old.policy_version and state_dict is None:
                raise LabError(f"the engine was serving policy version {old.policy_version}; restarting from "
                               f"the weights on disk would roll it back to 0 — pass the current weights, e.g. "
                               f"lab.restart_engine(trainer.policy.state_dict())")
            version = old.policy_version if version is None else version
            old.close()  # fails what is still in flight (503), ends the old process by its pid
            new = self._ready_engine(state_dict, version, startup_timeout)
            self._busy_before, self.engine = self._busy_before + old.busy_seconds, new
            self.service.engine = new  # calls read it after the gate lets them in
        finally:
            if not self._closed:
                self.run(gate.resume())
        log.info("engine restarted (pid %s, policy version %d)", new.pid, new.policy_version)
        return {"policy_version": new.policy_version, "startup_s": time.perf_counter() - t0}

    def _ready_engine(self, state_dict: Mapping[str, torch.Tensor] | None, version: int, timeout: float):
        """A new engine process, started and loaded with `state_dict` as `version`; closed again on failure,
        or when the Lab closed while it started (nothing would close it later)."""
        new = self._new_engine()
        try:
            new.wait_ready(timeout)
            if state_dict is not None:
                new.load_weights(state_dict, version=version)
            if self._closed:
                raise LabError("the Lab closed while its engine restarted")
        except BaseException:
            new.close()
            raise
        return new

    def dashboard(self, *, interval: float = 1.0, start: bool = True):
        """A live ipywidgets dashboard of this Lab (sessions, calls/s, tokens/s, version, proxy state).
        Display it as the last expression of a cell; it refreshes every `interval` s until the Lab closes."""
        from polar_lab.viz.dashboard import Dashboard

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
        return self._busy_before + float(getattr(self.engine, "busy_seconds", 0.0))

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def _calls_of(self, session_ids: list[str] | None) -> list[ModelCall]:
        """All recorded calls, or only these sessions' (read by offset, not by scanning the run)."""
        return self.call_records() if session_ids is None else self.store.read_calls(session_ids)

    def _check_open(self) -> None:
        if self._closed:
            raise LabError("this Lab is closed; create a new one")


def _make_config(model: str | None, config: LabConfig | None, overrides: dict[str, Any]) -> LabConfig:
    """Merge `model` and flat keyword overrides into a LabConfig (each name belongs to one section)."""
    base = config.to_dict() if config is not None else LabConfig().to_dict()
    if model is not None:
        base["engine"]["model"] = str(model)
    sections = {"engine": EngineConfig, "proxy": ProxyConfig, "store": StoreConfig}
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
