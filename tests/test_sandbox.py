"""The sandbox's levels, their fallback, and what a program's result may carry out of its workdir."""

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile

import pytest

from polar_lab import sandbox
from polar_lab.config import HarnessConfig
from polar_lab.errors import ConfigError, SandboxError
from polar_lab.harness.command import changes
from polar_lab.rewards.code import apply_changes
from polar_lab.sandbox import files, isolation


@pytest.fixture
def fresh_state(monkeypatch):
    """A process whose sandbox has not been configured or checked yet; the real state comes back after."""
    saved = dataclasses.replace(isolation._state)
    monkeypatch.setattr(isolation, "_state", isolation._State())
    yield
    isolation._state = saved


@pytest.fixture
def no_bubblewrap(fresh_state, monkeypatch):
    real = isolation.shutil.which
    monkeypatch.setattr(isolation.shutil, "which", lambda name: None if name == "bwrap" else real(name))


def test_without_bubblewrap_isolated_is_refused_when_a_program_is_about_to_run_with_the_way_out(no_bubblewrap,
                                                                                               caplog):
    with caplog.at_level(logging.DEBUG, logger="polar_lab.sandbox.isolation"):
        assert sandbox.configure("isolated") is None  # runs will be refused: known, and not said yet
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # nothing alarming before a program runs
    with pytest.raises(SandboxError, match="bubblewrap.*apt-get install bubblewrap.*sandbox_fallback=True"):
        sandbox.run(["true"], timeout=5)
    assert sandbox.run(["true"], timeout=5, level="process").returncode == 0  # asked for explicitly


def test_the_fallback_is_taken_only_when_allowed_and_said_once_when_a_program_runs(no_bubblewrap, caplog):
    with caplog.at_level(logging.WARNING, logger="polar_lab.sandbox.isolation"):
        assert sandbox.configure("isolated", fallback=True) == "process"
        assert not caplog.records  # said when a program runs, not when the level is set
        outcomes = [sandbox.run(["true"], timeout=5) for _ in range(3)]
    assert [o.level for o in outcomes] == ["process"] * 3
    said = [r for r in caplog.records if "cannot run here" in r.getMessage()]
    assert len(said) == 1 and "bubblewrap" in said[0].getMessage()


def test_levels_are_checked(fresh_state):
    with pytest.raises(SandboxError, match="'container'"):
        sandbox.configure("container")
    with pytest.raises(SandboxError, match="'container'"):
        sandbox.run(["true"], timeout=5, level="container")


@pytest.mark.parametrize("fields, message", [
    ({"sandbox": "docker"}, "'docker'"),
    ({"sandbox_uid": 0}, "not root's 0"),
])
def test_the_harness_config_is_validated(fields, message):
    with pytest.raises(ConfigError, match=message):
        HarnessConfig(**fields)


@pytest.mark.ci_required
@pytest.mark.skipif(sandbox.unavailable() is not None, reason="bubblewrap cannot run here")
def test_an_isolated_run_is_another_user_with_only_its_workdir_writable():
    with tempfile.NamedTemporaryFile(prefix="polar-marker-", dir="/tmp") as marker:  # in the host's /tmp
        probe = ("import os, json; print(json.dumps([os.getuid(), os.access('/usr', os.W_OK), "
                 "os.path.exists(os.path.expanduser('~')), sorted(os.listdir('/tmp'))]))")
        outcome = sandbox.run([sys.executable, "-c", probe], timeout=30)
        uid, usr_writable, home_exists, tmp = json.loads(outcome.stdout)
        assert os.path.basename(marker.name) in os.listdir("/tmp")
    assert outcome.level == "isolated" and outcome.returncode == 0, outcome.stderr
    expected = isolation.pool() if os.geteuid() == 0 else [os.geteuid()]
    assert uid in expected and (os.geteuid() != 0 or uid != 0)
    assert not usr_writable and home_exists
    # its /tmp holds its workdir (and, for a checkout under /tmp, the folders its venv is bound under): not the
    # host's files
    assert os.path.basename(marker.name) not in tmp and any(name.startswith("polar-sandbox-") for name in tmp)


@pytest.mark.ci_required
def test_concurrent_isolated_runs_get_their_own_uids_and_give_them_back():
    if sandbox.unavailable() is not None or os.geteuid() != 0:
        pytest.skip("needs the isolated level run by root (its own uids)")
    with contextlib.ExitStack() as stack:
        boxes = []
        for _ in range(3):
            where = stack.enter_context(sandbox.workdir())
            boxes.append(sandbox.Sandbox(["sh", "-c", "id -u; getent passwd $(id -u)"], workdir=where, level="isolated",
                                         env=sandbox.environment(where)).start())
        outs = [box.wait(30).stdout.split("\n") for box in boxes]
    uids = [int(out[0]) for out in outs]
    # each run's own uid is named in the passwd it sees (programs such as Node's os.userInfo() need it)
    assert all(out[1].startswith(f"sandbox:x:{uid}:{uid}:") for uid, out in zip(uids, outs)), outs
    assert len(set(uids)) == 3 and set(uids) <= set(isolation.pool()), uids
    assert isolation._state.leased == {}  # all given back


@pytest.mark.ci_required
def test_a_uid_a_run_of_another_kernel_holds_is_not_leased():
    """Two kernels on one machine: a run of one never gets the uid a run of the other holds (a lock file per uid);
    once that run ends (its process is gone), the uid is free again."""
    if sandbox.unavailable() is not None or os.geteuid() != 0:
        pytest.skip("needs the isolated level run by root (its own uids)")
    holder = subprocess.Popen([sys.executable, "-c", "import time\nfrom polar_lab.sandbox import isolation\n"
                               "print(isolation.lease().uid, flush=True)\ntime.sleep(120)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        theirs = int(holder.stdout.readline())
        assert theirs == isolation.pool()[0]  # the same pool: both kernels start at the first free uid
        mine = isolation.lease()
        isolation.release(mine)
        assert mine.uid != theirs
    finally:
        holder.kill()
        holder.wait()
    again = isolation.lease()  # the control: the holder is gone, and its lock with it
    isolation.release(again)
    assert again.uid == theirs


KEYRING_CALLS = ("import ctypes, errno, json\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                 "got = [libc.syscall(250, 0, -3, 0),"  # keyctl(GET_KEYRING_ID, the session keyring)
                 " libc.syscall(248, b'user', b'polar-note', b'the answer is 42', 16, -4)]\n"  # add_key(@u)
                 "print(json.dumps([got, ctypes.get_errno() == errno.ENOSYS]))\n")


@pytest.mark.ci_required
def test_an_isolated_run_cannot_use_kernel_keyrings():
    """Keyrings outlive a run (its uid's) or are shared by all (the kernel's session keyring): the seccomp
    filter refuses every keyring call with ENOSYS. The control: at "process" level the read-only call works."""
    import platform

    if platform.machine() != "x86_64" or sandbox.unavailable() is not None:
        pytest.skip("x86_64 syscall numbers, and the isolated level")
    isolated = sandbox.run([sys.executable, "-c", KEYRING_CALLS], timeout=30)
    (session, added), enosys = json.loads(isolated.stdout)
    assert session == added == -1 and enosys, isolated.stdout
    control = sandbox.run([sys.executable, "-c", "import ctypes\n"
                           "print(ctypes.CDLL(None).syscall(250, 0, -3, 0))"], timeout=30, level="process")
    assert int(control.stdout) > 0


def test_the_keyring_filter_is_the_program_its_comments_say():
    """Ten classic-BPF instructions; the jumps land where the comments say (a wrong offset would allow a
    keyring call or refuse everything)."""
    import struct

    from polar_lab.sandbox.seccomp import keyring_filter

    ops = [struct.unpack("HBBI", keyring_filter("x86_64")[i:i + 8]) for i in range(0, 80, 8)]
    refuse, allow = ops[8], ops[9]
    assert refuse[0] == allow[0] == 0x06 and refuse[3] == 0x00050000 | 38 and allow[3] == 0x7FFF0000
    targets = {i: (i + 1 + jt, i + 1 + jf) for i, (code, jt, jf, _) in enumerate(ops) if code in (0x15, 0x35)}
    assert targets == {1: (3, 2), 4: (8, 5), 5: (8, 6), 6: (8, 7), 7: (8, 9)}
    assert [ops[i][3] for i in (5, 6, 7)] == [248, 249, 250]


def test_what_a_program_leaves_running_is_killed_when_it_exits_even_without_cgroups(monkeypatch):
    """A program that exits 0 with a child still running in its process group: the group is killed before the
    program is reaped (a zombie leader still owns the group id), with no cgroup to fall back on."""
    import time

    from tests.conftest import running

    monkeypatch.setattr(sandbox, "Cgroup", type("NoCgroup", (), {"create": staticmethod(lambda **_: None)}))
    outcome = sandbox.run(["sh", "-c", "sleep 600 & echo $!"], timeout=30, level="process")
    leftover = int(outcome.stdout)
    deadline = time.monotonic() + 5
    while running(leftover) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert outcome.returncode == 0 and not running(leftover)


def test_a_link_in_the_workspace_is_never_followed(tmp_path):
    """A program could leave solution.py -> /etc/shadow (or the run's calls.jsonl); its result must not
    carry what the kernel can read."""
    secret = tmp_path / "secret.txt"
    secret.write_text("kernel-only")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "solution.py").symlink_to(secret)
    (repo / "linked-dir").symlink_to(tmp_path)
    (repo / "kept.py").write_text("x = 1\n")
    os.mkfifo(repo / "report.xml")  # reading a FIFO would block the kernel forever
    found, skipped = changes(repo, {"solution.py": "def f(): pass\n"})
    assert found == {"kept.py": "x = 1\n"} and skipped == ["linked-dir", "report.xml", "solution.py"]
    assert "kernel-only" not in repr(found)


def test_a_workspace_replaced_by_a_link_counts_as_deleted_and_is_not_read(tmp_path):
    secret_dir = tmp_path / "kernel"
    secret_dir.mkdir()
    (secret_dir / "calc.py").write_text("kernel-only")
    (tmp_path / "repo").symlink_to(secret_dir)  # the program ran `mv repo x; ln -s /somewhere repo`
    found, skipped = changes(tmp_path / "repo", {"calc.py": "def add(): pass\n"})
    assert found == {"calc.py": None} and skipped == []


def test_a_tree_past_the_walks_bounds_is_seen_and_still_removed(tmp_path):
    """Folders nested far past PATH_MAX and past Python's recursion limit: the usage walk says so (the run
    is killed for "disk"), and the workdir is still removed."""
    root = tmp_path / "work"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY)
    for _ in range(1200):  # 1200 levels of 40-character names: ~49,000 characters of path
        os.mkdir("d" * 40, dir_fd=fd)
        child = os.open("d" * 40, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)
    used = files.usage(root, max_entries=10_000)
    assert used.too_deep and used.entries == files.MAX_DEPTH
    files.remove_tree(root)
    assert not root.exists()


def test_many_empty_files_count_against_the_entry_limit(tmp_path):
    for i in range(300):
        (tmp_path / f"f{i}").touch()
    assert files.usage(tmp_path, max_entries=100).entries == 101  # it stops one past the limit


@pytest.mark.parametrize("path, applied", [
    ("pkg/core.py", True),  # an ordinary source file
    ("/etc/passwd", False),  # absolute
    ("../outside.py", False),  # leaves the repository
    ("pkg/../core.py", False),  # not a plain path
    ("test_core.py", False),  # a test
    ("tests/helpers.py", False),  # anything under tests/
    ("pkg/conftest.py", False),  # changes how tests run
    ("pytest.ini", False),
    ("evil.pth", False),
    (".pytest.ini", False),  # pytest reads it too
    ("pytest.toml", False),
    ("pytest.py", False),  # would shadow pytest itself
    ("_pytest/main.py", False),
    ("pkg/core.py/x", False),  # a file where a folder would have to be (once an evaluator error: a masked run)
    ("pkg", False),  # a folder's name as a file
])
def test_which_changes_the_evaluator_applies(path, applied):
    files, refused = apply_changes({"pkg/core.py": "old"}, {path: "new"})
    assert (files.get(path) == "new") is applied and (path in refused) is not applied


def test_editable_globs_narrow_the_changes():
    files, refused = apply_changes({"a.py": "", "b.py": ""}, {"a.py": "1", "b.py": "2", "c.py": "3"},
                                   editable=["a.py", "c*.py"])
    assert files == {"a.py": "1", "b.py": "", "c.py": "3"} and refused == ["b.py"]


def test_disk_use_counts_allocated_blocks_without_following_links(tmp_path):
    (tmp_path / "data").write_bytes(b"x" * 3 * 2**20)
    (tmp_path / "link").symlink_to("/usr")
    assert 3 <= files.usage(tmp_path, max_entries=100).mb < 3.1  # the link's /usr (gigabytes) is not counted
