"""The one sandbox for code the Lab does not trust: harness programs (`harness/command.py`) and unit-test
evaluators (`rewards/code.py`). Each `Sandbox` owns one run's process group, cgroups and output files.

Two levels. `configure` sets the process's default; a Lab does it at start from `LabConfig.harness` and puts
back the one before it when it closes (the level is per process: the newest open Lab's holds):
- "isolated" (the default): everything below, plus bubblewrap namespaces and an unprivileged user — the
  run sees its workdir, a read-only system and the proxy, nothing of the Lab (sandbox/isolation.py).
- "process": what follows only; same user and filesystem as the kernel. Good against accidents, not
  against a policy that learns what pays.

What every sandboxed run gets:
- a fresh temporary workdir, which is also its HOME and TMPDIR (removed afterwards unless kept);
- an environment built from scratch: PATH, locale, timezone, HF_HUB_OFFLINE, and what the caller adds —
  nothing else of the kernel's environment (API keys, tokens) leaks in;
- resource limits (`Limits`): address space, CPU seconds, file size and open files with util-linux
  `prlimit`; processes and memory with cgroups where the machine lets us make them (they hold for root
  too and know every descendant, even one that left the process group with setsid; elsewhere processes
  fall back to RLIMIT_NPROC); the workdir's disk use, checked while it runs;
- its own process group: when the program exits, its deadline passes or the caller is cancelled, the group
  is killed, then everything left in its cgroups. A run that hits its processes, memory or disk limit is
  killed the moment the limit is seen, and `Outcome.reason` says which limit ended it.

When the limits cannot be applied (no `prlimit`), `Sandbox` refuses with a `SandboxError` unless the
caller opts out with `Limits(enforce=False)`. Output goes to unnamed files, not pipes: a background child
holding an inherited pipe would otherwise keep the run open until its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from polar_lab.errors import SandboxError
from polar_lab.sandbox import files, isolation, seccomp
from polar_lab.sandbox.cgroup import Cgroup
from polar_lab.sandbox.isolation import LEVELS, Proxy, configure, current, expected, resolve, unavailable

__all__ = ["LEVELS", "Limits", "Outcome", "Proxy", "Sandbox", "configure", "current", "environment", "expected",
           "resolve", "run", "unavailable", "workdir", "write_files"]

log = logging.getLogger(__name__)
KEEP_ENV = ("PATH", "LANG", "LC_ALL", "HF_HUB_OFFLINE", "TZ")  # the only variables taken from the kernel
WATCH_S = 0.25  # how often a running sandbox's cgroups are checked (by its watcher thread)
DISK_WATCH_S = 1.0  # how often its workdir's disk use is (a walk of the tree)
MAX_OUTPUT_BYTES = 1024 * 1024  # of each of stdout and stderr, the tail kept
REASONS = ("deadline", "cpu", "memory", "processes", "disk")  # the limit that ended a run (`Outcome.reason`)


@dataclass(frozen=True)
class Limits:
    """Per-run resource limits."""

    memory_mb: int = 4096  # RLIMIT_AS, and the memory cgroup's ceiling where one can be made
    address_mb: int | None = None  # RLIMIT_AS when it must exceed memory_mb (WebAssembly reserves address space)
    cpu_seconds: int = 600  # RLIMIT_CPU: SIGXCPU at this many seconds, SIGKILL one second later
    file_mb: int = 512  # RLIMIT_FSIZE
    open_files: int = 4096  # RLIMIT_NOFILE
    disk_mb: int = 2048  # the workdir's disk use (checked every DISK_WATCH_S), and each private tmpfs when isolated
    disk_files: int = 200_000  # entries (files, folders, links) in the workdir; past it, or MAX_DEPTH deep: "disk"
    processes: int | None = 512  # tasks (processes and threads): a pids cgroup where possible, else RLIMIT_NPROC
    #   (which counts every process of the user, so None leaves it off where no cgroup can be made)
    enforce: bool = True  # False: run without prlimit where it is missing (an explicit opt-out)


@dataclass
class Outcome:
    """How a sandboxed run ended."""

    returncode: int | None  # None: killed by the sandbox (its deadline, or a limit it hit)
    stdout: str  # the last MAX_OUTPUT_BYTES
    stderr: str
    timed_out: bool  # still running when its deadline came (or its caller was cancelled)
    pids_peak: int | None  # most tasks at once, where the kernel reports it
    reason: str | None = None  # the limit that ended it (one of REASONS), None when it ended by itself
    level: str = "process"  # the sandbox level it ran at


def environment(workdir: str | Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A from-scratch environment for a run in `workdir`."""
    env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ}
    env.update(HOME=str(workdir), TMPDIR=str(workdir), **(extra or {}))
    return env


class Sandbox:
    """One run of `argv` in `workdir` under `limits`. `start()`, then `wait()` (a thread) or `wait_async()`
    (an event loop); `close()` always, which kills what is left. Context manager. While it runs, a watcher
    thread checks its cgroups and disk use and ends it at the first limit passed.

    level: "isolated" | "process" | None (the configured default; see `configure`). readonly: paths the
    program needs besides the system and the interpreter (its install), shown read-only when isolated.
    proxy: how an isolated program reaches the Lab's proxy (None: it reaches no network at all).
    cwd: where the program starts, inside the workdir (default: the workdir). inside: where an isolated program sees
    its workdir (default: at its own path) — a fixed path makes its view the same run after run (harness/command.py).
    """

    def __init__(self, argv: list[str], *, workdir: str | Path, env: dict[str, str], limits: Limits = Limits(),
                 level: str | None = None, readonly: tuple[str, ...] = (), proxy: Proxy | None = None,
                 cwd: str | Path | None = None, inside: str | None = None):
        self.argv, self.workdir, self.env, self.limits = list(argv), str(workdir), env, limits
        self.cwd = str(cwd or workdir)
        self.inside = inside
        self.readonly, self.proxy = tuple(readonly), proxy
        self._prlimit = _find_prlimit(limits)  # refuses before anything starts
        self.level = resolve(level)  # refuses too, where "isolated" cannot run and no fallback is allowed
        self.cgroup: Cgroup | None = None
        self.proc: subprocess.Popen | None = None
        self._out = self._err = None
        self._reason: str | None = None  # set when the sandbox ends the run for a limit
        self._done = threading.Event()  # stops the watcher
        self._watcher: threading.Thread | None = None
        self._owner: isolation.User | None = None  # the uid an isolated run holds
        self._seccomp: int | None = None  # the filter's descriptor, open while bwrap starts
        self._etc: tuple[int, ...] = ()  # the passwd and group descriptors, open while bwrap starts
        self._lock = threading.Lock()  # the watcher and close() both kill
        self._closed = threading.Event()  # set once close() has ended the run and kept its outcome

    def start(self) -> Sandbox:
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        try:
            self._owner = isolation.lease() if self.level == "isolated" else None  # its own uid, given back at close
            self.cgroup = Cgroup.create(max_pids=self.limits.processes, memory_mb=self.limits.memory_mb)
            _say_once_what_is_missing(self.cgroup)
            if self.level == "isolated":
                self._seccomp, self._etc = seccomp.filter_fd(), isolation.etc_fds(self._owner)
            self.proc = subprocess.Popen(
                self._command(), cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=self._out,
                stderr=self._err, start_new_session=True,  # its own process group: the deadline kills its children
                pass_fds=(*self._etc, *(() if self._seccomp is None else (self._seccomp,))))
        except BaseException:  # e.g. EAGAIN when processes are scarce: leave no cgroup, uid or files behind
            if self.cgroup is not None:
                self.cgroup.close()
            if self._owner is not None:
                isolation.release(self._owner)
            self._out.close()
            self._err.close()
            self._out = None
            raise
        finally:
            for fd in (*self._etc, *(() if self._seccomp is None else (self._seccomp,))):  # bwrap has its copies
                os.close(fd)
        self._watcher = threading.Thread(target=self._watch, name="polar-lab-sandbox-watch", daemon=True)
        self._watcher.start()
        return self

    def _command(self) -> list[str]:
        """The full argv: first the kernel's OOM killer is told to prefer this run over the Lab, the run joins
        its cgroups, then prlimit, then (isolated) bwrap and setpriv, then the program."""
        joins = [f'echo $$ > "{path}/cgroup.procs"' for path in dict.fromkeys(self.cgroup.paths.values())] \
            if self.cgroup is not None else []
        shell = " && ".join(["echo 1000 > /proc/self/oom_score_adj", *joins, 'exec "$@"'])
        nproc = self.cgroup is None or "pids" not in self.cgroup.paths
        argv = self.argv
        if self.level == "isolated":
            isolation.prepare_workdir(self.workdir, self._owner)
            seen_cwd = self.cwd if self.inside is None else self.inside + self.cwd[len(self.workdir):]
            argv = isolation.wrap(argv, workdir=self.workdir, tmp_mb=self.limits.disk_mb, readonly=self.readonly,
                                  proxy=self.proxy, cwd=seen_cwd, owner=self._owner, seccomp_fd=self._seccomp,
                                  etc=self._etc, inside=self.inside)
        return ["/bin/sh", "-c", shell, "sh", *_limits_argv(self._prlimit, self.limits, nproc=nproc), *argv]

    def _watch(self) -> None:
        """The watcher thread: every WATCH_S, the cgroups' verdicts; every DISK_WATCH_S, the workdir's disk
        use. The first limit passed ends the run (kill) and is kept as its reason."""
        next_disk = time.monotonic() + DISK_WATCH_S
        while not self._done.wait(WATCH_S):
            try:
                reason = self.cgroup.exceeded() if self.cgroup is not None else None
                if reason is None and time.monotonic() >= next_disk:
                    reason = self._disk_exceeded()
                    next_disk = time.monotonic() + DISK_WATCH_S
            except Exception:  # noqa: BLE001 - a failed check (EMFILE...) must not end the watching
                log.warning("checking a sandbox's limits failed; checking again", exc_info=True)
                continue
            if reason is not None:
                with self._lock:
                    if self._reason is None and not self._done.is_set():
                        self._reason = reason
                        self._kill()
                return

    def _disk_exceeded(self) -> str | None:
        used = files.usage(self.workdir, max_entries=self.limits.disk_files)
        over = used.mb > self.limits.disk_mb or used.entries > self.limits.disk_files or used.too_deep
        return "disk" if over else None

    def wait(self, timeout: float | None = None) -> Outcome:
        """Block until the program exits or `timeout` passes; then end the run and return its outcome."""
        fd = self._pidfd()
        if fd is None:  # no pidfd (an old kernel): look every 10 ms
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._exited() and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.01)
        else:
            try:
                poller = select.poll()
                poller.register(fd, select.POLLIN)
                poller.poll(None if timeout is None else int(timeout * 1000))  # readable the moment it exits
            finally:
                os.close(fd)
        return self.close()

    async def wait_async(self, poll_s: float = 0.02) -> Outcome:
        """Wait on an event loop (a pidfd the loop watches; polling where there is none); cancelling the
        caller kills the run. The end (killing, reaping, reading the output) runs in a thread: it may wait
        for a cgroup to empty."""
        fd = self._pidfd()
        try:
            if fd is None:
                while not self._exited():
                    await asyncio.sleep(poll_s)
            else:
                loop, exited = asyncio.get_running_loop(), asyncio.Event()
                loop.add_reader(fd, exited.set)
                try:
                    await exited.wait()
                finally:
                    loop.remove_reader(fd)
        except BaseException:
            self._kill()  # cancelled: end it now, whatever happens to this task next
            raise
        finally:
            if fd is not None:
                os.close(fd)
            outcome = await asyncio.shield(asyncio.to_thread(self.close))
        return outcome

    def _pidfd(self) -> int | None:
        """A descriptor that becomes readable when the program exits (Linux 5.3+), or None."""
        try:
            return os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):  # an old kernel
            return None

    def _exited(self) -> bool:
        """Whether the program has exited, without reaping it: until it is reaped, its pid and process group
        id stay its own, so killing the group cannot hit anyone else's."""
        if self.proc.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped already
            return True

    def _kill(self) -> None:
        if self.proc.returncode is None:  # not reaped yet (a zombie leader still holds the group id)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group start_new_session made; no one else's
            except ProcessLookupError:
                pass
        if self.cgroup is not None:
            self.cgroup.kill()

    def close(self) -> Outcome:
        """Kill the process group and everything left in the cgroups (what the program left running after it
        exited too); collect the output. Safe to call twice, and from two threads: one ends the run, the
        other waits for it."""
        if self.proc is None:
            raise SandboxError("the sandbox was never started")
        with self._lock:
            first = not self._done.is_set()
            self._done.set()
            if first:
                still_running = not self._exited() and self._reason is None
                self._kill()  # before reaping: the group's leftovers die with it
        if not first:
            self._closed.wait()
            return self._outcome
        try:
            self._outcome = self._end(still_running)
        finally:
            self._closed.set()
        return self._outcome

    def _end(self, still_running: bool) -> Outcome:
        self.proc.wait()
        if self._watcher is not None:
            self._watcher.join()
        peak = reason = cpu = None
        if self.cgroup is not None:
            peak, reason, cpu = self.cgroup.peak(), self.cgroup.exceeded(), self.cgroup.cpu_seconds()
            self.cgroup.close()  # every process the run left, even one that escaped its process group
            self.cgroup = None
        owner, self._owner = self._owner, None
        if owner is not None:  # its processes are gone (the cgroup emptied, or the PID namespace ended)
            isolation.release(owner)
        if reason is None and self._reason is None and not still_running:
            reason = self._disk_exceeded()  # it wrote past the quota and ended before a check saw it
        if reason is None and not still_running:
            reason = _signal_reason(self.proc.returncode, cpu, self.limits.cpu_seconds)
        reason = self._reason or reason or ("deadline" if still_running else None)
        killed = still_running or self._reason is not None
        outcome = Outcome(returncode=None if killed else self.proc.returncode, stdout=_tail(self._out),
                          stderr=_tail(self._err), timed_out=still_running, pids_peak=peak, reason=reason,
                          level=self.level)
        self._out.close()
        self._err.close()
        return outcome

    def __enter__(self) -> Sandbox:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


_missing_said: set[str] = set()


def _say_once_what_is_missing(cgroup: Cgroup | None) -> None:
    """Log, once per process, a limit this machine's cgroups cannot hold (no delegation, e.g. cgroup v2
    without a delegated subtree): runs still go, with the weaker stand-in named."""
    have = set(cgroup.paths) if cgroup is not None else set()
    weaker = {"pids": "processes are limited by RLIMIT_NPROC (not for root) and a run's leftovers are found by "
                      "its process group and PID namespace only",
              "memory": "memory is limited by RLIMIT_AS only (allocations fail; a run is not killed for it)"}
    for controller, instead in weaker.items():
        if controller not in have and controller not in _missing_said:
            _missing_said.add(controller)
            log.warning("no %s cgroup can be made here: %s", controller, instead)


def _tail(stream) -> str:
    """The last MAX_OUTPUT_BYTES of an output file (a program may print up to its file-size limit)."""
    size = stream.seek(0, os.SEEK_END)
    stream.seek(max(0, size - MAX_OUTPUT_BYTES))
    return stream.read().decode(errors="replace")


def _signal_reason(returncode: int | None, cpu_s: float | None, limit_s: int) -> str | None:
    """"cpu" when the run died of its CPU limit: SIGXCPU at the soft limit, or SIGKILL at the hard one when
    the cgroup saw it use that much CPU (an isolated run reports a signal N as exit status 128 + N)."""
    if returncode is None:
        return None
    died_of = -returncode if returncode < 0 else returncode - 128
    if died_of == signal.SIGXCPU:
        return "cpu"
    if died_of == signal.SIGKILL and cpu_s is not None and cpu_s >= limit_s:
        return "cpu"
    return None


def run(argv: list[str], *, timeout: float, files: dict[str, str] | None = None, env: dict[str, str] | None = None,
        limits: Limits = Limits(), level: str | None = None) -> Outcome:
    """Run `argv` in a fresh workdir holding `files` (relative path → text), with a from-scratch environment
    plus `env`, under `limits`, at `level` (None: the configured default), for at most `timeout` seconds;
    the workdir is removed afterwards."""
    with workdir() as where:
        write_files(where, files or {})
        with Sandbox(argv, workdir=where, env=environment(where, env), limits=limits, level=level) as box:
            return box.wait(timeout)


@contextlib.contextmanager
def workdir(prefix: str = "polar-sandbox-", *, keep: bool = False) -> Iterator[str]:
    """A fresh temporary folder, removed on exit unless `keep`."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        if not keep:
            files.remove_tree(path)  # whatever a program made of it (a tree too deep for rmtree...)


def write_files(root: str | Path, files: dict[str, str]) -> None:
    """Write `files` (relative path → text) under `root`; a path may not leave it."""
    base = Path(root).resolve()
    for relative, content in files.items():
        path = (base / relative).resolve()
        if base not in path.parents:
            raise SandboxError(f"file {relative!r} would be written outside the sandbox's workdir")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


def _find_prlimit(limits: Limits) -> str | None:
    prlimit = shutil.which("prlimit")
    if prlimit is None and limits.enforce:
        raise SandboxError("prlimit (util-linux) is needed to run code under resource limits; install it, or "
                           "pass Limits(enforce=False) to run without them")
    return prlimit


def _limits_argv(prlimit: str | None, limits: Limits, *, nproc: bool) -> list[str]:
    """The prlimit prefix; RLIMIT_NPROC only when no pids cgroup holds the process count (`nproc`)."""
    if prlimit is None:
        return []
    mb = 1024 * 1024
    argv = [prlimit, f"--as={(limits.address_mb or limits.memory_mb) * mb}", f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
            f"--fsize={limits.file_mb * mb}", f"--nofile={limits.open_files}", "--core=0"]  # no core dumps
    if nproc and limits.processes is not None:
        argv.append(f"--nproc={limits.processes}")
    return [*argv, "--"]
