"""SWE-bench / SWE-Gym rows → polar_lab repository tasks (a `Command(workspace="files")` harness edits them,
`repo_tests` scores them). Stateless: functions of rows and files on disk.

A row has SWE-bench's fields: `instance_id`, `repo` ("owner/name"), `base_commit`, `problem_statement`, `patch`
(the gold fix, a unified diff), `test_patch` (the tests that check it), `FAIL_TO_PASS`, `PASS_TO_PASS` (pytest
node ids; lists, or JSON strings as SWE-bench ships them). The repository comes from disk, never the network:
a git checkout `<repos>/<owner>__<name>` that holds `base_commit`, or an archive of the tree at that commit,
`<repos>/<owner>__<name>-<base_commit>.tar.gz`.

The task is what SWE-bench's harness grades: the tree at `base_commit` with `test_patch` applied (so the tests
that must pass are there), the problem statement as the prompt, FAIL_TO_PASS + PASS_TO_PASS as the tests to run
(`test_ids`), the files `test_patch` touches as test files (re-copied from the task before grading: a harness
cannot pass by editing them), and the gold patch kept as `reference_patch`. Text files only (a binary file of
the tree is left out and listed in `swe["skipped"]`).

    python -m polar_lab.envs.swe ROWS.jsonl --repos DIR --out data/tasks/swe_gym.jsonl
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from polar_lab.errors import LabError
from polar_lab.sandbox import write_files

FIELDS = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch", "FAIL_TO_PASS",
          "PASS_TO_PASS")


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """SWE-bench rows from a JSON-lines file, each checked for the fields a task needs."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for row in rows:
        missing = [f for f in FIELDS if f not in row]
        if missing:
            raise LabError(f"SWE row {row.get('instance_id', '?')}: missing {', '.join(missing)}")
    return rows


def to_task(row: dict[str, Any], repos: str | Path) -> dict[str, Any]:
    """One row as a repository task (module docstring)."""
    base, skipped = base_files(row["repo"], row["base_commit"], repos)
    files = apply_patch(base, row["test_patch"])
    fail_to_pass, pass_to_pass = _ids(row["FAIL_TO_PASS"]), _ids(row["PASS_TO_PASS"])
    return {"id": row["instance_id"], "prompt": row["problem_statement"], "files": files,
            "test_files": sorted(patched_paths(row["test_patch"])), "test_ids": [*fail_to_pass, *pass_to_pass],
            "reference_patch": row["patch"],
            "swe": {"repo": row["repo"], "base_commit": row["base_commit"], "FAIL_TO_PASS": fail_to_pass,
                    "PASS_TO_PASS": pass_to_pass, "skipped": skipped}}


def convert(rows_path: str | Path, repos: str | Path, out: str | Path) -> int:
    """Every row of `rows_path` as a task line of `out`; the number written."""
    tasks = [to_task(row, repos) for row in load_rows(rows_path)]
    Path(out).write_text("".join(json.dumps(t, sort_keys=True) + "\n" for t in tasks))
    return len(tasks)


def base_files(repo: str, commit: str, repos: str | Path) -> tuple[dict[str, str], list[str]]:
    """The text files of `repo` at `commit`, from a checkout or an archive under `repos`; and the paths left out
    (not UTF-8 text)."""
    name = repo.replace("/", "__")
    archive, checkout = Path(repos) / f"{name}-{commit}.tar.gz", Path(repos) / name
    if archive.is_file():
        data = archive.read_bytes()
    elif (checkout / ".git").exists():
        done = subprocess.run(["git", "-C", str(checkout), "archive", "--format=tar", commit], capture_output=True)
        if done.returncode != 0:
            raise LabError(f"{checkout} does not hold commit {commit}: {done.stderr.decode(errors='replace')[:300]}")
        data = done.stdout
    else:
        raise LabError(f"no repository for {repo} at {commit}: put a checkout at {checkout} or an archive at {archive}"
                       f" (nothing is fetched)")
    files, skipped = {}, []
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            path = member.name.removeprefix("./")
            try:
                files[path] = tar.extractfile(member).read().decode()
            except UnicodeDecodeError:
                skipped.append(path)
    return files, sorted(skipped)


def apply_patch(files: dict[str, str], patch: str) -> dict[str, str]:
    """`files` with a unified diff applied (git's own `apply`, outside any repository): new, changed and deleted
    files. A patch that does not apply is an error naming the file."""
    if not patch.strip():
        return dict(files)
    with tempfile.TemporaryDirectory(prefix="polar-swe-") as where:
        write_files(where, files)
        done = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=where, input=patch.encode(),
                              capture_output=True)
        if done.returncode != 0:
            raise LabError(f"the patch does not apply: {done.stderr.decode(errors='replace').strip()[:300]}")
        out = {}
        for path in Path(where).rglob("*"):
            if path.is_file():
                out[str(path.relative_to(where))] = path.read_text()
    return out


def patched_paths(patch: str) -> set[str]:
    """The paths a unified diff leaves in place (its `+++ b/...` lines; a deleted file's `/dev/null` is not one)."""
    return {line[6:].strip() for line in patch.splitlines() if line.startswith("+++ b/")}


def changes_of(files: dict[str, str], patch: str) -> dict[str, str | None]:
    """What a patch does to `files`, as a harness's `changes` ({path: new text, None: deleted}): the gold patch
    scored like a harness's edit."""
    after = apply_patch(files, patch)
    out: dict[str, str | None] = {p: t for p, t in after.items() if files.get(p) != t}
    out.update({p: None for p in files if p not in after})
    return out


def _ids(value: str | list[str]) -> list[str]:
    return json.loads(value) if isinstance(value, str) else list(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m polar_lab.envs.swe", description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", help="SWE-bench / SWE-Gym rows, one JSON object a line")
    parser.add_argument("--repos", required=True, help="folder of checkouts (owner__name) or archives "
                                                       "(owner__name-<commit>.tar.gz)")
    parser.add_argument("--out", required=True, help="where the tasks go (JSON lines)")
    args = parser.parse_args(argv)
    print(f"{convert(args.rows, args.repos, args.out)} tasks written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
