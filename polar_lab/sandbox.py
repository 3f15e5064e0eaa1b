"""The one sandbox for code the Lab does not trust: harness programs (`harness/command.py`) and unit-test
evaluators (`rewards/code.py`). Each `Sandbox` owns one run's process group, pids cgroup and output files.

What a sandboxed run gets:
- a fresh temporary workdir, which is also its HOME and TMPDIR (removed afterwards unless kept);
- an environment built from scratch: PATH, locale, timezone, HF_HUB_OFFLINE, and what the caller adds —
  nothing else of the kernel's environment (API keys, tokens) leaks in;
- resource limits applied with util-linux `prlimit`: address space, CPU seconds, file size, processes;
- a pids cgroup where the machine lets us make one (RLIMIT_NPROC is not enforced for root; a pids cgroup
  caps processes and threads whoever runs them, and knows every descendant, even one that left the process
  group with setsid). Elsewhere the run keeps RLIMIT_NPROC, which does hold for users other than root;
- its own process group: when the program exits, its deadline passes or the caller is cancelled, the group
  is killed, then everything left in the cgroup.

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
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from polar_lab.errors import SandboxError

KEEP_ENV = ("PATH", "LANG", "LC_ALL", "HF_HUB_OFFLINE", "TZ")  # the only variables taken from the kernel


@dataclass(frozen=True)
class Limits:
    """Per-run resource limits."""

    memory_mb: int = 4096  # RLIMIT_AS
    cpu_seconds: int = 600  # RLIMIT_CPU
    file_mb: int = 512  # RLIMIT_FSIZE
    processes: int | None = 512  # tasks (processes and threads): a pids cgroup where possible, else RLIMIT_NPROC
    #   (which counts every process of the user, so None leaves it off where no cgroup can be made)
    enforce: bool = True  # False: run without prlimit where it is missing (an explicit opt-out)


@dataclass
class Outcome:
    """How a sandboxed run ended."""

    returncode: int | None  # None: killed at its deadline
    stdout: str
    stderr: str
    timed_out: bool
    pids_peak: int | None  # most tasks at once, where the kernel reports it


def environment(workdir: str | Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A from-scratch environment for a run in `workdir`."""
    env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ}
    env.update(HOME=str(workdir), TMPDIR=str(workdir), **(extra or {}))
    return env


class Sandbox:
    """One run of `argv` in `workdir` under `limits`. `start()`, then `wait()` (a thread) or `wait_async()`
    (an event loop); `close()` always, which kills what is left. Context manager."""

    def __init__(self, argv: list[str], *, workdir: str | Path, env: dict[str, str], limits: Limits = Limits()):
        self.argv, self.workdir, self.env, self.limits = list(argv), str(workdir), env, limits
        self._prlimit = _find_prlimit(limits)  # refuses before anything starts
        self.cgroup: PidsCgroup | None = None
        self.proc: subprocess.Popen | None = None
        self._out = self._err = None

    def start(self) -> Sandbox:
        self.cgroup = PidsCgroup.create(self.limits.processes)
        join = self.cgroup.join_argv() if self.cgroup is not None else []
        limits = _limits_argv(self._prlimit, self.limits, nproc=self.cgroup is None)
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                [*join, *limits, *self.argv],
                cwd=self.workdir, env=self.env, stdin=subprocess.DEVNULL, stdout=self._out, stderr=self._err,
                start_new_session=True)  # its own process group: the deadline kills its children too
        except BaseException:  # e.g. EAGAIN when processes are scarce: leave no cgroup or files behind
            if self.cgroup is not None:
                self.cgroup.close()
            self._out.close()
            self._err.close()
            raise
        return self

    def wait(self, timeout: float | None = None) -> Outcome:
        """Block until the program exits or `timeout` passes; then end the run and return its outcome."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        return self.close()

    async def wait_async(self, poll_s: float = 0.02) -> Outcome:
        """Wait on an event loop (without a child watcher); cancelling the caller kills the run."""
        try:
            while self.proc.poll() is None:
                await asyncio.sleep(poll_s)
        finally:
            outcome = self.close()
        return outcome

    def close(self) -> Outcome:
        """Kill the process group and everything left in the cgroup; collect the output. Safe to call twice."""
        if self.proc is None:
            raise SandboxError("the sandbox was never started")
        timed_out = self.proc.poll() is None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group start_new_session made; no one else's
        except ProcessLookupError:
            pass
        self.proc.wait()
        peak = None
        if self.cgroup is not None:
            peak = self.cgroup.peak()
            self.cgroup.close()  # every process the run left, even one that escaped its process group
            self.cgroup = None
        if self._out is not None:
            self._out.seek(0)
            self._err.seek(0)
            self._outcome = Outcome(returncode=None if timed_out else self.proc.returncode,
                                    stdout=self._out.read().decode(errors="replace"),
                                    stderr=self._err.read().decode(errors="replace"), timed_out=timed_out,
                                    pids_peak=peak)
            self._out.close()
            self._err.close()
            self._out = self._err = None
        return self._outcome

    def __enter__(self) -> Sandbox:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def run(argv: list[str], *, timeout: float, files: dict[str, str] | None = None, env: dict[str, str] | None = None,
        limits: Limits = Limits()) -> Outcome:
    """Run `argv` in a fresh workdir holding `files` (relative path → text), with a from-scratch environment
    plus `env`, under `limits`, for at most `timeout` seconds; the workdir is removed afterwards."""
    with workdir() as where:
        write_files(where, files or {})
        return Sandbox(argv, workdir=where, env=environment(where, env), limits=limits).start().wait(timeout)


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
    argv = [prlimit, f"--as={limits.memory_mb * mb}", f"--cpu={limits.cpu_seconds}", f"--fsize={limits.file_mb * mb}"]
    if nproc and limits.processes is not None:
        argv.append(f"--nproc={limits.processes}")
    return [*argv, "--"]


# ---- the pids cgroup ---------------------------------------------------------------------------
_V1 = Path("/sys/fs/cgroup/pids")
_V2 = Path("/sys/fs/cgroup")


def _own(hierarchy: str) -> str:
    """This process's cgroup path in a hierarchy ("pids" for v1, "" for the v2 unified one)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == hierarchy or (hierarchy == "pids" and "pids" in controllers.split(",")):
            return path.lstrip("/")
    return ""


def _parents() -> list[Path]:
    """Where a child pids cgroup may be made: under our own cgroup, v1 first, then v2."""
    out = []
    if _V1.is_dir():
        out.append(_V1 / _own("pids"))
    if (_V2 / "cgroup.controllers").exists():
        out.append(_V2 / _own(""))
    return out


class PidsCgroup:
    """A process-count limit that holds for root too: one pids cgroup per sandboxed run."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls, max_pids: int | None) -> PidsCgroup | None:
        """A new cgroup that allows `max_pids` tasks (None: no limit, only the cleanup), or None where this
        machine does not let us make one."""
        for parent in _parents():
            path = parent / f"polar-lab-{uuid.uuid4().hex[:12]}"
            try:
                path.mkdir()
            except OSError:
                continue
            try:
                (path / "pids.max").write_text("max" if max_pids is None else str(max_pids))
                return cls(path)
            except OSError:
                path.rmdir()
        return None

    def join_argv(self) -> list[str]:
        """argv prefix that moves the program into this cgroup before it starts (no preexec_fn: the Lab
        has threads, and forking with a Python callback is unsafe then)."""
        return ["/bin/sh", "-c", f'echo $$ > "{self.path}/cgroup.procs" && exec "$@"', "sh"]

    def peak(self) -> int | None:
        """Most tasks the run had at once, where the kernel reports it."""
        try:
            return int((self.path / "pids.peak").read_text())
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (all of them descend from the run)."""
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self, timeout: float = 10.0) -> None:
        """Kill what is left and remove the cgroup."""
        deadline = time.monotonic() + timeout
        while True:
            self.kill()
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
