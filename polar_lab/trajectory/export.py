"""Trajectories to pandas, Parquet and `datasets.Dataset`, and back, losslessly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pandas as pd

from polar_lab.types import Trajectory

_LISTS = ("token_ids", "loss_mask", "behavior_logprobs", "policy_versions", "call_ids")


def to_frame(trajectories: list[Trajectory]) -> pd.DataFrame:
    """One row per trajectory; list columns stay lists, `info` is JSON text (it is free-form)."""
    rows = []
    for t in trajectories:
        row = dataclasses.asdict(t)
        row["info"] = orjson.dumps(t.info).decode()
        rows.append(row)
    return pd.DataFrame(rows, columns=[f.name for f in dataclasses.fields(Trajectory)])


def from_frame(frame: pd.DataFrame) -> list[Trajectory]:
    out = []
    for row in frame.to_dict("records"):
        for name in _LISTS:
            row[name] = [x.item() if hasattr(x, "item") else x for x in row[name]]
        row["info"] = orjson.loads(row["info"]) if row["info"] else {}
        supports = row.get("sampling_support")  # absent from files written before it was a field
        row["sampling_support"] = [] if supports is None or not len(supports) else \
            [(int(s[0]), float(s[1]), float(s[2])) for s in supports]
        for name in ("temperature", "truncated"):  # files written before these were fields kept them in info
            if name not in row or pd.isna(row[name]):
                row[name] = row["info"].pop(name, Trajectory.__dataclass_fields__[name].default)
        if row["reward"] is not None and pd.isna(row["reward"]):
            row["reward"] = None
        out.append(Trajectory(**row))
    return out


def to_parquet(trajectories: list[Trajectory], path: str | Path) -> Path:
    path = Path(path)
    to_frame(trajectories).to_parquet(path, index=False)
    return path


def read_parquet(path: str | Path) -> list[Trajectory]:
    return from_frame(pd.read_parquet(path))


def to_dataset(trajectories: list[Trajectory]):
    """A Hugging Face `datasets.Dataset` with one row per trajectory."""
    import datasets

    return datasets.Dataset.from_pandas(to_frame(trajectories), preserve_index=False)


def from_dataset(dataset) -> list[Trajectory]:
    return from_frame(dataset.to_pandas())
