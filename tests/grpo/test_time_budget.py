"""The time budget of `GRPOTrainer.train` (`time_budget_s`, `polar-lab train --time-budget-s`,
benchmarks/cli_learning.py --budget-s): training stops before the step that would end past it, its evaluation
included, and the benchmark's curve carries the seconds of training behind each point. On a fake clock and trainer:
the loop is what is tested, not GRPO."""

import json
import math
import sys
import types
from pathlib import Path

import pandas as pd
import pytest

from polar_lab import cli
from polar_lab.errors import ConfigError
from polar_lab.grpo.config import GRPOConfig
from polar_lab.grpo.run import format_train_summary, step_figures
from polar_lab.grpo.trainer import GRPOTrainer, train_steps


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Trainer:
    """What train() drives: a step takes `step_s[i]` on the clock and an evaluation `eval_s`; `evaluations` starts
    with the one before training, which took `before_s`."""

    def __init__(self, clock: Clock, step_s: list[float], eval_s: float = 5, before_s: float | None = None,
                 **config):
        self.clock, self.step_s, self.eval_s, self.history, self.saved = clock, step_s, eval_s, [], []
        self.config = types.SimpleNamespace(**{"eval_steps": 0, "save_steps": 0, "time_budget_s": None,
                                               "max_steps": len(step_s), **config})
        self.evaluations = [] if before_s is None else [{"step": 0, "eval_s": before_s}]

    def step(self, progress: bool) -> dict:
        self.clock.now += self.step_s[len(self.history)]
        self.history.append({})
        return {"step": len(self.history), "reward_mean": 0.0, "policy_version": len(self.history)}

    def evaluate(self, progress: bool) -> dict:
        self.clock.now += self.eval_s
        self.evaluations.append({"step": len(self.history), "eval_s": self.eval_s})
        return self.evaluations[-1]

    def save_checkpoint(self) -> None:
        self.saved.append(len(self.history))

    metrics = property(lambda self: self.history)


def test_training_stops_before_the_step_that_would_end_past_the_budget():
    clock = Clock()
    trainer = Trainer(clock, [10, 10, 20, 5, 10, 10], eval_steps=2, before_s=5)
    # the longest step so far decides: at 45 s step 4 starts (45 + 20 + its evaluation's 5 = 70), at 55 s step 5
    # does not (55 + 20 > 70), though the last step took 5 s
    spent = train_steps(trainer, 6, time_budget_s=70, progress=False, clock=clock)
    assert len(trainer.history) == 4 and spent == 55 and [e["step"] for e in trainer.evaluations] == [0, 2, 4]


def test_a_step_whose_evaluation_would_end_past_the_budget_is_not_started():
    clock = Clock()
    trainer = Trainer(clock, [10] * 6, eval_s=30, eval_steps=2, before_s=30)
    # the evaluation before training took 30 s: step 2 (10 s, then evaluated) would end at 50 s
    spent = train_steps(trainer, 6, time_budget_s=45, progress=False, clock=clock)
    assert len(trainer.history) == 1 and spent == 10 and len(trainer.evaluations) == 1


def test_without_a_budget_every_step_runs_and_checkpoints_on_their_cadence():
    clock = Clock()
    trainer = Trainer(clock, [30] * 6, eval_steps=4, save_steps=3)
    spent = train_steps(trainer, 6, progress=False, clock=clock)
    assert len(trainer.history) == 6 and spent == 185
    assert [e["step"] for e in trainer.evaluations] == [4] and trainer.saved == [3, 6]


def test_train_takes_the_configs_budget_unless_given_one(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("polar_lab.grpo.trainer.time.perf_counter", clock)
    trainer = Trainer(clock, [10] * 12, time_budget_s=35)
    GRPOTrainer.train(trainer, progress=False)
    assert len(trainer.history) == 3 and trainer.saved == [3]  # 30 + 10 > 35; the last checkpoint all the same
    GRPOTrainer.train(trainer, 5, time_budget_s=15, progress=False)  # its own budget: 10 + 10 > 15
    assert len(trainer.history) == 4 and trainer.saved == [3, 4]
    GRPOTrainer.train(trainer, 5, time_budget_s=math.inf, progress=False)  # none
    assert len(trainer.history) == 9


def test_the_budget_is_a_config_field_the_cli_sets_and_the_summary_reports(tmp_path, monkeypatch):
    assert GRPOConfig.from_dict({"time_budget_s": 1200}).time_budget_s == 1200
    with pytest.raises(ConfigError, match="time_budget_s must be > 0"):
        GRPOConfig.from_dict({"time_budget_s": 0})
    # `polar-lab train --time-budget-s`: S overrides the YAML's, 0 lifts it
    (tmp_path / "run.yaml").write_text("grpo: {time_budget_s: 1200}\n")
    seen = []
    monkeypatch.setattr("polar_lab.grpo.run.train_from_config", lambda lab, grpo: seen.append(grpo.time_budget_s))
    monkeypatch.setattr("polar_lab.grpo.run.format_train_summary", lambda summary: "")
    for flags in ([], ["--time-budget-s", "600"], ["--time-budget-s", "0"]):
        assert cli.main(["train", str(tmp_path / "run.yaml"), *flags]) == 0
    assert seen == [1200, 600, None]

    summary = {"run_dir": "r", "output_dir": "o", "steps": 25, "max_steps": 60, "time_budget_s": 1200.0,
               "async_mode": False, "world_size": 1, "train_s": 1140.0, "mean_step_s": 45.0,
               "mean_engine_busy_frac": 0.5, "reward_first_step": 0.1, "reward_last_step": 0.3, "before": None,
               "after": None}
    assert "time budget       1200 s: no time for step 26 of 60" in format_train_summary(summary)
    assert "time budget" not in format_train_summary({**summary, "steps": 60})
    no_step = {**summary, "steps": 0, **step_figures(pd.DataFrame())}
    assert json.loads(json.dumps(no_step))["mean_step_s"] is None  # summary.json stays strict JSON
    assert "train reward      (no step)" in format_train_summary(no_step)


def test_the_benchmarks_curve_carries_the_seconds_of_training_behind_each_point():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from cli_learning import learning_curve

    before = {"step": 0, "eval_reward": 0.1, "time": 1000.0}
    during = [{"step": 8, "eval_reward": 0.2, "time": 1300.4}, {"step": 16, "eval_reward": 0.3, "time": 1650.0}]
    after = {"step": 20, "eval_reward": 0.35, "time": 2100.0}  # after the checkpoint: its seconds are train_s
    curve = learning_curve(before, during, after, train_s=1180.2)
    assert [(c["step"], c["eval_reward"], c["s"]) for c in curve] == [(0, 0.1, 0), (8, 0.2, 300), (16, 0.3, 650),
                                                                      (20, 0.35, 1180)]
    assert learning_curve(before, during, during[-1], train_s=700)[-1] == {"step": 16, "eval_reward": 0.3, "s": 650}
