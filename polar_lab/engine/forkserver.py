"""The engine forkserver: one process that imports torch and vLLM once and forks every CPU engine process from there.

Why: a fresh engine process spends most of its start importing (torch, transformers, vLLM: ~8 of ~14 s for the 5 MB
tiny model on 2 cores); a process forked from one that has them imported starts at `vllm.LLM(...)`. A Lab's restarts,
a second Lab in the same kernel, and every engine of a test session start that way.

Who owns what: `ForkServer` (a context manager) owns the server process it starts and the folder of its socket. A
`ForkClient` is one connection to a server: the process's own, started on its first CPU engine (`launch`) and
offered to the processes it starts (notebook kernels, `polar-lab train`, ...) in POLAR_LAB_FORKSERVER, or the one an
ancestor named there (`polar-lab forkserver` names one for every kernel of a Jupyter server started beside it). `ForkedProcess` is a kernel's
handle on one engine process — pid, poll, wait, kill: what `VLLMEngine` used `subprocess.Popen` for. The engine
process is the server's child, not the kernel's: it is watched through a pidfd that the server opened before the
process could be reaped, and its exit code is asked of the server.

Fork safety: the server runs no torch op and starts no thread, so a child inherits no OpenMP pool and no lock held
by a thread it does not have. The only threads besides the main one are OpenBLAS's idle thread servers, started by
numpy's and OpenCV's imports (vLLM imports both); OpenBLAS shuts them down around a fork and restarts them in the
child (its pthread_atfork handlers). Before each fork the server checks that it still has one Python thread and no
native thread beyond those its imports left, and refuses otherwise.

The environment: a forked engine runs with the environment its request carries, but what torch, OpenMP, vLLM's
logger and the Hugging Face libraries read at import time was fixed when the server imported them. A request whose
import-time variables (`IMPORT_TIME`) differ from the server's, or that comes from another interpreter or another
copy of polar_lab, is refused; `launch` then starts a fresh process, as it does wherever no server can run (a GPU
engine, POLAR_LAB_FORKSERVER=off, a platform without pidfds).

Protocol: one JSON object per SOCK_SEQPACKET message, file descriptors by SCM_RIGHTS.
    client → server   {"op": "fork", "env", "cwd", "python", "package"} + [engine socket, log file (optional)]
                      → {"pid"} + [pidfd]  |  {"refused": why}
                      {"op": "exit_code", "pid"} → {"code": int or null}
The server ends when its owner's pipe closes (the owner exited, however it exited) or the owner closes it; the
engines it forked live on, each until its own kernel hangs up.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

ENV_VAR = "POLAR_LAB_FORKSERVER"  # a server's socket path, or "off"
# Variables read when torch, OpenMP, oneDNN, vLLM's logger or the Hugging Face libraries are imported: a fork
# inherits what the server read, so a request must agree with the server on every one of them.
IMPORT_TIME = ("LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "DNNL_", "ONEDNN_", "TORCH", "CUDA_", "HF_", "HUGGINGFACE_",
               "TRANSFORMERS_", "TOKENIZERS_", "VLLM_", "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONNOUSERSITE",
               "PYTHONSAFEPATH", "PYTHONOPTIMIZE", "PYTHONMALLOC", "PYTHONUTF8", "PYTHONWARNINGS")
# ... except these, read when an engine is built (vllm/envs.py reads lazily), or never by an engine (Ray's driver sets
# PYTHONBREAKPOINT, read at each breakpoint() call)
READ_LATE = frozenset({"VLLM_CPU_KVCACHE_SPACE"})
_PACKAGE = str(Path(__file__).resolve().parents[1])  # this copy of polar_lab: a server serves its own copy only
_MAX_MESSAGE = 1 << 20


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The part of an environment a forked process cannot change: what its imports read.

    >>> import_env({"OMP_NUM_THREADS": "1", "HOME": "/root", "VLLM_CPU_KVCACHE_SPACE": "1"})
    {'OMP_NUM_THREADS': '1'}
    """
    return {k: v for k, v in sorted(env.items()) if k.startswith(IMPORT_TIME) and k not in READ_LATE}


# ---- the kernel's side -----------------------------------------------------------------------------------------
def launch(env: dict[str, str], engine_fd: int, log_fd: int | None, *, gpus: bool = False):
    """Start an engine process serving the socket `engine_fd` (polar_lab/engine/worker.py) with environment `env`,
    stdout/stderr to `log_fd` (None: discarded): forked from a forkserver where one serves this environment, else a
    fresh `python -m polar_lab.engine.worker`. Returns a `ForkedProcess` or a `subprocess.Popen`."""
    client = None if gpus else _client_for(env)
    if client is not None:
        proc = client.fork(env, engine_fd, log_fd)
        if proc is not None:
            return proc
    out = log_fd if log_fd is not None else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "polar_lab.engine.worker", str(engine_fd)], pass_fds=(engine_fd,),
                            env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)


class ForkedProcess:
    """An engine process a forkserver forked: the subset of `subprocess.Popen` that VLLMEngine uses."""

    def __init__(self, pid: int, pidfd: int, client: ForkClient):
        self.pid = pid
        self.args = f"forked engine {pid}"
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._client = client

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._pidfd], [], [], 0)[0]:
            self._exited()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._exited()
        return self.returncode

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass  # exited meanwhile

    def _exited(self) -> None:
        code = self._client.exit_code(self.pid)
        self.returncode = code if code is not None else -1  # -1: the server is gone and took the code with it
        os.close(self._pidfd)


class ForkClient:
    """One connection to a forkserver; requests are serialised (a fork takes ~50 ms, the server's imports aside)."""

    def __init__(self, path: str):
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.connect(path)
        self._lock = threading.Lock()
        self.dead: str | None = None  # why this connection is no use any more

    def fork(self, env: dict[str, str], engine_fd: int, log_fd: int | None) -> ForkedProcess | None:
        """A forked engine process, or None (the reason logged) when the server refuses or is gone."""
        request = {"op": "fork", "env": env, "cwd": os.getcwd(), "python": _interpreter(), "package": _PACKAGE}
        fds = [engine_fd] + ([log_fd] if log_fd is not None else [])
        try:
            reply, got = self._ask(request, fds)
        except OSError as exc:
            self.dead = f"the forkserver at {self.path} is gone ({exc!r})"
            log.warning("%s; engines start as fresh processes", self.dead)
            return None
        if "refused" in reply:
            log.info("the forkserver refused an engine (%s): starting a fresh process", reply["refused"])
            return None
        return ForkedProcess(reply["pid"], got[0], self)

    def exit_code(self, pid: int) -> int | None:
        try:
            return self._ask({"op": "exit_code", "pid": pid})[0].get("code")
        except OSError:
            return None

    def _ask(self, request: dict, fds: list[int] = ()) -> tuple[dict, list[int]]:
        with self._lock:
            if self.dead:
                raise ConnectionError(self.dead)
            socket.send_fds(self._sock, [json.dumps(request).encode()], list(fds))
            data, got, flags, _ = socket.recv_fds(self._sock, _MAX_MESSAGE, 1)
        if not data:
            raise ConnectionError("the forkserver hung up")
        return json.loads(data), got

    def close(self) -> None:
        self._sock.close()


class ForkServer:
    """A forkserver process started with `env`, listening on a socket in a private folder (`path`). Context manager;
    `close()` ends the server (engines it forked keep running) and removes its folder. Safe to call twice."""

    def __init__(self, env: dict[str, str]):
        # not the engine's own scratch folder (TMPDIR, engine/vllm_engine.py): the server outlives that engine
        self.env = {k: v for k, v in env.items() if k not in (ENV_VAR, "TMPDIR")}
        if "TMPDIR" in os.environ:
            self.env["TMPDIR"] = os.environ["TMPDIR"]
        self.path: str | None = None
        self.pid: int | None = None
        self._proc: subprocess.Popen | None = None
        self._owner_w: int | None = None
        self._dir: str | None = None

    def start(self) -> ForkServer:
        """Start the server and return at once; it accepts connections at once, and answers the first request once
        its imports are done (a first fork waits for them)."""
        if self._proc is not None:
            return self
        from polar_lab.engine.process_env import socket_dir

        self._dir = socket_dir("polar-lab-forkserver-")  # mode 0700: only this user connects
        self.path = os.path.join(self._dir, "socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(self.path)
        listener.listen(16)
        owner_r, self._owner_w = os.pipe()
        try:
            with open(os.path.join(self._dir, "forkserver.log"), "ab") as err:
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", f"from polar_lab.engine.forkserver import main; "
                                           f"main({listener.fileno()}, {owner_r})"],
                    pass_fds=(listener.fileno(), owner_r), env=self.env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=err)
        except BaseException:
            os.close(self._owner_w)
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        finally:
            listener.close()
            os.close(owner_r)
        self.pid = self._proc.pid
        return self

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        os.close(self._owner_w)  # the server sees its owner's pipe close and exits
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> ForkServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_until_interrupted() -> int:
    """`polar-lab forkserver`: a server for the default CPU engine's environment, named in the line it prints, until
    Ctrl-C or SIGTERM. Start JupyterLab (or anything that starts kernels) with that variable set."""
    from polar_lab.config import EngineConfig
    from polar_lab.engine.process_env import engine_env

    with ForkServer(engine_env(EngineConfig(), [])) as server:
        print(f"export {ENV_VAR}={server.path}", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        proc = server._proc
        try:
            while proc.poll() is None:
                time.sleep(1.0)
        except KeyboardInterrupt:
            return 0
        print(f"the forkserver exited (code {proc.returncode})", file=sys.stderr)
        return 1


# The process's own server (started by its first CPU engine) and its connections, by socket path
_lock = threading.Lock()
_own: ForkServer | None = None
_clients: dict[str, ForkClient] = {}


def _client_for(env: dict[str, str]) -> ForkClient | None:
    """A connection to the server named in `env` (POLAR_LAB_FORKSERVER), else to this process's own server (started
    now with `env` if there is none); None where none may run."""
    global _own
    named = env.get(ENV_VAR, "")
    if named == "off" or not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
        return None
    with _lock:
        if not named:
            if _own is None:
                _own = ForkServer(env).start()
                atexit.register(close_own)
                os.environ.setdefault(ENV_VAR, _own.path)  # offered to the processes this one starts
            named = _own.path
        client = _clients.get(named)
        if client is None or client.dead:
            try:
                client = _clients[named] = ForkClient(named)
            except OSError as exc:
                log.warning("cannot reach the forkserver at %s (%r): engines start as fresh processes", named, exc)
                return None
        return client


def close_own() -> None:
    """End this process's own forkserver, if it started one (at exit; tests that count processes call it)."""
    global _own
    with _lock:
        server, _own = _own, None
        for path in [p for p in _clients if server is not None and p == server.path]:
            _clients.pop(path).close()
    if server is not None:
        if os.environ.get(ENV_VAR) == server.path:
            del os.environ[ENV_VAR]
        server.close()


# ---- the server's side -----------------------------------------------------------------------------------------
def serve(listener: socket.socket, owner_fd: int) -> None:
    """Accept connections and answer their requests until the owner's pipe closes. Single-threaded."""
    clients: list[socket.socket] = []
    owners: dict[int, socket.socket] = {}  # engine pid → the connection that asked for it
    codes: dict[int, int] = {}  # reaped engine pid → exit code, until asked
    while True:
        ready, _, _ = select.select([listener, owner_fd, *clients], [], [], 1.0)
        _reap(owners, codes)
        if owner_fd in ready:
            return
        if listener in ready:
            conn, _ = listener.accept()
            if _peer_uid(conn) == os.getuid():
                clients.append(conn)
            else:
                conn.close()
        for conn in [c for c in clients if c in ready]:
            if not _answer(conn, listener, owner_fd, clients, owners, codes):
                clients.remove(conn)
                conn.close()


def _answer(conn, listener, owner_fd, clients, owners, codes) -> bool:
    """Read one request from `conn` and answer it; False when the client hung up."""
    try:
        data, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 2)
    except OSError:
        return False
    if not data:
        return False
    request = json.loads(data)
    out: list[int] = []
    try:
        if request.get("op") == "fork":
            reply, out = _fork(request, fds, [listener.fileno(), owner_fd, *(c.fileno() for c in clients)])
            if "pid" in reply:
                owners[reply["pid"]] = conn
        else:
            reply = {"code": _exit_code(request.get("pid"), codes)}
        socket.send_fds(conn, [json.dumps(reply).encode()], out)
    except OSError:
        return False
    finally:
        for fd in (*fds, *out):  # the child has its own copies
            os.close(fd)
    return True


def _fork(request: dict, fds: list[int], server_fds: list[int]) -> tuple[dict, list[int]]:
    """Fork an engine process for `request`; ({"pid"}, [its pidfd]) or ({"refused": why}, [])."""
    why = _refusal(request)
    if why is not None:
        return {"refused": why}, []
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(request, fds, server_fds)  # never returns
    return {"pid": pid}, [os.pidfd_open(pid)]


def _refusal(request: dict) -> str | None:
    """Why this server cannot fork the engine `request` asks for, or None."""
    return _env_refusal(request) or _thread_refusal()


def _env_refusal(request: dict) -> str | None:
    if request.get("python") != _interpreter() or request.get("package") != _PACKAGE:
        return f"another interpreter or polar_lab ({request.get('python')}, {request.get('package')})"
    # a kernel that imported vLLM itself carries what those imports set (vLLM sets inductor's cache folder): as here
    asked = {k: v for k, v in request["env"].items() if k in _START_ENV or os.environ.get(k) != v}
    mine, theirs = import_env(_START_ENV), import_env(asked)
    if mine != theirs:
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        return f"import-time environment differs in {', '.join(differ)}"
    return None


def _thread_refusal() -> str | None:
    if threading.active_count() != 1 or _native_threads() > _IMPORT_THREADS[0]:
        return (f"the server has {threading.active_count()} Python threads and {_native_threads()} in all (its "
                f"imports left {_IMPORT_THREADS[0]}); forking it is not safe")
    return None


def _interpreter() -> list[str]:
    """Which Python this is, however it was named: a venv's `python` and `python3` (pytest's and a console script's
    shebang) are one interpreter; the same binary in another venv (another sys.prefix) is not."""
    return [os.path.realpath(sys.executable), sys.prefix]


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _child(request: dict, fds: list[int], server_fds: list[int]) -> None:
    """In the forked process: become an engine process serving fds[0], as `python -m polar_lab.engine.worker` would."""
    code = 1
    try:
        for fd in server_fds:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignored it; an engine does not
        out = fds[1] if len(fds) > 1 else os.open(os.devnull, os.O_WRONLY)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(request["cwd"])
        added = {k: v for k, v in os.environ.items() if k not in _START_ENV}  # what the imports set, as in a
        os.environ.clear()                                                    # fresh process importing them
        os.environ.update({**added, **request["env"]})
        tempfile.tempdir = None  # tempfile caches TMPDIR: the engine's own scratch folder is in the new environment
        from multiprocessing.connection import Connection

        from polar_lab.engine.worker import serve_connection

        code = serve_connection(Connection(fds[0]), forked=True, exit_after=True)
    except BaseException:  # noqa: BLE001 - reported in the engine's log, then the process ends
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _exit_code(pid: int, codes: dict[int, int]) -> int | None:
    if pid not in codes:
        try:
            _, status = os.waitpid(pid, 0)  # asked once its pidfd said it exited: this does not block
            codes[pid] = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            return None
    return codes.pop(pid)


def _reap(owners: dict[int, socket.socket], codes: dict[int, int]) -> None:
    """Collect exited children (no zombies); keep their codes for the connection that may ask, while it lives."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = owners.pop(pid, None)
        if conn is not None and conn.fileno() != -1:
            codes[pid] = os.waitstatus_to_exitcode(status)
        if len(codes) > 1024:  # asked for by nobody: forget the oldest
            codes.pop(next(iter(codes)))


def _peer_uid(conn: socket.socket) -> int:
    import struct

    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


_START_ENV: dict[str, str] = {}  # the server's environment before its imports (they add to it)
_IMPORT_THREADS = [1]  # the server's threads once its imports are done (OpenBLAS's servers)


def main(listen_fd: int, owner_fd: int) -> None:
    _START_ENV.update(os.environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches the whole group: the owner decides
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from polar_lab.engine.worker import WithoutRay

    sys.meta_path.insert(0, WithoutRay())  # as in a fresh engine process (engine/worker.py)
    t0 = time.perf_counter()
    from polar_lab.engine.preload import preload

    preload()
    _IMPORT_THREADS[0] = _native_threads()
    log.info("forkserver %d ready in %.1f s", os.getpid(), time.perf_counter() - t0)
    listener = socket.socket(fileno=listen_fd)
    folder = os.path.dirname(listener.getsockname())
    serve(listener, owner_fd)
    sys.stderr.flush()
    # the owner is gone: its folder goes too, even when the owner was killed and could not remove it itself
    shutil.rmtree(folder, ignore_errors=True)
    os._exit(0)
