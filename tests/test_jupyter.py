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
import json, logging, os, socket, sys
logging.getLogger("polar_lab.engine.forkserver").addHandler(logging.StreamHandler(sys.stdout))  # a refusal says why
logging.getLogger("polar_lab.engine.forkserver").setLevel(logging.INFO)
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


def _wait_for_kernel_info(client, state, timeout: float = 120) -> None:
    """Until the kernel answers kernel_info on its shell channel and its IOPub channel carries messages to us (what
    jupyter_client's `wait_for_ready` waits for). Not `wait_for_ready` itself: for a client that does not own the
    kernel it takes a heartbeat missed for 1 s as death ("Kernel died before replying to kernel_info"), which a
    kernel importing torch on a loaded machine gave once in `make test`. Death is the server's word here: `state()`,
    the kernel's execution_state as the Jupyter server that owns it reports it."""
    from queue import Empty

    deadline = time.monotonic() + timeout
    while True:
        client.kernel_info()
        try:
            if client.get_shell_msg(timeout=1)["msg_type"] == "kernel_info_reply":
                client.get_iopub_msg(timeout=1)
                return
        except Empty:
            pass
        assert state() != "dead", "the kernel died before it answered"
        assert time.monotonic() < deadline, f"the kernel did not answer in {timeout} s"


def _run_in_kernel(runtime_dir, kernel_id: str, code: str, state) -> str:
    from jupyter_client import BlockingKernelClient

    client = BlockingKernelClient(connection_file=str(runtime_dir / f"kernel-{kernel_id}.json"))
    client.load_connection_file()
    client.start_channels()
    try:
        _wait_for_kernel_info(client, state)
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

        def state() -> str:
            return httpx.get(f"{url}/api/kernels/{kernel['id']}", headers=auth, timeout=30).json()["execution_state"]

        printed = _run_in_kernel(tmp_path / "runtime", kernel["id"], IN_KERNEL, state)
        report = json.loads(printed.splitlines()[-1])

        assert report["named"], "the kernel was given no forkserver: is the extension enabled? (make setup)"
        assert not report["own"]  # the kernel started no server of its own
        assert report["child"] is not None, f"the Jupyter server's forkserver refused the kernel's engine: {printed}"
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
