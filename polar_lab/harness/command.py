"""Program harnesses: any command line (a CLI agent, a script) run unmodified against a session.

A `Command` fills its placeholders from the task and the session, writes its files, and runs the program in
the sandbox (polar_lab/sandbox: by default "isolated" — its own unprivileged user and namespaces, a fresh
workdir as HOME, a read-only system, the proxy reachable at the session's usual address and nothing else of
the Lab; an environment built from scratch plus the session's base URLs and keys; limits on memory, CPU,
files, processes and disk; its own process group killed at the deadline, when a limit is hit or when the
program exits). stdout/stderr are captured. A non-zero exit, or a limit hit, raises `HarnessError`, so the
rollout marks the run "error" (with `info["limit"]` naming the limit) and masks it.

With `workspace`, the task carries a repository (`task[workspace]`: relative path → text) that is written
into `<workdir>/repo`, where the program starts; the result's `changes` are the files it created, edited
or deleted there. Evaluators score those changes on pristine task files in a fresh sandbox
(`rewards.code.repo_tests`), never the workdir the program could tamper with.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_lab import sandbox
from polar_lab.errors import HarnessError, SandboxError
from polar_lab.sandbox import files
from polar_lab.types import Session

_PLACEHOLDER = re.compile(r"\{(\w+)\}")  # only {name} of known fields; other braces (code) stay as they are
REPO = "repo"  # the workspace's folder in the workdir
MAX_CHANGED_FILE_BYTES = 1024 * 1024  # a bigger changed file is listed in `skipped`, not returned
MAX_CHANGES_BYTES = 16 * 1024 * 1024  # beyond this in all, the rest is listed in `skipped`


@dataclass
class Command:
    """In `argv`, `env` values and `files`, `{field}` is replaced by the task's field, `{python}` by this interpreter, `{bin}` by
    its folder, `{workdir}`, `{repo}`, `{openai_base_url}` and `{anthropic_base_url}` by the run's own, e.g.
    `Command(["{python}", "-m", "polar_lab.harness.calc_cli", "{question}"])`."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # workdir-relative path → content, written first
    workspace: str | None = None  # task field holding a repository (path → text) to start in; see the module doc
    sandbox: str | None = None  # "isolated" | "process"; None: the Lab's (HarnessConfig.sandbox)
    isolated_only: bool = False  # refuse to run at any level but "isolated" (a program with its own guards off)
    readonly: list[str] = field(default_factory=list)  # paths the program needs (its install), read-only
    memory_mb: int = 4096  # RLIMIT_AS, and a memory cgroup where one can be made
    address_mb: int | None = None  # RLIMIT_AS instead, where the program reserves more address space than memory
    cpu_seconds: int = 600  # RLIMIT_CPU
    file_mb: int = 512  # RLIMIT_FSIZE
    open_files: int = 4096  # RLIMIT_NOFILE
    disk_mb: int = 2048  # the workdir's disk use; past it the run is killed
    disk_files: int = 200_000  # entries in the workdir; past it too
    processes: int = 512  # tasks (processes and threads): a pids cgroup where possible, else RLIMIT_NPROC
    keep_workdir: bool = False
    enforce_limits: bool = True  # False: run without prlimit where the machine has none (an explicit opt-out)
    final_field: str | None = None  # the final answer is this field of the JSON object stdout ends with
    name: str = "command"

    @property
    def __name__(self) -> str:  # rollouts name sessions after their harness
        return self.name

    @property
    def limits(self) -> sandbox.Limits:
        return sandbox.Limits(memory_mb=self.memory_mb, address_mb=self.address_mb, cpu_seconds=self.cpu_seconds,
                              file_mb=self.file_mb,
                              open_files=self.open_files, disk_mb=self.disk_mb, disk_files=self.disk_files,
                              processes=self.processes,
                              enforce=self.enforce_limits)

    async def __call__(self, session: Session, task: dict[str, Any]) -> dict[str, Any]:
        if self.isolated_only and sandbox.resolve(self.sandbox) != "isolated":
            raise SandboxError(f"{self.name} runs with its own sandbox or permission checks off and must run in "
                               f"the isolated sandbox, which this Lab does not use here (sandbox='process', or "
                               f"sandbox_fallback=True on a machine without bubblewrap)")
        with sandbox.workdir(prefix=f"polar-{self.name}-", keep=True) as workdir:
            try:
                return await self._run(session, task, workdir)
            finally:
                if not self.keep_workdir:  # a tree the program made may be big or odd: off the Lab's loop
                    await asyncio.shield(asyncio.to_thread(files.remove_tree, workdir))

    async def _run(self, session: Session, task: dict[str, Any], workdir: str) -> dict[str, Any]:
        repo = os.path.join(workdir, REPO)
        # isolated, the program sees its workdir at a fixed path: its prompts (an agent names its cwd) are the same
        # run after run, which a replay of the run needs (polar_lab/replay.py); the host's folder stays unique
        seen = f"/tmp/polar-{self.name}" if sandbox.resolve(self.sandbox) == "isolated" else workdir
        values = {"python": sys.executable, "bin": os.path.dirname(sys.executable), "workdir": seen,
                  "repo": os.path.join(seen, REPO),
                  "openai_base_url": session.openai_base_url, "anthropic_base_url": session.anthropic_base_url,
                  **task}

        def fill(text: str) -> str:
            return _PLACEHOLDER.sub(lambda m: str(values.get(m[1], m[0])), text)

        sandbox.write_files(workdir, {path: fill(text) for path, text in self.files.items()})  # e.g. Codex's config
        pristine = dict(task[self.workspace]) if self.workspace else {}
        if self.workspace:
            os.makedirs(repo, exist_ok=True)
            sandbox.write_files(repo, pristine)
        argv = [fill(a) for a in self.argv]
        env = sandbox.environment(seen, {**session.env(), **{k: fill(v) for k, v in self.env.items()}})
        if self.workspace:  # the repository's tests run with this interpreter's packages (pytest), as its grader does
            env["PATH"] = values["bin"] + os.pathsep + env.get("PATH", os.defpath)
        proxy = sandbox.Proxy.from_url(session.base_url, session.proxy_socket) if session.proxy_socket else None
        box = sandbox.Sandbox(argv, workdir=workdir, env=env, limits=self.limits, level=self.sandbox,
                              readonly=tuple(self.readonly), proxy=proxy, cwd=repo if self.workspace else None,
                              inside=seen if seen != workdir else None)
        outcome = await box.start().wait_async()
        result = {"returncode": outcome.returncode, "stdout": outcome.stdout, "stderr": outcome.stderr,
                  "workdir": workdir, "pids_peak": outcome.pids_peak, "sandbox": outcome.level}
        said = (outcome.stderr.strip() or outcome.stdout.strip())[-500:]  # some agents report on stdout
        if outcome.reason is not None:
            raise HarnessError(f"{argv[0]} was killed: it exceeded its {outcome.reason} limit. {said}",
                               output=outcome.stdout + outcome.stderr, limit=outcome.reason)
        if outcome.returncode != 0:
            raise HarnessError(f"{argv[0]} exited {outcome.returncode}: {said}", output=outcome.stdout + outcome.stderr)
        if self.workspace:  # a walk of a tree the program made (within its limits): off the Lab's loop
            result["changes"], result["skipped"] = await asyncio.to_thread(changes, repo, pristine, self.disk_files)
        result["final"] = final_answer(outcome.stdout, self.final_field)
        return result


def final_answer(stdout: str, field_name: str | None = None) -> str:
    """A program's final answer: its last line of output, or `field_name` of the JSON object it printed last (a
    CLI's machine-readable output; its last line where that is not there).

    >>> final_answer("working\\nThe answer is 5.\\n"), final_answer('{"result": "It is 5."}', "result")
    ('The answer is 5.', 'It is 5.')
    """
    lines = stdout.strip().splitlines()
    if field_name is not None:
        for line in reversed(lines):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict) and isinstance(value.get(field_name), str):
                return value[field_name]
    return lines[-1] if lines else ""


def changes(repo: str | Path, pristine: dict[str, str], max_entries: int = 200_000
            ) -> tuple[dict[str, str | None], list[str]]:
    """What a program did to its workspace: {path: new text, or None where it deleted a task file}, and the
    paths left out: links (never followed — the kernel reads this as root, and a link could point at anything
    it can read), anything not a regular file, binary files, files past the size bounds, folders nested past
    the walk's depth. A workspace the program replaced by a link or a file counts as all deleted.

    >>> import tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as where:
    ...     root = pathlib.Path(where)
    ...     _ = (root / "a.py").write_text("x = 2\\n"); _ = (root / "new.txt").write_text("hi")
    ...     changes(root, {"a.py": "x = 1\\n", "b.py": "y = 1\\n"})
    ({'a.py': 'x = 2\\n', 'new.txt': 'hi', 'b.py': None}, [])
    """
    found: dict[str, str | None] = {}
    skipped, present, deep, total = [], set(), [], 0
    for relative, info, folder, name in files.walk(repo, max_entries=max_entries, too_deep=deep):
        if stat.S_ISDIR(info.st_mode):
            continue
        data = files.read_regular(folder, name, MAX_CHANGED_FILE_BYTES) if stat.S_ISREG(info.st_mode) else None
        try:
            text = data.decode() if data is not None else None
        except UnicodeDecodeError:
            text = None
        if text is None:
            skipped.append(relative)
            continue
        present.add(relative)
        if pristine.get(relative) == text:
            continue
        if total + len(data) > MAX_CHANGES_BYTES:
            skipped.append(relative)
            continue
        found[relative] = text
        total += len(data)
    found.update({p: None for p in pristine if p not in present and p not in skipped})
    return found, sorted(skipped + deep)
