"""GRPO fixtures on the shared real Lab. Tests that change the engine's weights put the shipped ones back."""

import pytest
import torch

from polar_lab.grpo.trainer import read_jsonl
from polar_lab.harness import calculator_agent


@pytest.fixture(scope="session")
def shipped_weights(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return {k: v.clone() for k, v in model.state_dict().items()}  # lm_head.weight included


@pytest.fixture
def restore_weights(lab, shipped_weights):
    """Yield; then load the shipped weights back into the live engine for the tests that follow."""
    yield
    lab.sync_weights(shipped_weights)


@pytest.fixture(scope="session")
def train_tasks():
    return read_jsonl("data/tasks/calc_train.jsonl")


def rollout(lab, tasks, n=8):
    """Real calculator runs through the proxy at T=1, scored by the final-answer evaluator."""
    return lab.rollout(tasks, calculator_agent, num_generations=n, evaluator="final_answer",
                       sampling={"temperature": 1.0, "max_tokens": 128}, progress=False)
