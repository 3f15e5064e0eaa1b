"""The README's first command and its ten-line example, each as a newcomer runs it (its own process and engine,
forked from the suite's forkserver, which the process inherits): `polar-lab demo` runs end to end and writes its run
folder on a machine without bubblewrap, as a fresh one is, and prints nothing that looks like a failure."""

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


ALARMING = re.compile(r"error|warning|traceback|cannot|not installed|exception", re.IGNORECASE)


def _path_without(program: str, folder: Path) -> str:
    """A PATH with every program of this one but `program` (links in `folder`), as on a machine that lacks it."""
    folder.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        for entry in (Path(directory).iterdir() if Path(directory).is_dir() else ()):
            if entry.name != program and not os.path.lexists(folder / entry.name):
                (folder / entry.name).symlink_to(entry)
    return str(folder)


def test_demo_runs_sessions_and_writes_a_summary_and_alarms_no_one(tmp_path):
    run = f"test-demo-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PATH": _path_without("bwrap", tmp_path / "bin")}
    try:
        out = subprocess.run([sys.executable, "-m", "polar_lab", "demo", "--sessions", "8", "--run-name", run],
                             cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        alarming = [line for line in (out.stdout + out.stderr).splitlines() if ALARMING.search(line)]
        assert not alarming, alarming  # the demo runs no harness program: the missing sandbox is not its concern
        summary = json.loads((ROOT / "data" / "runs" / run / "summary.json").read_text())
        assert summary["sessions"] == 8 and summary["failed_sessions"] == 0
        assert summary["calls"] >= 8 and 0.0 <= summary["accuracy"] <= 1.0
        assert "tool_call_parse_rate" in out.stdout
    finally:
        shutil.rmtree(ROOT / "data" / "runs" / run, ignore_errors=True)


def test_the_readmes_ten_line_example_runs_as_printed(tmp_path):
    """The README's example, copied from the page and run as a user runs it: a fresh Python process (its own Lab and
    engine, forked from the suite's forkserver), the model by its relative path, the run folder under ./data/runs."""
    block = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL).group(1)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "models").symlink_to(ROOT / "data" / "models")
    out = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (tmp_path / "data" / "runs").iterdir()
    calls = [json.loads(line) for line in (run / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 1 and calls[0]["output_ids"] and "call_id" in out.stdout  # the printed calls table
