"""GRPO fixtures on the shared real Lab (the weight fixtures are in tests/conftest.py)."""

import pytest

from polar_lab.tasks import load_tasks
from polar_lab.harness import calculator_agent


@pytest.fixture(scope="session")
def train_tasks():
    return load_tasks("data/tasks/calc_train.jsonl")


def same_loss(two: float, one: float) -> bool:
    """Two ranks' loss against one rank's: within 1e-5 relative or 1e-6 absolute. The loss is a mean of ~±1 terms that
    nearly cancel (-3.2e-4 in one run, where two ranks were 1.7e-8 = 5.3e-5 relative apart), so its rounding is
    absolute; a rank that lost samples is off by the loss's own size."""
    return two == pytest.approx(one, rel=1e-5, abs=1e-6)


# The trainer's fp32 logprob of a token in a padded micro-batch against the same sample run alone: the matmuls'
# shapes differ, so the sums round differently. Mostly 0 apart; CI saw 1.3e-5 (14 ulps at |logprob| 8-16) on one
# token of a rollout at T=1 (this machine: ≤ 2.9e-6 in one probe). A token shifted by one is ≥ 8 off somewhere in
# every sample of that probe.
BATCHING_NOISE = 1e-4


def rollout(lab, tasks, n=8):
    """Real calculator runs through the proxy at T=1, scored by the final-answer evaluator."""
    return lab.rollout(tasks, calculator_agent, num_generations=n, evaluator="final_answer",
                       sampling={"temperature": 1.0, "max_tokens": 128}, progress=False)


@pytest.fixture
def replies_lab(model_path, tokenizer, tmp_path):
    """A Lab on a scripted engine answering REPLIES[seed % 7] (tests/grpo/scripted_runs.py): rollout logic, not the
    engine's."""
    from polar_lab import Lab
    from polar_lab.engine import ScriptedEngine
    from tests.grpo.scripted_runs import REPLIES

    engine = ScriptedEngine(tokenizer, REPLIES, model_path=model_path)
    with Lab(port=0, engine=engine, runs_dir=str(tmp_path), run_name="replies") as lab:
        yield lab
