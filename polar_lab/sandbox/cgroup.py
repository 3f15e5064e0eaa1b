"""One sandboxed run's control groups: a task count and a memory ceiling that hold for root too, its CPU
time, and a list of every process the run made (even one that left its process group with setsid). Owned by the
`Sandbox` that made it; nothing else writes to it.

Both cgroup versions: v1 keeps each controller in its own hierarchy (/sys/fs/cgroup/pids/..., .../memory/...),
v2 one folder with every controller its parent delegates. A controller the machine does not let us use is
left out: pids missing means RLIMIT_NPROC instead (which does not hold for root), memory missing means only
RLIMIT_AS (allocations beyond it fail; nothing is killed).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")


def _own(hierarchy: str) -> str:
    """This process's cgroup path in a hierarchy (a controller's name for v1, "" for the v2 unified one)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == hierarchy or (hierarchy and hierarchy in controllers.split(",")):
            return path.lstrip("/")
    return ""


def _parents(controller: str) -> list[Path]:
    """Where a child cgroup with `controller` may be made: under our own cgroup, v1 first, then v2."""
    out = []
    if (_ROOT / controller).is_dir():
        out.append(_ROOT / controller / _own(controller))
    if (_ROOT / "cgroup.controllers").exists():
        out.append(_ROOT / _own(""))
    return out


def _make(controller: str, settings: dict[str, str]) -> Path | None:
    """A new child cgroup with `controller` configured by `settings` (file → value), or None."""
    for parent in _parents(controller):
        path = parent / f"polar-lab-{uuid.uuid4().hex[:12]}"
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            for name, value in settings.items():
                (path / name).write_text(value)
            return path
        except OSError:
            path.rmdir()
    return None


def _memory(limit: str, beside: Path | None) -> Path | None:
    """A memory cgroup with `limit` bytes: v1's own hierarchy, or on v2 the run's one folder (a process is in
    one v2 cgroup only, so memory goes where pids already is)."""
    v1 = _ROOT / "memory"
    if v1.is_dir():
        return _make("memory", {"memory.limit_in_bytes": limit})
    if beside is None:
        return _make("memory", {"memory.max": limit})
    try:
        (beside / "memory.max").write_text(limit)
        return beside
    except OSError:
        return None


class Cgroup:
    """The run's cgroups, one folder per controller we could make (the same folder twice on v2 is fine)."""

    def __init__(self, paths: dict[str, Path]):
        self.paths = paths  # controller → folder

    @classmethod
    def create(cls, *, max_pids: int | None, memory_mb: int | None) -> Cgroup | None:
        """Cgroups that allow `max_pids` tasks and `memory_mb` of memory (None: no limit, only the
        bookkeeping), or None where this machine lets us make none."""
        paths = {}
        pids = _make("pids", {"pids.max": "max" if max_pids is None else str(max_pids)})
        if pids is not None:
            paths["pids"] = pids
        if memory_mb is not None:
            memory = _memory(str(memory_mb * 1024 * 1024), beside=pids)
            if memory is not None:
                paths["memory"] = memory
        if (_ROOT / "cpuacct").is_dir():  # v1: CPU time has its own hierarchy; v2 keeps cpu.stat everywhere
            cpu = _make("cpuacct", {})
            if cpu is not None:
                paths["cpuacct"] = cpu
        elif pids is not None and (pids / "cpu.stat").exists():
            paths["cpuacct"] = pids
        return cls(paths) if paths else None

    def peak(self) -> int | None:
        """Most tasks the run had at once, where the kernel reports it."""
        try:
            return int((self.paths["pids"] / "pids.peak").read_text())
        except (KeyError, OSError, ValueError):
            return None

    def cpu_seconds(self) -> float | None:
        """CPU time the run's processes used, where the kernel counts it."""
        path = self.paths.get("cpuacct")
        if path is None:
            return None
        try:
            if (path / "cpuacct.usage").exists():
                return int((path / "cpuacct.usage").read_text()) / 1e9
            return _count(path, "cpu.stat", "usage_usec") / 1e6
        except (OSError, ValueError):
            return None

    def exceeded(self) -> str | None:
        """Which limit the run has hit: "processes" (a fork or thread was refused), "memory" (the kernel's
        out-of-memory killer struck inside the run), or None."""
        if _count(self.paths.get("pids"), "pids.events", "max"):
            return "processes"
        memory = self.paths.get("memory")
        if _count(memory, "memory.oom_control", "oom_kill") or _count(memory, "memory.events", "oom_kill"):
            return "memory"
        return None

    def pids(self) -> set[int]:
        """Every process in the run's cgroups."""
        found = set()
        for path in self.paths.values():
            try:
                found.update(int(p) for p in (path / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return found

    def kill(self) -> None:
        """SIGKILL every process in the cgroups (all of them descend from the run)."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self, timeout: float = 10.0) -> None:
        """Kill what is left and remove the cgroups."""
        deadline = time.monotonic() + timeout
        for path in dict.fromkeys(self.paths.values()):
            while True:
                self.kill()
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.002)  # its processes are still dying: a few ms
        self.paths = {}


def _count(folder: Path | None, name: str, key: str) -> int:
    """The counter `key` in a cgroup's "key value" lines file (0 where the file or key is missing)."""
    if folder is None:
        return 0
    try:
        lines = (folder / name).read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0
