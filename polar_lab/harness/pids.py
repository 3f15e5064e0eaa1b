"""A process-count limit that holds for root too: one pids cgroup per harness run, owned by its Command.

RLIMIT_NPROC counts processes per user and is not enforced for root, so a fork bomb in a harness run as
root is bounded only by its deadline. A pids cgroup caps the run's processes and threads whoever runs
them, and it knows every descendant (even one that left the process group with setsid), so the run can be
cleaned up whole. Where no pids cgroup can be made (not root, a read-only /sys/fs/cgroup), `PidsCgroup.create`
returns None and the run keeps RLIMIT_NPROC only, which does hold for other users.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

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
    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls, max_pids: int) -> PidsCgroup | None:
        """A new cgroup that allows `max_pids` tasks, or None where this machine does not let us make one."""
        for parent in _parents():
            path = parent / f"polar-lab-{uuid.uuid4().hex[:12]}"
            try:
                path.mkdir()
            except OSError:
                continue
            try:
                (path / "pids.max").write_text(str(max_pids))
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
