"""Live weight sync: after a GRPO update and a sync, the engine samples from exactly the trainer's model."""

import torch

from polar_lab.grpo import GRPOConfig, build_batch
from polar_lab.grpo.batch import Sample
from polar_lab.grpo.policy import Policy
from polar_lab.types import SamplingSpec

from .conftest import rollout


def test_after_a_sync_engine_logprobs_equal_the_trainers(lab, model_path, train_tasks, restore_weights):
    config = GRPOConfig(learning_rate=1e-2)  # a large step, so a stale engine could not pass by accident
    policy = Policy(model_path, config)
    groups = rollout(lab, train_tasks[:4])
    batch = build_batch(groups, config, lab.policy_version)
    assert batch.samples, batch.stats
    policy.update(batch.samples)
    version = lab.policy_version
    sync = lab.sync_weights(policy.state_dict())
    assert sync.policy_version == version + 1 == lab.policy_version

    prompt = groups[0].trajectories[0].token_ids[:40]  # a fixed prompt from a real run
    # 32 tokens whatever the model would end on: three tokens once left the stale-engine check a 0.8e-2 margin
    gen = lab.engine.submit(prompt, SamplingSpec(max_tokens=32, temperature=0.7, seed=3, ignore_eos=True)).result()
    assert gen.output_versions == [version + 1] * len(gen.output_ids)  # every token says who sampled it
    sample = Sample(input_ids=torch.tensor(prompt + gen.output_ids), weights=torch.zeros(len(prompt) + len(gen.output_ids) - 1),
                    advantage=0.0, behavior_logprobs=torch.zeros(1), versions=torch.zeros(1), temperature=0.7)
    trainer = policy.logprobs([sample])[0][len(prompt) - 1:]
    diff = (trainer - torch.tensor(gen.output_logprobs)).abs()
    assert diff.max() < 1e-3, f"max |engine - trainer| {diff.max():.2e}"

    old = Policy(model_path, config).logprobs([sample])[0][len(prompt) - 1:]
    assert (old - torch.tensor(gen.output_logprobs)).abs().max() > 1e-2  # the update did change the policy


def test_recorded_calls_carry_the_version_that_sampled_them(lab, train_tasks, shipped_weights, restore_weights):
    before = rollout(lab, train_tasks[:1], n=2)
    lab.sync_weights(shipped_weights)
    after = rollout(lab, train_tasks[:1], n=2)
    v_before = {v for g in before for t in g.trajectories for v, m in zip(t.policy_versions, t.loss_mask) if m}
    v_after = {v for g in after for t in g.trajectories for v, m in zip(t.policy_versions, t.loss_mask) if m}
    assert v_after == {max(v_before) + 1}
