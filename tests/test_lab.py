"""Lab lifecycle: idempotent per port, context manager, close frees everything.

Each test builds a Lab of its own over a ScriptedEngine (no vLLM starts): the ports, threads and proxy connections
under test must belong to that Lab alone, so none can share the suite's."""

import socket
import threading
import warnings

import pytest

from polar_lab import Lab
from polar_lab.engine import ScriptedEngine
from polar_lab.errors import LabError
from polar_lab.parts import LabParts
from tests.conftest import free_port


def _threads(name):
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def _port_is_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_constructing_the_same_lab_again_returns_the_running_one(lab, runs_dir):
    # What re-running `lab = Lab(...)` in a notebook cell does: no second server, no second engine (the suite holds
    # other engines and Labs at the same time: counted before and after)
    engines, loops = len(_threads("polar-lab-engine")), len(_threads("polar-lab-loop"))
    again = Lab(lab.config.engine.model, port=lab.port, runs_dir=str(runs_dir), run_name="shared")
    assert again is lab
    assert len(_threads("polar-lab-engine")) == engines
    assert len(_threads("polar-lab-loop")) == loops


def _scripted(tokenizer, model_path):
    return ScriptedEngine(tokenizer, ["ok"], model_path=model_path)


def test_with_block_twice_leaves_nothing_behind(tokenizer, model_path, tmp_path):
    port = free_port()
    loops_before = len(_threads("polar-lab-loop"))
    for _ in range(2):  # the same cell run twice
        with Lab(port=port, engine=_scripted(tokenizer, model_path), runs_dir=str(tmp_path)) as lab:
            assert len(_threads("polar-lab-loop")) == loops_before + 1
        assert lab.closed and _port_is_free(port)
        assert len(_threads("polar-lab-loop")) == loops_before


def test_a_different_config_on_the_same_port_replaces_the_old_lab(tokenizer, model_path, tmp_path):
    port = free_port()
    first = Lab(port=port, engine=_scripted(tokenizer, model_path), runs_dir=str(tmp_path), run_name="a")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = Lab(port=port, engine=_scripted(tokenizer, model_path), runs_dir=str(tmp_path), run_name="b")
    try:
        assert first.closed and not second.closed
        assert any("different config" in str(w.message) for w in caught)
    finally:
        second.close()


def test_the_default_port_is_free_and_stands_for_this_kernels_lab(tokenizer, model_path, tmp_path):
    # Notebooks leave the port unset: a JupyterLab (or anything) holding a fixed port must not break them,
    # and re-running the cell must still return the running Lab.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        first = Lab(engine=_scripted(tokenizer, model_path), runs_dir=str(tmp_path), run_name="k")
        try:
            again = Lab(engine=_scripted(tokenizer, model_path), runs_dir=str(tmp_path), run_name="k")
            assert again is first
            assert first.config.proxy.port is None and first.port not in (0, taken)
            assert first.url.endswith(f":{first.port}")
        finally:
            first.close()
    assert _port_is_free(first.port)


def test_close_is_idempotent_and_a_closed_lab_refuses_work(tokenizer, model_path, tmp_path):
    lab = Lab(port=0, engine=_scripted(tokenizer, model_path), runs_dir=str(tmp_path))
    lab.close()
    lab.close()
    with pytest.raises(LabError, match="closed"):
        lab.session()


def test_a_taken_port_is_a_clear_error(tokenizer, model_path, tmp_path):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        with pytest.raises(LabError, match=str(port)):
            Lab(port=port, engine=_scripted(tokenizer, model_path), runs_dir=str(tmp_path))


def test_binding_beyond_loopback_warns(tokenizer, model_path, tmp_path):
    with pytest.warns(UserWarning, match="not loopback"):
        lab = Lab(host="0.0.0.0", port=0, engine=_scripted(tokenizer, model_path), runs_dir=str(tmp_path))
    lab.close()


def test_restart_engine_refuses_what_it_cannot_do_safely(scripted_lab):
    # a Lab that was handed its engine (a fake here) does not know how to build another one
    with pytest.raises(LabError, match="given its engine"):
        scripted_lab.restart_engine()
    # a version names weights: without them it would label the weights on disk
    with pytest.raises(LabError, match="pass them as state_dict"):
        scripted_lab.restart_engine(version=3)
    assert scripted_lab.proxy_state["pauses"] == 0  # refused before the proxy was paused


def test_the_labs_sandbox_level_holds_while_it_is_open_and_is_recorded(tokenizer, model_path, tmp_path):
    """`Lab(sandbox="process")` sets the level its programs and evaluators run at (a process-wide default),
    records it in the run's config, and puts back the level before it when it closes."""
    import json

    from polar_lab import sandbox

    before = sandbox.current()
    with Lab(port=0, engine=_scripted(tokenizer, model_path), runs_dir=str(tmp_path), run_name="proc",
             sandbox="process") as lab:
        assert lab.sandbox_level == "process" and sandbox.run(["true"], timeout=5).level == "process"
        assert json.loads((lab.run_dir / "config.json").read_text())["sandbox_level"] == "process"
    assert sandbox.current() == before


def test_a_lab_starts_under_a_tmpdir_too_deep_for_a_unix_socket(tokenizer, model_path, tmp_path, monkeypatch):
    """pytest's and CI's temporary folders can be deeper than an AF_UNIX address allows (108 bytes): the proxy's
    socket for isolated sandboxes then goes under /tmp ("AF_UNIX path too long" before), and is removed at close."""
    import os
    import tempfile

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with Lab(port=0, engine=_scripted(tokenizer, model_path), runs_dir=str(tmp_path / "runs")) as lab:
        path = os.path.join(lab.server.socket_dir, "proxy.sock")
        assert os.path.exists(path) and len(path) < 108 and not path.startswith(str(deep))
    assert not os.path.exists(path)


def test_an_engine_that_fails_while_the_lab_waits_for_it_leaves_no_proxy_behind(tokenizer, model_path, tmp_path,
                                                                                 monkeypatch):
    """The proxy is already serving when the Lab waits for its engine (the two start side by side): a failure there
    closes the proxy server — its loop thread, its socket folder, its port — and puts the sandbox level back."""
    import os

    from polar_lab import sandbox
    from polar_lab.errors import EngineError

    class FailsToStart(ScriptedEngine):
        def wait_ready(self, timeout: float = 900.0):
            raise EngineError("the engine process exited during start-up")

    loops, level = len(_threads("polar-lab-loop")), sandbox.current()
    seen = {}
    original = LabParts._start_server

    def spy(self, engine):
        original(self, engine)
        seen.update(port=self.server.port, socket_dir=self.server.socket_dir)

    monkeypatch.setattr(LabParts, "_start_server", spy)
    with pytest.raises(EngineError, match="exited during start-up"):
        Lab(port=0, engine=FailsToStart(tokenizer, ["ok"], model_path=model_path), runs_dir=str(tmp_path))
    assert seen and len(_threads("polar-lab-loop")) == loops and sandbox.current() == level
    assert not os.path.exists(seen["socket_dir"]) and _port_is_free(seen["port"])


STAGES = ["store", "engine_launch", "tokenizer", "proxy", "engine_wait", "supervisor"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_start_that_fails_at_any_stage_leaves_nothing_behind(stage, tokenizer, model_path, tmp_path, monkeypatch):
    """A Lab that owns its engine (launched by its EngineLauncher — a scripted one here: the Lab's start is the
    subject) fails at the end of each stage in turn: what the stages before it made is undone — the engine closed,
    the kept-weights folder in /dev/shm removed, the proxy's loop thread, socket folder and port gone, the sandbox
    level put back, the run store's files closed."""
    import os

    from polar_lab import parts as parts_module
    from polar_lab import sandbox

    class Boom(Exception):
        pass

    def done(self, name):
        if name == stage:
            raise Boom(name)
        self.seconds[name] = 0.0

    engines, folders, labs, start = [], [], [], LabParts.__init__

    def launch(self):
        folders.append(self.weights_dir)
        engines.append(_scripted(tokenizer, model_path))
        return engines[-1]

    def spy(self, config, engine=None):
        labs.append(self)
        start(self, config, engine)

    monkeypatch.setattr(parts_module._Phases, "done", done)
    monkeypatch.setattr(parts_module.EngineLauncher, "__call__", launch)
    monkeypatch.setattr(LabParts, "__init__", spy)
    loops, level = len(_threads("polar-lab-loop")), sandbox.current()
    with pytest.raises(Boom):
        Lab(port=0, runs_dir=str(tmp_path), keep_weights=True)
    (lab,) = labs
    assert len(_threads("polar-lab-loop")) == loops and sandbox.current() == level
    assert lab.writer._calls.closed and lab.writer._sessions.closed
    made = STAGES.index(stage)
    assert (len(engines) == 1) == (made >= 1)  # the engine is launched in the second stage
    assert all(not engine.alive for engine in engines)
    if made >= 1:
        assert folders[0].startswith("/dev/shm/polar-lab-weights-") and not os.path.exists(folders[0])
    if made >= 3:
        assert not os.path.exists(lab.server.socket_dir) and _port_is_free(lab.server.port)
    assert lab.supervisor is None or (made >= 5 and lab.supervisor.engine is engines[0])


def test_a_single_engine_is_replica_0_with_no_moves_and_no_replica_counters(scripted_lab):
    """The Engine protocol's replica views for one process (engine/base.py OneProcess): what lab.replicas(),
    lab.replica_moves() and lab.stats() read without asking what kind of engine they hold."""
    (row,) = scripted_lab.replicas().to_dict("records")
    assert (row["replica"], row["serving"], row["restarts"], row["failure"]) == (0, True, 0, None)
    moves = scripted_lab.replica_moves()
    assert moves.empty and list(moves.columns) == ["route", "from_replica", "to_replica", "why", "at"]
    assert "replicas" not in scripted_lab.stats() and scripted_lab.stats()["calls"] == 0


def test_engine_settings_given_as_engine_are_the_engines_settings_and_anything_else_is_a_clear_type_error(
        model_path, tmp_path, monkeypatch):
    """`Lab(model, engine=EngineConfig(...))` is what a user writes for the engine's settings: the Lab builds its engine
    with them (the start is stopped here at the parts, before any engine). A dict or a path is a TypeError at the call
    that says what to write; so are two models or the settings given twice."""
    from polar_lab import lab as lab_module
    from polar_lab.config import EngineConfig, LabConfig

    class Started(Exception):
        pass

    def parts(config, engine):
        raise Started(config, engine)

    monkeypatch.setattr(lab_module, "LabParts", parts)
    settings = EngineConfig(model=model_path, max_model_len=1024, served_model_name="mine")
    with pytest.raises(Started) as started:
        Lab(model_path, engine=settings, port=0, runs_dir=str(tmp_path))
    config, engine = started.value.args
    assert engine is None and config.engine == settings and config.store.runs_dir == str(tmp_path)
    with pytest.raises(Started) as started:
        Lab(engine=settings, port=0)
    assert started.value.args[0].engine.model == model_path
    for wrong, says in [({"max_model_len": 1024}, "max_model_len=..."), (model_path, "not str"),
                        (EngineConfig(model="data/models/other"), "two models")]:
        with pytest.raises(TypeError, match=says):
            Lab(model_path, engine=wrong, port=0)
    with pytest.raises(TypeError, match="once"):
        Lab(model_path, config=LabConfig(), engine=settings, port=0)


def _health(conn: socket.socket, port: int) -> bytes:
    """GET /health over `conn`; the head of the whole response (its head, then Content-Length bytes of body)."""
    conn.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += conn.recv(65536)
    return head


def test_an_idle_keep_alive_connection_is_closed_after_keep_alive_s_and_a_busy_one_is_not(tokenizer, model_path,
                                                                                         tmp_path):
    """ProxyConfig.keep_alive_s is uvicorn's idle timeout: a connection idle past it is closed by the server, one
    reused within it serves its next request."""
    import time

    with Lab(port=0, engine=_scripted(tokenizer, model_path), runs_dir=str(tmp_path), keep_alive_s=1) as lab:
        with socket.create_connection(("127.0.0.1", lab.port), timeout=10) as conn:
            assert _health(conn, lab.port).startswith(b"HTTP/1.1 200")
            time.sleep(0.3)
            assert _health(conn, lab.port).startswith(b"HTTP/1.1 200")  # within the timeout: served
            time.sleep(2.0)
            assert conn.recv(65536) == b""  # past it: the server closed the connection


def test_a_request_that_arrives_as_the_idle_timer_fires_is_served_not_reset(tokenizer, model_path, tmp_path):
    """A client reuses a connection just as the proxy's keep-alive timer fires: the request is in the socket, not yet
    read. Closing then would reset the connection (the client's httpx.ReadError, a call the proxy never saw); the
    proxy's timer sees the waiting bytes and serves the request (proxy/keepalive.py). The timing is forced: the
    proxy's loop is kept busy across the timer's deadline, and the request is sent while it is."""
    import time

    import httpx

    with Lab(port=0, engine=_scripted(tokenizer, model_path), runs_dir=str(tmp_path), keep_alive_s=1) as lab:
        url = f"{lab.url}/health"
        with httpx.Client() as client:  # its idle expiry (5 s) outlasts the proxy's 1 s: it reuses the connection
            assert client.get(url).status_code == 200
            (protocol,) = lab.server._server.server_state.connections
            deadline = time.monotonic() + 5
            while protocol.timeout_keep_alive_task is None and time.monotonic() < deadline:
                time.sleep(0.001)  # armed on the loop's thread once the response is written
            when = protocol.timeout_keep_alive_task.when()  # loop time (monotonic) at which the timer fires

            def busy_across_the_deadline():
                lab.server.loop.call_at(when - 0.3, time.sleep, 0.4)  # busy from when-0.3 to when+0.1, so this
                lab.server.loop.call_at(when - 1e-4, time.sleep, 0.6)  # and the timer are due in one iteration

            lab.server.loop.call_soon_threadsafe(busy_across_the_deadline)
            time.sleep(max(0.0, when + 0.35 - time.monotonic()))  # sent while the loop sleeps, before the timer runs
            assert client.get(url).status_code == 200
            assert len(lab.server._server.server_state.connections) == 1  # the same connection served it


def test_a_connection_the_client_resets_cancels_its_idle_timer_and_the_default_outlasts_clients_idle_pools(
        tokenizer, model_path, tmp_path):
    """A client that resets its connection (a killed harness) leaves no armed idle timer holding the connection's state
    until it fires (uvicorn cancels it on a clean close only); and the default idle timeout is longer than common
    clients keep an idle connection (httpx and Node 5 s, Go and Rust's hyper 90 s), so the proxy never closes first."""
    import struct
    import time

    from polar_lab.config import ProxyConfig

    assert ProxyConfig().keep_alive_s > 90
    with Lab(port=0, engine=_scripted(tokenizer, model_path), runs_dir=str(tmp_path)) as lab:
        conn = socket.create_connection(("127.0.0.1", lab.port), timeout=10)
        assert _health(conn, lab.port).startswith(b"HTTP/1.1 200")
        (protocol,) = lab.server._server.server_state.connections
        deadline = time.monotonic() + 5
        while protocol.timeout_keep_alive_task is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert protocol.timeout_keep_alive_task is not None  # armed: the connection is idle
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # with SO_LINGER 0: a reset, not a FIN
        while protocol in lab.server._server.server_state.connections and time.monotonic() < deadline:
            time.sleep(0.001)
        assert protocol not in lab.server._server.server_state.connections
        assert protocol.timeout_keep_alive_task is None
