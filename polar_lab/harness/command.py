"""Program harnesses: any command line (a CLI agent, a script) run unmodified against a session.

Each run gets a fresh temporary workdir (also its HOME and TMPDIR), an environment built from scratch —
PATH and locale, the session's base URLs and keys (`session.env()`), and what the harness asks for;
nothing else of the kernel's environment leaks in — resource limits (address space, CPU seconds, file
size, processes) applied with util-linux `prlimit`, a pids cgroup where the machine allows one (the
process limit then holds for root too; see harness/pids.py), and its own process group. When the
deadline passes or the rollout is cancelled the group is killed, and every process left in the cgroup.
stdout/stderr are captured.
A non-zero exit raises `HarnessError`, so the rollout marks the run "error" and masks it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from polar_lab.errors import PolarLabError
from polar_lab.harness.pids import PidsCgroup
from polar_lab.types import Session

_PLACEHOLDER = re.compile(r"\{(\w+)\}")  # only {name} of known fields; other braces (code) stay as they are
_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "HF_HUB_OFFLINE", "TZ")


class HarnessError(PolarLabError, RuntimeError):
    """A harness program exited non-zero; `output` holds what it printed (stdout, then stderr)."""

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output


@dataclass
class Command:
    """In `argv`, `env` values and `files`, `{field}` is replaced by the task's field, `{python}` by this interpreter, `{bin}` by
    its folder, `{workdir}`, `{openai_base_url}` and `{anthropic_base_url}` by the run's own, e.g.
    `Command(["{python}", "-m", "polar_lab.harness.calc_cli", "{question}"])`."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # workdir-relative path → content, written first
    memory_mb: int = 4096  # RLIMIT_AS
    cpu_seconds: int = 600  # RLIMIT_CPU
    file_mb: int = 512  # RLIMIT_FSIZE
    processes: int = 512  # tasks (processes and threads): a pids cgroup where possible, else RLIMIT_NPROC
    keep_workdir: bool = False
    name: str = "command"

    @property
    def __name__(self) -> str:  # rollouts name sessions after their harness
        return self.name

    async def __call__(self, session: Session, task: dict[str, Any]) -> dict[str, Any]:
        workdir = tempfile.mkdtemp(prefix=f"polar-{self.name}-")
        try:
            return await self._run(session, task, workdir)
        finally:
            if not self.keep_workdir:
                shutil.rmtree(workdir, ignore_errors=True)

    async def _run(self, session: Session, task: dict[str, Any], workdir: str) -> dict[str, Any]:
        values = {"python": sys.executable, "bin": os.path.dirname(sys.executable), "workdir": workdir,
                  "openai_base_url": session.openai_base_url, "anthropic_base_url": session.anthropic_base_url,
                  **task}

        def fill(text: str) -> str:
            return _PLACEHOLDER.sub(lambda m: str(values.get(m[1], m[0])), text)

        for relative, content in self.files.items():  # config files the program reads (e.g. Codex's)
            path = os.path.join(workdir, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as fh:
                fh.write(fill(content))
        argv = [fill(a) for a in self.argv]
        env = {k: fill(v) for k, v in self._environment(session, workdir).items()}
        cgroup = PidsCgroup.create(self.processes)
        try:
            out, err, returncode = await self._execute(argv, env, workdir, cgroup)
            peak = cgroup.peak() if cgroup else None
        finally:
            if cgroup is not None:
                cgroup.close()  # every process the run left, even one that escaped its process group
        result = {"returncode": returncode, "stdout": out.decode(errors="replace"),
                  "stderr": err.decode(errors="replace"), "workdir": workdir, "pids_peak": peak}
        if returncode != 0:
            said = (result["stderr"].strip() or result["stdout"].strip())[-500:]  # some agents report on stdout
            raise HarnessError(f"{argv[0]} exited {returncode}: {said}", output=result["stdout"] + result["stderr"])
        lines = result["stdout"].strip().splitlines()
        result["final"] = lines[-1] if lines else ""
        return result

    async def _execute(self, argv: list[str], env: dict[str, str], workdir: str,
                       cgroup: PidsCgroup | None) -> tuple[bytes, bytes, int]:
        """Run until the program exits, then kill what it left behind. Output goes to unnamed files, not
        pipes: a background child holding an inherited pipe would keep the run open until its deadline."""
        join = cgroup.join_argv() if cgroup is not None else []
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = await asyncio.create_subprocess_exec(
                *join, *self._limits(), *argv, cwd=workdir, env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True)  # its own process group: the deadline kills children too
            try:
                await proc.wait()
            finally:  # also on the deadline (CancelledError): leave nothing running
                _kill_group(proc.pid, cgroup)
                if proc.returncode is None:
                    await proc.wait()
            out.seek(0)
            err.seek(0)
            return out.read(), err.read(), proc.returncode

    def _environment(self, session: Session, workdir: str) -> dict[str, str]:
        env = {k: os.environ[k] for k in _KEEP_ENV if k in os.environ}
        env.update(HOME=workdir, TMPDIR=workdir, **session.env(), **self.env)
        return env

    def _limits(self) -> list[str]:
        prlimit = shutil.which("prlimit")
        if prlimit is None:
            raise HarnessError("prlimit (util-linux) is needed to run program harnesses under resource limits")
        mb = 1024 * 1024
        return [prlimit, f"--as={self.memory_mb * mb}", f"--cpu={self.cpu_seconds}",
                f"--fsize={self.file_mb * mb}", f"--nproc={self.processes}", "--"]


def _kill_group(pid: int, cgroup: PidsCgroup | None = None) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the group we created with start_new_session; no one else's
    except ProcessLookupError:
        pass
    if cgroup is not None:
        cgroup.kill()  # and whatever left the group: everything in the cgroup descends from this run

