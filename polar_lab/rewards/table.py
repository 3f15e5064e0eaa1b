"""Rewards as a table: one row per harness run (what reward plots and trainer.rewards show)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from polar_lab.types import Group

COLUMNS = ["step", "group", "task_id", "session_id", "reward", "status", "failure"]


def reward_rows(groups: list[Group], step: int = 0) -> list[dict[str, Any]]:
    """step, group index, task id, session id, reward (None = masked failure), status, failure cause — per run."""
    return [{"step": step, "group": g, "task_id": group.task.get("id", str(g)), "session_id": s.id,
             "reward": s.reward, "status": s.status, "failure": s.info.get("failure")}
            for g, group in enumerate(groups) for s in group.sessions]


def rewards_frame(groups_or_rows: list[Group] | list[dict[str, Any]], step: int = 0) -> pd.DataFrame:
    """The runs of a rollout (Groups) or accumulated rows, as a DataFrame with COLUMNS."""
    rows = groups_or_rows if groups_or_rows and isinstance(groups_or_rows[0], dict) else \
        reward_rows(groups_or_rows, step)
    return pd.DataFrame(rows, columns=COLUMNS)
