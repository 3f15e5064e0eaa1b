"""Policy.update on real rollouts: a second pass over the batch meets the clip, a reference model adds KL."""

from polar_lab.grpo import GRPOConfig, build_batch
from polar_lab.grpo.policy import Policy

from .conftest import rollout


def test_a_second_pass_over_the_batch_clips_and_the_reference_model_adds_kl(lab, model_path, train_tasks):
    config = GRPOConfig(num_iterations=2, learning_rate=1e-2, beta=0.1, epsilon=0.05, epsilon_high=0.05)
    batch = build_batch(rollout(lab, train_tasks[:4]), config, lab.policy_version)
    assert batch.samples, batch.stats
    policy = Policy(model_path, config)
    assert policy.ref_model is not None
    first = policy.update(batch.samples)
    assert first.iterations == 2 and first.kl_sum == 0.0  # pass 1 starts at the reference: k3 is exactly 0
    assert first.metrics()["clip_frac"] > 0  # pass 2 runs after a step: ratios leave [1-ε, 1+ε]
    second = policy.update(batch.samples)
    assert second.kl_sum > 0 and second.metrics()["kl"] > 0  # the policy has moved away from the reference
    assert second.loss != second.pg_loss  # the KL term is in the loss (β > 0)
