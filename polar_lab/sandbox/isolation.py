"""The "isolated" sandbox level: bubblewrap namespaces and an unprivileged user, for code the policy wrote.
Process-wide state, guarded by one lock: the configured level and the sandbox user, set once per kernel
(`configure`, which the Lab calls at start) and read by every `Sandbox`.

What an isolated run has (docs/reliability.md lists each with the test that checks it):
- its own user: when the kernel is root, an unprivileged uid/gid that owns nothing but the run's workdir
  (bwrap, as root, makes the namespaces and binds; setpriv then drops to that user with no capabilities
  before the program starts); otherwise the kernel's own uid inside a user namespace, no capabilities.
- new user, PID, IPC, UTS, cgroup and network namespaces: no other process is visible or can be signalled,
  no socket of the host can be reached;
- a read-only view of the system: /usr (and the /bin, /lib... links to it), /etc with a passwd and group
  that name the sandbox user (handed to bwrap in memory, per run: nothing on disk to leave behind), the
  interpreter (`sys.base_prefix`, `sys.prefix`), the polar_lab package, and the paths the harness names (its own install, e.g. .cache/agents). Nothing else of the host: not the
  run folder, the project tree, /root, /home, /dev/shm's weight files, other sandboxes' workdirs;
- its workdir read-write at its own path, a private /tmp and /dev/shm (memory-backed, each capped at the
  run's disk quota);
- the proxy through the Lab's unix socket only: `launch.py` listens on the session's own address
  (127.0.0.1:port) inside the sandbox's empty network namespace and forwards to the socket, so a harness
  keeps its ordinary base URL and no other port exists for it;
- nothing shared with another run: each run gets its own uid from a pool (`lease`), and a seccomp filter
  refuses the kernel keyring calls (`seccomp.py`: the uid's keyrings outlive a run, and the kernel's session
  keyring is inherited).
"""

from __future__ import annotations

import fcntl
import grp
import logging
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from polar_lab.errors import SandboxError

log = logging.getLogger(__name__)

LEVELS = ("isolated", "process")
FIRST_UID = 61000  # where the search for a free uid starts (no passwd entry, no group entry); POLAR_LAB_SANDBOX_UID
# moves it (the test suite gives each of its worker processes a pool of its own)
LEASES = os.path.join(tempfile.gettempdir(), "polar-lab-sandbox-uids")  # a lock file per uid a run of any process holds
POOL_SIZE = 1024  # uids from the first one: one per isolated run at a time (harnesses and evaluators together)
LAUNCH = Path(__file__).with_name("launch.py")
PACKAGE = Path(__file__).resolve().parents[1]  # polar_lab/: harness modules run from it (`-m polar_lab...`)
SOCKET_DIR = "/run/polar"  # where the proxy's socket appears inside the sandbox


@dataclass(frozen=True)
class Proxy:
    """How an isolated run reaches the proxy: the address its harness dials and the Lab's unix socket."""

    host: str
    port: int
    socket: str

    @classmethod
    def from_url(cls, base_url: str, socket_path: str) -> Proxy:
        """From a session's base URL (http://127.0.0.1:41234) and the Lab's socket path."""
        parts = urlsplit(base_url)
        return cls(host=parts.hostname or "127.0.0.1", port=parts.port or 80, socket=socket_path)


@dataclass(frozen=True)
class User:
    """Who runs isolated code. `switch`: the kernel is root; the program drops to uid/gid (setpriv) inside bwrap."""

    uid: int
    gid: int
    switch: bool


@dataclass
class _State:
    level: str = "isolated"
    fallback: bool = False
    uid: int | None = None
    user: User | None = None
    leased: dict[int, int] = field(default_factory=dict)  # uids runs of this process hold now → their lock's fd
    unavailable: str | None = None  # why "isolated" cannot run here; "" once checked and fine
    checked: bool = False
    warned: bool = False


_state = _State()
_lock = threading.Lock()


def configure(level: str = "isolated", *, fallback: bool = False, uid: int | None = None) -> str | None:
    """Set the default level of every sandbox in this process; returns the level runs will get (None: they will be
    refused), found quietly — what cannot run here is said when a program is about to run (`resolve`), not before:
    a Lab that runs no harness program prints nothing about a sandbox it never uses.

    level: "isolated" (bubblewrap + an unprivileged user) or "process" (own workdir, environment, limits
    and process group; same user and filesystem as the kernel). fallback: where "isolated" cannot run
    (no bubblewrap, no user namespaces), run at "process" after saying so once, instead of refusing.
    uid: the sandbox user when the kernel is root (also its gid); None: the first free uid from 61000.
    """
    if level not in LEVELS:
        raise SandboxError(f"sandbox level must be one of {LEVELS}, got {level!r}")
    with _lock:
        if uid != _state.uid:
            _state.user, _state.checked = None, False
        _state.level, _state.fallback, _state.uid = level, fallback, uid
    return expected(None)


def current() -> dict[str, object]:
    """The configuration in force (`configure(**current())` puts it back)."""
    with _lock:
        return {"level": _state.level, "fallback": _state.fallback, "uid": _state.uid}


def expected(level: str | None) -> str | None:
    """The level a run asking for `level` (None: the configured default) would get, found without a word: None
    where it would be refused."""
    level = level or _state.level
    if level == "process" or unavailable() is None:
        return level
    return "process" if _state.fallback else None


def resolve(level: str | None) -> str:
    """The level a run asking for `level` (None: the configured default) gets, as it is about to run; refuses
    (SandboxError, saying how to install bubblewrap) when "isolated" cannot run here and fallback is off, and says
    once per process that it fell back when it does."""
    if level is not None and level not in LEVELS:
        raise SandboxError(f"sandbox level must be one of {LEVELS}, got {level!r}")
    got = expected(level)
    if got == (level or _state.level):
        return got
    why = unavailable()
    if got is None:
        raise SandboxError(f"the isolated sandbox cannot run here: {why}. Install bubblewrap (Debian: "
                           f"apt-get install bubblewrap), or allow the weaker level explicitly: "
                           f"Lab(..., sandbox_fallback=True) or sandbox='process'")
    with _lock:
        if not _state.warned:
            log.warning("the isolated sandbox cannot run here (%s): harnesses and evaluators run at the "
                        "'process' level (same user and filesystem as the kernel)", why)
            _state.warned = True
    return got


def unavailable() -> str | None:
    """Why "isolated" cannot run on this machine, or None. Checked once per process by running a trial
    sandbox (bubblewrap present, user namespaces allowed, the sandbox user usable)."""
    with _lock:
        if not _state.checked:
            _state.unavailable = _trial()
            _state.checked = True
        return _state.unavailable or None


def _trial() -> str:
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    fds = etc_fds(_user())
    try:
        done = subprocess.run(wrap(["true"], workdir=None, tmp_mb=1, owner=_user(), etc=fds), capture_output=True,
                              timeout=30, stdin=subprocess.DEVNULL, pass_fds=fds)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"a trial sandbox failed: {exc}"
    finally:
        for fd in fds:
            os.close(fd)
    if done.returncode != 0:
        return f"a trial sandbox failed: {done.stderr.decode(errors='replace').strip()[:300]}"
    return ""


def user() -> User:
    """The first sandbox user (the pool's first uid), chosen once per process (`configure(uid=...)` picks it)."""
    with _lock:
        return _user()


def _user() -> User:
    if _state.user is None:
        switch = os.geteuid() == 0
        uid = (_state.uid or _free_id()) if switch else os.geteuid()
        gid = uid if switch else os.getegid()
        _state.user = User(uid=uid, gid=gid, switch=switch)
    return _state.user


def pool() -> range:
    """The uids isolated runs get when the kernel is root: one per run at a time, from the first user's."""
    first = user().uid
    return range(first, first + POOL_SIZE)


def lease() -> User:
    """A sandbox user for one run, given back with `release`. As root: a uid no other run holds — of this process, or
    of another kernel on the machine (a lock file per uid, held while the run lasts: runs share nothing through their
    uid, not a process limit, not the per-user keyring, not a cleanup by uid); otherwise the kernel's own uid, in a
    user namespace."""
    with _lock:
        first = _user()
        if not first.switch:
            return first
        for uid in range(first.uid, first.uid + POOL_SIZE):
            if uid not in _state.leased and _unnamed(uid) and _claim(uid):
                return User(uid=uid, gid=uid, switch=True)
    raise RuntimeError(f"all {POOL_SIZE} sandbox uids from {first.uid} are in use: too many isolated runs at once "
                       f"(lower the rollout's concurrency)")  # this run fails; the machine can still sandbox


def release(owner: User) -> None:
    with _lock:
        fd = _state.leased.pop(owner.uid, None)
        if fd is not None:
            os.close(fd)  # closing releases the lock: another process may take the uid now


def _claim(uid: int) -> bool:
    """Take the machine-wide lock of `uid` for this process (kept in `_state.leased`); False if another holds it."""
    os.makedirs(LEASES, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(LEASES, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _state.leased[uid] = fd
    return True


def _unnamed(uid: int) -> bool:
    """No passwd or group entry has this id (it belongs to no one on the host)."""
    try:
        pwd.getpwuid(uid)
        return False
    except KeyError:
        pass
    try:
        grp.getgrgid(uid)
        return False
    except KeyError:
        return True


def _free_id() -> int:
    """The first id from FIRST_UID (or POLAR_LAB_SANDBOX_UID) with neither a passwd nor a group entry."""
    first = int(os.environ.get("POLAR_LAB_SANDBOX_UID") or FIRST_UID)
    for candidate in range(first, first + 4000):
        if _unnamed(candidate):
            return candidate
    raise SandboxError(f"no free uid in [{first}, {first + 4000}); pass one: Lab(..., sandbox_uid=N)")


def etc_fds(owner: User) -> tuple[int, int]:
    """In-memory passwd and group files naming the sandbox user (programs such as Node's os.userInfo() need an entry
    for their uid), as two descriptors for bwrap's `--ro-bind-data`: the caller passes them to the run and closes
    them once it has started (bwrap copies them). Nothing on disk, so nothing a killed kernel leaves behind."""
    texts = ("root:x:0:0:root:/root:/usr/sbin/nologin\n"
             f"sandbox:x:{owner.uid}:{owner.gid}:polar_lab sandbox:/tmp:/bin/sh\n"
             "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
             f"root:x:0:\nsandbox:x:{owner.gid}:\nnogroup:x:65534:\n")
    fds = []
    for name, text in zip(("passwd", "group"), texts):
        fd = os.memfd_create(f"polar-sandbox-{name}")
        os.write(fd, text.encode())
        os.lseek(fd, 0, os.SEEK_SET)
        fds.append(fd)
    return fds[0], fds[1]


def prepare_workdir(workdir: str | Path, owner: User | None = None) -> None:
    """Hand the workdir (and the files written into it) to the sandbox user (default: the first one)."""
    owner = owner or user()
    if not owner.switch:
        return
    for root, dirs, files in os.walk(workdir):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(root, name), owner.uid, owner.gid)
    os.chown(workdir, owner.uid, owner.gid)


def wrap(argv: list[str], *, workdir: str | Path | None, tmp_mb: int, etc: tuple[int, int],
         readonly: tuple[str, ...] = (), proxy: Proxy | None = None, owner: User | None = None, cwd: str | None = None,
         seccomp_fd: int | None = None, inside: str | None = None) -> list[str]:
    """`argv` run isolated: the setpriv + bwrap prefix, then (with a proxy) the forwarding launcher. etc: the
    passwd and group descriptors (`etc_fds`), passed to the run with the seccomp filter's. inside: where the run
    sees its workdir (default: at its own path); cwd is then a path as the run sees it."""
    owner = owner or user()
    if proxy is not None:  # the forwarder first, then the program
        argv = [sys.executable, "-I", "-S", str(LAUNCH), "--listen", proxy.host, str(proxy.port), "--to",
                f"{SOCKET_DIR}/{os.path.basename(proxy.socket)}", "--", *argv]
    if owner.switch:  # bwrap runs as root (it can read what it binds), the program as the sandbox user
        argv = ["setpriv", f"--reuid={owner.uid}", f"--regid={owner.gid}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--", *argv]
    box = ["bwrap", *([] if owner.switch else ["--unshare-user"]), "--unshare-pid", "--unshare-ipc",
           "--unshare-uts", "--unshare-net", "--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent",
           *(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []), *_system(),
           "--perms", "0644", "--ro-bind-data", str(etc[0]), "/etc/passwd",
           "--perms", "0644", "--ro-bind-data", str(etc[1]), "/etc/group",
           "--proc", "/proc", "--dev", "/dev",
           "--perms", "1777", "--size", str(tmp_mb * 1024 * 1024), "--tmpfs", "/tmp",
           "--perms", "1777", "--size", str(tmp_mb * 1024 * 1024), "--tmpfs", "/dev/shm"]
    mounts = _readonly(readonly)
    seen = inside or (str(workdir) if workdir is not None else None)
    box += _parents([*mounts, *([seen] if seen is not None else []),
                     *([SOCKET_DIR] if proxy is not None else [])])
    for path in mounts:  # after /tmp: a venv or checkout under /tmp is bound over the tmpfs
        box += ["--ro-bind", path, path]
    if workdir is not None:
        box += ["--bind", str(workdir), seen, "--chdir", str(cwd or seen)]
    if proxy is not None:
        box += ["--ro-bind", os.path.dirname(proxy.socket), SOCKET_DIR]
    return [*box, "--", *argv]


def _system() -> list[str]:
    """/usr and /etc read-only, and the top-level links (or folders) that point into /usr."""
    out = ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            out += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            out += ["--ro-bind", str(path), str(path)]
    return out


def _parents(paths: list[str]) -> list[str]:
    """Traversable (0755) folders above each mount point, which bwrap would otherwise make 0700 (the host's
    own modes, e.g. /root's, do not apply: these folders exist only in the sandbox)."""
    out, made = [], set()
    for path in paths:
        for parent in reversed(Path(path).parents):
            folder = str(parent)
            if folder in made or folder in ("/", "/tmp", "/usr", "/etc", "/dev", "/proc"):
                continue
            if folder.startswith(("/usr/", "/etc/", "/proc/", "/dev/")):
                continue
            made.add(folder)
            out += ["--perms", "0755", "--dir", folder]
    return out


def _readonly(extra: tuple[str, ...]) -> list[str]:
    """The interpreter, its environment, the polar_lab package and `extra`: existing paths, each once,
    outermost first (a path inside one already bound is bound again, read-only, harmlessly)."""
    paths = [sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable)), str(PACKAGE), *extra]
    seen = []
    for path in paths:
        for candidate in (os.path.realpath(path), path):  # the path as named too, when it is a link
            system = candidate == "/usr" or candidate.startswith(("/usr/", "/etc/"))  # bound already
            if os.path.exists(candidate) and candidate not in seen and not system:
                seen.append(candidate)
    return sorted(seen, key=lambda p: p.count("/"))
