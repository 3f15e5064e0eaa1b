"""The Lab: the one object a notebook holds — its parts (parts.py: run store, engine and supervisor, proxy server),
Run's reads over its folder, its views (viz/views.py), and what notebooks call: sessions, rollouts, weight syncs.

Threads: the caller's (sessions, reads; `lab.run` hands coroutines to the loop), "polar-lab-loop" (uvicorn and the
harness coroutines: proxy/server.py), "polar-lab-engine" (engine/vllm_engine.py) and "polar-lab-heal"
(engine/supervisor.py). The vLLM engine runs in a child process; its log is <run>/engine.log. If it dies, the
Lab starts another at the same weights and policy version (`EngineConfig.max_restarts`).

One live Lab per (host, port): constructing a Lab with the same config again returns the running one, so re-running
a notebook cell never starts a second server or engine. The default port (None) is a free port chosen by the first
Lab of the process ("this kernel's Lab"); a different config on the same port closes the old Lab first. `close()`
is idempotent and frees the port, the engine and the files.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import logging
import operator
import threading
import warnings
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from types import EllipsisType
from typing import Any, ClassVar, TypeVar

import torch

from polar_lab.config import DEFAULT_MODEL, LabConfig, engine_settings, make_config
from polar_lab.engine.supervisor import Restart, sync_weights
from polar_lab.errors import LabError
from polar_lab.parts import LabParts
from polar_lab.proxy.server import warn_if_exposed
from polar_lab.replay import replay as _replay
from polar_lab.rewards.registry import get_evaluator
from polar_lab.rollout import RolloutSpec, rollout_async
from polar_lab.run import Run
from polar_lab.types import Evaluator, Group, Harness, Session, SyncResult
from polar_lab.viz.views import LabViews, ShowsTraining

log = logging.getLogger(__name__)
T = TypeVar("T")


def _reads(method: Callable[..., T]) -> Callable[..., T]:
    """`Run.method` as a Lab method: it reads the Lab's own run folder (`lab.reader`), same signature and doc."""
    @functools.wraps(method)
    def read(self: Lab, *args: Any, **kwargs: Any) -> T:
        return method(self.reader, *args, **kwargs)

    return read


def _part(path: str, doc: str = "") -> property:
    """An attribute of the Lab's parts (`server.port` is `lab.parts.server.port`) as a read-only Lab attribute."""
    return property(operator.attrgetter(f"parts.{path}"), doc=doc or f"`lab.parts.{path}` (parts.py)")


class Lab(LabViews):
    _live: ClassVar[dict[tuple[str, int | None], Lab]] = {}  # port 0 (always a new Lab) never in it
    _live_lock: ClassVar[threading.Lock] = threading.Lock()

    # what its parts hold (parts.py): the run folder, its writer (a RunStore) and its reader (a Run); the tokenizer, the
    # weights folder, the engine's supervisor; the sandbox level, each start stage's seconds; the proxy server and its
    # parts
    run_dir, writer, reader = _part("run_dir"), _part("writer"), _part("reader")
    tokenizer, weights, supervisor = _part("tokenizer"), _part("weights"), _part("supervisor")
    sandbox_level, startup, server = _part("sandbox_level"), _part("startup"), _part("server")
    port, url, loop = _part("server.port"), _part("server.url"), _part("server.loop")
    parsers, registry, service = _part("server.parsers"), _part("server.registry"), _part("server.service")
    engine = _part("supervisor.engine", "the live engine (a new object after each restart)")
    policy_version = _part("supervisor.engine.policy_version", "the version of the weights new tokens sample with")
    served_as = _part("supervisor.engine.model_name", "the model name the proxy serves (requests' `model`)")
    model_path = _part("supervisor.engine.model_path", "the model folder (or hub id) the engine started from")

    def __new__(cls, model: str | None = None, *, config: LabConfig | None = None, engine=None, **overrides: Any):
        config, engine = engine_settings(model, config, engine)
        cfg = make_config(model, config, overrides)
        with cls._live_lock:
            existing = cls._live.get((cfg.proxy.host, cfg.proxy.port)) if cfg.proxy.port != 0 else None
            if existing is not None and not existing.closed and existing.config == cfg:  # the same setup
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
            owner's: the Lab never restarts it and leaves it running when it closes. An EngineConfig: its settings.
        """
        if self._started:
            return
        config, engine = engine_settings(model, config, engine)
        self.config = make_config(model, config, overrides)
        self._owned: list[Any] = []  # trainers and producers that use this Lab; closed before it
        self._last_trainer: Any = None  # the latest trainer released (lab.training() shows its curves)
        warn_if_exposed(self.config.proxy.host, stacklevel=2)  # at the Lab(...) line
        self.parts = LabParts(self.config, engine)  # the start (parts.py); close() takes it down
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
                continuity: str | None = None, name: str | None = None, replay: Any = None,
                **info: Any) -> Session:
        """A new session (one harness run) with its own secret key.

        chat_template: render this session's prompts with another Jinja template (see polar_lab.templates).
        sampling: forced on every call whatever the harness asks: temperature, top_p, top_k, banned_strings,
            seed (the run's: call k samples with `types.call_seed(seed, k)`, its own random stream) and
            max_tokens (a cap). RL rollouts and evaluations use it to fix the sampling distribution.
        continuity: "splice" (echoed turns the proxy produced go back as their sampled ids) or "template"
            (re-rendered by the chat template); None: the Lab's `ProxyConfig.continuity`. See proxy/splice.py.
        name: what a request under the Lab's shared key (`ProxyConfig.shared_key`) calls this session in its
            `X-Session-ID` header (or `session_field`); its id works as well. Unique in the Lab.
        replay: a proxy/replay.py Script its first calls are answered from (`lab.replay` makes them).
        info: free-form facts stored with the session, e.g. harness="claude-code" (used by drift_report).
        """
        self._check_open()
        return self.registry.create(task, group_id=group_id, info=info, chat_template=chat_template,
                                    sampling=sampling, continuity=continuity, name=name, replay=replay)

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

        evaluator: a function or a registered name ("final_answer", "unit_tests", "repo_tests", "session_completed").
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

    replay = _replay  # lab.replay(session_id, until_turn=k, harness=..., branches=N): polar_lab/replay.py

    # ---- reading the run: Run's own methods over this Lab's folder (one implementation: polar_lab/run.py) ----
    call_records = _reads(Run.call_records)
    calls = _reads(Run.calls)
    sessions = _reads(Run.sessions)
    trajectories = _reads(Run.trajectories)
    chain_breaks = _reads(Run.chain_breaks)
    drift_report = _reads(Run.drift_report)
    sft_dataset = _reads(Run.sft_dataset)
    sft_acceptance = _reads(Run.sft_acceptance)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        """Load new weights into the live engine at once (no pause); returns the new policy version. The same path
        as `sync_weights(state_dict, pause="keep")`: the Lab's shared-memory slot and the standby copy.

        Calls in flight continue with the new weights from the next engine step; their tokens record
        which version sampled them. For a clean cut between versions use `sync_weights`.
        """
        return self.sync_weights(state_dict, pause="keep").policy_version

    def sync_weights(self, weights: Mapping[str, torch.Tensor] | str | Path, *, drain_timeout: float = 30.0,
                     pause: str = "drain") -> SyncResult:
        """Weight sync: pause the proxy (new calls wait), drain in-flight calls (up to `drain_timeout`), load the
        weights into the live engine, bump `policy_version`, resume; `pause="keep"`: no drain — calls in flight are
        held between two engine steps for the load and go on with the new weights (their tokens say which sampled
        them). If the engine dies during the load, a new one is started with these weights, at the next version.
        `weights`: HF-named tensors (`lm_head.weight` included), written first — before the pause — into the Lab's
        shared-memory slot in the engine's dtype; or the path of a safetensors file already written (a trainer
        writes straight from its ranks to `weights_path()`: engine/weights.py), which the engine keeps as the served
        weights' copy if it is the Lab's. A CPU engine keeps a standby copy (`EngineConfig.standby_weights`): the
        weights load into it before the pause, while the engine serves, and the pause only swaps it in (`swapped`).
        The result says how many bytes moved, how they travelled, and the write, preload and pause times."""
        self._check_open()
        return sync_weights(self.supervisor, weights, self.weights, drain_timeout, pause)

    def weights_path(self, *, adapter: bool = False) -> Path:
        """Where to write weights for `sync_weights`: of two files in shared memory the Lab reuses, the one not served
        (written in place: `WeightsFolder.slot`); with `adapter`, a fresh path for a LoRA adapter's folder (deleted
        once superseded or unsynced at close). Write floating tensors as `engine.weights_dtype`."""
        return self.weights.new_path() if adapter else self.weights.slot(self.supervisor.engine.weights_file)

    def restart_engine(self, state_dict: Mapping[str, torch.Tensor] | None = None, *, version: int | None = None,
                       drain_timeout: float = 30.0, startup_timeout: float = 900.0) -> Restart:
        """Replace the engine process with a fresh one now — to clear a wedged one, or after it died and the Lab's
        own restarts (`max_restarts`) were spent. The proxy, its sessions and keys, and the run's records carry on;
        new calls wait at the paused proxy while the engine starts, calls in flight after `drain_timeout` get a 503.
        The new engine serves what the old one served (the model from disk at version 0, or the last load's kept
        weights at their version), or `state_dict` as `version` (default: the old engine's). Without kept weights
        (`keep_weights=False`) past version 0 it refuses rather than silently roll training back. If the new
        engine fails to start, the error is raised and the Lab keeps answering 503s; call again.
        Returns the restart's record (policy_version, startup_s...)."""
        self._check_open()
        return self.supervisor.restart(state_dict, version=version, drain_timeout=drain_timeout,
                                       startup_timeout=startup_timeout)

    @property
    def store(self):
        """Deprecated name of `writer` (the RunStore writing the run folder); goes in the next release."""
        warnings.warn("lab.store is now lab.writer", DeprecationWarning, stacklevel=2)
        return self.writer

    @property
    def recorded(self) -> Run:
        """Deprecated name of `reader` (the Run reading the run folder); goes in the next release."""
        warnings.warn("lab.recorded is now lab.reader", DeprecationWarning, stacklevel=2)
        return self.reader

    def _check_open(self) -> None:
        if self._closed:
            raise LabError("this Lab is closed; create a new one")


__all__ = ["DEFAULT_MODEL", "Lab"]
