"""ProxyServer (proxy/server.py) on its own, without a Lab: it serves a session's calls from its loop thread, and
closing it — or a start that fails at any stage — leaves no thread, no socket folder and no bound port behind.
A scripted engine: the server's life is the subject, not the model's."""

import os
import socket
import threading

import httpx
import pytest

from polar_lab.config import ProxyConfig
from polar_lab.engine import ScriptedEngine
from polar_lab.engine.process_env import socket_dir
from polar_lab.errors import LabError
from polar_lab.proxy.server import ProxyServer
from polar_lab.store import RunStore


def _loops() -> int:
    return sum(t.name == "polar-lab-loop" and t.is_alive() for t in threading.enumerate())


@pytest.fixture
def socket_dirs(monkeypatch) -> list[str]:
    """The socket folders the servers of this test make (other processes of the suite make their own meanwhile, so
    a listing of /tmp before and after would not say whose a folder is)."""
    from polar_lab.proxy import server

    made: list[str] = []

    def recorded(prefix: str) -> str:
        made.append(socket_dir(prefix))
        return made[-1]

    monkeypatch.setattr(server, "socket_dir", recorded)
    return made


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


def test_it_serves_a_sessions_call_and_closing_it_leaves_nothing(parts, socket_dirs):
    loops = _loops()
    with ProxyServer(ProxyConfig(port=0), *parts) as server:
        assert _loops() == loops + 1 and os.path.exists(os.path.join(server.socket_dir, "proxy.sock"))
        session = server.registry.create(None)
        reply = httpx.post(f"{session.openai_base_url}/chat/completions", timeout=30,
                           headers={"Authorization": f"Bearer {session.api_key}"},
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "Hello there."
        port = server.port
    assert socket_dirs == [server.socket_dir]
    assert server.closed and _loops() == loops and not os.path.exists(server.socket_dir) and _bindable(port)
    server.close()  # twice: nothing happens


def test_a_start_that_cannot_bind_its_port_leaves_nothing(parts, socket_dirs):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        loops = _loops()
        with pytest.raises(LabError, match="cannot bind"):
            ProxyServer(ProxyConfig(port=taken.getsockname()[1]), *parts)
    assert _loops() == loops and not any(os.path.exists(d) for d in socket_dirs)


def test_a_start_whose_server_fails_after_the_loop_started_leaves_nothing(parts, socket_dirs, monkeypatch):
    import uvicorn

    async def broken(self, sockets=None):
        raise RuntimeError("uvicorn could not start")

    monkeypatch.setattr(uvicorn.Server, "serve", broken)
    loops = _loops()
    with pytest.raises(RuntimeError, match="could not start"):
        ProxyServer(ProxyConfig(port=0), *parts)
    assert _loops() == loops and len(socket_dirs) == 1 and not os.path.exists(socket_dirs[0])
