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

import atexit
import concurrent.futures
import dataclasses
import functools
import ipaddress
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from types import EllipsisType
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import pandas as pd
import torch

from polar_lab.config import DEFAULT_MODEL, LabConfig, make_config
from polar_lab.engine.supervisor import Restart
from polar_lab.engine.weights import weights_size, write_weights
from polar_lab.errors import LabError
from polar_lab.rewards.registry import get_evaluator
from polar_lab.rollout import RolloutSpec, rollout_async
from polar_lab.parts import LabParts
from polar_lab.run import Run
from polar_lab.types import Evaluator, Group, Harness, Session, SyncResult

log = logging.getLogger(__name__)
T = TypeVar("T")


@runtime_checkable
class ShowsTraining(Protocol):
    """What the Lab's dashboard reads of a trainer it holds (GRPOTrainer, grpo/trainer.py, is one): the metrics of
    each step, and each run's reward with its step."""

    history: Sequence[dict[str, Any]]
    reward_log: Sequence[dict[str, Any]]


def _reads(method: Callable[..., T]) -> Callable[..., T]:
    """`Run.method` as a Lab method: it reads the Lab's own run folder (`lab.recorded`), same signature and doc."""
    @functools.wraps(method)
    def read(self: Lab, *args: Any, **kwargs: Any) -> T:
        return method(self.recorded, *args, **kwargs)

    return read


class Lab:
    _live: ClassVar[dict[tuple[str, int | None], Lab]] = {}  # port 0 (always a new Lab) never in it
    _live_lock: ClassVar[threading.Lock] = threading.Lock()

    def __new__(cls, model: str | None = None, *, config: LabConfig | None = None, engine=None, **overrides: Any):
        cfg = make_config(model, config, overrides)
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
        self.config = make_config(model, config, overrides)
        self._owned: list[Any] = []  # trainers and producers that use this Lab; closed before it
        self._last_trainer: Any = None  # the latest trainer released (lab.training() shows its curves)
        _warn_if_exposed(self.config.proxy.host)
        self.parts = parts = LabParts(self.config, engine)  # the start (parts.py); close() takes it down
        self.run_dir, self.store, self.recorded, self.tokenizer = parts.run_dir, parts.store, parts.recorded, \
            parts.tokenizer
        self.server, self.supervisor, self.weights = parts.server, parts.supervisor, parts.weights
        self.port, self.url, self.parsers, self.loop = self.server.port, self.server.url, self.server.parsers, \
            self.server.loop
        self.registry, self.service = self.server.registry, self.server.service
        self.sandbox_level, self.startup = parts.sandbox_level, parts.startup
        with self._live_lock:
            if self.config.proxy.port != 0:
                self._live[(self.config.proxy.host, self.config.proxy.port)] = self
        atexit.register(self.close)
        self._closed, self._started = False, True

    def close(self) -> None:
        """Close what uses the Lab (trainers, producers, dashboards), then its parts, last started first (parts.py).
        Safe to call twice."""
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
        self.parts.close()

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
        if isinstance(owned, ShowsTraining):  # a trainer: the dashboard keeps its curves
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
                seed: int | None = None, spec: RolloutSpec | None = None) -> list[Group]:
        """Run each task `num_generations` times through `harness` (async callable or Command), one Group per task.

        evaluator: a function or a registered name ("final_answer", "unit_tests", "session_completed").
        Crashed or timed-out runs keep their calls, are marked in `session.status` and, with their cause, in
        `session.info["failure"]` (rollout.failure_cause). What bounds a run and scores a failed one is a
        `RolloutSpec` (rollout.py): `spec`, or one of `deadline_s` and the three rewards — `timeout_reward` and
        `overflow_reward` default to `failed_reward`, which defaults to None: masked out of training (fail-closed).
        sampling: forced on every call of every run (see `session`); seed: run i gets sampling seed seed+i,
        and its call k `types.call_seed(seed + i, k)`, so a rollout is reproducible whatever seeds the
        harness sends.
        """
        if spec is None:
            spec = RolloutSpec(deadline_s, failed_reward, failed_reward if timeout_reward is ... else timeout_reward,
                               failed_reward if overflow_reward is ... else overflow_reward)
        return self.run(rollout_async(self, tasks, harness, num_generations=num_generations, spec=spec,
                                      evaluator=get_evaluator(evaluator), concurrency=concurrency, builder=builder,
                                      progress=progress, sampling=sampling, seed=seed))

    # ---- reading the run: Run's own methods over this Lab's folder (one implementation: polar_lab/run.py) ----
    call_records = _reads(Run.call_records)
    calls = _reads(Run.calls)
    sessions = _reads(Run.sessions)
    trajectories = _reads(Run.trajectories)
    chain_breaks = _reads(Run.chain_breaks)
    drift_report = _reads(Run.drift_report)
    sft_dataset = _reads(Run.sft_dataset)
    sft_acceptance = _reads(Run.sft_acceptance)

    def stats(self) -> dict[str, Any]:
        """Live counters (what the dashboard shows): sessions by status, calls and sampled tokens recorded, the
        policy version, the proxy's gate and the engine's state and restarts."""
        statuses = [s.status for s in self.registry.all()]
        engine = self.supervisor.status()
        return {"sessions_running": statuses.count("open"), "sessions_finished": statuses.count("closed"),
                "sessions_failed": statuses.count("error") + statuses.count("timeout"),
                "calls": self.store.num_calls, "output_tokens": self.store.num_output_tokens,
                "policy_version": self.policy_version, "proxy": self.proxy_state,
                "engine_busy_s": self.supervisor.busy_seconds, **engine, **self.engine.replica_counts()}

    def training(self) -> dict[str, Any]:
        """What the dashboard plots of training: the newest attached trainer's metrics per step (`history`) and its
        runs' rewards as (step, reward); without a trainer, the rewards of this Lab's finished runs (step 0)."""
        trainers = self.owned(ShowsTraining)
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
            self.weights.taken(path, kept=self.engine.weights_file == path)  # else removed (not kept, or load failed)
        return dataclasses.replace(result, bytes=size, write_s=write_s, path=self.engine.weights_transport or kind)

    def weights_path(self) -> Path:
        """A fresh path in shared memory for a weights file (or a LoRA adapter's folder) that `sync_weights`
        will load (and keep, with keep_weights) and otherwise delete; one not synced is deleted when the Lab
        closes."""
        return self.weights.new_path()

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

    def replicas(self) -> pd.DataFrame:
        """One row per engine replica (engine/replicas.py): serving, pid, requests in flight, sessions routed to
        it, policy version, busy seconds, restarts (its own, and the whole engine's). A single engine is replica 0."""
        rows = self.engine.replica_status()
        for row in rows:
            row["restarts"] += len(self.engine_restarts)
        return pd.DataFrame(rows)

    def replica_moves(self) -> pd.DataFrame:
        """Every session moved to another replica (its own was dead, out of rotation or over its queue bound)."""
        return pd.DataFrame([dataclasses.asdict(m) for m in self.engine.moves],
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
    def served_as(self) -> str:
        """The model name the proxy serves (what a harness puts in its requests' `model`)."""
        return self.engine.model_name

    @property
    def model_path(self) -> str:
        """The model folder (or hub id) the engine was started from."""
        return self.engine.model_path

    def _check_open(self) -> None:
        if self._closed:
            raise LabError("this Lab is closed; create a new one")


def _warn_if_exposed(host: str) -> None:
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        warnings.warn(f"the proxy binds {host}, not loopback: anyone who can reach it and learns a session key "
                      f"can use the model and write into that session", stacklevel=3)


__all__ = ["DEFAULT_MODEL", "Lab"]
