"""The sandbox's levels, their fallback, and what a program's result may carry out of its workdir."""

import dataclasses
import json
import logging
import os
import sys
import tempfile

import pytest

from polar_lab import sandbox
from polar_lab.config import HarnessConfig
from polar_lab.errors import ConfigError, SandboxError
from polar_lab.harness.command import changes
from polar_lab.rewards.code import apply_changes
from polar_lab.sandbox import files, isolation
from polar_lab.sandbox.isolation import LEVELS


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


def test_without_bubblewrap_isolated_is_refused_with_the_way_out(no_bubblewrap):
    with pytest.raises(SandboxError, match="bubblewrap.*apt-get install bubblewrap.*sandbox_fallback=True"):
        sandbox.configure("isolated")
    with pytest.raises(SandboxError, match="bubblewrap"):  # and every run asking for it, not only the Lab
        sandbox.run(["true"], timeout=5)
    assert sandbox.run(["true"], timeout=5, level="process").returncode == 0  # asked for explicitly


def test_the_fallback_is_taken_only_when_allowed_and_said_once(no_bubblewrap, caplog):
    with caplog.at_level(logging.WARNING, logger="polar_lab.sandbox.isolation"):
        assert sandbox.configure("isolated", fallback=True) == "process"
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


@pytest.mark.skipif(sandbox.unavailable() is not None, reason="bubblewrap cannot run here")
def test_an_isolated_run_is_another_user_with_only_its_workdir_writable():
    probe = ("import os, json; print(json.dumps([os.getuid(), os.access('/usr', os.W_OK), "
             "os.path.exists(os.path.expanduser('~')), sorted(os.listdir('/tmp'))]))")
    outcome = sandbox.run([sys.executable, "-c", probe], timeout=30)
    uid, usr_writable, home_exists, tmp = json.loads(outcome.stdout)
    assert outcome.level == "isolated" and outcome.returncode == 0, outcome.stderr
    expected = isolation.pool() if os.geteuid() == 0 else [os.geteuid()]
    assert uid in expected and (os.geteuid() != 0 or uid != 0)
    assert not usr_writable and home_exists
    assert len(tmp) == 1 and tmp[0].startswith("polar-sandbox-")  # its workdir only, not the host's /tmp


def test_concurrent_isolated_runs_get_their_own_uids_and_give_them_back():
    if sandbox.unavailable() is not None or os.geteuid() != 0:
        pytest.skip("needs the isolated level run by root (its own uids)")
    boxes = []
    for _ in range(3):
        where = tempfile.mkdtemp()
        boxes.append(sandbox.Sandbox(["sh", "-c", "id -u; sleep 1"], workdir=where, env=sandbox.environment(where),
                                     level="isolated").start())
    uids = [int(box.wait(30).stdout) for box in boxes]
    assert len(set(uids)) == 3 and set(uids) <= set(isolation.pool()), uids
    assert isolation._state.leased == set()  # all given back


def test_a_run_does_not_have_the_kernels_session_keyring():
    """setpriv keeps the caller's session keyring, which every run would share (and may write): the launcher
    leaves it. A key the kernel adds to its session keyring is visible at "process" level (the control), not
    when isolated."""
    import ctypes
    import platform

    if platform.machine() != "x86_64" or sandbox.unavailable() is not None:
        pytest.skip("x86_64 syscall numbers, and the isolated level")
    libc = ctypes.CDLL(None, use_errno=True)
    name = f"polar-test-{os.getpid()}".encode()
    key = libc.syscall(248, b"user", name, b"secret", 6, -3)  # add_key(..., KEY_SPEC_SESSION_KEYRING)
    if key < 0:
        pytest.skip(f"cannot add a key here (errno {ctypes.get_errno()})")
    try:
        seen = {level: sandbox.run(["cat", "/proc/keys"], timeout=30, level=level).stdout for level in LEVELS}
        assert name.decode() in seen["process"] and name.decode() not in seen["isolated"]
    finally:
        libc.syscall(250, 3, key)  # keyctl(KEYCTL_REVOKE, key)


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
    assert 3 <= sandbox.disk_mb(tmp_path) < 3.1  # the link's /usr (gigabytes) is not counted
