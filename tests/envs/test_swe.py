"""SWE-bench / SWE-Gym rows → repository tasks (polar_lab/envs/swe.py), on the shipped set (data/swe: small
repositories built by scripts/build_swe_tasks.py, in SWE-bench's row format, each tree as an archive at its base
commit; a held-out split of 21 and a train split): on every held-out instance, and on three train instances, the gold
patch scores 1 and the base commit 0 under `repo_tests`, in the sandbox."""

import concurrent.futures
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from polar_lab.envs.swe import FIELDS, apply_patch, changes_of, convert, load_rows, to_task
from polar_lab.errors import LabError
from polar_lab.rewards import code
from polar_lab.tasks import load_tasks

ROWS, REPOS, TASKS = Path("data/swe/rows.jsonl"), Path("data/swe/repos"), Path("data/tasks/swe_mini.jsonl")
TRAIN_ROWS, TRAIN = Path("data/swe/rows_train.jsonl"), Path("data/tasks/swe_train.jsonl")


def test_the_shipped_rows_are_swe_bench_rows_and_the_shipped_tasks_are_their_conversion(tmp_path):
    rows = load_rows(ROWS)
    assert len(rows) >= 20 and len({r["instance_id"] for r in rows}) == len(rows)
    for row in rows:
        assert set(FIELDS) <= set(row)
        assert json.loads(row["FAIL_TO_PASS"]) and json.loads(row["PASS_TO_PASS"])  # JSON strings, as SWE-bench's
        assert row["patch"].startswith("diff --git") and row["test_patch"].startswith("diff --git")
    assert convert(ROWS, REPOS, tmp_path / "tasks.jsonl") == len(rows)
    assert load_tasks(tmp_path / "tasks.jsonl") == load_tasks(TASKS)  # what configs read is what the converter makes


def _score(task, changes):
    return code.repo_tests(task, {"changes": changes})["total"]


def test_on_every_instance_the_gold_patch_scores_1_and_the_base_commit_0():
    tasks = load_tasks(TASKS)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each run is a sandboxed pytest of its own
        gold = list(pool.map(lambda t: _score(t, changes_of(t["files"], t["reference_patch"])), tasks))
        base = list(pool.map(lambda t: _score(t, {}), tasks))
    assert gold == [1.0] * len(tasks), [t["id"] for t, g in zip(tasks, gold) if g != 1.0]
    assert base == [0.0] * len(tasks), [t["id"] for t, b in zip(tasks, base) if b != 0.0]


def _packages(tasks):
    return {path.split("/")[0] for t in tasks for path in t["files"] if path.endswith("/__init__.py")} - {"tests"}


def test_the_train_split_is_the_conversion_of_its_rows_and_shares_no_instance_or_package_with_the_held_out_one(
        tmp_path):
    train, held_out = load_rows(TRAIN_ROWS), load_rows(ROWS)
    assert len(train) >= 40 and len({r["instance_id"] for r in train}) == len(train)
    assert not {r["instance_id"] for r in train} & {r["instance_id"] for r in held_out}
    assert convert(TRAIN_ROWS, REPOS, tmp_path / "tasks.jsonl") == len(train)
    assert load_tasks(tmp_path / "tasks.jsonl") == load_tasks(TRAIN)
    train_packages, held_out_packages = _packages(load_tasks(TRAIN)), _packages(load_tasks(TASKS))
    assert len(train_packages) == len(train) and len(held_out_packages) == len(held_out)
    assert not train_packages & held_out_packages


def test_on_three_train_instances_the_gold_patch_scores_1_and_the_base_commit_0():
    tasks = load_tasks(TRAIN)
    sample = tasks[:: len(tasks) // 3][:3]  # the first, a third in, two thirds in (the build checks them all)
    gold = [_score(t, changes_of(t["files"], t["reference_patch"])) for t in sample]
    base = [_score(t, {}) for t in sample]
    assert (gold, base) == ([1.0] * 3, [0.0] * 3), [t["id"] for t in sample]


def test_a_task_holds_the_tests_the_grader_runs_and_not_the_fix():
    (row,) = [r for r in load_rows(ROWS) if r["instance_id"].endswith("rangekit-1")]
    task = to_task(row, REPOS)
    assert task["prompt"] == row["problem_statement"] and task["reference_patch"] == row["patch"]
    assert task["test_ids"] == json.loads(row["FAIL_TO_PASS"]) + json.loads(row["PASS_TO_PASS"])
    assert task["test_files"] == ["tests/test_clamp.py"]
    assert "def test_above_range" in task["files"]["tests/test_clamp.py"]  # the test patch is applied
    assert "min(lo, max(x, hi))" in task["files"]["rangekit/clamp.py"]  # the bug is still there
    # a harness that rewrites the test to pass scores 0: the grader puts the task's test back
    cheat = {"tests/test_clamp.py": "def test_above_range():\n    pass\n"}
    assert _score(task, cheat) == 0.0
    # only FAIL_TO_PASS + PASS_TO_PASS are graded, as SWE-bench's harness grades: a test of the file outside them
    # that fails either way (unrelated, flaky) does not fail the gold patch
    noisy = {**task, "files": {**task["files"], "tests/test_clamp.py": task["files"]["tests/test_clamp.py"]
                               + "\n\ndef test_unrelated():\n    assert False\n"}}
    assert _score(noisy, changes_of(noisy["files"], row["patch"])) == 1.0


def test_a_git_checkout_serves_as_the_archive_does(tmp_path):
    """A researcher's checkout `<repos>/<owner>__<name>` at the row's commit gives the same task as the archive."""
    (row,) = [r for r in load_rows(ROWS) if r["instance_id"].endswith("rangekit-1")]
    checkout = tmp_path / "polar-lab-swe__rangekit"
    checkout.mkdir()
    with tarfile.open(fileobj=io.BytesIO((REPOS / f"polar-lab-swe__rangekit-{row['base_commit']}.tar.gz")
                                          .read_bytes())) as tar:
        tar.extractall(checkout, filter="data")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        subprocess.run(["git", "-C", str(checkout), *args], check=True, env=env, capture_output=True)
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    from_checkout = to_task({**row, "base_commit": commit}, tmp_path)
    assert from_checkout["files"] == to_task(row, REPOS)["files"]
    with pytest.raises(LabError, match="does not hold commit"):
        to_task({**row, "base_commit": "0" * 40}, tmp_path)


def test_a_missing_repository_or_a_patch_that_does_not_apply_is_a_clear_error(tmp_path):
    row = load_rows(ROWS)[0]
    with pytest.raises(LabError, match="nothing is fetched"):
        to_task(row, tmp_path)
    with pytest.raises(LabError, match="does not apply"):
        apply_patch({"a.py": "x = 1\n"}, row["patch"])
    (tmp_path / "rows.jsonl").write_text(json.dumps({"instance_id": "x", "repo": "a/b"}) + "\n")
    with pytest.raises(LabError, match="missing base_commit"):
        load_rows(tmp_path / "rows.jsonl")
