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
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from polar_lab.errors import SandboxError
from polar_lab.sandbox import isolation
from polar_lab.sandbox.cgroup import Cgroup
from polar_lab.sandbox.isolation import LEVELS, Proxy, configure, current, resolve, unavailable

__all__ = ["LEVELS", "Limits", "Outcome", "Proxy", "Sandbox", "configure", "current", "environment", "resolve",
           "run", "unavailable", "workdir", "write_files"]

KEEP_ENV = ("PATH", "LANG", "LC_ALL", "HF_HUB_OFFLINE", "TZ")  # the only variables taken from the kernel
WATCH_S = 0.25  # how often a running sandbox's cgroups and disk use are checked
REASONS = ("deadline", "cpu", "memory", "processes", "disk")  # the limit that ended a run (`Outcome.reason`)


@dataclass(frozen=True)
class Limits:
    """Per-run resource limits."""

    memory_mb: int = 4096  # RLIMIT_AS, and the memory cgroup's ceiling where one can be made
    cpu_seconds: int = 600  # RLIMIT_CPU: SIGXCPU at this many seconds, SIGKILL one second later
    file_mb: int = 512  # RLIMIT_FSIZE
    open_files: int = 4096  # RLIMIT_NOFILE
    disk_mb: int = 2048  # the workdir's disk use (checked every WATCH_S), and each private tmpfs when isolated
    processes: int | None = 512  # tasks (processes and threads): a pids cgroup where possible, else RLIMIT_NPROC
    #   (which counts every process of the user, so None leaves it off where no cgroup can be made)
    enforce: bool = True  # False: run without prlimit where it is missing (an explicit opt-out)


@dataclass
class Outcome:
    """How a sandboxed run ended."""

    returncode: int | None  # None: killed by the sandbox (its deadline, or a limit it hit)
    stdout: str
    stderr: str
    timed_out: bool
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
    (an event loop); `close()` always, which kills what is left. Context manager.

    level: "isolated" | "process" | None (the configured default; see `configure`). readonly: paths the
    program needs besides the system and the interpreter (its install), shown read-only when isolated.
    proxy: how an isolated program reaches the Lab's proxy (None: it reaches no network at all).
    cwd: where the program starts, inside the workdir (default: the workdir).
    """

    def __init__(self, argv: list[str], *, workdir: str | Path, env: dict[str, str], limits: Limits = Limits(),
                 level: str | None = None, readonly: tuple[str, ...] = (), proxy: Proxy | None = None,
                 cwd: str | Path | None = None):
        self.argv, self.workdir, self.env, self.limits = list(argv), str(workdir), env, limits
        self.cwd = str(cwd or workdir)
        self.readonly, self.proxy = tuple(readonly), proxy
        self._prlimit = _find_prlimit(limits)  # refuses before anything starts
        self.level = resolve(level)  # refuses too, where "isolated" cannot run and no fallback is allowed
        self.cgroup: Cgroup | None = None
        self.proc: subprocess.Popen | None = None
        self._out = self._err = None
        self._reason: str | None = None  # set when the sandbox ends the run for a limit
        self._next_watch = 0.0

    def start(self) -> Sandbox:
        self.cgroup = Cgroup.create(max_pids=self.limits.processes, memory_mb=self.limits.memory_mb)
        join = self.cgroup.join_argv() if self.cgroup is not None else []
        limits = _limits_argv(self._prlimit, self.limits, nproc=self.cgroup is None or "pids" not in self.cgroup.paths)
        argv = self.argv
        if self.level == "isolated":
            isolation.prepare_workdir(self.workdir)
            argv = isolation.wrap(argv, workdir=self.workdir, tmp_mb=self.limits.disk_mb, readonly=self.readonly,
                                  proxy=self.proxy, cwd=self.cwd)
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                [*join, *limits, *argv],
                cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=self._out, stderr=self._err,
                start_new_session=True)  # its own process group: the deadline kills its children too
        except BaseException:  # e.g. EAGAIN when processes are scarce: leave no cgroup or files behind
            if self.cgroup is not None:
                self.cgroup.close()
            self._out.close()
            self._err.close()
            raise
        return self

    def watch(self) -> str | None:
        """Check the run's limits now (at most every WATCH_S); end the run when one is exceeded and return
        which. Called by the wait loops."""
        now = time.monotonic()
        if self._reason is not None or now < self._next_watch:
            return self._reason
        self._next_watch = now + WATCH_S
        reason = self.cgroup.exceeded() if self.cgroup is not None else None
        if reason is None and disk_mb(self.workdir) > self.limits.disk_mb:
            reason = "disk"
        if reason is not None:
            self._reason = reason
            self._kill()
        return reason

    def wait(self, timeout: float | None = None) -> Outcome:
        """Block until the program exits or `timeout` passes; then end the run and return its outcome."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.watch() is None:
            left = WATCH_S if deadline is None else min(WATCH_S, deadline - time.monotonic())
            try:
                self.proc.wait(max(left, 0))
                break
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline:
                    break
        return self.close()

    async def wait_async(self, poll_s: float = 0.02) -> Outcome:
        """Wait on an event loop (without a child watcher); cancelling the caller kills the run."""
        try:
            while self.proc.poll() is None and self.watch() is None:
                await asyncio.sleep(poll_s)
        finally:
            outcome = self.close()
        return outcome

    def _kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group start_new_session made; no one else's
        except ProcessLookupError:
            pass
        if self.cgroup is not None:
            self.cgroup.kill()

    def close(self) -> Outcome:
        """Kill the process group and everything left in the cgroups; collect the output. Safe to call twice."""
        if self.proc is None:
            raise SandboxError("the sandbox was never started")
        if self._out is None:
            return self._outcome
        still_running = self.proc.poll() is None
        self._kill()
        self.proc.wait()
        peak = reason = None
        if self.cgroup is not None:
            peak, reason = self.cgroup.peak(), self.cgroup.exceeded()
            self.cgroup.close()  # every process the run left, even one that escaped its process group
            self.cgroup = None
        if reason is None and not still_running and disk_mb(self.workdir) > self.limits.disk_mb:
            reason = "disk"  # it wrote past the quota and ended before the next check saw it
        reason = self._reason or reason or ("deadline" if still_running else _signal_reason(self.proc.returncode))
        self._out.seek(0)
        self._err.seek(0)
        self._outcome = Outcome(returncode=None if still_running or self._reason else self.proc.returncode,
                                stdout=self._out.read().decode(errors="replace"),
                                stderr=self._err.read().decode(errors="replace"), timed_out=still_running,
                                pids_peak=peak, reason=reason, level=self.level)
        self._out.close()
        self._err.close()
        self._out = self._err = None
        return self._outcome

    def __enter__(self) -> Sandbox:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def disk_mb(root: str | Path) -> float:
    """Disk space the files under `root` take, in MiB (allocated blocks; links not followed)."""
    total = 0
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:  # removed while we looked
                pass
    return total / (1024 * 1024)


def _signal_reason(returncode: int | None) -> str | None:
    """"cpu" when the run died of SIGXCPU (its CPU limit); an isolated run reports a signal as 128 + N."""
    return "cpu" if returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU) else None


def run(argv: list[str], *, timeout: float, files: dict[str, str] | None = None, env: dict[str, str] | None = None,
        limits: Limits = Limits(), level: str | None = None) -> Outcome:
    """Run `argv` in a fresh workdir holding `files` (relative path → text), with a from-scratch environment
    plus `env`, under `limits`, at `level` (None: the configured default), for at most `timeout` seconds;
    the workdir is removed afterwards."""
    with workdir() as where:
        write_files(where, files or {})
        box = Sandbox(argv, workdir=where, env=environment(where, env), limits=limits, level=level)
        return box.start().wait(timeout)


@contextlib.contextmanager
def workdir(prefix: str = "polar-sandbox-", *, keep: bool = False) -> Iterator[str]:
    """A fresh temporary folder, removed on exit unless `keep`."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


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
    argv = [prlimit, f"--as={limits.memory_mb * mb}", f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
            f"--fsize={limits.file_mb * mb}", f"--nofile={limits.open_files}"]
    if nproc and limits.processes is not None:
        argv.append(f"--nproc={limits.processes}")
    return [*argv, "--"]
