"""A Lab's parts, started in order and taken down in reverse: the run store, the sandbox level, the weights folder
and the engine, the tokenizer and the Run over the folder, the proxy server, the engine's supervisor.

`LabParts(config, engine)` starts them; each stage registers its undoing on one ExitStack before the next begins,
so a start that fails at any stage undoes exactly what was done, and `close()` is that same stack. The Lab
(lab.py) holds one and adds what notebooks call; `startup` keeps each stage's seconds
(benchmarks/lab_startup.py prints them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from polar_lab import sandbox
from polar_lab.config import LabConfig
from polar_lab.engine.launch import EngineLauncher, WeightsFolder, check_engine_layout
from polar_lab.engine.supervisor import EngineSupervisor
from polar_lab.proxy.server import ProxyServer
from polar_lab.run import Run
from polar_lab.store import RunStore
from polar_lab.store.runstore import check_run_name, new_run_name

log = logging.getLogger(__name__)


class LabParts:
    def __init__(self, config: LabConfig, engine=None):
        """Start every part. engine: one already built (a ScriptedEngine in unit tests, or one several Labs share)
        stays its owner's: never restarted, left running at close; None: launched from `config.engine`."""
        self.config = config
        clock = _Phases()
        self.startup = clock.seconds
        self._stack = contextlib.ExitStack()
        self.supervisor, self._first_engine, self.server = None, None, None
        self._owns_engine = engine is None
        try:
            self._open_store()
            self.sandbox_level = self._start_sandbox()
            clock.done("store")
            engine = self._launch_engine(engine, clock)
            self._start_server(engine)  # no call can reach it before this returns: sessions come later
            clock.done("proxy")
            engine.wait_ready()
            clock.done("engine_wait")
            self._supervise(engine)
            clock.done("supervisor")
        except BaseException:
            self._stack.close()
            raise
        self.startup["total"] = sum(self.startup.values())

    def close(self) -> None:
        """Last stage first: the supervisor's work in progress, the server and its loop, the engine, the sandbox
        level, the weights files, the store."""
        self._stack.close()

    def _open_store(self) -> None:
        cfg = self.config
        self.run_dir = Path(cfg.store.runs_dir) / check_run_name(cfg.store.run_name or new_run_name())
        self.writer = RunStore(self.run_dir, fsync=cfg.store.fsync)
        self._stack.callback(self.writer.close)
        self.writer.write_json("config.json", cfg.to_record())
        self.reader = None  # the Run reading this folder, once the tokenizer is loaded

    def _start_sandbox(self) -> str | None:
        """Set this process's sandbox from the harness section; returns the level programs will run at, or
        None where "isolated" cannot run and fallback is off: programs are then refused when they are about to
        run, saying why and how to install bubblewrap; not here, where a Lab that runs none would alarm for nothing.
        Closing puts back the level before it, unless a Lab started after this one set its own."""
        cfg = self.config.harness
        before = sandbox.current()
        level = sandbox.configure(cfg.sandbox, fallback=cfg.sandbox_fallback, uid=cfg.sandbox_uid)
        mine = sandbox.current()

        def put_back() -> None:
            if sandbox.current() == mine:  # only what this Lab set: a Lab started after it keeps its own
                sandbox.configure(**before)

        self._stack.callback(put_back)
        log.info("harness programs and evaluators run at the %r sandbox level", level)
        return level

    def _launch_engine(self, engine, clock: _Phases):
        """The engine, launched (the caller waits for it); the tokenizer and the Run over the folder are loaded while
        its process starts. A passed-in engine is used as it is, never restarted, never closed."""
        cfg = self.config.engine
        if engine is None:
            check_engine_layout(cfg)  # before any process starts
        self.weights = self._stack.enter_context(WeightsFolder(keep=engine is None and cfg.keep_weights,
                                                               reuse=cfg.weights_transport == "memory"))
        self.launcher = EngineLauncher(cfg, log_dir=self.run_dir, weights_dir=self.weights.path)
        if engine is None:
            engine = self.launcher()
        self._first_engine = engine
        self._stack.callback(self._close_engine)
        clock.done("engine_launch")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the proxy tokenises from several threads
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(engine.model_path)  # while the engine process starts
        self.reader = Run(self.run_dir, store=self.writer, tokenizer=self.tokenizer)
        clock.done("tokenizer")
        return engine

    def _start_server(self, engine) -> None:
        """The proxy, serving (proxy/server.py); the run's config.json gains the parsers it chose and the sandbox
        level."""
        cfg = self.config
        self.server = self._stack.enter_context(ProxyServer(
            cfg.proxy, engine, self.tokenizer, self.writer, tool_parser=cfg.engine.tool_parser,
            reasoning_parser=cfg.engine.reasoning_parser))
        self.writer.write_json("config.json", {**cfg.to_record(), "parsers": self.server.parsers,
                                              "sandbox_level": self.sandbox_level})

    def _supervise(self, engine) -> None:
        """The supervisor takes the engine over: restarts it (owned engines only), loads weights, heals."""
        cfg = self.config.engine
        self.supervisor = EngineSupervisor(
            engine, gate=self.server.gate(), factory=self.launcher if self._owns_engine else None,
            max_restarts=cfg.max_restarts, on_swap=self._swap_engine, owns_engine=self._owns_engine)
        self._stack.callback(self.supervisor.quiesce)  # runs first: a restart or load finishes while the loop runs
        self.server.service.engine_status = self.supervisor.status
        self.server.registry.on_close.append(lambda session: self.supervisor.engine.forget(session.id))

    def _swap_engine(self, engine) -> None:
        self.server.service.engine = engine  # calls read it after the gate lets them in

    def _close_engine(self) -> None:
        if self.supervisor is not None:
            self.supervisor.close()
        elif self._owns_engine:
            self._first_engine.close()


class _Phases:
    """Seconds per phase of a Lab's start, in order: `done(name)` closes the phase that began at the previous one."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._last, 4)
        self._last = now
