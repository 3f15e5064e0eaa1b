"""The sandbox's levels, their fallback, and what a program's result may carry out of its workdir."""

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import pytest

from polar_lab import sandbox
from polar_lab.config import HarnessConfig
from polar_lab.errors import ConfigError, SandboxError
from polar_lab.harness.command import changes
from polar_lab.rewards.code import apply_changes
from polar_lab.sandbox import isolation


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
    expected = isolation.user().uid if os.geteuid() == 0 else os.geteuid()
    assert uid == expected and (os.geteuid() != 0 or uid != 0)
    assert not usr_writable and home_exists
    assert len(tmp) == 1 and tmp[0].startswith("polar-sandbox-")  # its workdir only, not the host's /tmp


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
    found, skipped = changes(repo, {"solution.py": "def f(): pass\n"})
    assert found == {"kept.py": "x = 1\n"} and sorted(skipped) == ["linked-dir", "solution.py"]
    assert "kernel-only" not in repr(found)


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
    assert 3 <= sandbox.disk_mb(tmp_path) < 3.1
    assert Path("/usr").exists()
