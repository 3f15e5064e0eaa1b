"""polar_lab's Jupyter server extension: one engine forkserver for the Jupyter server's lifetime, named to every kernel.

Why: the first Lab of a fresh kernel waits for torch and vLLM to be imported (most of its 8-11 s on 2 cores); a kernel
that finds a forkserver already running forks its engine from there (engine/forkserver.py) and is up in ~4 s. Started
with the Jupyter server, the server's imports are done before a researcher has opened a notebook, and every kernel
they start or restart afterwards inherits its socket path in POLAR_LAB_FORKSERVER.

Who owns what: the Jupyter server process owns the `ForkServer`; it ends when the Jupyter server exits, however it
exits (the server watches its owner's pipe), and at a clean stop `close()` removes its folder first. Enabled on
install (`polar_lab/jupyter-config/polar_lab.json`, installed as `etc/jupyter/jupyter_server_config.d/polar_lab.json`
by a wheel, by `make setup` for the editable install); off with
`jupyter server extension disable polar_lab.jupyter` or POLAR_LAB_FORKSERVER=off. Where POLAR_LAB_FORKSERVER
already names a server (`polar-lab forkserver`, a test session's), kernels keep using that one and nothing starts.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from polar_lab.engine.forkserver import ENV_VAR, ForkServer


_SERVERS: list[ForkServer] = []  # this process's servers, kept for `_unload_jupyter_server_extension`


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "polar_lab.jupyter"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    server = start_for_kernels()
    if server is None:
        serverapp.log.info("polar_lab: kernels use the forkserver in %s=%s", ENV_VAR, os.environ.get(ENV_VAR))
        return
    serverapp.log.info("polar_lab: engine forkserver %d for this server's kernels (%s)", server.pid, server.path)
    _SERVERS.append(server)


def _unload_jupyter_server_extension(serverapp: Any) -> None:
    while _SERVERS:
        server = _SERVERS.pop()
        server.close()
        if os.environ.get(ENV_VAR) == server.path:
            del os.environ[ENV_VAR]


def start_for_kernels() -> ForkServer | None:
    """Start a forkserver for the default CPU engine's environment and name it in this process's POLAR_LAB_FORKSERVER,
    which the kernels it starts inherit; None (nothing started) where the variable is set already or no server can
    run here (a platform without pidfds)."""
    from polar_lab.config import EngineConfig
    from polar_lab.engine.process_env import engine_env

    if os.environ.get(ENV_VAR) or not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
        return None
    server = ForkServer(engine_env(EngineConfig(), [])).start()
    os.environ[ENV_VAR] = server.path
    return server
