"""Running a load client (load_client.py, stream_client.py) as a process of its own, as harnesses are: the one
way the benchmarks do it."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run_client(script: str, url: str, concurrency: int, total: int, body: dict, *, keys: list[str] | None = None,
               args: list[str] | None = None, timeout_s: float = 1800.0) -> dict:
    """`script` (a file beside this one) against `url` with `body`; its JSON report. keys: one session key per
    request (the URL holds {key}), handed over in a file; args: the client's other options."""
    argv = [sys.executable, str(Path(__file__).with_name(script)), url, str(concurrency), str(total),
            json.dumps(body), *(args or [])]
    with tempfile.NamedTemporaryFile("w", suffix=".keys") as fh:
        if keys:
            fh.write("\n".join(keys))
            fh.flush()
            argv += ["--keys", fh.name]
        return json.loads(subprocess.run(argv, check=True, capture_output=True, text=True, timeout=timeout_s).stdout)
