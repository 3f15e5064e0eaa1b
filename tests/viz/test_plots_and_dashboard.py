"""Reward plots, training curves and the live dashboard, on real rollouts and a real (short) GRPO run."""

import threading
import time

import matplotlib
import pytest

matplotlib.use("Agg")

from polar_lab.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from polar_lab.tasks import load_tasks  # noqa: E402
from polar_lab.harness import calculator_agent  # noqa: E402
from polar_lab.viz import Dashboard, plot_rewards, plot_training, rewards_frame, zero_advantage_fraction  # noqa: E402


@pytest.fixture(scope="module")
def groups(lab):
    tasks = load_tasks("data/tasks/calc_train.jsonl")[:3]
    return lab.rollout(tasks, calculator_agent, num_generations=6, evaluator="final_answer", progress=False)


@pytest.fixture(scope="module")
def trained(lab, shipped_weights, tmp_path_factory):
    config = GRPOConfig(tasks_per_step=4, learning_rate=1e-3, output_dir=str(tmp_path_factory.mktemp("viz")))
    with GRPOTrainer(lab, config) as trainer:
        trainer.train(2, progress=False)
    lab.sync_weights(shipped_weights)
    return trainer


def test_reward_strip_plot_shows_every_run_of_every_group(groups):
    fig = plot_rewards(groups)
    points = fig.axes[0].collections[0].get_offsets()
    assert len(points) == sum(len(g.sessions) for g in groups) == 18
    means = fig.axes[0].collections[1].get_offsets()
    assert sorted(round(float(y), 6) for _, y in means) == sorted(
        round(sum(s.reward for s in g.sessions) / len(g.sessions), 6) for g in groups)


def test_rewards_per_step_and_zero_advantage_fraction(trained):
    rewards = trained.rewards
    assert sorted(rewards["step"].unique()) == [1, 2] and len(rewards) == 2 * 4 * 8
    zero = zero_advantage_fraction(rewards)
    for step, row in trained.metrics.set_index("step").iterrows():
        assert zero[step] == pytest.approx(row["groups_zero_advantage"] / row["groups"])
    fig = plot_rewards(rewards)
    assert len(fig.axes) == 2 and fig.axes[1].get_title() == "zero-advantage groups"
    means = fig.axes[0].lines[0].get_ydata()
    assert list(means) == pytest.approx(list(trained.metrics["reward_mean"]))


def test_training_curves_plot_the_logged_metrics(trained):
    fig = plot_training(trained.metrics)
    reward_line = fig.axes[0].lines[0]
    assert list(reward_line.get_ydata()) == list(trained.metrics["reward_mean"])
    titles = [ax.get_title() for ax in fig.axes]
    assert {"reward", "loss", "clip fraction", "importance ratio π_old/μ", "staleness (versions)"} <= set(titles)


def test_rewards_frame_matches_the_groups(groups):
    frame = rewards_frame(groups, step=7)
    assert len(frame) == 18 and set(frame["step"]) == {7}
    assert frame["reward"].sum() == sum(s.reward for g in groups for s in g.sessions)


def test_dashboard_follows_a_background_rollout_and_a_sync(lab, shipped_weights):
    board = Dashboard(lab, interval=0.05)
    before = board.snapshot()
    tasks = load_tasks("data/tasks/calc_train.jsonl")[10:14]
    seen_running = []
    board.start()

    def watch():
        while not done.is_set():
            seen_running.append(board.snapshot()["sessions_running"])
            time.sleep(0.02)

    done = threading.Event()
    watcher = threading.Thread(target=watch)
    watcher.start()
    lab.rollout(tasks, calculator_agent, num_generations=8, evaluator="final_answer", progress=False)
    done.set()
    watcher.join()
    after = board.refresh()
    board.stop()
    board.redraw()
    assert max(seen_running) > 0  # it saw sessions in flight while the cell was busy
    assert after["sessions_finished"] - before["sessions_finished"] == 32
    assert after["calls"] > before["calls"]
    assert f"{after['sessions_finished']} finished" in board.table.value
    # the plots: the finished runs' rewards, one point per refresh in the time plots, the last trainer's curves
    training = lab.training()
    assert board.plotted["sessions"] == len(board.series) > 2 and "rewards: " in board.caption.value
    assert board.plotted["loss"] == len(training["history"][-30:])
    if not training["history"]:  # no trainer has used this Lab yet: every finished run's reward
        assert board.plotted["rewards"] >= 32
    assert max(s["tokens_per_s"] for s in board.series) > 0, list(board.series)[-5:]
    assert max(s["engine_busy"] for s in board.series) > 0, [s["engine_busy"] for s in board.series]
    assert bytes(board.image.value).startswith(b"\x89PNG") and len(board.image.value) > 10_000

    lab.run(lab.service.gate.pause(1.0))
    try:
        assert board.refresh()["proxy_state"] == "paused" and ">paused<" in board.table.value
    finally:
        lab.run(lab.service.gate.resume())
    assert board.refresh()["proxy_state"] == "serving"


def test_a_rerun_dashboard_replaces_the_first_and_stops_when_the_lab_closes(scripted_lab):
    first = scripted_lab.dashboard(interval=0.05)
    second = scripted_lab.dashboard(interval=0.05)  # the cell run again
    assert not first._thread.is_alive()  # one dashboard draws at a time
    time.sleep(0.3)
    assert len(second.series) > 1  # the new one refreshes in its thread
    scripted_lab.close()
    second._thread.join(timeout=5)
    assert not second._thread.is_alive()  # stopped with the Lab
