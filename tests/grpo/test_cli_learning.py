"""benchmarks/cli_learning.py's time budget (`--budget-s`): training stops before the step that would end past it,
its evaluation included, and each evaluation carries the seconds of training at which it was measured."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from cli_learning import train_within  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Trainer:
    """The two calls train_within makes: a step takes `step_s[i]` and an evaluation `eval_s` on the clock."""

    def __init__(self, clock: Clock, step_s: list[float], eval_s: float = 5):
        self.clock, self.step_s, self.eval_s, self.history = clock, step_s, eval_s, []

    def step(self, progress: bool) -> dict:
        self.clock.now += self.step_s[len(self.history)]
        self.history.append({})
        return {"step": len(self.history)}

    def evaluate(self, progress: bool) -> dict:
        self.clock.now += self.eval_s
        return {"eval_reward": len(self.history) / 100}


def test_training_stops_before_the_step_that_would_end_past_the_budget():
    clock = Clock()
    trainer = Trainer(clock, [10, 10, 20, 5, 10, 10])
    # the longest step so far decides: at 45 s step 4 starts (45 + 20 + its evaluation's 5 = 70), at 55 s step 5
    # does not (55 + 20 > 70), though the last step took 5 s
    curve, spent = train_within(trainer, steps=6, eval_every=2, budget_s=70, eval_s=5, clock=clock)
    assert len(trainer.history) == 4 and spent == 55
    assert curve == [{"step": 2, "eval_reward": 0.02, "s": 25}, {"step": 4, "eval_reward": 0.04, "s": 55}]


def test_a_step_whose_evaluation_would_end_past_the_budget_is_not_started():
    clock = Clock()
    trainer = Trainer(clock, [10] * 6, eval_s=30)
    # the evaluation before training took 30 s: step 2 (10 s, then evaluated) would end at 50 s
    curve, spent = train_within(trainer, steps=6, eval_every=2, budget_s=45, eval_s=30, clock=clock)
    assert len(trainer.history) == 1 and spent == 10 and curve == []


def test_without_a_budget_every_step_runs():
    clock = Clock()
    trainer = Trainer(clock, [30] * 6)
    curve, spent = train_within(trainer, steps=6, eval_every=4, budget_s=None, clock=clock)
    assert len(trainer.history) == 6 and spent == 185 and [c["step"] for c in curve] == [4]
