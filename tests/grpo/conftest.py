"""GRPO fixtures on the shared real Lab (the weight fixtures are in tests/conftest.py)."""

import pytest

from polar_lab.tasks import load_tasks
from polar_lab.harness import calculator_agent


@pytest.fixture(scope="session")
def train_tasks():
    return load_tasks("data/tasks/calc_train.jsonl")


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
