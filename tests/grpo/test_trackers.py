"""GRPOConfig(report_to=...): a 2-step run on the real engine logs to each tracker through its own library, and
each tracker's own reader reads the metrics back (tensorboard's event reader, mlflow.search_runs, wandb's offline
summary, trackio's local store)."""

import importlib.util
import json

import pytest

from polar_lab.errors import ConfigError
from polar_lab.grpo import GRPOConfig, GRPOTrainer
from polar_lab.grpo.trackers import TRACKERS, resolve_report_to
from polar_lab.viz import Dashboard

INSTALLED = [name for name in TRACKERS if importlib.util.find_spec(name) is not None]


@pytest.fixture(scope="module")
def two_steps(lab, tmp_path_factory, shipped_weights):
    """One 2-step run reporting to every tracker installed (the extra `.[trackers]`: all four here)."""
    if not INSTALLED:
        pytest.skip("no tracker installed (pip install -e '.[trackers]')")
    out = tmp_path_factory.mktemp("tracked")
    env = pytest.MonkeyPatch()
    env.setenv("TRACKIO_DIR", str(out / "trackio"))  # read when trackio is first imported
    env.setenv("WANDB_SILENT", "true")
    config = GRPOConfig(tasks_per_step=2, num_generations=4, learning_rate=1e-3, output_dir=str(out),
                        report_to=INSTALLED)
    board = Dashboard(lab, interval=3600)  # refreshed by hand below: what the live one plots of a trainer
    try:
        with GRPOTrainer(lab, config) as trainer:
            history = trainer.train(2, progress=False)
            board.redraw()
    finally:
        env.undo()
        lab.sync_weights(shipped_weights)
    return out, history, board.plotted


@pytest.mark.ci_required  # `make setup` installs the extra .[trackers]
def test_tensorboard_event_files_hold_every_step_and_the_reward_histogram(two_steps):
    if "tensorboard" not in INSTALLED:
        pytest.skip("tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, history, _ = two_steps
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0, "histograms": 0}).Reload()
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert loss == [(s, pytest.approx(v)) for s, v in zip(history["step"], history["loss"])]
    assert {"reward_mean", "policy_version", "engine_busy_frac"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Histograms("reward")] == [1, 2]
    assert "samples" in str(events.Tags()["tensors"]) and "config" in str(events.Tags()["tensors"])


@pytest.mark.ci_required  # `make setup` installs the extra .[trackers]
def test_mlflow_search_runs_reads_the_metrics_back(two_steps):
    if "mlflow" not in INSTALLED:
        pytest.skip("mlflow is not installed")
    import mlflow
    from mlflow import MlflowClient

    out, history, _ = two_steps
    uri = (out / "mlruns").absolute().as_uri()
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["polar_lab"])
    assert len(runs) == 1 and runs.loc[0, "metrics.loss"] == pytest.approx(history["loss"].iloc[-1])
    run_id = runs.loc[0, "run_id"]
    client = MlflowClient(tracking_uri=uri)
    assert [m.value for m in client.get_metric_history(run_id, "loss")] == pytest.approx(list(history["loss"]))
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.json", "model_card.json", "samples", "rewards"} <= artifacts


@pytest.mark.ci_required  # `make setup` installs the extra .[trackers]
def test_wandb_offline_and_trackio_keep_the_last_steps_metrics(two_steps):
    out, history, _ = two_steps
    if "wandb" in INSTALLED:  # wandb 0.31 has no offline reader (its core is Go): its run file and tables
        (records,) = list(out.glob("wandb/offline-run-*/run-*.wandb"))
        assert all(key.encode() in records.read_bytes() for key in ("loss", "reward_mean", "engine_busy_frac"))
        tables = sorted(out.glob("wandb/offline-run-*/files/media/table/samples_*.table.json"))
        assert len(tables) == 2  # one per step
        table = json.loads(tables[0].read_text())
        assert table["columns"] == ["task_id", "session_id", "reward", "text"] and table["data"]
    if "trackio" in INSTALLED:
        from trackio import SQLiteStorage

        logs = SQLiteStorage.get_logs("polar_lab", run=out.name)
        assert [row["loss"] for row in logs] == pytest.approx(list(history["loss"]))
    if not {"wandb", "trackio"} & set(INSTALLED):
        pytest.skip("neither wandb nor trackio is installed")


def test_report_to_takes_trls_values_and_refuses_others(monkeypatch):
    from polar_lab.grpo import trackers

    assert resolve_report_to("none") == [] and resolve_report_to("tensorboard") == ["tensorboard"]
    monkeypatch.setattr(trackers, "_installed", lambda name: name in ("mlflow", "trackio"))
    assert resolve_report_to("all") == ["mlflow", "trackio"]  # "all": the installed ones, in TRACKERS' order
    with pytest.raises(ConfigError, match="report_to takes"):
        GRPOConfig(report_to=["tensorboard", "comet"])


@pytest.mark.ci_required  # `make setup` installs the extra .[trackers]
def test_the_dashboard_plots_an_attached_trainers_curves_and_rewards_per_step(two_steps):
    _, history, plotted = two_steps
    assert plotted["loss"] == plotted["reward_mean"] == plotted["staleness"] == 2  # one point per step
    assert 0 < plotted["rewards"] <= 16  # the two steps' runs (2 tasks x 4), masked ones left out


def test_a_tracker_that_fails_is_dropped_and_the_others_go_on(caplog):
    from polar_lab.grpo.trackers import Trackers

    class Broken:
        name = "broken"

        def log(self, *args):
            raise OSError("disk full")

    class Kept:
        name, seen = "kept", []

        def log(self, step, metrics, rewards, samples):
            self.seen.append((step, metrics))

    trackers = Trackers([], None, {}, {})
    broken, kept = Broken(), Kept()
    trackers.trackers = [broken, kept]
    trackers.log(1, {"loss": 0.5, "time": 1e9, "flag": True}, [1.0], [])
    trackers.log(2, {"loss": 0.4}, [], [])
    assert trackers.trackers == [kept] and "broken failed at step 1" in caplog.text
    assert kept.seen == [(1, {"loss": 0.5}), (2, {"loss": 0.4})]  # numbers only; the timestamp is each tracker's
