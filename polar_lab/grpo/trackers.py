"""Experiment trackers: `GRPOConfig(report_to=...)`, TRL's name and values — "tensorboard", "wandb", "mlflow",
"trackio", a list of them, "all" (every one installed) or "none" (the default).

Each goes through its own library (the optional extra `.[trackers]`, which `make setup` installs), writes into the
trainer's output folder by default, and needs no network:

- tensorboard: `torch.utils.tensorboard.SummaryWriter` → `<output_dir>/tensorboard/` event files;
- mlflow: `MlflowClient` on `$MLFLOW_TRACKING_URI`, else a local file store `<output_dir>/mlruns` (MLflow 3 keeps
  that backend in maintenance mode behind `MLFLOW_ALLOW_FILE_STORE`, which is then set for this process; its usage
  telemetry is turned off with `MLFLOW_DISABLE_TELEMETRY` unless set otherwise);
- wandb: `wandb.init` in `<output_dir>`, offline unless `$WANDB_MODE` says otherwise (`wandb sync` uploads later);
- trackio: `trackio.init(project=...)`, its local database (under `$TRACKIO_DIR`).

Per step each gets every numeric metric, the step's rewards as a histogram, and a small table of sample runs
(task, reward, the decoded chain); each evaluation's `eval_*` figures; the config and a model card once. A tracker that fails to log
warns once and is dropped: a full disk or a dead tracking server never stops training.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from polar_lab.errors import ConfigError

log = logging.getLogger(__name__)
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
PROJECT = "polar_lab"


def resolve_report_to(report_to: str | list[str] | None) -> list[str]:
    """TRL's `report_to` as a list of tracker names ("all": the installed ones).

    >>> resolve_report_to("none"), resolve_report_to(["tensorboard", "mlflow"])
    ([], ['tensorboard', 'mlflow'])
    """
    if report_to in (None, "none", []):
        return []
    if report_to == "all":
        return [name for name in TRACKERS if _installed(name)]
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"report_to takes {list(TRACKERS)}, 'all' or 'none', got {unknown}")
    return names


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec({"tensorboard": "tensorboard"}.get(name, name)) is not None


class Trackers:
    """The trackers of one training run; `log` each step, `close` at the end."""

    def __init__(self, names: list[str], output_dir: Path, config: dict[str, Any], card: dict[str, Any]):
        self.trackers = []
        try:
            for name in names:
                try:
                    self.trackers.append(_MAKERS[name](output_dir, config, card))
                except ImportError as exc:
                    raise ConfigError(f"report_to={name!r} needs its library: pip install -e '.[trackers]' "
                                      f"({exc})") from exc
        except BaseException:
            self.close()  # the ones already started (a writer thread, an open run)
            raise

    def log(self, step: int, metrics: dict[str, Any], rewards: list[float], samples: list[dict[str, Any]]) -> None:
        numeric = {k: float(v) for k, v in metrics.items()  # "time" is a timestamp, each tracker keeps its own
                   if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("step", "time")}
        for tracker in list(self.trackers):
            try:
                tracker.log(step, numeric, rewards, samples)
            except Exception as exc:  # noqa: BLE001 - a tracker's failure must not stop training
                log.warning("report_to %s failed at step %d and is dropped: %r", tracker.name, step, exc)
                self.trackers.remove(tracker)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("report_to %s failed to close: %r", tracker.name, exc)
        self.trackers = []


def _table(samples: list[dict[str, Any]]) -> dict[str, list[Any]]:
    columns = ("task_id", "session_id", "reward", "text")
    return {c: [s.get(c) for s in samples] for c in columns}


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, output_dir: Path, config: dict[str, Any], card: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))
        self.writer.add_text("config", "```json\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)
        self.writer.add_text("model_card", _markdown(card), 0)

    def log(self, step, metrics, rewards, samples) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        if rewards:
            self.writer.add_histogram("reward", _array(rewards), step)
        if samples:
            rows = "\n".join(f"| {s['task_id']} | {s['reward']} | {_cell(s['text'])} |" for s in samples)
            self.writer.add_text("samples", "| task | reward | chain |\n|---|---|---|\n" + rows, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    name = "mlflow"

    def __init__(self, output_dir: Path, config: dict[str, Any], card: dict[str, Any]):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # MLflow 3 reports usage unless told not to
        from mlflow import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (output_dir / "mlruns").absolute().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's local store, opted into
        self.uri, self.client = uri, MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(PROJECT)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(PROJECT)
        self.run_id = self.client.create_run(experiment_id, run_name=output_dir.name).info.run_id
        self.client.log_dict(self.run_id, config, "config.json")
        self.client.log_dict(self.run_id, card, "model_card.json")

    def log(self, step, metrics, rewards, samples) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])
        if rewards:  # MLflow has no histogram: the distribution as a table per step
            self.client.log_table(self.run_id, {"reward": rewards}, f"rewards/step_{step}.json")
        if samples:
            self.client.log_table(self.run_id, _table(samples), f"samples/step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Wandb:
    name = "wandb"

    def __init__(self, output_dir: Path, config: dict[str, Any], card: dict[str, Any]):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=PROJECT, name=output_dir.name, dir=str(output_dir), config=config,
                              mode=os.environ.get("WANDB_MODE", "offline"), reinit="create_new")
        self.run.summary["model_card"] = card

    def log(self, step, metrics, rewards, samples) -> None:
        self.run.log(_with_media(self.wandb, metrics, rewards, samples), step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    name = "trackio"

    def __init__(self, output_dir: Path, config: dict[str, Any], card: dict[str, Any]):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=PROJECT, name=output_dir.name, config={**config, "model_card": card},
                                embed=False)

    def log(self, step, metrics, rewards, samples) -> None:  # this run's, not trackio's current one (another thread's)
        self.run.log(_with_media(self.trackio, metrics, rewards, samples), step=step)

    def close(self) -> None:
        self.run.finish()


def _with_media(library, metrics, rewards, samples) -> dict[str, Any]:
    """The step's data for wandb and trackio (trackio follows wandb's API): the rewards as a `Histogram`, the
    samples as a `Table`."""
    data: dict[str, Any] = dict(metrics)
    if rewards:
        data["reward"] = library.Histogram(rewards)
    if samples:
        table = _table(samples)
        data["samples"] = library.Table(columns=list(table), data=[list(r) for r in zip(*table.values())])
    return data


_MAKERS = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _Wandb, "trackio": _Trackio}


def _array(values: list[float]):
    import numpy as np

    return np.asarray(values, dtype=np.float64)


def _markdown(card: dict[str, Any]) -> str:
    return "\n".join(f"- **{k}**: {v}" for k, v in card.items())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ⏎ ")[:1500]


__all__ = ["TRACKERS", "Trackers", "resolve_report_to"]
