"""Program harnesses: any command line (a CLI agent, a script) run unmodified against a session.

A `Command` fills its placeholders from the task and the session, writes its files, and runs the program in
the sandbox (polar_lab/sandbox.py: fresh workdir as HOME, an environment built from scratch plus the
session's base URLs and keys, prlimit limits, a pids cgroup where possible, its own process group killed at
the deadline or when the program exits). stdout/stderr are captured. A non-zero exit raises `HarnessError`,
so the rollout marks the run "error" and masks it.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from polar_lab import sandbox
from polar_lab.errors import HarnessError
from polar_lab.types import Session

_PLACEHOLDER = re.compile(r"\{(\w+)\}")  # only {name} of known fields; other braces (code) stay as they are


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
    enforce_limits: bool = True  # False: run without prlimit where the machine has none (an explicit opt-out)
    name: str = "command"

    @property
    def __name__(self) -> str:  # rollouts name sessions after their harness
        return self.name

    @property
    def limits(self) -> sandbox.Limits:
        return sandbox.Limits(memory_mb=self.memory_mb, cpu_seconds=self.cpu_seconds, file_mb=self.file_mb,
                              processes=self.processes, enforce=self.enforce_limits)

    async def __call__(self, session: Session, task: dict[str, Any]) -> dict[str, Any]:
        with sandbox.workdir(prefix=f"polar-{self.name}-", keep=self.keep_workdir) as workdir:
            return await self._run(session, task, workdir)

    async def _run(self, session: Session, task: dict[str, Any], workdir: str) -> dict[str, Any]:
        values = {"python": sys.executable, "bin": os.path.dirname(sys.executable), "workdir": workdir,
                  "openai_base_url": session.openai_base_url, "anthropic_base_url": session.anthropic_base_url,
                  **task}

        def fill(text: str) -> str:
            return _PLACEHOLDER.sub(lambda m: str(values.get(m[1], m[0])), text)

        sandbox.write_files(workdir, {path: fill(text) for path, text in self.files.items()})  # e.g. Codex's config
        argv = [fill(a) for a in self.argv]
        env = sandbox.environment(workdir, {**session.env(), **{k: fill(v) for k, v in self.env.items()}})
        outcome = await sandbox.Sandbox(argv, workdir=workdir, env=env, limits=self.limits).start().wait_async()
        result = {"returncode": outcome.returncode, "stdout": outcome.stdout, "stderr": outcome.stderr,
                  "workdir": workdir, "pids_peak": outcome.pids_peak}
        if outcome.returncode != 0:
            said = (outcome.stderr.strip() or outcome.stdout.strip())[-500:]  # some agents report on stdout
            raise HarnessError(f"{argv[0]} exited {outcome.returncode}: {said}", output=outcome.stdout + outcome.stderr)
        lines = outcome.stdout.strip().splitlines()
        result["final"] = lines[-1] if lines else ""
        return result
