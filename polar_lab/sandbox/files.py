"""Reading what a sandboxed program left, as the kernel (often root) must: without following a link it made,
without a path the kernel resolves by name, and with bounds. Stateless.

A program owns its workdir: it can leave `solution.py -> /etc/shadow`, replace a folder by a link to /proc,
nest folders past PATH_MAX or a thousand deep, or make a FIFO where a report should be. So every walk here
goes by file descriptor (`openat` with O_NOFOLLOW from the root down), reads only regular files through the
descriptor it checked, and stops at a depth and an entry count.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_DEPTH = 128  # folders deeper than this are not walked (`Usage.too_deep`)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class Usage:
    """What a tree takes: allocated MiB, entries (inodes), and whether it went past the walk's bounds."""

    mb: float = 0.0
    entries: int = 0
    too_deep: bool = False


def _names(fd: int) -> list[str]:
    """A folder's names, last first (they are popped: the walk goes in name order)."""
    with os.scandir(fd) as entries:
        return sorted((e.name for e in entries), reverse=True)


def walk(root: str | Path, *, max_entries: int | None = None,
         too_deep: list[str] | None = None) -> Iterator[tuple[str, os.stat_result, int, str]]:
    """Every entry under `root`, depth first: (relative path, its lstat, its folder's descriptor, its name).
    The descriptor is valid while the caller handles the entry. Nothing when `root` is not a real folder.
    Stops after `max_entries`; does not enter folders MAX_DEPTH deep (their paths go to `too_deep`). One
    descriptor is open per level of the current path (as in fts), each opened from its parent's."""
    try:
        top = os.open(root, _DIR_FLAGS)
        stack = [(top, _names(top), ())]  # (folder's descriptor, names left in it, its path parts)
    except OSError:
        return
    seen = 0
    try:
        while stack:
            fd, names, parts = stack[-1]
            if not names:
                os.close(fd)
                stack.pop()
                continue
            name = names.pop()
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:  # removed meanwhile
                continue
            relative = "/".join((*parts, name))
            yield relative, info, fd, name
            seen += 1
            if max_entries is not None and seen >= max_entries:
                return
            if not stat.S_ISDIR(info.st_mode):
                continue
            if len(parts) + 1 >= MAX_DEPTH:
                if too_deep is not None:
                    too_deep.append(relative)
                continue
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:  # replaced by something that is not a folder, or removed
                continue
            try:
                stack.append((child, _names(child), (*parts, name)))
            except OSError:
                os.close(child)
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def usage(root: str | Path, *, max_entries: int) -> Usage:
    """Allocated MiB and entries under `root` (links not followed); stops counting past `max_entries`."""
    found, deep = Usage(), []
    for _, info, _, _ in walk(root, max_entries=max_entries + 1, too_deep=deep):
        found.mb += info.st_blocks * 512 / (1024 * 1024)
        found.entries += 1
    found.too_deep = bool(deep)
    return found


def read_regular(dir_fd: int, name: str, limit: int) -> bytes | None:
    """The bytes of `name` in `dir_fd` when it is a regular file of at most `limit` bytes, else None (a link,
    a FIFO, a device, a folder, or too big). Opened without following links or blocking on a FIFO."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        return data if len(data) <= limit else None
    finally:
        os.close(fd)


def read_file(path: str | Path, limit: int) -> bytes | None:
    """`read_regular` for a path whose folder the kernel made (the last component may be the program's)."""
    path = Path(path)
    try:
        fd = os.open(path.parent, _DIR_FLAGS)
    except OSError:
        return None
    try:
        return read_regular(fd, path.name, limit)
    finally:
        os.close(fd)


def remove_tree(path: str | Path) -> None:
    """Remove a workdir whatever the program made of it: Python's rmtree first, then coreutils (its fts walk
    takes trees too deep for Python's recursion), after making every folder writable for its owner."""
    try:
        shutil.rmtree(path)
        return
    except FileNotFoundError:
        return
    except (OSError, RecursionError):
        pass
    subprocess.run(["chmod", "-R", "u+rwX", "--", str(path)], capture_output=True)
    subprocess.run(["rm", "-rf", "--", str(path)], capture_output=True)
