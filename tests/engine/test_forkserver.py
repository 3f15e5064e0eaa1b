"""The engine forkserver (engine/forkserver.py), checked from outside: engines are the server's children and serve the
environment and working folder their request carried; an engine that dies reports its own exit code; a request the
server cannot serve as asked (another import-time environment) starts a fresh process instead; the server ends with the
process that owns it. Private engines here: an engine's death and start are the subject (each ~2-3 s, forked)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from polar_lab.config import EngineConfig
from polar_lab.engine import forkserver
from polar_lab.engine.process_env import engine_env
from polar_lab.engine.vllm_engine import VLLMEngine
from tests.conftest import ROOT, running


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def _server_pid() -> int:
    """The forkserver this test session's engines come from (the pytest process started it, or an ancestor did)."""
    client = forkserver._client_for(engine_env(EngineConfig(), []))
    assert client is not None, "no forkserver on this machine (no pidfd_open?)"
    return forkserver._own.pid if forkserver._own is not None else None


def test_the_labs_engine_is_a_child_of_the_forkserver(lab):
    server = _server_pid()
    assert isinstance(lab.engine.process.proc, forkserver.ForkedProcess)
    if server is not None:  # started by this process (not named by an ancestor)
        assert _parent(lab.engine.pid) == server
        assert _parent(server) == os.getpid()


def test_a_forked_engine_serves_the_environment_and_folder_it_asked_for(model_path, tmp_path, monkeypatch):
    """The engine's own start line (engine/worker.py `note_start`, read from the environment the engine runs in) names
    the test that started it, although the server was started by an earlier one; a relative model path resolves
    against the caller's folder, not the server's."""
    log = tmp_path / "engines.jsonl"
    monkeypatch.setenv("POLAR_LAB_ENGINE_LOG", str(log))
    monkeypatch.chdir(ROOT)
    relative = os.path.relpath(model_path, ROOT)
    with VLLMEngine(EngineConfig(model=relative)) as engine:
        assert isinstance(engine.process.proc, forkserver.ForkedProcess)
        line = json.loads(log.read_text().splitlines()[-1])
        assert line["pid"] == engine.pid and line["forked"] is True
        assert line["test"].startswith("tests/engine/test_forkserver.py::test_a_forked_engine_serves")


def test_a_forked_engine_that_is_killed_reports_its_own_exit_code(model_path):
    with VLLMEngine(EngineConfig(model=model_path)) as engine:
        pid = engine.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while engine.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.failure == f"the engine process exited (code {-signal.SIGKILL})"
    assert not running(pid)  # reaped by the server: no zombie left behind


def test_a_request_with_another_import_time_environment_is_refused_and_forks_nothing():
    """OpenMP reads OMP_NUM_THREADS when torch is imported: a fork would silently keep the server's value."""
    import psutil

    env = engine_env(EngineConfig(), [])
    client = forkserver._client_for(env)
    # negative control: variables read later are the child's own; it is forked, and ends as soon as we hang up
    ours, theirs = socket.socketpair()
    child = client.fork({**env, "HOME": "/elsewhere", "PYTEST_CURRENT_TEST": "x"}, theirs.fileno(), None)
    assert child is not None
    server = psutil.Process(_parent(child.pid))
    ours.close()
    assert child.wait(timeout=30) == 0
    before = {p.pid for p in server.children()}
    assert client.fork({**env, "OMP_NUM_THREADS": "7"}, theirs.fileno(), None) is None
    assert {p.pid for p in server.children()} <= before
    theirs.close()


def test_the_forkserver_ends_with_the_process_that_owns_it(tmp_path):
    """The owner is killed outright (no atexit): its server notices its pipe close, removes the socket's folder the
    owner could not, and exits by itself."""
    owner = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from polar_lab.config import EngineConfig\n"
        "from polar_lab.engine.forkserver import ForkServer\n"
        "from polar_lab.engine.process_env import engine_env\n"
        "server = ForkServer(engine_env(EngineConfig(), [])).start()\n"
        "print(server.pid, server.path, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        pid, path = owner.stdout.readline().split()
        server = int(pid)
        assert running(server) and os.path.exists(path)
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 120  # it notices once its imports are done
    while running(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(server)
    assert not os.path.exists(os.path.dirname(path))


@pytest.mark.parametrize("env, refused", [
    ({}, False),                                               # the same environment
    ({"OMP_NUM_THREADS": "3"}, True),                          # read by OpenMP at torch's import
    ({"LD_PRELOAD": "/x/libjemalloc.so"}, True),               # the allocator is chosen at exec
    ({"VLLM_LOGGING_LEVEL": "DEBUG"}, True),                   # vLLM's logger is configured at import
    ({"VLLM_CPU_KVCACHE_SPACE": "3"}, False),                  # read when the engine is built
    ({"PYTEST_CURRENT_TEST": "t", "HOME": "/h"}, False),       # read by nobody at import
    ({"PYTHONBREAKPOINT": "ray.util.rpdb._driver_set_trace"}, False),  # Ray's driver sets it; read at breakpoint()
    ({"PYTHONHASHSEED": "0"}, True),                           # read when the interpreter starts
])
def test_what_a_fork_cannot_change_is_refused(env, refused, monkeypatch):
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "2", "VLLM_LOGGING_LEVEL": "ERROR"}
    monkeypatch.setattr(forkserver, "_START_ENV", dict(base))
    request = {"env": {**base, **env}, "python": forkserver._interpreter(), "package": forkserver._PACKAGE}
    why = forkserver._env_refusal(request)
    assert (why is not None) == refused, why
    if refused:
        assert next(iter(env)) in why


def test_one_interpreter_under_two_names_is_one_and_another_venv_is_another(tmp_path, monkeypatch):
    """A venv's `python` (how `python -m pytest` names it) and `python3` (a console script's shebang: `polar-lab
    train`) fork from one server; the same binary in another venv does not (its packages differ)."""
    alias = tmp_path / "python3"
    alias.symlink_to(sys.executable)
    asked = forkserver._interpreter()
    monkeypatch.setattr(sys, "executable", str(alias))
    assert forkserver._interpreter() == asked
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert forkserver._interpreter() != asked
