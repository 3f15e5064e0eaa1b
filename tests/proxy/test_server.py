"""ProxyServer (proxy/server.py) on its own, without a Lab: it serves a session's calls from its loop thread, and
closing it — or a start that fails at any stage — leaves no thread, no socket folder and no bound port behind.
A scripted engine: the server's life is the subject, not the model's."""

import os
import socket
import tempfile
import threading

import httpx
import pytest

from polar_lab.config import ProxyConfig
from polar_lab.engine import ScriptedEngine
from polar_lab.errors import LabError
from polar_lab.proxy.server import ProxyServer
from polar_lab.store import RunStore


def _loops() -> int:
    return sum(t.name == "polar-lab-loop" and t.is_alive() for t in threading.enumerate())


def _socket_dirs() -> set[str]:
    roots = {tempfile.gettempdir(), "/tmp"}
    return {os.path.join(r, d) for r in roots for d in os.listdir(r) if d.startswith("polar-lab-proxy-")}


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture
def parts(tokenizer, model_path, tmp_path):
    store = RunStore(tmp_path / "run")
    yield ScriptedEngine(tokenizer, ["Hello there."], model_path=model_path), tokenizer, store
    store.close()


def test_it_serves_a_sessions_call_and_closing_it_leaves_nothing(parts):
    loops, dirs = _loops(), _socket_dirs()
    with ProxyServer(ProxyConfig(port=0), *parts) as server:
        assert _loops() == loops + 1 and os.path.exists(os.path.join(server.socket_dir, "proxy.sock"))
        session = server.registry.create(None)
        reply = httpx.post(f"{session.openai_base_url}/chat/completions", timeout=30,
                           headers={"Authorization": f"Bearer {session.api_key}"},
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "Hello there."
        port = server.port
    assert server.closed and _loops() == loops and _socket_dirs() == dirs and _bindable(port)
    server.close()  # twice: nothing happens


def test_a_start_that_cannot_bind_its_port_leaves_nothing(parts):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        loops, dirs = _loops(), _socket_dirs()
        with pytest.raises(LabError, match="cannot bind"):
            ProxyServer(ProxyConfig(port=taken.getsockname()[1]), *parts)
    assert _loops() == loops and _socket_dirs() == dirs


def test_a_start_whose_server_fails_after_the_loop_started_leaves_nothing(parts, monkeypatch):
    import uvicorn

    async def broken(self, sockets=None):
        raise RuntimeError("uvicorn could not start")

    monkeypatch.setattr(uvicorn.Server, "serve", broken)
    loops, dirs = _loops(), _socket_dirs()
    with pytest.raises(RuntimeError, match="could not start"):
        ProxyServer(ProxyConfig(port=0), *parts)
    assert _loops() == loops and _socket_dirs() == dirs
