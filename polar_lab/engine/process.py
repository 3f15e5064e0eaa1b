"""One engine process and its socket, from launch to stop: what `VLLMEngine` holds apart from what it says over it.

    EngineProcess   the shared half: send a command, wait for the worker's "ready", stop (ask, wait, then kill our
                    own pid), the exit code and log of a process that ended
    LocalProcess    forked from the forkserver on this machine (or started fresh where it cannot be), reached over
                    a socketpair; its scratch folder is removed when it is closed
    ActorConnection Ray's replica process (engine/ray_replicas.py): an actor's call that dials back to the kernel

A subclass says how its process starts (`__init__`), how its socket is reached (`connect`) and what is left to free
(`release`); the engine (engine/vllm_engine.py) never asks which kind it holds.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from polar_lab.config import EngineConfig
from polar_lab.engine import forkserver
from polar_lab.engine.layout import engine_gpus, visible_gpus
from polar_lab.engine.process_env import engine_env
from polar_lab.errors import EngineError

log = logging.getLogger(__name__)


class EngineProcess:
    """An engine process (`proc`: pid, poll, wait, kill) and the socket to it (`conn`), once connected."""

    def __init__(self, config: EngineConfig, log_path: Path | None):
        self.config = config
        self.log_path = log_path  # the worker's stdout/stderr (vLLM's logs)
        self.proc: Any = None  # subprocess.Popen, forkserver.ForkedProcess or a Ray ActorProcess
        self.conn: Connection | None = None
        self._send_lock = threading.Lock()

    def connect(self, deadline: float) -> None:
        """Wait until the process exists and `conn` reaches it (raises what its start raised)."""
        raise NotImplementedError

    def started(self) -> Any:
        """The process, if one was started (None when its start failed)."""
        return self.proc

    def release(self) -> None:
        """Free what is left once the process is gone (a folder, a listening socket)."""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def send(self, msg: tuple) -> None:
        """Send one command (from any thread); OSError if the process is gone."""
        with self._send_lock:
            self.conn.send(msg)

    def wait_ready(self, timeout: float) -> dict:
        """Connect, then wait for the worker's "ready" message (its figures); a failed start raises EngineError with
        the end of its log. The caller closes the engine either way it fails."""
        deadline = time.monotonic() + timeout
        self.connect(deadline)
        while time.monotonic() < deadline:
            if self.conn.poll(0.1):
                try:
                    kind, payload = self.conn.recv()
                except EOFError:
                    break
                if kind == "ready":
                    return payload
                raise EngineError(f"vLLM failed to start: {payload}{self.log_tail()}")
            if self.proc.poll() is not None:
                break
        try:
            exited = self.proc.wait(timeout=5)  # it hung up: let it finish exiting, for its code
        except subprocess.TimeoutExpired:
            raise EngineError(f"vLLM did not start within {timeout:.0f} s{self.log_tail()}") from None
        raise EngineError(f"the engine process exited with code {exited} during start-up{self.log_tail()}")

    def stop(self, *, serving: bool) -> None:
        """Ask the process to stop, wait, then kill our own pid if it does not go. serving: it reads commands (a
        process still building vLLM does not, and is killed at once)."""
        proc = self.started()
        if not serving and proc is not None:
            proc.kill()
        if self.conn is not None:
            try:
                self.send(("stop",))
            except OSError:
                pass
        if proc is None:
            return
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            log.warning("engine process %d did not stop within 60 s; killing it", proc.pid)
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Close the socket and free what is left (after the engine's reader has seen the end)."""
        if self.conn is not None:
            self.conn.close()
        self.release()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def exit_code(self) -> int | None:
        """The exit code of a process whose socket just closed (it may take a moment to be reapable)."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, chars: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return f"\n--- {self.log_path} (end) ---\n{self.log_path.read_text(errors='replace')[-chars:]}"


class LocalProcess(EngineProcess):
    """An engine process on this machine. Construction returns at once: a short-lived thread
    ("polar-lab-engine-launch") forks it from the forkserver, or starts it fresh where it cannot be
    (engine/forkserver.py); the start command waits in the socket until the process reads it."""

    def __init__(self, config: EngineConfig, log_path: Path | None):
        super().__init__(config, log_path)
        self.conn, self._launcher, self.scratch = _spawn(config, log_path)  # scratch: its TMPDIR
        self.conn.send(("start", config))

    def connect(self, deadline: float) -> None:
        if self.proc is None:
            self.proc = self._launcher.result()

    def started(self) -> Any:
        try:
            return self.proc or self._launcher.result()
        except BaseException:  # noqa: BLE001 - no process was started: only the socket and the folder are left
            return None

    def release(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def _spawn(config: EngineConfig, log_path: Path | None) -> tuple[Connection, concurrent.futures.Future, str]:
    """Start an engine process for `config`: (the kernel's end of its socket, the future of the process — forked from
    the forkserver, or started fresh where it cannot be, by a short-lived thread — and its scratch folder)."""
    gpus = engine_gpus(config, visible_gpus())
    env = engine_env(config, gpus)  # vLLM's settings, TCMalloc and thread binding on CPU (process_env.py)
    ours, theirs = socket.socketpair()
    if gpus:  # the engine sees its own GPUs only (indices as torch numbers them in this process)
        outer = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = outer.split(",") if outer else [str(g) for g in range(visible_gpus())]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(names[g] for g in gpus)
    # vLLM leaves rendezvous files (vllm_dist_*) in the temp dir; give it one we remove on close
    scratch = tempfile.mkdtemp(prefix="polar-lab-engine-")
    env["TMPDIR"] = scratch
    out = open(log_path, "ab") if log_path else None
    launched: concurrent.futures.Future = concurrent.futures.Future()

    def start() -> None:
        try:
            launched.set_result(forkserver.launch(env, theirs.fileno(), out.fileno() if out else None,
                                                  gpus=bool(gpus)))
        except BaseException as exc:  # noqa: BLE001 - raised by whoever waits for the process
            launched.set_exception(exc)
        finally:
            theirs.close()
            if out is not None:
                out.close()

    threading.Thread(target=start, name="polar-lab-engine-launch", daemon=True).start()
    return Connection(ours.detach()), launched, scratch
