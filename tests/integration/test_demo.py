"""The README's first command: `polar-lab demo` runs end to end and writes its run folder (its own process and
engine, as a newcomer runs it; forked from the suite's forkserver, which the command inherits)."""

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_sessions_and_writes_a_summary():
    run = f"test-demo-{uuid.uuid4().hex[:8]}"
    try:
        out = subprocess.run([sys.executable, "-m", "polar_lab", "demo", "--sessions", "8", "--run-name", run],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        summary = json.loads((ROOT / "data" / "runs" / run / "summary.json").read_text())
        assert summary["sessions"] == 8 and summary["failed_sessions"] == 0
        assert summary["calls"] >= 8 and 0.0 <= summary["accuracy"] <= 1.0
        assert "tool_call_parse_rate" in out.stdout
    finally:
        shutil.rmtree(ROOT / "data" / "runs" / run, ignore_errors=True)
