"""Task files: JSON lines, one task (a dict the harness and the evaluator read) per line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tasks(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` tasks (all by default) of a JSON-lines file; blank lines are skipped."""
    tasks = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return tasks[:limit]
