"""polar_lab's Jupyter server extension (polar_lab/jupyter.py), from outside: a Jupyter server started the way a
researcher starts it runs one engine forkserver, a kernel it starts forks its engines there, and the forkserver ends
with the Jupyter server. No vLLM engine is built: the forked child ends as soon as its socket is closed."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from polar_lab.engine.forkserver import ENV_VAR
from polar_lab.jupyter import start_for_kernels
from tests.conftest import ROOT, free_port, running, wait_for_jupyter

# Run in the kernel: fork an engine process from the forkserver its environment names, report who is whose parent
IN_KERNEL = """
import json, os, socket
from polar_lab.config import EngineConfig
from polar_lab.engine import forkserver
from polar_lab.engine.process_env import engine_env

def parent(pid):
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])

named = os.environ.get("POLAR_LAB_FORKSERVER")
env = engine_env(EngineConfig(), [])
client = forkserver._client_for(env)
ours, theirs = socket.socketpair()
child = client.fork(env, theirs.fileno(), None)
server = parent(child.pid) if child else None
report = {"named": named, "own": forkserver._own is not None,
          "child": child and child.pid, "server": server, "server_parent": server and parent(server)}
ours.close()
report["child_exit"] = child and child.wait(timeout=30)
print(json.dumps(report))
"""


def _run_in_kernel(runtime_dir, kernel_id: str, code: str) -> str:
    from jupyter_client import BlockingKernelClient

    client = BlockingKernelClient(connection_file=str(runtime_dir / f"kernel-{kernel_id}.json"))
    client.load_connection_file()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        out: list[str] = []
        reply = client.execute_interactive(code, timeout=180, output_hook=lambda msg: out.append(
            msg["content"].get("text", "") if msg["msg_type"] == "stream" else ""))
        assert reply["content"]["status"] == "ok", reply["content"]
        return "".join(out)
    finally:
        client.stop_channels()


def test_a_jupyter_servers_kernels_fork_their_engines_from_its_forkserver_which_ends_with_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}  # as a researcher's shell: no server named yet
    env |= {"JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    port, token = free_port(), "polar-lab-jupyter-test"
    argv = [sys.executable, "-m", "jupyter_server", "--no-browser", "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
            *(["--allow-root"] if os.geteuid() == 0 else [])]
    server = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"token {token}"}
    try:
        wait_for_jupyter(url, auth, server)
        kernel = httpx.post(f"{url}/api/kernels", headers=auth, json={"name": "python3"}, timeout=60).json()
        report = json.loads(_run_in_kernel(tmp_path / "runtime", kernel["id"], IN_KERNEL).splitlines()[-1])

        assert report["named"], "the kernel was given no forkserver: is the extension enabled? (make setup)"
        assert not report["own"]  # the kernel started no server of its own
        assert report["child"] is not None, "the Jupyter server's forkserver refused the kernel's engine"
        assert report["server_parent"] == server.pid  # the engine's parent is the Jupyter server's forkserver
        assert report["child_exit"] == 0

        forkserver_pid, folder = report["server"], os.path.dirname(report["named"])
        server.send_signal(signal.SIGTERM)  # Ctrl-C's way out: the Jupyter server alone, not its process group
        server.wait(timeout=60)
        deadline = time.monotonic() + 30
        while running(forkserver_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(forkserver_pid) and not os.path.exists(folder)
    finally:
        try:
            os.killpg(server.pid, signal.SIGKILL)  # whatever is left of the group: kernels, the forkserver
        except ProcessLookupError:
            pass
        server.wait(timeout=30)


def test_a_server_named_already_is_kept_and_nothing_starts(monkeypatch):
    """`polar-lab forkserver`'s variable (or a test session's, or "off") is the researcher's choice: the extension
    starts no second server over it."""
    for named in ("/somewhere/socket", "off"):
        monkeypatch.setenv(ENV_VAR, named)
        assert start_for_kernels() is None
        assert os.environ[ENV_VAR] == named
