"""The proxy, serving: `ProxyServer` owns its two doors (a TCP port, and the unix socket isolated sandboxes reach it
by), the asyncio loop thread that runs uvicorn and the harness coroutines, and the call service wired to an engine.

A context manager. `close()` stops the server, cancels what still runs on the loop (a rollout cut off), stops the
thread and removes the socket's folder; a start that fails part-way undoes what it had done, in reverse, and
raises. The Lab (lab.py) composes one with an engine and a run folder; the engine is the Lab's, the store is the
Lab's, the sessions and the loop are the server's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import logging
import os
import secrets
import shutil
import socket
import threading
import warnings
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvicorn

from polar_lab.config import ProxyConfig
from polar_lab.engine.process_env import socket_dir
from polar_lab.errors import LabError
from polar_lab.proxy.app import create_app
from polar_lab.proxy.formats import resolve_parsers, tool_format
from polar_lab.proxy.keepalive import KeepAliveProtocol
from polar_lab.proxy.parse import OutputParser
from polar_lab.proxy.pause import PAUSED, PauseState
from polar_lab.proxy.render import Renderer
from polar_lab.proxy.service import CallService
from polar_lab.proxy.sessions import SessionRegistry
from polar_lab.store import RunStore

log = logging.getLogger(__name__)
T = TypeVar("T")
START_TIMEOUT_S = 30.0


class ProxyServer:
    def __init__(self, cfg: ProxyConfig, engine, tokenizer, store: RunStore, *, tool_parser: str | None = "auto",
                 reasoning_parser: str | None = "auto"):
        """Bind, wire and start serving; returns once the server accepts connections. `tool_parser` and
        `reasoning_parser` are the engine config's names ("auto" picks from the tokenizer's chat template)."""
        self.config = cfg
        self._closed = False
        with contextlib.ExitStack() as undo:  # what a failed start must take back, in reverse
            sock = self._bind(cfg)
            undo.callback(sock.close)
            self.socket_dir = socket_dir("polar-lab-proxy-")
            undo.callback(shutil.rmtree, self.socket_dir, ignore_errors=True)
            unix = self._unix_socket()
            undo.callback(unix.close)
            shared = "pl-shared-" + secrets.token_urlsafe(32) if cfg.shared_key == "auto" else cfg.shared_key
            self.registry = SessionRegistry(store, base_url=self.url, auto_sessions=cfg.auto_sessions,
                                            proxy_socket=unix.getsockname(), shared_key=shared,
                                            create_named=cfg.create_named_sessions)
            tool, reasoning = resolve_parsers(tool_parser, reasoning_parser, tokenizer.chat_template or "")
            self.parsers = {"tool_parser": tool, "reasoning_parser": reasoning}  # what reads the model's output
            renderer = Renderer(tokenizer, tool_format(tool, tokenizer.chat_template or ""))
            self.service = CallService(engine, renderer, self.registry, store, cfg,
                                       parser=OutputParser(tokenizer, tool, reasoning))
            self._server = uvicorn.Server(uvicorn.Config(create_app(self.service), log_level=cfg.uvicorn_log_level,
                                                         lifespan="off", timeout_keep_alive=cfg.keep_alive_s,
                                                         http=KeepAliveProtocol, access_log=False))
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, name="polar-lab-loop", daemon=True)
            self._thread.start()
            undo.callback(self._stop_loop)
            self._serving = asyncio.run_coroutine_threadsafe(self._server.serve(sockets=[sock, unix]), self.loop)
            undo.callback(self._stop_server)
            self._wait_started()
            undo.pop_all()  # started: close() owns all of it now

    def _bind(self, cfg: ProxyConfig) -> socket.socket:
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say so, and without it
        # each keep-alive response waits ~40 ms for a delayed ACK (Nagle).
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.port or 0))
        except OSError as exc:
            sock.close()
            raise LabError(f"cannot bind {cfg.host}:{cfg.port} ({exc}); is another Lab or server on it? "
                           f"leave port unset for a free one") from exc
        self.port = sock.getsockname()[1]
        self.url = f"http://{cfg.host}:{self.port}"
        return sock

    def _unix_socket(self) -> socket.socket:
        """The proxy's second door: a unix socket that isolated sandboxes (no network of their own) reach it
        by (polar_lab/sandbox/launch.py forwards the session's address to it). Any local user may connect,
        as to the TCP port; a session key is still needed."""
        os.chmod(self.socket_dir, 0o755)
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(os.path.join(self.socket_dir, "proxy.sock"))
        os.chmod(unix.getsockname(), 0o666)  # connecting needs write permission on the socket file
        return unix

    def _wait_started(self) -> None:
        for _ in range(int(START_TIMEOUT_S / 0.05)):
            if self._server.started:
                return
            if self._serving.done():
                self._serving.result()  # re-raises the start-up error
                raise LabError("the proxy server stopped during start-up")
            threading.Event().wait(0.05)
        raise LabError(f"the proxy server did not start within {START_TIMEOUT_S:.0f} s")

    # ---- the loop, for callers on other threads ------------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the server's loop and wait for it (works inside Jupyter's own running loop)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start a coroutine on the server's loop and return at once."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def gate(self) -> LoopGate:
        """The proxy's pause state, driven from another thread (the engine supervisor's `Gate`)."""
        return LoopGate(self.service.gate, self.loop)

    # ---- closing ---------------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop serving, cancel what runs on the loop, stop the loop's thread, remove the socket. Safe twice."""
        if self._closed:
            return
        self._closed = True
        self._stop_server()
        self._cancel_pending()
        self._stop_loop()
        shutil.rmtree(self.socket_dir, ignore_errors=True)

    def _stop_server(self) -> None:
        self._server.should_exit = True
        try:
            self._serving.result(timeout=30)
        except Exception:  # noqa: BLE001 - shutting down regardless
            log.debug("server shutdown raised", exc_info=True)

    def _cancel_pending(self, timeout: float = 30.0) -> None:
        """Cancel what still runs on the loop — a rollout the close cut off — and wait for it to unwind: its harness
        programs are killed and their workdirs removed by their own cleanup, and whoever waits in `run` gets the
        cancellation instead of waiting forever on a stopped loop."""
        async def cancel() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)

        try:
            asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(timeout + 5)
        except Exception:  # noqa: BLE001 - shutting down regardless
            log.warning("runs still on the loop did not unwind within %.0f s", timeout, exc_info=True)

    def _stop_loop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()

    def __enter__(self) -> ProxyServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LoopGate:
    """The proxy's PauseState (owned by the loop) driven from another thread: the supervisor's `Gate`."""

    def __init__(self, state: PauseState, loop: asyncio.AbstractEventLoop):
        self.state = state
        self.loop = loop

    def pause(self, drain_timeout: float) -> int:
        pausing = asyncio.run_coroutine_threadsafe(self.state.pause(drain_timeout), self.loop)
        try:
            return pausing.result()
        except BaseException:  # e.g. a notebook interrupt during the drain: the pause still completes on the
            pausing.add_done_callback(lambda _: self._resume_soon())  # loop, so undo it once it has
            raise

    def resume(self) -> None:
        asyncio.run_coroutine_threadsafe(self.state.resume(), self.loop).result(timeout=30)

    def _resume_soon(self) -> None:
        try:
            self.loop.call_soon_threadsafe(
                lambda: self.state.state == PAUSED and self.loop.create_task(self.state.resume()))
        except RuntimeError:
            pass  # the loop is closed: the server is gone, and its gate with it


def warn_if_exposed(host: str, *, stacklevel: int = 1) -> None:
    """Warn when `host` is not a loopback address: the proxy is then reachable from the network. stacklevel 1 points
    the warning at the caller, 2 at the caller's caller."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        warnings.warn(f"the proxy binds {host}, not loopback: anyone who can reach it and learns a session key "
                      f"can use the model and write into that session", stacklevel=stacklevel + 1)
